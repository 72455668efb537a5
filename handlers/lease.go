package handlers

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/store"
)

// maxReclaims bounds how often acquire re-claims because PostgreSQL holds a fence at or
// above the token Redis issued. Once is enough after a Redis data loss; more means another
// worker keeps starting attempts, and the job is busy.
const maxReclaims = 3

// errFenceRace: the fence kept moving past our tokens; treat like a busy lease.
var errFenceRace = errors.New("handlers: job fence raised by another worker during claim")

// starter starts attempts: store.PG, or a store.GroupCommitter that batches the starts of
// concurrent handlers.
type starter interface {
	JobStart(ctx context.Context, p store.AttemptStartParams) (store.StartedAttempt, error)
}

// acquireParams are the inputs of acquire.
type acquireParams struct {
	Key   string
	Owner string
	TTL   time.Duration
	Start store.AttemptStartParams // Key and Token are filled in by acquire
}

// acquired is a lease held and an attempt started under its token.
type acquired struct {
	Lease    lua.Lease
	Attempt  store.StartedAttempt
	Reclaims int // re-claims needed because PostgreSQL held a higher fence
}

// acquire claims the lease of a job and starts an attempt under its fencing token: one
// Redis round trip and one PostgreSQL statement on the normal path.
//
// Tokens come from a Redis counter, the fence from PostgreSQL. If Redis lost its counter
// (restart without persistence, failover, flush), its token can be at or below a fence
// PostgreSQL already accepted; JobStart refuses it with ErrStaleFence and reports the
// fence, and acquire re-claims with that fence as the floor — the same owner re-claiming
// gets a higher token — so every token PostgreSQL accepts is higher than the last.
//
// Errors: a *lua.HeldError (errors.Is lua.ErrLeaseHeld) when another worker holds the
// lease; store.ErrJobComplete / ErrJobFailed / ErrJobNotFound from JobStart; errFenceRace.
// On error no lease is held.
func acquire(ctx context.Context, leases *lua.Leases, st starter, p acquireParams) (acquired, error) {
	var floor int64
	for reclaims := 0; ; reclaims++ {
		lease, err := leases.Claim(ctx, p.Key, p.Owner, p.TTL, floor)
		if err != nil {
			return acquired{}, err
		}
		start := p.Start
		start.Key, start.Token = p.Key, lease.Token
		att, err := st.JobStart(ctx, start)
		if err == nil {
			return acquired{Lease: lease, Attempt: att, Reclaims: reclaims}, nil
		}
		var te *store.TransitionError
		if errors.As(err, &te) && errors.Is(err, store.ErrStaleFence) && reclaims < maxReclaims {
			floor = te.Fence
			continue
		}
		// Give the lease back so the next delivery need not wait for it to expire. A
		// failure here only delays that delivery; the error that matters is err. A job
		// already complete never runs again: its fence counter goes too (a duplicate
		// delivery leaves no key; a later claim still starts above PostgreSQL's fence).
		rctx, cancel := detached(ctx)
		if errors.Is(err, store.ErrJobComplete) {
			_ = leases.ReleaseDone(rctx, lease)
		} else {
			_ = leases.Release(rctx, lease)
		}
		cancel()
		if errors.Is(err, store.ErrStaleFence) {
			return acquired{}, fmt.Errorf("%w: %w", errFenceRace, err)
		}
		return acquired{}, err
	}
}
