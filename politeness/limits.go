package politeness

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/tasks"
)

// HostLimiter paces requests per destination host. A bound collector
// (sessions.CollectorConfig.Limiter) calls Wait before every hop — redirects and robots.txt
// fetches included — and Pause when a host answered 429 or 503 with Retry-After. Limiter
// implements it fleet-wide on Redis.
type HostLimiter interface {
	// Wait blocks until a request to host (HostKey: host[:port], lower case) may be sent.
	// It returns ctx's error when ctx ends first, and an error of category throttled
	// (RetryAfter set) when the wait would be longer than the limiter allows a job to hold
	// its lease idle.
	Wait(ctx context.Context, host string) error
	// Pause asks every worker to send nothing to host for d. Best effort: it must not
	// block long, and a failure only loses the shared back-off.
	Pause(ctx context.Context, host string, d time.Duration)
}

// Limit is the fleet-wide request rate of one destination host: Rate requests per second (0:
// unpaced, only a pause holds requests back), Burst back to back after an idle period
// (0 means 1). It is lua.Limit, the type the rate script's wrapper (lua.HostLimits) takes,
// named here where the rest of the politeness configuration is.
type Limit = lua.Limit

// HostKey is the destination host a rate limit (and a pause) applies to: host[:port], lower
// case, the scheme's default port dropped ("shop.example", "127.0.0.1:8080").
func HostKey(u *url.URL) string {
	host := strings.ToLower(u.Hostname())
	port := u.Port()
	if port == "" || (u.Scheme == "http" && port == "80") || (u.Scheme == "https" && port == "443") {
		return host
	}
	return net.JoinHostPort(host, port)
}

// Host limit defaults.
const (
	// DefaultHostWaitMax is the longest a request waits for its host's slot.
	DefaultHostWaitMax = 10 * time.Second
	// MaxHostPause caps how long one Retry-After pauses a host for the whole fleet. The job
	// that received it still waits its full Retry-After; a destination asking for hours
	// must not stall (and, past their time budgets, fail) every queued job of the host.
	MaxHostPause = 15 * time.Minute
	// hostRedisTimeout bounds one limiter round trip.
	hostRedisTimeout = 2 * time.Second
)

// Reasons a Limiter tells LimitsConfig.OnThrottle.
const (
	// ThrottledWaitTooLong: a host's next slot was beyond HostWaitMax; the attempt ended
	// throttled with nothing sent (HostWaitError).
	ThrottledWaitTooLong = "wait_too_long"
	// ThrottledRetryAfter: a 429/503 Retry-After paused the host for every worker.
	ThrottledRetryAfter = "retry_after"
)

// LimitsConfig configures a worker's fleet-wide host limits (NewLimits).
type LimitsConfig struct {
	// Redis holds every host's bucket and pause. Required.
	Redis redis.Scripter
	// KeyPrefix of the host keys (lua.Keys.HostTAT, lua.Keys.HostNotBefore). Defaults to
	// "idemscrape:".
	KeyPrefix string
	// HostLimits are rates per destination host (HostKey). They win over a kind's limit
	// and DefaultHostLimit. Defaults to none.
	HostLimits map[string]Limit
	// DefaultHostLimit is the rate of every other host, for kinds without a limit of their
	// own. Defaults to nil: such hosts are not paced and cost no Redis round trip.
	DefaultHostLimit *Limit
	// HostWaitMax is the longest a request waits for its host's slot; a slot further away
	// ends the attempt as throttled (HostWaitError) with that distance as its Retry-After,
	// so the job frees its lease instead of holding it idle. Defaults to
	// DefaultHostWaitMax.
	HostWaitMax time.Duration
	// Logger gets a warning when a pause could not be shared. Defaults to slog.Default().
	Logger *slog.Logger
	// Now is the clock of Paused. Defaults to time.Now.
	Now func() time.Time
	// OnWait, if set, is called after every Wait that let a request to a limited host go,
	// with the limiter's kind and the wait the limiter asked for (not wall time: 0 means
	// sent at once). It must not block.
	OnWait func(kind string, wait time.Duration)
	// OnThrottle, if set, is called with the limiter's kind and ThrottledWaitTooLong or
	// ThrottledRetryAfter. It must not block.
	OnThrottle func(kind, reason string)
}

// Limits is a worker's side of the fleet-wide host limits: a GCRA bucket and a shared pause
// per host in Redis (lua.HostLimits, counted on the Redis server's clock), the limits of
// LimitsConfig, and the hosts this worker paused. Each job kind paces its requests through
// a Limiter of its own (Limiter), which names the kind to the hooks and may carry the
// kind's own limit.
type Limits struct {
	cfg    LimitsConfig
	hosts  *lua.HostLimits
	paused pausedHosts
}

// NewLimits validates cfg and returns the limits.
func NewLimits(cfg LimitsConfig) (*Limits, error) {
	if cfg.Redis == nil {
		return nil, errors.New("politeness: LimitsConfig.Redis is required")
	}
	if cfg.KeyPrefix == "" {
		cfg.KeyPrefix = "idemscrape:"
	}
	if cfg.HostWaitMax == 0 {
		cfg.HostWaitMax = DefaultHostWaitMax
	}
	if cfg.HostWaitMax < 0 {
		return nil, &ConfigError{Field: "HostWaitMax", Err: fmt.Errorf("%v must be positive", cfg.HostWaitMax)}
	}
	for host, lim := range cfg.HostLimits {
		if err := lim.Validate(); err != nil {
			return nil, &ConfigError{Field: fmt.Sprintf("HostLimits[%q]", host), Err: err}
		}
	}
	if cfg.DefaultHostLimit != nil {
		if err := cfg.DefaultHostLimit.Validate(); err != nil {
			return nil, &ConfigError{Field: "DefaultHostLimit", Err: err}
		}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	hosts, err := lua.NewHostLimits(cfg.Redis, cfg.KeyPrefix)
	if err != nil {
		return nil, err
	}
	return &Limits{cfg: cfg, hosts: hosts}, nil
}

// HostWaitMax is the longest a request waits for its host's slot (LimitsConfig.HostWaitMax,
// defaults applied).
func (l *Limits) HostWaitMax() time.Duration { return l.cfg.HostWaitMax }

// Paused returns how many hosts this worker paused (a Retry-After it received) whose pause
// has not ended at now.
func (l *Limits) Paused(now time.Time) int { return l.paused.count(now) }

// Limiter returns the HostLimiter of one job kind: a host's rate is its
// LimitsConfig.HostLimits entry, else lim (the kind's own, validated by the caller), else
// DefaultHostLimit; a host with none is not paced.
func (l *Limits) Limiter(kind string, lim *Limit) *Limiter {
	if lim == nil {
		lim = l.cfg.DefaultHostLimit
	}
	return &Limiter{limits: l, kind: kind, def: lim}
}

// Limiter is a HostLimiter on Limits for one job kind.
type Limiter struct {
	limits *Limits
	kind   string
	def    *Limit // the kind's limit, or the default; nil: none
}

var _ HostLimiter = (*Limiter)(nil)

// limitOf returns host's limit: LimitsConfig.HostLimits, else the kind's or the default.
func (l *Limiter) limitOf(host string) (Limit, bool) {
	if lim, ok := l.limits.cfg.HostLimits[host]; ok {
		return lim, true
	}
	if l.def != nil {
		return *l.def, true
	}
	return Limit{}, false
}

// Wait implements HostLimiter: one EVALSHA for a limited host (two when it had to wait),
// none for others. A slot further away than HostWaitMax is not waited for: Wait returns an
// *Error of category throttled whose RetryAfter is that distance (HostWaitError).
func (l *Limiter) Wait(ctx context.Context, host string) (err error) {
	lim, ok := l.limitOf(host)
	if !ok {
		return nil
	}
	// The hook gets what the limiter asked for, not wall time: 0 means sent at once.
	var waited time.Duration
	defer func() {
		if err == nil && l.limits.cfg.OnWait != nil {
			l.limits.cfg.OnWait(l.kind, waited)
		}
	}()
	for {
		var wait time.Duration
		wait, err = l.reserve(ctx, host, lim)
		if err != nil || wait <= 0 {
			return err
		}
		waited += wait
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return context.Cause(ctx)
		case <-t.C:
		}
		// The slot is ours, but a host that answered Retry-After meanwhile is paused for
		// every slot already handed out: look again, without reserving another slot.
		lim = Limit{}
	}
}

// reserve makes one round trip and returns how long to wait for the reserved slot, or the
// error that ends the attempt.
func (l *Limiter) reserve(ctx context.Context, host string, lim Limit) (time.Duration, error) {
	maxWait := l.limits.cfg.HostWaitMax
	rctx, cancel := context.WithTimeout(ctx, hostRedisTimeout)
	wait, reserved, err := l.limits.hosts.Reserve(rctx, host, lim, maxWait)
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return 0, context.Cause(ctx)
		}
		return 0, &Error{Category: tasks.CategoryInternal, Err: fmt.Errorf("host limit of %s: %w", host, err)}
	}
	if !reserved {
		l.throttled(ThrottledWaitTooLong)
		return 0, &Error{Category: tasks.CategoryThrottled, RetryAfter: wait,
			Err: &HostWaitError{Host: host, Wait: wait, Max: maxWait}}
	}
	return wait, nil
}

func (l *Limiter) throttled(reason string) {
	if l.limits.cfg.OnThrottle != nil {
		l.limits.cfg.OnThrottle(l.kind, reason)
	}
}

// Pause implements HostLimiter: the host's shared not-before moves to now + d (server
// clock), d capped at MaxHostPause. A failure is logged, not returned.
func (l *Limiter) Pause(ctx context.Context, host string, d time.Duration) {
	d = min(d, MaxHostPause)
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), hostRedisTimeout)
	defer cancel()
	if _, err := l.limits.hosts.Pause(rctx, host, d); err != nil {
		l.limits.cfg.Logger.WarnContext(ctx, "host pause (Retry-After) not shared", "host", host, "pause", d, "err", err)
		return
	}
	l.throttled(ThrottledRetryAfter)
	l.limits.paused.add(host, l.limits.cfg.Now().Add(d))
}

// HostWaitError: a request's host slot was further away than HostWaitMax — the host is
// paused fleet-wide (a Retry-After another job received) or its fleet-wide rate is booked
// that far ahead — so the attempt ended as throttled, nothing sent, with Wait as its
// Retry-After. The wait is the fleet's, not the job's: the runner retries such an attempt
// once the slot is due, uncounted and out of the job's attempt cap, bandwidth and total
// time budgets (see handlers.Registry.ProcessTask). The job that received the Retry-After
// itself fails with the destination's own throttled error, waits its full Retry-After, and
// is charged for it.
type HostWaitError struct {
	Host string
	Wait time.Duration // how far away the host's next slot is
	Max  time.Duration // HostWaitMax
}

func (e *HostWaitError) Error() string {
	return fmt.Sprintf("fleet-wide limit of %s: next slot in %v, more than HostWaitMax %v", e.Host, e.Wait.Round(time.Millisecond), e.Max)
}

// pausedHosts remembers the hosts this worker paused and until when (Limits.Paused).
type pausedHosts struct {
	mu    sync.Mutex
	until map[string]time.Time
}

func (p *pausedHosts) add(host string, until time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.until == nil {
		p.until = map[string]time.Time{}
	}
	if until.After(p.until[host]) {
		p.until[host] = until
	}
}

// count returns how many hosts are still paused at now, forgetting the others.
func (p *pausedHosts) count(now time.Time) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	for h, u := range p.until {
		if !now.Before(u) {
			delete(p.until, h)
		}
	}
	return len(p.until)
}

// ConfigError is a LimitsConfig field NewLimits refuses. Field is the field's name, so a
// caller that fills LimitsConfig from a configuration of its own (handlers.Config) can name
// its own field.
type ConfigError struct {
	Field string
	Err   error
}

func (e *ConfigError) Error() string {
	return "politeness: LimitsConfig." + e.Field + ": " + e.Err.Error()
}
func (e *ConfigError) Unwrap() error { return e.Err }
