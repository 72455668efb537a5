package lua_test

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/testutil"
)

// scanPrefix returns every key under prefix, sorted (SCAN, as an operator would).
func scanPrefix(t *testing.T, c *redis.Client, prefix string) []string {
	t.Helper()
	ctx := context.Background()
	var keys []string
	iter := c.Scan(ctx, 0, prefix+"*", 1000).Iterator()
	for iter.Next(ctx) {
		keys = append(keys, iter.Val())
	}
	require.NoError(t, iter.Err())
	sort.Strings(keys)
	return keys
}

// scripterOnly hides the client's Pipeline: RunMany falls back to one call
// after another.
type scripterOnly struct{ redis.Scripter }

// leaseEnv is one Redis for a subtest: the client, the key prefix and a way to make a
// lease vanish as if it expired.
type leaseEnv struct {
	name   string
	client *redis.Client
	prefix string
	expire func(t *testing.T, key string)
}

func leaseEnvs(t *testing.T) []func(t *testing.T) leaseEnv {
	return []func(t *testing.T) leaseEnv{
		func(t *testing.T) leaseEnv {
			c, mr := miniClient(t)
			return leaseEnv{"Miniredis", c, "mini:", func(t *testing.T, key string) {
				// Fast-forward past any lease (the counter lives 7 days).
				mr.FastForward(time.Hour)
				require.False(t, mr.Exists(key))
			}}
		},
		func(t *testing.T) leaseEnv {
			ns := testutil.Redis(t)
			return leaseEnv{"RealRedis", ns.Client, ns.Prefix, func(t *testing.T, key string) {
				// The same state as an expired lease, without waiting for the server's clock.
				require.NoError(t, ns.Client.Del(context.Background(), key).Err())
			}}
		},
	}
}

// leaseCase is a subtest that runs on each Redis of leaseEnvs, with Leases of its own.
type leaseCase struct {
	name string
	run  func(t *testing.T, env leaseEnv, l *lua.Leases)
}

// runLeaseCases runs every case as a subtest of its name, and within it once per Redis of
// leaseEnvs (subtests Miniredis and RealRedis), on Leases under that Redis's prefix.
func runLeaseCases(t *testing.T, cases []leaseCase) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for _, mk := range leaseEnvs(t) {
				env := mk(t)
				t.Run(env.name, func(t *testing.T) {
					l, err := lua.NewLeases(env.client, env.prefix)
					require.NoError(t, err)
					tc.run(t, env, l)
				})
			}
		})
	}
}

func TestReleaseDone(t *testing.T) {
	ctx := context.Background()
	runLeaseCases(t, []leaseCase{
		{"TerminalLeavesNoKey", func(t *testing.T, env leaseEnv, l *lua.Leases) {
			// PostgreSQL holds fence 7; the claim's token is 8, which the commit records.
			a, err := l.Claim(ctx, "job", "A", time.Minute, 7)
			require.NoError(t, err)
			require.Equal(t, int64(8), a.Token)
			require.Len(t, scanPrefix(t, env.client, env.prefix), 2, "lease and counter while running")
			require.NoError(t, l.ReleaseDone(ctx, a))
			assert.Empty(t, scanPrefix(t, env.client, env.prefix), "a completed job leaves no key")

			// A late claim (duplicate delivery, operator requeue) passes PostgreSQL's fence
			// as the floor: its token is still above every token PostgreSQL accepted.
			late, err := l.Claim(ctx, "job", "B", time.Minute, a.Token)
			require.NoError(t, err)
			assert.Equal(t, a.Token+1, late.Token)
			require.ErrorIs(t, l.Release(ctx, a), lua.ErrNotOwner, "the old lease is gone for good")
			require.NoError(t, l.ReleaseDone(ctx, late))
			assert.Empty(t, scanPrefix(t, env.client, env.prefix))
		}},
		{"NonTerminalKeepsCounter", func(t *testing.T, env leaseEnv, l *lua.Leases) {
			a, err := l.Claim(ctx, "job", "A", time.Minute, 0)
			require.NoError(t, err)
			require.NoError(t, l.Release(ctx, a))
			assert.Equal(t, []string{l.Keys().Fence("job")}, scanPrefix(t, env.client, env.prefix))
			assert.Equal(t, "1", env.client.Get(ctx, l.Keys().Fence("job")).Val())
			b, err := l.Claim(ctx, "job", "B", time.Minute, 0)
			require.NoError(t, err)
			assert.Equal(t, int64(2), b.Token, "the counter, not the floor, gave the next token")
		}},
		{"NotOwnerDeletesNothing", func(t *testing.T, env leaseEnv, l *lua.Leases) {
			a, err := l.Claim(ctx, "job", "A", time.Minute, 0)
			require.NoError(t, err)
			stale := a
			stale.Token--
			require.ErrorIs(t, l.ReleaseDone(ctx, stale), lua.ErrNotOwner)
			other := a
			other.Owner = "B"
			require.ErrorIs(t, l.ReleaseDone(ctx, other), lua.ErrNotOwner)
			assert.Len(t, scanPrefix(t, env.client, env.prefix), 2, "lease and counter stay")
			require.NoError(t, l.Renew(ctx, a, time.Minute), "A still holds the lease")
		}},
		{"LeaseLostKeepsCounter", func(t *testing.T, env leaseEnv, l *lua.Leases) {
			a, err := l.Claim(ctx, "job", "A", time.Minute, 0)
			require.NoError(t, err)
			env.expire(t, l.Keys().Lease("job"))
			// Another claim may have come and gone meanwhile: without the lease, the
			// counter is the only record of the tokens issued.
			require.ErrorIs(t, l.ReleaseDone(ctx, a), lua.ErrLeaseLost)
			assert.Equal(t, []string{l.Keys().Fence("job")}, scanPrefix(t, env.client, env.prefix))
		}},
		{"LaterTokenKept", func(t *testing.T, env leaseEnv, l *lua.Leases) {
			a, err := l.Claim(ctx, "job", "A", time.Minute, 0)
			require.NoError(t, err)
			// A counter beyond the lease's token (set by hand: claim.lua never leaves one
			// while the lease is held) records a token PostgreSQL may not know of.
			require.NoError(t, env.client.Set(ctx, l.Keys().Fence("job"), "5", 0).Err())
			require.NoError(t, l.ReleaseDone(ctx, a))
			assert.Equal(t, []string{l.Keys().Fence("job")}, scanPrefix(t, env.client, env.prefix))
			assert.Equal(t, "5", env.client.Get(ctx, l.Keys().Fence("job")).Val())
		}},
		{"ManyJobsLeaveNoKey", func(t *testing.T, env leaseEnv, l *lua.Leases) {
			for i := range 200 {
				a, err := l.Claim(ctx, fmt.Sprintf("job-%d", i), "A", time.Minute, int64(i))
				require.NoError(t, err)
				require.NoError(t, l.ReleaseDone(ctx, a))
			}
			assert.Empty(t, scanPrefix(t, env.client, env.prefix))
		}},
	})
}

func TestClaimManyReleaseMany(t *testing.T) {
	ctx := context.Background()
	check := func(t *testing.T, env leaseEnv, l *lua.Leases) {
		// Initial state: job-1 held by another worker, job-0 and job-2 free; job-2 has a
		// counter (3) above its floor (1).
		other, err := l.Claim(ctx, "job-1", "other", time.Minute, 0)
		require.NoError(t, err)
		c2, err := l.Claim(ctx, "job-2", "old", time.Minute, 2)
		require.NoError(t, err)
		require.NoError(t, l.Release(ctx, c2))

		leases, errs := l.ClaimMany(ctx, []lua.ClaimRequest{
			{Key: "job-0", Owner: "R", TTL: time.Minute, Floor: 41},
			{Key: "job-1", Owner: "R", TTL: time.Minute, Floor: 0},
			{Key: "job-2", Owner: "R", TTL: time.Minute, Floor: 1},
			{Key: "job-3", Owner: "", TTL: time.Minute},
			{Key: "job-4", Owner: "R", TTL: time.Minute, Floor: -1},
		})
		require.Len(t, leases, 5)
		require.Len(t, errs, 5)
		require.NoError(t, errs[0])
		assert.Equal(t, lua.Lease{Key: "job-0", Owner: "R", Token: 42, TTL: time.Minute, Claimed: leases[0].Claimed}, leases[0])
		var held *lua.HeldError
		require.ErrorAs(t, errs[1], &held)
		assert.Equal(t, "other", held.Holder)
		assert.Equal(t, lua.Lease{}, leases[1])
		require.NoError(t, errs[2])
		assert.Equal(t, c2.Token+1, leases[2].Token, "the counter beats a lower floor")
		assert.ErrorContains(t, errs[3], "empty owner")
		assert.ErrorContains(t, errs[4], "floor -1")

		staleOther := other
		staleOther.Owner = "R"
		rerrs := l.ReleaseMany(ctx, []lua.Lease{leases[0], staleOther, leases[2], leases[0], {}})
		require.Len(t, rerrs, 5)
		assert.NoError(t, rerrs[0])
		assert.ErrorIs(t, rerrs[1], lua.ErrNotOwner)
		assert.NoError(t, rerrs[2])
		assert.ErrorIs(t, rerrs[3], lua.ErrLeaseLost, "released twice in one pipeline")
		assert.ErrorContains(t, rerrs[4], "without key or owner")

		// Wanted state: job-1 still held by its worker; job-0 and job-2 free, counters kept.
		require.NoError(t, l.Renew(ctx, other, time.Minute))
		assert.Equal(t, []string{l.Keys().Fence("job-0"), l.Keys().Lease("job-1"), l.Keys().Fence("job-1"),
			l.Keys().Fence("job-2")}, sortedLike(scanPrefix(t, env.client, env.prefix), l, "job-0", "job-1", "job-2"))
		assert.Equal(t, "42", env.client.Get(ctx, l.Keys().Fence("job-0")).Val())

		empty, emptyErrs := l.ClaimMany(ctx, nil)
		assert.Empty(t, empty)
		assert.Empty(t, emptyErrs)
		assert.Empty(t, l.ReleaseMany(ctx, nil))
	}
	runLeaseCases(t, []leaseCase{{"Pipelined", check}})
	t.Run("NoPipeline", func(t *testing.T) {
		// Leases always pipeline (their client is a redis.Cmdable); RunMany on a bare
		// Scripter (store/outbox passes one) sends the scripts one after another,
		// each with its own reply, NOSCRIPT handled by Script.Run.
		for _, mk := range leaseEnvs(t) {
			env := mk(t)
			t.Run(env.name, func(t *testing.T) {
				echo := redis.NewScript(`return redis.call("INCRBY", KEYS[1], ARGV[1])`)
				k := env.prefix + "{n}:x"
				cmds := lua.RunMany(ctx, scripterOnly{env.client}, echo, [][]string{{k}, {k}, {k}}, [][]any{{1}, {2}, {"x"}})
				require.Len(t, cmds, 3)
				assert.Equal(t, int64(1), cmds[0].Val())
				assert.Equal(t, int64(3), cmds[1].Val())
				assert.Error(t, cmds[2].Err())
			})
		}
	})

	t.Run("RespectsContextCancellation", func(t *testing.T) {
		l, _ := realLeases(t)
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		leases, errs := l.ClaimMany(cctx, []lua.ClaimRequest{{Key: "a", Owner: "R", TTL: time.Minute}, {Key: "b", Owner: "R", TTL: time.Minute}})
		for i := range errs {
			assert.ErrorIs(t, errs[i], context.Canceled)
			assert.Equal(t, lua.Lease{}, leases[i])
		}
		for _, err := range l.ReleaseMany(cctx, []lua.Lease{{Key: "a", Owner: "R", Token: 1}}) {
			assert.ErrorIs(t, err, context.Canceled)
		}
	})
}

// sortedLike orders keys as the lease/fence keys of jobs, in job order, lease first.
func sortedLike(keys []string, l *lua.Leases, jobs ...string) []string {
	var out []string
	set := map[string]bool{}
	for _, k := range keys {
		set[k] = true
	}
	for _, j := range jobs {
		for _, k := range []string{l.Keys().Lease(j), l.Keys().Fence(j)} {
			if set[k] {
				out = append(out, k)
				delete(set, k)
			}
		}
	}
	for k := range set {
		out = append(out, "unexpected:"+k)
	}
	return out
}

// commandCalls returns the calls of each command since CONFIG RESETSTAT (INFO commandstats).
func commandCalls(t *testing.T, c *redis.Client) map[string]int {
	t.Helper()
	info, err := c.Info(context.Background(), "commandstats").Result()
	require.NoError(t, err)
	calls := map[string]int{}
	for _, line := range strings.Split(info, "\r\n") {
		name, rest, ok := strings.Cut(strings.TrimPrefix(line, "cmdstat_"), ":calls=")
		if !ok {
			continue
		}
		var n int
		_, err := fmt.Sscanf(rest, "%d", &n)
		require.NoError(t, err)
		calls[name] = n
	}
	return calls
}

func TestClaimManyScriptCacheFlushed(t *testing.T) {
	// SCRIPT FLUSH stands for a restart or failover that lost the script cache: every
	// EVALSHA of the pipeline fails with NOSCRIPT; the script is loaded once and the claims
	// sent again in one more pipeline (no EVAL per claim). Throwaway server: flushing the
	// shared one would disturb others.
	l, c := throwawayLeases(t)
	ctx := context.Background()
	const n = 50
	reqs := make([]lua.ClaimRequest, n)
	for i := range reqs {
		reqs[i] = lua.ClaimRequest{Key: fmt.Sprintf("job-%d", i), Owner: "R", TTL: time.Minute, Floor: int64(i)}
	}
	// A held lease among them: NOSCRIPT retries must not turn it into a claim.
	held, err := l.Claim(ctx, "job-7", "other", time.Minute, 0)
	require.NoError(t, err)

	for _, round := range []string{"Claim", "Release"} {
		t.Run(round, func(t *testing.T) {
			require.NoError(t, c.ScriptFlush(ctx).Err())
			require.NoError(t, c.ConfigResetStat(ctx).Err())
			var errs []error
			if round == "Claim" {
				var leases []lua.Lease
				leases, errs = l.ClaimMany(ctx, reqs)
				for i, err := range errs {
					if i == 7 {
						require.ErrorIs(t, err, lua.ErrLeaseHeld)
						continue
					}
					require.NoError(t, err, "claim %d", i)
					require.Equal(t, int64(i+1), leases[i].Token)
				}
			} else {
				leases := make([]lua.Lease, n)
				for i := range leases {
					leases[i] = lua.Lease{Key: fmt.Sprintf("job-%d", i), Owner: "R", Token: int64(i + 1)}
				}
				leases[7] = held
				errs = l.ReleaseMany(ctx, leases)
				for i, err := range errs {
					require.NoError(t, err, "release %d", i)
				}
			}
			calls := commandCalls(t, c)
			assert.Equal(t, 1, calls["script|load"], "%v", calls)
			assert.Zero(t, calls["eval"], "no EVAL fallback per item: %v", calls)
			assert.Equal(t, 2*n, calls["evalsha"], "one NOSCRIPT and one retry per item: %v", calls)
		})
	}
	require.Equal(t, []string{"x:{job-0}:fence"}, scanPrefix(t, c, "x:{job-0}"))
}
