package handlers

import (
	"errors"
	"fmt"
	"time"

	"github.com/idemscrape/idemscrape/politeness"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/tasks"
)

// Politeness (robots.txt, host rate limits, Retry-After pauses: package politeness, whose
// doc explains the fleet-wide model) is wired into the registry here:
//
//   - robots.txt: every registry shares one politeness.RobotsCache in Redis under KeyPrefix
//     (unless Config.Collector.IgnoreRobotsTxt, or a cache of its own in
//     Config.Collector.Robots); its fetches count in idemscrape_robots_fetches_total and
//     idemscrape_robots_bytes_total, not against the job, and the waits for another
//     worker's fetch in idemscrape_robots_lock_waits_total by how they ended.
//   - rate limits and pauses: Config.HostLimits, Config.DefaultHostLimit and
//     Config.HostWaitMax make the registry's politeness.Limits; each kind paces its requests
//     through a politeness.Limiter of its own (with WithHostLimit's limit), set as the
//     collector's Limiter unless Config.Collector.Limiter is given. Its waits and
//     throttles count in idemscrape_host_wait_seconds and idemscrape_host_throttled_total,
//     the hosts it paused in idemscrape_hosts_paused.
//   - waiting: a request waits for its slot under the job's context, so losing the lease
//     (the keeper keeps renewing while it waits) or shutdown ends the wait at once; a slot
//     further away than Config.HostWaitMax ends the attempt as throttled
//     (politeness.HostWaitError), which the runner retries once the slot is due without
//     charging the job (isHostWait).

// hostRedisTimeout bounds one Redis round trip of the router (routing.go).
const hostRedisTimeout = 2 * time.Second

// WithHostLimit sets the fleet-wide request rate of every host the kind fetches, except
// hosts named in Config.HostLimits (which win). Defaults to Config.DefaultHostLimit.
func WithHostLimit(lim politeness.Limit) KindOption {
	return func(k *kind) { k.hostLimit = &lim }
}

// newLimits makes the registry's host limits from its Config, with the metrics as hooks.
// It sets r.cfg.HostWaitMax to the limit in effect (defaults applied): the runner spreads
// host-wait retries over it.
func (r *Registry) newLimits() error {
	limits, err := politeness.NewLimits(politeness.LimitsConfig{
		Redis: r.cfg.Redis, KeyPrefix: r.cfg.KeyPrefix,
		HostLimits: r.cfg.HostLimits, DefaultHostLimit: r.cfg.DefaultHostLimit, HostWaitMax: r.cfg.HostWaitMax,
		Logger: r.log, Now: r.cfg.Now,
		OnWait: func(kind string, wait time.Duration) {
			r.metrics.hostWait.WithLabelValues(kind).Observe(wait.Seconds())
		},
		OnThrottle: func(kind, reason string) { r.metrics.hostThrottled.WithLabelValues(kind, reason).Inc() },
	})
	var ce *politeness.ConfigError
	switch {
	case errors.As(err, &ce):
		return fmt.Errorf("handlers: Config.%s: %w", ce.Field, ce.Err) // the field the caller set
	case err != nil:
		return fmt.Errorf("handlers: Config: %w", err)
	}
	r.hostLimits, r.cfg.HostWaitMax = limits, limits.HostWaitMax()
	return nil
}

// newRobots gives the collectors the fleet-wide robots.txt cache, unless robots.txt is
// ignored or Config.Collector brings a cache of its own.
func (r *Registry) newRobots() error {
	if r.cfg.Collector.IgnoreRobotsTxt || r.cfg.Collector.Robots != nil {
		return nil
	}
	robotsBytes := r.metrics.robotsBytes
	robotsFetches := r.metrics.robotsFetches
	robotsLockWaits := r.metrics.robotsLockWaits
	cache, err := politeness.NewRobotsCache(politeness.RobotsConfig{
		Redis: r.cfg.Redis, KeyPrefix: r.cfg.KeyPrefix,
		OnFetch: func(_ string, status int, bytes int64) {
			robotsBytes.Add(float64(bytes))
			robotsFetches.WithLabelValues(statusClass(status)).Inc()
		},
		OnLockWait: func(_ string, outcome politeness.RobotsLockWait) {
			robotsLockWaits.WithLabelValues(string(outcome)).Inc()
		},
	})
	if err != nil {
		return fmt.Errorf("handlers: robots.txt cache: %w", err)
	}
	r.cfg.Collector.Robots = cache
	return nil
}

// isHostWait tells a failure that is only the fleet's wait for a host slot.
func isHostWait(fe *sessions.FetchError) bool {
	var hw *politeness.HostWaitError
	return fe.Category == tasks.CategoryThrottled && errors.As(fe.Err, &hw)
}
