package handlers_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// failoverRig is a worker with two providers on the rig's account, alpha (the rig's proxy
// a) then beta (a second proxy b), on a test clock, registering catalog with one attempt
// (a counted failure would fail the job).
type failoverRig struct {
	*rig
	a, b    *testutil.FakeProxy
	clock   *testutil.Clock
	metrics *prometheus.Registry
	reg     *handlers.Registry
}

// newFailoverRig builds the failover rig; mutate may change the config before it is built.
func newFailoverRig(t *testing.T, mutate func(*handlers.Config)) *failoverRig {
	t.Helper()
	r := newRig(t, rigOpts{})
	f := &failoverRig{rig: r, a: r.proxy,
		b:       testutil.NewFakeProxy(t, testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: "acct", Password: canary}),
		clock:   testutil.NewClock(time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC)),
		metrics: prometheus.NewRegistry(),
	}
	cfg := handlers.Config{
		Store: r.st, Redis: r.ns.Client, Providers: []*sessions.Provider{newProvider(t, "alpha", f.a.Addr), newProvider(t, "beta", f.b.Addr)}, KeyPrefix: r.ns.Prefix,
		Collector:             sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), RequestTimeout: 5 * time.Second},
		Logger:                slog.New(slog.NewTextHandler(testWriter{t}, nil)),
		Registerer:            f.metrics,
		Now:                   f.clock.Now,
		Rand:                  func() float64 { return 0 },
		IncidentProbeInterval: time.Minute,
	}
	if mutate != nil {
		mutate(&cfg)
	}
	var err error
	f.reg, err = handlers.NewRegistry(cfg)
	require.NoError(t, err)
	t.Cleanup(f.reg.Close)
	require.NoError(t, f.reg.Register(catalog.Kind, catalog.Workflow(r.site.URL), catalog.Parse,
		handlers.WithRetry(handlers.RetryConfig{MaxAttempts: 1})))
	return f
}

// TestProviderFailover: a worker with two providers, alpha then beta. Alpha starts
// answering 407 (its password rotated): the attempt that met it is retryable and not
// counted, alpha's breaker opens, and the job and the next ones run on beta; the worker
// stays ready. No unit mixes providers: every session's bytes went through one proxy, the
// one its attempt records. Alpha answers again: once its probe interval has passed the next
// delivery is its probe, which authenticates, and alpha takes work again. With both
// refusing, the worker stops taking work (Ready names both). The clock is the test's: the
// breakers' schedule does not depend on this box's pace.
func TestProviderFailover(t *testing.T) {
	ctx := context.Background()
	f := newFailoverRig(t, func(c *handlers.Config) { c.IncidentProbeMax = 2 * time.Minute })
	r, a, b, reg, metrics := f.rig, f.a, f.b, f.reg, f.metrics
	gauge := func(provider string) float64 {
		for _, m := range metricFamily(t, metrics, "idemscrape_provider_incident_open") {
			if labelled(m, "provider", provider) {
				return m.GetGauge().GetValue()
			}
		}
		return 0
	}
	run := func(sku string) (string, error) {
		key, task := r.job(t, sku)
		return key, reg.ProcessTask(ctx, task)
	}
	rerun := func(key string) error {
		j, err := r.st.JobGet(ctx, key)
		require.NoError(t, err)
		_, task := r.job(t, j.SourceID)
		return reg.ProcessTask(ctx, task)
	}

	k1, err := run("sku-40")
	require.NoError(t, err, "alpha first")

	a.SetRefusing(true)
	k2, err := run("sku-41")
	dec := decisionOf(err)
	require.True(t, dec.Retry, "the 407 is the account's, not the job's: %v", err)
	require.False(t, dec.Counted, "not counted against the job")
	require.LessOrEqual(t, dec.Delay, time.Second, "the job goes to beta at once, not after alpha's probe")
	require.Equal(t, 1.0, gauge("alpha"))
	require.Equal(t, 0.0, gaugeValue(t, metrics, "idemscrape_incident_open"), "the worker still takes work")
	require.NoError(t, reg.Ready())
	require.NoError(t, rerun(k2), "on beta")
	k3, err := run("sku-42")
	require.NoError(t, err, "on beta")

	// Alpha is fixed; its probe is due after its interval: the next delivery probes it.
	a.SetRefusing(false)
	f.clock.Advance(time.Minute)
	k4, err := run("sku-43")
	require.NoError(t, err, "alpha's probe")
	require.Equal(t, 0.0, gauge("alpha"), "alpha restored")
	k5, err := run("sku-44")
	require.NoError(t, err, "alpha again")

	want := map[string][]string{ // each job's attempts: outcome@provider
		k1: {"complete@alpha"},
		k2: {"retryable/proxy_auth@alpha", "complete@beta"},
		k3: {"complete@beta"},
		k4: {"complete@alpha"},
		k5: {"complete@alpha"},
	}
	gateways := map[string]string{a.Addr: "alpha", b.Addr: "beta"}
	for key, outcomes := range want {
		atts, err := r.st.AttemptList(ctx, key)
		require.NoError(t, err)
		var got []string
		for _, at := range atts {
			o := at.Outcome
			if at.Category != "" {
				o += "/" + at.Category
			}
			got = append(got, o+"@"+gateways[at.ProxyEndpoint])
			if at.Outcome != store.OutcomeComplete {
				continue
			}
			// The unit's bytes went through its own provider's proxy only.
			onA, onB := a.BytesFor(at.SessionID), b.BytesFor(at.SessionID)
			require.Positive(t, onA+onB, "%s: session %s moved bytes", key, at.SessionID)
			require.True(t, (onA > 0) != (onB > 0), "%s: session %s went through both proxies", key, at.SessionID)
			require.Equal(t, gateways[at.ProxyEndpoint] == "alpha", onA > 0, key)
		}
		require.Equal(t, outcomes, got, key)
	}
	require.Zero(t, countState(t, r.st, tasks.StateFailed), "no job failed for the incident")
	require.Equal(t, int64(1), a.Refused())

	// Both refuse: the worker stops taking work, and says why.
	a.SetRefusing(true)
	b.SetRefusing(true)
	_, err = run("sku-45")
	require.True(t, decisionOf(err).Retry)
	_, err = run("sku-46") // beta meets its 407 now
	require.True(t, decisionOf(err).Retry)
	require.ErrorIs(t, reg.Ready(), handlers.ErrIncident)
	require.ErrorContains(t, reg.Ready(), "provider alpha")
	require.ErrorContains(t, reg.Ready(), "provider beta")
	require.NotContains(t, reg.Ready().Error(), canary)
	require.Equal(t, 1.0, gaugeValue(t, metrics, "idemscrape_incident_open"))
	refused := a.Refused() + b.Refused()
	_, err = run("sku-47")
	dec = decisionOf(err)
	require.True(t, dec.Retry && !dec.Counted, "handed back untouched")
	require.Equal(t, refused, a.Refused()+b.Refused(), "no proxy was asked")
	require.Zero(t, countState(t, r.st, tasks.StateFailed))
}

func TestProvidersConfig(t *testing.T) {
	r := newRig(t, rigOpts{})
	other, err := sessions.NewProvider("generic", "127.0.0.1:1", "{user}-session-{session}", "{pass}", "acct", canary, 0)
	require.NoError(t, err)
	base := handlers.Config{Store: r.st, Redis: r.ns.Client, KeyPrefix: r.ns.Prefix}
	cfg := base
	cfg.Providers = []*sessions.Provider{r.prov, other}
	_, err = handlers.NewRegistry(cfg)
	require.ErrorContains(t, err, "provider generic twice")
	cfg = base
	cfg.Provider, cfg.Providers = other, []*sessions.Provider{r.prov}
	_, err = handlers.NewRegistry(cfg)
	require.ErrorContains(t, err, "set Providers alone")
	cfg = base
	cfg.Providers = []*sessions.Provider{nil}
	_, err = handlers.NewRegistry(cfg)
	require.ErrorContains(t, err, "Providers[0] is nil")
	_, err = handlers.NewRegistry(base)
	require.ErrorContains(t, err, "Provider (or Providers)")
}

// TestProviderOutOfBalance: provider alpha's account runs out of balance (402 Payment
// Required with the provider's error header): an incident like a 407 — alpha's breaker
// opens, the job goes to beta at once, uncounted, and completes there; once the balance is
// topped up, alpha's probe authenticates and it takes work again.
func TestProviderOutOfBalance(t *testing.T) {
	ctx := context.Background()
	f := newFailoverRig(t, nil)
	r, a, b, reg := f.rig, f.a, f.b, f.reg

	a.SetOutOfBalance(true)
	key, task := r.job(t, "sku-40")
	dec := decisionOf(reg.ProcessTask(ctx, task))
	require.True(t, dec.Retry && !dec.Counted, "the account's failure, not the job's: %+v", dec)
	require.LessOrEqual(t, dec.Delay, time.Second)
	require.NoError(t, reg.ProcessTask(ctx, task), "on beta")
	atts, err := r.st.AttemptList(ctx, key)
	require.NoError(t, err)
	require.Len(t, atts, 2)
	require.Equal(t, string(tasks.CategoryProxyAuth), atts[0].Category)
	require.Contains(t, atts[0].Error, "402")
	require.Equal(t, b.Addr, atts[1].ProxyEndpoint)
	require.Equal(t, store.OutcomeComplete, atts[1].Outcome)
	for _, m := range metricFamily(t, f.metrics, "idemscrape_provider_incident_open") {
		if labelled(m, "provider", "alpha") {
			require.Equal(t, 1.0, m.GetGauge().GetValue())
		}
	}

	a.SetOutOfBalance(false)
	f.clock.Advance(time.Minute)
	probe, task := r.job(t, "sku-41")
	require.NoError(t, reg.ProcessTask(ctx, task), "alpha's probe")
	atts, err = r.st.AttemptList(ctx, probe)
	require.NoError(t, err)
	require.Equal(t, a.Addr, atts[0].ProxyEndpoint, "alpha takes work again")
}
