package sessions

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gocolly/colly/v2"

	"github.com/idemscrape/idemscrape/politeness"
	"github.com/idemscrape/idemscrape/tasks"
)

// Collector defaults.
const (
	DefaultMaxBodyBytes        = 10 << 20
	DefaultRequestTimeout      = 30 * time.Second
	DefaultDialTimeout         = 10 * time.Second
	DefaultTLSHandshakeTimeout = 10 * time.Second
	DefaultUserAgent           = "idemscrape (+https://github.com/idemscrape/idemscrape)"
	DefaultThrottleWaitMax     = 2 * time.Second
	DefaultThrottleRetries     = 2
)

// CollectorConfig configures the collector bound to a session.
type CollectorConfig struct {
	// MaxBodyBytes caps every response body after decompression; a larger body fails with
	// ErrBodyTooLarge (category body_too_large) instead of being silently cut. Defaults to
	// DefaultMaxBodyBytes.
	MaxBodyBytes int64
	// RequestTimeout bounds each request, body included. Defaults to DefaultRequestTimeout.
	RequestTimeout time.Duration
	// DialTimeout bounds the TCP connect to the proxy. Defaults to DefaultDialTimeout.
	DialTimeout time.Duration
	// IgnoreRobotsTxt turns robots.txt checks off altogether (neither Robots nor colly's
	// own check runs). Defaults to false: robots.txt is respected (colly's own default is
	// the opposite).
	IgnoreRobotsTxt bool
	// UserAgent sent with every request. Defaults to DefaultUserAgent.
	UserAgent string
	// Guard checks every request, redirect target and robots.txt fetch. Build it with
	// NewGuard from the same tasks.DestinationPolicy the Enqueuer uses. Defaults to a Guard
	// with the strict policy.
	Guard *Guard
	// TLSConfig for HTTPS destinations (tests pass their server's roots). Defaults to nil
	// (system roots).
	TLSConfig *tls.Config
	// Now is the clock for Retry-After dates. Defaults to time.Now.
	Now func() time.Time
	// Robots is the fleet-wide robots.txt cache (politeness.NewRobotsCache). When set (and
	// IgnoreRobotsTxt is false), colly's own per-collector robots.txt check is off and every
	// hop — redirects included — is checked against this cache instead, whose fetch goes
	// through the collector's own session. Defaults to nil: colly's per-collector check,
	// which fetches robots.txt once per collector (once per session).
	Robots *politeness.RobotsCache
	// Limiter paces every request hop (redirects and robots.txt fetches included) per
	// destination host, and hears every 429/503 Retry-After (politeness.Limiter is the
	// fleet-wide one). Defaults to nil: no pacing.
	Limiter politeness.HostLimiter
	// IsolatePlainHTTP gives every session its own connections to the gateway for
	// plain-HTTP destinations too. By default those are shared by every open collector of
	// the gateway: a forwarding proxy reads the session from each request's own
	// Proxy-Authorization header, so a new session needs no new TCP connection. Set it for
	// a gateway that binds a kept-alive connection to the session of its first request.
	// HTTPS destinations always use the session's own CONNECT tunnels.
	IsolatePlainHTTP bool
	// ThrottleWaitMax: a GET answered 429 or 503 with a Retry-After of at most this is sent
	// again on the same session once the wait has passed, up to ThrottleRetries times,
	// instead of ending the attempt: the session, and what its earlier steps fetched,
	// stays good, so the unit is not replayed from its first step later (the bytes of a
	// throttled attempt were the largest share of waste after session loss in the chaos
	// runs). A longer Retry-After ends the attempt as throttled, as before, so a worker
	// slot and the lease are never held long. Defaults to DefaultThrottleWaitMax; negative
	// turns it off.
	ThrottleWaitMax time.Duration
	// ThrottleRetries bounds the re-sends of one request. Defaults to DefaultThrottleRetries.
	ThrottleRetries int
	// Browsers renders pages that need JavaScript (StepContext.Render) on the session.
	// Defaults to nil: a step that renders fails (ErrNoBrowsers).
	Browsers *BrowserPool

	// run is the run's owner of bytes (set by Unit.Run), above every session's: it counts
	// what all the run's sessions moved and carries the run's byte cap (RunConfig.MaxBytes,
	// raised by RunConfig.MoreBytes), one value for all of them. nil: no cap. budgetSet
	// says run has a cap.
	run       *wireOwner
	budgetSet bool
	// jar is the session's cookie jar when it comes warm from a Pool (nil: a new one);
	// knownExit the exit its last unit ended on ("" = none named).
	jar       http.CookieJar
	knownExit string
}

func (c *CollectorConfig) withDefaults() CollectorConfig {
	var o CollectorConfig
	if c != nil {
		o = *c
	}
	if o.MaxBodyBytes <= 0 {
		o.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if o.RequestTimeout <= 0 {
		o.RequestTimeout = DefaultRequestTimeout
	}
	if o.DialTimeout <= 0 {
		o.DialTimeout = DefaultDialTimeout
	}
	if o.UserAgent == "" {
		o.UserAgent = DefaultUserAgent
	}
	if o.ThrottleWaitMax == 0 {
		o.ThrottleWaitMax = DefaultThrottleWaitMax
	}
	if o.ThrottleRetries <= 0 {
		o.ThrottleRetries = DefaultThrottleRetries
	}
	if o.Guard == nil {
		o.Guard = &Guard{}
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return o
}

// Bound is a colly collector bound to one session: a new collector (never Clone(), which
// shares the client and cookie jar) with its own cookie jar and, for HTTPS, its own
// transport and CONNECT tunnels, so nothing of one session leaks into another. Plain-HTTP
// requests go through a transport shared by every Bound of the same gateway (see
// plainTransport): the proxy reads the session from each request's own
// Proxy-Authorization header, so a kept-alive connection to the gateway carries no
// session state and a new session does not need a new TCP connection.
type Bound struct {
	Collector *colly.Collector
	Session   *Session

	cfg        CollectorConfig
	plain      *plainTransport // shared, for http:// destinations
	plainKey   plainKey
	tunnelOnce sync.Once
	tunnel     *http.Transport // this session's own, for https:// (CONNECT) destinations
	closed     atomic.Bool
	bytes      atomic.Int64 // wire bytes of the job's traffic (see Bytes)
	sent       atomic.Int64 // the part of bytes this side wrote to the gateway
	job        *wireOwner   // charges the job's connection bytes to bytes, under the budget
	refused    atomic.Int64 // wire bytes of the proxy's refusals (see RefusedBytes)
	refSent    atomic.Int64 // the part of refused this side wrote
	refusals   *wireOwner   // where a refused exchange's bytes go (refused, refSent)
	robots     atomic.Int64 // wire bytes of the robots.txt fetches it made (see RobotsBytes)
	robotsOwn  *wireOwner   // charges robots
	served     atomic.Bool  // the session answered at least one request
	lastStatus atomic.Int32 // status of the last response (destination's or proxy's)
	resent     atomic.Int64 // requests sent again after a short Retry-After (ThrottleWaitMax)
	ctx        context.Context
	stepCtx    context.Context // the running step's (its span); set by the unit before each step

	exitMu  sync.Mutex
	exit    string // the exit the session's first response named ("" until then)
	proving bool   // after a cut: the next response must name exit (resume.go)
}

const responseKey = "idemscrape.response"

// profiledHeader marks a request whose headers Fetch built with the session's profile;
// the collector's OnRequest removes it before the request is sent. A follow-up request
// colly makes from the response (it inherits the colly context, not the headers) is not
// marked, and gets the profile there.
const profiledHeader = "X-Idemscrape-Profiled"

// NewCollector returns a collector bound to s. Requests run under ctx. Close it when the
// unit is done.
func NewCollector(ctx context.Context, s *Session, cfg *CollectorConfig) (*Bound, error) {
	c := cfg.withDefaults()
	b := &Bound{Session: s, cfg: c, ctx: ctx, exit: c.knownExit}
	b.job = &wireOwner{n: &b.bytes, sent: &b.sent, up: c.run}
	b.refusals = &wireOwner{n: &b.refused, sent: &b.refSent}
	b.robotsOwn = &wireOwner{n: &b.robots}
	b.plainKey = plainKey{endpoint: s.Endpoint, dial: c.DialTimeout, header: c.RequestTimeout}
	if c.IsolatePlainHTTP {
		b.plain = &plainTransport{t: newPlainTransport(b.plainKey, 4), refs: 1} // not in plains: only this Bound
	} else {
		b.plain = acquirePlain(b.plainKey)
	}
	// colly keeps the collector's own User-Agent: its robots.txt check (without
	// CollectorConfig.Robots) matches groups with it, also under a client profile.
	col := colly.NewCollector(
		colly.AllowURLRevisit(),        // a replay fetches the same URLs again
		colly.ParseHTTPErrorResponse(), // statuses are classified by Fetch, not colly
		colly.MaxBodySize(0),           // colly would cut silently and cap compressed bytes only
		colly.UserAgent(c.UserAgent),
		colly.StdlibContext(ctx),
	)
	if p := s.Profile; p != nil {
		// Every request of the session presents its client: Fetch applied the profile
		// before colly (and marked the request), a step's own use of the collector (Visit,
		// OnHTML's follow-ups) gets it here, colly's defaults replaced.
		col.OnRequest(func(r *colly.Request) {
			h := *r.Headers
			if h.Get(profiledHeader) != "" {
				h.Del(profiledHeader)
				return
			}
			if h.Get("Accept") == "*/*" {
				h.Del("Accept") // colly's default, not the step's choice
			}
			if h.Get("User-Agent") == c.UserAgent {
				h.Del("User-Agent")
			}
			p.ApplyFor(h, r.URL)
		})
	}
	// With the shared cache, the transport checks robots.txt on every hop; colly's own
	// check would fetch it again per collector, i.e. per session.
	col.IgnoreRobotsTxt = c.IgnoreRobotsTxt || c.Robots != nil
	if c.jar != nil {
		col.SetCookieJar(c.jar) // a warm session's (Pool): its cookies go on with it
	}
	col.WithTransport(&sessionTransport{bound: b})
	col.SetRequestTimeout(c.RequestTimeout)
	col.OnResponse(func(r *colly.Response) { r.Ctx.Put(responseKey, r) })
	b.Collector = col
	return b, nil
}

// Fetch sends one request through the session and returns the response. A proxy refusal,
// a network failure or a destination status >= 400 returns a *FetchError (with the
// response, when there is one).
//
// A GET or HEAD answered 429 or 503 with a short Retry-After (CollectorConfig.ThrottleWaitMax)
// is sent again on the same session once it has passed (ThrottleRetries times at most).
func (b *Bound) Fetch(method, rawURL string, body io.Reader, hdr http.Header) (resp *colly.Response, err error) {
	if _, span := startSpan(b.spanContext(), "fetch"); span.IsRecording() {
		defer b.endFetchSpan(span, method, rawURL, b.bytes.Load(), b.resent.Load(), &resp, &err)
	}
	for try := 0; ; try++ {
		resp, err := b.fetchOnce(method, rawURL, body, hdr)
		var fe *FetchError
		if err == nil || resp == nil || !errors.As(err, &fe) || fe.Category != tasks.CategoryThrottled ||
			(method != http.MethodGet && method != http.MethodHead) || body != nil ||
			fe.RetryAfter <= 0 || fe.RetryAfter > b.cfg.ThrottleWaitMax || try >= b.cfg.ThrottleRetries {
			return resp, err
		}
		t := time.NewTimer(fe.RetryAfter)
		select {
		case <-t.C:
		case <-b.ctx.Done():
			t.Stop()
			return resp, err
		}
		b.resent.Add(1)
	}
}

// Resent is how many requests this collector sent again after a short Retry-After.
func (b *Bound) Resent() int64 { return b.resent.Load() }

// fetchOnce is one Fetch without the re-sends.
func (b *Bound) fetchOnce(method, rawURL string, body io.Reader, hdr http.Header) (*colly.Response, error) {
	if p := b.Session.Profile; p != nil {
		// The session's client: its headers on every request, a step's own header winning.
		h := hdr.Clone()
		if h == nil {
			h = http.Header{}
		}
		u, _ := url.Parse(rawURL)
		p.ApplyFor(h, u)
		h.Set(profiledHeader, "1") // removed by the collector's OnRequest, never sent
		hdr = h
	}
	cctx := colly.NewContext()
	if err := b.Collector.Request(method, rawURL, body, cctx, hdr); err != nil {
		return nil, classify(err, b.served.Load())
	}
	resp, _ := cctx.GetAny(responseKey).(*colly.Response)
	if resp == nil {
		return nil, &FetchError{Category: "internal", Err: errors.New("colly returned no response")}
	}
	b.served.Store(true)
	if fe := classifyStatus(resp.StatusCode, *resp.Headers, b.cfg.Now()); fe != nil {
		return resp, fe
	}
	return resp, nil
}

// Get is Fetch for a GET without body.
func (b *Bound) Get(rawURL string) (*colly.Response, error) {
	return b.Fetch(http.MethodGet, rawURL, nil, nil)
}

// Bytes is the number of bytes this collector moved through the proxy for the job, as
// they went over the connections to the gateway, both ways: the CONNECT exchange, TLS
// handshakes and records, request and response headers (those the transport adds, such as
// Proxy-Authorization and Host, included) and bodies as sent (compressed, if they were);
// plus the bytes of its renders, counted the same way by the render's forwarder. It is
// what the job is charged for (Result.Bytes, the budgets, the attempt's cost).
//
// Not in it: the proxy's own refusals (RefusedBytes), which providers do not bill, and
// robots.txt fetches, which are the fleet's (politeness.RobotsConfig.OnFetch) — except
// that a tunnel's CONNECT and TLS handshake are the job's even when a robots.txt fetch
// happened to open it.
func (b *Bound) Bytes() int64 { return b.bytes.Load() }

// RobotsBytes is the number of bytes of the robots.txt fetches this collector made for the
// fleet's cache (politeness.RobotsCache), counted on the wire as Bytes is. They are not in
// Bytes: robots.txt is fetched once for the whole fleet, by whichever job first needed it,
// and is no job's cost (docs/OPERATIONS.md, "What an attempt costs").
func (b *Bound) RobotsBytes() int64 { return b.robots.Load() }

// RefusedBytes is the number of bytes of the exchanges the proxy refused (isProxyRefusal:
// 407, 402 with the provider's error header, 502 and the other "no exit" answers), counted
// on the wire as Bytes is, both ways, the request that was refused included. They are not
// in Bytes: a provider bills the traffic it carried to and from an exit, and a refused
// request reached none (docs/OPERATIONS.md, "What an attempt costs").
func (b *Bound) RefusedBytes() int64 { return b.refused.Load() }

// LastStatus is the HTTP status of the last response this collector received — every
// hop counts, redirects and robots.txt included, and a proxy's refusal — or 0 if none.
func (b *Bound) LastStatus() int { return int(b.lastStatus.Load()) }

// overBudget reports whether the run moved more bytes than its cap, once the cap's
// MoreBytes, asked, did not raise it above them.
func (b *Bound) overBudget() bool {
	return b.cfg.budgetSet && b.cfg.run.over()
}

func (b *Bound) budgetError() error {
	return b.cfg.run.cap.exceeded(b.cfg.run.n.Load())
}

// Exit is the exit address the session's responses named in the provider's exit header
// (Provider.WithExitHeader), "" if the provider has none or no response carried it yet.
func (b *Bound) Exit() string {
	b.exitMu.Lock()
	defer b.exitMu.Unlock()
	return b.exit
}

// ExitVerified reports whether the session's exit is checked on every response: the
// provider names an exit header (Provider.WithExitHeader).
func (b *Bound) ExitVerified() bool { return b.Session.exitHeader != "" }

// ErrExitChanged: a session's responses came from another exit than its first one — the
// provider re-assigned the sticky session silently. Category session_lost: the unit
// replays on another session.
var ErrExitChanged = errors.New("sessions: the session's exit changed mid-unit")

// checkExit learns the exit from the session's first response that names one and refuses
// every later response from another exit. A response without the header (a proxy's own
// answer) is not evidence either way.
func (b *Bound) checkExit(h http.Header) error {
	name := b.Session.exitHeader
	if name == "" {
		return nil
	}
	got := sanitizeHeader(strings.TrimSpace(h.Get(name)))
	b.exitMu.Lock()
	defer b.exitMu.Unlock()
	if b.proving {
		return b.proveExit(got) // the first response after a cut (resume.go)
	}
	if got == "" {
		return nil
	}
	switch b.exit {
	case "":
		b.exit = got
		return nil
	case got:
		return nil
	}
	return &FetchError{Category: tasks.CategorySessionLost,
		Err: fmt.Errorf("%w: first response from exit %s, now %s (%s)", ErrExitChanged, b.exit, got, name)}
}

// Close drops the session's tunnels and its hold on the gateway's shared plain-HTTP
// connections (closed once no open Bound uses them). Calling it again does nothing.
func (b *Bound) Close() {
	if !b.closed.CompareAndSwap(false, true) {
		return
	}
	b.tunnelOnce.Do(func() {}) // no tunnel transport after Close
	if b.tunnel != nil {
		b.tunnel.CloseIdleConnections()
	}
	releasePlain(b.plainKey, b.plain)
}

// tunnelTransport returns the session's own transport for HTTPS destinations, made on
// first use: its CONNECT carries the session's credentials, so its tunnels are never
// shared with another session.
func (b *Bound) tunnelTransport() (*http.Transport, error) {
	b.tunnelOnce.Do(func() {
		c := b.cfg
		dialer := &net.Dialer{Timeout: c.DialTimeout, KeepAlive: 30 * time.Second}
		b.tunnel = &http.Transport{
			Proxy:                  http.ProxyURL(&url.URL{Scheme: "http", Host: b.Session.Endpoint}), // no user info, ever
			ProxyConnectHeader:     http.Header{"Proxy-Authorization": {b.Session.proxyAuthorization()}},
			OnProxyConnectResponse: b.onConnectResponse,
			// The tunnel is the session's own: its CONNECT exchange and TLS handshake are the
			// job's bytes, whichever request opened it.
			DialContext: wireDial(dialer, func(ctx context.Context) *wireOwner {
				o := b.job.child()
				if slot, ok := ctx.Value(dialSlotKey{}).(*dialSlot); ok {
					slot.owner.Store(o)
				}
				return o
			}),
			TLSClientConfig:       c.TLSConfig,
			TLSHandshakeTimeout:   DefaultTLSHandshakeTimeout,
			ResponseHeaderTimeout: c.RequestTimeout,
			// Keep-alives stay on (colly's SetProxyFunc turns them off): one session reuses
			// its tunnel. Compression is ours, so the byte count sees wire bytes and the cap
			// sees decompressed ones.
			DisableCompression:  true,
			MaxIdleConnsPerHost: 4,
			IdleConnTimeout:     90 * time.Second,
		}
	})
	if b.tunnel == nil {
		return nil, errCollectorClosed
	}
	return b.tunnel, nil
}

// errCollectorClosed: a request on a Bound after its Close.
var errCollectorClosed = errors.New("sessions: collector used after Close")

// plainKey identifies the shared plain-HTTP transport of a gateway: the settings of the
// transport are part of it, so collectors configured differently never share one.
type plainKey struct {
	endpoint     string
	dial, header time.Duration
}

// plainTransport is a gateway's forwarding transport for plain-HTTP destinations,
// shared by every open Bound of that gateway. It carries no credentials: exchange adds
// the session's Proxy-Authorization to each request, and a forwarding proxy
// authenticates (and picks the session's exit for) every request on its own.
type plainTransport struct {
	t    *http.Transport
	refs int
}

var (
	plainMu sync.Mutex
	plains  = map[plainKey]*plainTransport{}
)

// plainIdlePerGateway is how many idle kept-alive connections a gateway's shared
// transport keeps: about a worker's concurrency.
const plainIdlePerGateway = 64

func acquirePlain(k plainKey) *plainTransport {
	plainMu.Lock()
	defer plainMu.Unlock()
	p := plains[k]
	if p == nil {
		p = &plainTransport{t: newPlainTransport(k, plainIdlePerGateway)}
		plains[k] = p
	}
	p.refs++
	return p
}

// newPlainTransport returns a forwarding transport to the gateway of k that keeps up to
// idle idle connections.
func newPlainTransport(k plainKey, idle int) *http.Transport {
	dialer := &net.Dialer{Timeout: k.dial, KeepAlive: 30 * time.Second}
	return &http.Transport{
		Proxy: http.ProxyURL(&url.URL{Scheme: "http", Host: k.endpoint}), // no user info, ever
		// Shared by sessions: a connection's bytes are charged to the request using it
		// (exchange's GotConn); dialing one moves none.
		DialContext:           wireDial(dialer, ownerOf),
		ResponseHeaderTimeout: k.header,
		DisableCompression:    true, // see tunnelTransport
		MaxIdleConns:          idle,
		MaxIdleConnsPerHost:   idle,
		IdleConnTimeout:       90 * time.Second,
	}
}

// releasePlain drops one hold on p; the last one closes its idle connections and
// forgets it, so nothing outlives the collectors that used it.
func releasePlain(k plainKey, p *plainTransport) {
	plainMu.Lock()
	defer plainMu.Unlock()
	if p.refs--; p.refs > 0 {
		return
	}
	if plains[k] == p {
		delete(plains, k)
	}
	p.t.CloseIdleConnections()
}

func (b *Bound) onConnectResponse(ctx context.Context, _ *url.URL, _ *http.Request, res *http.Response) error {
	b.lastStatus.Store(int32(res.StatusCode))
	if res.StatusCode == http.StatusOK {
		return nil
	}
	drainRefusal(res)
	// The dial's bytes — the CONNECT and its refusal — are the proxy's refusal, not the
	// job's traffic (ctx is the dial's, with the values of the request that caused it).
	if slot, ok := ctx.Value(dialSlotKey{}).(*dialSlot); ok {
		if o := slot.owner.Load(); o != nil {
			o.refuse(b.refusals)
		}
	}
	return &proxyStatusError{status: res.StatusCode, header: res.Header.Clone()}
}

// dialSlot receives the owner of the tunnel a request's dial opens, so that a refused
// CONNECT's bytes can be told apart (onConnectResponse).
type dialSlot struct{ owner atomic.Pointer[wireOwner] }

type dialSlotKey struct{}

// refusalDrainWait bounds how long drainRefusal waits for a refusal's body.
const refusalDrainWait = 2 * time.Second

// drainRefusal reads the short body of a proxy's refusal of a CONNECT (a 407's text), as
// a forwarding proxy's refusal is read: the gateway sent it and bills it, and the
// transport would close the connection with it unread, so the wire count would miss it.
// A body that does not come within refusalDrainWait is left: the transport's close of
// the connection then ends the read.
func drainRefusal(res *http.Response) {
	if res.Body == nil || res.ContentLength < 0 || res.ContentLength > 4096 {
		return
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = io.Copy(io.Discard, res.Body)
	}()
	t := time.NewTimer(refusalDrainWait)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	}
}

// sessionTransport is the RoundTripper of a bound collector. Every hop — redirects and
// robots.txt included — passes the SSRF guard, carries the session's proxy credentials in
// a header only the proxy sees, and is counted and capped.
type sessionTransport struct {
	bound *Bound
}

func (t *sessionTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	b := t.bound
	if req.Body != nil {
		defer req.Body.Close()
	}
	ctx := req.Context()
	if err := b.cfg.Guard.Check(ctx, req.URL.String()); err != nil {
		return nil, err
	}
	if b.overBudget() {
		return nil, b.budgetError()
	}
	if err := b.polite(ctx, req.URL); err != nil {
		return nil, err
	}
	return b.exchange(req, &b.bytes, true)
}

// polite holds a request to u back as politeness asks: robots.txt first (unless ignored),
// then the host's slot.
func (b *Bound) polite(ctx context.Context, u *url.URL) error {
	if b.cfg.Robots != nil && !b.cfg.IgnoreRobotsTxt {
		if err := b.cfg.Robots.Check(ctx, robotsVia{b}, u); err != nil {
			return err
		}
	}
	return b.waitHost(ctx, u)
}

// waitHost waits for u's host slot (CollectorConfig.Limiter), if there is a limiter.
func (b *Bound) waitHost(ctx context.Context, u *url.URL) error {
	if b.cfg.Limiter == nil {
		return nil
	}
	return b.cfg.Limiter.Wait(ctx, politeness.HostKey(u))
}

// robotsVia is the session a politeness.RobotsCache fetches robots.txt through: the
// collector whose request needed it.
type robotsVia struct{ b *Bound }

// UserAgent is the product token robots.txt groups are matched with: the collector's
// (idemscrape's own by default), whatever client profile the session presents — a site's
// rules for this bot hold with a browser profile too.
func (v robotsVia) UserAgent() string      { return v.b.cfg.UserAgent }
func (v robotsVia) Timeout() time.Duration { return v.b.cfg.RequestTimeout }
func (v robotsVia) Fail(err error) error   { return classify(err, v.b.served.Load()) }

// Get sends one robots.txt hop as every hop goes — guard, host limit, exit check — with
// its bytes in moved, not the job's; the body ends at the size cap instead of failing.
func (v robotsVia) Get(ctx context.Context, target string, moved *atomic.Int64) (*http.Response, error) {
	b := v.b
	if err := b.cfg.Guard.Check(ctx, target); err != nil {
		return nil, v.Fail(err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
	if err != nil {
		return nil, v.Fail(err)
	}
	if err := b.waitHost(ctx, req.URL); err != nil {
		return nil, v.Fail(err)
	}
	ua := b.cfg.UserAgent
	if p := b.Session.Profile; p != nil {
		ua = p.UserAgent // the fetch looks like the session's other requests
	}
	req.Header.Set("User-Agent", ua)
	res, err := b.exchange(req, moved, false)
	if err != nil {
		return nil, v.Fail(err)
	}
	b.served.Store(true)
	res.Body = capIsEOF{res.Body}
	return res, nil
}

// capIsEOF ends a body at the size cap (ErrBodyTooLarge) as if it were its end.
type capIsEOF struct{ io.ReadCloser }

func (c capIsEOF) Read(p []byte) (int, error) {
	n, err := c.ReadCloser.Read(p)
	if errors.Is(err, ErrBodyTooLarge) {
		err = io.EOF
	}
	return n, err
}

// exchange sends req through the session's proxy and returns the response with a capped,
// decompressed body. The bytes of the connection it runs on — from when the transport hands
// it over until the next request takes it — go to counter; job says it is the job's
// traffic (counter is b.bytes and the budget applies) rather than the fleet's (robots.txt).
// It checks the exit and tells the limiter of a Retry-After.
func (b *Bound) exchange(req *http.Request, counter *atomic.Int64, job bool) (*http.Response, error) {
	if b.closed.Load() {
		// Its connections are (being) closed: a new one would outlive the collector.
		return nil, errCollectorClosed
	}
	// This exchange's own owner, under the job's (or the fleet's counter for robots.txt),
	// so that a refusal's bytes can be taken out of the job's.
	owner := b.job.child()
	if !job {
		owner = &wireOwner{n: counter, sent: new(atomic.Int64), up: b.robotsOwn}
	}
	// An HTTP/1 connection serves one request at a time (neither transport speaks HTTP/2:
	// both set DialContext and not ForceAttemptHTTP2), so the request that got it owns its
	// bytes until the next one gets it.
	ctx := context.WithValue(req.Context(), wireOwnerKey{}, owner)
	ctx = context.WithValue(ctx, dialSlotKey{}, &dialSlot{})
	ctx = httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		GotConn: func(info httptrace.GotConnInfo) {
			if wc := asWireConn(info.Conn); wc != nil {
				wc.owner.Store(owner)
			}
		},
	})
	out := req.Clone(ctx)
	var rt http.RoundTripper
	switch req.URL.Scheme {
	case "http":
		// Plain HTTP is forwarded by the proxy, which reads this header. Never set it on
		// HTTPS requests: those travel inside the CONNECT tunnel to the destination, which
		// must not see it (the CONNECT carries it instead).
		out.Header.Set("Proxy-Authorization", b.Session.proxyAuthorization())
		rt = b.plain.t
	case "https":
		t, err := b.tunnelTransport()
		if err != nil {
			return nil, err
		}
		rt = t
	default:
		return nil, fmt.Errorf("sessions: scheme %q not allowed", req.URL.Scheme)
	}
	if out.Header.Get("Accept-Encoding") == "" {
		// The session's browser's (a profile's "gzip, deflate, br, zstd"), or gzip: each
		// is decoded below, under the body cap (the transports' own decompression is off).
		out.Header.Set("Accept-Encoding", acceptEncoding(b.Session, req.URL))
	}
	res, err := rt.RoundTrip(out)
	if err != nil {
		if job && b.overBudget() {
			return nil, b.budgetError() // the connection ended the read at the budget
		}
		return nil, err
	}
	// The response must point at the caller's request, not our copy that carries the
	// credentials: colly takes the response's request as the final one and exposes its
	// headers to every callback.
	res.Request = req
	b.lastStatus.Store(int32(res.StatusCode))
	if req.URL.Scheme == "http" && isProxyRefusal(res) {
		_, _ = io.Copy(io.Discard, io.LimitReader(res.Body, 4096))
		res.Body.Close()
		if job {
			owner.refuse(b.refusals)
		}
		return nil, &proxyStatusError{status: res.StatusCode, header: res.Header.Clone()}
	}
	if err := b.checkExit(res.Header); err != nil {
		res.Body.Close()
		return nil, err
	}
	if b.cfg.Limiter != nil && (res.StatusCode == http.StatusTooManyRequests || res.StatusCode == http.StatusServiceUnavailable) {
		if d := retryAfter(res.Header.Get("Retry-After"), b.cfg.Now()); d > 0 {
			b.cfg.Limiter.Pause(req.Context(), politeness.HostKey(req.URL), d)
		}
	}
	var body io.Reader = res.Body
	if job && b.cfg.budgetSet {
		body = &budgetReader{r: res.Body, bound: b}
	}
	// gzip, deflate, br, zstd: decoded here, so that the cap below counts decompressed
	// bytes (a bomb of any coding fails body_too_large) and the wire count compressed ones.
	var closer io.Closer = res.Body
	decoded, release, ok, err := decodeBody(res.Header, body)
	if err != nil {
		res.Body.Close()
		return nil, err
	}
	if ok {
		body = decoded
		closer = releaseCloser{release: release, c: res.Body}
		res.Header.Del("Content-Encoding")
		res.Header.Del("Content-Length")
		res.ContentLength = -1
	}
	// Uncompressed tells colly not to decompress again (its gunzip has no limit).
	res.Uncompressed = true
	res.Body = &cappedBody{r: body, left: b.cfg.MaxBodyBytes, limit: b.cfg.MaxBodyBytes, closer: closer}
	return res, nil
}

// releaseCloser closes a decoded body: its decoders, then the response's body.
type releaseCloser struct {
	release func()
	c       io.Closer
}

func (r releaseCloser) Close() error {
	r.release()
	return r.c.Close()
}

// isProxyRefusal tells a forwarding proxy's own refusal from a destination's answer: 407
// is always the proxy's; 502/522/525 are what providers send when the exit is gone or
// unavailable (a destination's own 502 is then retried on a new session, which is
// harmless).
func isProxyRefusal(res *http.Response) bool {
	switch res.StatusCode {
	case http.StatusProxyAuthRequired, http.StatusBadGateway, 522, 525:
		return true
	case http.StatusPaymentRequired:
		// The provider's "no balance" carries its error header; a shop's own 402 (a
		// paywall) does not.
		return providerErrorCode(res.Header) != ""
	}
	return providerErrorCode(res.Header) != "" && res.StatusCode >= 500
}

// budgetReader ends the read of a job's response with the budget error once the run's
// wire bytes exceed its cap (and MoreBytes did not raise it). The connection (wireConn)
// counts the bytes and reads at most one byte past the cap, so the abort comes at the cap
// and not a socket buffer later.
type budgetReader struct {
	r     io.Reader
	bound *Bound
}

func (c *budgetReader) Read(p []byte) (int, error) {
	if c.bound.overBudget() {
		return 0, c.bound.budgetError()
	}
	n, err := c.r.Read(p)
	if c.bound.overBudget() {
		return n, c.bound.budgetError()
	}
	return n, err
}

// wireOwner is whom a connection's bytes are charged to: one exchange (a request and its
// answer, a tunnel's dial, a render), which charges every owner above it too, up to the
// job's (Bound.job) or the fleet's (robots.txt).
type wireOwner struct {
	n    *atomic.Int64 // both ways
	sent *atomic.Int64 // written only; nil: not kept apart
	// cap: reads are cut so that n goes at most one byte past it, unless the cap is raised
	// then (byteCap.raise); nil: no cap. The first owner up the chain with a cap sets the
	// limit.
	cap *byteCap
	up  *wireOwner
	// moved: the owner's bytes were refused (refuse); what it moves from now on goes there.
	moved atomic.Pointer[wireOwner]
}

// child is a new owner whose bytes are o's too.
func (o *wireOwner) child() *wireOwner {
	return &wireOwner{n: new(atomic.Int64), sent: new(atomic.Int64), up: o}
}

// add charges n bytes to o and every owner above it (to the one o's bytes were moved to,
// once refused); written: this side wrote them.
func (o *wireOwner) add(n int64, written bool) {
	if m := o.moved.Load(); m != nil {
		o = m
	}
	for ; o != nil; o = o.up {
		o.n.Add(n)
		if written && o.sent != nil {
			o.sent.Add(n)
		}
	}
}

// capped is the first owner up the chain with a cap (o's, or the one o's bytes were moved
// to, once refused), nil if none.
func (o *wireOwner) capped() *wireOwner {
	if o == nil {
		return nil
	}
	if m := o.moved.Load(); m != nil {
		o = m
	}
	for ; o != nil; o = o.up {
		if o.cap != nil {
			return o
		}
	}
	return nil
}

// left is how many bytes the first cap up the chain still allows; ok is false when there
// is none.
func (o *wireOwner) left() (n int64, ok bool) {
	if c := o.capped(); c != nil {
		return c.cap.max.Load() - c.n.Load(), true
	}
	return 0, false
}

// over reports whether the first owner up the chain with a cap moved more than it, once
// asked to raise it (byteCap.raise), or was stopped.
func (o *wireOwner) over() bool {
	c := o.capped()
	if c == nil {
		return false
	}
	if c.cap.stopped.Load() {
		return true
	}
	if c.n.Load() <= c.cap.max.Load() {
		return false
	}
	return !c.cap.raise(c.n.Load)
}

// refuse moves what o moved so far, and what it moves from now on, out of the owners above
// it and into to: the exchange was the proxy's refusal, which is not the job's traffic.
func (o *wireOwner) refuse(to *wireOwner) {
	if !o.moved.CompareAndSwap(nil, to) {
		return
	}
	n, sent := o.n.Swap(0), o.sent.Swap(0)
	for p := o.up; p != nil; p = p.up {
		p.n.Add(-n)
		if p.sent != nil {
			p.sent.Add(-sent)
		}
	}
	to.add(n-sent, false)
	to.add(sent, true)
}

// wireOwnerKey carries the *wireOwner of a request in its context, which the transport's
// dial context keeps.
type wireOwnerKey struct{}

// ownerOf is the owner a request's context names, nil if none.
func ownerOf(ctx context.Context) *wireOwner {
	o, _ := ctx.Value(wireOwnerKey{}).(*wireOwner)
	return o
}

// wireDial dials the gateway with d and counts the connection's bytes; owner names who
// pays for the bytes moved before a request gets the connection (the CONNECT exchange
// and TLS handshake).
func wireDial(d *net.Dialer, owner func(context.Context) *wireOwner) func(context.Context, string, string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		wc := &wireConn{Conn: c}
		wc.owner.Store(owner(ctx))
		return wc, nil
	}
}

// wireConn counts every byte read from and written to a connection to the gateway into
// its current owner: what the proxy bills, as no estimate of headers can.
type wireConn struct {
	net.Conn
	owner atomic.Pointer[wireOwner]
	// held are bytes a read returned past the cap of the owner they arrived for (see
	// Read): not counted yet, the next reads return them first. heldErr is the error
	// that read returned with them. Only Read uses them (a connection has one reader).
	held    []byte
	heldErr error
}

// asWireConn finds the wireConn under c (a TLS connection inside a CONNECT tunnel wraps
// it), nil if there is none.
func asWireConn(c net.Conn) *wireConn {
	for c != nil {
		switch v := c.(type) {
		case *wireConn:
			return v
		case interface{ NetConn() net.Conn }:
			c = v.NetConn()
		default:
			return nil
		}
	}
	return nil
}

// Read reads at most one byte past the cap of the connection's owner, counting what it
// returns into the owner.
//
// The cap is applied twice: to the size of the read before it starts, and to what it
// returned, with the owner the bytes arrived for. The read may have started for another
// owner, with that one's room: an idle kept-alive connection's read, started for the last
// request (of another run, perhaps without a cap: a whole 4 KiB buffer), returns the next
// request's response; and other connections of the run move bytes while it waits. What
// arrived past the cap is held, uncounted, and returned by the next reads, each of which
// asks the cap (RunConfig.MoreBytes) first; if it is not raised, the held bytes are never
// counted, as bytes still in the socket's buffer are not.
func (c *wireConn) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return c.Conn.Read(p)
	}
	for {
		q := p
		if left, ok := c.owner.Load().left(); ok {
			// Past the cap: the run's MoreBytes may raise it (a top-up of its money). Other
			// connections of the run (a render's, parallel requests) read meanwhile, so the
			// raised cap may be passed again before this read: ask until it holds.
			for left < 0 {
				if c.owner.Load().over() {
					// Spent: reading on (a TLS record needs all of its bytes before any reach
					// the reader) would only move more. The connection is dropped.
					return 0, ErrBudgetExceeded
				}
				left, _ = c.owner.Load().left()
			}
			if int64(len(q)) > left+1 {
				q = q[:left+1]
			}
		}
		var (
			n   int
			err error
		)
		if len(c.held) > 0 {
			n = copy(q, c.held)
			if c.held = c.held[n:]; len(c.held) == 0 {
				c.held, err, c.heldErr = nil, c.heldErr, nil
			}
		} else {
			n, err = c.Conn.Read(q)
		}
		// The owner when the bytes arrived: an idle connection's read, started for the last
		// request, returns the next one's response.
		o := c.owner.Load()
		if left, ok := o.left(); ok && n > 0 && int64(n) > left+1 {
			keep := int(max(left+1, 0))
			c.held = append(append([]byte(nil), q[keep:n]...), c.held...)
			if err != nil {
				c.heldErr = err
			}
			n, err = keep, nil
			if n == 0 {
				continue // asks the cap first
			}
		}
		if o != nil && n > 0 {
			o.add(int64(n), false)
		}
		return n, err
	}
}

// Write counts p before it is sent, and takes back what was not: the answer to a request
// may be read (and the exchange settled, refused) before the writing goroutine would
// count bytes it had already sent.
// A write is not cut at the cap (the read of its answer is, asking MoreBytes first): a
// request refused before it is sent would leave what is left of a money budget unspent
// for ever, each attempt granted it stopping without a byte.
func (c *wireConn) Write(p []byte) (int, error) {
	o := c.owner.Load()
	if o != nil && len(p) > 0 {
		o.add(int64(len(p)), true)
	}
	n, err := c.Conn.Write(p)
	if o != nil && n < len(p) {
		o.add(int64(n-len(p)), true)
	}
	return n, err
}

// ErrBudgetExceeded: the run moved more bytes than its cap — RunConfig.MaxBytes (the
// job's bandwidth budget, or the bytes its money budgets buy: RunConfig.BudgetNote), as
// RunConfig.MoreBytes last raised it; the response being read was aborted (category
// budget_exceeded).
var ErrBudgetExceeded = errors.New("sessions: byte budget exceeded")

// byteCap is a run's byte cap: one value for all of the run's sessions, so a replayed
// unit's new session goes on from what the earlier ones moved, and a raise reaches every
// connection of the run (collector fetches and renders alike: both count at wireConn).
type byteCap struct {
	ctx context.Context
	max atomic.Int64
	// more is RunConfig.MoreBytes; nil: the cap is fixed.
	more func(ctx context.Context, moved int64) (newMax int64, note string)
	// mu serialises more, and guards what follows.
	mu sync.Mutex
	// note is what the cap stands for (RunConfig.BudgetNote, or more's last word).
	note string
	// done: more said stop, or the run ended; more is not asked again.
	done bool
	// stopped: the run passed the cap and it was not raised: the run is over budget from
	// then on.
	stopped atomic.Bool
}

// runOwner is a run's owner of bytes, above each of its sessions' (CollectorConfig.run),
// with its cap.
func runOwner(ctx context.Context, maxBytes int64, note string, more func(context.Context, int64) (int64, string)) *wireOwner {
	c := &byteCap{ctx: ctx, more: more, note: note}
	c.max.Store(maxBytes)
	return &wireOwner{n: new(atomic.Int64), cap: c}
}

// raise asks more for a higher cap once the run's bytes (moved, read at the call: calls
// wait for each other) passed it. It reports whether the cap is now at or above them:
// raised by this call or by another meanwhile. Not raised, the run is stopped.
func (c *byteCap) raise(moved func() int64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := moved()
	if c.stopped.Load() {
		return false
	}
	if n <= c.max.Load() {
		return true
	}
	if c.done || c.more == nil {
		c.stopped.Store(true)
		return false
	}
	newMax, note := c.more(c.ctx, n)
	if note != "" {
		c.note = note
	}
	if newMax <= n {
		c.done = true
		c.stopped.Store(true)
		return false
	}
	c.max.Store(newMax)
	return true
}

// end stops asking more: the run is over (an idle connection's late read must not buy
// anything).
func (c *byteCap) end() {
	c.mu.Lock()
	c.done = true
	c.mu.Unlock()
}

func (c *byteCap) exceeded(moved int64) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return &budgetExceededError{moved: moved, budget: c.max.Load(), note: c.note}
}

// budgetExceededError says how much was moved against which budget; errors.Is(err,
// ErrBudgetExceeded) holds.
type budgetExceededError struct {
	moved, budget int64
	note          string // what the byte budget stands for, "" for the bandwidth budget
}

func (e *budgetExceededError) Error() string {
	msg := fmt.Sprintf("%v: the run moved %d bytes of a cap of %d", ErrBudgetExceeded, e.moved, e.budget)
	if e.note != "" {
		msg += " (" + e.note + ")"
	}
	return msg
}

func (e *budgetExceededError) Is(target error) bool { return target == ErrBudgetExceeded }

// cappedBody fails with ErrBodyTooLarge once more than left bytes were read.
type cappedBody struct {
	r      io.Reader
	left   int64
	limit  int64
	closer io.Closer
}

func (c *cappedBody) Read(p []byte) (int, error) {
	if c.left < 0 {
		return 0, &bodyTooLargeError{limit: c.limit}
	}
	if int64(len(p)) > c.left+1 {
		p = p[:c.left+1]
	}
	n, err := c.r.Read(p)
	c.left -= int64(n)
	if c.left < 0 {
		return n + int(c.left), &bodyTooLargeError{limit: c.limit}
	}
	return n, err
}

// bodyTooLargeError names the cap; errors.Is(err, ErrBodyTooLarge) holds.
type bodyTooLargeError struct{ limit int64 }

func (e *bodyTooLargeError) Error() string {
	return fmt.Sprintf("%v: more than %d bytes (after decompression); raise CollectorConfig.MaxBodyBytes if the page is legitimately this large", ErrBodyTooLarge, e.limit)
}

func (e *bodyTooLargeError) Is(target error) bool { return target == ErrBodyTooLarge }

func (c *cappedBody) Close() error { return c.closer.Close() }
