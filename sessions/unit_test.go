package sessions_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const canary = "CANARY-pw-7f3a9c"

type env struct {
	proxy    *testutil.FakeProxy
	site     *testutil.FakeSite
	provider *sessions.Provider
	logs     *bytes.Buffer
	logger   *slog.Logger

	mu          sync.Mutex
	quarantined []sessions.Quarantined
}

func setup(t *testing.T, pc testutil.FakeProxyConfig, sc testutil.FakeSiteConfig) *env {
	t.Helper()
	if pc.Format == "" {
		pc.Format, pc.User, pc.Password = testutil.ProxyFormatGeneric, "acct", canary
	}
	e := &env{proxy: testutil.NewFakeProxy(t, pc), site: testutil.NewFakeSite(t, sc), logs: &bytes.Buffer{}}
	var err error
	e.provider, err = sessions.NewProvider("generic", e.proxy.Addr, "{user}[-country-{country}]-session-{session}", "{pass}", "acct", canary, 0)
	require.NoError(t, err)
	e.logger = slog.New(slog.NewTextHandler(&lockedWriter{w: e.logs}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	return e
}

type lockedWriter struct {
	mu sync.Mutex
	w  *bytes.Buffer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

func (e *env) runCfg() sessions.RunConfig {
	return sessions.RunConfig{
		Provider: e.provider, Country: "US", Logger: e.logger,
		Collector: sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), RequestTimeout: 5 * time.Second, TLSConfig: e.tlsConfig()},
		Quarantine: func(_ context.Context, q sessions.Quarantined) error {
			e.mu.Lock()
			defer e.mu.Unlock()
			e.quarantined = append(e.quarantined, q)
			return nil
		},
	}
}

func (e *env) tlsConfig() *tls.Config {
	if pool := e.site.CertPool(); pool != nil {
		return &tls.Config{RootCAs: pool}
	}
	return nil
}

// exits returns the exit each step of a successful catalog run saw.
func exits(t *testing.T, staged map[string]json.RawMessage) []string {
	t.Helper()
	var s catalog.SearchStage
	var p catalog.ProductStage
	var pr catalog.PriceStage
	require.NoError(t, json.Unmarshal(staged["search"], &s))
	require.NoError(t, json.Unmarshal(staged["product"], &p))
	require.NoError(t, json.Unmarshal(staged["price"], &pr))
	return []string{s.Exit, p.Exit, pr.Exit}
}

func TestUnitIsSticky(t *testing.T) {
	for _, useTLS := range []bool{false, true} {
		t.Run(fmt.Sprintf("TLS=%v", useTLS), func(t *testing.T) {
			e := setup(t, testutil.FakeProxyConfig{Seed: 1}, testutil.FakeSiteConfig{Seed: 1, TLS: useTLS, StrictExit: true})
			for _, sku := range []string{"sku-1", "sku-2", "sku-3"} {
				unit, err := catalog.Unit(e.site.URL, sku)
				require.NoError(t, err)
				res, err := unit.Run(context.Background(), e.runCfg())
				require.NoError(t, err)
				ex := exits(t, res.Staged)
				require.NotEmpty(t, ex[0])
				require.Equal(t, []string{ex[0], ex[0], ex[0]}, ex, "every request of the unit leaves through one exit")
				require.Equal(t, e.proxy.ExitOf(res.Session.ID), ex[0], "the proxy agrees which exit the session had")
				require.Zero(t, res.Restarts)
				require.Positive(t, res.Bytes)
				want, _ := e.site.Product(sku)
				var pr catalog.PriceStage
				require.NoError(t, json.Unmarshal(res.Staged["price"], &pr))
				require.Equal(t, want.Price, pr.Price)
			}
		})
	}
}

func TestReplayOnDisconnect(t *testing.T) {
	e := setup(t, testutil.FakeProxyConfig{Seed: 2}, testutil.FakeSiteConfig{Seed: 2, StrictExit: true})
	unit, err := catalog.Unit(e.site.URL, "sku-7")
	require.NoError(t, err)
	// Disconnect the device while step 2 runs, the first time only.
	orig := unit.Steps[1].Run
	first := true
	unit.Steps[1].Run = func(ctx context.Context, sc *sessions.StepContext) error {
		if first {
			first = false
			e.proxy.SetDisconnectProb(1)
			defer e.proxy.SetDisconnectProb(0)
		}
		return orig(ctx, sc)
	}
	res, err := unit.Run(context.Background(), e.runCfg())
	require.NoError(t, err)
	require.Equal(t, 1, res.Restarts)
	require.Len(t, res.Sessions, 2)
	require.NotEqual(t, res.Sessions[0], res.Sessions[1], "a new session id")
	require.Equal(t, res.Sessions[1], res.Session.ID)
	require.Equal(t, []tasks.Category{tasks.CategorySessionLost}, res.RestartReasons)

	// The first session's staging was quarantined with its reason and session id.
	require.Len(t, e.quarantined, 1)
	q := e.quarantined[0]
	require.Equal(t, res.Sessions[0], q.SessionID)
	require.Equal(t, "product", q.Step)
	require.Equal(t, tasks.CategorySessionLost, q.Reason)
	require.Contains(t, q.Staged, "search", "step 1's staging is what was quarantined")

	// The observation comes from the second session only, replayed from step 1.
	ex := exits(t, res.Staged)
	require.Equal(t, []string{ex[0], ex[0], ex[0]}, ex)
	require.Equal(t, e.proxy.ExitOf(res.Session.ID), ex[0])
	// (Not "through another exit": the new session's exit is drawn afresh, and 1 in 249
	// draws is the old one — a real provider may hand the same address back too. The
	// replay's staging is the new session's, which is what the lines above prove.)
	var oldSearch catalog.SearchStage
	require.NoError(t, json.Unmarshal(q.Staged["search"], &oldSearch))
	require.NotEmpty(t, oldSearch.Exit)
	require.Equal(t, 2, e.site.Hits("/search"), "step 1 ran again")
}

func TestNoMergedHalves(t *testing.T) {
	// StrictExit off: the site would refuse a cookie from another exit itself; here only the
	// unit's design keeps the halves apart.
	e := setup(t, testutil.FakeProxyConfig{Seed: 3, DisconnectProb: 0.2}, testutil.FakeSiteConfig{Seed: 3, Products: 100})
	cfg := e.runCfg()
	cfg.MaxSessionRestarts = 10
	cfg.Logger = slog.New(slog.NewTextHandler(discard{}, nil))
	const units = 500
	var (
		mu                          sync.Mutex
		ok, failed, mixed, restarts int
	)
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for i := 0; i < units; i++ {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			unit, err := catalog.Unit(e.site.URL, fmt.Sprintf("sku-%d", i%100+1))
			if err != nil {
				panic(err)
			}
			res, err := unit.Run(context.Background(), cfg)
			mu.Lock()
			defer mu.Unlock()
			restarts += res.Restarts
			if err != nil {
				failed++
				return
			}
			ok++
			ex := exits(t, res.Staged)
			if ex[0] != ex[1] || ex[1] != ex[2] || ex[0] != e.proxy.ExitOf(res.Session.ID) {
				mixed++
			}
		}()
	}
	wg.Wait()
	t.Logf("%d units: %d ok, %d failed after 10 restarts, %d restarts, %d proxy disconnects", units, ok, failed, restarts, e.proxy.Disconnects())
	require.Zero(t, mixed, "observations mixing sessions")
	require.Positive(t, restarts, "the disconnects must have forced replays")
	require.Greater(t, ok, units*9/10)
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

func TestUnsafeStepNotReplayed(t *testing.T) {
	e := setup(t, testutil.FakeProxyConfig{Seed: 4}, testutil.FakeSiteConfig{Seed: 4})
	unit, err := catalog.Unit(e.site.URL, "sku-3")
	require.NoError(t, err)
	// Step 2 becomes unsafe (think: adds to a cart); the device drops during step 3.
	unit.Steps[1].Safe = false
	orig := unit.Steps[2].Run
	unit.Steps[2].Run = func(ctx context.Context, sc *sessions.StepContext) error {
		e.proxy.SetDisconnectProb(1)
		defer e.proxy.SetDisconnectProb(0)
		return orig(ctx, sc)
	}
	_, err = unit.Run(context.Background(), e.runCfg())
	require.Error(t, err)
	require.Equal(t, tasks.CategoryUnsafeStepIncomplete, sessions.CategoryOf(err))
	var fe *sessions.FetchError
	require.ErrorAs(t, err, &fe)
	require.Equal(t, "price", fe.Step)
	require.Equal(t, 1, e.site.Hits("/search"), "not replayed")
	require.Len(t, e.quarantined, 1, "the staging is kept for review")

	// The same loss before any unsafe step ran is replayed as usual.
	e2 := setup(t, testutil.FakeProxyConfig{Seed: 5}, testutil.FakeSiteConfig{Seed: 5})
	unit2, err := catalog.Unit(e2.site.URL, "sku-3")
	require.NoError(t, err)
	unit2.Steps[2].Safe = false
	orig2 := unit2.Steps[1].Run
	first := true
	unit2.Steps[1].Run = func(ctx context.Context, sc *sessions.StepContext) error {
		if first {
			first = false
			e2.proxy.SetDisconnectProb(1)
			defer e2.proxy.SetDisconnectProb(0)
		}
		return orig2(ctx, sc)
	}
	res, err := unit2.Run(context.Background(), e2.runCfg())
	require.NoError(t, err)
	require.Equal(t, 1, res.Restarts)
}

func TestSessionLifetime(t *testing.T) {
	e := setup(t, testutil.FakeProxyConfig{Seed: 6}, testutil.FakeSiteConfig{Seed: 6})
	unit, err := catalog.Unit(e.site.URL, "sku-4")
	require.NoError(t, err)
	// A clock that jumps past the lifetime after the first step of the first session: the
	// expired session is never used for step 2; the unit restarts on a fresh one.
	var mu sync.Mutex
	now := time.Date(2026, 4, 23, 15, 0, 0, 0, time.UTC)
	cfg := e.runCfg()
	cfg.SessionLifetime = time.Minute
	cfg.Now = func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	orig := unit.Steps[0].Run
	jumped := false
	unit.Steps[0].Run = func(ctx context.Context, sc *sessions.StepContext) error {
		err := orig(ctx, sc)
		if !jumped {
			jumped = true
			mu.Lock()
			now = now.Add(2 * time.Minute)
			mu.Unlock()
		}
		return err
	}
	res, err := unit.Run(context.Background(), cfg)
	require.NoError(t, err)
	require.Equal(t, 1, res.Restarts)
	require.Equal(t, 1, e.site.Hits("/product/sku-4"), "the expired session ran no further step")
	require.Contains(t, e.quarantined[0].Detail, "lifetime")
}

func TestFetchCategories(t *testing.T) {
	ctx := context.Background()
	run := func(t *testing.T, e *env, mutate func(*sessions.RunConfig), prepare func()) error {
		t.Helper()
		unit, err := catalog.Unit(e.site.URL, "sku-1")
		require.NoError(t, err)
		cfg := e.runCfg()
		cfg.MaxSessionRestarts = -1
		if mutate != nil {
			mutate(&cfg)
		}
		if prepare != nil {
			prepare()
		}
		_, err = unit.Run(ctx, cfg)
		return err
	}
	t.Run("ProxyAuth", func(t *testing.T) {
		for _, useTLS := range []bool{false, true} {
			e := setup(t, testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: "acct", Password: "other"}, testutil.FakeSiteConfig{TLS: useTLS})
			err := run(t, e, nil, nil)
			require.Equal(t, tasks.CategoryProxyAuth, sessions.CategoryOf(err), "TLS=%v: %v", useTLS, err)
			var fe *sessions.FetchError
			require.ErrorAs(t, err, &fe)
			require.Equal(t, 407, fe.Status)
		}
	})
	t.Run("ExitUnavailable", func(t *testing.T) {
		e := setup(t, testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: "acct", Password: canary, UnavailableCountries: []string{"US"}, ErrorHeaders: true}, testutil.FakeSiteConfig{})
		err := run(t, e, nil, nil)
		require.Equal(t, tasks.CategoryExitUnavailable, sessions.CategoryOf(err), "%v", err)
		require.Contains(t, err.Error(), "Proxy-Status", "the provider's error code is kept")
	})
	t.Run("SessionLost", func(t *testing.T) {
		e := setup(t, testutil.FakeProxyConfig{}, testutil.FakeSiteConfig{})
		err := run(t, e, nil, func() { e.proxy.SetDisconnectProb(1) })
		require.Equal(t, tasks.CategorySessionLost, sessions.CategoryOf(err), "%v", err)
	})
	t.Run("Throttled", func(t *testing.T) {
		e := setup(t, testutil.FakeProxyConfig{}, testutil.FakeSiteConfig{})
		err := run(t, e, nil, func() { e.site.Throttle(1, 42*time.Second) })
		require.Equal(t, tasks.CategoryThrottled, sessions.CategoryOf(err))
		var fe *sessions.FetchError
		require.ErrorAs(t, err, &fe)
		require.Equal(t, 42*time.Second, fe.RetryAfter)
		require.Equal(t, 429, fe.Status)
	})
	t.Run("Unavailable503", func(t *testing.T) {
		e := setup(t, testutil.FakeProxyConfig{}, testutil.FakeSiteConfig{UnavailableRetryAfter: 7 * time.Second})
		// Classified throttled; not waited out on the session (the unit would resume after 7 s).
		err := run(t, e, func(c *sessions.RunConfig) { c.ThrottleResumeMax = -1 }, func() { e.site.SetUnavailable(1) })
		var fe *sessions.FetchError
		require.ErrorAs(t, err, &fe)
		require.Equal(t, tasks.CategoryThrottled, fe.Category)
		require.Equal(t, 7*time.Second, fe.RetryAfter)
	})
	t.Run("Timeout", func(t *testing.T) {
		e := setup(t, testutil.FakeProxyConfig{}, testutil.FakeSiteConfig{})
		err := run(t, e, func(c *sessions.RunConfig) { c.Collector.RequestTimeout = 200 * time.Millisecond }, func() { e.site.SetSlow(2 * time.Second) })
		require.Equal(t, tasks.CategoryTimeout, sessions.CategoryOf(err), "%v", err)
	})
	t.Run("Validation", func(t *testing.T) {
		e := setup(t, testutil.FakeProxyConfig{}, testutil.FakeSiteConfig{})
		err := run(t, e, nil, func() { e.site.SetSchemaChange(true) })
		require.Equal(t, tasks.CategoryValidation, sessions.CategoryOf(err), "%v", err)
		require.Len(t, e.quarantined, 1, "a surprising schema change is quarantined")
	})
	t.Run("RobotsDisallowed", func(t *testing.T) {
		e := setup(t, testutil.FakeProxyConfig{}, testutil.FakeSiteConfig{Robots: "User-agent: *\nDisallow: /search\n"})
		err := run(t, e, nil, nil)
		require.Equal(t, tasks.CategoryRobotsDisallowed, sessions.CategoryOf(err), "%v", err)
		require.Zero(t, e.site.Hits("/search"))
	})
	t.Run("ForbiddenAddress", func(t *testing.T) {
		e := setup(t, testutil.FakeProxyConfig{}, testutil.FakeSiteConfig{})
		err := run(t, e, func(c *sessions.RunConfig) { c.Collector.Guard = &sessions.Guard{} }, nil)
		require.Equal(t, tasks.CategoryForbiddenAddress, sessions.CategoryOf(err), "%v", err)
		require.Zero(t, e.site.TotalHits(), "nothing was sent")
	})
}

func TestStepPanicAndQuarantineFailure(t *testing.T) {
	e := setup(t, testutil.FakeProxyConfig{Seed: 8}, testutil.FakeSiteConfig{Seed: 8})
	unit, err := catalog.Unit(e.site.URL, "sku-2")
	require.NoError(t, err)
	// A panic in a step after an unsafe one: still never replayed.
	unit.Steps[0].Safe = false
	unit.Steps[1].Run = func(context.Context, *sessions.StepContext) error { panic("parser bug") }
	_, err = unit.Run(context.Background(), e.runCfg())
	require.Equal(t, tasks.CategoryUnsafeStepIncomplete, sessions.CategoryOf(err), "%v", err)
	require.ErrorContains(t, err, "parser bug")
	require.Equal(t, 1, e.site.Hits("/search"))

	// A quarantine that fails stops the run and says so, keeping the failure's category.
	e2 := setup(t, testutil.FakeProxyConfig{Seed: 9}, testutil.FakeSiteConfig{Seed: 9})
	unit2, err := catalog.Unit(e2.site.URL, "sku-2")
	require.NoError(t, err)
	cfg := e2.runCfg()
	cfg.Quarantine = func(context.Context, sessions.Quarantined) error { return errors.New("database is down") }
	e2.proxy.SetDisconnectProb(1)
	_, err = unit2.Run(context.Background(), cfg)
	require.Equal(t, tasks.CategorySessionLost, sessions.CategoryOf(err))
	require.ErrorContains(t, err, "could not be quarantined: database is down")
}
