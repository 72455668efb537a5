package lua_test

import (
	"context"
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
