package handlers

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/tasks"
)

// Incidents are failures of the proxy account, not of a job: a 407 from the gateway means
// the credentials, the username format or the account's balance are wrong, and every job
// would fail the same way. Failing the jobs would lose the whole collection window, so an
// incident instead trips the registry's breaker:
//
//   - the attempt that met it is recorded as retryable (category proxy_auth), never failed,
//     and does not count against the job's attempt cap or asynq's MaxRetry;
//   - while the breaker is open the worker takes no work: deliveries of every kind are handed
//     back to asynq with a delay, without touching PostgreSQL or the proxy;
//   - after IncidentProbeInterval one delivery is let through as the probe (half-open);
//     if its requests authenticate, the breaker closes and work resumes; if it meets the
//     incident again, the breaker stays open and the interval doubles up to
//     IncidentProbeMax.
//
// There is one breaker per provider of the registry (per worker process; see
// providerSlot): Registry.Ready reports them (for /readyz), idemscrape_incident_open is 1
// while all are open and idemscrape_provider_incident_open shows each.

// Incident defaults.
const (
	DefaultIncidentProbeInterval = 30 * time.Second
	DefaultIncidentProbeMax      = 5 * time.Minute
)

// isIncident tells the categories that are the account's, not the job's.
func isIncident(c tasks.Category) bool { return c == tasks.CategoryProxyAuth }

// breaker is the registry's incident breaker. The zero value is closed; interval and max
// must be set.
type breaker struct {
	interval, max time.Duration

	mu       sync.Mutex
	open     bool
	category tasks.Category
	detail   string
	since    time.Time
	probeAt  time.Time     // when the next probe may start
	wait     time.Duration // current probe interval
	probing  bool          // a probe delivery is running
	trips    uint64        // incidents so far (tests count them)
}

// admission is what the breaker says about one delivery.
type admission struct {
	ok    bool          // run it
	probe bool          // it is the half-open probe: report its outcome with probeDone
	wait  time.Duration // when !ok: hand it back for this long
}

// admit decides whether a delivery may run now.
func (b *breaker) admit(now time.Time) admission {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.open {
		return admission{ok: true}
	}
	if !b.probing && !now.Before(b.probeAt) {
		b.probing = true
		return admission{ok: true, probe: true}
	}
	wait := b.probeAt.Sub(now)
	if b.probing {
		// The probe may run for minutes (robots, host limits, the job itself): come back
		// after one probe interval, not every second.
		wait = max(wait, b.wait)
	}
	wait = max(wait, time.Second) // asynq schedules retries in whole seconds
	return admission{wait: wait}
}

// trip records an incident met by a delivery (the probe or one already in flight when the
// breaker opened) and returns how long that job should wait before its next attempt.
func (b *breaker) trip(cat tasks.Category, detail string, now time.Time, probe bool) (opened bool, wait time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case !b.open:
		b.open, b.category, b.detail, b.since = true, cat, detail, now
		b.wait = b.interval
		b.probeAt = now.Add(b.wait)
		b.trips++
		opened = true
	case probe:
		b.probing = false
		b.wait = min(2*b.wait, b.max)
		b.probeAt = now.Add(b.wait)
		b.detail = detail
	}
	return opened, max(b.probeAt.Sub(now), time.Second)
}

// probeDone reports a probe that did not meet the incident. authenticated: its requests
// went through the proxy (the breaker closes); otherwise the probe proved nothing (it
// never reached the proxy) and the next delivery becomes the probe.
func (b *breaker) probeDone(authenticated bool) (closed bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.probing = false
	if authenticated && b.open {
		b.open = false
		return true
	}
	return false
}

// state returns an error describing an open breaker, nil when closed.
func (b *breaker) state() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.open {
		return nil
	}
	return fmt.Errorf("%w: %s since %s (%s); next probe at %s",
		ErrIncident, b.category, b.since.UTC().Format(time.RFC3339), b.detail, b.probeAt.UTC().Format(time.RFC3339))
}

// Several providers (Config.Providers). Each has its own breaker: an incident on one moves
// the worker's deliveries to the next provider in Config.Providers' order, and the worker
// stops taking work only when every provider's breaker is open. A delivery runs its whole
// unit on the one provider it was admitted to: a change of provider is a lost session,
// which replays the unit from step 1 on the next delivery, never halves of two providers.

// providerSlot is one provider of the worker and its incident breaker.
type providerSlot struct {
	prov    *sessions.Provider
	breaker breaker
}

// admitAny picks the provider for one delivery: the first in priority order whose breaker
// admits it (closed, or open with its probe due: the probe goes first, so that a provider
// that recovered is restored). When none admits, ok is false and wait is the shortest of
// their waits.
func (r *Registry) admitAny(now time.Time) (*providerSlot, admission) {
	wait := time.Duration(-1)
	for _, s := range r.providers {
		adm := s.breaker.admit(now)
		if adm.ok {
			return s, adm
		}
		if wait < 0 || adm.wait < wait {
			wait = adm.wait
		}
	}
	return nil, admission{wait: wait}
}

// incidentState is nil while some provider takes work; otherwise every provider's
// incident, joined.
func (r *Registry) incidentState() error {
	var errs []error
	for _, s := range r.providers {
		err := s.breaker.state()
		if err == nil {
			return nil
		}
		errs = append(errs, fmt.Errorf("provider %s: %w", s.prov.Name(), err))
	}
	return errors.Join(errs...)
}

// openProviders counts the providers whose breaker is open, and sets the gauges:
// idemscrape_provider_incident_open per provider, idemscrape_incident_open when all are.
// Serialised (gaugeMu), so that two deliveries tripping and closing breakers at once can
// not leave the gauges as the older of their two readings.
func (r *Registry) openProviders() int {
	r.gaugeMu.Lock()
	defer r.gaugeMu.Unlock()
	n := 0
	for _, s := range r.providers {
		open := s.breaker.state() != nil
		v := 0.0
		if open {
			n++
			v = 1
		}
		r.metrics.providerOpen.WithLabelValues(s.prov.Name()).Set(v)
	}
	if n == len(r.providers) {
		r.metrics.incidentOpen.Set(1)
	} else {
		r.metrics.incidentOpen.Set(0)
	}
	return n
}
