package handlers

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/tasks"
)

// Politeness is fleet-wide, not per process:
//
//   - robots.txt: every registry shares one sessions.RobotsCache in Redis (unless
//     Config.Collector.IgnoreRobotsTxt, or a cache of its own in Config.Collector.Robots),
//     so a host's robots.txt is fetched once per TTL by one worker, through the session of
//     the job that needed it, its bytes counted in idemscrape_robots_bytes_total and not
//     against the job.
//   - rate limits: a host with a limit (Config.HostLimits, a kind's WithHostLimit, or
//     Config.DefaultHostLimit) is paced by one GCRA bucket in Redis (lua.HostLimits) shared
//     by every worker: one EVALSHA before every request to it. A host without a limit costs
//     no round trip.
//   - Retry-After: a 429/503 with Retry-After from any host pauses that host in Redis; every
//     worker's limiter for a limited host honours the pause (a host without a limit is not
//     paced, so only the job that got the answer waits).
//   - waiting: a request waits for its slot under the job's context, so losing the lease
//     (the keeper keeps renewing while it waits) or shutdown ends the wait at once; a slot
//     further away than Config.HostWaitMax is not waited for: the attempt ends as throttled
//     with that distance as its Retry-After and the job frees its lease.

// Politeness defaults.
const (
	// DefaultHostWaitMax is the longest a request waits for its host's slot.
	DefaultHostWaitMax = 10 * time.Second
	// hostRedisTimeout bounds one limiter round trip.
	hostRedisTimeout = 2 * time.Second
	// MaxHostPause caps how long one Retry-After pauses a host for the whole fleet. The job
	// that received it still waits its full Retry-After; a destination asking for hours
	// must not stall (and, past their time budgets, fail) every queued job of the host.
	MaxHostPause = 15 * time.Minute
)

// WithHostLimit sets the fleet-wide request rate of every host the kind fetches, except
// hosts named in Config.HostLimits (which win). Defaults to Config.DefaultHostLimit.
func WithHostLimit(lim lua.Limit) KindOption {
	return func(k *kind) { k.hostLimit = &lim }
}

// hostLimiter is a sessions.HostLimiter on lua.HostLimits for one kind.
type hostLimiter struct {
	r    *Registry
	kind string
	def  *lua.Limit // the kind's limit, or the registry's default; nil: none
}

var _ sessions.HostLimiter = (*hostLimiter)(nil)

func (r *Registry) limiterFor(k *kind) *hostLimiter {
	def := k.hostLimit
	if def == nil {
		def = r.cfg.DefaultHostLimit
	}
	return &hostLimiter{r: r, kind: k.name, def: def}
}

// limitOf returns host's limit: Config.HostLimits, else the kind's or registry's default.
func (l *hostLimiter) limitOf(host string) (lua.Limit, bool) {
	if lim, ok := l.r.cfg.HostLimits[host]; ok {
		return lim, true
	}
	if l.def != nil {
		return *l.def, true
	}
	return lua.Limit{}, false
}

// Wait implements sessions.HostLimiter: one EVALSHA for a limited host (two when it had to
// wait), none for others.
func (l *hostLimiter) Wait(ctx context.Context, host string) (err error) {
	lim, ok := l.limitOf(host)
	if !ok {
		return nil
	}
	// The histogram gets what the limiter asked for, not wall time: 0 means sent at once.
	var waited time.Duration
	defer func() {
		if err == nil {
			l.r.metrics.hostWait.WithLabelValues(l.kind).Observe(waited.Seconds())
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
		lim = lua.Limit{}
	}
}

// reserve makes one round trip and returns how long to wait for the reserved slot, or the
// error that ends the attempt.
func (l *hostLimiter) reserve(ctx context.Context, host string, lim lua.Limit) (time.Duration, error) {
	maxWait := l.r.cfg.HostWaitMax
	rctx, cancel := context.WithTimeout(ctx, hostRedisTimeout)
	wait, reserved, err := l.r.hostLimits.Reserve(rctx, host, lim, maxWait)
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return 0, context.Cause(ctx)
		}
		return 0, &sessions.FetchError{Category: tasks.CategoryInternal, Err: fmt.Errorf("host limit of %s: %w", host, err)}
	}
	if !reserved {
		l.r.metrics.hostThrottled.WithLabelValues(l.kind, "wait_too_long").Inc()
		return 0, &sessions.FetchError{Category: tasks.CategoryThrottled, RetryAfter: wait,
			Err: &HostWaitError{Host: host, Wait: wait, Max: maxWait}}
	}
	return wait, nil
}

// HostWaitError: a request's host slot was further away than Config.HostWaitMax — the
// host is paused fleet-wide (a Retry-After another job received) or its fleet-wide rate is
// booked that far ahead — so the attempt ended as throttled, nothing sent, with Wait as its
// Retry-After. The wait is the fleet's, not the job's: such an attempt is retried once the
// slot is due, uncounted and out of the job's attempt cap, bandwidth and total time budgets
// (see Registry.ProcessTask). The job that received the Retry-After itself fails with the
// destination's own throttled error, waits its full Retry-After, and is charged for it.
type HostWaitError struct {
	Host string
	Wait time.Duration // how far away the host's next slot is
	Max  time.Duration // Config.HostWaitMax
}

func (e *HostWaitError) Error() string {
	return fmt.Sprintf("fleet-wide limit of %s: next slot in %v, more than HostWaitMax %v", e.Host, e.Wait.Round(time.Millisecond), e.Max)
}

// isHostWait tells a failure that is only the fleet's wait for a host slot.
func isHostWait(fe *sessions.FetchError) bool {
	var hw *HostWaitError
	return fe.Category == tasks.CategoryThrottled && errors.As(fe.Err, &hw)
}

// Pause implements sessions.HostLimiter: the host's shared not-before moves to now + d
// (server clock).
func (l *hostLimiter) Pause(ctx context.Context, host string, d time.Duration) {
	d = min(d, MaxHostPause)
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), hostRedisTimeout)
	defer cancel()
	if _, err := l.r.hostLimits.Pause(rctx, host, d); err != nil {
		l.r.log.WarnContext(ctx, "host pause (Retry-After) not shared", "host", host, "pause", d, "err", err)
		return
	}
	l.r.metrics.hostThrottled.WithLabelValues(l.kind, "retry_after").Inc()
	l.r.paused.add(host, l.r.cfg.Now().Add(d))
}

// pausedHosts remembers the hosts this worker paused and until when (the
// idemscrape_hosts_paused gauge).
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
