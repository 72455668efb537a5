package sessions

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/textproto"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/testutil"
)

// informationalSite is a plain-HTTP destination that answers every request with
// informational responses before its final one: "100 Continue" and "103 Early Hints"
// (with a Link header), then "200 OK" with the body "hello <path>". It keeps connections
// alive.
func informationalSite(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var wg sync.WaitGroup
	var mu sync.Mutex
	conns := map[net.Conn]bool{}
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		for c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns[c] = true
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				br := bufio.NewReader(c)
				for {
					req, err := http.ReadRequest(br)
					if err != nil {
						return
					}
					body := "hello " + req.URL.Path
					_, err = fmt.Fprintf(c, "HTTP/1.1 100 Continue\r\n\r\n"+
						"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload; as=style\r\n\r\n"+
						"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
					if err != nil {
						return
					}
				}
			}()
		}
	}()
	return "http://" + ln.Addr().String()
}

// TestRenderForwarder1xx: a destination that sends "100 Continue" and "103 Early Hints"
// before its "200 OK" is relayed by the render forwarder as it came — the informational
// responses passed on as informational (Chromium reads Early Hints' Link headers), then
// the final answer, on a connection that carries the next request too — never the 103 as
// if it were the answer (Chromium would wait for ever for the 200 it left unread, until
// the render's timeout). Every byte moved through the proxy, the informational responses'
// included, is counted: the forwarder's count is the proxy's, exactly.
func TestRenderForwarder1xx(t *testing.T) {
	e := newForwarderEnv(t, testutil.FakeProxyConfig{Seed: 45}, LoopbackGuard())
	site := informationalSite(t)
	c := e.client(t, true, nil)

	for _, path := range []string{"/first", "/second"} {
		var (
			mu    sync.Mutex
			early []int
			links []string
		)
		trace := &httptrace.ClientTrace{Got1xxResponse: func(code int, h textproto.MIMEHeader) error {
			mu.Lock()
			defer mu.Unlock()
			early = append(early, code)
			links = append(links, h.Get("Link"))
			return nil
		}}
		req, err := http.NewRequestWithContext(httptrace.WithClientTrace(t.Context(), trace), http.MethodGet, site+path, nil)
		require.NoError(t, err)
		// The client's timeout only bounds a failure: a forwarder that passed the 103 on
		// as the answer leaves the 200 unread and the client waits for it.
		resp, err := c.Do(req)
		require.NoError(t, err, "%s: the final answer arrives", path)
		b := new(strings.Builder)
		_, err = bufio.NewReader(resp.Body).WriteTo(b)
		require.NoError(t, err)
		_ = resp.Body.Close()
		assert.Equal(t, http.StatusOK, resp.StatusCode, path)
		assert.Equal(t, "hello "+path, b.String())
		mu.Lock()
		assert.Equal(t, []int{http.StatusContinue, http.StatusEarlyHints}, early, "%s: the informational responses were passed on", path)
		assert.Equal(t, []string{"", "</style.css>; rel=preload; as=style"}, links, "%s: with their headers", path)
		mu.Unlock()
	}
	seen := e.proxy.Seen()
	require.Len(t, seen, 2)
	assert.Equal(t, 1, e.proxy.OpenClients(), "both requests went over one kept-alive gateway connection")

	// The counts are final once the gateway's connection is closed (the client's idle
	// connection closes, the forwarder closes the gateway's).
	c.Transport.(*http.Transport).CloseIdleConnections()
	require.Eventually(t, func() bool { return e.proxy.OpenClients() == 0 }, 10*time.Second, 5*time.Millisecond)
	from, to := e.proxy.ClientBytes()
	got := e.fwd.owner.n.Load()
	t.Logf("forwarder counted %d bytes; the proxy read %d from it and wrote %d to it", got, from, to)
	assert.Equal(t, from+to, got, "every byte moved through the proxy, the 1xx responses' included")
	// The 1xx responses are in: without them the answers alone would be fewer bytes.
	one := len("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload; as=style\r\n\r\n")
	assert.Greater(t, to, int64(2*one), "the proxy relayed the informational responses")
	assert.Zero(t, e.authFail.Load())
	assert.Zero(t, e.refused.Load())
}
