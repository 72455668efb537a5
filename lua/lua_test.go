package lua_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/testutil"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func realLeases(t *testing.T) (*lua.Leases, *testutil.RedisNS) {
	t.Helper()
	ns := testutil.Redis(t)
	l, err := lua.NewLeases(ns.Client, ns.Prefix)
	require.NoError(t, err)
	return l, ns
}

func miniLeases(t *testing.T) (*lua.Leases, *miniredis.Miniredis) {
	t.Helper()
	c, mr := miniClient(t)
	l, err := lua.NewLeases(c, "mini:")
	require.NoError(t, err)
	return l, mr
}

// miniClient starts a miniredis for the test and returns a client of it, closed with the
// test.
func miniClient(t *testing.T) (*redis.Client, *miniredis.Miniredis) {
	t.Helper()
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	return c, mr
}

// frozenMini is miniClient with the server clock (TIME) frozen at the instant it returns,
// so waits the scripts compute are exact; move it with mr.SetTime.
func frozenMini(t *testing.T) (*redis.Client, *miniredis.Miniredis, time.Time) {
	t.Helper()
	c, mr := miniClient(t)
	now := time.Date(2026, 4, 23, 12, 0, 0, 0, time.UTC)
	mr.SetTime(now)
	return c, mr, now
}

// throwawayLeases returns Leases (prefix "x:") on a Redis server of the test's own, for
// tests that flush the script cache or read the server's command statistics (on the shared
// server either would disturb others).
func throwawayLeases(t *testing.T) (*lua.Leases, *redis.Client) {
	t.Helper()
	c := testutil.StartRedis(t).Client()
	l, err := lua.NewLeases(c, "x:")
	require.NoError(t, err)
	return l, c
}

func TestLeaseExclusive(t *testing.T) {
	l, _ := realLeases(t)
	ctx := context.Background()
	const (
		goroutines = 32
		cycles     = 2000
		keys       = 8
	)
	var (
		holders   [keys]atomic.Int32
		lastToken [keys]atomic.Int64
		claims    atomic.Int64
		failures  = make(chan string, goroutines)
		wg        sync.WaitGroup
	)
	for g := 0; g < goroutines; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			owner := fmt.Sprintf("worker-%d", g)
			for i := 0; i < cycles; i++ {
				k := (g + i) % keys
				lease, err := l.Claim(ctx, fmt.Sprintf("job-%d", k), owner, 10*time.Second, 0)
				if errors.Is(err, lua.ErrLeaseHeld) {
					continue
				}
				if err != nil {
					failures <- err.Error()
					return
				}
				claims.Add(1)
				if n := holders[k].Add(1); n != 1 {
					failures <- fmt.Sprintf("key %d has %d holders", k, n)
					return
				}
				if last := lastToken[k].Load(); lease.Token <= last {
					failures <- fmt.Sprintf("key %d: token %d after %d", k, lease.Token, last)
					return
				}
				lastToken[k].Store(lease.Token)
				holders[k].Add(-1)
				if err := l.Release(ctx, lease); err != nil {
					failures <- err.Error()
					return
				}
			}
		}()
	}
	wg.Wait()
	close(failures)
	for f := range failures {
		t.Error(f)
	}
	// Every successful claim issued exactly one token: the tokens of a key are 1..n.
	var total int64
	for k := range lastToken {
		total += lastToken[k].Load()
	}
	require.Equal(t, claims.Load(), total, "tokens per key are consecutive and one per claim")
	require.Greater(t, claims.Load(), int64(1000), "the test exercised many claims")
}

func TestLeaseExpiryAndReclaim(t *testing.T) {
	ctx := context.Background()
	// ttl is short where time can be fast-forwarded (miniredis); on a real server it is long
	// enough that a stalled test goroutine (a busy box under -race) cannot see the lease
	// expire between two consecutive calls.
	check := func(t *testing.T, l *lua.Leases, ttl time.Duration, expire func(time.Duration)) {
		a, err := l.Claim(ctx, "job", "A", ttl, 0)
		require.NoError(t, err)
		require.Equal(t, int64(1), a.Token)

		_, err = l.Claim(ctx, "job", "B", time.Second, 0)
		var held *lua.HeldError
		require.ErrorAs(t, err, &held)
		require.ErrorIs(t, err, lua.ErrLeaseHeld)
		require.Equal(t, "A", held.Holder)
		require.Greater(t, held.Remaining, time.Duration(0))
		require.LessOrEqual(t, held.Remaining, ttl)

		expire(ttl)

		b, err := l.Claim(ctx, "job", "B", time.Minute, 0)
		require.NoError(t, err)
		require.Greater(t, b.Token, a.Token)
		require.ErrorIs(t, l.Renew(ctx, a, time.Second), lua.ErrNotOwner, "old holder's renew")
		require.ErrorIs(t, l.Release(ctx, a), lua.ErrNotOwner, "old holder's release")
		require.NoError(t, l.Renew(ctx, b, time.Minute))

		// Same owner, stale token (an earlier claim of its own) is not the holder either.
		b2, err := l.Claim(ctx, "job", "B", time.Minute, 0)
		require.NoError(t, err, "the holder re-claims with a new token")
		require.Greater(t, b2.Token, b.Token)
		require.ErrorIs(t, l.Release(ctx, b), lua.ErrNotOwner)
		require.NoError(t, l.Release(ctx, b2))
		require.ErrorIs(t, l.Renew(ctx, b2, time.Second), lua.ErrLeaseLost, "renew after release")
		require.ErrorIs(t, l.Release(ctx, b2), lua.ErrLeaseLost, "release twice")

		// The floor (PostgreSQL's fence) wins over a smaller counter.
		c, err := l.Claim(ctx, "job", "C", time.Minute, 1000)
		require.NoError(t, err)
		require.Equal(t, int64(1001), c.Token)
		require.NoError(t, l.Release(ctx, c))
		d, err := l.Claim(ctx, "job", "D", time.Minute, 5)
		require.NoError(t, err)
		require.Equal(t, int64(1002), d.Token, "a floor below the counter does not lower tokens")
	}
	t.Run("Miniredis", func(t *testing.T) {
		l, mr := miniLeases(t)
		check(t, l, 200*time.Millisecond, func(d time.Duration) { mr.FastForward(d) })
	})
	t.Run("RealRedis", func(t *testing.T) {
		l, ns := realLeases(t)
		check(t, l, 3*time.Second, func(ttl time.Duration) {
			// Wait for the server to expire the lease (server clock), not for a timer of ours;
			// the deadline is a hang guard only.
			key := l.Keys().Lease("job")
			deadline := time.Now().Add(ttl + guard)
			for ns.Client.Exists(ctx, key).Val() == 1 {
				require.True(t, time.Now().Before(deadline), "lease never expired")
				time.Sleep(5 * time.Millisecond)
			}
		})
	})
}

func TestLeaseBadInput(t *testing.T) {
	l, _ := miniLeases(t)
	ctx := context.Background()
	_, err := l.Claim(ctx, "", "A", time.Second, 0)
	require.ErrorContains(t, err, "empty job key")
	_, err = l.Claim(ctx, "job", "", time.Second, 0)
	require.ErrorContains(t, err, "empty owner")
	_, err = l.Claim(ctx, "job", "A", time.Microsecond, 0)
	require.ErrorContains(t, err, "below 1ms")
	_, err = l.Claim(ctx, "job", "A", time.Second, -1)
	require.ErrorContains(t, err, "floor -1")
	_, err = lua.NewKeys("bad{prefix}")
	require.ErrorContains(t, err, "may not contain")
}

func TestScriptCacheFlushed(t *testing.T) {
	// After SCRIPT FLUSH (restart, failover) EVALSHA fails with NOSCRIPT and the wrapper
	// falls back to EVAL. Throwaway server: flushing the shared one would disturb others.
	l, c := throwawayLeases(t)
	ctx := context.Background()
	a, err := l.Claim(ctx, "job", "A", time.Minute, 0)
	require.NoError(t, err)
	require.NoError(t, c.ScriptFlush(ctx).Err())
	require.NoError(t, l.Renew(ctx, a, time.Minute))
	require.NoError(t, l.Release(ctx, a))
}

// crc16 is the CRC16-XMODEM Redis Cluster uses for key slots.
func crc16(b []byte) uint16 {
	var crc uint16
	for _, c := range b {
		crc ^= uint16(c) << 8
		for i := 0; i < 8; i++ {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc
}

// slot follows the cluster spec: hash the part between the first '{' and the next '}' if
// that part is non-empty, else the whole key.
func slot(key string) uint16 {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			key = key[i+1 : i+1+j]
		}
	}
	return crc16([]byte(key)) % 16384
}

func TestScriptsClusterSafe(t *testing.T) {
	require.Equal(t, uint16(0x31C3), crc16([]byte("123456789")), "CRC16 test vector of the cluster spec")
	keys, err := lua.NewKeys("idemscrape:")
	require.NoError(t, err)
	for _, jobKey := range []string{
		"catalog:sku-42:US:2026-04-23:v3",
		"catalog:0123456789abcdef0123456789abcdef",
		"weird:{brace}:key", "}{", "{}",
	} {
		// Every key the scripts receive in KEYS, per script.
		scripts := map[string][]string{
			"claim.lua":   {keys.Lease(jobKey), keys.Fence(jobKey)},
			"renew.lua":   {keys.Lease(jobKey)},
			"release.lua": {keys.Lease(jobKey), keys.Fence(jobKey)},
		}
		want := slot(keys.Lease(jobKey))
		for name, ks := range scripts {
			for _, k := range ks {
				require.Equal(t, want, slot(k), "%s: key %q of job %q is in another slot", name, k, jobKey)
				require.Contains(t, k, keys.Tag(jobKey))
			}
		}
		// Different jobs spread over slots: the tag is the job, not the prefix.
		require.NotEqual(t, slot(keys.Lease("a:1")), slot(keys.Lease("b:2")))
	}
}

func TestScriptHeaders(t *testing.T) {
	files, err := filepath.Glob("*.lua")
	require.NoError(t, err)
	require.NotEmpty(t, files)
	for _, f := range files {
		b, err := os.ReadFile(f)
		require.NoError(t, err)
		src := string(b)
		for _, want := range []string{"KEYS[1] ->", "Returns"} {
			require.Contains(t, src, want, "%s: header lacks %q (see CONVENTIONS)", f, want)
		}
		// A script without arguments says so instead of leaving the reader to guess.
		if !strings.Contains(src, "ARGV[1] ->") {
			require.Contains(t, src, "-- (no ARGV)", "%s: header lacks ARGV lines or \"(no ARGV)\"", f)
			require.NotContains(t, src, "ARGV[", "%s: uses ARGV but its header says it takes none", f)
		}
		// A script may use only keys it declares: no key built from ARGV.
		require.NotContains(t, src, "ARGV[1] ..", "%s builds a key from ARGV", f)
	}
}

// TestLeaseOwnerWithColons: the lease value is "<token>:<owner>" and an owner may hold
// colons and digits (host:port worker ids): it is still one holder, told from another whose
// name is a suffix or looks like a token, on miniredis and on a real server.
func TestLeaseOwnerWithColons(t *testing.T) {
	ctx := context.Background()
	mini, _ := miniLeases(t)
	onServer, _ := realLeases(t)
	for name, l := range map[string]*lua.Leases{"miniredis": mini, "real": onServer} {
		t.Run(name, func(t *testing.T) {
			const key = "colons"
			a, err := l.Claim(ctx, key, "host:12:pid/ab", time.Minute, 0)
			require.NoError(t, err)
			for _, other := range []string{"12:pid/ab", "7:1", "1", "pid/ab"} {
				_, err = l.Claim(ctx, key, other, time.Minute, 0)
				var held *lua.HeldError
				require.ErrorAs(t, err, &held, other)
				assert.Equal(t, "host:12:pid/ab", held.Holder, other)
			}
			require.NoError(t, l.Renew(ctx, a, time.Minute))
			require.ErrorIs(t, l.Release(ctx, lua.Lease{Key: a.Key, Owner: "12:pid/ab", Token: a.Token}), lua.ErrNotOwner)
			require.NoError(t, l.Release(ctx, a))
			b, err := l.Claim(ctx, key, "7:1", time.Minute, 0)
			require.NoError(t, err)
			assert.Greater(t, b.Token, a.Token)
			require.NoError(t, l.Release(ctx, b))
		})
	}
}
