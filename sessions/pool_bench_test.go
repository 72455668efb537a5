package sessions_test

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// BenchmarkSessionPool: 1,000 catalog units, 8 at a time, against the shop in challenge
// mode (a new exit's first request gets a 24 KiB challenge page whose clearance cookie is
// bound to the exit; every 20th challenge is a block instead) through the fake proxy, with
// the session pool off and on; the same with 5 % of requests cutting their device (the unit
// replays: with the pool, on another warm session when one is idle); and without
// challenges, where the pool must cost nothing.
// Reported per completed unit: bytes at the proxy (both directions, the wire), requests the
// shop answered, challenges; and blocked units per 1,000.
//
//	go test ./sessions -run '^$' -bench SessionPool -benchtime 1x
func BenchmarkSessionPool(b *testing.B) {
	for _, c := range []struct {
		challenge bool
		cuts      float64
	}{{true, 0}, {true, 0.05}, {false, 0}} {
		for _, pooled := range []bool{false, true} {
			name := fmt.Sprintf("challenge=%v/pool=%v", c.challenge, pooled)
			if c.cuts > 0 {
				name = fmt.Sprintf("challenge=%v/cuts=%v/pool=%v", c.challenge, c.cuts, pooled)
			}
			b.Run(name, func(b *testing.B) {
				for range b.N {
					benchPoolRun(b, c.challenge, c.cuts, pooled)
				}
			})
		}
	}
}

func benchPoolRun(b *testing.B, challenge bool, cuts float64, pooled bool) {
	b.StopTimer()
	const units, workers = 1000, 8
	proxy := testutil.NewFakeProxy(b, testutil.FakeProxyConfig{Seed: 80, Format: testutil.ProxyFormatGeneric, User: "acct", Password: canary,
		DisconnectProb: cuts})
	site := testutil.NewFakeSite(b, testutil.FakeSiteConfig{Seed: 80, Products: 100, StrictExit: true,
		Challenge: challenge, ChallengeBlockEvery: 20})
	prov, err := sessions.NewProvider("generic", proxy.Addr, "{user}[-country-{country}]-session-{session}", "{pass}", "acct", canary, 0)
	require.NoError(b, err)
	cfg := sessions.RunConfig{
		Provider: prov, Country: "US", Logger: slog.New(slog.NewTextHandler(discard{}, nil)),
		Collector:  sessions.CollectorConfig{Guard: sessions.LoopbackGuard()},
		Quarantine: func(context.Context, sessions.Quarantined) error { return nil },
	}
	if pooled {
		pool, err := sessions.NewPool(sessions.PoolConfig{})
		require.NoError(b, err)
		defer pool.Close()
		cfg.Pool = pool
	}
	e := &env{proxy: proxy, site: site}
	var ok, blocked, other atomic.Int64
	var next atomic.Int64
	var wg sync.WaitGroup
	b.StartTimer()
	for range workers {
		wg.Go(func() {
			for {
				n := next.Add(1)
				if n > units {
					return
				}
				res, err := poolUnitB(b, e, fmt.Sprintf("sku-%d", n%100+1)).Run(context.Background(), cfg)
				switch {
				case err == nil:
					ok.Add(1)
					res.Lease.Keep()
				case sessions.CategoryOf(err) == tasks.CategoryBlocked:
					blocked.Add(1)
				default:
					other.Add(1)
				}
			}
		})
	}
	wg.Wait()
	b.StopTimer()
	done := float64(ok.Load())
	b.ReportMetric(float64(proxy.Bytes())/done, "wire-bytes/unit")
	b.ReportMetric(float64(site.TotalHits())/done, "requests/unit")
	b.ReportMetric(float64(site.Challenges())/done, "challenges/unit")
	b.ReportMetric(float64(blocked.Load()), "blocked/1000")
	b.ReportMetric(float64(other.Load()), "failed/1000")
	b.ReportMetric(float64(proxy.Disconnects()), "cuts/1000")
	proxy.Close()
	site.Close()
}

// poolUnitB is poolUnit for a benchmark.
func poolUnitB(b *testing.B, e *env, sku string) *sessions.Unit {
	u, err := catalog.Unit(e.site.URL, sku) // Site: the shop's host
	if err != nil {
		b.Fatal(err)
	}
	return u
}
