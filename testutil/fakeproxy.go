package testutil

import (
	"bufio"
	"crypto/subtle"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"math"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Credential formats understood by FakeProxy (FakeProxyConfig.Format). Each mirrors the
// documented format of one residential-proxy provider; ProxyFormatGeneric is this fake's own.
const (
	// ProxyFormatBrightData: username brd-customer-<ID>-zone-<ZONE>[-country-us][-session-<id>].
	// FakeProxyConfig.User is "brd-customer-<ID>-zone-<ZONE>". Bright Data has no lifetime
	// option, so sessions last FakeProxyConfig.SessionLifetime or DefaultFakeSessionLifetime.
	ProxyFormatBrightData = "brightdata"
	// ProxyFormatOxylabs: username customer-<USER>[-cc-US][-sessid-<id>][-sesstime-<min>],
	// sesstime 1–1440 minutes. FakeProxyConfig.User is <USER>.
	ProxyFormatOxylabs = "oxylabs"
	// ProxyFormatDecodo: username user-<USER>[-country-us][-session-<id>][-sessionduration-<min>],
	// sessionduration 1–1440 minutes. FakeProxyConfig.User is <USER>.
	ProxyFormatDecodo = "decodo"
	// ProxyFormatIPRoyal: plain username <USER>, password
	// <PASS>[_country-us][_session-<8 alnum>_lifetime-<n><s|m|h|d>], lifetime 1 s – 7 d; a
	// session needs a lifetime, as IPRoyal requires. FakeProxyConfig.User and .Password are
	// the plain parts.
	ProxyFormatIPRoyal = "iproyal"
	// ProxyFormatSOAX: username package-<ID>[-country-us][-sessionid-<id>-sessionlength-<seconds>];
	// a session id needs a length and a length needs a session id. FakeProxyConfig.User is <ID>.
	ProxyFormatSOAX = "soax"
	// ProxyFormatGeneric (this fake's own): username <USER>[-country-<cc>][-session-<id>],
	// options in any order. FakeProxyConfig.User is <USER>.
	ProxyFormatGeneric = "generic"
)

// DefaultFakeSessionLifetime is how long a sticky session keeps its exit when neither
// FakeProxyConfig.SessionLifetime nor the username sets a lifetime.
const DefaultFakeSessionLifetime = 10 * time.Minute

// Values FakeProxy puts in the Bright-Data-style error headers of its 502 answers when
// FakeProxyConfig.ErrorHeaders is set: Proxy-Status is always
// `brd; error=destination_unreachable; details="<code>: <message>"` and x-brd-err-code is
// one of these codes (invented for the fake; real provider codes differ).
const (
	// FakeProxyErrCountry: no peer in the requested country (FakeProxyConfig.UnavailableCountries).
	FakeProxyErrCountry = "fake_no_peer_in_country"
	// FakeProxyErrSessionGone: the session's device disconnected earlier; the session id is dead.
	FakeProxyErrSessionGone = "fake_session_gone"
	// FakeProxyErrDestination: the destination could not be dialled or is not loopback.
	FakeProxyErrDestination = "fake_destination_unreachable"
)

// FakeProxyConfig configures a FakeProxy.
type FakeProxyConfig struct {
	// Seed makes every exit choice and every disconnect decision reproducible. Defaults to 0.
	Seed int64
	// Format is the credential format, one of the ProxyFormat* constants. Required.
	Format string
	// User is the account part of the username (see the ProxyFormat* constants for what it
	// holds per format). Required.
	User string
	// Password is the account password (for IPRoyal the part before the first option).
	// Required. FakeProxy never prints it.
	Password string
	// UnavailableCountries are upper-case ISO 3166 codes for which the proxy has no peer:
	// requests asking for them get 502 Bad Gateway. Defaults to none.
	UnavailableCountries []string
	// DisconnectProb is the probability, per request through a sticky session, that the
	// device drops mid-response and the session dies. 0 ≤ p ≤ 1. Defaults to 0.
	DisconnectProb float64
	// CutExitAlive is the fraction of disconnects (DisconnectProb draws) that drop only the
	// client's connection: the device stays, and the session id keeps its exit, as a
	// residential exit often does when a connection is dropped on the way. The draw is
	// hash(seed, id, k) like the disconnect's, so a run is reproducible. 0 ≤ f ≤ 1.
	// Defaults to 0: every disconnect loses the exit (the session id is dead).
	CutExitAlive float64
	// CutDrawsByURL keys the disconnect draws (and CutExitAlive's) of forwarded plain-HTTP
	// requests by the request's path and query and how many times the proxy has forwarded
	// them (hash(seed, path?query, k)) instead of by session id: two runs of the same jobs then see the
	// same cuts where they send the same requests, so that their bytes compare without the
	// noise of two random samples (ResetCutDraws starts the counts again). CONNECT requests
	// keep the session's draws. Defaults to false.
	CutDrawsByURL bool
	// SessionLifetime, when positive, overrides every lifetime: after it has passed since a
	// session's first request (on its current exit), the session silently gets a new exit.
	// Defaults to the lifetime in the username, or DefaultFakeSessionLifetime.
	SessionLifetime time.Duration
	// ErrorHeaders adds Bright-Data-style Proxy-Status, x-brd-err-code and x-brd-err-msg
	// headers to every 502 answer. Defaults to false (a bare 502).
	ErrorHeaders bool
	// Now is the clock session lifetimes are measured with, so tests can step time instead
	// of sleeping. Defaults to time.Now.
	Now func() time.Time
	// Tier is the kind of exit this gateway sells (datacenter, residential, mobile): it is
	// sent to the destination in X-Fake-Tier on forwarded plain-HTTP requests, so that a
	// FakeSite can block a tier (FakeSite.SetBlockedTier). Defaults to "" (no header).
	Tier string
	// NoChallenge makes the gateway accept requests that carry no Proxy-Authorization at
	// all, as a provider does for an account that allow-lists the client's IP: such a
	// request is served as a rotating one (no session, an exit of its own) instead of
	// being answered 407. Wrong credentials still get 407. Defaults to false.
	NoChallenge bool
}

// FakeProxyRequest is what the proxy saw of one request it read (FakeProxy.Seen).
type FakeProxyRequest struct {
	Method string // CONNECT, GET, …
	Target string // the destination host:port
	Path   string // the URL path of a forwarded request; "" for CONNECT
	// Credentials: "none" (no Proxy-Authorization), "invalid" (refused) or "valid".
	Credentials string
	Session     string // the session id of valid credentials; "" when rotating or none
}

// FakeProxy is a residential-proxy gateway on a free 127.0.0.1 port: HTTP forward proxying
// (absolute-form request URI) and CONNECT tunnelling, with Basic proxy authentication in
// one of the provider credential formats (ProxyFormat*). What it does, request by request
// (a CONNECT tunnel is one request, however many HTTPS requests go through it):
//
//   - Bad credentials or an unparseable username: 407 with Proxy-Authenticate: Basic
//     realm="fake". A country in UnavailableCountries: 502. A destination that is not a
//     loopback IPv4 address or "localhost": 502, so no test traffic can leave the machine.
//   - Exits are source addresses 127.0.0.N (N in 2…250) bound to the outgoing connection,
//     so the destination sees the exit as RemoteAddr; forwarded plain-HTTP requests also
//     carry X-Fake-Exit. Proxy-Authorization is never forwarded.
//   - Sticky: a session id (alone, whatever the country) keeps its exit, derived from the
//     seed, the id and the session's generation. When the lifetime has passed since the
//     generation's first request, the next request silently starts a new generation with a
//     different exit. An open CONNECT tunnel keeps its exit.
//   - Rotating: without a session id every request gets an exit derived from the seed and
//     a proxy-wide counter, never the same as the previous rotating request's.
//   - Disconnects: the k-th request of a session id drops the device when
//     hash(seed, id, k) < DisconnectProb, independently of other sessions and goroutines.
//     The request still reaches the destination; the client gets the status line and half
//     the body (just the status line for an empty body, a 512-byte chunk for a chunked
//     one), or, for CONNECT, 8…64 bytes of the tunnel, and then the connection closes. The
//     session id is dead from then on: 502 for every later request (ErrorHeaders add
//     x-brd-err-code FakeProxyErrSessionGone). Rotating requests never disconnect.
//     With CutExitAlive (or DropNextKeepExit) a disconnect drops the connection only: the
//     session id lives on, on the same exit. DropNextNewExit drops the connection and
//     re-assigns the session id silently to another exit.
//
// It prints nothing: neither the password nor the username appears in any answer, error
// or String.
type FakeProxy struct {
	// Addr is the host:port the proxy listens on.
	Addr string

	cfg         FakeProxyConfig
	now         func() time.Time
	unavailable map[string]bool
	ln          net.Listener
	wg          sync.WaitGroup
	closeOnce   sync.Once

	bytes         atomic.Int64
	rotatingBytes atomic.Int64
	fromClients   atomic.Int64 // bytes read from clients, every connection, CONNECT and tunnels included
	toClients     atomic.Int64 // bytes written to clients
	requests      atomic.Int64
	disconnects   atomic.Int64
	cutsAlive     atomic.Int64 // disconnects that left the session its exit
	refusing      atomic.Bool  // SetRefusing: every request answered 407
	refused       atomic.Int64 // requests answered 407 for SetRefusing
	broke         atomic.Bool  // SetOutOfBalance: every request answered 402
	authed        atomic.Int64 // requests with valid credentials

	mu           sync.Mutex
	discProb     float64
	aliveFrac    float64           // CutExitAlive (SetCutExitAlive)
	dropPaths    []fpDrop          // DropNext*: each entry cuts the next request with that path prefix
	urlDraws     map[string]uint64 // CutDrawsByURL: requests forwarded per URL
	sessions     map[string]*fpSession
	rotations    uint64
	lastRotating string
	conns        map[net.Conn]bool // open connections: true for those to destinations
	closed       bool
	seen         []FakeProxyRequest
}

// fpSession is the state of one sticky session id.
type fpSession struct {
	exit     string
	gen      uint64
	since    time.Time // first request on the current exit
	lifetime time.Duration
	requests uint64 // requests ever made with this id, drives the disconnect draws
	gone     bool
	moveNext bool // DropNextNewExit: the next request gets a new exit
	bytes    atomic.Int64
}

// fpCred is what a username (and, for IPRoyal, a password) asks for.
type fpCred struct {
	country  string // upper case, "" = any
	session  string // "" = rotating
	lifetime time.Duration
}

// NewFakeProxy starts a FakeProxy; it is closed, with all its goroutines ended, when the
// test ends. An invalid config fails the test.
func NewFakeProxy(t testing.TB, cfg FakeProxyConfig) *FakeProxy {
	t.Helper()
	if err := cfg.validate(); err != nil {
		t.Fatalf("testutil: FakeProxyConfig: %v", err)
	}
	p := &FakeProxy{
		cfg:         cfg,
		now:         cfg.Now,
		unavailable: map[string]bool{},
		discProb:    cfg.DisconnectProb,
		aliveFrac:   cfg.CutExitAlive,
		sessions:    map[string]*fpSession{},
		urlDraws:    map[string]uint64{},
		conns:       map[net.Conn]bool{},
	}
	if p.now == nil {
		p.now = time.Now
	}
	for _, c := range cfg.UnavailableCountries {
		p.unavailable[strings.ToUpper(c)] = true
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("testutil: fake proxy listen: %v", err)
	}
	p.ln = ln
	p.Addr = ln.Addr().String()
	p.wg.Add(1)
	go p.acceptLoop()
	t.Cleanup(p.Close)
	return p
}

func (c FakeProxyConfig) validate() error {
	switch c.Format {
	case ProxyFormatBrightData:
		if !strings.HasPrefix(c.User, "brd-customer-") || !strings.Contains(c.User, "-zone-") {
			return fmt.Errorf("brightdata User must be brd-customer-<ID>-zone-<ZONE>")
		}
	case ProxyFormatOxylabs, ProxyFormatDecodo, ProxyFormatIPRoyal, ProxyFormatSOAX, ProxyFormatGeneric:
	default:
		return fmt.Errorf("unknown Format %q", c.Format)
	}
	if c.User == "" || c.Password == "" {
		return errors.New("testutil: FakeProxyConfig: User and Password are required")
	}
	if c.DisconnectProb < 0 || c.DisconnectProb > 1 || math.IsNaN(c.DisconnectProb) {
		return fmt.Errorf("DisconnectProb %v is outside [0, 1]", c.DisconnectProb)
	}
	if c.CutExitAlive < 0 || c.CutExitAlive > 1 || math.IsNaN(c.CutExitAlive) {
		return fmt.Errorf("CutExitAlive %v is outside [0, 1]", c.CutExitAlive)
	}
	if c.SessionLifetime < 0 {
		return fmt.Errorf("SessionLifetime %v is negative", c.SessionLifetime)
	}
	return nil
}

// URL returns the proxy's URL, http://127.0.0.1:<port>, without credentials.
func (p *FakeProxy) URL() string { return "http://" + p.Addr }

// String implements fmt.Stringer; it never contains credentials.
func (p *FakeProxy) String() string { return fmt.Sprintf("fake %s proxy %s", p.cfg.Format, p.Addr) }

// Bytes is the total number of bytes relayed between the proxy and destinations, both
// ways (request and response bytes on the wire, tunnel bytes for CONNECT).
func (p *FakeProxy) Bytes() int64 { return p.bytes.Load() }

// BytesFor is Bytes for one session id, over all its exits; BytesFor("") is the traffic
// of rotating (session-less) requests.
func (p *FakeProxy) BytesFor(sessionID string) int64 {
	if sessionID == "" {
		return p.rotatingBytes.Load()
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if s := p.sessions[sessionID]; s != nil {
		return s.bytes.Load()
	}
	return 0
}

// ClientBytes is what the proxy exchanged with its clients on every connection so far:
// the bytes it read from them and the bytes it wrote to them — request and response lines
// and headers as sent, CONNECT exchanges, tunnelled TLS, its own refusals — i.e. what a
// provider bills. A connection's last bytes are in once OpenClients no longer counts it.
func (p *FakeProxy) ClientBytes() (fromClients, toClients int64) {
	return p.fromClients.Load(), p.toClients.Load()
}

// OpenClients is the number of client connections the proxy has open.
func (p *FakeProxy) OpenClients() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, upstream := range p.conns {
		if !upstream {
			n++
		}
	}
	return n
}

// Authenticated is the number of requests that carried valid credentials (a browser's
// first try without them, answered 407, is not one).
func (p *FakeProxy) Authenticated() int64 { return p.authed.Load() }

// RequestsFor is the number of requests made with a session id (authenticated).
func (p *FakeProxy) RequestsFor(sessionID string) int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	if s := p.sessions[sessionID]; s != nil {
		return int64(s.requests)
	}
	return 0
}

// Seen lists, in order, every request the proxy has read and which credentials it
// carried (never the credentials themselves).
func (p *FakeProxy) Seen() []FakeProxyRequest {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]FakeProxyRequest(nil), p.seen...)
}

// Requests is the number of requests the proxy has read (forwarded requests and CONNECTs),
// whatever it answered, 407 and 502 included.
func (p *FakeProxy) Requests() int64 { return p.requests.Load() }

// Disconnects is the number of disconnects the proxy has decided (each kills one client
// connection, and its session unless the exit survived: CutsExitAlive).
func (p *FakeProxy) Disconnects() int64 { return p.disconnects.Load() }

// ExitOf returns the exit ("127.0.0.N") the session id was last assigned, or "" when the
// id is unknown or its device is gone. After the lifetime passes the old exit is reported
// until the next request re-assigns it.
func (p *FakeProxy) ExitOf(sessionID string) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if s := p.sessions[sessionID]; s != nil && !s.gone {
		return s.exit
	}
	return ""
}

// SetRefusing makes the proxy answer every request 407, whatever its credentials, as a
// provider does after a password rotation or once the account's balance is spent (true),
// or take them again (false).
func (p *FakeProxy) SetRefusing(refusing bool) { p.refusing.Store(refusing) }

// SetOutOfBalance makes the proxy answer every authenticated request (CONNECT included)
// 402 Payment Required with the provider's error header X-Brd-Err-Code, as a provider does
// when the account's balance ran out; Refused counts them too.
func (p *FakeProxy) SetOutOfBalance(broke bool) { p.broke.Store(broke) }

// Refused counts the requests answered 407 because of SetRefusing.
func (p *FakeProxy) Refused() int64 { return p.refused.Load() }

// SetDisconnectProb changes DisconnectProb for the requests that follow; p is clamped to [0, 1].
func (p *FakeProxy) SetDisconnectProb(prob float64) {
	prob = math.Max(0, math.Min(1, prob))
	p.mu.Lock()
	p.discProb = prob
	p.mu.Unlock()
}

// SetCutExitAlive changes CutExitAlive for the disconnects that follow; f is clamped to [0, 1].
func (p *FakeProxy) SetCutExitAlive(f float64) {
	f = math.Max(0, math.Min(1, f))
	p.mu.Lock()
	p.aliveFrac = f
	p.mu.Unlock()
}

// ResetCutDraws starts the per-URL request counts of CutDrawsByURL again: the next run of
// the same requests sees the same cuts as the first.
func (p *FakeProxy) ResetCutDraws() {
	p.mu.Lock()
	clear(p.urlDraws)
	p.mu.Unlock()
}

// CutsExitAlive is the number of disconnects after which the session kept its exit
// (CutExitAlive, DropNextKeepExit); Disconnects counts them too.
func (p *FakeProxy) CutsExitAlive() int64 { return p.cutsAlive.Load() }

// fpDrop is one DropNext* entry.
type fpDrop struct {
	prefix string
	mode   fpCutMode
}

// fpCutMode is what a disconnect does to the session.
type fpCutMode int

const (
	cutExitLost  fpCutMode = iota // the device is gone: the session id is dead (502 from then on)
	cutExitAlive                  // the connection only: the session id keeps its exit
	cutNewExit                    // the connection, and the session id silently moves to another exit
)

// DropNext makes the device of the next plain-HTTP request on a sticky session whose
// URL path starts with pathPrefix drop mid-response (a disconnect, as DisconnectProb
// draws them): e.g. a page's XHR, to cut a render half-way. Each call drops one request.
func (p *FakeProxy) DropNext(pathPrefix string) { p.dropNext(pathPrefix, cutExitLost) }

// DropNextKeepExit is DropNext for a dropped connection whose exit survives: the next
// plain-HTTP request with that path prefix is cut mid-response, and the session id keeps
// its exit for the requests that follow.
func (p *FakeProxy) DropNextKeepExit(pathPrefix string) { p.dropNext(pathPrefix, cutExitAlive) }

// DropNextNewExit is DropNext for an exit lost under a live session id: the next
// plain-HTTP request with that path prefix is cut mid-response, and the session id's
// next request goes out from another exit, with no error (a silent re-assignment).
func (p *FakeProxy) DropNextNewExit(pathPrefix string) { p.dropNext(pathPrefix, cutNewExit) }

func (p *FakeProxy) dropNext(pathPrefix string, mode fpCutMode) {
	p.mu.Lock()
	p.dropPaths = append(p.dropPaths, fpDrop{prefix: pathPrefix, mode: mode})
	p.mu.Unlock()
}

// takeDrop consumes a DropNext* entry that path matches; p.mu is held.
func (p *FakeProxy) takeDrop(path string) (fpCutMode, bool) {
	if path == "" {
		return 0, false
	}
	for i, d := range p.dropPaths {
		if strings.HasPrefix(path, d.prefix) {
			p.dropPaths = append(p.dropPaths[:i], p.dropPaths[i+1:]...)
			return d.mode, true
		}
	}
	return 0, false
}

// Close stops the proxy, kills every open connection and waits for all its goroutines.
// It may be called more than once.
func (p *FakeProxy) Close() {
	p.closeOnce.Do(func() {
		_ = p.ln.Close()
		p.mu.Lock()
		p.closed = true
		// Clients first: a handler that sees its destination vanish must find no client
		// left to answer.
		for c, upstream := range p.conns {
			if !upstream {
				_ = c.Close()
			}
		}
		for c := range p.conns {
			_ = c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
}

// track registers c so that Close can kill it; it reports false (and closes c) when the
// proxy is already closed.
func (p *FakeProxy) track(c net.Conn, upstream bool) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		_ = c.Close()
		return false
	}
	p.conns[c] = upstream
	return true
}

func (p *FakeProxy) untrack(c net.Conn) {
	_ = c.Close()
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
}

func (p *FakeProxy) acceptLoop() {
	defer p.wg.Done()
	for {
		raw, err := p.ln.Accept()
		if err != nil {
			return // listener closed
		}
		c := &fpClientConn{Conn: raw, p: p}
		if !p.track(c, false) {
			continue
		}
		p.wg.Add(1)
		go p.serveConn(c)
	}
}

func (p *FakeProxy) serveConn(c net.Conn) {
	defer p.wg.Done()
	defer p.untrack(c)
	br := bufio.NewReader(c)
	for {
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		p.requests.Add(1)
		if !p.handle(c, br, req) {
			return
		}
	}
}

// handle answers one request and reports whether the client connection may be reused.
func (p *FakeProxy) handle(c net.Conn, br *bufio.Reader, req *http.Request) bool {
	header := req.Header.Get("Proxy-Authorization")
	cred, ok := p.authenticate(header)
	p.record(req, header, cred, ok)
	valid := ok
	if header == "" && p.cfg.NoChallenge && !p.refusing.Load() {
		// An allow-listed client: served without credentials, on a rotating exit.
		cred, ok = fpCred{}, true
	}
	if ok && p.refusing.Load() {
		p.refused.Add(1)
		ok = false
	}
	if !ok {
		h := http.Header{}
		h.Set("Proxy-Authenticate", `Basic realm="fake"`)
		fpWriteError(c, http.StatusProxyAuthRequired, h, "proxy authentication required\n")
		return false
	}
	if valid {
		p.authed.Add(1)
	}
	if p.broke.Load() {
		p.refused.Add(1)
		h := http.Header{}
		h.Set("X-Brd-Err-Code", "balance_exhausted")
		fpWriteError(c, http.StatusPaymentRequired, h, "account balance exhausted\n")
		return false
	}
	var target string
	if req.Method == http.MethodConnect {
		target = req.Host
	} else {
		if req.URL.Scheme != "http" || req.URL.Host == "" {
			fpWriteError(c, http.StatusBadRequest, nil, "absolute http:// request URI required\n")
			return false
		}
		target = req.URL.Host
		if _, _, err := net.SplitHostPort(target); err != nil {
			target = net.JoinHostPort(target, "80")
		}
	}
	if cred.country != "" && p.unavailable[cred.country] {
		p.writeBadGateway(c, FakeProxyErrCountry, "no peer available in country "+cred.country)
		return false
	}
	dest, ok := fpLoopbackTarget(target)
	if !ok {
		p.writeBadGateway(c, FakeProxyErrDestination, "fake proxy dials loopback IPv4 destinations only")
		return false
	}
	path, rawURL := "", ""
	if req.Method != http.MethodConnect {
		path, rawURL = req.URL.Path, req.URL.RequestURI()
	}
	rt := p.route(cred, path, rawURL)
	exit, sess := rt.exit, rt.sess
	if sess != nil && exit == "" {
		p.writeBadGateway(c, FakeProxyErrSessionGone, "the session's peer is gone; use a new session id")
		return false
	}
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(exit)}, Timeout: 5 * time.Second}
	raw, err := d.Dial("tcp", dest)
	if err != nil {
		p.writeBadGateway(c, FakeProxyErrDestination, "could not connect to the destination")
		return false
	}
	if !p.track(raw, true) {
		return false
	}
	defer p.untrack(raw)
	up := &fpCountConn{Conn: raw, p: p, sess: sess}
	if req.Method == http.MethodConnect {
		p.tunnel(c, br, up, rt.cut)
		return false
	}
	return p.forward(c, req, up, exit, rt.cut > 0)
}

// record appends what Seen reports about req.
func (p *FakeProxy) record(req *http.Request, header string, cred fpCred, ok bool) {
	seen := FakeProxyRequest{Method: req.Method, Credentials: "invalid"}
	switch {
	case header == "":
		seen.Credentials = "none"
	case ok:
		seen.Credentials, seen.Session = "valid", cred.session
	}
	if req.Method == http.MethodConnect {
		seen.Target = req.Host
	} else if req.URL != nil {
		seen.Target, seen.Path = req.URL.Host, req.URL.Path
	}
	p.mu.Lock()
	p.seen = append(p.seen, seen)
	p.mu.Unlock()
}

// fpRoute is the proxy's decision for one request.
type fpRoute struct {
	exit string     // "" when the session is gone
	sess *fpSession // nil for a rotating request
	cut  int64      // > 0: the device drops; for CONNECT, after this many destination bytes
}

// route picks the exit for a request and draws its disconnect. For a dead session it
// returns the session and exit "".
func (p *FakeProxy) route(cred fpCred, path, rawURL string) fpRoute {
	p.mu.Lock()
	defer p.mu.Unlock()
	if cred.session == "" {
		p.rotations++
		exit := p.pickExit(p.lastRotating, "rotate", strconv.FormatUint(p.rotations, 10))
		p.lastRotating = exit
		return fpRoute{exit: exit}
	}
	lifetime := cred.lifetime
	if p.cfg.SessionLifetime > 0 {
		lifetime = p.cfg.SessionLifetime
	}
	if lifetime <= 0 {
		lifetime = DefaultFakeSessionLifetime
	}
	now := p.now()
	s := p.sessions[cred.session]
	switch {
	case s == nil:
		s = &fpSession{since: now, lifetime: lifetime}
		s.exit = p.pickExit("", "session", cred.session, "0")
		p.sessions[cred.session] = s
	case s.gone:
		return fpRoute{sess: s}
	case now.Sub(s.since) >= s.lifetime || s.moveNext:
		// The provider re-assigns the session silently: a new exit, no error.
		s.gen++
		s.since, s.lifetime, s.moveNext = now, lifetime, false
		s.exit = p.pickExit(s.exit, "session", cred.session, strconv.FormatUint(s.gen, 10))
	}
	s.requests++
	n := strconv.FormatUint(s.requests, 10)
	mode, dropped := p.takeDrop(path)
	drawKey, drawN := cred.session, n
	if p.cfg.CutDrawsByURL && rawURL != "" {
		p.urlDraws[rawURL]++
		drawKey, drawN = "url "+rawURL, strconv.FormatUint(p.urlDraws[rawURL], 10)
	}
	if !dropped && fpUnit(p.cfg.Seed, "disconnect", drawKey, drawN) < p.discProb {
		dropped = true
		if fpUnit(p.cfg.Seed, "alive", drawKey, drawN) < p.aliveFrac {
			mode = cutExitAlive
		}
	}
	if dropped {
		switch mode {
		case cutExitAlive:
			p.cutsAlive.Add(1)
		case cutNewExit:
			s.moveNext = true
		default:
			s.gone = true
		}
		p.disconnects.Add(1)
		return fpRoute{exit: s.exit, sess: s, cut: 8 + int64(fpHash(p.cfg.Seed, "cut", cred.session, n)%57)}
	}
	return fpRoute{exit: s.exit, sess: s}
}

// pickExit derives an exit 127.0.0.N (N in 2…250) from the seed and parts, different from avoid.
func (p *FakeProxy) pickExit(avoid string, parts ...string) string {
	for salt := 0; ; salt++ {
		h := fpHash(p.cfg.Seed, append(parts, strconv.Itoa(salt))...)
		exit := "127.0.0." + strconv.FormatUint(2+h%249, 10)
		if exit != avoid {
			return exit
		}
	}
}

// forward relays one plain-HTTP request and reports whether the client connection may be
// reused.
func (p *FakeProxy) forward(c net.Conn, req *http.Request, up net.Conn, exit string, disconnect bool) bool {
	clientClose := req.Close
	fpStripHopHeaders(req.Header)
	req.Header.Set("X-Fake-Exit", exit)
	if p.cfg.Tier != "" {
		req.Header.Set("X-Fake-Tier", p.cfg.Tier)
	}
	req.RequestURI = ""
	req.Close = true
	if err := req.Write(up); err != nil {
		p.writeBadGateway(c, FakeProxyErrDestination, "could not send the request to the destination")
		return false
	}
	upr := bufio.NewReader(up)
	resp, err := http.ReadResponse(upr, req)
	// Informational responses (100 Continue, 103 Early Hints) are relayed as they come,
	// then the final one is read.
	for n := 0; err == nil && fpInformational(resp.StatusCode) && !disconnect; n++ {
		if n == fpMax1xx {
			p.writeBadGateway(c, FakeProxyErrDestination, "too many informational responses from the destination")
			return false
		}
		if err := resp.Write(c); err != nil {
			return false
		}
		resp, err = http.ReadResponse(upr, req)
	}
	if err != nil {
		p.writeBadGateway(c, FakeProxyErrDestination, "no valid response from the destination")
		return false
	}
	defer resp.Body.Close()
	if disconnect {
		fpWritePartial(c, resp)
		return false
	}
	fpStripHopHeaders(resp.Header)
	chunked := len(resp.TransferEncoding) > 0 && resp.TransferEncoding[0] == "chunked"
	resp.Close = clientClose || !resp.ProtoAtLeast(1, 1) ||
		(resp.ContentLength < 0 && !chunked && req.Method != http.MethodHead)
	if err := resp.Write(c); err != nil {
		return false
	}
	return !resp.Close
}

// fpMax1xx bounds the informational responses relayed before a final one.
const fpMax1xx = 16

// fpInformational reports whether code is an informational response a final one follows
// (1xx but 101 Switching Protocols, which ends HTTP on the connection).
func fpInformational(code int) bool {
	return code >= 100 && code < 200 && code != http.StatusSwitchingProtocols
}

// fpWritePartial writes what a client sees when the device drops mid-response: the status
// line, and when there is a body, the headers and part of the body; then the caller closes.
func fpWritePartial(c net.Conn, resp *http.Response) {
	status := resp.Status
	if status == "" {
		status = strconv.Itoa(resp.StatusCode)
	}
	statusLine := fmt.Sprintf("HTTP/1.1 %s\r\n", status)
	if resp.ContentLength == 0 || resp.Request.Method == http.MethodHead {
		_, _ = io.WriteString(c, statusLine)
		return
	}
	h := resp.Header.Clone()
	fpStripHopHeaders(h)
	h.Del("Content-Length")
	var (
		cut     int64
		chunked bool
	)
	if resp.ContentLength > 0 {
		h.Set("Content-Length", strconv.FormatInt(resp.ContentLength, 10))
		cut = resp.ContentLength / 2
	} else {
		h.Set("Transfer-Encoding", "chunked")
		chunked, cut = true, 512
	}
	bw := bufio.NewWriter(c)
	_, _ = bw.WriteString(statusLine)
	_ = h.Write(bw)
	_, _ = bw.WriteString("\r\n")
	if chunked {
		part, _ := io.ReadAll(io.LimitReader(resp.Body, cut))
		if len(part) > 0 {
			fmt.Fprintf(bw, "%x\r\n", len(part))
			_, _ = bw.Write(part)
		}
	} else {
		_, _ = io.CopyN(bw, resp.Body, cut)
	}
	_ = bw.Flush()
}

// tunnel relays a CONNECT tunnel until either side closes. When cut > 0 (a disconnect) it
// closes the tunnel after cut (8…64) bytes from the destination.
func (p *FakeProxy) tunnel(c net.Conn, br *bufio.Reader, up net.Conn, cut int64) {
	if _, err := io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
		return
	}
	done := make(chan struct{})
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		defer close(done)
		_, _ = io.Copy(up, br) // br first: it may hold bytes the client sent early
		_ = up.Close()
		_ = c.Close()
	}()
	if cut > 0 {
		_, _ = io.CopyN(c, up, cut)
	} else {
		_, _ = io.Copy(c, up)
	}
	// Whichever side ends first ends the tunnel: closing both unblocks the other copy.
	_ = up.Close()
	_ = c.Close()
	<-done
}

func (p *FakeProxy) writeBadGateway(c net.Conn, code, msg string) {
	h := http.Header{}
	if p.cfg.ErrorHeaders {
		h.Set("Proxy-Status", fmt.Sprintf(`brd; error=destination_unreachable; details="%s: %s"`, code, msg))
		h.Set("X-Brd-Err-Code", code)
		h.Set("X-Brd-Err-Msg", msg)
	}
	fpWriteError(c, http.StatusBadGateway, h, msg+"\n")
}

func fpWriteError(w io.Writer, code int, h http.Header, body string) {
	if h == nil {
		h = http.Header{}
	}
	h.Set("Content-Type", "text/plain; charset=utf-8")
	resp := &http.Response{
		StatusCode:    code,
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        h,
		Body:          io.NopCloser(strings.NewReader(body)),
		ContentLength: int64(len(body)),
		Close:         true,
	}
	_ = resp.Write(w)
}

// fpHopHeaders are the headers that concern one connection only and are not relayed.
var fpHopHeaders = []string{
	"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authorization",
	"Proxy-Authenticate", "Te", "Trailer", "Transfer-Encoding", "Upgrade",
}

func fpStripHopHeaders(h http.Header) {
	for _, v := range h.Values("Connection") {
		for _, name := range strings.Split(v, ",") {
			if name = strings.TrimSpace(name); name != "" {
				h.Del(name)
			}
		}
	}
	for _, name := range fpHopHeaders {
		h.Del(name)
	}
}

// fpLoopbackTarget maps host:port to a dialable loopback IPv4 address.
func fpLoopbackTarget(hostport string) (string, bool) {
	host, port, err := net.SplitHostPort(hostport)
	if err != nil || port == "" {
		return "", false
	}
	if strings.EqualFold(host, "localhost") {
		return net.JoinHostPort("127.0.0.1", port), true
	}
	ip := net.ParseIP(host)
	if ip == nil || ip.To4() == nil || !ip.IsLoopback() {
		return "", false
	}
	return net.JoinHostPort(ip.String(), port), true
}

// fpCountConn counts the bytes relayed to and from a destination.
type fpCountConn struct {
	net.Conn
	p    *FakeProxy
	sess *fpSession
}

func (c *fpCountConn) add(n int) {
	if n <= 0 {
		return
	}
	c.p.bytes.Add(int64(n))
	if c.sess != nil {
		c.sess.bytes.Add(int64(n))
	} else {
		c.p.rotatingBytes.Add(int64(n))
	}
}

func (c *fpCountConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	c.add(n)
	return n, err
}

func (c *fpCountConn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	c.add(n)
	return n, err
}

// fpClientConn counts the bytes exchanged with a client (ClientBytes).
type fpClientConn struct {
	net.Conn
	p *FakeProxy
}

func (c *fpClientConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	c.p.fromClients.Add(int64(max(n, 0)))
	return n, err
}

func (c *fpClientConn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	c.p.toClients.Add(int64(max(n, 0)))
	return n, err
}

// authenticate checks a Proxy-Authorization header against the configured account and
// parses the options of the configured format.
func (p *FakeProxy) authenticate(header string) (fpCred, bool) {
	scheme, enc, ok := strings.Cut(header, " ")
	if !ok || !strings.EqualFold(scheme, "Basic") {
		return fpCred{}, false
	}
	raw, err := base64.StdEncoding.DecodeString(strings.TrimSpace(enc))
	if err != nil {
		return fpCred{}, false
	}
	user, pass, ok := strings.Cut(string(raw), ":")
	if !ok {
		return fpCred{}, false
	}
	if p.cfg.Format == ProxyFormatIPRoyal {
		if !fpEqual(user, p.cfg.User) {
			return fpCred{}, false
		}
		rest, found := strings.CutPrefix(pass, p.cfg.Password)
		if !found {
			return fpCred{}, false
		}
		return fpParseIPRoyal(rest)
	}
	if !fpEqual(pass, p.cfg.Password) {
		return fpCred{}, false
	}
	var prefix string
	switch p.cfg.Format {
	case ProxyFormatBrightData, ProxyFormatGeneric:
		prefix = p.cfg.User
	case ProxyFormatOxylabs:
		prefix = "customer-" + p.cfg.User
	case ProxyFormatDecodo:
		prefix = "user-" + p.cfg.User
	case ProxyFormatSOAX:
		prefix = "package-" + p.cfg.User
	}
	rest, found := strings.CutPrefix(user, prefix)
	if !found {
		return fpCred{}, false
	}
	opts, ok := fpDashOptions(rest)
	if !ok {
		return fpCred{}, false
	}
	return fpParseOptions(p.cfg.Format, opts)
}

func fpEqual(a, b string) bool { return subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1 }

// fpDashOptions splits "-key-value-key-value…" into a map; keys may not repeat.
func fpDashOptions(rest string) (map[string]string, bool) {
	opts := map[string]string{}
	if rest == "" {
		return opts, true
	}
	if rest[0] != '-' {
		return nil, false
	}
	parts := strings.Split(rest[1:], "-")
	if len(parts)%2 != 0 {
		return nil, false
	}
	for i := 0; i < len(parts); i += 2 {
		k, v := parts[i], parts[i+1]
		if _, dup := opts[k]; dup || k == "" || v == "" {
			return nil, false
		}
		opts[k] = v
	}
	return opts, true
}

func fpParseOptions(format string, opts map[string]string) (fpCred, bool) {
	// Option names per format: country, session id, lifetime (and its unit).
	var countryKey, sessionKey, lifetimeKey string
	var unit time.Duration
	var maxLifetime int
	switch format {
	case ProxyFormatBrightData, ProxyFormatGeneric:
		countryKey, sessionKey = "country", "session"
	case ProxyFormatOxylabs:
		countryKey, sessionKey, lifetimeKey, unit, maxLifetime = "cc", "sessid", "sesstime", time.Minute, 1440
	case ProxyFormatDecodo:
		countryKey, sessionKey, lifetimeKey, unit, maxLifetime = "country", "session", "sessionduration", time.Minute, 1440
	case ProxyFormatSOAX:
		countryKey, sessionKey, lifetimeKey, unit, maxLifetime = "country", "sessionid", "sessionlength", time.Second, 7*24*3600
	}
	var cred fpCred
	for k, v := range opts {
		switch k {
		case countryKey:
			if !fpIsCountry(v) {
				return fpCred{}, false
			}
			cred.country = strings.ToUpper(v)
		case sessionKey:
			if !fpIsSessionID(v) {
				return fpCred{}, false
			}
			cred.session = v
		case lifetimeKey:
			if lifetimeKey == "" {
				return fpCred{}, false
			}
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 || n > maxLifetime {
				return fpCred{}, false
			}
			cred.lifetime = time.Duration(n) * unit
		default:
			return fpCred{}, false
		}
	}
	if format == ProxyFormatSOAX && (cred.session == "") != (cred.lifetime == 0) {
		return fpCred{}, false // SOAX: sessionid and sessionlength come together
	}
	return cred, true
}

// fpParseIPRoyal parses the options after the password: _country-us_session-<8>_lifetime-30m.
func fpParseIPRoyal(rest string) (fpCred, bool) {
	var cred fpCred
	if rest == "" {
		return cred, true
	}
	if rest[0] != '_' {
		return fpCred{}, false
	}
	seen := map[string]bool{}
	for _, opt := range strings.Split(rest[1:], "_") {
		k, v, ok := strings.Cut(opt, "-")
		if !ok || v == "" || seen[k] {
			return fpCred{}, false
		}
		seen[k] = true
		switch k {
		case "country":
			if !fpIsCountry(v) {
				return fpCred{}, false
			}
			cred.country = strings.ToUpper(v)
		case "session":
			if len(v) != 8 || !fpIsSessionID(v) || strings.Contains(v, "_") {
				return fpCred{}, false
			}
			cred.session = v
		case "lifetime":
			d, ok := fpParseIPRoyalLifetime(v)
			if !ok {
				return fpCred{}, false
			}
			cred.lifetime = d
		default:
			return fpCred{}, false
		}
	}
	if (cred.session == "") != (cred.lifetime == 0) {
		return fpCred{}, false // IPRoyal: a sticky session needs a lifetime, and vice versa
	}
	return cred, true
}

func fpParseIPRoyalLifetime(v string) (time.Duration, bool) {
	units := map[byte]time.Duration{'s': time.Second, 'm': time.Minute, 'h': time.Hour, 'd': 24 * time.Hour}
	unit, ok := units[v[len(v)-1]]
	if !ok {
		return 0, false
	}
	n, err := strconv.Atoi(v[:len(v)-1])
	if err != nil || n < 1 {
		return 0, false
	}
	d := time.Duration(n) * unit
	if d > 7*24*time.Hour {
		return 0, false
	}
	return d, true
}

func fpIsCountry(v string) bool {
	if len(v) != 2 {
		return false
	}
	for _, r := range strings.ToLower(v) {
		if r < 'a' || r > 'z' {
			return false
		}
	}
	return true
}

func fpIsSessionID(v string) bool {
	if v == "" || len(v) > 64 {
		return false
	}
	for _, r := range v {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_') {
			return false
		}
	}
	return true
}

// fpHash mixes the seed and parts into 64 well-distributed bits (FNV-1a, then the
// splitmix64 finaliser so that low and high bits both vary).
func fpHash(seed int64, parts ...string) uint64 {
	h := fnv.New64a()
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], uint64(seed))
	_, _ = h.Write(b[:])
	for _, s := range parts {
		_, _ = h.Write([]byte{0})
		_, _ = h.Write([]byte(s))
	}
	x := h.Sum64()
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// fpUnit is fpHash as a float in [0, 1).
func fpUnit(seed int64, parts ...string) float64 {
	return float64(fpHash(seed, parts...)>>11) / (1 << 53)
}
