package sessions_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/sessions/profile"
	"github.com/idemscrape/idemscrape/testutil"
)

// seenRequest is what the header-recording site saw of one request.
type seenRequest struct {
	Path, Session, UA, Lang, Hints, Platform string
}

// TestSessionHeaderProfileStable: every request of a session — colly's and Chromium's (the
// page and its XHR), over the several units a warm session serves — carries the profile
// the session was given when it opened; another session carries its own.
func TestSessionHeaderProfileStable(t *testing.T) {
	e := setup(t, testutil.FakeProxyConfig{Seed: 71}, testutil.FakeSiteConfig{Seed: 71})
	var (
		mu   sync.Mutex
		seen []seenRequest
	)
	site := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = append(seen, seenRequest{Path: r.URL.Path, Session: r.URL.Query().Get("s"), UA: r.UserAgent(),
			Lang: r.Header.Get("Accept-Language"), Hints: r.Header.Get("Sec-Ch-Ua"), Platform: r.Header.Get("Sec-Ch-Ua-Platform")})
		mu.Unlock()
		switch r.URL.Path {
		case "/page":
			w.Header().Set("Content-Type", "text/html")
			fmt.Fprint(w, `<!DOCTYPE html><html><body><p id="done">…</p><script>
fetch("/xhr" + location.search).then(r => r.text()).then(() => { const p = document.getElementById("done"); p.className = "ready"; p.textContent = "ok"; });
</script></body></html>`)
		default:
			fmt.Fprint(w, "ok")
		}
	}))
	defer site.Close()
	browsers := newPool(t, sessions.BrowserConfig{MaxBrowsers: 1})
	pool, err := sessions.NewPool(sessions.PoolConfig{})
	require.NoError(t, err)
	defer pool.Close()
	cfg := e.runCfg()
	cfg.Collector.Browsers = browsers
	cfg.Pool = pool
	// Chromium-family profiles: a rendered page can pass only for Chromium.
	cfg.Profiles = &profile.Options{Browsers: []string{profile.Chrome, profile.Edge}, Locales: []string{"en-US", "de-DE", "fr-FR"}}

	unit := func() *sessions.Unit {
		get := func(path string) sessions.Step {
			return sessions.Step{Name: path, Safe: true, Run: func(_ context.Context, sc *sessions.StepContext) error {
				_, err := sc.Get(site.URL + path + "?s=" + sc.Session.ID)
				return err
			}}
		}
		return &sessions.Unit{Name: "profiled", Site: "127.0.0.1", Steps: []sessions.Step{get("/a"), get("/b"),
			{Name: "render", Safe: true, Run: func(_ context.Context, sc *sessions.StepContext) error {
				_, err := sc.Render(site.URL+"/page?s="+sc.Session.ID, sessions.RenderOptions{WaitFor: "#done.ready"})
				return err
			}}}}
	}
	profiles := map[string]profile.Profile{} // session → its profile
	run := func(cfg sessions.RunConfig) sessions.Result {
		t.Helper()
		res, err := unit().Run(context.Background(), cfg)
		require.NoError(t, err)
		require.NotNil(t, res.Session.Profile)
		if p, ok := profiles[res.Session.ID]; ok {
			require.Equal(t, p, *res.Session.Profile, "a warm session keeps its profile")
		}
		profiles[res.Session.ID] = *res.Session.Profile
		return res
	}
	first := run(cfg)
	first.Lease.Keep()
	second := run(cfg)
	require.True(t, second.Warm)
	require.Equal(t, first.Session.ID, second.Session.ID)
	second.Lease.Keep()
	// New sessions until one presents another client (4 profiles × 3 locales to pick from).
	alone := cfg
	alone.Pool = nil
	var other string
	for range 20 {
		res := run(alone)
		if res.Session.Profile.String() != profiles[first.Session.ID].String() {
			other = res.Session.ID
			break
		}
	}
	require.NotEmpty(t, other, "a new session picks its own profile")

	mu.Lock()
	defer mu.Unlock()
	perSession := map[string]int{}
	for _, s := range seen {
		if s.Path == "/robots.txt" {
			continue
		}
		p, ok := profiles[s.Session]
		require.True(t, ok, "request %s of an unknown session %q", s.Path, s.Session)
		perSession[s.Session]++
		h := p.Headers()
		assert.Equal(t, p.UserAgent, s.UA, "%s of session %s: User-Agent", s.Path, s.Session)
		assert.Equal(t, h.Get("Sec-Ch-Ua"), s.Hints, "%s of session %s: sec-ch-ua", s.Path, s.Session)
		assert.Equal(t, h.Get("Sec-Ch-Ua-Platform"), s.Platform, "%s of session %s: sec-ch-ua-platform", s.Path, s.Session)
		if s.Path != "/xhr" && s.Path != "/page" {
			assert.Equal(t, p.AcceptLanguage, s.Lang, "%s of session %s: Accept-Language", s.Path, s.Session)
		} else {
			assert.Contains(t, s.Lang, p.Languages[0], "%s of session %s (Chromium): Accept-Language", s.Path, s.Session)
		}
	}
	assert.Equal(t, 8, perSession[first.Session.ID], "two units of four requests (a, b, the page, its XHR) on the warm session")
	assert.Equal(t, 4, perSession[other])
}
