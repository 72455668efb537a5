package sessions

import (
	"context"
	"errors"
	"fmt"
	"go.opentelemetry.io/otel/attribute"
	"iter"
	"net/http"
	"net/url"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/emulation"
	"github.com/chromedp/cdproto/fetch"
	"github.com/chromedp/cdproto/inspector"
	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/cdproto/target"
	"github.com/chromedp/chromedp"

	"github.com/idemscrape/idemscrape/tasks"
)

// RenderOptions configure one render (StepContext.Render).
type RenderOptions struct {
	// WaitFor is a CSS selector the render waits for (visible) before it reads the page:
	// the element the page's JavaScript fills. "" reads the page once it has loaded.
	WaitFor string
	// Capture lists substrings of the URLs of XHR/fetch responses whose bodies the render
	// returns (Rendered.Captured), e.g. "/api/price/".
	Capture []string
	// AllowResources lists resource types to load although the pool blocks them ("Image",
	// "Media", "Font", unless BrowserConfig.LoadResources allows them for every render).
	AllowResources []string
	// Timeout bounds the render. Defaults to the pool's BrowserConfig.RenderTimeout.
	Timeout time.Duration
}

// Captured is one XHR/fetch response a render captured (RenderOptions.Capture).
type Captured struct {
	URL    string `json:"url"`
	Status int    `json:"status"`
	Body   []byte `json:"body"`
}

// Rendered is what a render saw.
type Rendered struct {
	URL      string     // the document's final URL
	Status   int        // the document's HTTP status
	HTML     string     // the DOM after the page's JavaScript ran (document.documentElement.outerHTML)
	Captured []Captured // the captured XHR/fetch responses, in the order they finished
	Bytes    int64      // bytes the render moved through the proxy (also in Bound.Bytes)
	Requests int        // requests the page made that were let through
	// Refused counts the page's requests the destination guard refused (loopback,
	// private, metadata addresses, ports outside the policy; checked again by the render's
	// proxy), and the WebSockets, WebTransport sessions, WebRTC peer connections, workers
	// and service workers it tried to open (a render allows none): none reached the proxy.
	Refused int
	// Skipped counts the requests for blocked resource types (images, media, fonts).
	Skipped int
}

// ErrNoBrowsers: a step rendered on a collector without a browser pool
// (CollectorConfig.Browsers).
var ErrNoBrowsers = errors.New("sessions: Render needs a browser pool (CollectorConfig.Browsers, handlers.Config.Browsers)")

// ErrNoChromium: NewBrowserPool found no Chromium to run (no ExecPath, no
// $IDEMSCRAPE_CHROMIUM, none on PATH).
var ErrNoChromium = errors.New("sessions: browser pool: no Chromium found")

// Render loads rawURL in a fresh Chromium browser context of the pool, through the step's
// session: the same proxy gateway and sticky username as the step's colly requests, on
// every request and CONNECT whether the gateway challenges or not (a loopback forwarder of
// the render's adds them; Chromium never holds them), the same cookies both ways. Every
// request the page makes passes the destination guard (refused ones fail in the browser
// and are counted); WebRTC is refused (counted too); the page's own navigation passes
// robots.txt and the host rate limit. Images, media and fonts are not loaded unless
// allowed. Every byte counts toward the attempt's budget, which stops the render mid-way
// (budget_exceeded). A network failure of the session (the device dropped) or a Chromium
// that died is session_lost: the unit replays on another session.
func (sc *StepContext) Render(rawURL string, o RenderOptions) (*Rendered, error) {
	return sc.bound.Render(rawURL, o)
}

// Render is StepContext.Render.
func (b *Bound) Render(rawURL string, o RenderOptions) (_ *Rendered, rerr error) {
	pool := b.cfg.Browsers
	if pool == nil {
		return nil, &FetchError{Category: tasks.CategoryInternal, Err: ErrNoBrowsers}
	}
	ctx := b.ctx
	u, err := url.Parse(rawURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") {
		return nil, &FetchError{Category: tasks.CategoryValidation, Err: fmt.Errorf("sessions: render %q: not an http(s) URL", rawURL)}
	}
	if err := b.cfg.Guard.Check(ctx, rawURL); err != nil {
		return nil, classify(err, b.served.Load())
	}
	if b.overBudget() {
		return nil, classify(b.budgetError(), b.served.Load())
	}
	if err := b.polite(ctx, u); err != nil {
		return nil, classify(err, b.served.Load())
	}
	timeout := o.Timeout
	if timeout <= 0 {
		timeout = pool.cfg.RenderTimeout
	}
	rctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	br, release, err := pool.acquire(rctx)
	if err != nil {
		return nil, renderError(rctx, err, false)
	}
	defer release()
	r := &render{b: b, o: o, pool: pool, page: rawURL, rendered: &Rendered{}, ids: map[network.RequestID]*renderReq{},
		wire: b.job.child()}
	_, span := startSpan(b.spanContext(), "render")
	defer func() {
		if !span.IsRecording() {
			return
		}
		span.SetAttributes(attribute.String("url.full", spanURL(rawURL)), attribute.String("idemscrape.session", b.Session.ID),
			attribute.Int64("idemscrape.bytes", r.bytesTotal()), attribute.Int("idemscrape.render.requests", r.rendered.Requests),
			attribute.Int("idemscrape.render.refused", r.rendered.Refused))
		if r.rendered.Status != 0 {
			span.SetAttributes(attribute.Int("http.response.status_code", r.rendered.Status))
		}
		var fe *FetchError
		if rerr != nil && !errors.As(rerr, &fe) {
			fe = &FetchError{Category: tasks.CategoryInternal, Err: rerr}
		}
		endSpan(span, fe)
	}()
	res, err := r.run(rctx, br) // its bytes are in b.bytes already, as they moved
	if res != nil {
		res.Bytes = r.bytesTotal()
	}
	if err != nil {
		if stop := r.stopped(); stop != nil {
			return nil, stop // the halt's reason, not the cancelled command's
		}
		var exit *exec.ExitError
		if br.gone() || errors.As(err, &exit) || errors.Is(err, chromedp.ErrChannelClosed) {
			// Chromium went away under the render: a lost session, not the worker's crash.
			return nil, &FetchError{Category: tasks.CategorySessionLost, Err: fmt.Errorf("sessions: render: the browser process ended: %w", err)}
		}
		return nil, renderError(rctx, err, r.lostSession())
	}
	b.served.Store(true)
	if res.Status != 0 {
		b.lastStatus.Store(int32(res.Status))
	}
	if isProxyRefusal(&http.Response{StatusCode: res.Status, Header: r.docHeader}) {
		// The proxy's own answer (407, 402 with its error header, 502 no peers), not the
		// destination's: classified as colly's path classifies it.
		return nil, classify(&proxyStatusError{status: res.Status, header: r.docHeader}, b.served.Load())
	}
	if fe := classifyStatus(res.Status, r.docHeader, b.cfg.Now()); fe != nil {
		return res, fe
	}
	return res, nil
}

// renderError classifies a render's failure.
func renderError(ctx context.Context, err error, lost bool) error {
	var fe *FetchError
	switch {
	case errors.As(err, &fe):
		return fe
	case lost:
		return &FetchError{Category: tasks.CategorySessionLost, Err: fmt.Errorf("sessions: render: %w", err)}
	case ctx.Err() != nil && errors.Is(context.Cause(ctx), context.DeadlineExceeded):
		return &FetchError{Category: tasks.CategoryTimeout, Err: fmt.Errorf("sessions: render: %w", err)}
	case ctx.Err() != nil:
		return &FetchError{Category: tasks.CategoryInterrupted, Err: fmt.Errorf("sessions: render: %w", context.Cause(ctx))}
	}
	return &FetchError{Category: tasks.CategoryInternal, Err: fmt.Errorf("sessions: render: %w", err)}
}

// render is one Render's state: the requests the page made, their bytes, what failed.
type render struct {
	b         *Bound
	o         RenderOptions
	pool      *BrowserPool
	page      string      // the URL asked for
	docHeader http.Header // the document's response headers
	rendered  *Rendered

	wire *wireOwner // the render's bytes, counted by its forwarder on the gateway connections

	mu       sync.Mutex
	ids      map[network.RequestID]*renderReq
	lost     error        // a network failure of the session
	budget   error        // the attempt's budget ran out
	authFail int          // proxy authentication challenges answered without success
	fwd      *renderProxy // the render's own proxy in front of the session's gateway
	stop     chan struct{}
	stopOnce sync.Once
	changed  chan struct{} // a request finished or failed (buffered 1)
}

// renderReq is one request of the page.
type renderReq struct {
	url     string
	typ     network.ResourceType
	status  int
	capture bool
	done    bool
}

// bytesTotal is the render's bytes so far: what its forwarder exchanged with the gateway,
// both ways, the gateway's refusals apart (Bound.Bytes counts them as they move).
func (r *render) bytesTotal() int64 { return r.wire.n.Load() }

func (r *render) lostSession() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.lost != nil
}

// cdpHeader turns CDP's headers into an http.Header.
func cdpHeader(h network.Headers) http.Header {
	out := http.Header{}
	for k, v := range h {
		out.Set(k, fmt.Sprint(v))
	}
	return out
}

// sameOrigin reports whether two URLs share scheme and host[:port].
func sameOrigin(a, b string) bool {
	ua, err1 := url.Parse(a)
	ub, err2 := url.Parse(b)
	return err1 == nil && err2 == nil && ua.Scheme == ub.Scheme && strings.EqualFold(ua.Host, ub.Host)
}

// signal tells settle that a request ended.
func (r *render) signal() {
	select {
	case r.changed <- struct{}{}:
	default:
	}
}

// renderSettleMax bounds how long a render waits, once its page is ready, for the
// requests still loading.
const renderSettleMax = 5 * time.Second

// settle waits until every request the page made has finished or failed (at most
// renderSettleMax): a response still loading is paid for all the same (its forwarder
// counts what moved until the tab closes) and a captured one can only be read once it
// has finished.
func (r *render) settle(ctx context.Context) {
	t := time.NewTimer(renderSettleMax)
	defer t.Stop()
	for {
		r.mu.Lock()
		pending := 0
		for _, q := range r.ids {
			if !q.done {
				pending++
			}
		}
		r.mu.Unlock()
		if pending == 0 {
			return
		}
		select {
		case <-r.changed:
		case <-t.C:
			return
		case <-ctx.Done():
			return
		case <-r.stop:
			return
		}
	}
}

// halt ends the render early (budget spent, session lost).
func (r *render) halt() { r.stopOnce.Do(func() { close(r.stop) }) }

// sessionErrors are Chromium's net errors that mean the proxy or the device went away.
var sessionErrors = []string{"ERR_EMPTY_RESPONSE", "ERR_CONNECTION_CLOSED", "ERR_CONNECTION_RESET",
	"ERR_TUNNEL_CONNECTION_FAILED", "ERR_PROXY_CONNECTION_FAILED", "ERR_INCOMPLETE_CHUNKED_ENCODING",
	"ERR_CONTENT_LENGTH_MISMATCH", "ERR_CONNECTION_REFUSED", "ERR_SOCKET_NOT_CONNECTED"}

// listen is the ordered listener of the page's network events: it runs on the tab's
// message loop, so it only records (no command).
func (r *render) listen(ev any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch ev := ev.(type) {
	case *network.EventRequestWillBeSent:
		q := r.ids[ev.RequestID]
		if q == nil {
			q = &renderReq{}
			r.ids[ev.RequestID] = q
		}
		q.url, q.typ = ev.Request.URL, ev.Type
	case *runtime.EventBindingCalled:
		if ev.Name == refusedBinding { // a WebSocket, WebTransport, WebRTC peer connection, worker or service worker refused
			r.rendered.Refused++
		}
	case *network.EventResponseReceived:
		if ev.Response != nil && r.b.Session.exitHeader != "" {
			// The exit-integrity check of colly's path, on every response of the page: a
			// silently re-assigned exit is a lost session.
			if err := r.b.checkExit(cdpHeader(ev.Response.Headers)); err != nil && r.lost == nil {
				r.lost = err
				go r.halt()
			}
		}
		if q := r.ids[ev.RequestID]; q != nil && ev.Response != nil {
			q.status = int(ev.Response.Status)
			if ev.Type == network.ResourceTypeXHR || ev.Type == network.ResourceTypeFetch {
				for _, c := range r.o.Capture {
					if strings.Contains(ev.Response.URL, c) {
						q.capture = true
					}
				}
			}
		}
	case *network.EventDataReceived:
		// Bytes arrived: the budget check below sees them (the forwarder's wire count).
	case *network.EventLoadingFinished:
		if q := r.ids[ev.RequestID]; q != nil {
			q.done = true
		}
		r.signal()
	case *inspector.EventTargetCrashed:
		// The tab's renderer died (out of memory, a crash): a lost session.
		if r.lost == nil {
			r.lost = errors.New("the page's renderer crashed")
		}
		go r.halt()
	case *network.EventLoadingFailed:
		q := r.ids[ev.RequestID]
		if q != nil {
			q.done = true
		}
		r.signal()
		// The page's own requests only: a third-party script that can not be reached says
		// nothing about the session.
		own := q != nil && (q.typ == network.ResourceTypeDocument || sameOrigin(q.url, r.page))
		if own && ev.BlockedReason == "" && !ev.Canceled && ev.ErrorText != "" && slices.ContainsFunc(sessionErrors, func(s string) bool { return strings.Contains(ev.ErrorText, s) }) {
			if r.lost == nil {
				r.lost = fmt.Errorf("request failed: %s", ev.ErrorText)
			}
			go r.halt()
		}
	default:
		return
	}
	if b := r.b; b.cfg.budgetSet {
		if b.overBudget() && r.budget == nil {
			r.budget = b.budgetError()
			go r.halt()
		}
	}
}

// refusedBinding is the function noSocketsNoWorkers calls for each refusal.
const refusedBinding = "__idemscrapeRefused"

// noSocketsNoWorkers runs before a page's own scripts, in every frame: opening a WebSocket
// (WebSocket, WebSocketStream) or a WebTransport session throws, creating a WebRTC peer
// connection (RTCPeerConnection, webkitRTCPeerConnection) throws, starting a web worker
// (Worker, SharedWorker) throws, and registering a service worker fails, as in a browser
// whose policy forbids them; each refusal is reported to the render. WebRTC is refused
// because its ICE traffic (STUN over UDP, TURN) goes around the proxy and the guard: a
// site would learn the worker's own address and reach internal ones (the pool also starts
// Chromium with non-proxied UDP disabled, for what this script can not reach). Workers are refused
// because this script can not run inside them (CDP's addScriptToEvaluateOnNewDocument
// reaches documents only), so a worker could open a WebSocket past it.
const noSocketsNoWorkers = `(() => {
  const report = globalThis["` + refusedBinding + `"] || (() => {});
  delete globalThis["` + refusedBinding + `"];
  const refuse = (what) => function () {
    report(what);
    throw new DOMException(what + " is off in this browser", "SecurityError");
  };
  for (const name of ["WebSocket", "WebSocketStream", "WebTransport", "RTCPeerConnection", "webkitRTCPeerConnection", "Worker", "SharedWorker"]) {
    if (name in globalThis) {
      Object.defineProperty(globalThis, name, {value: refuse(name), writable: false, configurable: false});
    }
  }
  if ("ServiceWorkerContainer" in globalThis) {
    Object.defineProperty(ServiceWorkerContainer.prototype, "register", {writable: false, configurable: false,
      value: function () { report("ServiceWorker"); return Promise.reject(new DOMException("service workers are off in this browser", "SecurityError")); }});
  }
})();`

// run drives one render in a new browser context of br.
func (r *render) run(ctx context.Context, br *browser) (*Rendered, error) {
	r.stop, r.changed = make(chan struct{}), make(chan struct{}, 1)
	// Chromium sends proxy credentials only when the gateway challenges with 407: through
	// a gateway that serves unauthenticated requests (an IP-allow-listed account) the page
	// would load from another exit than the session's. Its proxy is the render's own
	// forwarder, which puts the session's credentials on every request and CONNECT.
	fwd, err := newRenderProxy(ctx, r.b.Session, r.b.cfg.DialTimeout, r.b.cfg.Guard.Check,
		func() { r.mu.Lock(); r.rendered.Refused++; r.mu.Unlock() },
		func() { r.mu.Lock(); r.authFail++; r.mu.Unlock(); go r.halt() },
		r.wire, r.b.refusals)
	if err != nil {
		return nil, fmt.Errorf("sessions: render proxy: %w", err)
	}
	defer fwd.close() // after the tab (deferred below, so run first)
	r.mu.Lock()
	r.fwd = fwd
	r.mu.Unlock()
	tctx, tcancel := chromedp.NewContext(br.ctx,
		chromedp.WithNewBrowserContext(func(p *target.CreateBrowserContextParams) {
			p.ProxyServer = "http://" + fwd.addr()
			// Chromium sends loopback destinations around a proxy unless told not to; every
			// request must go through the session's proxy (the guard decides what may).
			p.ProxyBypassList = "<-loopback>"
		}),
		chromedp.WithListener(r.listen))
	defer tcancel() // closes the tab and disposes the browser context
	// The render ends with ctx (the attempt's context, the render timeout) or on halt.
	go func() {
		select {
		case <-ctx.Done():
		case <-r.stop:
		case <-tctx.Done():
			return
		}
		tcancel()
	}()
	if err := chromedp.Do(tctx); err != nil { // opens the tab
		return nil, err
	}
	t := chromedp.FromContext(tctx).Target
	paused := chromedp.Events(tctx, fetch.RequestPaused)
	auths := chromedp.Events(tctx, fetch.AuthRequired)
	var wg sync.WaitGroup
	defer func() { tcancel(); wg.Wait() }() // the iterators end with the tab
	wg.Add(2)
	go func() { defer wg.Done(); r.intercept(tctx, t, paused) }()
	go func() { defer wg.Done(); r.authenticate(tctx, t, auths) }()

	if _, err := cdp.Call(tctx, t, network.Enable, network.EnableParams{}); err != nil {
		return nil, err
	}
	// The session's client identity (RunConfig.Profiles): the page's every request, and
	// navigator.userAgent, userAgentData and languages, are those of the profile its
	// colly requests carry.
	if p := r.b.Session.Profile; p != nil {
		if _, err := cdp.Call(tctx, t, emulation.SetUserAgentOverride, *p.UserAgentOverride()); err != nil {
			return nil, err
		}
	}
	// CDP's Fetch domain intercepts neither WebSocket handshakes nor a service worker's
	// requests, so the guard could not see them: a render allows neither. Before any of a
	// page's scripts, in every frame, opening a WebSocket (or WebSocketStream, WebTransport),
	// starting a web worker and registering a service worker fail, and the page's requests
	// bypass service workers. A refusal is reported through a binding and counted
	// (Rendered.Refused).
	if _, err := cdp.Call(tctx, t, runtime.AddBinding, runtime.AddBindingParams{Name: refusedBinding}); err != nil {
		return nil, err
	}
	if _, err := cdp.Call(tctx, t, network.SetBypassServiceWorker, network.SetBypassServiceWorkerParams{Bypass: true}); err != nil {
		return nil, err
	}
	if _, err := cdp.Call(tctx, t, page.AddScriptToEvaluateOnNewDocument, page.AddScriptToEvaluateOnNewDocumentParams{Source: noSocketsNoWorkers}); err != nil {
		return nil, err
	}
	if _, err := cdp.Call(tctx, t, fetch.Enable, fetch.EnableParams{
		Patterns:           []*fetch.RequestPattern{{URLPattern: "*"}},
		HandleAuthRequests: new(true),
	}); err != nil {
		return nil, err
	}
	// The session's cookies go with the page's requests.
	if cookies := r.b.Collector.Cookies(r.pageURL()); len(cookies) > 0 {
		params := network.SetCookiesParams{}
		for _, c := range cookies {
			params.Cookies = append(params.Cookies, &network.CookieParam{Name: c.Name, Value: c.Value, URL: r.pageURL()})
		}
		if _, err := cdp.Call(tctx, t, network.SetCookies, params); err != nil {
			return nil, err
		}
	}
	resp, err := chromedp.Run(tctx, chromedp.NavigateResponse(r.pageURL()))
	if err == nil && r.o.WaitFor != "" {
		err = chromedp.Do(tctx, chromedp.WaitVisible(chromedp.CSS(r.o.WaitFor)))
	}
	if err == nil {
		r.settle(tctx)
	}
	if err := r.stopped(); err != nil {
		return nil, err
	}
	if err != nil {
		return nil, err
	}
	res := r.rendered
	if resp != nil {
		res.URL, res.Status = resp.URL, int(resp.Status)
		r.docHeader = cdpHeader(resp.Headers)
	}
	if res.HTML, err = chromedp.Run(tctx, chromedp.Evaluate[string](`document.documentElement.outerHTML`)); err != nil {
		return nil, err
	}
	if err := r.captured(tctx, t, res); err != nil {
		return nil, err
	}
	// The page's cookies go back to the session's collector.
	got, err := cdp.Call(tctx, t, network.GetCookies, network.GetCookiesParams{URLs: []string{r.pageURL(), res.URL}})
	if err != nil {
		return nil, err
	}
	var jar []*http.Cookie
	for _, c := range got.Cookies {
		jar = append(jar, &http.Cookie{Name: c.Name, Value: c.Value, Path: c.Path, Domain: c.Domain, HttpOnly: c.HTTPOnly, Secure: c.Secure})
	}
	if len(jar) > 0 {
		if err := r.b.Collector.SetCookies(r.pageURL(), jar); err != nil {
			return nil, err
		}
	}
	if err := r.stopped(); err != nil {
		return nil, err
	}
	return res, nil
}

// pageURL is the URL the render was asked for.
func (r *render) pageURL() string { return r.page }

// stopped is the reason the render was halted, if it was.
func (r *render) stopped() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case r.budget != nil:
		return classify(r.budget, true)
	case r.lost != nil:
		var fe *FetchError
		if errors.As(r.lost, &fe) {
			return fe
		}
		return &FetchError{Category: tasks.CategorySessionLost, Err: fmt.Errorf("sessions: render: %w", r.lost)}
	case r.authFail > 0:
		return &FetchError{Category: tasks.CategoryProxyAuth, Status: http.StatusProxyAuthRequired,
			Err: errors.New("sessions: render: the proxy refused the session's credentials")}
	}
	return nil
}

// captured fetches the bodies of the captured responses that finished.
func (r *render) captured(ctx context.Context, t *chromedp.Target, res *Rendered) error {
	r.mu.Lock()
	var ids []network.RequestID
	for id, q := range r.ids {
		if q.capture && q.done {
			ids = append(ids, id)
		}
	}
	r.mu.Unlock()
	slices.Sort(ids)
	for _, id := range ids {
		body, err := cdp.Call(ctx, t, network.GetResponseBody, network.GetResponseBodyParams{RequestID: id})
		if err != nil {
			continue // evicted or failed: not captured
		}
		r.mu.Lock()
		q := r.ids[id]
		res.Captured = append(res.Captured, Captured{URL: q.url, Status: q.status, Body: body.Body})
		r.mu.Unlock()
	}
	return nil
}

// intercept decides every request of the page before it is sent: the guard, the blocked
// resource types; everything else continues through the session's proxy.
func (r *render) intercept(ctx context.Context, t *chromedp.Target, paused iter.Seq2[fetch.EventRequestPaused, error]) {
	for ev, err := range paused {
		if err != nil {
			return
		}
		if ev.ResponseStatusCode != 0 || ev.ResponseErrorReason != "" {
			_, _ = cdp.Call(ctx, t, fetch.ContinueRequest, fetch.ContinueRequestParams{RequestID: ev.RequestID})
			continue
		}
		reqURL := ev.Request.URL
		switch {
		case strings.HasPrefix(reqURL, "data:") || strings.HasPrefix(reqURL, "blob:"):
			// In the page, no network.
		case r.pool.blocked(ev.ResourceType) && !slices.Contains(r.o.AllowResources, string(ev.ResourceType)),
			ev.ResourceType == network.ResourceTypeOther && strings.HasSuffix(strings.SplitN(reqURL, "?", 2)[0], "/favicon.ico"):
			// Pictures, media, fonts and the tab's favicon: bytes no scraper reads.
			r.mu.Lock()
			r.rendered.Skipped++
			r.mu.Unlock()
			_, _ = cdp.Call(ctx, t, fetch.FailRequest, fetch.FailRequestParams{RequestID: ev.RequestID, ErrorReason: network.ErrorReasonBlockedByClient})
			continue
		default:
			if err := r.b.cfg.Guard.Check(ctx, reqURL); err != nil {
				r.mu.Lock()
				r.rendered.Refused++
				r.mu.Unlock()
				_, _ = cdp.Call(ctx, t, fetch.FailRequest, fetch.FailRequestParams{RequestID: ev.RequestID, ErrorReason: network.ErrorReasonAccessDenied})
				continue
			}
			r.mu.Lock()
			r.rendered.Requests++
			if ev.NetworkID != "" && r.ids[ev.NetworkID] == nil {
				// Known before Chromium reports it, so that settle waits for it.
				r.ids[ev.NetworkID] = &renderReq{url: reqURL, typ: ev.ResourceType}
			}
			r.mu.Unlock()
		}
		_, _ = cdp.Call(ctx, t, fetch.ContinueRequest, fetch.ContinueRequestParams{RequestID: ev.RequestID})
	}
}

// authenticate answers the render proxy's 407 with the render's token, once per request:
// a second challenge for the same request means it was refused. The session's own
// credentials never reach Chromium: the render proxy adds them, and reports the gateway's
// refusal of them itself.
func (r *render) authenticate(ctx context.Context, t *chromedp.Target, auths iter.Seq2[fetch.EventAuthRequired, error]) {
	tried := map[fetch.RequestID]bool{}
	for ev, err := range auths {
		if err != nil {
			return
		}
		resp := &fetch.AuthChallengeResponse{Response: fetch.AuthChallengeResponseResponseCancelAuth}
		if ev.AuthChallenge != nil && ev.AuthChallenge.Source == fetch.AuthChallengeSourceProxy && !tried[ev.RequestID] {
			tried[ev.RequestID] = true
			user, pass := r.fwd.token()
			resp = &fetch.AuthChallengeResponse{Response: fetch.AuthChallengeResponseResponseProvideCredentials, Username: user, Password: pass}
		} else if ev.AuthChallenge != nil && ev.AuthChallenge.Source == fetch.AuthChallengeSourceProxy {
			r.mu.Lock()
			r.authFail++
			r.mu.Unlock()
			go r.halt()
		}
		_, _ = cdp.Call(ctx, t, fetch.ContinueWithAuth, fetch.ContinueWithAuthParams{RequestID: ev.RequestID, AuthChallengeResponse: resp})
	}
}
