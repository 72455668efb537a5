package handlers_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestCostPerAttempt: a worker whose provider has a price (8.40 USD/GB, 10.00 for US exits)
// records on every attempt its bytes at that price (bytes × price ÷ 10^9, its share of a
// running total rounded once: within one micro-unit of the exact figure);
// idemscrape_proxy_cost_total counts the same money; and StatsCost adds it up so that
// useful + waste by category, and the sums by kind, window and endpoint, each equal the sum
// of the attempts' costs.
func TestCostPerAttempt(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	price, err := sessions.ParsePrice("8.40 USD/GB")
	require.NoError(t, err)
	price, err = price.WithCountries("US=10")
	require.NoError(t, err)
	metrics := prometheus.NewRegistry()
	reg := r.registry(t, func(c *handlers.Config) {
		c.Provider, err = c.Provider.WithPrice(price)
		require.NoError(t, err)
		c.Registerer = metrics
	})

	retried, task := r.job(t, "sku-30")
	r.site.Throttle(1, time.Second)
	require.True(t, decisionOf(reg.ProcessTask(ctx, task)).Retry, "attempt 1 throttled")
	require.NoError(t, reg.ProcessTask(ctx, task), "attempt 2 completes")
	first, task := r.job(t, "sku-31")
	require.NoError(t, reg.ProcessTask(ctx, task))

	var sum, waste int64
	for _, key := range []string{retried, first} {
		atts, err := r.st.AttemptList(ctx, key)
		require.NoError(t, err)
		for _, a := range atts {
			require.Positive(t, a.Bytes, "%s attempt %d moved bytes", key, a.AttemptNo)
			exact := float64(a.Bytes) * 10_000_000 / 1e9 // US price
			require.InDelta(t, exact, float64(a.CostMicros), 1, "%s attempt %d: %d bytes at 10.00 USD/GB", key, a.AttemptNo, a.Bytes)
			require.Equal(t, "USD", a.Currency)
			sum += a.CostMicros
			if a.Outcome != store.OutcomeComplete {
				require.Equal(t, store.OutcomeRetryable, a.Outcome)
				waste += a.CostMicros
			}
		}
	}
	require.Positive(t, waste)

	var metric float64
	for _, m := range metricFamily(t, metrics, "idemscrape_proxy_cost_total") {
		require.True(t, labelled(m, "provider", "generic") && labelled(m, "currency", "USD") && labelled(m, "kind", "catalog"))
		metric += m.GetCounter().GetValue()
	}
	require.InDelta(t, float64(sum)/1e6, metric, 1e-9, "the metric counts the same money")

	costs, err := r.st.StatsCost(ctx)
	require.NoError(t, err)
	require.Len(t, costs, 1)
	c := costs[0]
	require.Equal(t, "USD", c.Currency)
	require.Equal(t, sum, c.TotalMicros)
	require.Equal(t, int64(3), c.Attempts)
	require.Equal(t, int64(2), c.CompletedJobs)
	require.Equal(t, (sum+1)/2, c.PerCompletedJobMicros)
	require.Equal(t, map[string]int64{"retryable/" + string(tasks.CategoryThrottled): waste}, c.Waste)
	require.Equal(t, sum-waste, c.UsefulMicros)
	require.Equal(t, map[string]int64{"catalog": sum}, c.ByKind)
	require.Equal(t, map[string]int64{"2026-04-23": sum}, c.ByWindow)
	require.Equal(t, map[string]int64{r.proxy.Addr: sum}, c.ByProxyEndpoint)
}

// TestCostRoundedOnce: the attempts' costs add up to their bytes' cost rounded once, not
// to one rounding per attempt: at 0.15 USD/GB an attempt of a few KB costs under one
// micro-unit, which rounded on its own is 0 or 1 (−100 % or up to +150 %), and on small
// pages at real prices an error of 1–4 % that does not average out (every page of a kind
// has about the same size).
func TestCostRoundedOnce(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	// A price no other test uses: the process's meter (sessions.DefaultCostMeter) starts at 0.
	price := sessions.Price{Currency: "USD", MicrosPerGB: 150_001}
	reg := r.registry(t, func(c *handlers.Config) {
		var err error
		c.Provider, err = c.Provider.WithPrice(price)
		require.NoError(t, err)
	})
	var bytes, micros, rounded int64
	for i := range 8 {
		key, task := r.job(t, fmt.Sprintf("sku-%d", 40+i))
		require.NoError(t, reg.ProcessTask(ctx, task))
		atts, err := r.st.AttemptList(ctx, key)
		require.NoError(t, err)
		for _, a := range atts {
			bytes += a.Bytes
			micros += a.CostMicros
			rounded += price.Cost(a.Bytes, "US")
		}
	}
	require.Positive(t, bytes)
	t.Logf("%d bytes: %d micro-units charged, %d exact, %d rounded per attempt", bytes, micros, price.Cost(bytes, "US"), rounded)
	require.Equal(t, price.Cost(bytes, "US"), micros, "the attempts' costs are their bytes' cost, rounded once")
	costs, err := r.st.StatsCost(ctx)
	require.NoError(t, err)
	require.Len(t, costs, 1)
	require.Equal(t, micros, costs[0].TotalMicros)
}

// TestRefusalsNotCharged: the proxy's own refusals — a 407 for the account, a 502 "no peer
// in the country" (three sessions: the unit replays twice) — move bytes on the wire but
// carry no exit's traffic, which is what providers bill: their attempts record no bytes
// and no cost.
func TestRefusalsNotCharged(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name    string
		proxy   testutil.FakeProxyConfig
		refuse  bool
		outcome string
	}{
		{"ProxyAuth407", testutil.FakeProxyConfig{}, true, store.OutcomeRetryable},
		{"NoPeers502", testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: "acct", Password: canary,
			UnavailableCountries: []string{"US"}, ErrorHeaders: true}, false, store.OutcomeRetryable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t, rigOpts{proxy: tc.proxy})
			r.proxy.SetRefusing(tc.refuse)
			metrics := prometheus.NewRegistry()
			reg := r.registry(t, func(c *handlers.Config) {
				var err error
				c.Registerer = metrics
				c.Provider, err = c.Provider.WithPrice(sessions.Price{Currency: "USD", MicrosPerGB: 8_400_000})
				require.NoError(t, err)
				// The job's own request meets the refusal, not a robots.txt fetch (whose bytes
				// are the fleet's anyway).
				c.Collector.IgnoreRobotsTxt = true
			})
			key, task := r.job(t, "sku-48")
			require.True(t, decisionOf(reg.ProcessTask(ctx, task)).Retry)
			atts, err := r.st.AttemptList(ctx, key)
			require.NoError(t, err)
			require.Len(t, atts, 1)
			require.Equal(t, tc.outcome, atts[0].Outcome)
			require.Zero(t, atts[0].Bytes, "the refusals' bytes are not the job's")
			require.Zero(t, atts[0].CostMicros, "nor is their cost")
			var refused float64
			for _, m := range metricFamily(t, metrics, "idemscrape_proxy_refused_bytes_total") {
				require.True(t, labelled(m, "kind", "catalog") && labelled(m, "provider", "generic"))
				refused += m.GetCounter().GetValue()
			}
			require.Positive(t, refused, "the refusals did move bytes on the wire, counted apart")
			// All of them: what the proxy exchanged with the worker (its count of its last
			// write may land after the worker read it).
			require.Eventually(t, func() bool {
				from, to := r.proxy.ClientBytes()
				return float64(from+to) == refused
			}, 10*time.Second, 5*time.Millisecond, "the refused bytes are what the proxy moved")
		})
	}
}

// TestJobMoneyBudget: a kind's money budget is the bytes it buys at the exit's price. A
// page that costs more than the whole budget stops inside its first attempt (the 20 MiB
// page is cut near the budget's bytes) and fails the job as budget_exceeded, not retried;
// a kind with a money budget can not be registered on a worker without a price.
func TestJobMoneyBudget(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	big := func(job tasks.Payload) (*sessions.Unit, error) {
		return &sessions.Unit{Steps: []sessions.Step{{Name: "big", Safe: true, Run: func(ctx context.Context, sc *sessions.StepContext) error {
			resp, err := sc.Get(r.site.URL + "/big") // 20 MiB
			if err != nil {
				return err
			}
			return sc.Staging.Put("size", len(resp.Body))
		}}}}, nil
	}
	money := handlers.WithRetry(handlers.RetryConfig{MoneyBudget: 2_560}) // 0.00256 USD: 256 KB at 10 USD/GB
	newReg := func(prov *sessions.Provider) *handlers.Registry {
		reg, err := handlers.NewRegistry(handlers.Config{Store: r.st, Redis: r.ns.Client, Provider: prov, KeyPrefix: r.ns.Prefix,
			Collector: sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), MaxBodyBytes: 64 << 20}})
		require.NoError(t, err)
		t.Cleanup(reg.Close)
		return reg
	}

	err := newReg(r.prov).Register(catalog.Kind, big, catalog.Parse, money)
	require.ErrorContains(t, err, `kind "catalog": a money budget of 2560 micro-units needs a price above 0 on provider generic`)

	priced, err := r.prov.WithPrice(sessions.Price{Currency: "USD", MicrosPerGB: 10_000_000})
	require.NoError(t, err)
	reg := newReg(priced)
	require.NoError(t, reg.Register(catalog.Kind, big, catalog.Parse, money))
	key, task := r.job(t, "sku-32")
	require.ErrorIs(t, reg.ProcessTask(ctx, task), asynq.SkipRetry)
	job := requireJob(t, r.st, key, tasks.StateFailed, tasks.CategoryBudgetExceeded)
	const budgetBytes = 256_000
	require.Greater(t, job.BytesTotal, int64(budgetBytes), "stopped past the budget's bytes")
	require.Less(t, job.BytesTotal, int64(4*budgetBytes), "stopped near them, not after 20 MiB")
	atts, err := r.st.AttemptList(ctx, key)
	require.NoError(t, err)
	require.Len(t, atts, 1)
	require.Equal(t, priced.Price().Cost(atts[0].Bytes, "US"), atts[0].CostMicros, "the overrun is on the record, at the price")
	require.Contains(t, atts[0].Error, "the job's money budget: 2560 of 2560 micro-units USD left", "the error names the money budget")
}

// TestMoneyBudgetNeedsOneCurrency: a money budget is refused on providers without a price
// above 0, or billing in different currencies.
func TestMoneyBudgetNeedsOneCurrency(t *testing.T) {
	r := newRig(t, rigOpts{})
	priced := func(name string, price sessions.Price) *sessions.Provider {
		p, err := sessions.NewProvider(name, r.proxy.Addr, "{user}-session-{session}", "{pass}", "acct", canary, 0)
		require.NoError(t, err)
		p, err = p.WithPrice(price)
		require.NoError(t, err)
		return p
	}
	usd, eur, free := sessions.Price{Currency: "USD", MicrosPerGB: 8_000_000}, sessions.Price{Currency: "EUR", MicrosPerGB: 7_000_000},
		sessions.Price{Currency: "USD"}
	money := handlers.WithRetry(handlers.RetryConfig{MoneyBudget: 1_000})
	for name, tc := range map[string]struct {
		providers []*sessions.Provider
		want      string
	}{
		"TwoCurrencies": {[]*sessions.Provider{priced("a", usd), priced("b", eur)}, "provider a bills in USD and b in EUR"},
		"FreeProvider":  {[]*sessions.Provider{priced("a", usd), priced("b", free)}, "needs a price above 0 on provider b"},
	} {
		t.Run(name, func(t *testing.T) {
			reg, err := handlers.NewRegistry(handlers.Config{Store: r.st, Redis: r.ns.Client, Providers: tc.providers, KeyPrefix: r.ns.Prefix,
				Collector: sessions.CollectorConfig{Guard: sessions.LoopbackGuard()}})
			require.NoError(t, err)
			t.Cleanup(reg.Close)
			require.ErrorContains(t, reg.Register(catalog.Kind, catalog.Workflow(r.site.URL), catalog.Parse, money), tc.want)
			require.NoError(t, reg.Register(catalog.Kind, catalog.Workflow(r.site.URL), catalog.Parse), "without a money budget")
		})
	}
}
