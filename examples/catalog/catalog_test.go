package catalog_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestMain fails the package's tests if a goroutine they started outlives them.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const canary = "pw-catalog-canary-5e21"

// env is a fake shop behind a fake residential proxy, and a provider for the proxy.
type env struct {
	site     *testutil.FakeSite
	proxy    *testutil.FakeProxy
	provider *sessions.Provider

	mu          sync.Mutex
	quarantined []sessions.Quarantined
}

func setup(t *testing.T, sc testutil.FakeSiteConfig) *env {
	t.Helper()
	e := &env{
		site:  testutil.NewFakeSite(t, sc),
		proxy: testutil.NewFakeProxy(t, testutil.FakeProxyConfig{Seed: sc.Seed, Format: testutil.ProxyFormatGeneric, User: "acct", Password: canary}),
	}
	var err error
	e.provider, err = sessions.NewProvider("generic", e.proxy.Addr, "{user}[-country-{country}]-session-{session}", "{pass}", "acct", canary, 0)
	require.NoError(t, err)
	return e
}

func (e *env) runCfg() sessions.RunConfig {
	return sessions.RunConfig{
		Provider:  e.provider,
		Country:   "US",
		Collector: sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), RequestTimeout: 5 * time.Second},
		Quarantine: func(_ context.Context, q sessions.Quarantined) error {
			e.mu.Lock()
			defer e.mu.Unlock()
			e.quarantined = append(e.quarantined, q)
			return nil
		},
	}
}

// run runs the catalog unit for sku, with mod (if any) changing it first.
func (e *env) run(t *testing.T, sku string, mod func(*sessions.Unit)) (sessions.Result, error) {
	t.Helper()
	unit, err := catalog.Unit(e.site.URL, sku)
	require.NoError(t, err)
	if mod != nil {
		mod(unit)
	}
	return unit.Run(context.Background(), e.runCfg())
}

// price is the staged price of a successful run, and the exits its steps saw.
func price(t *testing.T, res sessions.Result) (catalog.PriceStage, []string) {
	t.Helper()
	var (
		s  catalog.SearchStage
		p  catalog.ProductStage
		pr catalog.PriceStage
	)
	require.NoError(t, json.Unmarshal(res.Staged["search"], &s))
	require.NoError(t, json.Unmarshal(res.Staged["product"], &p))
	require.NoError(t, json.Unmarshal(res.Staged["price"], &pr))
	return pr, []string{s.Exit, p.Exit, pr.Exit}
}

// TestUnitThroughChallenge: against a shop in challenge mode (clearance bound to the exit,
// sid bound to the exit), the unit's first request gets the challenge page, the same URL
// again is served on the same session, and the rest of the unit goes through on the
// clearance: one challenge per unit, the right price, one exit. A shop without challenges
// sees no extra request.
func TestUnitThroughChallenge(t *testing.T) {
	e := setup(t, testutil.FakeSiteConfig{Seed: 21, Challenge: true, StrictExit: true})
	res, err := e.run(t, "sku-5", nil)
	require.NoError(t, err)
	pr, exits := price(t, res)
	want, ok := e.site.Product("sku-5")
	require.True(t, ok)
	assert.Equal(t, want.Price, pr.Price)
	assert.Equal(t, want.Currency, pr.Currency)
	exit := e.proxy.ExitOf(res.Session.ID)
	require.NotEmpty(t, exit)
	assert.Equal(t, []string{exit, exit, exit}, exits)
	assert.Zero(t, res.Restarts)
	assert.Equal(t, 1, e.site.Challenges(), "one challenge for the unit")
	assert.Equal(t, 2, e.site.Hits("/search"), "the challenged search, and the same URL again")
	assert.Equal(t, 1, e.site.Hits("/product/sku-5"))
	assert.Equal(t, 1, e.site.Hits("/api/price/sku-5"))
	assert.Zero(t, e.site.ClearanceMismatches())
	assert.Zero(t, e.site.ChallengeBlocks())

	// Another unit is another session, on its own exit: challenged again.
	res, err = e.run(t, "sku-6", nil)
	require.NoError(t, err)
	pr, _ = price(t, res)
	want, _ = e.site.Product("sku-6")
	assert.Equal(t, want.Price, pr.Price)
	assert.Equal(t, 2, e.site.Challenges())

	// Without challenges: no extra request.
	plain := setup(t, testutil.FakeSiteConfig{Seed: 21, StrictExit: true})
	res, err = plain.run(t, "sku-5", nil)
	require.NoError(t, err)
	pr, _ = price(t, res)
	want, _ = plain.site.Product("sku-5")
	assert.Equal(t, want.Price, pr.Price)
	assert.Equal(t, 1, plain.site.Hits("/search"))
	assert.Equal(t, 1, plain.site.Hits("/product/sku-5"))
	assert.Equal(t, 1, plain.site.Hits("/api/price/sku-5"))
	assert.Zero(t, plain.site.Challenges())
}

// TestEveryStepPassesAChallenge: whichever step the shop challenges (here: the session's
// clearance cookie is dropped from its jar just before that step), the step asks again on
// the same session and the unit completes.
func TestEveryStepPassesAChallenge(t *testing.T) {
	for i, step := range []string{"search", "product", "price"} {
		t.Run(step, func(t *testing.T) {
			e := setup(t, testutil.FakeSiteConfig{Seed: 22, Challenge: true, StrictExit: true})
			res, err := e.run(t, "sku-9", func(u *sessions.Unit) {
				run := u.Steps[i].Run
				u.Steps[i].Run = func(ctx context.Context, sc *sessions.StepContext) error {
					dropClearance(t, sc, e.site.URL)
					return run(ctx, sc)
				}
			})
			require.NoError(t, err)
			pr, _ := price(t, res)
			want, _ := e.site.Product("sku-9")
			assert.Equal(t, want.Price, pr.Price)
			wantChallenges := 2 // the unit's first request, and the step's
			if i == 0 {
				wantChallenges = 1 // the jar was empty anyway
			}
			assert.Equal(t, wantChallenges, e.site.Challenges())
			assert.Zero(t, res.Restarts)
		})
	}
}

// TestChallengeBlocked: a shop that blocks every challenge (ChallengeBlockEvery 1) fails
// the unit at its first step with category blocked, after one request; a shop that
// challenges again although its clearance was sent back (here: the session's jar drops
// every cookie) fails it as blocked after one retry.
func TestChallengeBlocked(t *testing.T) {
	t.Run("BlockEvery1", func(t *testing.T) {
		e := setup(t, testutil.FakeSiteConfig{Seed: 23, Challenge: true, ChallengeBlockEvery: 1})
		_, err := e.run(t, "sku-3", nil)
		require.Error(t, err)
		assert.Equal(t, tasks.CategoryBlocked, sessions.CategoryOf(err))
		var fe *sessions.FetchError
		require.True(t, errors.As(err, &fe))
		assert.Equal(t, http.StatusForbidden, fe.Status)
		assert.Equal(t, "search", fe.Step)
		assert.Equal(t, 1, e.site.ChallengeBlocks())
		assert.Zero(t, e.site.Challenges())
		assert.Equal(t, 1, e.site.Hits("/search"), "a block is not asked again")
	})

	t.Run("ChallengedTwice", func(t *testing.T) {
		e := setup(t, testutil.FakeSiteConfig{Seed: 23, Challenge: true})
		_, err := e.run(t, "sku-3", func(u *sessions.Unit) {
			run := u.Steps[0].Run
			u.Steps[0].Run = func(ctx context.Context, sc *sessions.StepContext) error {
				sc.Collector().SetCookieJar(forgetfulJar{})
				return run(ctx, sc)
			}
		})
		require.Error(t, err)
		assert.Equal(t, tasks.CategoryBlocked, sessions.CategoryOf(err))
		var fe *sessions.FetchError
		require.True(t, errors.As(err, &fe))
		assert.Equal(t, http.StatusOK, fe.Status, "a challenge page is a 200")
		assert.Equal(t, "search", fe.Step)
		assert.Contains(t, err.Error(), "challenged again")
		assert.Equal(t, 2, e.site.Challenges(), "one retry, no more")
		assert.Equal(t, 2, e.site.Hits("/search"))
	})
}

func TestIsChallenge(t *testing.T) {
	for body, want := range map[string]bool{
		`<!DOCTYPE html><html><head><meta name="challenge" content="1"></head><body></body></html>`:      true,
		`<!DOCTYPE html><html><head><meta name="price-token" content="ab12"></head><body></body></html>`: false,
		`{"sku":"sku-1","price":"19.99","currency":"USD","exit":"127.0.0.2"}`:                            false,
		``: false,
	} {
		assert.Equal(t, want, catalog.IsChallenge([]byte(body)), body)
	}
}

// dropClearance replaces the step's cookie jar with one that holds the same cookies for
// the shop but its clearance.
func dropClearance(t *testing.T, sc *sessions.StepContext, shop string) {
	t.Helper()
	jar, err := cookiejar.New(nil)
	require.NoError(t, err)
	u, err := url.Parse(shop)
	require.NoError(t, err)
	var keep []*http.Cookie
	for _, c := range sc.Collector().Cookies(shop) {
		if c.Name != "clearance" {
			keep = append(keep, c)
		}
	}
	jar.SetCookies(u, keep)
	sc.Collector().SetCookieJar(jar)
}

// forgetfulJar is a cookie jar that keeps nothing.
type forgetfulJar struct{}

func (forgetfulJar) SetCookies(*url.URL, []*http.Cookie) {}
func (forgetfulJar) Cookies(*url.URL) []*http.Cookie     { return nil }
