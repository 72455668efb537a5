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
	// DefaultRobotsLockMargin is how much longer than the fetch it guards a robots.txt
	// fetch lock lives (see RobotsConfig.LockMargin).
	DefaultRobotsLockMargin = 5 * time.Second
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
	// LockMargin is how much longer than the robots.txt fetch's own timeout the fetch lock
	// lives. The fetch is bounded by the collector's RequestTimeout as a whole (host-limit
	// waits, every redirect and the body included), and its lock expires RequestTimeout +
	// LockMargin after it was taken, so it can not expire while its fetch still runs: the
	// margin covers the Redis round trips around the fetch and a short stall of the worker.
	// Another worker of the origin waits at most its own RequestTimeout + LockMargin for
	// the fetch before its attempt gives up as network (retryable). Defaults to
	// DefaultRobotsLockMargin; at least 1ms.
	LockMargin time.Duration
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
	// Now is the clock of the in-memory copies. Defaults to time.Now.
	Now func() time.Time
}

// RobotsCache is robots.txt for a whole fleet: one entry per origin (scheme://host[:port])
// in Redis with the file's TTL, fetched by one worker at a time, plus a small in-memory
// copy per process. The fetch lock (lua.Keys.RobotsLock, SET NX PX) holds a random owner
// token, lives longer than the fetch it guards (RequestTimeout + LockMargin) and is given
// up by compare-and-delete (lua.Unlock): a worker whose lock did expire never deletes the
// lock another worker took since. The others poll the entry until it appears or the lock
// expires. A collector with a RobotsCache (sessions.CollectorConfig.Robots) checks every
// hop against it (Check). The fetch goes through the session of the request that needed it
// (Via: same proxy, same exit), and its bytes are reported to OnFetch instead of the job.
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
// worker that fetches adds SET NX, GET, SET and the unlock script.
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
		{"ErrorTTL", &cfg.ErrorTTL, DefaultRobotsErrorTTL}, {"LockMargin", &cfg.LockMargin, DefaultRobotsLockMargin},
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
// worker's fetch took too long), internal (Redis); a failure of the fetch itself, as via
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
	lockTTL := rc.lockTTL(via)
	deadline := time.Now().Add(lockTTL + robotsPoll)
	owner := "" // this call's lock value (random, made when first needed): only this call gives the lock up
	for {
		raw, err := rc.cfg.Redis.Get(ctx, key).Result()
		switch {
		case err == nil:
			if e, derr := decodeRobots(raw); derr == nil {
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
		got, err := rc.cfg.Redis.SetNX(ctx, lockKey, owner, lockTTL).Result()
		if err != nil {
			return nil, rc.redisFailure(ctx, org, err)
		}
		if got {
			// Another worker may have filled the entry and dropped its lock between our GET
			// and our SET NX: look once more before fetching.
			if raw, err := rc.cfg.Redis.Get(ctx, key).Result(); err == nil {
				if e, derr := decodeRobots(raw); derr == nil {
					rc.unlock(ctx, lockKey, owner)
					rc.remember(org, e)
					return e, nil
				}
			}
			e, ferr := rc.fetch(ctx, via, org)
			if ferr != nil {
				// Not the host's answer (session lost, proxy refusal, timeout): nothing is
				// cached, the next worker may try at once.
				rc.unlock(ctx, lockKey, owner)
				return nil, ferr
			}
			ttl := time.Duration(e.Expires-rc.cfg.Now().UnixMilli()) * time.Millisecond
			raw, _ := json.Marshal(e)
			if err := rc.cfg.Redis.Set(ctx, key, raw, max(ttl, time.Millisecond)).Err(); err != nil {
				rc.unlock(ctx, lockKey, owner)
				return nil, rc.redisFailure(ctx, org, err)
			}
			rc.unlock(ctx, lockKey, owner)
			rc.remember(org, e)
			return e, nil
		}
		if !time.Now().Before(deadline) {
			return nil, &Error{Category: tasks.CategoryNetwork,
				Err: fmt.Errorf("robots.txt of %s: another worker has been fetching it for more than %v; retried later", org, lockTTL)}
		}
		t := time.NewTimer(robotsPoll)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, context.Cause(ctx)
		case <-t.C:
		}
	}
}

// robotsUnlockTimeout bounds giving a fetch lock up, which runs even when the request's
// context is done (else the lock would hold the others back until it expires).
const robotsUnlockTimeout = 5 * time.Second

// lockTTL is how long the fetch lock of a fetch through via lives: strictly longer than the
// fetch (via.Timeout, plus LockMargin, at least 1ms), so it can not expire while the fetch
// runs.
func (rc *RobotsCache) lockTTL(via Via) time.Duration {
	return via.Timeout() + rc.cfg.LockMargin
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
	ctx, cancel := context.WithTimeout(ctx, via.Timeout()) // the lock outlives it: lockTTL
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
