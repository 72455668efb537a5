package sessions_test

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/PuerkitoBio/goquery"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestRenderCredentialsWithoutChallenge: through a gateway that serves requests without
// credentials (an IP-allow-listed account: it never challenges with 407), every request
// of the render — the document, its price XHR, its picture — still arrives with the
// unit's sticky session, as the colly search before it does; none goes out without
// credentials (from another exit than the unit's).
func TestRenderCredentialsWithoutChallenge(t *testing.T) {
	e := setup(t, testutil.FakeProxyConfig{Seed: 31, NoChallenge: true}, testutil.FakeSiteConfig{Seed: 31})
	pool := newPool(t, sessions.BrowserConfig{MaxBrowsers: 1, LoadResources: []string{"Image"}})
	cfg := e.runCfg()
	cfg.Collector.Browsers = pool
	cfg.Collector.IgnoreRobotsTxt = true
	var seen []*sessions.Rendered
	unit := renderUnit(e.site.URL, "sku-2", sessions.RenderOptions{WaitFor: "#price.ready", Capture: []string{"/api/price/"}}, &seen)
	res, err := unit.Run(context.Background(), cfg)
	require.NoError(t, err)
	require.Len(t, seen, 1)

	paths := map[string]bool{}
	for _, q := range e.proxy.Seen() {
		assert.Equal(t, "valid", q.Credentials, "%s %s%s went out with credentials %q", q.Method, q.Target, q.Path, q.Credentials)
		assert.Equal(t, res.Session.ID, q.Session, "%s %s%s on the unit's session", q.Method, q.Target, q.Path)
		paths[q.Path] = true
	}
	for _, p := range []string{"/search", "/js/product/sku-2", "/api/price/sku-2", "/img/sku-2.png"} {
		assert.True(t, paths[p], "%s reached the gateway", p)
	}
	assert.Equal(t, e.proxy.Requests(), e.proxy.RequestsFor(res.Session.ID), "every request the gateway read was the session's")
	assert.NotContains(t, e.logs.String(), canary)

	// An https:// page: Chromium's CONNECT carries them too. (Chromium does not trust the
	// fake shop's self-signed certificate, so the render itself fails after the tunnel.)
	tlsSite := testutil.NewFakeSite(t, testutil.FakeSiteConfig{Seed: 31, TLS: true})
	before := len(e.proxy.Seen())
	unit = &sessions.Unit{Name: "tls", Steps: []sessions.Step{{Name: "render", Safe: true, Run: func(_ context.Context, sc *sessions.StepContext) error {
		_, err := sc.Render(tlsSite.URL+"/search?q=sku-1", sessions.RenderOptions{})
		return err
	}}}}
	res, _ = unit.Run(context.Background(), cfg)
	require.NotNil(t, res.Session)
	tunnels := 0
	for _, q := range e.proxy.Seen()[before:] {
		assert.Equal(t, "valid", q.Credentials, "%s %s went out with credentials %q", q.Method, q.Target, q.Credentials)
		assert.Contains(t, res.Sessions, q.Session, "%s %s on the unit's session", q.Method, q.Target)
		if q.Method == http.MethodConnect {
			tunnels++
		}
	}
	assert.NotZero(t, tunnels, "the page's CONNECT reached the gateway")
}

// TestRenderGatewayRefusesCredentials: the gateway refuses the session's credentials
// (407 to what the render's proxy sent): the render ends proxy_auth, as colly's path does.
func TestRenderGatewayRefusesCredentials(t *testing.T) {
	e := setup(t, testutil.FakeProxyConfig{Seed: 32}, testutil.FakeSiteConfig{Seed: 32})
	pool := newPool(t, sessions.BrowserConfig{MaxBrowsers: 1})
	cfg := e.runCfg()
	cfg.Collector.Browsers = pool
	cfg.Collector.IgnoreRobotsTxt = true
	e.proxy.SetRefusing(true)
	unit := &sessions.Unit{Name: "render", Steps: []sessions.Step{{Name: "render", Safe: true, Run: func(_ context.Context, sc *sessions.StepContext) error {
		_, err := sc.Render(e.site.URL+"/search?q=sku-1", sessions.RenderOptions{})
		return err
	}}}}
	_, err := unit.Run(context.Background(), cfg)
	assert.Equal(t, tasks.CategoryProxyAuth, sessions.CategoryOf(err), "%v", err)
	assert.NotZero(t, e.proxy.Refused(), "the gateway saw the session's credentials and refused them")
	assert.Zero(t, e.site.TotalHits(), "nothing reached the shop")
}

// webRTCPage is a page that opens WebRTC peer connections with a STUN server at
// 127.0.0.1:port (UDP) — from its own window and, with bypass, from a fresh iframe's,
// which a script injected into documents may not reach — waits until their ICE
// gathering is over (at most 10 s), and shows #done with data-tried (constructors it
// found) and data-thrown (those that threw).
func webRTCPage(port int, bypass bool) string {
	return fmt.Sprintf(`<!doctype html><p id="done" hidden>done</p>
<script>
const stun = {iceServers: [{urls: "stun:127.0.0.1:%d"}]};
let tried = 0, thrown = 0;
function open(win, name) {
  if (!(name in win)) return Promise.resolve();
  tried++;
  return new Promise(done => {
    try {
      const pc = new win[name](stun);
      pc.createDataChannel("probe");
      pc.onicegatheringstatechange = () => { if (pc.iceGatheringState === "complete") done(); };
      pc.createOffer().then(o => pc.setLocalDescription(o)).catch(done);
      setTimeout(done, 10000);
    } catch (e) { thrown++; done(); }
  });
}
const waits = [];
if (%t) {
  const f = document.createElement("iframe");
  document.body.appendChild(f);
  waits.push(open(f.contentWindow, "RTCPeerConnection"));
} else {
  waits.push(open(window, "RTCPeerConnection"), open(window, "webkitRTCPeerConnection"));
}
Promise.allSettled(waits).then(() => {
  const d = document.getElementById("done");
  d.dataset.tried = tried;
  d.dataset.thrown = thrown;
  d.hidden = false;
});
</script>`, port, bypass)
}

// TestRenderNoWebRTC: a page that creates RTCPeerConnections with a STUN server at a
// loopback UDP port the test listens on sends it nothing — WebRTC would go around the
// render's proxy and the guard (the worker's own address, internal addresses) — and each
// attempt is refused (the constructor throws) and counted in Rendered.Refused. A peer
// connection taken from a fresh iframe, where the refusal script may not reach, sends
// nothing either: Chromium runs with non-proxied UDP disabled.
func TestRenderNoWebRTC(t *testing.T) {
	e := setup(t, testutil.FakeProxyConfig{Seed: 33}, testutil.FakeSiteConfig{Seed: 33})
	pool := newPool(t, sessions.BrowserConfig{MaxBrowsers: 1})
	udp, err := net.ListenPacket("udp4", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = udp.Close() })
	var datagrams atomic.Int64
	go func() {
		buf := make([]byte, 2048)
		for {
			if _, _, err := udp.ReadFrom(buf); err != nil {
				return // closed
			}
			datagrams.Add(1)
		}
	}()
	port := udp.LocalAddr().(*net.UDPAddr).Port
	page := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		_, _ = fmt.Fprint(w, webRTCPage(port, r.URL.Query().Get("bypass") == "1"))
	}))
	t.Cleanup(page.Close)
	cfg := e.runCfg()
	cfg.Collector.Browsers = pool
	cfg.Collector.IgnoreRobotsTxt = true

	render := func(t *testing.T, query string) (*sessions.Rendered, int, int) {
		t.Helper()
		var seen *sessions.Rendered
		unit := &sessions.Unit{Name: "webrtc", Steps: []sessions.Step{{Name: "render", Safe: true, Run: func(_ context.Context, sc *sessions.StepContext) error {
			r, err := sc.Render(page.URL+"/webrtc"+query, sessions.RenderOptions{WaitFor: "#done"})
			seen = r
			return err
		}}}}
		_, err := unit.Run(context.Background(), cfg)
		require.NoError(t, err)
		doc, err := goquery.NewDocumentFromReader(strings.NewReader(seen.HTML))
		require.NoError(t, err)
		tried, err := strconv.Atoi(doc.Find("#done").AttrOr("data-tried", ""))
		require.NoError(t, err)
		thrown, err := strconv.Atoi(doc.Find("#done").AttrOr("data-thrown", ""))
		require.NoError(t, err)
		return seen, tried, thrown
	}

	t.Run("refused", func(t *testing.T) {
		before := datagrams.Load()
		r, tried, thrown := render(t, "")
		require.GreaterOrEqual(t, tried, 1, "the page found RTCPeerConnection")
		assert.Equal(t, tried, thrown, "every peer connection was refused in the page")
		assert.Equal(t, tried, r.Refused, "every attempt counted")
		assert.Zero(t, datagrams.Load()-before, "no STUN datagram reached the loopback UDP port")
	})
	t.Run("iframe", func(t *testing.T) {
		before := datagrams.Load()
		_, tried, _ := render(t, "?bypass=1")
		require.Equal(t, 1, tried)
		assert.Zero(t, datagrams.Load()-before, "no STUN datagram reached the loopback UDP port")
	})
}
