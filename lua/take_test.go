package lua_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/lua"
)

// TestTake: the runner's lease. One SET NX PX GET takes it; the token is PostgreSQL's
// (the caller sets it); Renew and Release recognise the lease by its owner; a committed
// job's lease and counter go with one DEL (ReleaseCommitted).
func TestTake(t *testing.T) {
	ctx := context.Background()
	// takeAfterClaim: a Claim (the reconciler's or reparse's) of the job comes and goes,
	// leaving its counter, then worker w1/aa takes the job.
	takeAfterClaim := func(t *testing.T, l *lua.Leases, floor int64) (claimed, taken lua.Lease) {
		t.Helper()
		c, err := l.Claim(ctx, "job", "reconciler", time.Minute, floor)
		require.NoError(t, err)
		require.NoError(t, l.Release(ctx, c))
		a, err := l.Take(ctx, "job", "w1/aa", time.Minute)
		require.NoError(t, err)
		return c, a
	}
	runLeaseCases(t, []leaseCase{
		{"Exclusive", func(t *testing.T, env leaseEnv, l *lua.Leases) {
			a, err := l.Take(ctx, "job", "w1/aa", time.Minute)
			require.NoError(t, err)
			assert.Equal(t, int64(0), a.Token, "no token until PostgreSQL issues one")
			assert.Equal(t, "w1/aa", env.client.Get(ctx, l.Keys().Lease("job")).Val())
			_, err = l.Take(ctx, "job", "w2/bb", time.Minute)
			var held *lua.HeldError
			require.ErrorAs(t, err, &held)
			assert.Equal(t, "w1/aa", held.Holder)
			assert.Greater(t, held.Remaining, time.Duration(0))
			assert.LessOrEqual(t, held.Remaining, time.Minute)
			assert.Equal(t, "w1/aa", env.client.Get(ctx, l.Keys().Lease("job")).Val(), "a refused take writes nothing")
		}},
		{"RenewReleaseByOwner", func(t *testing.T, env leaseEnv, l *lua.Leases) {
			a, err := l.Take(ctx, "job", "w1/aa", time.Minute)
			require.NoError(t, err)
			a.Token = 42 // PostgreSQL's fence, set by the caller
			require.NoError(t, l.Renew(ctx, a, 2*time.Minute))
			assert.Greater(t, env.client.PTTL(ctx, l.Keys().Lease("job")).Val(), time.Minute)
			other := a
			other.Owner = "w1/ab"
			require.ErrorIs(t, l.Renew(ctx, other, time.Minute), lua.ErrNotOwner)
			require.ErrorIs(t, l.Release(ctx, other), lua.ErrNotOwner)
			require.NoError(t, l.Release(ctx, a))
			assert.Empty(t, scanPrefix(t, env.client, env.prefix))
			require.ErrorIs(t, l.Release(ctx, a), lua.ErrLeaseLost)
			require.ErrorIs(t, l.Renew(ctx, a, time.Minute), lua.ErrLeaseLost)
		}},
		{"ExpiredThenTakenByAnother", func(t *testing.T, env leaseEnv, l *lua.Leases) {
			a, err := l.Take(ctx, "job", "w1/aa", time.Minute)
			require.NoError(t, err)
			env.expire(t, l.Keys().Lease("job"))
			b, err := l.Take(ctx, "job", "w2/bb", time.Minute)
			require.NoError(t, err)
			require.ErrorIs(t, l.Renew(ctx, a, time.Minute), lua.ErrNotOwner)
			require.ErrorIs(t, l.Release(ctx, a), lua.ErrNotOwner)
			require.NoError(t, l.Renew(ctx, b, time.Minute), "the new holder keeps it")
		}},
		{"ReleaseDoneKeepsForeignCounter", func(t *testing.T, env leaseEnv, l *lua.Leases) {
			// A counter left by a Claim (the reconciler's or reparse's) is not the Take
			// lease's: a checked ReleaseDone leaves it, whatever number PostgreSQL gave.
			c, a := takeAfterClaim(t, l, 6)
			a.Token = c.Token
			require.NoError(t, l.ReleaseDone(ctx, a))
			assert.Equal(t, []string{l.Keys().Fence("job")}, scanPrefix(t, env.client, env.prefix))
		}},
		{"ReleaseCommittedLeavesNoKey", func(t *testing.T, env leaseEnv, l *lua.Leases) {
			_, a := takeAfterClaim(t, l, 0)
			require.NoError(t, l.ReleaseCommitted(ctx, a))
			assert.Empty(t, scanPrefix(t, env.client, env.prefix), "lease and counter both gone")
			// No owner check, on purpose (the job is complete: see ReleaseCommitted): a
			// lease taken by another since ours expired goes too.
			b, err := l.Take(ctx, "job", "w2/bb", time.Minute)
			require.NoError(t, err)
			require.NoError(t, l.ReleaseCommitted(ctx, a))
			require.ErrorIs(t, l.Release(ctx, b), lua.ErrLeaseLost)
		}},
		{"ReleaseCommittedMany", func(t *testing.T, env leaseEnv, l *lua.Leases) {
			var ls []lua.Lease
			for _, k := range []string{"a", "b", "c"} {
				x, err := l.Take(ctx, k, "w1/"+k, time.Minute)
				require.NoError(t, err)
				ls = append(ls, x)
			}
			// A counter an older worker or the reconciler left goes with the lease.
			require.NoError(t, env.client.Set(ctx, l.Keys().Fence("b"), "4", 0).Err())
			errs := l.ReleaseCommittedMany(ctx, append(ls, lua.Lease{}))
			require.Len(t, errs, 4)
			require.NoError(t, errs[0])
			require.NoError(t, errs[1])
			require.NoError(t, errs[2])
			require.Error(t, errs[3], "a lease without key is refused, the others go")
			assert.Empty(t, scanPrefix(t, env.client, env.prefix))
			assert.Empty(t, l.ReleaseCommittedMany(ctx, nil))
			cctx, cancel := context.WithCancel(ctx)
			cancel()
			for _, err := range l.ReleaseCommittedMany(cctx, ls) {
				assert.ErrorIs(t, err, context.Canceled)
			}
		}},
		{"ClaimAndTakeExcludeEachOther", func(t *testing.T, env leaseEnv, l *lua.Leases) {
			c, err := l.Claim(ctx, "job", "reconciler", time.Minute, 0)
			require.NoError(t, err)
			_, err = l.Take(ctx, "job", "w1/aa", time.Minute)
			var held *lua.HeldError
			require.ErrorAs(t, err, &held)
			assert.Equal(t, "reconciler", held.Holder, "the token prefix is not part of the holder")
			require.NoError(t, l.Release(ctx, c))

			_, err = l.Take(ctx, "job", "w1/aa", time.Minute)
			require.NoError(t, err)
			_, err = l.Claim(ctx, "job", "reconciler", time.Minute, 0)
			require.ErrorAs(t, err, &held)
			assert.Equal(t, "w1/aa", held.Holder)
		}},
		{"BadInput", func(t *testing.T, env leaseEnv, l *lua.Leases) {
			_, err := l.Take(ctx, "", "w", time.Minute)
			assert.ErrorContains(t, err, "empty job key")
			_, err = l.Take(ctx, "job", "", time.Minute)
			assert.ErrorContains(t, err, "empty owner")
			_, err = l.Take(ctx, "job", "w", 0)
			assert.ErrorContains(t, err, "below 1ms")
			assert.Error(t, l.ReleaseCommitted(ctx, lua.Lease{}))
			assert.Empty(t, scanPrefix(t, env.client, env.prefix))
		}},
	})
}

// TestTakeRollingDeploy: workers of the previous release claim "<token>:<owner>" leases
// with claim.lua (unchanged) and renew and release them with the scripts in
// testdata/stringlease; workers of this release Take. Neither renews or releases the
// other's lease, and each sees the other's as held. An older still HASH lease is held too.
func TestTakeRollingDeploy(t *testing.T) {
	ctx := context.Background()
	l, ns := realLeases(t)
	c := ns.Client
	load := func(name string) *redis.Script {
		src, err := os.ReadFile("testdata/stringlease/" + name)
		require.NoError(t, err)
		return redis.NewScript(string(src))
	}
	oldRenew, oldRelease := load("renew.lua"), load("release.lua")

	a, err := l.Take(ctx, "job", "new/aa", time.Minute)
	require.NoError(t, err)
	a.Token = 7
	// The old scripts compare "<token>:<owner>"; a Take lease holds the owner alone.
	for _, token := range []int64{0, 7} {
		n, err := oldRenew.Run(ctx, c, []string{l.Keys().Lease("job")}, "new/aa", token, 1000).Int64()
		require.NoError(t, err)
		assert.Equal(t, int64(-2), n)
		n, err = oldRelease.Run(ctx, c, []string{l.Keys().Lease("job"), l.Keys().Fence("job")}, "new/aa", token, "1").Int64()
		require.NoError(t, err)
		assert.Equal(t, int64(-2), n)
	}
	assert.Equal(t, "new/aa", c.Get(ctx, l.Keys().Lease("job")).Val())
	assert.Greater(t, c.PTTL(ctx, l.Keys().Lease("job")).Val(), 30*time.Second, "not shortened either")
	require.NoError(t, l.Renew(ctx, a, time.Minute))
	require.NoError(t, l.Release(ctx, a))

	// An old worker's lease (claim.lua is unchanged): held for Take; the old worker's own
	// scripts still renew and release it.
	old, err := l.Claim(ctx, "job", "old/bb", time.Minute, 0)
	require.NoError(t, err)
	_, err = l.Take(ctx, "job", "new/aa", time.Minute)
	require.ErrorIs(t, err, lua.ErrLeaseHeld)
	n, err := oldRenew.Run(ctx, c, []string{l.Keys().Lease("job")}, "old/bb", old.Token, 60000).Int64()
	require.NoError(t, err)
	assert.Equal(t, int64(1), n)
	n, err = oldRelease.Run(ctx, c, []string{l.Keys().Lease("job"), l.Keys().Fence("job")}, "old/bb", old.Token, "1").Int64()
	require.NoError(t, err)
	assert.Equal(t, int64(1), n)
	assert.Empty(t, scanPrefix(t, c, ns.Prefix))

	// A HASH lease of the release before that.
	_, err = newHashLeases(t, c, ns.Prefix).Claim(ctx, "legacy", "older/cc", time.Minute, 0)
	require.NoError(t, err)
	_, err = l.Take(ctx, "legacy", "new/aa", time.Minute)
	var held *lua.HeldError
	require.ErrorAs(t, err, &held)
	assert.Equal(t, "older/cc", held.Holder)
	assert.Greater(t, held.Remaining, time.Duration(0))
}
