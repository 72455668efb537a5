package testutil

import (
	"bytes"
	"compress/flate"
	"compress/gzip"
	"compress/zlib"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"hash/crc32"
	"html"
	"image"
	"image/png"
	"io"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/andybalholm/brotli"
	"github.com/klauspost/compress/zstd"
)

// Defaults of FakeSiteConfig.
const (
	// DefaultFakeSiteProducts is the catalog size: sku-1 … sku-50.
	DefaultFakeSiteProducts = 50
	// DefaultFakeSiteRobots allows everything except /private/.
	DefaultFakeSiteRobots = "User-agent: *\nDisallow: /private/\n"
	// DefaultFakeSiteBigSize is the size of /big: 20 MiB.
	DefaultFakeSiteBigSize = 20 << 20
	// DefaultFakeSiteSlowDelay is how long /slow waits before answering.
	DefaultFakeSiteSlowDelay = 2 * time.Second
	// DefaultFakeSiteUnavailableRetryAfter is the Retry-After of the 503s of SetUnavailable.
	DefaultFakeSiteUnavailableRetryAfter = time.Second
	// FakeSiteBombSize is how much the gzip body of /bomb inflates to: 1 GiB of zeros.
	FakeSiteBombSize = 1 << 30
	// DefaultFakeSiteChallengeSize is the body size of the challenge page: 24 KiB, as a
	// real anti-bot challenge carries tens of KB of script.
	DefaultFakeSiteChallengeSize = 24 << 10
)

// FakeSiteConfig configures a FakeSite.
type FakeSiteConfig struct {
	// Seed makes the catalog (names, prices) and the price tokens reproducible. Defaults to 0.
	Seed int64
	// Products is the catalog size, sku-1 … sku-<Products>. Defaults to DefaultFakeSiteProducts.
	Products int
	// Robots is the body of /robots.txt. Defaults to DefaultFakeSiteRobots.
	Robots string
	// BigSize is the size in bytes of the body of /big. Defaults to DefaultFakeSiteBigSize.
	BigSize int64
	// SlowDelay is how long /slow waits before answering. Defaults to DefaultFakeSiteSlowDelay.
	SlowDelay time.Duration
	// UnavailableRetryAfter is the Retry-After of the 503 answers of SetUnavailable.
	// Defaults to DefaultFakeSiteUnavailableRetryAfter.
	UnavailableRetryAfter time.Duration
	// StrictExit makes the site bind a sid to the exit that created it, as anti-bot systems
	// do: a product page or price request whose sid came from another exit gets 403.
	// Defaults to false.
	StrictExit bool
	// TLS serves the site over HTTPS (httptest's self-signed certificate for 127.0.0.1), so
	// that proxied requests go through CONNECT; CertPool trusts it. Defaults to false.
	TLS bool
	// Challenge puts an anti-bot challenge in front of every path but /robots.txt: a
	// request needs a clearance cookie issued to its exit, which the challenge page sets
	// (see FakeSite, "Challenge mode"). Defaults to false: the site never challenges.
	Challenge bool
	// ChallengeSize is the body size in bytes of the challenge page (its HTML, padded with
	// a script comment); a size below the page's bare HTML gets the bare HTML. Defaults to
	// DefaultFakeSiteChallengeSize.
	ChallengeSize int
	// Encodings, when set, makes the site compress its pages (every path but /big,
	// /bomb and /img/…) with the first of these content codings — "br", "zstd", "gzip",
	// "deflate" — that the request's Accept-Encoding offers, as a CDN does; a request that
	// offers none of them is served uncompressed. The body is sent with its Content-Length
	// and Vary: Accept-Encoding. Defaults to nil: pages are never compressed.
	Encodings []string
	// ChallengeBlockEvery, when k > 0, answers every k-th challenge the site would issue
	// with 403 and a block page instead (no cookie), as an anti-bot system flags a fresh
	// exit; the count is site-wide and deterministic. Defaults to 0: never.
	ChallengeBlockEvery int
}

// FakeProduct is one catalog entry, as the site shows it.
type FakeProduct struct {
	SKU      string
	Name     string
	Price    string // decimal with two digits, e.g. "19.99"
	Currency string // always "USD"
}

// FakeSite is a small deterministic shop on 127.0.0.1 for scraping tests. A scrape is a
// three-step chain that only works inside one session:
//
//	GET /search?q=<sku>           HTML linking /product/<sku>; sets cookie sid (if none)
//	GET /product/<sku>            needs the sid: <h1 class="name">, <span class="currency">,
//	                              <meta name="price-token" content="<token for sid+sku>">
//	GET /api/price/<sku>?token=T  needs the sid and its token: JSON
//	                              {"sku":…,"price":"19.99","currency":"USD","exit":…}
//
// and missing or foreign cookies or tokens get 403. Every answer names the exit that
// requested it (the client IP, i.e. the proxy's source address 127.0.0.N): an X-Exit
// header, data-exit on the HTML <body>, "exit" in JSON, a "# exit:" comment in
// /robots.txt and a first line "exit=…" in /big. Only /bomb, being zeros, has it in the
// header alone.
//
// Other paths: /robots.txt (FakeSiteConfig.Robots), /private/<anything> (a polite scraper
// never comes here; Hits counts it), /big (BigSize bytes of text/plain), /bomb (a ~1 MB
// gzip body, Content-Encoding: gzip, that inflates to FakeSiteBombSize zeros) and /slow
// (answers after SlowDelay). Throttle, SetUnavailable and SetSlow apply to every path but
// /robots.txt, so that a scraper's robots fetch does not eat them.
//
// Challenge mode (FakeSiteConfig.Challenge), like a CDN's anti-bot clearance, for every
// path but /robots.txt:
//
//   - a request with a clearance cookie the site issued to its exit is served normally;
//   - one without a clearance cookie (or with one the site never issued) gets the
//     challenge page: 200, text/html, <meta name="challenge" content="1"> in the head, a
//     body of ChallengeSize bytes, and Set-Cookie: clearance=<HMAC of the exit>; Path=/;
//     HttpOnly. A client with a cookie jar then asks for the same URL again and is served
//     (Challenges counts the pages);
//   - one whose clearance cookie was issued to another exit (the client moved exits)
//     gets 403 with <p class="blocked">blocked: clearance does not match your address</p>
//     (ClearanceMismatches);
//   - with ChallengeBlockEvery k, every k-th challenge the site would issue is a 403
//     block page instead, without a cookie (ChallengeBlocks).
//
// The gates apply in this order: a blocked tier (SetBlockedTier) answers first, uncounted
// in Hits as always; then the request counts in Hits and TotalHits, whatever follows;
// then the challenge, which stands in front of the shop as a CDN does — its challenge
// pages and 403s are not delayed by SetSlow and do not use up Throttle or SetUnavailable;
// then SetSlow, Throttle and SetUnavailable; then the page, where the sid cookie and
// StrictExit work as without challenges. /robots.txt is exempt from every gate.
type FakeSite struct {
	// URL is the site's base URL, http://127.0.0.1:<port> (https:// with TLS).
	URL string

	cfg      FakeSiteConfig
	srv      *httptest.Server
	products map[string]FakeProduct
	tokenKey []byte
	clearKey []byte // key of the clearance tokens (challenge mode)

	mu            sync.Mutex
	sids          map[string]string // sid → exit that created it
	hits          map[string]int
	hitWaiters    map[string][]chan struct{} // NextHit's channels, closed at path's next request
	total         int
	throttle      int
	throttleAfter time.Duration
	unavailable   int
	slow          time.Duration
	schemaChange  bool
	blockedTier   string
	blocked       map[string]int    // tier → requests answered 403 for it
	clearances    map[string]string // clearance token → exit it was issued to (challenge mode)
	challengeN    int               // challenges the site would have issued: drives ChallengeBlockEvery
	challenges    int               // challenge pages served
	chBlocks      int               // challenges answered with a block instead
	mismatches    int               // 403s for a clearance issued to another exit
	closeOnce     sync.Once
}

// NewFakeSite starts a FakeSite; it is closed when the test ends.
func NewFakeSite(t testing.TB, cfg FakeSiteConfig) *FakeSite {
	t.Helper()
	if cfg.Products <= 0 {
		cfg.Products = DefaultFakeSiteProducts
	}
	if cfg.Robots == "" {
		cfg.Robots = DefaultFakeSiteRobots
	}
	if cfg.BigSize <= 0 {
		cfg.BigSize = DefaultFakeSiteBigSize
	}
	if cfg.SlowDelay <= 0 {
		cfg.SlowDelay = DefaultFakeSiteSlowDelay
	}
	if cfg.UnavailableRetryAfter <= 0 {
		cfg.UnavailableRetryAfter = DefaultFakeSiteUnavailableRetryAfter
	}
	if cfg.ChallengeSize <= 0 {
		cfg.ChallengeSize = DefaultFakeSiteChallengeSize
	}
	s := &FakeSite{
		cfg:        cfg,
		products:   map[string]FakeProduct{},
		sids:       map[string]string{},
		hits:       map[string]int{},
		clearances: map[string]string{},
	}
	key := sha256.Sum256(binary.LittleEndian.AppendUint64([]byte("fakesite-token"), uint64(cfg.Seed)))
	s.tokenKey = key[:]
	ckey := sha256.Sum256(append([]byte("fakesite-clearance\x00"), s.tokenKey...))
	s.clearKey = ckey[:]
	for i := 1; i <= cfg.Products; i++ {
		p := fsMakeProduct(cfg.Seed, i)
		s.products[p.SKU] = p
	}
	for _, enc := range cfg.Encodings {
		if _, ok := fsEncoders[enc]; !ok {
			t.Fatalf("testutil: FakeSiteConfig.Encodings: unknown coding %q", enc)
		}
	}
	s.srv = httptest.NewUnstartedServer(http.HandlerFunc(s.serveEncoded))
	if cfg.TLS {
		s.srv.StartTLS()
	} else {
		s.srv.Start()
	}
	s.URL = s.srv.URL
	t.Cleanup(s.Close)
	return s
}

// Close stops the site, cutting open connections first so that no handler outlives it.
// It may be called more than once.
func (s *FakeSite) Close() {
	s.closeOnce.Do(func() {
		s.srv.CloseClientConnections()
		s.srv.Close()
	})
}

// CertPool trusts the site's certificate when FakeSiteConfig.TLS is set; nil otherwise.
func (s *FakeSite) CertPool() *x509.CertPool {
	if !s.cfg.TLS {
		return nil
	}
	pool := x509.NewCertPool()
	pool.AddCert(s.srv.Certificate())
	return pool
}

// Product returns the catalog entry of sku, as the site serves it.
func (s *FakeSite) Product(sku string) (FakeProduct, bool) {
	p, ok := s.products[sku]
	return p, ok
}

// SKUs returns the catalog's SKUs in order: sku-1 … sku-N.
func (s *FakeSite) SKUs() []string {
	out := make([]string, s.cfg.Products)
	for i := range out {
		out[i] = "sku-" + strconv.Itoa(i+1)
	}
	return out
}

// ExitOfSID returns the exit that created the cookie sid, or "" for an unknown sid.
func (s *FakeSite) ExitOfSID(sid string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sids[sid]
}

// Throttle makes the next n requests (robots.txt excepted) answer 429 Too Many Requests
// with Retry-After: retryAfter in whole seconds, rounded up. It replaces any pending throttle.
func (s *FakeSite) Throttle(n int, retryAfter time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.throttle, s.throttleAfter = max(n, 0), retryAfter
}

// SetBlockedTier makes every later request (robots.txt excepted) that came through a
// FakeProxy of that tier (X-Fake-Tier) answer 403 Forbidden with a block page, as a shop
// that blocks datacenter exits does; "" blocks none.
func (s *FakeSite) SetBlockedTier(tier string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.blockedTier = tier
}

// Blocked is how many requests were answered 403 for coming through tier.
func (s *FakeSite) Blocked(tier string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.blocked[tier]
}

// blockTier reports whether a request through tier is blocked, and counts it.
func (s *FakeSite) blockTier(tier, path string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if tier == "" || tier != s.blockedTier || path == "/robots.txt" {
		return false
	}
	if s.blocked == nil {
		s.blocked = map[string]int{}
	}
	s.blocked[tier]++
	return true
}

// SetUnavailable makes the next n requests (robots.txt excepted) answer 503 Service
// Unavailable with Retry-After (FakeSiteConfig.UnavailableRetryAfter). A pending Throttle
// is served first.
func (s *FakeSite) SetUnavailable(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.unavailable = max(n, 0)
}

// SetSlow delays every later answer (robots.txt excepted) by d; 0 turns it off. The delay
// ends early when the client goes away.
func (s *FakeSite) SetSlow(d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.slow = max(d, 0)
}

// SetSchemaChange switches the price API between its two schemas: when on, the field
// "price" is renamed "amount".
func (s *FakeSite) SetSchemaChange(on bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.schemaChange = on
}

// SetChallenge turns challenge mode (FakeSiteConfig.Challenge) on or off for the requests
// that follow; clearances issued so far stay valid.
func (s *FakeSite) SetChallenge(on bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.cfg.Challenge = on
}

// Hits is the number of requests received for path (the URL path, without query), whatever
// the answer.
func (s *FakeSite) Hits(path string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.hits[path]
}

// NextHit returns a channel closed when the site receives its next request for path (the
// URL path, without query): a test waits on it instead of polling Hits.
func (s *FakeSite) NextHit(path string) <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	ch := make(chan struct{})
	if s.hitWaiters == nil {
		s.hitWaiters = map[string][]chan struct{}{}
	}
	s.hitWaiters[path] = append(s.hitWaiters[path], ch)
	return ch
}

// TotalHits is the number of requests received on every path.
func (s *FakeSite) TotalHits() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.total
}

// RobotsHits is Hits("/robots.txt").
func (s *FakeSite) RobotsHits() int { return s.Hits("/robots.txt") }

// Challenges is the number of challenge pages served (challenge mode).
func (s *FakeSite) Challenges() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.challenges
}

// ChallengeBlocks is the number of challenges answered with a 403 block page instead,
// under FakeSiteConfig.ChallengeBlockEvery (challenge mode).
func (s *FakeSite) ChallengeBlocks() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.chBlocks
}

// ClearanceMismatches is the number of requests answered 403 for carrying a clearance
// cookie the site issued to another exit (challenge mode).
func (s *FakeSite) ClearanceMismatches() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.mismatches
}

// fsGate is what challenge mode decided for one request.
type fsGate int

const (
	fsGatePass      fsGate = iota // served as without challenges
	fsGateChallenge               // the challenge page, with a clearance cookie
	fsGateBlock                   // the k-th challenge: 403, no cookie
	fsGateMismatch                // a clearance of another exit: 403
)

// fsPending is what the toggles decided for one request.
type fsPending struct {
	status     int
	retryAfter time.Duration
	slow       time.Duration
	schema     bool
	gate       fsGate
}

// admit counts the request and decides what the toggles make of it. clearance is the
// value of its clearance cookie, "" when it has none.
func (s *FakeSite) admit(path, exit, clearance string) fsPending {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.hits[path]++
	s.total++
	for _, ch := range s.hitWaiters[path] {
		close(ch)
	}
	delete(s.hitWaiters, path)
	pend := fsPending{schema: s.schemaChange}
	if path == "/robots.txt" {
		return pend
	}
	if s.cfg.Challenge {
		if pend.gate = s.gateLocked(exit, clearance); pend.gate != fsGatePass {
			return pend
		}
	}
	pend.slow = s.slow
	switch {
	case s.throttle > 0:
		s.throttle--
		pend.status, pend.retryAfter = http.StatusTooManyRequests, s.throttleAfter
	case s.unavailable > 0:
		s.unavailable--
		pend.status, pend.retryAfter = http.StatusServiceUnavailable, s.cfg.UnavailableRetryAfter
	}
	return pend
}

// gateLocked is challenge mode's decision for a request from exit with the clearance
// cookie value clearance ("" for none). s.mu is held.
func (s *FakeSite) gateLocked(exit, clearance string) fsGate {
	if clearance != "" {
		if issuedTo, ok := s.clearances[clearance]; ok {
			if issuedTo == exit {
				return fsGatePass
			}
			s.mismatches++
			return fsGateMismatch
		}
	}
	s.challengeN++
	if k := s.cfg.ChallengeBlockEvery; k > 0 && s.challengeN%k == 0 {
		s.chBlocks++
		return fsGateBlock
	}
	s.challenges++
	s.clearances[s.clearanceToken(exit)] = exit
	return fsGateChallenge
}

// clearanceToken is the clearance cookie of exit: an HMAC under a key derived from the
// seed, so it is bound to the exit and nobody else can make one.
func (s *FakeSite) clearanceToken(exit string) string {
	m := hmac.New(sha256.New, s.clearKey)
	_, _ = io.WriteString(m, exit)
	return hex.EncodeToString(m.Sum(nil)[:16])
}

// serveGate answers a request challenge mode stopped.
func (s *FakeSite) serveGate(w http.ResponseWriter, gate fsGate, exit string) {
	switch gate {
	case fsGateChallenge:
		http.SetCookie(w, &http.Cookie{Name: "clearance", Value: s.clearanceToken(exit), Path: "/", HttpOnly: true})
		page := fsChallengePage(exit, s.cfg.ChallengeSize)
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		w.Header().Set("Content-Length", strconv.Itoa(len(page)))
		w.WriteHeader(http.StatusOK)
		_, _ = io.WriteString(w, page)
	case fsGateBlock:
		s.writeHTML(w, http.StatusForbidden, exit, `<p class="blocked">blocked: your address was flagged by the challenge</p>`)
	case fsGateMismatch:
		s.writeHTML(w, http.StatusForbidden, exit, `<p class="blocked">blocked: clearance does not match your address</p>`)
	}
}

// fsChallengePage is the challenge page for exit, padded with a script comment to size
// bytes (or its bare HTML, if that is longer).
func fsChallengePage(exit string, size int) string {
	head := "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>Just a moment...</title>" +
		"<meta name=\"challenge\" content=\"1\"></head>\n<body data-exit=\"" + html.EscapeString(exit) + "\">\n" +
		"<p class=\"challenge\">Checking your browser before accessing the shop.</p>\n" +
		"<script>\n/* challenge bundle\n"
	tail := "*/\ndocument.cookie; location.reload();\n</script>\n</body></html>\n"
	pad := size - len(head) - len(tail)
	if pad <= 0 {
		return head + tail
	}
	const line = "var _0xc1ea = [0x63, 0x68, 0x61, 0x6c, 0x6c, 0x65, 0x6e, 0x67, 0x65]; // proof of work\n"
	var b strings.Builder
	b.Grow(size)
	b.WriteString(head)
	for left := pad; left > 0; left -= len(line) {
		b.WriteString(line[:min(left, len(line))])
	}
	b.WriteString(tail)
	return b.String()
}

// serveEncoded is serve, its answer compressed as FakeSiteConfig.Encodings and the
// request's Accept-Encoding say.
func (s *FakeSite) serveEncoded(w http.ResponseWriter, r *http.Request) {
	path := r.URL.Path
	if len(s.cfg.Encodings) == 0 || path == "/big" || path == "/bomb" || strings.HasPrefix(path, "/img/") {
		s.serve(w, r)
		return
	}
	buf := &fsBuffered{h: w.Header()}
	s.serve(buf, r)
	if buf.code == 0 {
		buf.code = http.StatusOK
	}
	body := buf.body.Bytes()
	w.Header().Add("Vary", "Accept-Encoding")
	if enc := fsPickEncoding(s.cfg.Encodings, r.Header.Get("Accept-Encoding")); enc != "" && len(body) > 0 && w.Header().Get("Content-Encoding") == "" {
		body = fsEncoders[enc](body)
		w.Header().Set("Content-Encoding", enc)
	}
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(buf.code)
	_, _ = w.Write(body)
}

// fsBuffered keeps a handler's answer for serveEncoded; its headers are the real writer's.
type fsBuffered struct {
	h    http.Header
	code int
	body bytes.Buffer
}

func (b *fsBuffered) Header() http.Header { return b.h }

func (b *fsBuffered) WriteHeader(code int) {
	if b.code == 0 {
		b.code = code
	}
}

func (b *fsBuffered) Write(p []byte) (int, error) {
	b.WriteHeader(http.StatusOK)
	return b.body.Write(p)
}

// fsPickEncoding is the first of the site's codings that acceptEncoding offers (with a
// q-value above 0), "" if none.
func fsPickEncoding(site []string, acceptEncoding string) string {
	offered := map[string]bool{}
	for part := range strings.SplitSeq(acceptEncoding, ",") {
		name, params, _ := strings.Cut(part, ";")
		name = strings.ToLower(strings.TrimSpace(name))
		if q, ok := strings.CutPrefix(strings.TrimSpace(params), "q="); ok {
			if v, err := strconv.ParseFloat(q, 64); err == nil && v <= 0 {
				continue
			}
		}
		offered[name] = true
	}
	for _, enc := range site {
		if offered[enc] {
			return enc
		}
	}
	return ""
}

// fsEncoders compress a body with each coding FakeSiteConfig.Encodings may name, at the
// libraries' default levels (brotli 6, zstd's default, gzip and deflate 6).
var fsEncoders = map[string]func([]byte) []byte{
	"br": func(b []byte) []byte {
		var out bytes.Buffer
		w := brotli.NewWriterLevel(&out, brotli.DefaultCompression)
		_, _ = w.Write(b)
		_ = w.Close()
		return out.Bytes()
	},
	"zstd": func(b []byte) []byte {
		w, _ := zstd.NewWriter(nil)
		defer w.Close()
		return w.EncodeAll(b, nil)
	},
	"gzip": func(b []byte) []byte {
		var out bytes.Buffer
		w := gzip.NewWriter(&out)
		_, _ = w.Write(b)
		_ = w.Close()
		return out.Bytes()
	},
	"deflate": func(b []byte) []byte {
		var out bytes.Buffer
		w := zlib.NewWriter(&out)
		_, _ = w.Write(b)
		_ = w.Close()
		return out.Bytes()
	},
}

func (s *FakeSite) serve(w http.ResponseWriter, r *http.Request) {
	exit := r.RemoteAddr
	if host, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		exit = host
	}
	w.Header().Set("X-Exit", exit)
	if s.blockTier(r.Header.Get("X-Fake-Tier"), r.URL.Path) {
		s.writeHTML(w, http.StatusForbidden, exit, "<p>Access denied: datacenter traffic is not allowed</p>")
		return
	}
	var clearance string
	if s.cfg.Challenge {
		if c, err := r.Cookie("clearance"); err == nil {
			clearance = c.Value
		}
	}
	pend := s.admit(r.URL.Path, exit, clearance)
	if pend.gate != fsGatePass {
		s.serveGate(w, pend.gate, exit)
		return
	}
	if pend.slow > 0 && !fsSleep(r, pend.slow) {
		return
	}
	if pend.status != 0 {
		secs := int64((pend.retryAfter + time.Second - 1) / time.Second)
		w.Header().Set("Retry-After", strconv.FormatInt(max(secs, 0), 10))
		s.writeHTML(w, pend.status, exit, "<p>"+http.StatusText(pend.status)+"</p>")
		return
	}
	path := r.URL.Path
	switch {
	case path == "/robots.txt":
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		body := s.cfg.Robots
		if !strings.HasSuffix(body, "\n") {
			body += "\n"
		}
		_, _ = io.WriteString(w, body+"# exit: "+exit+"\n")
	case path == "/search":
		s.serveSearch(w, r, exit)
	case strings.HasPrefix(path, "/product/"):
		s.serveProduct(w, r, exit, strings.TrimPrefix(path, "/product/"))
	case strings.HasPrefix(path, "/api/price/"):
		s.servePrice(w, r, exit, strings.TrimPrefix(path, "/api/price/"), pend.schema)
	case strings.HasPrefix(path, "/private/"):
		s.writeHTML(w, http.StatusOK, exit, "<p>private: polite scrapers never see this</p>")
	case path == "/big":
		s.serveBig(w, exit)
	case strings.HasPrefix(path, "/js/product/"):
		s.serveJSProduct(w, r, exit, strings.TrimPrefix(path, "/js/product/"))
	case path == "/js/probe":
		s.serveJSProbe(w, r, exit)
	case path == "/js/ws-worker.js":
		// A worker that opens a WebSocket to the probe address, then reports.
		w.Header().Set("Content-Type", "text/javascript")
		fmt.Fprintf(w, `try { const s = new WebSocket("ws://%s/ws"); s.onopen = s.onerror = () => postMessage("done"); } catch (e) { postMessage("done"); }`+"\n",
			strings.ReplaceAll(r.URL.Query().Get("probe"), `"`, ""))
	case path == "/sw.js":
		// A service worker that would see every request of its pages.
		w.Header().Set("Content-Type", "text/javascript")
		_, _ = io.WriteString(w, "self.addEventListener(\"fetch\", e => e.respondWith(fetch(e.request)));\n")
	case path == "/redirect-private":
		http.Redirect(w, r, "http://10.1.2.3/", http.StatusFound)
	case strings.HasPrefix(path, "/img/"):
		w.Header().Set("Content-Type", "image/png")
		_, _ = w.Write(FakeSiteImage())
	case path == "/cookies":
		w.Header().Set("Content-Type", "application/json")
		got := map[string]string{}
		for _, c := range r.Cookies() {
			got[c.Name] = c.Value
		}
		_ = json.NewEncoder(w).Encode(got)
	case path == "/bomb":
		bomb := fsBomb()
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		w.Header().Set("Content-Encoding", "gzip")
		w.Header().Set("Content-Length", strconv.Itoa(len(bomb)))
		_, _ = w.Write(bomb)
	case path == "/slow":
		if !fsSleep(r, s.cfg.SlowDelay) {
			return
		}
		s.writeHTML(w, http.StatusOK, exit, "<p>slow</p>")
	case path == "/":
		s.writeHTML(w, http.StatusOK, exit, `<form action="/search"><input name="q"></form>`)
	default:
		s.writeHTML(w, http.StatusNotFound, exit, "<p>not found</p>")
	}
}

func (s *FakeSite) serveSearch(w http.ResponseWriter, r *http.Request, exit string) {
	if s.sidOf(r, exit, s.cfg.StrictExit) == "" {
		sid := fsNewSID()
		s.mu.Lock()
		s.sids[sid] = exit
		s.mu.Unlock()
		http.SetCookie(w, &http.Cookie{Name: "sid", Value: sid, Path: "/", HttpOnly: true})
	}
	q := r.URL.Query().Get("q")
	var results string
	if p, ok := s.products[q]; ok {
		results = fmt.Sprintf(`<li><a class="result" href="/product/%s">%s</a></li>`,
			html.EscapeString(p.SKU), html.EscapeString(p.Name))
	}
	s.writeHTML(w, http.StatusOK, exit, fmt.Sprintf(
		`<h1>Search: %s</h1><ul class="results">%s</ul>`, html.EscapeString(q), results))
}

// sessionProduct is what a product page needs: the session's sid (403 without one) and the
// product (404 for an unknown sku); ok false when it answered already.
func (s *FakeSite) sessionProduct(w http.ResponseWriter, r *http.Request, exit, sku string) (string, FakeProduct, bool) {
	sid := s.sidOf(r, exit, s.cfg.StrictExit)
	if sid == "" {
		s.writeHTML(w, http.StatusForbidden, exit, "<p>forbidden: no session</p>")
		return "", FakeProduct{}, false
	}
	p, ok := s.products[sku]
	if !ok {
		s.writeHTML(w, http.StatusNotFound, exit, "<p>not found</p>")
		return "", FakeProduct{}, false
	}
	return sid, p, true
}

func (s *FakeSite) serveProduct(w http.ResponseWriter, r *http.Request, exit, sku string) {
	sid, p, ok := s.sessionProduct(w, r, exit, sku)
	if !ok {
		return
	}
	s.writeHTMLHead(w, http.StatusOK, exit,
		fmt.Sprintf(`<meta name="price-token" content="%s">`, s.token(sid, sku)),
		fmt.Sprintf(`<h1 class="name">%s</h1><p class="sku">%s</p><span class="currency">%s</span>`,
			html.EscapeString(p.Name), html.EscapeString(p.SKU), p.Currency))
}

var (
	fsImageOnce sync.Once
	fsImage     []byte
)

// FakeSiteImage is the picture every /img/ path answers: a valid 256×256 PNG of noise
// (about 257 KiB: noise does not compress), since a page's pictures are most of its bytes
// and a browser stops reading a picture it can not decode.
func FakeSiteImage() []byte {
	fsImageOnce.Do(func() {
		img := image.NewNRGBA(image.Rect(0, 0, 256, 256))
		rnd := mrand.New(mrand.NewPCG(1, 2))
		for i := range img.Pix {
			img.Pix[i] = byte(rnd.Uint32())
		}
		var buf bytes.Buffer
		if err := png.Encode(&buf, img); err != nil {
			panic(err)
		}
		fsImage = buf.Bytes()
	})
	return fsImage
}

// serveJSProduct is the product page of a shop that renders its price with JavaScript: the
// HTML has no price, only a script that fetches /api/price/<sku> with the page's token
// (an XHR) and writes it into #price, then sets the cookie "rendered". Like /product/ it
// needs the session's sid cookie (from /search); it shows a 256 KiB picture.
func (s *FakeSite) serveJSProduct(w http.ResponseWriter, r *http.Request, exit, sku string) {
	sid, p, ok := s.sessionProduct(w, r, exit, sku)
	if !ok {
		return
	}
	s.writeHTML(w, http.StatusOK, exit, fmt.Sprintf(`<h1 class="name">%s</h1><img src="/img/%s.png" alt="">
<p>Price: <span id="price"></span> <span class="currency">%s</span></p>
<script>
fetch("/api/price/%s?token=%s").then(r => r.json()).then(j => {
  document.cookie = "rendered=1; path=/";
  const el = document.getElementById("price");
  el.textContent = j.price;
  el.className = "ready";
});
</script>`, html.EscapeString(p.Name), html.EscapeString(p.SKU), p.Currency, p.SKU, s.token(sid, sku)))
}

// serveJSProbe is a page whose script reaches for forbidden places: the address in its
// query's "probe" parameter (host:port), the cloud metadata address, and /redirect-private
// (a redirect to a private address); with "ws=1" also WebSockets to the probe address and
// to its own origin's /ws, and a service worker (/sw.js) registered. It then shows #done.
func (s *FakeSite) serveJSProbe(w http.ResponseWriter, r *http.Request, exit string) {
	probe := html.EscapeString(r.URL.Query().Get("probe"))
	ws := "false"
	if r.URL.Query().Get("ws") == "1" {
		ws = "true"
	}
	s.writeHTML(w, http.StatusOK, exit, fmt.Sprintf(`<p id="done" hidden>done</p>
<script>
const urls = ["http://%s/", "http://169.254.169.254/latest/meta-data/", "/redirect-private"];
const waits = urls.map(u => fetch(u, {mode: "no-cors"}));
if (%s) {
  for (const u of ["ws://%s/ws", "ws://" + location.host + "/ws"]) {
    waits.push(new Promise(done => {
      try {
        const sock = new WebSocket(u);
        sock.onopen = () => { sock.send("hello"); done(); };
        sock.onerror = sock.onclose = done;
      } catch (e) { done(); }
    }));
  }
  if (navigator.serviceWorker) {
    waits.push(navigator.serviceWorker.register("/sw.js").catch(() => {}));
  }
  if (typeof WebSocketStream === "function") {
    try { const st = new WebSocketStream("ws://%s/ws"); waits.push(st.opened.catch(() => {})); } catch (e) {}
  }
  // A worker could open a WebSocket where no page script reaches.
  waits.push(new Promise(done => {
    try {
      const w = new Worker("/js/ws-worker.js?probe=%s");
      w.onmessage = w.onerror = done;
    } catch (e) { done(); }
  }));
}
Promise.allSettled(waits).then(() => {
  document.getElementById("done").hidden = false;
});
</script>`, probe, ws, probe, probe, probe))
}

func (s *FakeSite) servePrice(w http.ResponseWriter, r *http.Request, exit, sku string, schemaChange bool) {
	sid := s.sidOf(r, exit, s.cfg.StrictExit)
	p, ok := s.products[sku]
	if sid == "" || !ok || !hmac.Equal([]byte(r.URL.Query().Get("token")), []byte(s.token(sid, sku))) {
		s.writeJSON(w, http.StatusForbidden, fsPriceJSON{Error: "forbidden", Exit: exit})
		return
	}
	body := fsPriceJSON{SKU: p.SKU, Price: p.Price, Currency: p.Currency, Exit: exit}
	if schemaChange {
		body.Price, body.Amount = "", p.Price
	}
	s.writeJSON(w, http.StatusOK, body)
}

// fsPriceJSON is the price API's answer; exactly one of Price and Amount is set.
type fsPriceJSON struct {
	Error    string `json:"error,omitempty"`
	SKU      string `json:"sku,omitempty"`
	Price    string `json:"price,omitempty"`
	Amount   string `json:"amount,omitempty"`
	Currency string `json:"currency,omitempty"`
	Exit     string `json:"exit"`
}

func (s *FakeSite) serveBig(w http.ResponseWriter, exit string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Content-Length", strconv.FormatInt(s.cfg.BigSize, 10))
	head := []byte("exit=" + exit + "\n")
	if int64(len(head)) > s.cfg.BigSize {
		head = head[:s.cfg.BigSize]
	}
	if _, err := w.Write(head); err != nil {
		return
	}
	fill := bytes.Repeat([]byte("x"), 32<<10)
	for left := s.cfg.BigSize - int64(len(head)); left > 0; {
		n := min(left, int64(len(fill)))
		if _, err := w.Write(fill[:n]); err != nil {
			return
		}
		left -= n
	}
}

// sidOf returns the request's sid cookie if the site issued it (and, when strict, issued
// it to this exit), else "".
func (s *FakeSite) sidOf(r *http.Request, exit string, strict bool) string {
	c, err := r.Cookie("sid")
	if err != nil {
		return ""
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	created, ok := s.sids[c.Value]
	if !ok || (strict && created != exit) {
		return ""
	}
	return c.Value
}

// token is the price token of (sid, sku): an HMAC under a key derived from the seed.
func (s *FakeSite) token(sid, sku string) string {
	m := hmac.New(sha256.New, s.tokenKey)
	_, _ = io.WriteString(m, sid+"\x00"+sku)
	return hex.EncodeToString(m.Sum(nil)[:12])
}

func (s *FakeSite) writeHTML(w http.ResponseWriter, status int, exit, body string) {
	s.writeHTMLHead(w, status, exit, "", body)
}

func (s *FakeSite) writeHTMLHead(w http.ResponseWriter, status int, exit, head, body string) {
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	fmt.Fprintf(w, "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>Fake shop</title>%s</head>\n"+
		"<body data-exit=\"%s\">\n%s\n</body></html>\n", head, html.EscapeString(exit), body)
}

func (s *FakeSite) writeJSON(w http.ResponseWriter, status int, body fsPriceJSON) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(body)
}

// fsSleep waits d or until the client goes away; it reports whether to go on answering.
func fsSleep(r *http.Request, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-r.Context().Done():
		return false
	}
}

func fsNewSID() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

var (
	fsAdjectives = []string{"Sturdy", "Compact", "Deluxe", "Classic", "Bright", "Silent",
		"Rapid", "Gentle", "Rugged", "Elegant", "Smart", "Vintage", "Modular", "Ultra", "Cozy", "Solar"}
	fsNouns = []string{"Kettle", "Lamp", "Backpack", "Drill", "Blender", "Headphones", "Chair",
		"Umbrella", "Notebook", "Thermos", "Speaker", "Toaster", "Tent", "Watch", "Scarf", "Router"}
)

// fsMakeProduct derives product i of the catalog from the seed.
func fsMakeProduct(seed int64, i int) FakeProduct {
	sku := "sku-" + strconv.Itoa(i)
	h := fpHash(seed, "product", sku)
	cents := 99 + h%99901 // 0.99 … 999.99
	return FakeProduct{
		SKU:      sku,
		Name:     fmt.Sprintf("%s %s %d", fsAdjectives[h>>20%16], fsNouns[h>>28%16], 100+h>>36%900),
		Price:    fmt.Sprintf("%d.%02d", cents/100, cents%100),
		Currency: "USD",
	}
}

var (
	fsBombOnce sync.Once
	fsBombGz   []byte
)

// fsBomb returns the gzip stream of /bomb, built once per process. Deflating 1 GiB takes
// seconds (much longer under -race), so it deflates 1 MiB chunks with sync flushes: once
// the window is all zeros, every later chunk encodes to the same bytes, which are
// repeated. If the encoder ever stops behaving so, it falls back to deflating everything.
func fsBomb() []byte {
	fsBombOnce.Do(func() {
		const chunk = 1 << 20
		zero := make([]byte, chunk)
		var out, buf bytes.Buffer
		out.Write([]byte{0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 2, 255}) // gzip header, no name, mtime 0
		fw, _ := flate.NewWriter(&buf, flate.BestCompression)
		pieces := make([][]byte, 3)
		for i := range pieces {
			_, _ = fw.Write(zero)
			_ = fw.Flush()
			pieces[i] = bytes.Clone(buf.Bytes())
			buf.Reset()
		}
		if bytes.Equal(pieces[1], pieces[2]) {
			_ = fw.Close()
			out.Write(pieces[0])
			for i := 1; i < FakeSiteBombSize/chunk; i++ {
				out.Write(pieces[1])
			}
			out.Write(buf.Bytes())
		} else {
			fw, _ = flate.NewWriter(&out, flate.BestCompression)
			for i := 0; i < FakeSiteBombSize/chunk; i++ {
				_, _ = fw.Write(zero)
			}
			_ = fw.Close()
		}
		crc := crc32.NewIEEE()
		for i := 0; i < FakeSiteBombSize/chunk; i++ {
			_, _ = crc.Write(zero)
		}
		out.Write(binary.LittleEndian.AppendUint32(nil, crc.Sum32()))
		out.Write(binary.LittleEndian.AppendUint32(nil, uint32(FakeSiteBombSize)))
		fsBombGz = out.Bytes()
	})
	return fsBombGz
}
