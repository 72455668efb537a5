package lua

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"
)

// Keeper defaults.
const (
	// DefaultKeepFraction: the keeper renews every TTL × DefaultKeepFraction.
	DefaultKeepFraction = 1.0 / 3
	// DefaultKeepJitter: each interval is varied by up to ± this fraction, so a fleet's
	// renewals do not align.
	DefaultKeepJitter = 0.1
)

// KeepOptions tunes a Keeper. The zero value uses the defaults.
type KeepOptions struct {
	// Interval between renewals. Defaults to lease TTL × DefaultKeepFraction.
	Interval time.Duration
	// Jitter fraction in [0, 0.5). Defaults to DefaultKeepJitter.
	Jitter float64
	// OnRenew, if set, is called after every renewal attempt with its error (test signal
	// and metrics hook). It must not block.
	OnRenew func(error)
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

// Keep starts a Keeper for lease, deriving its context from ctx.
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
	switch {
	case lease.TTL < time.Millisecond:
		return nil, fmt.Errorf("lua: keep %q: lease TTL %v is below 1ms", lease.Key, lease.TTL)
	case o.Interval <= 0 || o.Interval >= lease.TTL:
		return nil, fmt.Errorf("lua: keep %q: interval %v must be positive and shorter than the lease (%v)", lease.Key, o.Interval, lease.TTL)
	case o.Jitter < 0 || o.Jitter >= 0.5:
		return nil, fmt.Errorf("lua: keep %q: jitter %v must be in [0, 0.5)", lease.Key, o.Jitter)
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
	deadline := time.Now().Add(lease.TTL)
	if !lease.Claimed.IsZero() {
		deadline = lease.Claimed.Add(lease.TTL)
	}
	next := jittered(o.Interval, o.Jitter)
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
		sent := time.Now()
		if !sent.Before(deadline) {
			k.cancel(fmt.Errorf("lua: lease %q token %d not renewed before expiry: %w", lease.Key, lease.Token, ErrLeaseLost))
			return
		}
		rctx, cancel := context.WithDeadline(k.ctx, deadline)
		err := l.Renew(rctx, lease, lease.TTL)
		cancel()
		if o.OnRenew != nil {
			o.OnRenew(err)
		}
		switch {
		case err == nil:
			deadline = sent.Add(lease.TTL)
			next = jittered(o.Interval, o.Jitter)
		case errors.Is(err, ErrLeaseLost), errors.Is(err, ErrNotOwner):
			k.cancel(err)
			return
		default:
			// Redis unreachable or slow: try again soon, but never past the deadline.
			next = min(o.Interval/4+time.Millisecond, time.Until(deadline))
			if next <= 0 {
				k.cancel(fmt.Errorf("lua: lease %q token %d not renewed before expiry (%v): %w", lease.Key, lease.Token, err, ErrLeaseLost))
				return
			}
		}
		timer.Reset(next)
	}
}

func jittered(d time.Duration, jitter float64) time.Duration {
	if jitter == 0 {
		return d
	}
	f := 1 + jitter*(2*rand.Float64()-1)
	return time.Duration(float64(d) * f)
}
