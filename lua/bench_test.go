package lua_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/testutil"
)

// BenchmarkLease compares a lease cycle (claim with fencing token + release, two EVALSHA)
// with the cheapest unsafe lock (SET NX PX + DEL, no owner check, no token), on one
// connection to the same server, in one run.
func BenchmarkLease(b *testing.B) {
	ns := testutil.Redis(b)
	c := redis.NewClient(&redis.Options{Addr: ns.Addr, PoolSize: 1})
	defer c.Close()
	ctx := context.Background()

	b.Run("ClaimRelease", func(b *testing.B) {
		l, err := lua.NewLeases(c, ns.Prefix)
		if err != nil {
			b.Fatal(err)
		}
		b.ReportAllocs()
		for i := 0; i < b.N; i++ {
			lease, err := l.Claim(ctx, "bench-job", "worker-1", 30*time.Second, 0)
			if err != nil {
				b.Fatal(err)
			}
			if err := l.Release(ctx, lease); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("RawSetNXDel", func(b *testing.B) {
		key := ns.Prefix + "raw-lock"
		b.ReportAllocs()
		for i := 0; i < b.N; i++ {
			ok, err := c.SetNX(ctx, key, "worker-1", 30*time.Second).Result()
			if err != nil || !ok {
				b.Fatal(ok, err)
			}
			if err := c.Del(ctx, key).Err(); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkHostLimit is the limiter's cost per request (one EVALSHA of hostlimit.lua that
// never waits), next to a lease cycle's two, on one connection.
func BenchmarkHostLimit(b *testing.B) {
	ns := testutil.Redis(b)
	c := redis.NewClient(&redis.Options{Addr: ns.Addr, PoolSize: 1})
	defer c.Close()
	ctx := context.Background()
	h, err := lua.NewHostLimits(c, ns.Prefix)
	if err != nil {
		b.Fatal(err)
	}
	lim := lua.Limit{Rate: 1e6, Burst: 1e6}
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		if _, ok, err := h.Reserve(ctx, "shop.example", lim, time.Second); err != nil || !ok {
			b.Fatal(ok, err)
		}
	}
}

// BenchmarkCompletedJobMemory is the Redis memory a completed job leaves behind: 10,000
// jobs claimed and released as the runner does after a successful commit, on a throwaway
// server, with Release (the token counter stays for DefaultCounterTTL) and with
// ReleaseDone (it goes with the lease). Reports used_memory growth per job and keys left.
func BenchmarkCompletedJobMemory(b *testing.B) {
	const jobs = 10_000
	for _, mode := range []string{"Release", "ReleaseDone"} {
		b.Run(mode, func(b *testing.B) {
			srv := testutil.StartRedis(b)
			c := srv.Client()
			ctx := context.Background()
			l, err := lua.NewLeases(c, "idemscrape:")
			if err != nil {
				b.Fatal(err)
			}
			// A first round warms up what is not per job (script cache, Lua heap, client
			// buffers: ~200 KB), so that only what the jobs leave is measured.
			run := func(n int) {
				for j := range n {
					lease, err := l.Claim(ctx, fmt.Sprintf("catalog:sku-%08d:US:2026-04-23:v1", j), "worker-1", 30*time.Second, 1)
					if err != nil {
						b.Fatal(err)
					}
					if mode == "Release" {
						err = l.Release(ctx, lease)
					} else {
						err = l.ReleaseDone(ctx, lease)
					}
					if err != nil {
						b.Fatal(err)
					}
				}
			}
			run(jobs)
			var grown, keys int64
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if err := c.FlushAll(ctx).Err(); err != nil {
					b.Fatal(err)
				}
				before := usedMemory(b, c)
				run(jobs)
				grown += usedMemory(b, c) - before
				keys += c.DBSize(ctx).Val()
			}
			b.ReportMetric(float64(grown)/float64(b.N*jobs), "redis-B/job")
			b.ReportMetric(float64(keys)/float64(b.N), "keys-left")
		})
	}
}

// usedMemory is the server's INFO used_memory in bytes.
func usedMemory(b *testing.B, c *redis.Client) int64 {
	info, err := c.Info(context.Background(), "memory").Result()
	if err != nil {
		b.Fatal(err)
	}
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "used_memory:"); ok {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				b.Fatal(err)
			}
			return n
		}
	}
	b.Fatal("INFO memory has no used_memory")
	return 0
}

// BenchmarkClaimMany is a reconciler page's lease work: 1,000 claims then 1,000 releases,
// one round trip each (Claim, Release) vs one pipeline each (ClaimMany, ReleaseMany).
func BenchmarkClaimMany(b *testing.B) {
	const page = 1000
	ns := testutil.Redis(b)
	ctx := context.Background()
	l, err := lua.NewLeases(ns.Client, ns.Prefix)
	if err != nil {
		b.Fatal(err)
	}
	reqs := make([]lua.ClaimRequest, page)
	for i := range reqs {
		reqs[i] = lua.ClaimRequest{Key: fmt.Sprintf("job-%d", i), Owner: "reconciler", TTL: 30 * time.Second, Floor: 1}
	}
	b.Run("OneByOne", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			for _, r := range reqs {
				lease, err := l.Claim(ctx, r.Key, r.Owner, r.TTL, r.Floor)
				if err != nil {
					b.Fatal(err)
				}
				if err := l.Release(ctx, lease); err != nil {
					b.Fatal(err)
				}
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*page), "ns/job")
	})
	b.Run("Pipelined", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			leases, errs := l.ClaimMany(ctx, reqs)
			for _, err := range errs {
				if err != nil {
					b.Fatal(err)
				}
			}
			for _, err := range l.ReleaseMany(ctx, leases) {
				if err != nil {
					b.Fatal(err)
				}
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*page), "ns/job")
	})
}
