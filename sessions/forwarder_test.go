package sessions

import (
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// forwarderEnv is a render proxy for one session of a fake gateway, with the counters its
// render would keep.
type forwarderEnv struct {
	proxy    *testutil.FakeProxy
	sess     *Session
	fwd      *renderProxy
	refused  atomic.Int64
	authFail atomic.Int64
}

func newForwarderEnv(t *testing.T, pc testutil.FakeProxyConfig, guard *Guard) *forwarderEnv {
	t.Helper()
	pc.Format, pc.User, pc.Password = testutil.ProxyFormatGeneric, "acct", canary
	e := &forwarderEnv{proxy: testutil.NewFakeProxy(t, pc)}
	p, err := NewProvider("generic", e.proxy.Addr, "{user}[-country-{country}]-session-{session}", "{pass}", "acct", canary, 0)
	require.NoError(t, err)
	e.sess, err = p.NewSession("US", 0, time.Now())
	require.NoError(t, err)
	e.fwd, err = newRenderProxy(context.Background(), e.sess, 5*time.Second, guard.Check,
		func() { e.refused.Add(1) }, func() { e.authFail.Add(1) }, nil, nil)
	require.NoError(t, err)
	t.Cleanup(e.fwd.close)
	return e
}

// client goes through the render proxy, with its token when withToken.
func (e *forwarderEnv) client(t *testing.T, withToken bool, roots *tls.Config) *http.Client {
	t.Helper()
	u := &url.URL{Scheme: "http", Host: e.fwd.addr()}
	if withToken {
		u.User = url.UserPassword(e.fwd.token())
	}
	tr := &http.Transport{Proxy: http.ProxyURL(u), TLSClientConfig: roots, DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 10 * time.Second}
}

func get(c *http.Client, u string) (int, http.Header, string, error) {
	resp, err := c.Get(u)
	if err != nil {
		return 0, nil, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, string(b), err
}

// TestRenderProxyAddsSessionCredentials: through a gateway that serves requests without
// credentials, every request the render proxy forwards — plain HTTP on a kept-alive
// connection and a CONNECT tunnel — carries the session's credentials; a client without
// the render's token gets the proxy's own 407 and nothing reaches the gateway; the bytes
// exchanged with the gateway are counted; the credentials are in no answer.
func TestRenderProxyAddsSessionCredentials(t *testing.T) {
	e := newForwarderEnv(t, testutil.FakeProxyConfig{Seed: 41, NoChallenge: true}, LoopbackGuard())
	site := testutil.NewFakeSite(t, testutil.FakeSiteConfig{Seed: 41})
	tlsSite := testutil.NewFakeSite(t, testutil.FakeSiteConfig{Seed: 41, TLS: true})

	status, hdr, body, err := get(e.client(t, false, nil), site.URL+"/search?q=sku-1")
	require.NoError(t, err)
	assert.Equal(t, http.StatusProxyAuthRequired, status, "no token: the render proxy's own challenge")
	assert.Equal(t, `Basic realm="`+renderProxyRealm+`"`, hdr.Get("Proxy-Authenticate"))
	assert.Zero(t, e.proxy.Requests(), "nothing reached the gateway")
	assert.NotContains(t, body, canary)

	c := e.client(t, true, &tls.Config{RootCAs: tlsSite.CertPool()})
	var bodies int
	for _, u := range []string{site.URL + "/search?q=sku-1", site.URL + "/search?q=sku-2", tlsSite.URL + "/search?q=sku-3"} {
		status, _, body, err := get(c, u)
		require.NoError(t, err, u)
		require.Equal(t, http.StatusOK, status, u)
		assert.NotContains(t, body, canary)
		bodies += len(body)
	}
	seen := e.proxy.Seen()
	require.Len(t, seen, 3)
	for _, q := range seen {
		assert.Equal(t, "valid", q.Credentials, "%s %s%s", q.Method, q.Target, q.Path)
		assert.Equal(t, e.sess.ID, q.Session, "%s %s%s", q.Method, q.Target, q.Path)
	}
	assert.Equal(t, []string{"GET", "GET", "CONNECT"}, []string{seen[0].Method, seen[1].Method, seen[2].Method})
	assert.Greater(t, e.fwd.owner.n.Load(), int64(bodies), "the bytes exchanged with the gateway are counted")
	assert.Zero(t, e.refused.Load())
	assert.Zero(t, e.authFail.Load())
}

// TestRenderProxyGuard: a destination the guard refuses — plain HTTP or CONNECT, as a
// WebRTC TCP candidate or anything CDP's Fetch domain does not see would ask — is answered
// 403 by the render proxy, counted, and never reaches the gateway.
func TestRenderProxyGuard(t *testing.T) {
	site := testutil.NewFakeSite(t, testutil.FakeSiteConfig{Seed: 42})
	su, err := url.Parse(site.URL)
	require.NoError(t, err)
	port, err := strconv.Atoi(su.Port())
	require.NoError(t, err)
	guard := NewGuard(&tasks.DestinationPolicy{Allow: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Ports: []uint16{uint16(port)}})
	e := newForwarderEnv(t, testutil.FakeProxyConfig{Seed: 42}, guard)
	other := testutil.NewFakeSite(t, testutil.FakeSiteConfig{Seed: 43})
	c := e.client(t, true, nil)

	status, _, _, err := get(c, site.URL+"/search?q=sku-1")
	require.NoError(t, err)
	assert.Equal(t, http.StatusOK, status, "the allowed port")
	status, _, _, err = get(c, other.URL+"/search?q=sku-1")
	require.NoError(t, err)
	assert.Equal(t, http.StatusForbidden, status, "another port")
	_, _, _, err = get(c, "https://"+strings.TrimPrefix(other.URL, "http://")+"/")
	assert.Error(t, err, "CONNECT to another port refused")
	assert.Equal(t, int64(2), e.refused.Load())
	assert.Zero(t, other.TotalHits())
	assert.Equal(t, int64(1), e.proxy.Requests(), "only the allowed request reached the gateway")
}

// TestRenderProxyGatewayFailures: the gateway refusing the session's credentials is
// reported (the render ends proxy_auth) and Chromium gets no challenge to answer; a device
// that drops mid-response drops Chromium's connection too (the render sees the short body:
// a lost session), never a clean answer; after close nothing listens.
func TestRenderProxyGatewayFailures(t *testing.T) {
	e := newForwarderEnv(t, testutil.FakeProxyConfig{Seed: 44}, LoopbackGuard())
	site := testutil.NewFakeSite(t, testutil.FakeSiteConfig{Seed: 44})
	c := e.client(t, true, nil)

	e.proxy.DropNext("/search")
	_, _, _, err := get(c, site.URL+"/search?q=sku-1")
	assert.Error(t, err, "the device dropped: the response is cut, not completed")

	e.proxy.SetRefusing(true)
	status, hdr, body, err := get(e.client(t, true, nil), site.URL+"/search?q=sku-1")
	require.NoError(t, err)
	assert.Equal(t, http.StatusProxyAuthRequired, status)
	assert.Empty(t, hdr.Get("Proxy-Authenticate"), "no challenge for Chromium to answer")
	assert.NotContains(t, body, canary)
	assert.Equal(t, int64(1), e.authFail.Load())

	addr := e.fwd.addr()
	e.fwd.close()
	_, err = net.DialTimeout("tcp", addr, time.Second)
	assert.Error(t, err, "nothing listens after close")
}
