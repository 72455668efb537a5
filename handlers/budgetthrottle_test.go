package handlers_test

import (
	"context"
	"encoding/json"
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

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/tasks"
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

	// A worker that starts now reserves the measured cost at once: PostgreSQL's record of
	// the kind's recent attempts seeds its measurements.
	logs2 := &testutil.SyncBuffer{}
	reg2 := gatedRegistry(t, r, gate.URL, func(c *handlers.Config) {
		c.Provider, c.Logger = priced, jsonLogger(logs2)
	}, handlers.WithRetry(handlers.RetryConfig{BandwidthBudget: capBytes}),
		handlers.WithWindowBudget(handlers.WindowBudget{Money: budget, MinSamples: warm, Concurrency: inFlight}))
	_, task := r.job(t, "sku-30")
	require.NoError(t, reg2.ProcessTask(ctx, task))
	assert.Contains(t, logs2.String(), `"measured":true`)
	assert.NotContains(t, logs2.String(), `"measured":false`)
}

// BenchmarkWindowBudget processes b.N jobs (one 8 KB page each) through a real asynq
// server (concurrency 20), without a window budget and with one ten times the work's
// cost, at the figures: a 50 MiB byte cap at 8.40 USD/GB (0.44 USD a cap). With
// the byte cap as the reservation the budget let a job or two run at a time; at the
// measured cost per attempt it does not hold the workers back. BudgetCold is a kind
// without a history (its first DefaultWindowMinSamples attempts reserve their cap, and
// the deliveries that meet the rest reserved wait 1–6 s); BudgetWarm one whose recent
// attempts PostgreSQL records.
func BenchmarkWindowBudget(b *testing.B) {
	for _, mode := range []string{"NoBudget", "BudgetCold", "BudgetWarm"} {
		b.Run(mode, func(b *testing.B) {
			r := newBenchRig(b)
			priced, err := r.prov.WithPrice(sessions.Price{Currency: "USD", MicrosPerGB: 8_400_000})
			if err != nil {
				b.Fatal(err)
			}
			reg, err := handlers.NewRegistry(handlers.Config{
				Store: r.st, Redis: r.ns.Client, Provider: priced, KeyPrefix: r.ns.Prefix,
				Collector: sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), IgnoreRobotsTxt: true},
				Logger:    discardLogger(),
			})
			if err != nil {
				b.Fatal(err)
			}
			defer reg.Close()
			opts := []handlers.KindOption{handlers.WithRetry(handlers.RetryConfig{BandwidthBudget: 50 << 20})}
			// A job moves about 8.5 KB: 72 micro-units. Ten times the work, and at least
			// enough for the first attempts' reservations at their cap.
			budget := max(int64(b.N)*72*10, 10*sessions.Price{Currency: "USD", MicrosPerGB: 8_400_000}.Cost(50<<20, ""))
			if mode != "NoBudget" {
				opts = append(opts, handlers.WithWindowBudget(handlers.WindowBudget{Money: budget, Concurrency: benchConcurrency}))
			}
			if err := reg.Register("page", pageWorkflow(r.site.URL+"/big"), pageParse, opts...); err != nil {
				b.Fatal(err)
			}
			if mode == "BudgetWarm" {
				// The kind has a history: an earlier window's jobs, run before the timer.
				for i, key := range recordJobs(b, r.st, handlers.DefaultWindowMinSamples) {
					spec := tasks.Spec{Kind: "page", SourceID: fmt.Sprintf("p-%d", i), Country: "US", Window: "w", ParserVersion: 1}
					payload, err := json.Marshal(tasks.Payload{Key: key, Spec: spec})
					if err != nil {
						b.Fatal(err)
					}
					if err := reg.ProcessTask(context.Background(), asynq.NewTask("page", payload)); err != nil {
						b.Fatal(err)
					}
				}
			}
			r.enqueue(b, b.N)
			elapsed := r.process(b, reg, b.N)
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "jobs/s")
			if n := testutil.Count(b, r.st.Pool(), `SELECT count(*) FROM jobs WHERE state = 'complete' AND "window" = '2026-04-23'`); n != b.N {
				b.Fatalf("%d of %d jobs complete", n, b.N)
			}
		})
	}
}
