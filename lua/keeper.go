package lua

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/idemscrape/idemscrape/internal/retry"
)

// Keeper defaults.
const (
	// DefaultKeepFraction: the keeper renews every TTL × DefaultKeepFraction.
	DefaultKeepFraction = 1.0 / 3
	// DefaultKeepJitter: each interval is varied by up to ± this fraction, so a fleet's
	// renewals do not align.
	DefaultKeepJitter = 0.1
	// MaxKeepJitter bounds KeepOptions.Jitter (exclusive).
	MaxKeepJitter = 0.5
)

// Clock tells the worker's time. Lease expiry itself is counted by Redis; the keeper only
// uses its clock to decide when the last successful renewal stops covering the work.
type Clock interface {
	Now() time.Time
}

type systemClock struct{}

func (systemClock) Now() time.Time { return time.Now() }

// KeepOptions tunes a Keeper. The zero value uses the defaults; CheckKeepTiming tells
// whether a setting is allowed for a lease length.
type KeepOptions struct {
	// Interval between renewals. Interval × (1 + Jitter) must be at most half the lease TTL
	// (see CheckKeepTiming). Defaults to lease TTL × DefaultKeepFraction.
	Interval time.Duration
	// Jitter fraction in [0, MaxKeepJitter): each interval is varied by up to ± Jitter.
	// Zero means the default. Defaults to DefaultKeepJitter.
	Jitter float64
	// OnRenew, if set, is called after every renewal attempt with its error (test signal
	// and metrics hook). It must not block.
	OnRenew func(error)
	// Clock is the worker's clock the keeper counts the lease's safe end with (tests inject a
	// stub). Defaults to the system clock.
	Clock Clock
}

// CheckKeepTiming reports whether a keeper renewing every interval, varied by ± jitter, keeps
// a lease of length ttl safely, applying the same defaults as Keep (interval 0 means
// ttl × DefaultKeepFraction, jitter 0 means DefaultKeepJitter). It is the one rule every
// caller that configures renewals (Keep, the handlers' registry) checks against:
//
//	0 < interval,  0 <= jitter < MaxKeepJitter,  interval × (1 + jitter) <= ttl / 2
//
// Half the lease, so that the longest jittered wait still leaves half the lease for a
// renewal that failed (Redis slow or briefly unreachable) to be retried before expiry;
// with the old rule (interval < ttl) jitter alone pushed renewals past the lease.
// A fixed interval that passes for the shortest lease passes for every longer one. The
// error names the field and values and says the largest interval allowed.
func CheckKeepTiming(ttl, interval time.Duration, jitter float64) error {
	if interval == 0 {
		interval = time.Duration(float64(ttl) * DefaultKeepFraction)
	}
	if jitter == 0 {
		jitter = DefaultKeepJitter
	}
	switch {
	case ttl < time.Millisecond:
		return fmt.Errorf("lua: lease TTL %v is below 1ms", ttl)
	case !(jitter >= 0 && jitter < MaxKeepJitter): // also refuses NaN
		return fmt.Errorf("lua: KeepOptions.Jitter %v must be in [0, %v)", jitter, MaxKeepJitter)
	case interval <= 0:
		return fmt.Errorf("lua: KeepOptions.Interval %v must be positive", interval)
	}
	if worst := float64(interval) * (1 + jitter); worst > float64(ttl)/2 {
		return fmt.Errorf("lua: KeepOptions.Interval %v × (1 + Jitter %v) = %v must be at most half the lease TTL %v "+
			"(so a failed renewal can be retried before expiry): use Interval <= %v",
			interval, jitter, time.Duration(worst), ttl, maxKeepInterval(ttl, jitter))
	}
	return nil
}

// maxKeepInterval is the largest interval CheckKeepTiming allows for ttl and jitter.
func maxKeepInterval(ttl time.Duration, jitter float64) time.Duration {
	return time.Duration(float64(ttl) / 2 / (1 + jitter))
}

// Keeper renews a lease in the background and cancels its context the moment the lease is
// lost (expired, deleted, taken by another claim) or cannot be renewed before it expires
// (Redis unreachable). Work done under the lease must use Context().
type Keeper struct {
	ctx    context.Context
	cancel context.CancelCauseFunc
	done   chan struct{}
	stop   chan struct{}
	once   sync.Once
}

// Keep starts a Keeper for lease, deriving its context from ctx. It refuses options that
// CheckKeepTiming refuses for lease.TTL. Renewals are scheduled, and the lease's safe end
// counted, from lease.Claimed when set (else from the call).
func (l *Leases) Keep(ctx context.Context, lease Lease, opts *KeepOptions) (*Keeper, error) {
	var o KeepOptions
	if opts != nil {
		o = *opts
	}
	if o.Interval == 0 {
		o.Interval = time.Duration(float64(lease.TTL) * DefaultKeepFraction)
	}
	if o.Jitter == 0 {
		o.Jitter = DefaultKeepJitter
	}
	if o.Clock == nil {
		o.Clock = systemClock{}
	}
	if err := CheckKeepTiming(lease.TTL, o.Interval, o.Jitter); err != nil {
		return nil, fmt.Errorf("lua: keep %q: %w", lease.Key, err)
	}
	kctx, cancel := context.WithCancelCause(ctx)
	k := &Keeper{ctx: kctx, cancel: cancel, done: make(chan struct{}), stop: make(chan struct{})}
	go k.run(l, lease, o)
	return k, nil
}

// Context is cancelled when the lease is lost or the keeper stops; context.Cause tells
// which (errors.Is ErrLeaseLost or ErrNotOwner when lost).
func (k *Keeper) Context() context.Context { return k.ctx }

// Stop ends the renewals and waits for the keeper's goroutine. It returns the reason the
// lease was lost, or nil if it was still held. Safe to call more than once.
func (k *Keeper) Stop() error {
	k.once.Do(func() { close(k.stop) })
	<-k.done
	cause := context.Cause(k.ctx) // nil while the lease was held
	k.cancel(errKeeperStopped)
	if errors.Is(cause, ErrLeaseLost) || errors.Is(cause, ErrNotOwner) {
		return cause
	}
	return nil
}

var errKeeperStopped = errors.New("lua: keeper stopped")

func (k *Keeper) run(l *Leases, lease Lease, o KeepOptions) {
	defer close(k.done)
	// The lease is safe until `deadline` on our clock: the last claim or renewal that
	// succeeded was sent no earlier than `sent`, and the server counted TTL from when it ran,
	// which is after `sent`. So sent + TTL is a conservative end. Before the first renewal
	// that is the claim's send time (work between the claim and Keep counts).
	now := o.Clock.Now
	deadline := now().Add(lease.TTL)
	next := retry.Jitter(o.Interval, o.Jitter)
	if !lease.Claimed.IsZero() {
		deadline = lease.Claimed.Add(lease.TTL)
		// The schedule counts from the claim too: a slow start must not push the first
		// renewal later than the check in CheckKeepTiming assumed.
		next = max(0, lease.Claimed.Add(next).Sub(now()))
	}
	timer := time.NewTimer(next)
	defer timer.Stop()
	for {
		select {
		case <-k.stop:
			return
		case <-k.ctx.Done():
			return
		case <-timer.C:
		}
		sent := now()
		if !sent.Before(deadline) {
			k.cancel(fmt.Errorf("lua: lease %q token %d not renewed before expiry: %w", lease.Key, lease.Token, ErrLeaseLost))
			return
		}
		rctx, cancel := context.WithTimeout(k.ctx, deadline.Sub(sent))
		err := l.Renew(rctx, lease, lease.TTL)
		cancel()
		if o.OnRenew != nil {
			o.OnRenew(err)
		}
		switch {
		case err == nil:
			deadline = sent.Add(lease.TTL)
			next = retry.Jitter(o.Interval, o.Jitter)
		case errors.Is(err, ErrLeaseLost), errors.Is(err, ErrNotOwner):
			k.cancel(err)
			return
		default:
			// Redis unreachable or slow: try again soon, but never past the deadline.
			next = min(o.Interval/4+time.Millisecond, deadline.Sub(now()))
			if next <= 0 {
				k.cancel(fmt.Errorf("lua: lease %q token %d not renewed before expiry (%v): %w", lease.Key, lease.Token, err, ErrLeaseLost))
				return
			}
		}
		timer.Reset(next)
	}
}
