package politeness_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gocolly/colly/v2"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/politeness"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// robotsSite is a destination whose robots.txt answer the test sets, counting hits per path.
type robotsSite struct {
	*httptest.Server
	mu     sync.Mutex
	hits   map[string]int
	status int
	body   string
	header http.Header
}

func newRobotsSite(t *testing.T, status int, body string, header http.Header) *robotsSite {
	t.Helper()
	s := &robotsSite{hits: map[string]int{}, status: status, body: body, header: header}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		s.hits[r.URL.Path]++
		status, body, header := s.status, s.body, s.header
		s.mu.Unlock()
		switch r.URL.Path {
		case "/robots.txt":
			for k, v := range header {
				w.Header()[k] = v
			}
			w.WriteHeader(status)
			_, _ = fmt.Fprint(w, body)
		case "/go":
			http.Redirect(w, r, "/private/x", http.StatusFound)
		default:
			_, _ = fmt.Fprint(w, "<p>page</p>")
		}
	}))
	t.Cleanup(s.Close)
	return s
}

func (s *robotsSite) Hits(path string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.hits[path]
}

func (s *robotsSite) set(status int, body string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.status, s.body = status, body
}

// env is a fake residential proxy in front of a fake site, and a provider of sticky
// sessions on the proxy: the collectors of the tests fetch robots.txt as a worker's do.
type env struct {
	site     *testutil.FakeSite
	provider *sessions.Provider
}

func newEnv(t *testing.T, site testutil.FakeSiteConfig) *env {
	t.Helper()
	const user, pass = "acct", "proxy-pass"
	proxy := testutil.NewFakeProxy(t, testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: user, Password: pass})
	prov, err := sessions.NewProvider("generic", proxy.Addr, "{user}[-country-{country}]-session-{session}", "{pass}", user, pass, 0)
	require.NoError(t, err)
	return &env{site: testutil.NewFakeSite(t, site), provider: prov}
}

type robotsRig struct {
	e       *env
	ns      *testutil.RedisNS
	cache   *politeness.RobotsCache
	fetches atomic.Int64
	bytes   atomic.Int64
}

func newRobotsRig(t *testing.T, siteCfg testutil.FakeSiteConfig, mutate func(*politeness.RobotsConfig)) *robotsRig {
	t.Helper()
	rr := &robotsRig{e: newEnv(t, siteCfg), ns: testutil.Redis(t)}
	cfg := politeness.RobotsConfig{Redis: rr.ns.Client, KeyPrefix: rr.ns.Prefix,
		OnFetch: func(_ string, _ int, n int64) { rr.fetches.Add(1); rr.bytes.Add(n) }}
	if mutate != nil {
		mutate(&cfg)
	}
	var err error
	rr.cache, err = politeness.NewRobotsCache(cfg)
	require.NoError(t, err)
	return rr
}

// get fetches rawURL on a new session with the shared cache and returns the collector.
func (rr *robotsRig) get(t *testing.T, rawURL string) (*sessions.Bound, error) {
	t.Helper()
	s, err := rr.e.provider.NewSession("US", 0, time.Now())
	require.NoError(t, err)
	b, err := sessions.NewCollector(context.Background(), s, &sessions.CollectorConfig{
		Guard: sessions.LoopbackGuard(), RequestTimeout: 5 * time.Second, Robots: rr.cache})
	require.NoError(t, err)
	t.Cleanup(b.Close)
	_, err = b.Get(rawURL)
	return b, err
}

func TestRobotsCache(t *testing.T) {
	t.Run("OncePerHostAcrossCollectors", func(t *testing.T) {
		// A large robots.txt: if its bytes were counted against the job, every job that
		// fetched it would show them.
		big := testutil.DefaultFakeSiteRobots + "# " + strings.Repeat("x", 64<<10) + "\n"
		rr := newRobotsRig(t, testutil.FakeSiteConfig{Robots: big}, nil)
		const jobs = 20
		var wg sync.WaitGroup
		jobBytes := make([]int64, jobs)
		for i := range jobs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				b, err := rr.get(t, rr.e.site.URL+"/search?q=sku-1")
				if assert.NoError(t, err) {
					jobBytes[i] = b.Bytes()
				}
			}()
		}
		wg.Wait()
		assert.Equal(t, 1, rr.e.site.RobotsHits(), "one fetch for 20 collectors on 20 sessions")
		assert.Equal(t, int64(1), rr.fetches.Load())
		assert.Greater(t, rr.bytes.Load(), int64(64<<10), "the fetch's bytes went to OnFetch")
		for i, n := range jobBytes {
			assert.Less(t, n, int64(32<<10), "job %d was not charged for robots.txt", i)
		}
	})
	t.Run("DisallowedPathIsTerminal", func(t *testing.T) {
		rr := newRobotsRig(t, testutil.FakeSiteConfig{}, nil)
		_, err := rr.get(t, rr.e.site.URL+"/private/x")
		require.Error(t, err)
		assert.Equal(t, tasks.CategoryRobotsDisallowed, sessions.CategoryOf(err))
		assert.ErrorIs(t, err, colly.ErrRobotsTxtBlocked)
		assert.ErrorContains(t, err, "robots.txt of http://127.0.0.1")
		assert.ErrorContains(t, err, "/private/x")
		assert.Zero(t, rr.e.site.Hits("/private/x"))
	})
	t.Run("RedirectHopIsChecked", func(t *testing.T) {
		rr := newRobotsRig(t, testutil.FakeSiteConfig{}, nil)
		site := newRobotsSite(t, http.StatusOK, "User-agent: *\nDisallow: /private/\n", nil)
		_, err := rr.get(t, site.URL+"/go")
		require.Error(t, err)
		assert.Equal(t, tasks.CategoryRobotsDisallowed, sessions.CategoryOf(err))
		assert.Equal(t, 1, site.Hits("/go"))
		assert.Zero(t, site.Hits("/private/x"), "the redirect target was refused before it was fetched")
	})
	t.Run("ServerErrorDisallowsForAWhileRetryably", func(t *testing.T) {
		for _, status := range []int{http.StatusServiceUnavailable, http.StatusInternalServerError, http.StatusTooManyRequests} {
			t.Run(fmt.Sprint(status), func(t *testing.T) {
				rr := newRobotsRig(t, testutil.FakeSiteConfig{}, nil)
				site := newRobotsSite(t, status, "down", nil)
				for range 3 {
					_, err := rr.get(t, site.URL+"/page")
					require.Error(t, err)
					var fe *sessions.FetchError
					require.ErrorAs(t, err, &fe)
					assert.Equal(t, tasks.CategoryDestinationError, fe.Category, "retryable, not a failure of the job")
					assert.Equal(t, status, fe.Status)
					assert.ErrorContains(t, err, fmt.Sprintf("robots.txt of %s answered %d", strings.ToLower(site.URL), status))
				}
				assert.Equal(t, 1, site.Hits("/robots.txt"), "the answer is remembered for ErrorTTL")
				assert.Zero(t, site.Hits("/page"))
				pttl, err := rr.ns.Client.PTTL(context.Background(), robotsKey(t, rr.ns.Prefix, site.URL)).Result()
				require.NoError(t, err)
				assert.LessOrEqual(t, pttl, politeness.DefaultRobotsErrorTTL)
				assert.Greater(t, pttl, time.Duration(0))
			})
		}
	})
	t.Run("NotFoundAllowsEverything", func(t *testing.T) {
		rr := newRobotsRig(t, testutil.FakeSiteConfig{}, nil)
		site := newRobotsSite(t, http.StatusNotFound, "", nil)
		_, err := rr.get(t, site.URL+"/private/x")
		require.NoError(t, err)
		assert.Equal(t, 1, site.Hits("/private/x"))
	})
	t.Run("CacheControlSetsTheTTL", func(t *testing.T) {
		for _, tc := range []struct {
			name     string
			header   string
			min, max time.Duration
		}{
			{"MaxAge", "public, max-age=300", 290 * time.Second, 300 * time.Second},
			{"BelowMinTTL", "max-age=5", 50 * time.Second, politeness.DefaultRobotsMinTTL},
			{"NoStore", "no-store", 50 * time.Second, politeness.DefaultRobotsMinTTL},
			{"AboveTTL", "max-age=999999", 23 * time.Hour, politeness.DefaultRobotsTTL},
			{"None", "", 23 * time.Hour, politeness.DefaultRobotsTTL},
		} {
			t.Run(tc.name, func(t *testing.T) {
				rr := newRobotsRig(t, testutil.FakeSiteConfig{}, nil)
				site := newRobotsSite(t, http.StatusOK, "User-agent: *\nDisallow:\n", http.Header{"Cache-Control": {tc.header}})
				_, err := rr.get(t, site.URL+"/page")
				require.NoError(t, err)
				pttl, err := rr.ns.Client.PTTL(context.Background(), robotsKey(t, rr.ns.Prefix, site.URL)).Result()
				require.NoError(t, err)
				assert.GreaterOrEqual(t, pttl, tc.min)
				assert.LessOrEqual(t, pttl, tc.max)
			})
		}
	})
	t.Run("ProcessCopyExpiresWithTheEntry", func(t *testing.T) {
		clock := testutil.NewClock(time.Now())
		rr := newRobotsRig(t, testutil.FakeSiteConfig{}, func(c *politeness.RobotsConfig) { c.Now = clock.Now })
		site := newRobotsSite(t, http.StatusOK, "User-agent: *\nDisallow: /a\n", nil)
		_, err := rr.get(t, site.URL+"/b")
		require.NoError(t, err)
		// The site changes its rules and the shared entry goes (as at its TTL's end): this
		// process keeps its copy until LocalTTL, then reads Redis, misses, and fetches again.
		site.set(http.StatusOK, "User-agent: *\nDisallow: /b\n")
		require.NoError(t, rr.ns.Client.Del(context.Background(), robotsKey(t, rr.ns.Prefix, site.URL)).Err())
		_, err = rr.get(t, site.URL+"/b")
		require.NoError(t, err, "still the in-memory copy")
		clock.Advance(politeness.DefaultRobotsLocalTTL)
		_, err = rr.get(t, site.URL+"/b")
		require.Error(t, err)
		assert.Equal(t, tasks.CategoryRobotsDisallowed, sessions.CategoryOf(err))
		assert.Equal(t, 2, site.Hits("/robots.txt"))
	})
	t.Run("IgnoreRobotsTxtMeansNone", func(t *testing.T) {
		rr := newRobotsRig(t, testutil.FakeSiteConfig{}, nil)
		s, err := rr.e.provider.NewSession("US", 0, time.Now())
		require.NoError(t, err)
		b, err := sessions.NewCollector(context.Background(), s, &sessions.CollectorConfig{
			Guard: sessions.LoopbackGuard(), Robots: rr.cache, IgnoreRobotsTxt: true})
		require.NoError(t, err)
		defer b.Close()
		_, err = b.Get(rr.e.site.URL + "/private/x")
		require.NoError(t, err)
		assert.Zero(t, rr.e.site.RobotsHits())
	})
	t.Run("ConfigErrors", func(t *testing.T) {
		_, err := politeness.NewRobotsCache(politeness.RobotsConfig{})
		require.ErrorContains(t, err, "RobotsConfig.Redis")
		ns := testutil.Redis(t)
		_, err = politeness.NewRobotsCache(politeness.RobotsConfig{Redis: ns.Client, MinTTL: time.Hour, TTL: time.Minute})
		require.ErrorContains(t, err, "MinTTL")
	})
}

func robotsKey(t *testing.T, prefix, siteURL string) string {
	t.Helper()
	k, err := lua.NewKeys(prefix)
	require.NoError(t, err)
	return k.Robots(strings.ToLower(siteURL))
}

// recordingLimiter is a HostLimiter that records what the collector asked of it.
type recordingLimiter struct {
	mu     sync.Mutex
	waits  []string
	pauses map[string]time.Duration
	refuse error
}

func (l *recordingLimiter) Wait(_ context.Context, host string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.waits = append(l.waits, host)
	return l.refuse
}

func (l *recordingLimiter) Pause(_ context.Context, host string, d time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.pauses == nil {
		l.pauses = map[string]time.Duration{}
	}
	l.pauses[host] = d
}

func TestLimiterHooks(t *testing.T) {
	rr := newRobotsRig(t, testutil.FakeSiteConfig{}, nil)
	host := strings.TrimPrefix(rr.e.site.URL, "http://")
	newBound := func(t *testing.T, lim politeness.HostLimiter) *sessions.Bound {
		s, err := rr.e.provider.NewSession("US", 0, time.Now())
		require.NoError(t, err)
		b, err := sessions.NewCollector(context.Background(), s, &sessions.CollectorConfig{
			Guard: sessions.LoopbackGuard(), Robots: rr.cache, Limiter: lim, ThrottleWaitMax: -1})
		require.NoError(t, err)
		t.Cleanup(b.Close)
		return b
	}

	t.Run("EveryHopWaitsRobotsIncluded", func(t *testing.T) {
		lim := &recordingLimiter{}
		b := newBound(t, lim)
		_, err := b.Get(rr.e.site.URL + "/search?q=sku-1")
		require.NoError(t, err)
		_, err = b.Get(rr.e.site.URL + "/search?q=sku-2")
		require.NoError(t, err)
		assert.Equal(t, []string{host, host, host}, lim.waits, "robots.txt, then each request")
	})
	t.Run("RetryAfterPausesTheHost", func(t *testing.T) {
		lim := &recordingLimiter{}
		b := newBound(t, lim)
		rr.e.site.Throttle(1, 2*time.Second)
		_, err := b.Get(rr.e.site.URL + "/search?q=sku-1")
		require.Error(t, err)
		assert.Equal(t, tasks.CategoryThrottled, sessions.CategoryOf(err))
		assert.Equal(t, map[string]time.Duration{host: 2 * time.Second}, lim.pauses)
	})
	t.Run("RefusalStopsTheRequest", func(t *testing.T) {
		// Limits refuses with a politeness.Error; a limiter of the caller's may refuse with a
		// sessions.FetchError. Either way the request ends as a FetchError of its category.
		for _, refusal := range []error{
			&politeness.Error{Category: tasks.CategoryThrottled, RetryAfter: time.Minute, Err: errors.New("too far")},
			&sessions.FetchError{Category: tasks.CategoryThrottled, RetryAfter: time.Minute, Err: errors.New("too far")},
		} {
			before := rr.e.site.Hits("/search")
			b := newBound(t, &recordingLimiter{refuse: refusal})
			_, err := b.Get(rr.e.site.URL + "/search?q=sku-1")
			var fe *sessions.FetchError
			require.ErrorAs(t, err, &fe)
			assert.Equal(t, tasks.CategoryThrottled, fe.Category)
			assert.Equal(t, time.Minute, fe.RetryAfter)
			assert.EqualError(t, fe.Err, "too far")
			assert.Equal(t, before, rr.e.site.Hits("/search"))
		}
	})
}
