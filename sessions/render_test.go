package sessions_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/PuerkitoBio/goquery"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// newPool starts a browser pool for the test (Debian's chromium: make test-deps); every
// process it started is gone when the test ends.
func newPool(t *testing.T, cfg sessions.BrowserConfig) *sessions.BrowserPool {
	t.Helper()
	pool, err := sessions.NewBrowserPool(cfg)
	require.NoError(t, err, "Chromium is needed: make test-deps installs Debian's chromium")
	t.Cleanup(func() {
		pids := pool.Processes()
		pool.Close()
		for _, pid := range pids {
			assert.NoFileExists(t, fmt.Sprintf("/proc/%d/cmdline", pid), "Chromium %d outlived Close", pid)
		}
	})
	return pool
}

// renderUnit is the catalog flow with its product page rendered: a colly search (it sets
// the shop's sid cookie), then the JavaScript product page rendered, its price read from
// the DOM and the price XHR captured.
func renderUnit(site string, sku string, o sessions.RenderOptions, seen *[]*sessions.Rendered) *sessions.Unit {
	return &sessions.Unit{Name: "render", Steps: []sessions.Step{
		{Name: "search", Safe: true, Run: func(_ context.Context, sc *sessions.StepContext) error {
			_, err := sc.Get(site + "/search?q=" + sku)
			return err
		}},
		{Name: "render", Safe: true, Run: func(_ context.Context, sc *sessions.StepContext) error {
			r, err := sc.Render(site+"/js/product/"+sku, o)
			if err != nil {
				return err
			}
			if seen != nil {
				*seen = append(*seen, r)
			}
			doc, err := goquery.NewDocumentFromReader(strings.NewReader(r.HTML))
			if err != nil {
				return err
			}
			if err := sc.Staging.Put("price", strings.TrimSpace(doc.Find("#price").Text())); err != nil {
				return err
			}
			return sc.Staging.Put("captured", len(r.Captured))
		}},
	}}
}

// TestRenderThroughSession: a unit searches with colly and renders the JavaScript product
// page on the same session: every request the proxy authenticated carried the unit's
// sticky session, the shop (StrictExit: its cookie and token work only from the exit
// that got them) answered the page and its price XHR, the price that only JavaScript puts
// in the DOM is parsed, the XHR is captured, the picture was not loaded; the canary
// password is in no Chromium process's command line or environment, nor in the logs.
func TestRenderThroughSession(t *testing.T) {
	e := setup(t, testutil.FakeProxyConfig{Seed: 21}, testutil.FakeSiteConfig{Seed: 21, StrictExit: true})
	t.Setenv(sessions.EnvPassword, canary) // as a worker has it: Chromium must not inherit it
	pool := newPool(t, sessions.BrowserConfig{MaxBrowsers: 1})
	cfg := e.runCfg()
	cfg.Collector.Browsers = pool
	var seen []*sessions.Rendered
	unit := renderUnit(e.site.URL, "sku-3", sessions.RenderOptions{WaitFor: "#price.ready", Capture: []string{"/api/price/"}}, &seen)
	res, err := unit.Run(context.Background(), cfg)
	require.NoError(t, err)
	p, _ := e.site.Product("sku-3")
	assert.JSONEq(t, strconv.Quote(p.Price), string(res.Staged["price"]), "the price JavaScript wrote")
	assert.JSONEq(t, "1", string(res.Staged["captured"]))
	require.Len(t, seen, 1)
	var body map[string]any
	require.NoError(t, json.Unmarshal(seen[0].Captured[0].Body, &body))
	assert.Equal(t, p.Price, body["price"])
	assert.Equal(t, 200, seen[0].Status)
	assert.Equal(t, 2, seen[0].Skipped, "neither the picture nor the favicon was loaded")
	assert.Zero(t, seen[0].Refused)

	assert.Equal(t, e.proxy.Authenticated(), e.proxy.RequestsFor(res.Session.ID), "every authenticated request on the unit's session")
	assert.GreaterOrEqual(t, e.proxy.RequestsFor(res.Session.ID), int64(3), "search, page, price XHR")
	for _, pid := range pool.Processes() {
		for _, f := range []string{"cmdline", "environ"} {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/%s", pid, f))
			require.NoError(t, err)
			assert.False(t, bytes.Contains(b, []byte(canary)), "the password in Chromium's %s", f)
		}
	}
	assert.NotContains(t, e.logs.String(), canary)
}

// TestRenderCookiesShared: the sid cookie a colly step got is sent by the render (the
// shop answers the JavaScript page only with it), and the cookie the page's script set is
// sent by the next colly request.
func TestRenderCookiesShared(t *testing.T) {
	e := setup(t, testutil.FakeProxyConfig{Seed: 22}, testutil.FakeSiteConfig{Seed: 22, StrictExit: true})
	pool := newPool(t, sessions.BrowserConfig{MaxBrowsers: 1})
	cfg := e.runCfg()
	cfg.Collector.Browsers = pool
	unit := renderUnit(e.site.URL, "sku-4", sessions.RenderOptions{WaitFor: "#price.ready"}, nil)
	unit.Steps = append(unit.Steps, sessions.Step{Name: "cookies", Safe: true, Run: func(_ context.Context, sc *sessions.StepContext) error {
		resp, err := sc.Get(e.site.URL + "/cookies")
		if err != nil {
			return err
		}
		var got map[string]string
		if err := json.Unmarshal(resp.Body, &got); err != nil {
			return err
		}
		return sc.Staging.Put("cookies", got)
	}})
	res, err := unit.Run(context.Background(), cfg)
	require.NoError(t, err, "the render had the colly step's sid: the shop answered the page")
	var cookies map[string]string
	require.NoError(t, json.Unmarshal(res.Staged["cookies"], &cookies))
	assert.Equal(t, "1", cookies["rendered"], "the page's cookie went back to colly")
	assert.NotEmpty(t, cookies["sid"])

	// Without the colly step the render has no sid: the shop refuses the page.
	unit = renderUnit(e.site.URL, "sku-4", sessions.RenderOptions{}, nil)
	unit.Steps = unit.Steps[1:]
	_, err = unit.Run(context.Background(), cfg)
	assert.Equal(t, tasks.CategoryBlocked, sessions.CategoryOf(err), "403 without the session's cookie")
}

// renderProbe renders the shop's /js/probe page (query: its options besides probe) with a
// destination policy that allows only the shop's address and port, and returns what the
// render saw, the probe listener (any hit on it is a failure) and the shop.
func renderProbe(t *testing.T, seed int64, query string) (*sessions.Rendered, *testutil.FakeSite, *testutil.FakeSite) {
	t.Helper()
	e := setup(t, testutil.FakeProxyConfig{Seed: seed}, testutil.FakeSiteConfig{Seed: seed})
	pool := newPool(t, sessions.BrowserConfig{MaxBrowsers: 1})
	probe := testutil.NewFakeSite(t, testutil.FakeSiteConfig{Seed: seed + 1})
	_, sitePort, _ := strings.Cut(strings.TrimPrefix(e.site.URL, "http://"), ":")
	port, err := strconv.Atoi(sitePort)
	require.NoError(t, err)
	cfg := e.runCfg()
	cfg.Collector.Browsers = pool
	cfg.Collector.IgnoreRobotsTxt = true
	cfg.Collector.Guard = sessions.NewGuard(&tasks.DestinationPolicy{
		Allow: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Ports: []uint16{uint16(port)}})
	var seen []*sessions.Rendered
	unit := &sessions.Unit{Name: "probe", Steps: []sessions.Step{{Name: "render", Safe: true, Run: func(_ context.Context, sc *sessions.StepContext) error {
		r, err := sc.Render(e.site.URL+"/js/probe?"+query+"probe="+strings.TrimPrefix(probe.URL, "http://"), sessions.RenderOptions{WaitFor: "#done"})
		if err != nil {
			return err
		}
		seen = append(seen, r)
		return nil
	}}}}
	_, err = unit.Run(context.Background(), cfg)
	require.NoError(t, err)
	require.Len(t, seen, 1)
	return seen[0], probe, e.site
}

// TestRenderGuard: the page's script reaches for another port on 127.0.0.1 (a listener of
// the test), the metadata address and a redirect to a private address; the destination
// policy allows only the shop's address and port. Each is refused in the browser and
// counted; the listener saw nothing; the page itself rendered.
func TestRenderGuard(t *testing.T) {
	r, probe, _ := renderProbe(t, 23, "")
	assert.Equal(t, 3, r.Refused, "the other port, the metadata address, the private redirect target")
	assert.Zero(t, probe.TotalHits(), "nothing reached the other port")
	assert.GreaterOrEqual(t, r.Requests, 2, "the page and its redirecting request went through")
}

// TestRenderGuardSocketsAndWorkers: CDP's Fetch domain sees neither WebSocket handshakes
// nor a service worker's requests, so a render allows neither: a page that opens
// WebSockets (to another port and to its own origin), a WebSocketStream, a worker that
// would open a WebSocket, and registers a service worker reaches none of them; each is
// counted as refused.
func TestRenderGuardSocketsAndWorkers(t *testing.T) {
	r, probe, site := renderProbe(t, 28, "ws=1&")
	assert.Zero(t, probe.TotalHits(), "nothing reached the other port")
	assert.Zero(t, site.Hits("/ws"), "no WebSocket handshake reached the site")
	assert.Zero(t, site.Hits("/sw.js"), "no service worker was fetched")
	assert.Equal(t, 8, r.Refused, "3 fetches, 2 WebSockets, a WebSocketStream, a service worker, a worker refused")
}

// TestRenderBytesCounted: a render's bytes are within 5 % of what the proxy moved for the
// session, and count toward the attempt; a byte budget below the page's size stops the
// render with budget_exceeded, without replay.
func TestRenderBytesCounted(t *testing.T) {
	e := setup(t, testutil.FakeProxyConfig{Seed: 25}, testutil.FakeSiteConfig{Seed: 25})
	pool := newPool(t, sessions.BrowserConfig{MaxBrowsers: 1, LoadResources: []string{"Image"}})
	cfg := e.runCfg()
	cfg.Collector.Browsers = pool
	cfg.Collector.IgnoreRobotsTxt = true
	unit := renderUnit(e.site.URL, "sku-5", sessions.RenderOptions{WaitFor: "#price.ready"}, nil)
	res, err := unit.Run(context.Background(), cfg)
	require.NoError(t, err)
	atProxy := e.proxy.BytesFor(res.Session.ID)
	t.Logf("unit bytes %d, at the proxy %d", res.Bytes, atProxy)
	assert.Greater(t, res.Bytes, int64(len(testutil.FakeSiteImage())), "the picture was loaded (allowed) and counted")
	assert.InEpsilon(t, float64(atProxy), float64(res.Bytes), 0.05)

	cfg.MaxBytes = 64 << 10 // below the picture
	unit = renderUnit(e.site.URL, "sku-5", sessions.RenderOptions{WaitFor: "#price.ready"}, nil)
	res, err = unit.Run(context.Background(), cfg)
	assert.Equal(t, tasks.CategoryBudgetExceeded, sessions.CategoryOf(err), "%v", err)
	assert.Zero(t, res.Restarts, "not replayed")
}

// TestRenderSessionLossReplays: the proxy drops the device during the render (the page's
// price XHR is cut): the staging is quarantined, the unit replays from its first step on
// a new session, and the result is all from that one session.
func TestRenderSessionLossReplays(t *testing.T) {
	e := setup(t, testutil.FakeProxyConfig{Seed: 26}, testutil.FakeSiteConfig{Seed: 26, StrictExit: true})
	pool := newPool(t, sessions.BrowserConfig{MaxBrowsers: 1})
	cfg := e.runCfg()
	cfg.Collector.Browsers = pool
	cfg.Collector.IgnoreRobotsTxt = true
	cfg.MaxSessionRestarts = 3
	first := true
	unit := renderUnit(e.site.URL, "sku-6", sessions.RenderOptions{WaitFor: "#price.ready", Timeout: 20 * time.Second}, nil)
	render := unit.Steps[1].Run
	unit.Steps[1].Run = func(ctx context.Context, sc *sessions.StepContext) error {
		if first {
			first = false
			e.proxy.SetDisconnectProb(1) // the page's requests: the device drops on the first
			defer e.proxy.SetDisconnectProb(0)
		}
		return render(ctx, sc)
	}
	res, err := unit.Run(context.Background(), cfg)
	require.NoError(t, err)
	assert.Equal(t, 1, res.Restarts)
	assert.Equal(t, []tasks.Category{tasks.CategorySessionLost}, res.RestartReasons)
	require.NotEmpty(t, e.quarantined, "the lost session's staging is quarantined")
	p, _ := e.site.Product("sku-6")
	assert.JSONEq(t, strconv.Quote(p.Price), string(res.Staged["price"]))
	assert.Len(t, res.Sessions, 2)
}

// TestBrowserPoolBounded: 20 renders at once on a pool of 2 never run more than 2
// Chromium browser processes; a Chromium killed under a render is a lost session, the unit
// replays; after Close no process is left.
func TestBrowserPoolBounded(t *testing.T) {
	e := setup(t, testutil.FakeProxyConfig{Seed: 27}, testutil.FakeSiteConfig{Seed: 27})
	pool, err := sessions.NewBrowserPool(sessions.BrowserConfig{MaxBrowsers: 2, RendersPerBrowser: 3})
	require.NoError(t, err)
	defer pool.Close()
	cfg := e.runCfg()
	cfg.Collector.Browsers = pool
	cfg.Collector.IgnoreRobotsTxt = true
	var mu sync.Mutex
	most := 0
	seenPIDs := map[int]bool{}
	errs := make(chan error, 20)
	for i := range 20 {
		go func() {
			unit := renderUnit(e.site.URL, fmt.Sprintf("sku-%d", 1+i), sessions.RenderOptions{WaitFor: "#price.ready"}, nil)
			unit.Steps[1].Run = wrapRender(unit.Steps[1].Run, func() {
				pids := pool.Processes()
				mu.Lock()
				most = max(most, len(pids))
				for _, p := range pids {
					seenPIDs[p] = true
				}
				mu.Unlock()
			})
			_, err := unit.Run(context.Background(), cfg)
			errs <- err
		}()
	}
	for range 20 {
		require.NoError(t, <-errs)
	}
	assert.LessOrEqual(t, most, 2)
	assert.LessOrEqual(t, len(chromiumBrowsers(t)), 2, "browser processes on the machine from this pool")

	// A Chromium killed under a render: the unit replays, on a new process.
	killed := false
	unit := renderUnit(e.site.URL, "sku-7", sessions.RenderOptions{WaitFor: "#never-there", Timeout: 30 * time.Second}, nil)
	inner := unit.Steps[1].Run
	unit.Steps[1].Run = func(ctx context.Context, sc *sessions.StepContext) error {
		if !killed {
			killed = true
			arrived := e.site.NextHit("/js/product/sku-7")
			go func() {
				// Only once the page's request reached the shop is the render on a browser
				// of the pool: killed earlier, the pool would reap it and start another
				// (as it does after RendersPerBrowser renders).
				select {
				case <-arrived:
				case <-t.Context().Done():
					return // the test ended without the page's request: its own errors say why
				}
				for _, pid := range pool.Processes() { // our own pool's processes, by id
					if p, err := os.FindProcess(pid); err == nil {
						_ = p.Kill()
					}
				}
			}()
			return inner(ctx, sc)
		}
		return nil
	}
	res, err := unit.Run(context.Background(), cfg)
	require.NoError(t, err)
	assert.Equal(t, []tasks.Category{tasks.CategorySessionLost}, res.RestartReasons)

	pids := pool.Processes()
	pool.Close()
	for p := range seenPIDs {
		pids = append(pids, p)
	}
	for _, pid := range pids {
		assert.NoFileExists(t, fmt.Sprintf("/proc/%d/cmdline", pid), "Chromium %d outlived Close", pid)
	}
	assert.Empty(t, chromiumBrowsers(t), "no browser process of the pool is left")
}

func wrapRender(run func(context.Context, *sessions.StepContext) error, during func()) func(context.Context, *sessions.StepContext) error {
	return func(ctx context.Context, sc *sessions.StepContext) error {
		during()
		err := run(ctx, sc)
		during()
		return err
	}
}

// chromiumBrowsers lists the Chromium browser processes (not their renderer, GPU or
// utility children) whose profile is a pool's (idemscrape-chromium-*) and whose parent is
// this test process.
func chromiumBrowsers(t *testing.T) []int {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	require.NoError(t, err)
	var pids []int
	for _, en := range entries {
		pid, err := strconv.Atoi(en.Name())
		if err != nil {
			continue
		}
		cmd, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if err != nil || !bytes.Contains(cmd, []byte("idemscrape-chromium-")) || bytes.Contains(cmd, []byte("--type=")) {
			continue
		}
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		fields := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
		if len(fields) > 1 && fields[1] == strconv.Itoa(os.Getpid()) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// TestRenderProxyAnswers: the proxy's own refusal of a render's page is classified as for
// colly — out of balance (402 with the provider's header) is proxy_auth, the account's
// incident, not the shop blocking the page.
func TestRenderProxyAnswers(t *testing.T) {
	e := setup(t, testutil.FakeProxyConfig{Seed: 28}, testutil.FakeSiteConfig{Seed: 28})
	pool := newPool(t, sessions.BrowserConfig{MaxBrowsers: 1})
	cfg := e.runCfg()
	cfg.Collector.Browsers = pool
	cfg.Collector.IgnoreRobotsTxt = true
	e.proxy.SetOutOfBalance(true)
	unit := &sessions.Unit{Name: "render", Steps: []sessions.Step{{Name: "render", Safe: true, Run: func(_ context.Context, sc *sessions.StepContext) error {
		_, err := sc.Render(e.site.URL+"/search?q=sku-1", sessions.RenderOptions{})
		return err
	}}}}
	_, err := unit.Run(context.Background(), cfg)
	assert.Equal(t, tasks.CategoryProxyAuth, sessions.CategoryOf(err), "%v", err)
}

// TestRenderExitIntegrity: the provider silently gives the session another exit between
// the colly search and the render (the fake proxy's lifetime passes on its stub clock):
// the render's responses name another exit than the session's first one, which is a lost
// session as on colly's path — staging quarantined, the unit replayed on a new session.
func TestRenderExitIntegrity(t *testing.T) {
	clock := testutil.NewClock(time.Date(2026, 4, 23, 15, 0, 0, 0, time.UTC))
	e := setup(t, testutil.FakeProxyConfig{Seed: 29, SessionLifetime: time.Minute, Now: clock.Now}, testutil.FakeSiteConfig{Seed: 29})
	var err error
	e.provider, err = e.provider.WithExitHeader("x-exit")
	require.NoError(t, err)
	pool := newPool(t, sessions.BrowserConfig{MaxBrowsers: 1})
	cfg := e.runCfg()
	cfg.Collector.Browsers = pool
	cfg.Collector.IgnoreRobotsTxt = true
	unit := renderUnit(e.site.URL, "sku-8", sessions.RenderOptions{WaitFor: "#price.ready"}, nil)
	search := unit.Steps[0].Run
	moved := false
	unit.Steps[0].Run = func(ctx context.Context, sc *sessions.StepContext) error {
		err := search(ctx, sc)
		if !moved {
			moved = true
			clock.Advance(2 * time.Minute) // the next request of this session gets a new exit
		}
		return err
	}
	res, err := unit.Run(context.Background(), cfg)
	require.NoError(t, err)
	assert.Equal(t, []tasks.Category{tasks.CategorySessionLost}, res.RestartReasons)
	require.Len(t, e.quarantined, 1)
	assert.Contains(t, e.quarantined[0].Detail, "exit changed")
	assert.True(t, res.ExitVerified)
	p, _ := e.site.Product("sku-8")
	assert.JSONEq(t, strconv.Quote(p.Price), string(res.Staged["price"]))
}
