package sessions_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
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
	assert.Equal(t, 1, seen[0].Skipped, "the picture was not loaded")
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
	_ = tasks.CategorySessionLost
	_ = time.Second
}
