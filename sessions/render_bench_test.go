package sessions_test

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/testutil"
)

// BenchmarkRender loads the JavaScript product page of the fake shop through the fake
// proxy, each iteration on a new session (a fresh browser context, as a job gets):
//   - Colly: the session-bound collector fetches the page's HTML (no price: JavaScript
//     writes it);
//   - Render: Chromium renders it and its price XHR (the picture blocked, as by default);
//   - RenderImages: the same with the 256 KiB picture loaded.
//
// Reported per page: bytes through the proxy (B/page) and, for the renders, the resident
// memory of the pool's Chromium process tree after the run (MB/browser).
func BenchmarkRender(b *testing.B) {
	proxy := testutil.NewFakeProxy(b, testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: "acct", Password: canary})
	site := testutil.NewFakeSite(b, testutil.FakeSiteConfig{})
	prov, err := sessions.NewProvider("generic", proxy.Addr, "{user}[-country-{country}]-session-{session}", "{pass}", "acct", canary, 0)
	if err != nil {
		b.Fatal(err)
	}
	page := site.URL + "/js/product/sku-1"
	bound := func(b *testing.B, pool *sessions.BrowserPool) *sessions.Bound {
		s, _ := prov.NewSession("US", time.Hour, time.Now())
		c, err := sessions.NewCollector(context.Background(), s, &sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), IgnoreRobotsTxt: true, Browsers: pool})
		if err != nil {
			b.Fatal(err)
		}
		if _, err := c.Get(site.URL + "/search?q=sku-1"); err != nil { // the shop's cookie
			b.Fatal(err)
		}
		return c
	}
	b.Run("Colly", func(b *testing.B) {
		var moved int64
		for b.Loop() {
			c := bound(b, nil)
			before := c.Bytes()
			if _, err := c.Get(page); err != nil {
				b.Fatal(err)
			}
			moved += c.Bytes() - before
			c.Close()
		}
		b.ReportMetric(float64(moved)/float64(b.N), "B/page")
	})
	for _, tc := range []struct {
		name string
		load []string
	}{{"Render", nil}, {"RenderImages", []string{"Image"}}} {
		b.Run(tc.name, func(b *testing.B) {
			pool, err := sessions.NewBrowserPool(sessions.BrowserConfig{MaxBrowsers: 1, LoadResources: tc.load})
			if err != nil {
				b.Fatal(err)
			}
			defer pool.Close()
			warm := bound(b, pool) // starts the process outside the timing
			if _, err := warm.Render(page, sessions.RenderOptions{WaitFor: "#price.ready"}); err != nil {
				b.Fatal(err)
			}
			warm.Close()
			var moved int64
			b.ResetTimer()
			for b.Loop() {
				c := bound(b, pool)
				before := c.Bytes()
				if _, err := c.Render(page, sessions.RenderOptions{WaitFor: "#price.ready"}); err != nil {
					b.Fatal(err)
				}
				moved += c.Bytes() - before
				c.Close()
			}
			b.ReportMetric(float64(moved)/float64(b.N), "B/page")
			var rss int64
			for _, pid := range pool.Processes() {
				rss += treeRSS(pid)
			}
			b.ReportMetric(float64(rss)/(1<<20), "MB/browser")
		})
	}
}

// treeRSS is the resident memory of a process and its descendants, in bytes.
func treeRSS(root int) int64 {
	children := map[int][]int{}
	entries, _ := os.ReadDir("/proc")
	for _, en := range entries {
		pid, err := strconv.Atoi(en.Name())
		if err != nil {
			continue
		}
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		fields := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
		if len(fields) > 1 {
			if ppid, err := strconv.Atoi(fields[1]); err == nil {
				children[ppid] = append(children[ppid], pid)
			}
		}
	}
	var total int64
	var walk func(int)
	walk = func(pid int) {
		f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
		if err == nil {
			sc := bufio.NewScanner(f)
			for sc.Scan() {
				if rest, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
					kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
					total += kb << 10
				}
			}
			f.Close()
		}
		for _, c := range children[pid] {
			walk(c)
		}
	}
	walk(root)
	return total
}
