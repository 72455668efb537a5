package handlers_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/testutil"
)

// routingRig is two workers' registries with the same providers, Redis and test clock.
type routingRig struct {
	*rig
	workers [2]*handlers.Registry
	metrics [2]*prometheus.Registry
	clock   *testutil.Clock
	keys    lua.Keys
}

func newRoutingRig(t *testing.T, providers []*sessions.Provider, routing handlers.RoutingConfig, r *rig) *routingRig {
	t.Helper()
	rr := &routingRig{rig: r, clock: testutil.NewClock(time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC))}
	var err error
	rr.keys, err = lua.NewKeys(r.ns.Prefix)
	require.NoError(t, err)
	for i := range rr.workers {
		rr.metrics[i] = prometheus.NewRegistry()
		reg, err := handlers.NewRegistry(handlers.Config{
			Store: r.st, Redis: r.ns.Client, Providers: providers, KeyPrefix: r.ns.Prefix, Routing: routing,
			Collector:          sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), RequestTimeout: 5 * time.Second},
			Logger:             slog.New(slog.NewTextHandler(testWriter{t}, nil)),
			Registerer:         rr.metrics[i],
			Now:                rr.clock.Now,
			Rand:               func() float64 { return 0 },
			MaxSessionRestarts: 1,
		})
		require.NoError(t, err)
		t.Cleanup(reg.Close)
		// Two attempts at most: a counted failure of the first would leave one.
		require.NoError(t, reg.Register(catalog.Kind, catalog.Workflow(r.site.URL), catalog.Parse,
			handlers.WithRetry(handlers.RetryConfig{MaxAttempts: 2})))
		rr.workers[i] = reg
	}
	return rr
}

// routeChanges sums idemscrape_route_changes_total for provider and reason.
func routeChanges(t *testing.T, g prometheus.Gatherer, provider, reason string) float64 {
	n := 0.0
	for _, m := range metricFamily(t, g, "idemscrape_route_changes_total") {
		if labelled(m, "provider", provider) && labelled(m, "reason", reason) {
			n += m.GetCounter().GetValue()
		}
	}
	return n
}

// endpoints lists the proxy endpoint of each attempt of key, and its outcome.
func endpoints(t *testing.T, st *store.PG, key string) (eps, outcomes []string) {
	t.Helper()
	atts, err := st.AttemptList(context.Background(), key)
	require.NoError(t, err)
	for _, a := range atts {
		eps, outcomes = append(eps, a.ProxyEndpoint), append(outcomes, a.Outcome)
	}
	return eps, outcomes
}

// TestCountryRouting: provider alpha has no peers in BR, beta has. Worker 1's BR job meets
// alpha's "no exit" once: the attempt is retried at once and uncounted, and completes on
// beta; the fleet learned it — worker 2's BR job goes to beta without touching alpha, while
// its US job still runs on alpha, the first provider. Once the mark's TTL has passed, alpha
// is tried for BR again.
func TestCountryRouting(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{proxy: testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: "acct", Password: canary,
		UnavailableCountries: []string{"BR", "JP"}}})
	a, b := r.proxy, testutil.NewFakeProxy(t, testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: "acct", Password: canary,
		UnavailableCountries: []string{"JP"}})
	routing := handlers.RoutingConfig{NoPeersFor: 20 * time.Minute}
	rr := newRoutingRig(t, []*sessions.Provider{newProvider(t, "alpha", a.Addr), newProvider(t, "beta", b.Addr)}, routing, r)

	br1, task := r.jobIn(t, "sku-1", "BR")
	d := decisionOf(rr.workers[0].ProcessTask(ctx, task))
	require.True(t, d.Retry, "%+v", d)
	assert.False(t, d.Counted, "the provider's failure, not the job's")
	assert.Equal(t, time.Second, d.Delay, "to the next provider at once")
	require.NoError(t, rr.workers[0].ProcessTask(ctx, task))
	eps, outcomes := endpoints(t, r.st, br1)
	assert.Equal(t, []string{a.Addr, b.Addr}, eps)
	assert.Equal(t, []string{store.OutcomeRetryable, store.OutcomeComplete}, outcomes)
	assert.Equal(t, 1.0, routeChanges(t, rr.metrics[0], "alpha", "no_peers"))
	ttl, err := r.ns.Client.PTTL(ctx, rr.keys.RouteNoPeers("alpha", "BR")).Result()
	require.NoError(t, err)
	assert.True(t, ttl > 0 && ttl <= routing.NoPeersFor, "the mark lasts NoPeersFor: %v", ttl)

	aBefore := a.Requests()
	br2, task := r.jobIn(t, "sku-2", "BR")
	require.NoError(t, rr.workers[1].ProcessTask(ctx, task))
	eps, _ = endpoints(t, r.st, br2)
	assert.Equal(t, []string{b.Addr}, eps, "the other worker knew")
	assert.Equal(t, aBefore, a.Requests(), "alpha was not asked for BR again")
	us, task := r.jobIn(t, "sku-3", "US")
	require.NoError(t, rr.workers[1].ProcessTask(ctx, task))
	eps, _ = endpoints(t, r.st, us)
	assert.Equal(t, []string{a.Addr}, eps, "alpha still serves US first")

	// The mark's TTL passes: alpha is tried for BR again (and still has no peers there).
	require.NoError(t, r.ns.Client.Del(ctx, rr.keys.RouteNoPeers("alpha", "BR")).Err())
	rr.clock.Advance(3 * time.Second) // past the workers' route cache
	aBefore = a.Requests()
	br3, task := r.jobIn(t, "sku-4", "BR")
	d = decisionOf(rr.workers[1].ProcessTask(ctx, task))
	require.True(t, d.Retry && !d.Counted, "%+v", d)
	assert.Greater(t, a.Requests(), aBefore, "alpha asked again")
	require.NoError(t, rr.workers[1].ProcessTask(ctx, task))
	eps, _ = endpoints(t, r.st, br3)
	assert.Equal(t, []string{a.Addr, b.Addr}, eps)

	// A country no provider serves: alpha's failure reroutes once to beta, beta's is the
	// job's own (counted), not another uncounted reroute back to alpha.
	_, task = r.jobIn(t, "sku-5", "JP")
	d = decisionOf(rr.workers[0].ProcessTask(ctx, task))
	require.True(t, d.Retry && !d.Counted, "alpha: to beta, uncounted: %+v", d)
	d = decisionOf(rr.workers[0].ProcessTask(ctx, task))
	assert.True(t, d.Counted, "beta has no exit either: the job's failure, counted: %+v", d)
}

// TestTierEscalation: a datacenter provider (1 USD/GB) and a residential one (8 USD/GB),
// configured residential first. Jobs start on the cheapest tier. The shop blocks datacenter
// exits (403): worker 1's job is escalated to residential at once, uncounted, and
// completes there; worker 2's job goes to residential directly. Once the escalation's TTL
// has passed and the shop no longer blocks, jobs run on the datacenter tier again.
func TestTierEscalation(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{proxy: testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: "acct", Password: canary, Tier: "datacenter"}})
	dcProxy := r.proxy
	resProxy := testutil.NewFakeProxy(t, testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: "acct", Password: canary, Tier: "residential"})
	provider := func(name, gateway string, tier sessions.Tier, usdPerGB int64) *sessions.Provider {
		p, err := newProvider(t, name, gateway).WithTier(tier)
		require.NoError(t, err)
		p, err = p.WithPrice(sessions.Price{Currency: "USD", MicrosPerGB: usdPerGB * 1_000_000})
		require.NoError(t, err)
		return p
	}
	routing := handlers.RoutingConfig{EscalateFor: 30 * time.Minute}
	rr := newRoutingRig(t, []*sessions.Provider{
		provider("res", resProxy.Addr, sessions.TierResidential, 8),
		provider("dc", dcProxy.Addr, sessions.TierDatacenter, 1),
	}, routing, r)

	first, task := r.jobIn(t, "sku-1", "US")
	require.NoError(t, rr.workers[0].ProcessTask(ctx, task))
	eps, _ := endpoints(t, r.st, first)
	assert.Equal(t, []string{dcProxy.Addr}, eps, "the cheapest tier first")

	r.site.SetBlockedTier("datacenter")
	blocked, task := r.jobIn(t, "sku-2", "US")
	d := decisionOf(rr.workers[0].ProcessTask(ctx, task))
	require.True(t, d.Retry, "%+v", d)
	assert.False(t, d.Counted)
	assert.Equal(t, time.Second, d.Delay)
	require.NoError(t, rr.workers[0].ProcessTask(ctx, task))
	eps, outcomes := endpoints(t, r.st, blocked)
	assert.Equal(t, []string{dcProxy.Addr, resProxy.Addr}, eps)
	assert.Equal(t, []string{store.OutcomeRetryable, store.OutcomeComplete}, outcomes)
	assert.Equal(t, 1, r.site.Blocked("datacenter"))
	assert.Equal(t, 1.0, routeChanges(t, rr.metrics[0], "dc", "blocked"))
	dest := "kind:" + catalog.Kind
	ttl, err := r.ns.Client.PTTL(ctx, rr.keys.RouteTier(dest)).Result()
	require.NoError(t, err)
	assert.True(t, ttl > 0 && ttl <= routing.EscalateFor, "the escalation lasts EscalateFor: %v", ttl)

	direct, task := r.jobIn(t, "sku-3", "US")
	require.NoError(t, rr.workers[1].ProcessTask(ctx, task))
	eps, _ = endpoints(t, r.st, direct)
	assert.Equal(t, []string{resProxy.Addr}, eps, "the other worker escalated without being blocked")
	assert.Equal(t, 1, r.site.Blocked("datacenter"))

	// The TTL passes and the shop lets datacenter exits in again: back to the cheap tier.
	r.site.SetBlockedTier("")
	require.NoError(t, r.ns.Client.Del(ctx, rr.keys.RouteTier(dest)).Err())
	rr.clock.Advance(3 * time.Second)
	again, task := r.jobIn(t, "sku-4", "US")
	require.NoError(t, rr.workers[1].ProcessTask(ctx, task))
	eps, _ = endpoints(t, r.st, again)
	assert.Equal(t, []string{dcProxy.Addr}, eps)

	// A destination that blocks the top tier too: nothing to escalate to, the job's own
	// failure (counted).
	r.site.SetBlockedTier("residential")
	require.NoError(t, r.ns.Client.Set(ctx, rr.keys.RouteTier(dest), "1", time.Minute).Err())
	rr.clock.Advance(3 * time.Second)
	top, task := r.jobIn(t, "sku-5", "US")
	d = decisionOf(rr.workers[1].ProcessTask(ctx, task))
	assert.True(t, d.Retry && d.Counted, "%+v", d)
	eps, _ = endpoints(t, r.st, top)
	assert.Equal(t, []string{resProxy.Addr}, eps)
}
