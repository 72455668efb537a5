package sessions

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"
)

// renderProxy is one render's own HTTP proxy on 127.0.0.1: the render's browser context
// uses it as its proxy, and it sends every request and every CONNECT on to the session's
// gateway with the session's Proxy-Authorization, whatever the gateway does. Chromium
// itself would send credentials only when the gateway challenges with 407; a gateway that
// accepts unauthenticated requests (an account that allow-lists the worker's IP) would
// serve the render from another exit than the unit's, on no session at all.
//
// It serves only the render's Chromium: a request must carry the render's random token
// (Basic credentials Chromium gets through Fetch.authRequired after the forwarder's own
// 407), and it listens for as long as the render runs. The session's credentials never
// reach Chromium. Every destination passes the guard again here (what CDP's Fetch domain
// does not see — a WebRTC TCP candidate, a request it missed — is refused all the same).
// It logs nothing.
//
// Its connections to the gateway are where a render's bytes are counted: every byte
// either way (the CONNECT exchanges, TLS inside the tunnels, request and response headers
// as Chromium sent them plus the session's Proxy-Authorization, bodies as sent) goes to
// its owner, the render's, which is the job's (Bound.Bytes) and under the run's byte cap
// as it arrives (a read past the cap asks RunConfig.MoreBytes, as a fetch's does); an exchange the gateway refused goes to the refusals instead
// (Bound.RefusedBytes). Chromium's own figures (encodedDataLength) miss the proxy
// headers, the CONNECTs and the TLS overhead.
type renderProxy struct {
	ln       net.Listener
	gateway  string // the session's gateway host:port
	upAuth   string // the session's Proxy-Authorization value
	tokUser  string // the credentials Chromium must present
	tokPass  string
	tokAuth  string // their Basic header value
	dial     func(ctx context.Context, network, addr string) (net.Conn, error)
	check    func(ctx context.Context, rawURL string) error
	refused  func() // a destination the guard refused
	authFail func() // the gateway refused the session's credentials

	ctx      context.Context // ends with the render
	cancel   context.CancelFunc
	owner    *wireOwner // the render's: bytes exchanged with the gateway, both ways
	refusals *wireOwner // the bytes of the gateway's refusals
	wg       sync.WaitGroup

	mu      sync.Mutex
	conns   map[net.Conn]struct{}
	closed  bool
	allowed map[string]bool // scheme://host:port the guard let through in this render
}

// renderProxyRealm is the realm of the forwarder's own challenge.
const renderProxyRealm = "idemscrape-render"

// forwarderHopHeaders concern one connection only: not sent on to the gateway (the
// Proxy-Authorization Chromium sent is the render's token, never the session's).
var forwarderHopHeaders = []string{"Proxy-Authorization", "Proxy-Connection", "Connection", "Keep-Alive", "Te", "Trailer", "Upgrade"}

// newRenderProxy starts a forwarder for session s; close ends it. check is the
// destination guard, refused and authFail report to the render. owner is charged with the
// bytes exchanged with the gateway and refusals with those of its refusals (nil: counters
// of the forwarder's own).
func newRenderProxy(ctx context.Context, s *Session, dialTimeout time.Duration, check func(context.Context, string) error, refused, authFail func(), owner, refusals *wireOwner) (*renderProxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	tok := make([]byte, 16)
	_, _ = rand.Read(tok)
	d := &net.Dialer{Timeout: dialTimeout, KeepAlive: 30 * time.Second}
	p := &renderProxy{
		ln: ln, gateway: s.Endpoint, upAuth: s.proxyAuthorization(),
		tokUser: "render", tokPass: hex.EncodeToString(tok),
		dial: d.DialContext, check: check, refused: refused, authFail: authFail,
		conns: map[net.Conn]struct{}{}, allowed: map[string]bool{},
		owner: owner, refusals: refusals,
	}
	if p.owner == nil {
		p.owner = (*wireOwner)(nil).child()
	}
	if p.refusals == nil {
		p.refusals = (*wireOwner)(nil).child()
	}
	p.tokAuth = basicAuth(p.tokUser, p.tokPass)
	p.ctx, p.cancel = context.WithCancel(ctx)
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// addr is the forwarder's 127.0.0.1:port.
func (p *renderProxy) addr() string { return p.ln.Addr().String() }

// token is what Chromium answers the forwarder's challenge with.
func (p *renderProxy) token() (user, pass string) { return p.tokUser, p.tokPass }

// close stops listening, cuts every connection and waits for its goroutines.
func (p *renderProxy) close() {
	p.mu.Lock()
	p.closed = true
	for c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
	p.cancel()
	_ = p.ln.Close()
	p.wg.Wait()
}

// track registers c for close; false (c closed) once the forwarder is closing.
func (p *renderProxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		_ = c.Close()
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *renderProxy) untrack(c net.Conn) {
	_ = c.Close()
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
}

func (p *renderProxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return // closed
		}
		if !p.track(c) {
			continue
		}
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			defer p.untrack(c)
			p.serve(c)
		}()
	}
}

// upstream is a connection to the gateway.
type upstream struct {
	raw  net.Conn      // as dialled (tracked for close)
	conn *wireConn     // raw, counting its bytes into the exchange that uses it
	r    *bufio.Reader // reads conn
}

// exchange gives up's bytes from now on to a new exchange of the render.
func (p *renderProxy) exchange(up *upstream) *wireOwner {
	ex := p.owner.child()
	up.conn.owner.Store(ex)
	return ex
}

// serve answers the requests of one Chromium connection, one at a time (Chromium does
// not pipeline). Its requests go over one gateway connection, opened on the first and
// closed with it, so that a gateway that drops the connection drops Chromium's: Chromium
// sees the failure (a lost session) as it would without the forwarder.
func (p *renderProxy) serve(c net.Conn) {
	br := bufio.NewReader(c)
	var up *upstream
	defer func() {
		if up != nil {
			p.untrack(up.raw)
		}
	}()
	for {
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		if subtle.ConstantTimeCompare([]byte(req.Header.Get("Proxy-Authorization")), []byte(p.tokAuth)) != 1 {
			// Chromium's first request, before it has the token; or not this render's.
			h := http.Header{"Proxy-Authenticate": {`Basic realm="` + renderProxyRealm + `"`}}
			writeForwarderError(c, http.StatusProxyAuthRequired, h, "proxy authentication required")
			return
		}
		for _, k := range forwarderHopHeaders {
			req.Header.Del(k)
		}
		if req.Method == http.MethodConnect {
			p.connect(c, br, req)
			return // a tunnel ends its connection
		}
		if req.URL.Scheme != "http" || req.URL.Host == "" {
			writeForwarderError(c, http.StatusBadRequest, nil, "absolute http:// request URI required")
			return
		}
		if !p.guard(p.ctx, req.URL.String()) {
			writeForwarderError(c, http.StatusForbidden, nil, "destination refused")
			return
		}
		if up == nil {
			if up = p.dialGateway(); up == nil {
				writeForwarderError(c, http.StatusBadGateway, nil, "could not connect to the proxy gateway")
				return
			}
		}
		req.Header.Set("Proxy-Authorization", p.upAuth)
		ex := p.exchange(up)
		if err := req.WriteProxy(up.conn); err != nil {
			return // Chromium sees the connection close, as if the gateway had closed it
		}
		resp, err := p.readFinal(up.r, req, c)
		if err != nil {
			return // no (whole) answer: the connection closes, nothing more written
		}
		refusal := isProxyRefusal(resp)
		keep := p.relay(c, req, resp)
		_ = resp.Body.Close()
		if refusal {
			ex.refuse(p.refusals) // the gateway's answer, not the destination's: not billed
		}
		if !keep {
			return
		}
	}
}

// forwarderMax1xx bounds the informational responses the forwarder relays before a
// final one: more ends the connection (their bytes are counted all the same).
const forwarderMax1xx = 16

// informational reports whether code is an informational response that a final one
// follows: 1xx but 101 Switching Protocols (the forwarder sends no Upgrade, so a 101
// is answered as final and ends the connection).
func informational(code int) bool {
	return code >= 100 && code < 200 && code != http.StatusSwitchingProtocols
}

// readFinal reads the gateway's answer to req: the informational responses before it
// (100 Continue, 103 Early Hints) are relayed to Chromium as they come when c is set
// (Chromium reads Early Hints' Link headers; it takes a 1xx for what it is and waits on)
// and skipped when c is nil; the final response is returned, unwritten. The bytes of
// every one of them are counted as read (up's wireConn). An error: the connection is to
// be closed.
func (p *renderProxy) readFinal(r *bufio.Reader, req *http.Request, c net.Conn) (*http.Response, error) {
	for n := 0; ; n++ {
		resp, err := http.ReadResponse(r, req)
		if err != nil || !informational(resp.StatusCode) {
			return resp, err
		}
		if n == forwarderMax1xx {
			return nil, errors.New("sessions: render proxy: too many informational responses")
		}
		if c == nil {
			continue
		}
		for _, k := range []string{"Proxy-Connection", "Keep-Alive", "Connection"} {
			resp.Header.Del(k)
		}
		if err := resp.Write(c); err != nil {
			return nil, err
		}
	}
}

// relay writes the gateway's response to Chromium and reports whether both connections
// may carry another request.
func (p *renderProxy) relay(c net.Conn, req *http.Request, resp *http.Response) bool {
	if resp.StatusCode == http.StatusProxyAuthRequired {
		// The session's credentials were sent and refused: the render ends proxy_auth.
		// Chromium must not see a challenge (it would answer with the render's token).
		p.authFail()
		resp.Header.Del("Proxy-Authenticate")
		resp.Close = true
	}
	for _, k := range []string{"Proxy-Connection", "Keep-Alive"} {
		resp.Header.Del(k)
	}
	if req.Close {
		resp.Close = true
	}
	if err := resp.Write(c); err != nil {
		return false // cut mid-body: Chromium sees the short body
	}
	return !resp.Close
}

// connect opens a tunnel through the gateway, with the session's credentials.
func (p *renderProxy) connect(c net.Conn, br *bufio.Reader, req *http.Request) {
	target := req.Host
	if _, _, err := net.SplitHostPort(target); err != nil {
		writeForwarderError(c, http.StatusBadRequest, nil, "CONNECT needs host:port")
		return
	}
	if !p.guard(p.ctx, "https://"+target+"/") {
		writeForwarderError(c, http.StatusForbidden, nil, "destination refused")
		return
	}
	up := p.dialGateway()
	if up == nil {
		writeForwarderError(c, http.StatusBadGateway, nil, "could not connect to the proxy gateway")
		return
	}
	defer p.untrack(up.raw)
	ex := p.exchange(up)
	out := &http.Request{Method: http.MethodConnect, URL: req.URL, Host: target, Header: http.Header{"Proxy-Authorization": {p.upAuth}}}
	if ua := req.Header.Get("User-Agent"); ua != "" {
		out.Header.Set("User-Agent", ua)
	}
	if err := out.Write(up.conn); err != nil {
		return
	}
	resp, err := p.readFinal(up.r, out, nil) // a 1xx before the tunnel's answer is skipped
	if err != nil {
		return
	}
	if resp.StatusCode != http.StatusOK {
		resp.Close = true
		p.relay(c, out, resp)
		_ = resp.Body.Close()
		ex.refuse(p.refusals) // a refused CONNECT reached no exit: not billed
		return
	}
	if _, err := io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
		return
	}
	// The tunnel: bytes both ways until either side ends it. Buffered bytes first.
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = io.Copy(up.conn, br)
		_ = up.conn.Close()
		_ = c.Close()
	}()
	_, _ = io.Copy(c, up.r)
	_ = up.conn.Close()
	_ = c.Close()
	<-done
}

// dialGateway connects to the session's gateway; nil when it can not.
func (p *renderProxy) dialGateway() *upstream {
	raw, err := p.dial(p.ctx, "tcp", p.gateway)
	if err != nil {
		return nil
	}
	if !p.track(raw) {
		return nil
	}
	conn := &wireConn{Conn: raw}
	conn.owner.Store(p.owner)
	return &upstream{raw: raw, conn: conn, r: bufio.NewReader(conn)}
}

// guard applies the destination guard to rawURL (once per scheme, host and port per
// render: the page's requests repeat their hosts); a refusal is counted.
func (p *renderProxy) guard(ctx context.Context, rawURL string) bool {
	key := rawURL
	if i := strings.Index(rawURL, "://"); i >= 0 {
		if j := strings.IndexByte(rawURL[i+3:], '/'); j >= 0 {
			key = rawURL[:i+3+j]
		}
	}
	p.mu.Lock()
	ok := p.allowed[key]
	p.mu.Unlock()
	if ok {
		return true
	}
	if err := p.check(ctx, rawURL); err != nil {
		p.refused()
		return false
	}
	p.mu.Lock()
	p.allowed[key] = true
	p.mu.Unlock()
	return true
}

// writeForwarderError answers Chromium with the forwarder's own status; the connection
// closes after it.
func writeForwarderError(w io.Writer, code int, h http.Header, msg string) {
	if h == nil {
		h = http.Header{}
	}
	h.Set("Content-Type", "text/plain; charset=utf-8")
	body := "idemscrape render proxy: " + msg + "\n"
	resp := &http.Response{StatusCode: code, ProtoMajor: 1, ProtoMinor: 1, Header: h,
		Body: io.NopCloser(strings.NewReader(body)), ContentLength: int64(len(body)), Close: true}
	_ = resp.Write(w)
}
