package testutil

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// fpTestFormat is one provider format with the account used in these tests and a builder
// of its credentials; "" leaves an option out.
type fpTestFormat struct {
	format, user, pass string
	cred               func(country, session string) (username, password string)
}

func fpOpt(prefix, v string) string {
	if v == "" {
		return ""
	}
	return prefix + v
}

var fpTestFormats = []fpTestFormat{
	{ProxyFormatBrightData, "brd-customer-hl_1a2b3c4d-zone-residential", "zone-secret-1",
		func(c, s string) (string, string) {
			return "brd-customer-hl_1a2b3c4d-zone-residential" + fpOpt("-country-", c) + fpOpt("-session-", s), "zone-secret-1"
		}},
	{ProxyFormatOxylabs, "acme_scraper", "oxy-secret-2",
		func(c, s string) (string, string) {
			u := "customer-acme_scraper" + fpOpt("-cc-", strings.ToUpper(c)) + fpOpt("-sessid-", s)
			if s != "" {
				u += "-sesstime-10"
			}
			return u, "oxy-secret-2"
		}},
	{ProxyFormatDecodo, "spacme", "decodo-secret-3",
		func(c, s string) (string, string) {
			u := "user-spacme" + fpOpt("-country-", c) + fpOpt("-session-", s)
			if s != "" {
				u += "-sessionduration-30"
			}
			return u, "decodo-secret-3"
		}},
	{ProxyFormatIPRoyal, "acme", "ipr-secret-4",
		func(c, s string) (string, string) {
			p := "ipr-secret-4" + fpOpt("_country-", c)
			if s != "" {
				p += "_session-" + s + "_lifetime-30m"
			}
			return "acme", p
		}},
	{ProxyFormatSOAX, "123456", "soax-secret-5",
		func(c, s string) (string, string) {
			u := "package-123456" + fpOpt("-country-", c)
			if s != "" {
				u += "-sessionid-" + s + "-sessionlength-600"
			}
			return u, "soax-secret-5"
		}},
	{ProxyFormatGeneric, "acme", "generic-secret-6",
		func(c, s string) (string, string) {
			return "acme" + fpOpt("-country-", c) + fpOpt("-session-", s), "generic-secret-6"
		}},
}

// fpEcho is a destination that reports what it saw of each request.
type fpEcho struct {
	*httptest.Server
	hits atomic.Int64
}

func newFPEcho(t *testing.T) *fpEcho {
	t.Helper()
	e := &fpEcho{}
	e.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.hits.Add(1)
		host, _, _ := net.SplitHostPort(r.RemoteAddr)
		switch r.URL.Path {
		case "/empty":
			w.Header().Set("Content-Length", "0")
			return
		case "/post":
			b, _ := io.ReadAll(r.Body)
			fmt.Fprintf(w, "method=%s\nbody=%s\nremote=%s\n", r.Method, b, host)
			return
		case "/chunked":
			for i := 0; i < 4; i++ {
				_, _ = io.WriteString(w, strings.Repeat("c", 1024))
				w.(http.Flusher).Flush()
			}
			return
		}
		fmt.Fprintf(w, "remote=%s\nx-fake-exit=%s\nproxy-authorization=%s\n",
			host, r.Header.Get("X-Fake-Exit"), r.Header.Get("Proxy-Authorization"))
	}))
	t.Cleanup(e.Close)
	return e
}

// fpClient returns a keep-alive client that goes through proxy with the credentials.
func fpClient(t *testing.T, p *FakeProxy, username, password string) *http.Client {
	t.Helper()
	u, err := url.Parse(p.URL())
	require.NoError(t, err)
	u.User = url.UserPassword(username, password)
	tr := &http.Transport{Proxy: http.ProxyURL(u)}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 10 * time.Second}
}

// fpGet does one GET and returns status, headers and body; a transport or body error is
// returned as err.
func fpGet(c *http.Client, target string) (int, http.Header, string, error) {
	resp, err := c.Get(target)
	if err != nil {
		return 0, nil, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, string(b), err
}

// fpEchoField extracts "name=value" from an echo body.
func fpEchoField(body, name string) string {
	for _, line := range strings.Split(body, "\n") {
		if v, ok := strings.CutPrefix(line, name+"="); ok {
			return v
		}
	}
	return ""
}

func fpNewProxy(t *testing.T, f fpTestFormat, mod func(*FakeProxyConfig)) *FakeProxy {
	t.Helper()
	cfg := FakeProxyConfig{Seed: 42, Format: f.format, User: f.user, Password: f.pass}
	if mod != nil {
		mod(&cfg)
	}
	return NewFakeProxy(t, cfg)
}

// fpTestClock is a clock the test steps by hand.
type fpTestClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fpTestClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fpTestClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

func TestFakeProxy(t *testing.T) {
	generic := fpTestFormats[len(fpTestFormats)-1]

	t.Run("NoChallengeServesWithoutCredentialsAndRecords", func(t *testing.T) {
		echo := newFPEcho(t)
		p := fpNewProxy(t, generic, func(c *FakeProxyConfig) { c.NoChallenge = true })
		tr := &http.Transport{Proxy: http.ProxyURL(&url.URL{Scheme: "http", Host: p.Addr})}
		t.Cleanup(tr.CloseIdleConnections)
		status, _, body, err := fpGet(&http.Client{Transport: tr, Timeout: 10 * time.Second}, echo.URL+"/anon")
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, status, "no Proxy-Authorization: served, as for an allow-listed IP")
		assert.NotEmpty(t, fpEchoField(body, "remote"))
		assert.Zero(t, p.Authenticated())

		user, pass := generic.cred("", "abcd1234")
		status, _, _, err = fpGet(fpClient(t, p, user, pass), echo.URL+"/sticky")
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, status)
		status, _, _, err = fpGet(fpClient(t, p, user, "wrong"), echo.URL+"/wrong")
		require.NoError(t, err)
		assert.Equal(t, http.StatusProxyAuthRequired, status, "wrong credentials are still refused")
		assert.Equal(t, int64(1), p.Authenticated())

		target := strings.TrimPrefix(echo.URL, "http://")
		assert.Equal(t, []FakeProxyRequest{
			{Method: "GET", Target: target, Path: "/anon", Credentials: "none"},
			{Method: "GET", Target: target, Path: "/sticky", Credentials: "valid", Session: "abcd1234"},
			{Method: "GET", Target: target, Path: "/wrong", Credentials: "invalid"},
		}, p.Seen())
	})

	t.Run("EveryFormatAcceptedAndWrongPasswordRefused", func(t *testing.T) {
		echo := newFPEcho(t)
		for _, f := range fpTestFormats {
			t.Run(f.format, func(t *testing.T) {
				p := fpNewProxy(t, f, nil)
				user, pass := f.cred("us", "abcd1234")
				status, _, body, err := fpGet(fpClient(t, p, user, pass), echo.URL+"/")
				require.NoError(t, err)
				require.Equal(t, http.StatusOK, status, body)
				exit := p.ExitOf("abcd1234")
				require.Regexp(t, `^127\.0\.0\.([2-9]|[1-9][0-9]|1[0-9][0-9]|2[0-4][0-9]|250)$`, exit)
				assert.Equal(t, exit, fpEchoField(body, "remote"), "destination sees the exit as RemoteAddr")
				assert.Equal(t, exit, fpEchoField(body, "x-fake-exit"))
				assert.Empty(t, fpEchoField(body, "proxy-authorization"), "credentials are not forwarded")

				user, pass = f.cred("", "")
				status, _, _, err = fpGet(fpClient(t, p, user, pass), echo.URL+"/")
				require.NoError(t, err)
				assert.Equal(t, http.StatusOK, status, "rotating, any country")

				user, pass = f.cred("us", "abcd1234")
				if f.format == ProxyFormatIPRoyal {
					pass = strings.Replace(pass, f.pass, "wrong", 1)
				} else {
					pass = "wrong"
				}
				status, hdr, body, err := fpGet(fpClient(t, p, user, pass), echo.URL+"/")
				require.NoError(t, err)
				assert.Equal(t, http.StatusProxyAuthRequired, status)
				assert.Equal(t, `Basic realm="fake"`, hdr.Get("Proxy-Authenticate"))
				assert.NotContains(t, body, f.pass)
				assert.NotContains(t, p.String(), f.pass)
				assert.NotContains(t, p.URL(), f.pass)
				assert.Equal(t, int64(3), p.Requests())
			})
		}
	})

	t.Run("MalformedUsernamesRefused", func(t *testing.T) {
		echo := newFPEcho(t)
		bad := map[string][][2]string{
			ProxyFormatBrightData: {
				{"brd-customer-hl_1a2b3c4d-zone-other", "zone-secret-1"},
				{"brd-customer-hl_1a2b3c4d-zone-residential-country-usa", "zone-secret-1"},
				{"brd-customer-hl_1a2b3c4d-zone-residential-session", "zone-secret-1"},
				{"brd-customer-hl_1a2b3c4d-zone-residential-sessid-abcd1234", "zone-secret-1"},
			},
			ProxyFormatOxylabs: {
				{"acme_scraper", "oxy-secret-2"},
				{"customer-acme_scraper-sessid-abcd1234-sesstime-1441", "oxy-secret-2"},
				{"customer-acme_scraper-sessid-abcd1234-sessid-abcd1235", "oxy-secret-2"},
			},
			ProxyFormatDecodo: {
				{"user-spacme-session-abcd1234-sessionduration-0", "decodo-secret-3"},
				{"spacme-session-abcd1234", "decodo-secret-3"},
			},
			ProxyFormatIPRoyal: {
				{"acme", "ipr-secret-4_session-abc"},
				{"acme", "ipr-secret-4_session-abcd1234"},
				{"acme", "ipr-secret-4_session-abcd1234_lifetime-8d"},
				{"acme", "ipr-secret-4_session-abcd1234_lifetime-30x"},
				{"acme-country-us", "ipr-secret-4"},
			},
			ProxyFormatSOAX: {
				{"package-123456-sessionid-abcd1234", "soax-secret-5"},
				{"package-654321", "soax-secret-5"},
			},
			ProxyFormatGeneric: {
				{"acme-city-paris", "generic-secret-6"},
				{"acmex", "generic-secret-6"},
			},
		}
		for _, f := range fpTestFormats {
			p := fpNewProxy(t, f, nil)
			for _, up := range bad[f.format] {
				status, _, _, err := fpGet(fpClient(t, p, up[0], up[1]), echo.URL+"/")
				require.NoError(t, err)
				assert.Equal(t, http.StatusProxyAuthRequired, status, "%s %q", f.format, up[0])
			}
		}
		assert.Zero(t, echo.hits.Load(), "a refused request never reaches the destination")
	})

	t.Run("UnavailableCountryGets502", func(t *testing.T) {
		echo := newFPEcho(t)
		for _, headers := range []bool{false, true} {
			p := fpNewProxy(t, fpTestFormats[0], func(c *FakeProxyConfig) {
				c.UnavailableCountries = []string{"CU", "KP"}
				c.ErrorHeaders = headers
			})
			user, pass := fpTestFormats[0].cred("kp", "abcd1234")
			status, hdr, body, err := fpGet(fpClient(t, p, user, pass), echo.URL+"/")
			require.NoError(t, err)
			assert.Equal(t, http.StatusBadGateway, status)
			assert.NotContains(t, body, pass)
			if headers {
				assert.Contains(t, hdr.Get("Proxy-Status"), "brd; error=destination_unreachable")
				assert.Equal(t, FakeProxyErrCountry, hdr.Get("X-Brd-Err-Code"))
			} else {
				assert.Empty(t, hdr.Get("Proxy-Status"))
				assert.Empty(t, hdr.Get("X-Brd-Err-Code"))
			}
			user, pass = fpTestFormats[0].cred("de", "abcd1234")
			status, _, _, err = fpGet(fpClient(t, p, user, pass), echo.URL+"/")
			require.NoError(t, err)
			assert.Equal(t, http.StatusOK, status)
		}
		assert.Equal(t, int64(2), echo.hits.Load())
	})

	t.Run("NonLoopbackDestinationRefused", func(t *testing.T) {
		p := fpNewProxy(t, generic, nil)
		c := fpClient(t, p, "acme", generic.pass)
		for _, target := range []string{"http://192.0.2.1/", "http://example.invalid/", "http://[::1]:1/"} {
			status, _, _, err := fpGet(c, target)
			require.NoError(t, err)
			assert.Equal(t, http.StatusBadGateway, status, target)
		}
	})

	t.Run("StickySessionsAndRotation", func(t *testing.T) {
		echo := newFPEcho(t)
		p := fpNewProxy(t, generic, nil)
		sticky := fpClient(t, p, "acme-session-abcd1234", generic.pass)
		var first string
		for i := 0; i < 20; i++ {
			status, _, body, err := fpGet(sticky, echo.URL+"/")
			require.NoError(t, err)
			require.Equal(t, http.StatusOK, status)
			if i == 0 {
				first = fpEchoField(body, "remote")
			}
			require.Equal(t, first, fpEchoField(body, "remote"), "request %d", i)
		}
		assert.Equal(t, first, p.ExitOf("abcd1234"))

		perSession := map[string]bool{}
		for i := 0; i < 20; i++ {
			c := fpClient(t, p, fmt.Sprintf("acme-session-sess%04d", i), generic.pass)
			_, _, body, err := fpGet(c, echo.URL+"/")
			require.NoError(t, err)
			perSession[fpEchoField(body, "remote")] = true
		}
		assert.GreaterOrEqual(t, len(perSession), 15, "different session ids mostly get different exits")

		rotating := fpClient(t, p, "acme", generic.pass)
		seen, prev := map[string]bool{}, ""
		for i := 0; i < 20; i++ {
			_, _, body, err := fpGet(rotating, echo.URL+"/")
			require.NoError(t, err)
			exit := fpEchoField(body, "remote")
			require.NotEqual(t, prev, exit, "rotation gives every request a fresh exit")
			seen[exit], prev = true, exit
		}
		assert.GreaterOrEqual(t, len(seen), 15)
		assert.Equal(t, "", p.ExitOf(""))
	})

	t.Run("PostBodyAndConcurrentSessions", func(t *testing.T) {
		echo := newFPEcho(t)
		p := fpNewProxy(t, generic, nil)
		resp, err := fpClient(t, p, "acme-session-post0001", generic.pass).Post(echo.URL+"/post", "text/plain", strings.NewReader("order=42"))
		require.NoError(t, err)
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		assert.Equal(t, "POST", fpEchoField(string(b), "method"))
		assert.Equal(t, "order=42", fpEchoField(string(b), "body"))
		assert.Equal(t, p.ExitOf("post0001"), fpEchoField(string(b), "remote"))

		var wg sync.WaitGroup
		for g := 0; g < 8; g++ {
			sess := fmt.Sprintf("conc%04d", g)
			c := fpClient(t, p, "acme-session-"+sess, generic.pass)
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; i < 10; i++ {
					_, _, body, err := fpGet(c, echo.URL+"/")
					if !assert.NoError(t, err) {
						return
					}
					assert.Equal(t, p.ExitOf(sess), fpEchoField(body, "remote"))
					_ = p.BytesFor(sess) + p.Bytes() + p.Disconnects()
				}
			}()
		}
		wg.Wait()
		assert.Equal(t, int64(81), p.Requests())
	})

	t.Run("ConnectTunnelToTLS", func(t *testing.T) {
		var remote atomic.Value
		srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			host, _, _ := net.SplitHostPort(r.RemoteAddr)
			remote.Store(host)
			_, _ = io.WriteString(w, strings.Repeat("tls", 1000))
		}))
		defer srv.Close()
		p := fpNewProxy(t, fpTestFormats[1], func(c *FakeProxyConfig) {
			c.UnavailableCountries = []string{"KP"}
			c.ErrorHeaders = true
		})
		tlsCfg := srv.Client().Transport.(*http.Transport).TLSClientConfig.Clone()
		var connectStatus atomic.Int64
		var connectHeader atomic.Value
		client := func(username, password string) *http.Client {
			proxyURL, err := url.Parse(p.URL())
			require.NoError(t, err)
			tr := &http.Transport{
				Proxy:           http.ProxyURL(proxyURL),
				TLSClientConfig: tlsCfg,
				ProxyConnectHeader: http.Header{"Proxy-Authorization": {
					"Basic " + fpBasic(username, password)}},
				OnProxyConnectResponse: func(_ context.Context, _ *url.URL, _ *http.Request, resp *http.Response) error {
					connectStatus.Store(int64(resp.StatusCode))
					connectHeader.Store(resp.Header.Clone())
					return nil
				},
			}
			t.Cleanup(tr.CloseIdleConnections)
			return &http.Client{Transport: tr, Timeout: 10 * time.Second}
		}

		user, pass := fpTestFormats[1].cred("us", "tlssess1")
		c := client(user, pass)
		for i := 0; i < 3; i++ {
			status, _, body, err := fpGet(c, srv.URL+"/")
			require.NoError(t, err)
			require.Equal(t, http.StatusOK, status)
			require.Len(t, body, 3000)
			assert.Equal(t, p.ExitOf("tlssess1"), remote.Load(), "the TLS server sees the exit")
		}
		assert.EqualValues(t, 200, connectStatus.Load())
		assert.Greater(t, p.BytesFor("tlssess1"), int64(3000))

		_, _, _, err := fpGet(client(user, "wrong"), srv.URL+"/")
		require.Error(t, err)
		assert.EqualValues(t, http.StatusProxyAuthRequired, connectStatus.Load())

		user, pass = fpTestFormats[1].cred("kp", "tlssess2")
		_, _, _, err = fpGet(client(user, pass), srv.URL+"/")
		require.Error(t, err)
		assert.EqualValues(t, http.StatusBadGateway, connectStatus.Load())
		assert.Equal(t, FakeProxyErrCountry, connectHeader.Load().(http.Header).Get("X-Brd-Err-Code"))
	})

	t.Run("DisconnectKillsConnectionAndSession", func(t *testing.T) {
		echo := newFPEcho(t)
		p := fpNewProxy(t, generic, func(c *FakeProxyConfig) {
			c.DisconnectProb = 1
			c.ErrorHeaders = true
		})
		for i, path := range []string{"/", "/empty", "/chunked"} {
			sess := fmt.Sprintf("drop%04d", i)
			c := fpClient(t, p, "acme-session-"+sess, generic.pass)
			hitsBefore := echo.hits.Load()
			_, _, _, err := fpGet(c, echo.URL+path)
			require.Error(t, err, path)
			assert.True(t, errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) ||
				strings.Contains(err.Error(), "EOF") || strings.Contains(err.Error(), "reset"), "%s: %v", path, err)
			assert.Equal(t, hitsBefore+1, echo.hits.Load(), "the destination got the request")
			assert.Equal(t, "", p.ExitOf(sess), "the device is gone")

			status, hdr, _, err := fpGet(c, echo.URL+path)
			require.NoError(t, err)
			assert.Equal(t, http.StatusBadGateway, status)
			assert.Equal(t, FakeProxyErrSessionGone, hdr.Get("X-Brd-Err-Code"))
			assert.Equal(t, hitsBefore+1, echo.hits.Load())
		}
		assert.Equal(t, int64(3), p.Disconnects())

		p.SetDisconnectProb(0)
		status, _, _, err := fpGet(fpClient(t, p, "acme-session-fresh001", generic.pass), echo.URL+"/")
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, status, "a new session id gets a new exit")
		status, _, _, err = fpGet(fpClient(t, p, "acme-session-drop0000", generic.pass), echo.URL+"/")
		require.NoError(t, err)
		assert.Equal(t, http.StatusBadGateway, status, "a dead session stays dead")

		p.SetDisconnectProb(1)
		status, _, _, err = fpGet(fpClient(t, p, "acme", generic.pass), echo.URL+"/")
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, status, "rotating requests have no device to lose")

		// A refused account (password rotated, balance spent): 407 whatever the credentials.
		p.SetDisconnectProb(0)
		p.SetRefusing(true)
		status, _, _, err = fpGet(fpClient(t, p, "acme-session-fresh002", generic.pass), echo.URL+"/")
		require.NoError(t, err)
		assert.Equal(t, http.StatusProxyAuthRequired, status)
		assert.Equal(t, int64(1), p.Refused())
		p.SetRefusing(false)
		status, _, _, err = fpGet(fpClient(t, p, "acme-session-fresh002", generic.pass), echo.URL+"/")
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, status, "taken again")
		assert.Equal(t, int64(1), p.Refused())
	})

	t.Run("DropNextCutsOneRequestByPath", func(t *testing.T) {
		echo := newFPEcho(t)
		p := fpNewProxy(t, generic, nil)
		p.DropNext("/chunked")
		c := fpClient(t, p, "acme-session-dropnext1", generic.pass)
		status, _, _, err := fpGet(c, echo.URL+"/")
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, status, "another path is not cut")
		_, _, _, err = fpGet(c, echo.URL+"/chunked")
		require.Error(t, err, "the matching request loses its device")
		assert.Equal(t, "", p.ExitOf("dropnext1"))
		assert.Equal(t, int64(1), p.Disconnects())
		status, _, _, err = fpGet(fpClient(t, p, "acme-session-dropnext2", generic.pass), echo.URL+"/chunked")
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, status, "one call drops one request")
	})

	t.Run("CutKeepsOrMovesTheExit", func(t *testing.T) {
		echo := newFPEcho(t)
		p := fpNewProxy(t, generic, nil)
		c := fpClient(t, p, "acme-session-keepexit", generic.pass)
		_, _, _, err := fpGet(c, echo.URL+"/")
		require.NoError(t, err)
		exit := p.ExitOf("keepexit")
		require.NotEmpty(t, exit)
		p.DropNextKeepExit("/chunked")
		_, _, _, err = fpGet(c, echo.URL+"/chunked")
		require.Error(t, err, "the connection is cut")
		assert.Equal(t, exit, p.ExitOf("keepexit"), "the session keeps its exit")
		status, _, _, err := fpGet(c, echo.URL+"/")
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, status, "and serves on")
		assert.Equal(t, int64(1), p.CutsExitAlive())

		p.DropNextNewExit("/chunked")
		_, _, _, err = fpGet(c, echo.URL+"/chunked")
		require.Error(t, err)
		status, _, _, err = fpGet(c, echo.URL+"/")
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, status, "the session id lives on")
		moved := p.ExitOf("keepexit")
		assert.NotEqual(t, exit, moved, "on another exit")
		assert.NotEmpty(t, moved)
		assert.Equal(t, int64(2), p.Disconnects())
	})

	t.Run("CutExitAliveDraws", func(t *testing.T) {
		echo := newFPEcho(t)
		p := fpNewProxy(t, generic, func(c *FakeProxyConfig) { c.DisconnectProb, c.CutExitAlive = 1, 1 })
		c := fpClient(t, p, "acme-session-alive001", generic.pass)
		for range 3 {
			_, _, _, err := fpGet(c, echo.URL+"/")
			require.Error(t, err, "every request cut")
		}
		assert.NotEmpty(t, p.ExitOf("alive001"), "the exit survives every cut")
		assert.Equal(t, int64(3), p.CutsExitAlive())
		p.SetCutExitAlive(0)
		_, _, _, err := fpGet(c, echo.URL+"/")
		require.Error(t, err)
		assert.Empty(t, p.ExitOf("alive001"), "now the cut loses it")
	})

	t.Run("DisconnectClosesConnectTunnel", func(t *testing.T) {
		srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.WriteString(w, "hello")
		}))
		srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the broken handshake is the point
		srv.StartTLS()
		defer srv.Close()
		p := fpNewProxy(t, generic, func(c *FakeProxyConfig) { c.DisconnectProb = 1 })
		proxyURL, err := url.Parse(p.URL())
		require.NoError(t, err)
		proxyURL.User = url.UserPassword("acme-session-tunnel01", generic.pass)
		var connectStatus atomic.Int64
		tr := &http.Transport{
			Proxy:           http.ProxyURL(proxyURL),
			TLSClientConfig: srv.Client().Transport.(*http.Transport).TLSClientConfig.Clone(),
			OnProxyConnectResponse: func(_ context.Context, _ *url.URL, _ *http.Request, resp *http.Response) error {
				connectStatus.Store(int64(resp.StatusCode))
				return nil
			},
		}
		defer tr.CloseIdleConnections()
		c := &http.Client{Transport: tr, Timeout: 10 * time.Second}
		_, _, _, err = fpGet(c, srv.URL+"/")
		require.Error(t, err)
		assert.EqualValues(t, http.StatusOK, connectStatus.Load(), "the tunnel opened, then broke")
		_, _, _, err = fpGet(c, srv.URL+"/")
		require.Error(t, err)
		assert.EqualValues(t, http.StatusBadGateway, connectStatus.Load())
		assert.Equal(t, int64(1), p.Disconnects())
	})

	t.Run("DisconnectsReproducibleUnderSeed", func(t *testing.T) {
		echo := newFPEcho(t)
		run := func(seed int64) []int {
			p := fpNewProxy(t, generic, func(c *FakeProxyConfig) {
				c.Seed = seed
				c.DisconnectProb = 0.3
			})
			var firstDrop []int
			for s := 0; s < 12; s++ {
				c := fpClient(t, p, fmt.Sprintf("acme-session-rep%05d", s), generic.pass)
				drop := -1
				for i := 0; i < 8 && drop < 0; i++ {
					if _, _, _, err := fpGet(c, echo.URL+"/"); err != nil {
						drop = i
					}
				}
				firstDrop = append(firstDrop, drop)
			}
			assert.Positive(t, p.Disconnects())
			return firstDrop
		}
		a, b := run(7), run(7)
		assert.Equal(t, a, b)
		assert.NotEqual(t, a, run(8), "another seed drops elsewhere")
	})

	t.Run("LifetimeExpiryChangesExit", func(t *testing.T) {
		echo := newFPEcho(t)
		cases := []struct {
			name     string
			f        fpTestFormat
			sess     string
			username string
			override time.Duration
			lifetime time.Duration
		}{
			{"UsernameLifetime", fpTestFormats[1], "life0001", "customer-acme_scraper-sessid-life0001-sesstime-1", 0, time.Minute},
			{"ConfigOverridesUsername", fpTestFormats[1], "life0002", "customer-acme_scraper-sessid-life0002-sesstime-1", 5 * time.Minute, 5 * time.Minute},
			{"DefaultLifetime", fpTestFormats[0], "life0003", "brd-customer-hl_1a2b3c4d-zone-residential-session-life0003", 0, DefaultFakeSessionLifetime},
			{"SOAXSeconds", fpTestFormats[4], "life0004", "package-123456-sessionid-life0004-sessionlength-90", 0, 90 * time.Second},
		}
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				clock := &fpTestClock{now: time.Date(2026, 4, 23, 15, 0, 0, 0, time.UTC)}
				p := fpNewProxy(t, tc.f, func(c *FakeProxyConfig) {
					c.Now = clock.Now
					c.SessionLifetime = tc.override
				})
				c := fpClient(t, p, tc.username, tc.f.pass)
				exitNow := func() string {
					status, _, body, err := fpGet(c, echo.URL+"/")
					require.NoError(t, err)
					require.Equal(t, http.StatusOK, status)
					return fpEchoField(body, "remote")
				}
				first := exitNow()
				clock.Advance(tc.lifetime - time.Second)
				assert.Equal(t, first, exitNow(), "still within the lifetime")
				clock.Advance(time.Second)
				second := exitNow()
				assert.NotEqual(t, first, second, "the exit changes silently")
				assert.Equal(t, second, p.ExitOf(tc.sess))
				clock.Advance(tc.lifetime / 2)
				assert.Equal(t, second, exitNow(), "the new lifetime starts at the re-assignment")
			})
		}
	})

	t.Run("ByteCounters", func(t *testing.T) {
		echo := newFPEcho(t)
		p := fpNewProxy(t, generic, nil)
		c := fpClient(t, p, "acme-session-bytes001", generic.pass)
		var last int64
		for i := 0; i < 3; i++ {
			_, _, body, err := fpGet(c, echo.URL+"/")
			require.NoError(t, err)
			require.Greater(t, p.BytesFor("bytes001"), last+int64(len(body)))
			last = p.BytesFor("bytes001")
		}
		_, _, _, err := fpGet(fpClient(t, p, "acme", generic.pass), echo.URL+"/")
		require.NoError(t, err)
		assert.Positive(t, p.BytesFor(""))
		assert.Equal(t, p.Bytes(), p.BytesFor("bytes001")+p.BytesFor(""))
		assert.Zero(t, p.BytesFor("unknown1"))
		assert.Equal(t, int64(4), p.Requests())
	})

	t.Run("SameSeedSameExits", func(t *testing.T) {
		echo := newFPEcho(t)
		run := func(seed int64) []string {
			p := fpNewProxy(t, generic, func(c *FakeProxyConfig) { c.Seed = seed })
			var exits []string
			for _, u := range []string{"acme-session-seed0001", "acme-session-seed0002", "acme", "acme", "acme-session-seed0003", "acme"} {
				_, _, body, err := fpGet(fpClient(t, p, u, generic.pass), echo.URL+"/")
				require.NoError(t, err)
				exits = append(exits, fpEchoField(body, "remote"))
			}
			return exits
		}
		a := run(99)
		assert.Equal(t, a, run(99))
		assert.NotEqual(t, a, run(100))
	})

	t.Run("InvalidConfigFails", func(t *testing.T) {
		for _, cfg := range []FakeProxyConfig{
			{Format: "luminati", User: "u", Password: "p"},
			{Format: ProxyFormatBrightData, User: "hl_1a2b3c4d", Password: "p"},
			{Format: ProxyFormatGeneric, User: "u"},
			{Format: ProxyFormatGeneric, User: "u", Password: "p", DisconnectProb: 1.5},
		} {
			assert.Error(t, cfg.validate(), "%+v", cfg.Format)
		}
	})
}

// TestFakeProxyCloseEndsGoroutines proves that Close ends every goroutine, including those
// of open tunnels, keep-alive connections and a request stuck on a slow destination.
func TestFakeProxyCloseEndsGoroutines(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())

	release := make(chan struct{})
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer slow.Close()
	defer close(release)
	tlsSrv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "ok")
	}))
	defer tlsSrv.Close()
	p := NewFakeProxy(t, FakeProxyConfig{Format: ProxyFormatGeneric, User: "acme", Password: "pw"})
	proxyURL, err := url.Parse(p.URL())
	require.NoError(t, err)
	proxyURL.User = url.UserPassword("acme-session-leak0001", "pw")
	tr := &http.Transport{
		Proxy:           http.ProxyURL(proxyURL),
		TLSClientConfig: &tls.Config{RootCAs: tlsSrv.Client().Transport.(*http.Transport).TLSClientConfig.RootCAs},
	}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr}
	status, _, _, err := fpGet(c, tlsSrv.URL+"/") // leaves an idle tunnel open
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, status)

	stuck := make(chan error, 1)
	go func() {
		_, _, _, err := fpGet(c, slow.URL+"/")
		stuck <- err
	}()
	require.Eventually(t, func() bool { return p.Requests() == 2 }, 30*time.Second, 5*time.Millisecond, "hang guard")
	p.Close()
	require.Error(t, <-stuck, "Close cuts the request in flight")
	p.Close() // idempotent
}

func fpBasic(user, pass string) string {
	r, _ := http.NewRequest(http.MethodGet, "http://x/", nil)
	r.SetBasicAuth(user, pass)
	return strings.TrimPrefix(r.Header.Get("Authorization"), "Basic ")
}
