package lua_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/lua"
)

// hashLeases runs the lease scripts of the version before the lease became a STRING
// (testdata/hashlease: claim.lua, renew.lua and release.lua as they were, a HASH {owner,
// token} per lease) with the keys and arguments that version's wrappers sent: a worker not
// yet upgraded during a rolling deploy.
type hashLeases struct {
	c                     *redis.Client
	keys                  lua.Keys
	claim, renew, release *redis.Script
}

func newHashLeases(t *testing.T, c *redis.Client, prefix string) *hashLeases {
	t.Helper()
	keys, err := lua.NewKeys(prefix)
	require.NoError(t, err)
	load := func(name string) *redis.Script {
		src, err := os.ReadFile("testdata/hashlease/" + name)
		require.NoError(t, err)
		return redis.NewScript(string(src))
	}
	return &hashLeases{c: c, keys: keys, claim: load("claim.lua"), renew: load("renew.lua"), release: load("release.lua")}
}

// Claim returns the token, or an error (a held lease is an error too).
func (h *hashLeases) Claim(ctx context.Context, key, owner string, ttl time.Duration, floor int64) (int64, error) {
	reply, err := h.claim.Run(ctx, h.c, []string{h.keys.Lease(key), h.keys.Fence(key)},
		owner, ttl.Milliseconds(), floor, lua.DefaultCounterTTL.Milliseconds()).Slice()
	if err != nil {
		return 0, err
	}
	if len(reply) != 2 || reply[0] != int64(1) {
		return 0, &lua.HeldError{Key: key, Holder: reply[1].(string)}
	}
	return reply[1].(int64), nil
}

func (h *hashLeases) Renew(ctx context.Context, key, owner string, token int64, ttl time.Duration) (int64, error) {
	return h.renew.Run(ctx, h.c, []string{h.keys.Lease(key)}, owner, token, ttl.Milliseconds()).Int64()
}

func (h *hashLeases) Release(ctx context.Context, key, owner string, token int64, terminal bool) (int64, error) {
	flag := "0"
	if terminal {
		flag = "1"
	}
	return h.release.Run(ctx, h.c, []string{h.keys.Lease(key), h.keys.Fence(key)}, owner, token, flag).Int64()
}

// leaseState is what Redis holds for one job: the lease's type and contents and the
// counter.
type leaseState struct {
	Type  string            // "string", "hash" or "none"
	Value string            // a STRING lease
	Hash  map[string]string // a HASH lease
	Fence string
}

func stateOf(t *testing.T, c *redis.Client, keys lua.Keys, job string) leaseState {
	t.Helper()
	ctx := context.Background()
	s := leaseState{Type: c.Type(ctx, keys.Lease(job)).Val(), Fence: c.Get(ctx, keys.Fence(job)).Val()}
	switch s.Type {
	case "string":
		s.Value = c.Get(ctx, keys.Lease(job)).Val()
	case "hash":
		s.Hash = c.HGetAll(ctx, keys.Lease(job)).Val()
	}
	return s
}

// TestLeaseRollingDeploy: workers of the HASH-lease version and of this one (STRING lease,
// same key) claim, renew and release the same jobs. Neither takes a lease the other holds,
// neither deletes or extends the other's, no call fails in a way that writes, and tokens
// stay strictly increasing whichever version issues them.
func TestLeaseRollingDeploy(t *testing.T) {
	ctx := context.Background()
	runLeaseCases(t, []leaseCase{
		{"NewMeetsHashLease", func(t *testing.T, env leaseEnv, l *lua.Leases) {
			old := newHashLeases(t, env.client, env.prefix)
			keys := l.Keys()
			tok, err := old.Claim(ctx, "job", "old", time.Minute, 0)
			require.NoError(t, err)
			require.Equal(t, int64(1), tok)
			held := leaseState{Type: "hash", Hash: map[string]string{"owner": "old", "token": "1"}, Fence: "1"}
			require.Empty(t, cmp.Diff(held, stateOf(t, env.client, keys, "job")), "precondition: an old worker's HASH lease")

			_, err = l.Claim(ctx, "job", "new", time.Minute, 0)
			var he *lua.HeldError
			require.ErrorAs(t, err, &he)
			assert.Equal(t, "old", he.Holder)
			assert.Greater(t, he.Remaining, time.Duration(0))
			assert.LessOrEqual(t, he.Remaining, time.Minute)
			// A new worker whose lease the old one took since is not the owner.
			mine := lua.Lease{Key: "job", Owner: "new", Token: 1, TTL: time.Minute}
			assert.ErrorIs(t, l.Renew(ctx, mine, time.Hour), lua.ErrNotOwner)
			assert.ErrorIs(t, l.Release(ctx, mine), lua.ErrNotOwner)
			assert.ErrorIs(t, l.ReleaseDone(ctx, mine), lua.ErrNotOwner)
			assert.Empty(t, cmp.Diff(held, stateOf(t, env.client, keys, "job")), "(-want +got) nothing written")
			assert.LessOrEqual(t, env.client.PTTL(ctx, keys.Lease("job")).Val(), time.Minute, "not extended")

			// The old worker keeps and gives up its lease as before; the counter goes on.
			n, err := old.Renew(ctx, "job", "old", 1, time.Minute)
			require.NoError(t, err)
			require.Equal(t, int64(1), n)
			n, err = old.Release(ctx, "job", "old", 1, false)
			require.NoError(t, err)
			require.Equal(t, int64(1), n)
			a, err := l.Claim(ctx, "job", "new", time.Minute, 0)
			require.NoError(t, err)
			assert.Equal(t, int64(2), a.Token)
			assert.Empty(t, cmp.Diff(leaseState{Type: "string", Value: "2:new", Fence: "2"}, stateOf(t, env.client, keys, "job")))
		}},
		{"OldMeetsStringLease", func(t *testing.T, env leaseEnv, l *lua.Leases) {
			old := newHashLeases(t, env.client, env.prefix)
			keys := l.Keys()
			a, err := l.Claim(ctx, "job", "new", time.Minute, 0)
			require.NoError(t, err)
			held := leaseState{Type: "string", Value: "1:new", Fence: "1"}
			require.Empty(t, cmp.Diff(held, stateOf(t, env.client, keys, "job")))

			// Every old script fails on its first command, before it writes anything.
			_, err = old.Claim(ctx, "job", "old", time.Minute, 0)
			assert.ErrorContains(t, err, "WRONGTYPE")
			_, err = old.Renew(ctx, "job", "new", 1, time.Hour)
			assert.ErrorContains(t, err, "WRONGTYPE")
			_, err = old.Release(ctx, "job", "new", 1, true)
			assert.ErrorContains(t, err, "WRONGTYPE")
			assert.Empty(t, cmp.Diff(held, stateOf(t, env.client, keys, "job")), "(-want +got) nothing written")
			assert.LessOrEqual(t, env.client.PTTL(ctx, keys.Lease("job")).Val(), time.Minute, "not extended")

			require.NoError(t, l.Renew(ctx, a, time.Minute), "the new holder still holds it")
			require.NoError(t, l.Release(ctx, a))
			tok, err := old.Claim(ctx, "job", "old", time.Minute, 0)
			require.NoError(t, err)
			assert.Equal(t, int64(2), tok, "the old version counts on from the shared counter")
			_, err = l.Claim(ctx, "job", "new", time.Minute, 0)
			require.ErrorIs(t, err, lua.ErrLeaseHeld)

			// The old lease expires; the next claim is a STRING lease with the next token.
			env.expire(t, keys.Lease("job"))
			b, err := l.Claim(ctx, "job", "new", time.Minute, 0)
			require.NoError(t, err)
			assert.Equal(t, int64(3), b.Token)
			require.NoError(t, l.ReleaseDone(ctx, b))
			assert.Empty(t, scanPrefix(t, env.client, env.prefix), "a completed job leaves no key")
		}},
		{"SameOwnerReplacesItsHashLease", func(t *testing.T, env leaseEnv, l *lua.Leases) {
			old := newHashLeases(t, env.client, env.prefix)
			_, err := old.Claim(ctx, "job", "A", time.Minute, 0)
			require.NoError(t, err)
			a, err := l.Claim(ctx, "job", "A", time.Minute, 0)
			require.NoError(t, err)
			assert.Equal(t, int64(2), a.Token)
			assert.Empty(t, cmp.Diff(leaseState{Type: "string", Value: "2:A", Fence: "2"}, stateOf(t, env.client, l.Keys(), "job")))
		}},
		{"TokensIncreaseAcrossVersions", func(t *testing.T, env leaseEnv, l *lua.Leases) {
			old := newHashLeases(t, env.client, env.prefix)
			// Claims alternate between the versions, each released by the version that
			// claimed it, some as terminal (the next claim's floor is then the last token, as
			// PostgreSQL's fence would be).
			var last, floor int64
			for i := range 24 {
				var tok int64
				switch i % 2 {
				case 0:
					a, err := l.Claim(ctx, "job", "new", time.Minute, floor)
					require.NoError(t, err)
					tok = a.Token
					if i%3 == 0 {
						require.NoError(t, l.ReleaseDone(ctx, a))
					} else {
						require.NoError(t, l.Release(ctx, a))
					}
				default:
					var err error
					tok, err = old.Claim(ctx, "job", "old", time.Minute, floor)
					require.NoError(t, err)
					n, err := old.Release(ctx, "job", "old", tok, i%3 == 0)
					require.NoError(t, err)
					require.Equal(t, int64(1), n)
				}
				require.Greater(t, tok, last, "claim %d", i)
				last = tok
				if i%3 == 0 {
					floor = tok
				}
			}
		}},
	})
}

// TestCommandsPerCall counts, with INFO commandstats on a throwaway server (CONFIG
// RESETSTAT before each call), the Redis commands each wrapper costs — the script call and
// every command inside it. docs/PERFORMANCE.md ("Redis commands per job") quotes them.
func TestCommandsPerCall(t *testing.T) {
	l, c := throwawayLeases(t)
	ctx := context.Background()
	h, err := lua.NewHostLimits(c, "x:")
	require.NoError(t, err)
	paced, unpaced := lua.Limit{Rate: 1000, Burst: 1000}, lua.Limit{}

	// Load every script first: a NOSCRIPT and its EVAL are not what a call costs.
	w, err := l.Claim(ctx, "warm", "W", time.Minute, 0)
	require.NoError(t, err)
	require.NoError(t, l.Renew(ctx, w, time.Minute))
	require.NoError(t, l.ReleaseDone(ctx, w))
	_, _, err = h.Reserve(ctx, "warm.example", paced, time.Second)
	require.NoError(t, err)
	_, err = newHashLeases(t, c, "x:").Claim(ctx, "legacy", "old", time.Minute, 0)
	require.NoError(t, err)

	var a, b lua.Lease
	for _, tc := range []struct {
		name string
		call func(t *testing.T)
		want map[string]int
	}{
		{"ClaimFresh", func(t *testing.T) {
			a, err = l.Claim(ctx, "job", "A", time.Minute, 0)
			require.NoError(t, err)
		}, map[string]int{"evalsha": 1, "mget": 1, "set": 2}},
		{"ClaimHeld", func(t *testing.T) {
			_, err := l.Claim(ctx, "job", "B", time.Minute, 0)
			require.ErrorIs(t, err, lua.ErrLeaseHeld)
		}, map[string]int{"evalsha": 1, "mget": 1, "pttl": 1}},
		{"ClaimHeldAsHash", func(t *testing.T) {
			// An older worker's HASH lease: the SET NX finds the key, HGET reads the holder.
			_, err := l.Claim(ctx, "legacy", "B", time.Minute, 0)
			require.ErrorIs(t, err, lua.ErrLeaseHeld)
		}, map[string]int{"evalsha": 1, "mget": 1, "set": 1, "hget": 1, "pttl": 1}},
		{"Renew", func(t *testing.T) {
			require.NoError(t, l.Renew(ctx, a, time.Minute))
		}, map[string]int{"evalsha": 1, "get": 1, "pexpire": 1}},
		{"Release", func(t *testing.T) {
			require.NoError(t, l.Release(ctx, a))
		}, map[string]int{"evalsha": 1, "mget": 1, "del": 1}},
		{"ReleaseLost", func(t *testing.T) {
			require.ErrorIs(t, l.Release(ctx, a), lua.ErrLeaseLost)
		}, map[string]int{"evalsha": 1, "mget": 1, "exists": 1}},
		{"ClaimAfterRelease", func(t *testing.T) {
			b, err = l.Claim(ctx, "job", "B", time.Minute, 0)
			require.NoError(t, err)
			require.Equal(t, a.Token+1, b.Token)
		}, map[string]int{"evalsha": 1, "mget": 1, "set": 2}},
		{"ReleaseDone", func(t *testing.T) {
			require.NoError(t, l.ReleaseDone(ctx, b))
		}, map[string]int{"evalsha": 1, "mget": 1, "del": 1}},
		{"Take", func(t *testing.T) {
			// The runner's claim: the token comes from PostgreSQL's attempt start.
			a, err = l.Take(ctx, "taken", "A/1", time.Minute)
			require.NoError(t, err)
		}, map[string]int{"set": 1}},
		{"TakeHeld", func(t *testing.T) {
			_, err := l.Take(ctx, "taken", "B/1", time.Minute)
			require.ErrorIs(t, err, lua.ErrLeaseHeld)
		}, map[string]int{"set": 1, "pttl": 1}},
		{"RenewTaken", func(t *testing.T) {
			require.NoError(t, l.Renew(ctx, a, time.Minute))
		}, map[string]int{"evalsha": 1, "get": 1, "pexpire": 1}},
		{"ReleaseCommitted", func(t *testing.T) {
			// The runner's release after a commit.
			require.NoError(t, l.ReleaseCommitted(ctx, a))
		}, map[string]int{"del": 1}},
		{"ReservePaced", func(t *testing.T) {
			_, ok, err := h.Reserve(ctx, "shop.example", paced, time.Second)
			require.NoError(t, err)
			require.True(t, ok)
		}, map[string]int{"evalsha": 1, "time": 1, "mget": 1, "set": 1}},
		{"ReserveUnpaced", func(t *testing.T) {
			_, ok, err := h.Reserve(ctx, "shop.example", unpaced, time.Second)
			require.NoError(t, err)
			require.True(t, ok)
		}, map[string]int{"evalsha": 1, "time": 1, "get": 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.NoError(t, c.ConfigResetStat(ctx).Err())
			tc.call(t)
			got := commandCalls(t, c)
			delete(got, "config|resetstat")
			assert.Empty(t, cmp.Diff(tc.want, got), "commands (-want +got)")
		})
	}
}
