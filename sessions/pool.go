package sessions

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/idemscrape/idemscrape/sessions/profile"
	"github.com/idemscrape/idemscrape/tasks"
)

// A Pool keeps healthy sticky sessions warm between units, as Crawlee's SessionPool does:
// a unit that finished well hands its session — the sticky id and so its exit, its cookie
// jar, its client identity — back, and the next unit for the same destination takes it
// instead of opening a new exit that must pass the site's checks again (a consent page, a
// bot challenge whose clearance cookie is bound to the exit, a login).
//
// The unit rules do not change: a unit runs on one session from its first step to its last,
// and one session serves one unit at a time (a session is out of the pool while a unit
// holds it). A warm session starts its unit knowing the exit its last unit ended on; with
// a provider that names the exit (Provider.WithExitHeader) a first answer from another exit
// ends the session as lost before anything is staged, and the unit replays on another
// session: a warm one of its key when one is idle (never the lost one), else a new one.
//
// Sessions are kept per PoolKey: provider, tier, country and destination host. A session is
// retired — dropped, never handed out again — after PoolConfig.MaxUnits units, when less than
// PoolConfig.MinRemaining of its sticky lifetime is left (so a unit never starts on a
// session the provider would re-assign under it), after PoolConfig.IdleTimeout unused, and
// whenever its unit did not end well: any failure of the unit (a block, a lost or changed
// exit, a timeout, a validation failure) or a parser's verdict the caller reports with
// PoolLease.Retire.
//
// What is not carried from unit to unit: HTTPS tunnels (each unit opens its own CONNECT on
// the same sticky credentials, so it reaches the same exit; a tunnel's bytes are charged to
// the unit that opened it) and the staging. Plain-HTTP connections to the gateway are shared
// by every session anyway (CollectorConfig.IsolatePlainHTTP).
type Pool struct {
	cfg PoolConfig

	mu        sync.Mutex
	idle      map[PoolKey][]*pooledSession // per key, least recently returned first
	idleN     int                          // idle sessions, all keys
	busy      map[PoolKey]int
	lastSweep time.Time
	closed    bool
}

// PoolKey is what a warm session may be reused for: the same provider account and tier,
// the same requested exit country, the same destination host.
type PoolKey struct {
	Provider string
	Tier     string
	Country  string // upper case, "" = any
	Host     string // the destination host (Unit.Site), lower case, without port
	// Client tells apart the runs whose sessions must not mix although they go to one host:
	// another scope (RunConfig.PoolScope: handlers sets the kind's name), client profile
	// choice (RunConfig.Profiles), cookie policy (RunConfig.PoolCookies) or asked lifetime
	// (RunConfig.SessionLifetime). "" for runs with none of them.
	Client string
}

func (k PoolKey) String() string {
	s := k.Provider + "/" + k.Tier + "/" + k.Country + "/" + k.Host
	if k.Client != "" {
		s += "/" + k.Client
	}
	return s
}

// clientKey is PoolKey.Client for a run's scope, profile options, cookie policy and asked
// session lifetime.
func clientKey(scope string, p *profile.Options, cookies []string, lifetime time.Duration) string {
	var parts []string
	if scope != "" {
		parts = append(parts, fmt.Sprintf("scope=%q", scope))
	}
	if p != nil {
		parts = append(parts, fmt.Sprintf("profiles=%s;%s;%v", strings.Join(p.Browsers, ","), strings.Join(p.Locales, ","), p.ChromiumOnly))
	}
	if cookies != nil {
		parts = append(parts, "cookies="+strings.Join(cookies, ","))
	}
	if lifetime != 0 {
		parts = append(parts, "lifetime="+lifetime.String())
	}
	return strings.Join(parts, " ")
}

// PoolConfig configures a Pool. The zero value is valid: every field has a default.
type PoolConfig struct {
	// MaxUnits is how many units one session serves before it is retired (Crawlee's
	// maxUsageCount). Defaults to DefaultPoolMaxUnits.
	MaxUnits int
	// MaxAge retires a session this long after it was opened, whatever is left of its
	// sticky lifetime. Defaults to 0: only MinRemaining and the lifetime bound it.
	MaxAge time.Duration
	// MinRemaining is how much of its sticky lifetime a session must have left to start a
	// unit: a unit that could outlast it starts on a fresher session instead. Keep it above
	// a unit's longest run. Defaults to DefaultPoolMinRemaining; for a session whose
	// lifetime is shorter than twice that, half its lifetime.
	MinRemaining time.Duration
	// IdleTimeout retires a session unused this long (residential exits drop idle
	// devices). Defaults to DefaultPoolIdleTimeout.
	IdleTimeout time.Duration
	// MaxIdle bounds the idle sessions kept per key; the one unused longest is retired
	// first. Defaults to DefaultPoolMaxIdle.
	MaxIdle int
	// MaxIdleTotal bounds the idle sessions of all keys together (a broad crawl visits
	// many hosts once): a session handed back over it is retired. Idle sessions of every
	// key are swept for IdleTimeout and age at most every IdleTimeout/2, whenever the pool
	// is used. Defaults to DefaultPoolMaxIdleTotal.
	MaxIdleTotal int
	// OnRetire, when set, hears every retirement with its reason (one of the PoolRetire*
	// constants), e.g. for a metric. Called without the pool's lock; keep it quick.
	OnRetire func(key PoolKey, reason string)
}

// Pool defaults.
const (
	DefaultPoolMaxUnits     = 25
	DefaultPoolMinRemaining = 2 * time.Minute
	DefaultPoolIdleTimeout  = 2 * time.Minute
	DefaultPoolMaxIdle      = 16
	DefaultPoolMaxIdleTotal = 1024
)

// Why a pooled session was retired (PoolConfig.OnRetire, the retirement metric).
const (
	PoolRetireMaxUnits = "max_units" // served PoolConfig.MaxUnits units
	PoolRetireAge      = "age"       // too little sticky lifetime left, or MaxAge passed
	PoolRetireIdle     = "idle"      // unused for IdleTimeout, or over MaxIdle
	PoolRetireBlocked  = "blocked"   // the destination blocked it (a status or the parser)
	PoolRetireExit     = "exit"      // its exit was lost or changed
	PoolRetireFailed   = "failed"    // its unit failed otherwise
	PoolRetireClosed   = "closed"    // the pool closed
)

// Validate reports a configuration that can not work.
func (c PoolConfig) Validate() error {
	var errs []error
	if c.MaxUnits < 0 {
		errs = append(errs, fmt.Errorf("MaxUnits %d is negative", c.MaxUnits))
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"MaxAge", c.MaxAge}, {"MinRemaining", c.MinRemaining}, {"IdleTimeout", c.IdleTimeout}} {
		if d.v < 0 {
			errs = append(errs, fmt.Errorf("%s %v is negative", d.name, d.v))
		}
	}
	if c.MaxIdle < 0 {
		errs = append(errs, fmt.Errorf("MaxIdle %d is negative", c.MaxIdle))
	}
	if c.MaxIdleTotal < 0 {
		errs = append(errs, fmt.Errorf("MaxIdleTotal %d is negative", c.MaxIdleTotal))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("sessions: pool: %w", err)
	}
	return nil
}

// NewPool returns an empty pool. Close it when the worker stops.
func NewPool(cfg PoolConfig) (*Pool, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.MaxUnits == 0 {
		cfg.MaxUnits = DefaultPoolMaxUnits
	}
	if cfg.MinRemaining == 0 {
		cfg.MinRemaining = DefaultPoolMinRemaining
	}
	if cfg.IdleTimeout == 0 {
		cfg.IdleTimeout = DefaultPoolIdleTimeout
	}
	if cfg.MaxIdle == 0 {
		cfg.MaxIdle = DefaultPoolMaxIdle
	}
	if cfg.MaxIdleTotal == 0 {
		cfg.MaxIdleTotal = DefaultPoolMaxIdleTotal
	}
	return &Pool{cfg: cfg, idle: map[PoolKey][]*pooledSession{}, busy: map[PoolKey]int{}}, nil
}

// pooledSession is a session the pool knows: idle in its list, or held by one unit.
type pooledSession struct {
	key      PoolKey
	sess     *Session
	jar      http.CookieJar
	units    int       // units it finished well
	exit     string    // the exit its last unit ended on ("" = not named)
	returned time.Time // when it was last handed back
	held     bool
}

// PoolStat is one key's sessions at a moment.
type PoolStat struct {
	Key  PoolKey
	Idle int // warm, waiting for a unit
	Busy int // held by a unit
}

// Stats returns every key's idle and busy sessions, in key order.
func (p *Pool) Stats() []PoolStat {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []PoolStat
	seen := map[PoolKey]bool{}
	for k, l := range p.idle {
		seen[k] = true
		out = append(out, PoolStat{Key: k, Idle: len(l), Busy: p.busy[k]})
	}
	for k, n := range p.busy {
		if !seen[k] {
			out = append(out, PoolStat{Key: k, Busy: n})
		}
	}
	slices.SortFunc(out, func(a, b PoolStat) int { return strings.Compare(a.Key.String(), b.Key.String()) })
	return out
}

// Close retires every idle session; sessions held by a unit are retired when it hands them
// back. A closed pool hands out nothing.
func (p *Pool) Close() {
	p.mu.Lock()
	p.closed = true
	var gone []*pooledSession
	for k, l := range p.idle {
		gone = append(gone, l...)
		delete(p.idle, k)
	}
	p.idleN = 0
	p.mu.Unlock()
	for _, ps := range gone {
		p.heard(ps.key, PoolRetireClosed)
	}
}

func (p *Pool) heard(key PoolKey, reason string) {
	if p.cfg.OnRetire != nil {
		p.cfg.OnRetire(key, reason)
	}
}

// minRemaining is how much lifetime s must have left to start a unit.
func (p *Pool) minRemaining(s *Session) time.Duration {
	return min(p.cfg.MinRemaining, s.MaxLifetime/2)
}

// usable says why a session may not start a unit at now ("" = it may).
func (p *Pool) usable(ps *pooledSession, now time.Time) string {
	s := ps.sess
	switch {
	case ps.units >= p.cfg.MaxUnits:
		return PoolRetireMaxUnits
	case s.Created.Add(s.MaxLifetime).Sub(now) < p.minRemaining(s):
		return PoolRetireAge
	case p.cfg.MaxAge > 0 && now.Sub(s.Created) >= p.cfg.MaxAge:
		return PoolRetireAge
	case !ps.returned.IsZero() && now.Sub(ps.returned) >= p.cfg.IdleTimeout:
		return PoolRetireIdle
	}
	return ""
}

// take hands out the warm session of key returned last (its exit is the likeliest still
// up), retiring on the way those no longer usable; nil when none is left.
func (p *Pool) take(key PoolKey, now time.Time) *pooledSession {
	var retired []retirement
	defer func() { p.hearAll(retired) }()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	retired = p.sweepLocked(now)
	l := p.idle[key]
	for len(l) > 0 {
		ps := l[len(l)-1]
		l[len(l)-1] = nil // no reference to a session out of the list
		l = l[:len(l)-1]
		p.idleN--
		if why := p.usable(ps, now); why != "" {
			retired = append(retired, retirement{key, why})
			continue
		}
		p.setIdle(key, l)
		ps.held = true
		p.busy[key]++
		return ps
	}
	p.setIdle(key, l)
	return nil
}

// retirement is one session retired under the lock, heard after it.
type retirement struct {
	key    PoolKey
	reason string
}

func (p *Pool) hearAll(rs []retirement) {
	for _, r := range rs {
		p.heard(r.key, r.reason)
	}
}

// sweepLocked retires the idle sessions of every key that can no longer start a unit, at
// most every IdleTimeout/2. p.mu is held.
func (p *Pool) sweepLocked(now time.Time) []retirement {
	if now.Sub(p.lastSweep) < p.cfg.IdleTimeout/2 {
		return nil
	}
	p.lastSweep = now
	var out []retirement
	for key, l := range p.idle {
		kept := l[:0]
		for _, ps := range l {
			if why := p.usable(ps, now); why != "" {
				out = append(out, retirement{key, why})
				p.idleN--
				continue
			}
			kept = append(kept, ps)
		}
		clear(l[len(kept):])
		p.setIdle(key, kept)
	}
	return out
}

func (p *Pool) setIdle(key PoolKey, l []*pooledSession) {
	if len(l) == 0 {
		delete(p.idle, key)
		return
	}
	p.idle[key] = l
}

// fresh makes a new session the pool's, held by the unit that opened it.
func (p *Pool) fresh(key PoolKey, s *Session) *pooledSession {
	jar, _ := cookiejar.New(nil) // never fails with nil options
	ps := &pooledSession{key: key, sess: s, jar: jar, held: true}
	p.mu.Lock()
	p.busy[key]++
	p.mu.Unlock()
	return ps
}

// giveBack ends a unit's hold on ps: kept warm when keep and still usable, else retired
// with reason (or the reason it is no longer usable).
func (p *Pool) giveBack(ps *pooledSession, keep bool, reason string, now time.Time) {
	p.mu.Lock()
	if !ps.held {
		p.mu.Unlock()
		return
	}
	ps.held = false
	p.busy[ps.key]--
	if p.busy[ps.key] <= 0 {
		delete(p.busy, ps.key)
	}
	retired := p.sweepLocked(now)
	if keep {
		ps.units++
		ps.returned = now
		switch why := p.usable(ps, now); {
		case p.closed:
			keep, reason = false, PoolRetireClosed
		case why != "":
			keep, reason = false, why
		case p.idleN >= p.cfg.MaxIdleTotal:
			keep, reason = false, PoolRetireIdle
		default:
			p.idle[ps.key] = append(p.idle[ps.key], ps)
			p.idleN++
			if l := p.idle[ps.key]; len(l) > p.cfg.MaxIdle {
				l[0] = nil
				p.idle[ps.key] = l[1:]
				p.idleN--
				retired = append(retired, retirement{ps.key, PoolRetireIdle})
			}
		}
	}
	if !keep {
		retired = append(retired, retirement{ps.key, reason})
	}
	p.mu.Unlock()
	p.hearAll(retired)
}

// PoolLease is a unit's hold on its pooled session after a successful Unit.Run
// (Result.Lease): the caller, once it knows whether the session is still welcome — its
// parser did not find a block page — calls Keep to hand it back warm, or Retire. Only the
// first call counts; a lease never ended holds the session out of the pool, so end it on
// every path (e.g. a deferred Retire after the Keep).
type PoolLease struct {
	pool *Pool
	ps   *pooledSession
	now  func() time.Time
	once sync.Once
}

// Keep hands the session back to the pool warm (or retires it if it has served its
// MaxUnits or is too old to start another unit).
func (l *PoolLease) Keep() {
	if l == nil {
		return
	}
	l.once.Do(func() { l.pool.giveBack(l.ps, true, "", l.now()) })
}

// Retire closes the session for good; reason is one of the PoolRetire* constants.
func (l *PoolLease) Retire(reason string) {
	if l == nil {
		return
	}
	l.once.Do(func() { l.pool.giveBack(l.ps, false, reason, l.now()) })
}

// retireReason maps a unit's failure to why its session is retired.
func retireReason(fe *FetchError) string {
	switch {
	case fe == nil:
		return PoolRetireFailed
	case fe.Category == tasks.CategoryBlocked, fe.Status == http.StatusForbidden, fe.Status == http.StatusTooManyRequests:
		return PoolRetireBlocked
	case replayable(fe.Category), errors.Is(fe, ErrExitChanged):
		return PoolRetireExit
	}
	return PoolRetireFailed
}

// siteHost is the pool's form of a Unit.Site: lower case, without a port or a scheme.
func siteHost(site string) string {
	if u, err := url.Parse(site); err == nil && u.Host != "" {
		site = u.Host
	}
	if h, _, err := net.SplitHostPort(site); err == nil {
		site = h
	}
	return strings.ToLower(strings.Trim(site, "[]"))
}

// keptCookies is the jar a warm session takes to its next unit: jar itself when every
// cookie survives (keep nil), else a new jar holding only the cookies named in keep that
// jar sends to the site's root (as host-only cookies of the site, path /).
func keptCookies(jar http.CookieJar, site string, keep []string) http.CookieJar {
	if keep == nil {
		return jar
	}
	next, _ := cookiejar.New(nil)
	host := site
	if u, err := url.Parse(site); err == nil && u.Host != "" {
		host = u.Host
	}
	for _, scheme := range []string{"https", "http"} {
		root := &url.URL{Scheme: scheme, Host: host, Path: "/"}
		var kept []*http.Cookie
		for _, c := range jar.Cookies(root) {
			if slices.Contains(keep, c.Name) {
				kept = append(kept, &http.Cookie{Name: c.Name, Value: c.Value, Path: "/", Secure: scheme == "https"})
			}
		}
		if len(kept) > 0 {
			next.SetCookies(root, kept)
		}
	}
	return next
}
