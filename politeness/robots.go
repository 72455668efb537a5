package politeness

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gocolly/colly/v2"
	"github.com/redis/go-redis/v9"
	"github.com/temoto/robotstxt"

	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/tasks"
)

// RobotsCache defaults.
const (
	// DefaultRobotsTTL is how long a fetched robots.txt is used when its Cache-Control
	// says nothing (and the most any max-age is honoured: RFC 9309 asks for at most 24 h).
	DefaultRobotsTTL = 24 * time.Hour
	// DefaultRobotsMinTTL is the least a fetched robots.txt is kept, whatever its
	// Cache-Control (max-age=0, no-store): one fetch per host per minute at most.
	DefaultRobotsMinTTL = time.Minute
	// DefaultRobotsErrorTTL is how long a robots.txt that answered 5xx counts as "disallow
	// everything" before it is fetched again (RFC 9309 §2.3.1.4).
	DefaultRobotsErrorTTL = time.Minute
	// DefaultRobotsLockMargin was how much longer than the fetch it guards a robots.txt
	// fetch lock lived.
	//
	// Deprecated: the lock is a lease renewed while its fetch runs (RobotsConfig.LockWaitMax);
	// RobotsConfig.LockMargin is ignored.
	DefaultRobotsLockMargin = 5 * time.Second
	// DefaultRobotsLockWaitMax caps a worker's wait for another worker's robots.txt fetch
	// (see RobotsConfig.LockWaitMax).
	DefaultRobotsLockWaitMax = 10 * time.Second
	// DefaultRobotsLocalTTL caps how long a process keeps a robots.txt in memory without
	// asking Redis again.
	DefaultRobotsLocalTTL = 5 * time.Minute
	// DefaultRobotsLocalEntries caps the in-process cache.
	DefaultRobotsLocalEntries = 10000
	// MaxRobotsBytes is how much of a robots.txt is read and cached (RFC 9309 asks parsers
	// to read at least 500 KiB).
	MaxRobotsBytes = 512 << 10
)

// RobotsConfig configures a RobotsCache.
type RobotsConfig struct {
	// Redis holds the shared cache and the fetch lock. Required.
	Redis redis.UniversalClient
	// KeyPrefix of the cache keys (lua.Keys.Robots, lua.Keys.RobotsLock). Defaults to
	// "idemscrape:".
	KeyPrefix string
	// TTL is how long a robots.txt without Cache-Control max-age is used, and the most any
	// max-age is honoured. Defaults to DefaultRobotsTTL.
	TTL time.Duration
	// MinTTL is the least a fetched robots.txt is kept. Defaults to DefaultRobotsMinTTL.
	MinTTL time.Duration
	// ErrorTTL is how long a 5xx robots.txt disallows everything before the next fetch.
	// Defaults to DefaultRobotsErrorTTL.
	ErrorTTL time.Duration
	// LockMargin was how much longer than the robots.txt fetch's own timeout the fetch lock
	// lived. The waiting workers then waited longer than their own request's timeout, so a
	// stopped holder made every request of the origin time out (and its unit restart on a
	// new session) for RequestTimeout + LockMargin.
	//
	// Deprecated: ignored. The lock is a lease renewed while its fetch runs; see
	// LockWaitMax.
	LockMargin time.Duration
	// LockWaitMax caps how long a worker waits for another worker's robots.txt fetch. The
	// wait is a quarter of what is left of the waiting request's own time — its context's
	// deadline, or the collector's RequestTimeout (Via.Timeout) if that is sooner — and at
	// most LockWaitMax, so it ends well before the request would time out.
	//
	// The fetch lock is a lease of half the wait of a request with the holder's
	// RequestTimeout (a quarter of it, at most LockWaitMax, halved), which the holder renews
	// every third of the lease while its fetch runs. A holder that stops — paused, killed,
	// cut off from Redis — frees the lock within one lease, before the waiting workers give
	// up: the first to take it fetches robots.txt itself, through its own session. A lock
	// still renewed when the wait ends (a live holder whose fetch is slow) ends the waiting
	// request as network (retryable): its attempt is retried later, not replayed on a new
	// session. Defaults to DefaultRobotsLockWaitMax; at least 1ms.
	LockWaitMax time.Duration
	// LocalTTL caps how long this process trusts its in-memory copy before reading Redis
	// again (never past the entry's own expiry). Defaults to DefaultRobotsLocalTTL.
	LocalTTL time.Duration
	// LocalEntries caps the in-memory copies. Defaults to DefaultRobotsLocalEntries.
	LocalEntries int
	// OnFetch, if set, is called after every robots.txt fetch this process made, with the
	// origin, the status (0 for a failure without one) and the bytes it moved through the
	// proxy. Those bytes are the fleet's, not the job's: they never count against a job's
	// bandwidth budget. It must not block.
	OnFetch func(origin string, status int, bytes int64)
	// OnLockWait, if set, is called when a wait for another worker's robots.txt fetch ends,
	// with the origin and how it ended. It must not block.
	OnLockWait func(origin string, outcome RobotsLockWait)
	// Now is the clock of the in-memory copies. Defaults to time.Now.
	Now func() time.Time
}

// RobotsCache is robots.txt for a whole fleet: one entry per origin (scheme://host[:port])
// in Redis with the file's TTL, fetched by one worker at a time, plus a small in-memory
// copy per process. The fetch lock (lua.Keys.RobotsLock, SET NX PX) holds a random owner
// token, is a short lease its holder renews while the fetch runs (see
// RobotsConfig.LockWaitMax) and is given up by compare-and-delete (lua.Unlock): a worker
// whose lock did expire never deletes the lock another worker took since. The others poll
// the entry until it appears or the lock ends, when the first to take the lock fetches;
// they wait at most a quarter of their request's time (RobotsConfig.LockWaitMax), then end
// the request as network (retryable). A collector with a RobotsCache
// (sessions.CollectorConfig.Robots) checks every hop against it (Check). The fetch goes
// through the session of the request that needed it (Via: same proxy, same exit), and its
// bytes are reported to OnFetch instead of the job.
//
// Status handling follows RFC 9309: 2xx is parsed (temoto/robotstxt, as colly does), 4xx
// allows everything, 5xx disallows everything for ErrorTTL — requests fail with category
// destination_error, which is retryable, so the jobs wait instead of failing (429 counts as
// 5xx here). A failure to reach the host at all (network, proxy, session lost) is not cached:
// the request fails with that failure's own, retryable, category. A disallowed
// path fails with category robots_disallowed (terminal). /robots.txt itself is always
// allowed.
//
// Redis round trips per job: none while the in-memory copy is fresh; else one GET; the one
// worker that fetches adds SET NX, GET, SET and the unlock script, and a renewal of the lock
// (WATCH, GET, MULTI/PEXPIRE/EXEC) every third of its lease while the fetch runs.
type RobotsCache struct {
	cfg  RobotsConfig
	keys lua.Keys

	mu    sync.Mutex
	local map[string]robotsLocal
}

type robotsLocal struct {
	entry   *robotsEntry
	expires time.Time
}

// robotsEntry is what Redis holds for an origin (JSON).
type robotsEntry struct {
	Status  int    `json:"status"`
	Body    string `json:"body,omitempty"`
	Expires int64  `json:"expires"` // unix ms, the fetching worker's clock

	data *robotstxt.RobotsData
}

// NewRobotsCache validates cfg and returns the cache.
func NewRobotsCache(cfg RobotsConfig) (*RobotsCache, error) {
	if cfg.Redis == nil {
		return nil, errors.New("politeness: RobotsConfig.Redis is required")
	}
	if cfg.KeyPrefix == "" {
		cfg.KeyPrefix = "idemscrape:"
	}
	defaults := []struct {
		name string
		v    *time.Duration
		def  time.Duration
	}{
		{"TTL", &cfg.TTL, DefaultRobotsTTL}, {"MinTTL", &cfg.MinTTL, DefaultRobotsMinTTL},
		{"ErrorTTL", &cfg.ErrorTTL, DefaultRobotsErrorTTL}, {"LockWaitMax", &cfg.LockWaitMax, DefaultRobotsLockWaitMax},
		{"LocalTTL", &cfg.LocalTTL, DefaultRobotsLocalTTL},
	}
	for _, d := range defaults {
		if *d.v == 0 {
			*d.v = d.def
		}
		if *d.v < time.Millisecond {
			return nil, fmt.Errorf("politeness: RobotsConfig.%s %v must be at least 1ms", d.name, *d.v)
		}
	}
	if cfg.MinTTL > cfg.TTL {
		return nil, fmt.Errorf("politeness: RobotsConfig.MinTTL %v must not exceed TTL %v", cfg.MinTTL, cfg.TTL)
	}
	if cfg.LocalEntries == 0 {
		cfg.LocalEntries = DefaultRobotsLocalEntries
	}
	if cfg.LocalEntries < 0 {
		return nil, fmt.Errorf("politeness: RobotsConfig.LocalEntries %d must be >= 0", cfg.LocalEntries)
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	keys, err := lua.NewKeys(cfg.KeyPrefix)
	if err != nil {
		return nil, err
	}
	return &RobotsCache{cfg: cfg, keys: keys, local: map[string]robotsLocal{}}, nil
}

// Via is the session a robots.txt is fetched through: the one whose request needed it, so
// that the fetch leaves by the same proxy and exit. sessions implements it for every
// collector; the cache needs nothing else of sessions.
type Via interface {
	// UserAgent is the agent the rules are tested for, and the fetch sends.
	UserAgent() string
	// Timeout bounds one robots.txt fetch as a whole: the host limit's waits, every
	// redirect and the body (the collector's RequestTimeout).
	Timeout() time.Duration
	// Get sends one GET of target through the session, as every hop goes: the SSRF guard
	// and the host limit first, the exit check and Retry-After after. It follows no
	// redirect, counts the bytes it moves — the response body's as it is read — in moved
	// instead of the job's, and ends the body (io.EOF) at the collector's size cap instead
	// of failing. Its error is already classified: the cache returns it as it is.
	Get(ctx context.Context, target string, moved *atomic.Int64) (*http.Response, error)
	// Fail classifies a failure of the fetch that Get did not see: a bad redirect, a body
	// that could not be read.
	Fail(err error) error
}

// Check returns nil when robots.txt lets via's user agent fetch u, or the error the
// request ends with: an *Error of category robots_disallowed (terminal) or
// destination_error (a robots.txt that answered 5xx or 429: retried later), network (another
// worker's fetch still held the lock when this request's wait ended: see
// RobotsConfig.LockWaitMax), internal (Redis); a failure of the fetch itself, as via
// classified it; or ctx's cause.
func (rc *RobotsCache) Check(ctx context.Context, via Via, u *url.URL) error {
	if u.EscapedPath() == "/robots.txt" {
		return nil
	}
	org := origin(u)
	e, err := rc.entry(ctx, via, org)
	if err != nil {
		return err
	}
	if robotsUnreachable(e.Status) {
		return &Error{Category: tasks.CategoryDestinationError, Status: e.Status,
			Err: fmt.Errorf("robots.txt of %s answered %d: every path is disallowed until it can be fetched (RFC 9309); retried later", org, e.Status)}
	}
	path := u.EscapedPath()
	if path == "" {
		path = "/"
	}
	test := path
	if u.RawQuery != "" {
		test += "?" + u.RawQuery
	}
	if !e.data.TestAgent(test, via.UserAgent()) {
		return &Error{Category: tasks.CategoryRobotsDisallowed,
			Err: fmt.Errorf("%w: robots.txt of %s disallows %s for user agent %q", colly.ErrRobotsTxtBlocked, org, path, via.UserAgent())}
	}
	return nil
}

// origin is the scheme://host[:port] a robots.txt belongs to (RFC 9309).
func origin(u *url.URL) string { return strings.ToLower(u.Scheme) + "://" + HostKey(u) }

// robotsPoll is how often a worker waiting for another's fetch looks again.
const robotsPoll = 50 * time.Millisecond

// RobotsLockWait is how a worker's wait for another worker's robots.txt fetch ended
// (RobotsConfig.OnLockWait).
type RobotsLockWait string

// The ends of a wait for another worker's robots.txt fetch.
const (
	// RobotsLockWaitEntry: the other worker's fetch arrived, and the request used it.
	RobotsLockWaitEntry RobotsLockWait = "entry"
	// RobotsLockWaitTookOver: the lock ended without an entry — its holder's fetch failed,
	// or the holder stopped and its lease lapsed — and this worker took the lock and
	// fetched robots.txt through its own session.
	RobotsLockWaitTookOver RobotsLockWait = "took_over"
	// RobotsLockWaitGaveUp: the lock was still held when the wait's bound passed, and the
	// request ended as network (retryable).
	RobotsLockWaitGaveUp RobotsLockWait = "gave_up"
)

// robotsWaitShare: a worker waits for another's fetch at most 1/robotsWaitShare of what is
// left of its request's time, so that the request still has the rest for its own fetch of
// robots.txt (when the lock ends) and its page, instead of timing out in the wait.
const robotsWaitShare = 4

// entry returns the origin's robots.txt: from memory, from Redis, or fetched through via.
func (rc *RobotsCache) entry(ctx context.Context, via Via, org string) (*robotsEntry, error) {
	now := rc.cfg.Now()
	rc.mu.Lock()
	l, ok := rc.local[org]
	rc.mu.Unlock()
	if ok && now.Before(l.expires) {
		return l.entry, nil
	}
	key, lockKey := rc.keys.Robots(org), rc.keys.RobotsLock(org)
	lease := rc.lockLease(via)
	var (
		owner   string        // this call's lock value (random, made when first needed): only this call gives the lock up
		wait    time.Duration // how long this call waits for another's fetch (lockWait)
		waitEnd time.Time     // when that wait ends; zero until this call first finds the lock taken
	)
	waited := func(outcome RobotsLockWait) {
		if !waitEnd.IsZero() && rc.cfg.OnLockWait != nil {
			rc.cfg.OnLockWait(org, outcome)
		}
	}
	for {
		raw, err := rc.cfg.Redis.Get(ctx, key).Result()
		switch {
		case err == nil:
			if e, derr := decodeRobots(raw); derr == nil {
				waited(RobotsLockWaitEntry)
				rc.remember(org, e)
				return e, nil
			}
			// An unreadable entry (another version wrote it): fetch again.
		case !errors.Is(err, redis.Nil):
			return nil, rc.redisFailure(ctx, org, err)
		}
		if owner == "" {
			owner = rand.Text()
		}
		got, err := rc.cfg.Redis.SetNX(ctx, lockKey, owner, lease).Result()
		if err != nil {
			return nil, rc.redisFailure(ctx, org, err)
		}
		if got {
			// Another worker may have filled the entry and dropped its lock between our GET
			// and our SET NX: look once more before fetching.
			if raw, err := rc.cfg.Redis.Get(ctx, key).Result(); err == nil {
				if e, derr := decodeRobots(raw); derr == nil {
					rc.unlock(ctx, lockKey, owner)
					waited(RobotsLockWaitEntry)
					rc.remember(org, e)
					return e, nil
				}
			}
			waited(RobotsLockWaitTookOver)
			return rc.fetchLocked(ctx, via, org, key, lockKey, owner, lease)
		}
		if waitEnd.IsZero() {
			wait = rc.lockWait(ctx, via)
			waitEnd = time.Now().Add(wait)
		}
		if !time.Now().Before(waitEnd) {
			waited(RobotsLockWaitGaveUp)
			return nil, &Error{Category: tasks.CategoryNetwork,
				Err: fmt.Errorf("robots.txt of %s: another worker's fetch still holds the lock after this request waited %v for it (a quarter of its time, at most LockWaitMax); retried later", org, wait.Round(time.Millisecond))}
		}
		t := time.NewTimer(min(robotsPoll, time.Until(waitEnd)))
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, context.Cause(ctx)
		case <-t.C:
		}
	}
}

// fetchLocked fetches org's robots.txt through via under the fetch lock this call holds
// (lockKey = owner, with lease), stores it under key for its TTL and gives the lock up. The
// lock is renewed while the fetch runs (keepLock).
func (rc *RobotsCache) fetchLocked(ctx context.Context, via Via, org, key, lockKey, owner string, lease time.Duration) (*robotsEntry, error) {
	stop := rc.keepLock(ctx, lockKey, owner, lease)
	defer rc.unlock(ctx, lockKey, owner) // deferred first: runs after stop, so no renewal follows the unlock
	defer stop()
	e, err := rc.fetch(ctx, via, org)
	if err != nil {
		// Not the host's answer (session lost, proxy refusal, timeout): nothing is cached,
		// the next worker may try at once.
		return nil, err
	}
	ttl := time.Duration(e.Expires-rc.cfg.Now().UnixMilli()) * time.Millisecond
	raw, _ := json.Marshal(e)
	if err := rc.cfg.Redis.Set(ctx, key, raw, max(ttl, time.Millisecond)).Err(); err != nil {
		return nil, rc.redisFailure(ctx, org, err)
	}
	rc.remember(org, e)
	return e, nil
}

// robotsUnlockTimeout bounds giving a fetch lock up, which runs even when the request's
// context is done (else the lock would hold the others back until it expires).
const robotsUnlockTimeout = 5 * time.Second

// lockWait is how long a request waits for another worker's fetch: a quarter of what is
// left of its time (ctx's deadline, or via.Timeout if sooner), at most LockWaitMax. A
// request of the holder's RequestTimeout waits two of the holder's leases (lockLease), so
// a stopped holder's lock lapses while the others still wait.
func (rc *RobotsCache) lockWait(ctx context.Context, via Via) time.Duration {
	left := via.Timeout()
	if dl, ok := ctx.Deadline(); ok {
		left = min(left, time.Until(dl))
	}
	return max(min(left/robotsWaitShare, rc.cfg.LockWaitMax), 0)
}

// lockLease is the fetch lock's lease for a fetch through via: half the wait of a request
// with via's whole RequestTimeout (lockWait), at least 1ms. Its holder renews it every third
// of it while the fetch runs (keepLock), so the lock lives as long as the fetch, however
// slow, but a holder that stops frees it within one lease.
func (rc *RobotsCache) lockLease(via Via) time.Duration {
	return max(min(via.Timeout()/robotsWaitShare, rc.cfg.LockWaitMax)/2, time.Millisecond)
}

// keepLock renews the fetch lock (lockKey = owner) to lease every third of lease until
// stop is called, which waits for the renewals to end. It stops on its own once a renewal
// finds the lock gone or another's: this process stalled past the lease and another worker
// may be fetching by now. This fetch still ends and stores its answer (the same file, or a
// fresher one). A renewal that fails (Redis) is tried again at the next tick: the lease
// leaves two of them before it lapses.
func (rc *RobotsCache) keepLock(ctx context.Context, lockKey, owner string, lease time.Duration) (stop func()) {
	done := make(chan struct{})
	ended := make(chan struct{})
	go func() {
		defer close(ended)
		t := time.NewTicker(max(lease/3, time.Millisecond))
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case <-t.C:
			}
			rctx, cancel := context.WithTimeout(ctx, lease)
			held, err := rc.renewLock(rctx, lockKey, owner, lease)
			cancel()
			if err == nil && !held {
				return
			}
		}
	}()
	return func() {
		close(done)
		<-ended
	}
}

// renewLock extends the fetch lock to lease if it still holds owner: WATCH, GET, then
// MULTI/PEXPIRE/EXEC, which Redis refuses if the lock changed since the GET. A
// compare-and-expire without a script, as the lease scripts of package lua are written for
// job keys (lua/renew.lua does the same for those). held is false when the lock is gone or
// another's.
func (rc *RobotsCache) renewLock(ctx context.Context, lockKey, owner string, lease time.Duration) (held bool, err error) {
	err = rc.cfg.Redis.Watch(ctx, func(tx *redis.Tx) error {
		cur, err := tx.Get(ctx, lockKey).Result()
		if err != nil || cur != owner {
			return err // redis.Nil: gone
		}
		var expire *redis.BoolCmd
		if _, err := tx.TxPipelined(ctx, func(p redis.Pipeliner) error {
			expire = p.PExpire(ctx, lockKey, lease)
			return nil
		}); err != nil {
			return err
		}
		held = expire.Val()
		return nil
	}, lockKey)
	if errors.Is(err, redis.Nil) || errors.Is(err, redis.TxFailedErr) {
		// Gone, or changed between the GET and the EXEC: only an expiry and another
		// worker's SET NX change it, so it is not ours any more.
		return false, nil
	}
	return held, err
}

// unlock gives the fetch lock up if it still holds owner (lua.Unlock). A lock that expired,
// or that another worker took since, is left alone: it is not ours to delete. Errors are
// not the request's: at worst the lock holds the others back until it expires.
func (rc *RobotsCache) unlock(ctx context.Context, lockKey, owner string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), robotsUnlockTimeout)
	defer cancel()
	_ = lua.Unlock(ctx, rc.cfg.Redis, lockKey, owner)
}

func (rc *RobotsCache) redisFailure(ctx context.Context, org string, err error) error {
	if ctx.Err() != nil {
		return context.Cause(ctx)
	}
	// %v, not %w: the text of Redis's error, not its chain (nothing it wraps travels on).
	return &Error{Category: tasks.CategoryInternal, Err: fmt.Errorf("robots.txt cache of %s: %v", org, err)}
}

func (rc *RobotsCache) remember(org string, e *robotsEntry) {
	now := rc.cfg.Now()
	exp := time.UnixMilli(e.Expires)
	if cap := now.Add(rc.cfg.LocalTTL); cap.Before(exp) {
		exp = cap
	}
	rc.mu.Lock()
	defer rc.mu.Unlock()
	if len(rc.local) >= rc.cfg.LocalEntries {
		// Full: drop the expired copies, or everything if none has expired (a simple
		// bound; the entries are in Redis anyway).
		for k, v := range rc.local {
			if !now.Before(v.expires) {
				delete(rc.local, k)
			}
		}
		if len(rc.local) >= rc.cfg.LocalEntries {
			clear(rc.local)
		}
	}
	if rc.cfg.LocalEntries > 0 {
		rc.local[org] = robotsLocal{entry: e, expires: exp}
	}
}

func decodeRobots(raw string) (*robotsEntry, error) {
	var e robotsEntry
	if err := json.Unmarshal([]byte(raw), &e); err != nil {
		return nil, err
	}
	return e.parse()
}

func (e *robotsEntry) parse() (*robotsEntry, error) {
	status := e.Status
	switch {
	case robotsUnreachable(status):
		status = http.StatusServiceUnavailable
	case status >= 300 && status < 400:
		status = http.StatusNotFound // redirects not followed to the end: no robots.txt, allow all
	}
	data, err := robotstxt.FromStatusAndBytes(status, []byte(e.Body))
	if err != nil {
		// Unparsable: as if there was none (RFC 9309 asks parsers to be lenient).
		data, _ = robotstxt.FromStatusAndBytes(http.StatusNotFound, nil)
	}
	e.data = data
	return e, nil
}

// robotsUnreachable: a robots.txt answer that means "ask again later" and, until then,
// "disallow everything": 5xx (RFC 9309 §2.3.1.4), and 429, which is a server asking for
// less traffic rather than a missing file.
func robotsUnreachable(status int) bool {
	return status >= 500 || status == http.StatusTooManyRequests
}

// maxRobotsRedirects is how many redirects a robots.txt fetch follows (RFC 9309: at least 5).
const maxRobotsRedirects = 5

// fetch gets org's robots.txt through via, the session that needed it: every hop passes
// the guard and the host limit (Via.Get); the bytes go to OnFetch, not to the job.
func (rc *RobotsCache) fetch(ctx context.Context, via Via, org string) (*robotsEntry, error) {
	var moved atomic.Int64
	status := 0
	defer func() {
		if rc.cfg.OnFetch != nil {
			rc.cfg.OnFetch(org, status, moved.Load())
		}
	}()
	ctx, cancel := context.WithTimeout(ctx, via.Timeout()) // the lock is renewed while it runs: keepLock
	defer cancel()
	target := org + "/robots.txt"
	for hop := 0; ; hop++ {
		u, err := url.Parse(target)
		if err != nil {
			return nil, via.Fail(fmt.Errorf("robots.txt of %s: bad redirect: %w", org, err))
		}
		res, err := via.Get(ctx, target, &moved)
		if err != nil {
			return nil, err
		}
		status = res.StatusCode
		body, rerr := io.ReadAll(io.LimitReader(res.Body, MaxRobotsBytes))
		res.Body.Close()
		if loc := res.Header.Get("Location"); status >= 300 && status < 400 && loc != "" && hop < maxRobotsRedirects {
			next, err := u.Parse(loc)
			if err != nil {
				return nil, via.Fail(fmt.Errorf("robots.txt of %s: bad redirect: %w", org, err))
			}
			target = next.String()
			continue
		}
		if rerr != nil {
			return nil, via.Fail(rerr)
		}
		e := &robotsEntry{Status: status, Expires: rc.cfg.Now().Add(rc.ttl(status, res.Header)).UnixMilli()}
		if status >= 200 && status < 300 {
			e.Body = string(body)
		}
		return e.parse()
	}
}

// ttl is how long a robots.txt answer is used: 5xx ErrorTTL; otherwise Cache-Control
// max-age (s-maxage wins) clamped to [MinTTL, TTL], or TTL.
func (rc *RobotsCache) ttl(status int, h http.Header) time.Duration {
	if robotsUnreachable(status) {
		return rc.cfg.ErrorTTL
	}
	ttl := rc.cfg.TTL
	age, sAge, noCache := -1, -1, false
	for _, part := range strings.Split(h.Get("Cache-Control"), ",") {
		name, val, _ := strings.Cut(strings.TrimSpace(strings.ToLower(part)), "=")
		n, err := strconv.Atoi(strings.Trim(val, `"`))
		switch {
		case name == "no-store" || name == "no-cache":
			noCache = true
		case name == "max-age" && err == nil && n >= 0:
			age = n
		case name == "s-maxage" && err == nil && n >= 0:
			sAge = n
		}
	}
	if sAge >= 0 {
		age = sAge
	}
	if noCache {
		age = 0
	}
	if age >= 0 {
		ttl = min(time.Duration(min(age, 10*365*86400))*time.Second, rc.cfg.TTL)
	}
	return max(ttl, rc.cfg.MinTTL)
}
