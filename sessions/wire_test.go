package sessions_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/politeness"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/testutil"
)

// wireSite is a destination with pages of the sizes and encodings the wire count must get
// right: /small (1 KB), /large (2 MiB), /gz (gzip on the wire), /redirect (to /small) and
// /robots.txt.
func wireSite(t *testing.T, useTLS bool) *httptest.Server {
	t.Helper()
	rng := rand.New(rand.NewPCG(37, 1))
	text := func(n int) []byte {
		words := []string{"price", "sku", "widget", "catalog", "red", "blue", "size", "in stock", "ships", "today"}
		var b bytes.Buffer
		for b.Len() < n {
			b.WriteString(words[rng.IntN(len(words))])
			b.WriteByte(' ')
		}
		return b.Bytes()[:n]
	}
	small, large, plain := text(1<<10), text(2<<20), text(256<<10)
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	_, _ = zw.Write(plain)
	require.NoError(t, zw.Close())
	mux := http.NewServeMux()
	mux.HandleFunc("/small", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write(small) })
	mux.HandleFunc("/large", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write(large) })
	mux.HandleFunc("/gz", func(w http.ResponseWriter, r *http.Request) {
		if !strings.Contains(r.Header.Get("Accept-Encoding"), "gzip") {
			_, _ = w.Write(plain)
			return
		}
		w.Header().Set("Content-Encoding", "gzip")
		_, _ = w.Write(gz.Bytes())
	})
	mux.HandleFunc("/redirect", func(w http.ResponseWriter, r *http.Request) { http.Redirect(w, r, "/small", http.StatusFound) })
	// /page is rendered: its script fetches /api/data (XHR, 64 KB, gzip on the wire) and
	// /api/small, then marks #out ready. /go redirects to it.
	api := text(64 << 10)
	var apiGz bytes.Buffer
	zw = gzip.NewWriter(&apiGz)
	_, _ = zw.Write(api)
	require.NoError(t, zw.Close())
	mux.HandleFunc("/page", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		_, _ = fmt.Fprintf(w, `<!doctype html><title>wire</title><p>%s</p><div id="out"></div>
<script>
Promise.all([fetch("/api/data").then(r => r.text()), fetch("/api/small").then(r => r.text())]).then(([a, b]) => {
  const out = document.getElementById("out");
  out.textContent = a.length + " " + b.length;
  out.className = "ready";
});
</script>`, small)
	})
	mux.HandleFunc("/go", func(w http.ResponseWriter, r *http.Request) { http.Redirect(w, r, "/page", http.StatusFound) })
	mux.HandleFunc("/api/data", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		if strings.Contains(r.Header.Get("Accept-Encoding"), "gzip") {
			w.Header().Set("Content-Encoding", "gzip")
			_, _ = w.Write(apiGz.Bytes())
			return
		}
		_, _ = w.Write(api)
	})
	mux.HandleFunc("/api/small", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write(small) })
	mux.HandleFunc("/robots.txt", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write(append([]byte("User-agent: *\nDisallow: /private/\n# "), text(8<<10)...))
	})
	var srv *httptest.Server
	if useTLS {
		srv = httptest.NewTLSServer(mux)
	} else {
		srv = httptest.NewServer(mux)
	}
	t.Cleanup(srv.Close)
	return srv
}

// wireRun is one collector's traffic through its own proxy: what the collector recorded
// and what the proxy exchanged with it.
type wireRun struct {
	recorded, recordedSent int64
	refused, refusedSent   int64 // the proxy's refusals (RefusedBytes), not in recorded
	robots                 int64 // robots.txt bytes reported to the fleet (OnFetch)
	fromClient, toClient   int64
	rendered               []*sessions.Rendered
}

// runWire fetches paths (in order) from srv through a fresh FakeProxy on one session,
// closes the collector and waits until the proxy has closed every client connection, so
// that both counts are final. refuse makes the proxy refuse every request: "407" (the
// account's credentials) or "502" (no peer in the session's country, with Bright-Data-style
// error headers); "" serves them. robots, if set, is the
// fleet robots.txt cache the collector checks. A path "render:<path>" is rendered with
// pool (its #out filled by its XHRs) instead of fetched.
func runWire(t *testing.T, srv *httptest.Server, refuse string, robots func(onFetch func(int64)) *politeness.RobotsCache, pool *sessions.BrowserPool, paths ...string) wireRun {
	t.Helper()
	pcfg := testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: "acct", Password: canary, Seed: 37}
	if refuse == "502" {
		pcfg.UnavailableCountries, pcfg.ErrorHeaders = []string{"US"}, true
	}
	proxy := testutil.NewFakeProxy(t, pcfg)
	proxy.SetRefusing(refuse == "407")
	p, err := sessions.NewProvider("generic", proxy.Addr, "{user}[-country-{country}]-session-{session}", "{pass}", "acct", canary, 0)
	require.NoError(t, err)
	sess, err := p.NewSession("US", time.Hour, time.Now())
	require.NoError(t, err)
	cfg := &sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), RequestTimeout: 10 * time.Second, IgnoreRobotsTxt: true, Browsers: pool}
	if srv.Certificate() != nil {
		pool := x509.NewCertPool()
		pool.AddCert(srv.Certificate())
		cfg.TLSConfig = &tls.Config{RootCAs: pool}
	}
	var run wireRun
	var robotsBytes atomic.Int64
	if robots != nil {
		cfg.IgnoreRobotsTxt = false
		cfg.Robots = robots(func(n int64) { robotsBytes.Add(n) })
	}
	b, err := sessions.NewCollector(context.Background(), sess, cfg)
	require.NoError(t, err)
	for _, path := range paths {
		if page, ok := strings.CutPrefix(path, "render:"); ok {
			if refuse != "" {
				// The page is the proxy's refusal: nothing to wait for.
				_, err := b.Render(srv.URL+page, sessions.RenderOptions{})
				require.Error(t, err, path)
				continue
			}
			rendered, err := b.Render(srv.URL+page, sessions.RenderOptions{WaitFor: "#out.ready", Capture: []string{"/api/"}})
			require.NoError(t, err, path)
			require.Contains(t, rendered.HTML, `<div id="out" class="ready">65536 1024</div>`, "the page's XHRs ran")
			require.Len(t, rendered.Captured, 2, "both XHRs were captured")
			run.rendered = append(run.rendered, rendered)
			continue
		}
		res, err := b.Get(srv.URL + path)
		if refuse != "" {
			require.Error(t, err, path)
			assert.Equal(t, refuse, strconv.Itoa(b.LastStatus()))
			continue
		}
		require.NoError(t, err, path)
		require.Equal(t, http.StatusOK, res.StatusCode, path)
		require.NotEmpty(t, res.Body, path)
	}
	b.Close()
	require.Eventually(t, func() bool { return proxy.OpenClients() == 0 }, 10*time.Second, 5*time.Millisecond,
		"the proxy closes its client connections once the collector closed its idle ones")
	run.recorded, run.recordedSent, run.robots = b.Bytes(), sessions.BytesSent(b), robotsBytes.Load()
	run.refused, run.refusedSent = b.RefusedBytes(), sessions.RefusedSent(b)
	assert.Equal(t, run.robots, b.RobotsBytes(), "the collector's robots.txt bytes are what the fleet was told of")
	run.fromClient, run.toClient = proxy.ClientBytes()
	return run
}

// within2 asserts that got is within 2 % of want.
func within2(t *testing.T, want, got int64, what string) {
	t.Helper()
	require.Positive(t, want, what)
	diff := float64(got-want) / float64(want)
	assert.InDelta(t, 0, diff, 0.02, "%s: recorded %d, the proxy counted %d (%+.1f %%)", what, got, want, 100*diff)
}

// TestWireBytesMatchProxy: what a collector records (Bound.Bytes, hence Result.Bytes, the
// bandwidth and money budgets and the cost in stats) is what the proxy moved for it on the
// wire, both directions, within 2 %: headers the transport adds (Proxy-Authorization,
// Host, Accept-Encoding), the CONNECT exchange and TLS included, and for a render what
// Chromium and its forwarder exchanged with the gateway (the document, a redirect, its
// XHRs). The proxy's refusals (a 407 round trip) are on the wire too but recorded apart
// (RefusedBytes), not as the job's: providers do not bill them. Robots.txt bytes are the
// fleet's and not the job's.
func TestWireBytesMatchProxy(t *testing.T) {
	check := func(t *testing.T, run wireRun) {
		t.Helper()
		t.Logf("recorded %d (sent %d), refused %d (sent %d); proxy read %d from the client, wrote %d to it",
			run.recorded, run.recordedSent, run.refused, run.refusedSent, run.fromClient, run.toClient)
		within2(t, run.fromClient, run.recordedSent+run.refusedSent, "client → proxy")
		within2(t, run.toClient, run.recorded-run.recordedSent+run.refused-run.refusedSent, "proxy → client")
		within2(t, run.fromClient+run.toClient, run.recorded+run.refused, "both ways")
	}
	for _, useTLS := range []bool{false, true} {
		srv := wireSite(t, useTLS)
		for _, tc := range []struct {
			name   string
			paths  []string
			refuse string
		}{
			{"Small", []string{"/small", "/small", "/small"}, ""},
			{"Large", []string{"/large"}, ""},
			{"Gzip", []string{"/gz", "/gz"}, ""},
			{"Redirect", []string{"/redirect", "/redirect"}, ""},
			{"Refused407", []string{"/small", "/small"}, "407"},
			{"NoPeers502", []string{"/small", "/small"}, "502"},
		} {
			t.Run(fmt.Sprintf("TLS=%v/%s", useTLS, tc.name), func(t *testing.T) {
				run := runWire(t, srv, tc.refuse, nil, nil, tc.paths...)
				check(t, run)
				if tc.refuse != "" {
					assert.Zero(t, run.recorded, "a refusal is not the job's traffic")
				} else {
					assert.Zero(t, run.refused, "nothing was refused")
				}
			})
		}
		t.Run(fmt.Sprintf("TLS=%v/RobotsAreTheFleets", useTLS), func(t *testing.T) {
			ns := testutil.Redis(t)
			robots := func(onFetch func(int64)) *politeness.RobotsCache {
				rc, err := politeness.NewRobotsCache(politeness.RobotsConfig{Redis: ns.Client, KeyPrefix: ns.Prefix,
					OnFetch: func(_ string, _ int, n int64) { onFetch(n) }})
				require.NoError(t, err)
				return rc
			}
			run := runWire(t, srv, "", robots, nil, "/small", "/large")
			t.Logf("job %d, robots.txt %d; proxy read %d from the client, wrote %d to it",
				run.recorded, run.robots, run.fromClient, run.toClient)
			require.Greater(t, run.robots, int64(8<<10), "the robots.txt fetch is counted, for the fleet")
			within2(t, run.fromClient+run.toClient, run.recorded+run.robots, "job and fleet together")
			within2(t, run.fromClient+run.toClient-run.robots, run.recorded, "the job alone")
		})
	}
	// Renders: plain-HTTP pages (Chromium does not trust the test server's certificate),
	// a redirect, two XHRs (one gzip), a colly fetch on the same session before them.
	srv := wireSite(t, false)
	pool := newPool(t, sessions.BrowserConfig{MaxBrowsers: 1})
	t.Run("Render/XHR", func(t *testing.T) {
		run := runWire(t, srv, "", nil, pool, "/small", "render:/go", "render:/page")
		check(t, run)
		require.Len(t, run.rendered, 2)
		assert.Zero(t, run.refused, "nothing was refused")
		for _, r := range run.rendered {
			assert.Greater(t, r.Bytes, int64(10<<10), "the render's bytes are its own too (Rendered.Bytes)")
		}
	})
	t.Run("Render/Refused407", func(t *testing.T) {
		run := runWire(t, srv, "407", nil, pool, "render:/page")
		check(t, run)
		assert.Zero(t, run.recorded, "a refusal is not the job's traffic")
	})
	t.Run("Render/NoPeers502", func(t *testing.T) {
		run := runWire(t, srv, "502", nil, pool, "render:/page")
		check(t, run)
		assert.Zero(t, run.recorded, "a refusal is not the job's traffic")
	})
}

// TestWireBytesSharedConnections: plain-HTTP requests of different sessions share the
// gateway's kept-alive connections (plainTransport); each byte is charged to the session
// whose request it belonged to — an idle connection's pending read, started for one
// session's request, returns the next session's response — so that each session records
// what it would have recorded alone, and together what the proxy moved.
func TestWireBytesSharedConnections(t *testing.T) {
	srv := wireSite(t, false)
	soloA := runWire(t, srv, "", nil, nil, "/small", "/small", "/small")
	soloB := runWire(t, srv, "", nil, nil, "/gz", "/redirect")

	proxy := testutil.NewFakeProxy(t, testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: "acct", Password: canary, Seed: 37})
	p, err := sessions.NewProvider("generic", proxy.Addr, "{user}[-country-{country}]-session-{session}", "{pass}", "acct", canary, 0)
	require.NoError(t, err)
	bound := func() *sessions.Bound {
		sess, err := p.NewSession("US", time.Hour, time.Now())
		require.NoError(t, err)
		b, err := sessions.NewCollector(context.Background(), sess,
			&sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), RequestTimeout: 10 * time.Second, IgnoreRobotsTxt: true})
		require.NoError(t, err)
		return b
	}
	a, b := bound(), bound()
	for _, step := range []struct {
		b    *sessions.Bound
		path string
	}{{a, "/small"}, {b, "/gz"}, {a, "/small"}, {b, "/redirect"}, {a, "/small"}} {
		res, err := step.b.Get(srv.URL + step.path)
		require.NoError(t, err, step.path)
		require.Equal(t, http.StatusOK, res.StatusCode, step.path)
	}
	assert.Equal(t, 1, proxy.OpenClients(), "the two sessions' requests went over one kept-alive connection")
	a.Close()
	b.Close()
	require.Eventually(t, func() bool { return proxy.OpenClients() == 0 }, 10*time.Second, 5*time.Millisecond)
	from, to := proxy.ClientBytes()
	t.Logf("session A %d (alone %d), session B %d (alone %d); the proxy moved %d", a.Bytes(), soloA.recorded, b.Bytes(), soloB.recorded, from+to)
	within2(t, soloA.recorded, a.Bytes(), "session A")
	within2(t, soloB.recorded, b.Bytes(), "session B")
	within2(t, from+to, a.Bytes()+b.Bytes(), "both sessions")
	within2(t, from, sessions.BytesSent(a)+sessions.BytesSent(b), "client → proxy")
}
