package handlers

import (
	"context"
	"errors"
	"go.opentelemetry.io/otel/attribute"
	"time"

	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/store"
)

// starter starts attempts: store.PG, or a store.GroupCommitter that batches the starts of
// concurrent handlers.
type starter interface {
	JobStart(ctx context.Context, p store.AttemptStartParams) (store.StartedAttempt, error)
}

// acquireParams are the inputs of acquire.
type acquireParams struct {
	Key   string
	Owner string // unique per delivery (Registry.owner): the lease is known by it
	TTL   time.Duration
	Start store.AttemptStartParams // Key and Token are filled in by acquire
}

// acquired is a lease held and an attempt started under its token.
type acquired struct {
	Lease   lua.Lease // Lease.Token is the attempt's fencing token (Attempt.Fence)
	Attempt store.StartedAttempt
	slot    *providerSlot // the provider the attempt runs on (set by the caller)
	window  *windowHold   // the attempt's window budget reservation (nil without one)
}

// acquire takes the lease of a job and starts an attempt: one Redis command (SET NX PX,
// lua.Leases.Take) and one PostgreSQL statement.
//
// The lease gives one worker the job at a time; the fencing token comes from PostgreSQL:
// the start raises the job's fence by one (store.JobStart with Token 0) and the attempt's
// every later write requires that fence exactly. A worker whose lease expired while it
// paused is refused at its commit because the next start raised the fence. Tokens never
// depend on what Redis remembers, so a Redis that lost its data (restart without
// persistence, failover, flush) can not hand out an old token; every start waits for its
// WAL flush, so neither can a PostgreSQL crash (store.PG.JobStart).
//
// Errors: a *lua.HeldError (errors.Is lua.ErrLeaseHeld) when another worker holds the
// lease; store.ErrJobComplete / ErrJobFailed / ErrJobNotFound from JobStart. On error no
// lease is held.
func acquire(ctx context.Context, leases *lua.Leases, st starter, p acquireParams) (acquired, error) {
	lctx, span := startSpan(ctx, "lease")
	lease, err := leases.Take(lctx, p.Key, p.Owner, p.TTL)
	endSpan(span, err)
	if err != nil {
		return acquired{}, err
	}
	start := p.Start
	start.Key, start.Token, start.Owner = p.Key, 0, p.Owner
	sctx, span := startSpan(ctx, "start")
	att, err := st.JobStart(sctx, start)
	if err == nil && span.IsRecording() {
		span.SetAttributes(attribute.Int64("idemscrape.fence", att.Fence), attribute.Int("idemscrape.attempt", att.AttemptNo))
	}
	endSpan(span, err)
	if err != nil {
		// Give the lease back so the next delivery need not wait for it to expire. A
		// failure here only delays that delivery; the error that matters is err. A job
		// already complete never runs again: one DEL (its counter, if an older worker
		// left one, goes too).
		rctx, cancel := detached(ctx)
		if errors.Is(err, store.ErrJobComplete) {
			_ = leases.ReleaseCommitted(rctx, lease)
		} else {
			_ = leases.Release(rctx, lease)
		}
		cancel()
		return acquired{}, err
	}
	lease.Token = att.Fence
	return acquired{Lease: lease, Attempt: att}, nil
}
