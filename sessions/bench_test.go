package sessions_test

import (
	"context"
	"net/url"
	"testing"
	"time"

	"github.com/gocolly/colly/v2"

	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/testutil"
)

// BenchmarkFetch fetches one product page of the fake shop, in one run:
//   - Bound: the session-bound collector through the fake proxy (keep-alive, guard, cap,
//     byte counting, header auth);
//   - CollyProxy: a bare colly collector through the same proxy the colly way (SetProxy
//     with credentials in the URL, which turns keep-alives off);
//   - CollyDirect: a bare colly collector straight to the shop, no proxy.
func BenchmarkFetch(b *testing.B) {
	proxy := testutil.NewFakeProxy(b, testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: "acct", Password: canary})
	site := testutil.NewFakeSite(b, testutil.FakeSiteConfig{})
	page := site.URL + "/search?q=sku-1"

	b.Run("Bound", func(b *testing.B) {
		p, err := sessions.NewProvider("generic", proxy.Addr, "{user}[-country-{country}]-session-{session}", "{pass}", "acct", canary, 0)
		if err != nil {
			b.Fatal(err)
		}
		s, _ := p.NewSession("US", time.Hour, time.Now())
		c, err := sessions.NewCollector(context.Background(), s, &sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), IgnoreRobotsTxt: true})
		if err != nil {
			b.Fatal(err)
		}
		defer c.Close()
		b.ReportAllocs()
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			if _, err := c.Get(page); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("CollyProxy", func(b *testing.B) {
		c := colly.NewCollector(colly.AllowURLRevisit())
		u := &url.URL{Scheme: "http", Host: proxy.Addr, User: url.UserPassword("acct-country-us-session-bench001", canary)}
		if err := c.SetProxy(u.String()); err != nil {
			b.Fatal(err)
		}
		b.ReportAllocs()
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			if err := c.Visit(page); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("CollyDirect", func(b *testing.B) {
		c := colly.NewCollector(colly.AllowURLRevisit())
		b.ReportAllocs()
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			if err := c.Visit(page); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkFetchNewSession is the per-job shape of a worker (issue 11 item 2): every job
// gets a new session and a new bound collector, fetches one plain-HTTP page through the
// proxy and closes it; 20 jobs run at once (asynq's concurrency).
func BenchmarkFetchNewSession(b *testing.B) {
	proxy := testutil.NewFakeProxy(b, testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: "acct", Password: canary})
	site := testutil.NewFakeSite(b, testutil.FakeSiteConfig{})
	page := site.URL + "/search?q=sku-1"
	p, err := sessions.NewProvider("generic", proxy.Addr, "{user}[-country-{country}]-session-{session}", "{pass}", "acct", canary, 0)
	if err != nil {
		b.Fatal(err)
	}
	cfg := &sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), IgnoreRobotsTxt: true}
	b.ReportAllocs()
	b.SetParallelism(10) // 10 × GOMAXPROCS(2) = 20 concurrent jobs
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			s, err := p.NewSession("US", time.Hour, time.Now())
			if err != nil {
				b.Error(err)
				return
			}
			c, err := sessions.NewCollector(context.Background(), s, cfg)
			if err != nil {
				b.Error(err)
				return
			}
			if _, err := c.Get(page); err != nil {
				b.Error(err)
			}
			c.Close()
		}
	})
}
