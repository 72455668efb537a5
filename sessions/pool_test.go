package sessions_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/gocolly/colly/v2"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/sessions/profile"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// retirements records a pool's OnRetire calls.
type retirements struct {
	mu      sync.Mutex
	reasons []string
}

func (r *retirements) hear(_ sessions.PoolKey, reason string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.reasons = append(r.reasons, reason)
}

func (r *retirements) list() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.reasons...)
}

// poolEnv is setup (proxy and shop seeded alike) with a pool of pc whose retirements are
// heard, closed at the test's end, and a RunConfig on it.
func poolEnv(t *testing.T, sc testutil.FakeSiteConfig, pc sessions.PoolConfig) (*env, *sessions.Pool, *retirements, sessions.RunConfig) {
	t.Helper()
	e := setup(t, testutil.FakeProxyConfig{Seed: sc.Seed}, sc)
	heard := &retirements{}
	pc.OnRetire = heard.hear
	pool, err := sessions.NewPool(pc)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	cfg := e.runCfg()
	cfg.Pool = pool
	return e, pool, heard, cfg
}

// poolUnit is the catalog unit for sku, pooled per the shop's host.
func poolUnit(t *testing.T, e *env, sku string) *sessions.Unit {
	t.Helper()
	u, err := catalog.Unit(e.site.URL, sku)
	require.NoError(t, err)
	site, err := url.Parse(e.site.URL)
	require.NoError(t, err)
	u.Site = site.Host
	return u
}

// cookieUnit is a one-step unit that stages the cookies the shop received (GET /cookies).
func cookieUnit(t *testing.T, e *env) *sessions.Unit {
	t.Helper()
	site, err := url.Parse(e.site.URL)
	require.NoError(t, err)
	return &sessions.Unit{Name: "cookies", Site: site.Host, Steps: []sessions.Step{{Name: "cookies", Safe: true,
		Run: func(_ context.Context, sc *sessions.StepContext) error {
			resp, err := sc.Get(e.site.URL + "/cookies")
			if err != nil {
				return err
			}
			var got map[string]string
			if err := json.Unmarshal(resp.Body, &got); err != nil {
				return err
			}
			return sc.Staging.Put("cookies", got)
		}}}}
}

func stagedCookies(t *testing.T, res sessions.Result) map[string]string {
	t.Helper()
	var got map[string]string
	require.NoError(t, json.Unmarshal(res.Staged["cookies"], &got))
	return got
}

// TestWarmSessionReused: a second unit of the same site runs on the first one's session —
// the same sticky id, so the same exit, and its cookie jar — and no session ever serves
// two units at once.
func TestWarmSessionReused(t *testing.T) {
	e, pool, heard, cfg := poolEnv(t, testutil.FakeSiteConfig{Seed: 61, StrictExit: true}, sessions.PoolConfig{})

	first, err := poolUnit(t, e, "sku-1").Run(context.Background(), cfg)
	require.NoError(t, err)
	require.False(t, first.Warm)
	require.Zero(t, first.SessionUnits)
	require.NotNil(t, first.Lease, "a pooled success hands its session to the caller")
	sid := stagedCookieAfter(t, e, cfg, first) // the sid the shop set on unit 1, read on a warm unit

	second, err := poolUnit(t, e, "sku-2").Run(context.Background(), cfg)
	require.NoError(t, err)
	require.True(t, second.Warm, "the second unit takes the warm session")
	require.Equal(t, 2, second.SessionUnits, "units 1 and the cookie probe ran on it before")
	require.Equal(t, first.Session.ID, second.Session.ID, "the same sticky session")
	ex1, ex2 := exits(t, first.Staged), exits(t, second.Staged)
	require.Equal(t, ex1[0], ex2[0], "the same exit")
	require.Equal(t, []string{ex2[0], ex2[0], ex2[0]}, ex2, "one exit for the whole unit")
	want, _ := e.site.Product("sku-2")
	var pr catalog.PriceStage
	require.NoError(t, json.Unmarshal(second.Staged["price"], &pr))
	require.Equal(t, want.Price, pr.Price, "the strict shop accepted the warm session's cookie on its exit")
	second.Lease.Keep()
	third, err := cookieUnit(t, e).Run(context.Background(), cfg)
	require.NoError(t, err)
	require.Equal(t, sid, stagedCookies(t, third)["sid"], "the cookie jar went on with the session")
	third.Lease.Keep()
	require.Empty(t, heard.list(), "nothing retired")
	stats := pool.Stats()
	require.Len(t, stats, 1)
	require.Equal(t, 1, stats[0].Idle)
	require.Zero(t, stats[0].Busy)

	// Many units at once on one site: a session is held by one unit at a time.
	var (
		mu        sync.Mutex
		inUse     = map[string]int{}
		overlaps  int
		warm      int
		sessionsN = map[string]bool{}
		wg        sync.WaitGroup
	)
	const workers, each = 6, 5
	for w := range workers {
		wg.Go(func() {
			for i := range each {
				u := poolUnit(t, e, fmt.Sprintf("sku-%d", (w*each+i)%40+1))
				first, last := u.Steps[0].Run, u.Steps[len(u.Steps)-1].Run
				u.Steps[0].Run = func(ctx context.Context, sc *sessions.StepContext) error {
					mu.Lock()
					inUse[sc.Session.ID]++
					if inUse[sc.Session.ID] > 1 {
						overlaps++
					}
					mu.Unlock()
					return first(ctx, sc)
				}
				u.Steps[len(u.Steps)-1].Run = func(ctx context.Context, sc *sessions.StepContext) error {
					defer func() { mu.Lock(); inUse[sc.Session.ID]--; mu.Unlock() }()
					return last(ctx, sc)
				}
				res, err := u.Run(context.Background(), cfg)
				if err != nil {
					t.Errorf("unit: %v", err)
					return
				}
				mu.Lock()
				sessionsN[res.Session.ID] = true
				if res.Warm {
					warm++
				}
				mu.Unlock()
				res.Lease.Keep()
			}
		})
	}
	wg.Wait()
	require.Zero(t, overlaps, "no session ran two units at once")
	require.Positive(t, warm, "units ran on warm sessions")
	require.LessOrEqual(t, len(sessionsN), workers+1, "at most one session per concurrent unit (plus the warm one)")
	require.Empty(t, heard.list())
}

// stagedCookieAfter hands res's session back and runs the cookie probe on it (warm):
// the sid cookie the shop set during res's unit.
func stagedCookieAfter(t *testing.T, e *env, cfg sessions.RunConfig, res sessions.Result) string {
	t.Helper()
	res.Lease.Keep()
	probe, err := cookieUnit(t, e).Run(context.Background(), cfg)
	require.NoError(t, err)
	require.True(t, probe.Warm)
	require.Equal(t, res.Session.ID, probe.Session.ID)
	sid := stagedCookies(t, probe)["sid"]
	require.NotEmpty(t, sid, "the search step's sid cookie is in the warm session's jar")
	probe.Lease.Keep()
	return sid
}

// TestSessionRetired: a block, an exit change, MaxUnits and too little lifetime left each
// retire a session, with its reason, and a retired session never serves again.
func TestSessionRetired(t *testing.T) {
	type tc struct {
		name   string
		pc     testutil.FakeProxyConfig
		pool   sessions.PoolConfig
		header bool
		// between runs after the first unit kept its session warm; the next unit must not
		// run on it (it may start on it and find out, as with an exit change).
		between func(e *env, clock, proxyClock *testutil.Clock)
		reason  string
		// warmFails: the second unit first ran on the warm session and replayed
		warmFails bool
	}
	cases := []tc{
		{name: "blocked", pc: testutil.FakeProxyConfig{Seed: 62, Tier: "datacenter"},
			between: func(e *env, _, _ *testutil.Clock) { e.site.SetBlockedTier("datacenter") },
			reason:  sessions.PoolRetireBlocked},
		{name: "exit changed", pc: testutil.FakeProxyConfig{Seed: 63}, header: true,
			between: func(_ *env, _, proxyClock *testutil.Clock) { proxyClock.Advance(11 * time.Minute) },
			reason:  sessions.PoolRetireExit, warmFails: true},
		{name: "max units", pc: testutil.FakeProxyConfig{Seed: 64}, pool: sessions.PoolConfig{MaxUnits: 1},
			reason: sessions.PoolRetireMaxUnits},
		{name: "age", pc: testutil.FakeProxyConfig{Seed: 65}, pool: sessions.PoolConfig{MinRemaining: time.Minute},
			between: func(_ *env, clock, _ *testutil.Clock) { clock.Advance(9*time.Minute + 30*time.Second) },
			reason:  sessions.PoolRetireAge},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			start := time.Date(2026, 12, 7, 9, 0, 0, 0, time.UTC)
			clock, proxyClock := testutil.NewClock(start), testutil.NewClock(start)
			c.pc.Now = proxyClock.Now
			e := setup(t, c.pc, testutil.FakeSiteConfig{Seed: c.pc.Seed, StrictExit: true})
			if c.header {
				var err error
				e.provider, err = e.provider.WithExitHeader("X-Exit")
				require.NoError(t, err)
			}
			var heard retirements
			c.pool.OnRetire = heard.hear
			pool, err := sessions.NewPool(c.pool)
			require.NoError(t, err)
			defer pool.Close()
			cfg := e.runCfg()
			cfg.Pool, cfg.Now, cfg.SessionLifetime = pool, clock.Now, 10*time.Minute

			first, err := poolUnit(t, e, "sku-3").Run(context.Background(), cfg)
			require.NoError(t, err)
			first.Lease.Keep()
			retired := first.Session.ID
			if c.between != nil {
				c.between(e, clock, proxyClock)
			}
			second, err := poolUnit(t, e, "sku-4").Run(context.Background(), cfg)
			switch c.name {
			case "blocked":
				require.Error(t, err)
				require.Equal(t, tasks.CategoryBlocked, sessions.CategoryOf(err))
				require.True(t, second.Warm, "the blocked unit ran on the warm session")
				require.Nil(t, second.Lease, "a failed unit hands nothing back")
				e.site.SetBlockedTier("")
			case "exit changed":
				require.NoError(t, err)
				require.Equal(t, retired, second.Sessions[0], "it started on the warm session")
				require.Equal(t, []tasks.Category{tasks.CategorySessionLost}, second.RestartReasons, "the new exit ended it before anything was staged")
				require.NotEqual(t, retired, second.Session.ID, "and replayed on a new session")
				require.True(t, second.Warm, "it started warm")
				require.Zero(t, second.SessionUnits, "the session it ends on is new")
				second.Lease.Keep()
			default:
				require.NoError(t, err)
				require.False(t, second.Warm, "a new session")
				require.NotEqual(t, retired, second.Session.ID)
				second.Lease.Keep()
			}
			want := []string{c.reason}
			if c.name == "max units" {
				want = append(want, c.reason) // the second unit's session served its one unit too
			}
			require.Equal(t, want, heard.list(), "retired once, for its reason")

			// Never again: whatever runs next, the retired session is not among its sessions.
			for i := range 4 {
				res, err := poolUnit(t, e, fmt.Sprintf("sku-%d", 10+i)).Run(context.Background(), cfg)
				require.NoError(t, err)
				require.NotContains(t, res.Sessions, retired)
				res.Lease.Keep()
			}
		})
	}
}

// TestPoolRetireFromCaller: a caller's Retire (a parser's block verdict) keeps the session
// out of the pool; only the first of Keep and Retire counts.
func TestPoolRetireFromCaller(t *testing.T) {
	e, pool, heard, cfg := poolEnv(t, testutil.FakeSiteConfig{Seed: 66}, sessions.PoolConfig{})
	first, err := poolUnit(t, e, "sku-5").Run(context.Background(), cfg)
	require.NoError(t, err)
	first.Lease.Retire(sessions.PoolRetireBlocked)
	first.Lease.Keep() // too late: retired
	second, err := poolUnit(t, e, "sku-6").Run(context.Background(), cfg)
	require.NoError(t, err)
	require.False(t, second.Warm)
	require.NotEqual(t, first.Session.ID, second.Session.ID)
	second.Lease.Keep()
	require.Equal(t, []string{sessions.PoolRetireBlocked}, heard.list())
	require.Equal(t, []sessions.PoolStat{{Key: sessions.PoolKey{Provider: "generic", Tier: "residential", Country: "US", Host: "127.0.0.1"}, Idle: 1}}, pool.Stats())

	// Without a Site the pool is not used.
	u := poolUnit(t, e, "sku-7")
	u.Site = ""
	res, err := u.Run(context.Background(), cfg)
	require.NoError(t, err)
	require.False(t, res.Warm)
	require.Nil(t, res.Lease)
}

// TestPoolCookies: only the cookies RunConfig.PoolCookies names go on to the next unit.
func TestPoolCookies(t *testing.T) {
	e := setup(t, testutil.FakeProxyConfig{Seed: 67}, testutil.FakeSiteConfig{Seed: 67})
	for _, c := range []struct {
		keep    []string
		wantSID bool
	}{{nil, true}, {[]string{"sid"}, true}, {[]string{}, false}, {[]string{"other"}, false}} {
		t.Run(fmt.Sprint(c.keep), func(t *testing.T) {
			pool, err := sessions.NewPool(sessions.PoolConfig{})
			require.NoError(t, err)
			defer pool.Close()
			cfg := e.runCfg()
			cfg.Pool, cfg.PoolCookies = pool, c.keep
			first, err := poolUnit(t, e, "sku-8").Run(context.Background(), cfg)
			require.NoError(t, err)
			first.Lease.Keep()
			probe, err := cookieUnit(t, e).Run(context.Background(), cfg)
			require.NoError(t, err)
			require.True(t, probe.Warm)
			_, has := stagedCookies(t, probe)["sid"]
			require.Equal(t, c.wantSID, has)
			probe.Lease.Keep()
		})
	}
}

// TestLifetimeEndIsSessionLost: a provider without an exit header moves the session to
// another exit when its sticky lifetime ends, under a running unit; the exit-bound shop
// answers 403. That is the session's end, not a block: the unit replays on a new session
// at once instead of waiting out a block.
func TestLifetimeEndIsSessionLost(t *testing.T) {
	clock := testutil.NewClock(time.Date(2026, 12, 7, 9, 0, 0, 0, time.UTC))
	e := setup(t, testutil.FakeProxyConfig{Seed: 68, SessionLifetime: time.Second, Now: clock.Now},
		testutil.FakeSiteConfig{Seed: 68, StrictExit: true})
	unit, err := catalog.Unit(e.site.URL, "sku-9")
	require.NoError(t, err)
	orig := unit.Steps[1].Run
	var once sync.Once
	unit.Steps[1].Run = func(ctx context.Context, sc *sessions.StepContext) error {
		once.Do(func() { clock.Advance(2 * time.Second) }) // the lifetime ends under the step
		return orig(ctx, sc)
	}
	cfg := e.runCfg()
	cfg.Now, cfg.SessionLifetime = clock.Now, time.Second
	res, err := unit.Run(context.Background(), cfg)
	require.NoError(t, err, "replayed on a new session, not failed as blocked")
	require.Equal(t, []tasks.Category{tasks.CategorySessionLost}, res.RestartReasons)
	require.Len(t, e.quarantined, 1)
	require.Contains(t, e.quarantined[0].Detail, "answered 403")
	ex := exits(t, res.Staged)
	require.Equal(t, []string{ex[0], ex[0], ex[0]}, ex)

	// With an exit header the change is seen as it is (ErrExitChanged), whatever the clock.
	e2 := setup(t, testutil.FakeProxyConfig{Seed: 69, SessionLifetime: time.Second, Now: clock.Now},
		testutil.FakeSiteConfig{Seed: 69, StrictExit: true})
	e2.provider, err = e2.provider.WithExitHeader("X-Exit")
	require.NoError(t, err)
	unit2, err := catalog.Unit(e2.site.URL, "sku-9")
	require.NoError(t, err)
	orig2 := unit2.Steps[1].Run
	var once2 sync.Once
	unit2.Steps[1].Run = func(ctx context.Context, sc *sessions.StepContext) error {
		once2.Do(func() { clock.Advance(2 * time.Second) })
		return orig2(ctx, sc)
	}
	cfg2 := e2.runCfg()
	cfg2.Now, cfg2.SessionLifetime = clock.Now, time.Second
	res2, err := unit2.Run(context.Background(), cfg2)
	require.NoError(t, err)
	require.Equal(t, []tasks.Category{tasks.CategorySessionLost}, res2.RestartReasons)
	require.Contains(t, e2.quarantined[0].Detail, "exit changed")
}

// TestWarmSessionNeverMidUnit: under the fault mix — devices dropped under a step (half
// of them leaving the exit alive), the exit moved silently under a session, throttle bursts
// — with the pool on, every observation comes from one session and one exit, no session
// serves two units at once, and warm sessions carry on between units.
func TestWarmSessionNeverMidUnit(t *testing.T) {
	for _, header := range []bool{true, false} {
		t.Run(fmt.Sprintf("exit header %v", header), func(t *testing.T) {
			e := setup(t, testutil.FakeProxyConfig{Seed: 70, DisconnectProb: 0.05, CutExitAlive: 0.5},
				testutil.FakeSiteConfig{Seed: 70, Products: 60, StrictExit: true, Challenge: true})
			if header {
				var err error
				e.provider, err = e.provider.WithExitHeader("X-Exit")
				require.NoError(t, err)
			}
			pool, err := sessions.NewPool(sessions.PoolConfig{MaxUnits: 8})
			require.NoError(t, err)
			defer pool.Close()
			cfg := e.runCfg()
			cfg.Pool, cfg.MaxSessionRestarts = pool, 6
			cfg.Logger = e.logger.With() // keep the default handler (quiet enough)

			var (
				mu                          sync.Mutex
				holder                      = map[string]string{} // session → the unit holding it
				overlaps, mixed, ok, warm   int
				failed, moved, steps, units int
			)
			const workers, each = 8, 25
			var wg sync.WaitGroup
			for w := range workers {
				wg.Go(func() {
					for i := range each {
						n := w*each + i
						if n%40 == 39 {
							e.proxy.DropNextNewExit("/product/") // the exit moves under a session
							mu.Lock()
							moved++
							mu.Unlock()
						}
						if n%50 == 25 {
							e.site.Throttle(3, 0)
						}
						u := poolUnit(t, e, fmt.Sprintf("sku-%d", n%60+1))
						// A session belongs to one unit from the first step it runs for it until
						// the unit's Run returns (a failed session is retired, a good one handed
						// back after that): another unit running a step on it is an overlap.
						unitID := fmt.Sprint(n)
						held := map[string]bool{}
						for si := range u.Steps {
							orig := u.Steps[si].Run
							u.Steps[si].Run = func(ctx context.Context, sc *sessions.StepContext) error {
								mu.Lock()
								steps++
								if h := holder[sc.Session.ID]; h != "" && h != unitID {
									overlaps++
								}
								holder[sc.Session.ID], held[sc.Session.ID] = unitID, true
								mu.Unlock()
								return orig(ctx, sc)
							}
						}
						res, err := u.Run(context.Background(), cfg)
						mu.Lock()
						for id := range held {
							if holder[id] == unitID {
								delete(holder, id)
							}
						}
						units++
						if err != nil {
							failed++
							mu.Unlock()
							continue
						}
						ok++
						if res.Warm {
							warm++
						}
						ex := exits(t, res.Staged)
						if ex[0] != ex[1] || ex[1] != ex[2] || (header && ex[0] != res.Exit) {
							mixed++
						}
						mu.Unlock()
						res.Lease.Keep()
					}
				})
			}
			wg.Wait()
			t.Logf("%d units: %d ok (%d on warm sessions), %d failed; %d disconnects (%d exit alive), %d exits moved, %d challenges, %d clearance mismatches",
				units, ok, warm, failed, e.proxy.Disconnects(), e.proxy.CutsExitAlive(), moved, e.site.Challenges(), e.site.ClearanceMismatches())
			require.Zero(t, overlaps, "a session ran two units at once")
			require.Zero(t, mixed, "an observation mixed sessions or exits")
			require.Positive(t, e.proxy.Disconnects(), "the fault mix must have cut connections")
			require.Positive(t, warm, "units ran on warm sessions")
			require.Greater(t, ok, units*8/10)
			require.Less(t, e.site.Challenges(), units, "warm sessions skipped challenges")
		})
	}
}

// TestPoolKeepsClientsApart: runs of one site whose client profiles or cookie policies
// differ (two kinds configured differently) never take each other's sessions.
func TestPoolKeepsClientsApart(t *testing.T) {
	e := setup(t, testutil.FakeProxyConfig{Seed: 72}, testutil.FakeSiteConfig{Seed: 72})
	pool, err := sessions.NewPool(sessions.PoolConfig{})
	require.NoError(t, err)
	defer pool.Close()
	plain := e.runCfg()
	plain.Pool = pool
	profiled := plain
	profiled.Profiles = &profile.Options{Browsers: []string{profile.Firefox}}
	fewCookies := plain
	fewCookies.PoolCookies = []string{}

	a, err := poolUnit(t, e, "sku-1").Run(context.Background(), profiled)
	require.NoError(t, err)
	a.Lease.Keep()
	for _, other := range []sessions.RunConfig{plain, fewCookies} {
		b, err := poolUnit(t, e, "sku-2").Run(context.Background(), other)
		require.NoError(t, err)
		require.False(t, b.Warm, "another client does not take the profiled session")
		require.Nil(t, b.Session.Profile)
		b.Lease.Keep()
	}
	c, err := poolUnit(t, e, "sku-3").Run(context.Background(), profiled)
	require.NoError(t, err)
	require.True(t, c.Warm)
	require.Equal(t, a.Session.ID, c.Session.ID)
	require.Equal(t, a.Session.Profile.String(), c.Session.Profile.String())
	c.Lease.Keep()
	require.Len(t, pool.Stats(), 3, "three clients of one site")
}

// TestPoolSweepsIdleKeys: idle sessions of a key nobody asks for again are retired once
// they pass IdleTimeout (a sweep of every key while the pool is used), and MaxIdleTotal
// bounds the idle sessions of all keys together.
func TestPoolSweepsIdleKeys(t *testing.T) {
	clock := testutil.NewClock(time.Date(2026, 12, 7, 9, 0, 0, 0, time.UTC))
	e, pool, heard, cfg := poolEnv(t, testutil.FakeSiteConfig{Seed: 73}, sessions.PoolConfig{IdleTimeout: time.Minute, MaxIdleTotal: 2})
	cfg.Now = clock.Now
	run := func(site string) {
		t.Helper()
		u := poolUnit(t, e, "sku-1")
		u.Site = site // one key per site name (all reach the shop)
		res, err := u.Run(context.Background(), cfg)
		require.NoError(t, err)
		res.Lease.Keep()
	}
	run("a.example")
	run("b.example")
	run("c.example") // over MaxIdleTotal: retired when handed back
	require.Equal(t, []string{sessions.PoolRetireIdle}, heard.list())
	require.Len(t, pool.Stats(), 2)
	clock.Advance(2 * time.Minute)
	run("d.example") // a use of the pool sweeps a and b, idle too long
	require.Equal(t, []string{sessions.PoolRetireIdle, sessions.PoolRetireIdle, sessions.PoolRetireIdle}, heard.list())
	st := pool.Stats()
	require.Len(t, st, 1)
	require.Equal(t, "d.example", st[0].Key.Host)
}

// TestProfileOnCollectorRequests: a step that uses the collector itself (Visit, an
// OnHTML follow-up of a page it fetched) presents the session's profile too, with colly's
// default Accept replaced and a step's explicit header kept; the marker Fetch puts on its
// own requests never reaches the wire; and colly's own robots.txt check still matches the
// groups with idemscrape's token, not the browser's.
func TestProfileOnCollectorRequests(t *testing.T) {
	e := setup(t, testutil.FakeProxyConfig{Seed: 74}, testutil.FakeSiteConfig{Seed: 74})
	type seenReq struct {
		path string
		h    http.Header
	}
	var (
		mu   sync.Mutex
		seen []seenReq
	)
	site := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = append(seen, seenReq{r.URL.Path, r.Header.Clone()})
		mu.Unlock()
		switch r.URL.Path {
		case "/robots.txt":
			fmt.Fprint(w, "User-agent: idemscrape\nDisallow: /private\n\nUser-agent: *\nAllow: /\n")
		case "/list":
			w.Header().Set("Content-Type", "text/html")
			fmt.Fprint(w, `<html><body><a class="next" href="/next">next</a></body></html>`)
		default:
			fmt.Fprint(w, "ok")
		}
	}))
	defer site.Close()
	cfg := e.runCfg()
	cfg.Profiles = &profile.Options{Browsers: []string{profile.Chrome}}
	u := &sessions.Unit{Name: "visit", Steps: []sessions.Step{{Name: "visit", Safe: true, Run: func(_ context.Context, sc *sessions.StepContext) error {
		if err := sc.Collector().Visit(site.URL + "/visit"); err != nil {
			return err
		}
		sc.Collector().OnHTML("a.next", func(el *colly.HTMLElement) { _ = el.Request.Visit(el.Attr("href")) })
		if _, err := sc.Get(site.URL + "/list"); err != nil {
			return err
		}
		_, err := sc.Fetch(http.MethodGet, site.URL+"/api", nil, http.Header{"Accept": {"application/json"}})
		return err
	}}}}
	res, err := u.Run(context.Background(), cfg)
	require.NoError(t, err)
	p := res.Session.Profile
	mu.Lock()
	byPath := map[string]http.Header{}
	for _, s := range seen {
		byPath[s.path] = s.h
		require.Empty(t, s.h.Get("X-Idemscrape-Profiled"), "%s: the internal marker reached the wire", s.path)
	}
	mu.Unlock()
	for _, path := range []string{"/visit", "/list", "/next"} {
		h := byPath[path]
		require.NotNil(t, h, path)
		require.Equal(t, p.UserAgent, h.Get("User-Agent"), path)
		require.Equal(t, p.Accept, h.Get("Accept"), "%s: colly's */* replaced by the profile's", path)
		require.Equal(t, p.AcceptLanguage, h.Get("Accept-Language"), path)
		require.Equal(t, p.Headers().Get("Sec-Ch-Ua"), h.Get("Sec-Ch-Ua"), path)
	}
	require.Equal(t, p.UserAgent, byPath["/api"].Get("User-Agent"))
	require.Equal(t, "application/json", byPath["/api"].Get("Accept"), "the step's own header wins")

	// colly's robots.txt check (no fleet cache) matches idemscrape's group under a profile.
	private := &sessions.Unit{Name: "private", Steps: []sessions.Step{{Name: "private", Safe: true, Run: func(_ context.Context, sc *sessions.StepContext) error {
		_, err := sc.Get(site.URL + "/private/x")
		return err
	}}}}
	_, err = private.Run(context.Background(), cfg)
	require.Equal(t, tasks.CategoryRobotsDisallowed, sessions.CategoryOf(err), "the bot's own robots.txt group applies: %v", err)
}

// TestPoolMaxAge: MaxAge retires a session that long after it opened, however much of its
// sticky lifetime is left and however recently it served.
func TestPoolMaxAge(t *testing.T) {
	clock := testutil.NewClock(time.Date(2026, 12, 7, 9, 0, 0, 0, time.UTC))
	e, _, heard, cfg := poolEnv(t, testutil.FakeSiteConfig{Seed: 74}, sessions.PoolConfig{MaxAge: 3 * time.Minute, IdleTimeout: 10 * time.Minute})
	cfg.Now, cfg.SessionLifetime = clock.Now, 10*time.Minute

	first, err := poolUnit(t, e, "sku-1").Run(context.Background(), cfg)
	require.NoError(t, err)
	first.Lease.Keep()
	clock.Advance(time.Minute)
	second, err := poolUnit(t, e, "sku-2").Run(context.Background(), cfg)
	require.NoError(t, err)
	require.True(t, second.Warm, "a minute old: still warm")
	require.Equal(t, first.Session.ID, second.Session.ID)
	second.Lease.Keep()
	require.Empty(t, heard.list())

	clock.Advance(2 * time.Minute) // 3 min after it opened, 2 after its last unit, 7 min of lifetime left
	third, err := poolUnit(t, e, "sku-3").Run(context.Background(), cfg)
	require.NoError(t, err)
	require.False(t, third.Warm, "past MaxAge: a new session")
	require.NotEqual(t, first.Session.ID, third.Session.ID)
	third.Lease.Keep()
	require.Equal(t, []string{sessions.PoolRetireAge}, heard.list())
}

// TestPoolMaxIdleTrim: over MaxIdle sessions of one key, the one handed back first (idle
// longest) is retired; the others serve again, the one handed back last first.
func TestPoolMaxIdleTrim(t *testing.T) {
	e, pool, heard, cfg := poolEnv(t, testutil.FakeSiteConfig{Seed: 75}, sessions.PoolConfig{MaxIdle: 2})

	// Three units hold three sessions at once (none is idle while another starts).
	var held []sessions.Result
	for i := range 3 {
		res, err := poolUnit(t, e, fmt.Sprintf("sku-%d", i+1)).Run(context.Background(), cfg)
		require.NoError(t, err)
		require.False(t, res.Warm)
		held = append(held, res)
	}
	require.Equal(t, 3, pool.Stats()[0].Busy)
	for _, res := range held {
		res.Lease.Keep()
	}
	require.Equal(t, []string{sessions.PoolRetireIdle}, heard.list(), "the third hand-back trims one")
	require.Equal(t, 2, pool.Stats()[0].Idle)

	var next []sessions.Result
	for i := range 3 {
		res, err := poolUnit(t, e, fmt.Sprintf("sku-%d", i+4)).Run(context.Background(), cfg)
		require.NoError(t, err)
		next = append(next, res)
	}
	require.Equal(t, held[2].Session.ID, next[0].Session.ID, "the one handed back last serves first")
	require.Equal(t, held[1].Session.ID, next[1].Session.ID)
	require.False(t, next[2].Warm, "the trimmed one never serves again")
	require.NotEqual(t, held[0].Session.ID, next[2].Session.ID)
	for _, res := range next {
		res.Lease.Keep()
	}
}

// TestPoolCloseWithHeldSessions: Close retires the idle sessions at once and a held one
// when its unit hands it back; a closed pool hands out no warm session and keeps none.
func TestPoolCloseWithHeldSessions(t *testing.T) {
	e, pool, heard, cfg := poolEnv(t, testutil.FakeSiteConfig{Seed: 76}, sessions.PoolConfig{})

	idle, err := poolUnit(t, e, "sku-1").Run(context.Background(), cfg)
	require.NoError(t, err)
	idle.Lease.Keep()
	busy, err := poolUnit(t, e, "sku-2").Run(context.Background(), cfg)
	require.NoError(t, err)
	require.True(t, busy.Warm)
	other, err := poolUnit(t, e, "sku-3").Run(context.Background(), cfg)
	require.NoError(t, err)
	require.False(t, other.Warm, "the warm one is held")
	other.Lease.Keep() // idle
	key := sessions.PoolKey{Provider: "generic", Tier: "residential", Country: "US", Host: "127.0.0.1"}
	require.Equal(t, []sessions.PoolStat{{Key: key, Idle: 1, Busy: 1}}, pool.Stats())

	pool.Close()
	require.Equal(t, []string{sessions.PoolRetireClosed}, heard.list(), "the idle session, at once")
	require.Equal(t, []sessions.PoolStat{{Key: key, Busy: 1}}, pool.Stats(), "only busy's session, still held")
	busy.Lease.Keep()
	require.Equal(t, []string{sessions.PoolRetireClosed, sessions.PoolRetireClosed}, heard.list(), "kept after Close: retired")
	require.Empty(t, pool.Stats())

	after, err := poolUnit(t, e, "sku-4").Run(context.Background(), cfg)
	require.NoError(t, err)
	require.False(t, after.Warm, "a closed pool hands out nothing")
	require.NotContains(t, []string{idle.Session.ID, other.Session.ID}, after.Session.ID)
	after.Lease.Keep()
	require.Equal(t, []string{sessions.PoolRetireClosed, sessions.PoolRetireClosed, sessions.PoolRetireClosed}, heard.list())
	require.Empty(t, pool.Stats())
}

// TestReplayTakesWarmSession: a unit whose session is lost mid-way replays from its first
// step on another warm session of the pool when one is idle — its exit and clearance
// cookie, so no challenge page — never on the lost one; with none idle, on a new one.
func TestReplayTakesWarmSession(t *testing.T) {
	e, _, heard, cfg := poolEnv(t, testutil.FakeSiteConfig{Seed: 77, StrictExit: true, Challenge: true}, sessions.PoolConfig{})

	// Two warm sessions: a and b, b handed back last.
	a, err := poolUnit(t, e, "sku-1").Run(context.Background(), cfg)
	require.NoError(t, err)
	b, err := poolUnit(t, e, "sku-2").Run(context.Background(), cfg)
	require.NoError(t, err)
	require.NotEqual(t, a.Session.ID, b.Session.ID)
	a.Lease.Keep()
	b.Lease.Keep()
	challenges := e.site.Challenges()

	e.proxy.DropNext("/api/price/") // b's device goes under the unit's last step
	res, err := poolUnit(t, e, "sku-3").Run(context.Background(), cfg)
	require.NoError(t, err)
	require.Equal(t, []string{b.Session.ID, a.Session.ID}, res.Sessions, "started on b, replayed on a")
	require.Equal(t, []tasks.Category{tasks.CategorySessionLost}, res.RestartReasons)
	require.True(t, res.Warm)
	require.Equal(t, a.Session.ID, res.Session.ID)
	require.Equal(t, 1, res.SessionUnits, "the recorded session, a, had served one unit")
	require.Equal(t, challenges, e.site.Challenges(), "no challenge: both sessions were cleared on their exits")
	require.Equal(t, []string{sessions.PoolRetireExit}, heard.list(), "b retired")
	ex := exits(t, res.Staged)
	require.Equal(t, []string{ex[0], ex[0], ex[0]}, ex, "the replay ran on one exit")
	res.Lease.Keep()

	// A unit that starts new (the one warm session is held by another unit) and loses its
	// session replays on the warm one handed back meanwhile: it did not start warm, but the
	// session it ends on — the one its attempt row records — had served 3 units.
	held, err := poolUnit(t, e, "sku-4").Run(context.Background(), cfg)
	require.NoError(t, err)
	require.Equal(t, a.Session.ID, held.Session.ID)
	e.proxy.DropNext("/api/price/")
	u := poolUnit(t, e, "sku-5")
	search := u.Steps[0].Run
	var handBack sync.Once
	u.Steps[0].Run = func(ctx context.Context, sc *sessions.StepContext) error {
		handBack.Do(held.Lease.Keep) // a is idle from the unit's first session on
		return search(ctx, sc)
	}
	res, err = u.Run(context.Background(), cfg)
	require.NoError(t, err)
	require.False(t, res.Warm, "it started on a new session")
	require.Len(t, res.Sessions, 2)
	require.NotEqual(t, a.Session.ID, res.Sessions[0], "a was held when the unit started")
	require.Equal(t, a.Session.ID, res.Sessions[1], "the replay took a")
	require.Equal(t, 3, res.SessionUnits, "a served sku-1, sku-3 and sku-4")
	res.Lease.Keep()

	// None idle at the replay (a is held): it opens a new session.
	held, err = poolUnit(t, e, "sku-6").Run(context.Background(), cfg)
	require.NoError(t, err)
	require.Equal(t, a.Session.ID, held.Session.ID)
	challenges = e.site.Challenges()
	e.proxy.DropNext("/api/price/")
	res, err = poolUnit(t, e, "sku-7").Run(context.Background(), cfg)
	require.NoError(t, err)
	require.False(t, res.Warm)
	require.Len(t, res.Sessions, 2)
	require.NotContains(t, res.Sessions, a.Session.ID, "never a session another unit holds")
	require.Zero(t, res.SessionUnits, "it ends on a session it opened")
	require.Equal(t, challenges+2, e.site.Challenges(), "both new sessions met the challenge")
	held.Lease.Keep()
	res.Lease.Keep()
}
