package handlers_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/testutil"
)

// armedGate is the shop through a reverse proxy that, once armed, holds every price
// request until release is closed, reporting each on held.
type armedGate struct {
	URL     string
	armed   atomic.Bool
	held    chan string
	release chan struct{}
	once    sync.Once
}

func newArmedGate(t testing.TB, site string) *armedGate {
	target, err := url.Parse(site)
	require.NoError(t, err)
	rp := httputil.NewSingleHostReverseProxy(target)
	g := &armedGate{held: make(chan string, 1000), release: make(chan struct{})}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if g.armed.Load() && strings.HasPrefix(r.URL.Path, "/api/price/") {
			g.held <- r.URL.Path
			select {
			case <-g.release:
			case <-r.Context().Done():
				return
			}
		}
		rp.ServeHTTP(w, r)
	}))
	g.URL = srv.URL
	t.Cleanup(srv.Close)
	t.Cleanup(g.open)
	return g
}

func (g *armedGate) open() { g.once.Do(func() { close(g.release) }) }

// TestBudgetDoesNotThrottle: a window budget ten times what the window's work costs lets
// the attempts in flight reach the configured concurrency. Once the kind's cost per
// attempt is measured (MinSamples attempts), each attempt reserves a high percentile of
// it with a margin — not its whole byte cap (10 MiB here, 6,000 times a job), which let
// one attempt run at a time and sent every other delivery back to wait. The site holds
// every price request until all the deliveries are either held there (in flight) or have
// returned: no timing is asserted. The log says how many reservations the budget covers.
func TestBudgetDoesNotThrottle(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{site: testutil.FakeSiteConfig{Products: 40}})
	priced, err := r.prov.WithPrice(sessions.Price{Currency: "USD", MicrosPerGB: 1_000_000_000}) // 1 micro-unit a byte
	require.NoError(t, err)
	const warm, inFlight, capBytes = 5, 8, 10 << 20
	const jobCost = 2_000 // a catalog job moves about 1.7 KB
	const budget = 10 * (warm + inFlight) * jobCost
	gate := newArmedGate(t, r.site.URL)
	logs := &testutil.SyncBuffer{}
	reg := gatedRegistry(t, r, gate.URL, func(c *handlers.Config) {
		c.Provider, c.Logger = priced, jsonLogger(logs)
	}, handlers.WithRetry(handlers.RetryConfig{BandwidthBudget: capBytes}),
		handlers.WithWindowBudget(handlers.WindowBudget{Money: budget, MinSamples: warm, Concurrency: inFlight}))

	// The kind's cost per attempt is measured on a few jobs.
	for i := range warm {
		_, task := r.job(t, fmt.Sprintf("sku-%d", 20+i))
		require.NoError(t, reg.ProcessTask(ctx, task))
	}
	assert.Contains(t, logs.String(), "window money budget covers fewer attempts at once than the concurrency: until the kind's cost per attempt is measured",
		"the start warns: at its byte cap an attempt reserves more than the whole budget")

	gate.armed.Store(true)
	type done struct {
		key string
		d   asynqDecision
	}
	results := make(chan done, inFlight)
	for i := range inFlight {
		key, task := r.job(t, fmt.Sprintf("sku-%d", i+1))
		go func() { results <- done{key, decisionOf(reg.ProcessTask(ctx, task))} }()
	}
	held, early := 0, []done{}
	timeout := time.After(2 * time.Minute) // bounds a hung run only
	for held+len(early) < inFlight {
		select {
		case <-gate.held:
			held++
		case d := <-results:
			early = append(early, d)
		case <-timeout:
			t.Fatalf("%d held, %d returned of %d", held, len(early), inFlight)
		}
	}
	gate.open()
	assert.Equal(t, inFlight, held, "every delivery is in flight at once; those that returned first: %+v", early)
	for range inFlight - len(early) {
		d := <-results
		assert.True(t, d.d.Ack, "%s: %+v", d.key, d.d)
	}

	wb, err := lua.NewWindowBudgets(r.ns.Client, r.ns.Prefix)
	require.NoError(t, err)
	spent, reserved, ok, err := wb.Spent(ctx, catalog.Kind, "2026-04-23")
	require.NoError(t, err)
	require.True(t, ok)
	inPG, err := r.st.WindowCost(ctx, catalog.Kind, "2026-04-23", "USD")
	require.NoError(t, err)
	assert.Equal(t, inPG, spent)
	assert.Zero(t, reserved)
	assert.Less(t, spent, int64(budget))
	line := ""
	for _, l := range strings.Split(logs.String(), "\n") {
		if strings.Contains(l, `"measured":true`) {
			line = l
		}
	}
	require.NotEmpty(t, line, "the measured reservation is logged:\n%s", logs.String())
	t.Logf("%d micro-units spent of %d; %s", spent, budget, line)
}
