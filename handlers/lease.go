package handlers

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"

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
	Start store.AttemptStartParams // Key, Token and Owner are filled in by acquire
	// Unsure, if set, gives the start the owner of an earlier delivery's start of the job
	// whose outcome stayed unknown, and keeps this one's if it stays unknown too.
	Unsure *unsureStarts
}

// acquired is a lease held and an attempt started under its token.
type acquired struct {
	Lease   lua.Lease // Lease.Token is the attempt's fencing token (Attempt.Fence)
	Attempt store.StartedAttempt
	// reusedOwner: the start was sent with the owner an earlier delivery's unsure start
	// left (p.Unsure), not this delivery's: if that start landed, the store recognised it
	// as this one and wrote nothing, so the attempt's row records the earlier delivery's
	// reservation (attemptMoney.startReused).
	reusedOwner bool
	slot        *providerSlot // the provider the attempt runs on (set by the caller)
	money       *attemptMoney // the attempt's money: its budgets, reservation, cost (set by the caller)
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
// A start whose reply is lost (its statement may land, now or later) is sent again with the
// same owner, which the start recognises as its own (startOwn): the worker never takes its
// own attempt over. If it stays unknown, its owner is kept for the job's next delivery on
// this worker (p.Unsure).
//
// Errors: a *lua.HeldError (errors.Is lua.ErrLeaseHeld) when another worker holds the
// lease; store.ErrJobComplete / ErrJobFailed / ErrJobNotFound from JobStart;
// store.ErrOutcomeUnknown when the start may have landed unseen. On error no lease is held.
func acquire(ctx context.Context, leases *lua.Leases, st starter, p acquireParams) (acquired, error) {
	lctx, span := startSpan(ctx, "lease")
	lease, err := leases.Take(lctx, p.Key, p.Owner, p.TTL)
	endSpan(span, err)
	if err != nil {
		return acquired{}, err
	}
	start := p.Start
	start.Key, start.Token, start.Owner = p.Key, 0, p.Owner
	reused := false
	if o := p.Unsure.take(p.Key); o != "" {
		start.Owner, reused = o, true
	}
	sctx, span := startSpan(ctx, "start")
	att, err := startOwn(sctx, st, start, time.Now().Add(p.TTL/2))
	if errors.Is(err, store.ErrOutcomeUnknown) {
		p.Unsure.put(p.Key, start.Owner)
	}
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
	return acquired{Lease: lease, Attempt: att, reusedOwner: reused}, nil
}

// startTries bounds the sends of one attempt start whose outcome stays unknown.
const startTries = 4

// startOwn sends the attempt start p, and sends it again, with the same owner, while its
// outcome is unknown (its reply lost: the statement may have landed, now or later): the
// start recognises its own earlier send by p.Owner and reports that attempt, never taking
// it over (store.AttemptStartParams.Owner). It stops on an answer, after startTries sends,
// when ctx ends, or at until (half the lease: past it another worker may take the lease,
// and a start sent then would take that worker's attempt over). An error after a send whose
// outcome is unknown wraps store.ErrOutcomeUnknown.
func startOwn(ctx context.Context, st starter, p store.AttemptStartParams, until time.Time) (store.StartedAttempt, error) {
	pause := 50 * time.Millisecond
	unsure := false
	for try := 1; ; try++ {
		att, err := st.JobStart(ctx, p)
		if err == nil {
			return att, nil
		}
		unsure = unsure || store.OutcomeUnknown(err)
		if !unsure || !sendAgain(err) {
			return att, err
		}
		if !errors.Is(err, store.ErrOutcomeUnknown) {
			err = fmt.Errorf("%w: %w", store.ErrOutcomeUnknown, err)
		}
		if try == startTries || ctx.Err() != nil || !time.Now().Add(pause).Before(until) {
			return att, err
		}
		t := time.NewTimer(pause)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return att, err
		}
		pause *= 2
	}
}

// sendAgain: err, after a start whose outcome is unknown, is no answer of the job's row
// (a refusal), of PostgreSQL's (a statement it refuses), or of a closing committer.
func sendAgain(err error) bool {
	return !errors.As(err, new(*store.TransitionError)) && !errors.Is(err, store.ErrGroupCommitterClosed) && !refusedByPostgres(err)
}

// maxUnsureStarts bounds unsureStarts: past it, no more owners are kept (a delivery then
// starts with its own, taking an unseen earlier start over as a real takeover).
const maxUnsureStarts = 10000

// unsureStarts remembers, by job key, the start owner of a delivery whose start's outcome
// stayed unknown (it gave up, its lease released): the next delivery of the job on this
// worker starts with that owner, so an earlier start that landed unseen (or lands later)
// is recognised as this worker's own and not taken over. Each owner is used once.
type unsureStarts struct {
	mu     sync.Mutex
	owners map[string]string
}

// put remembers owner for key (nothing on a nil u).
func (u *unsureStarts) put(key, owner string) {
	if u == nil {
		return
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.owners == nil {
		u.owners = map[string]string{}
	}
	if len(u.owners) < maxUnsureStarts {
		u.owners[key] = owner
	}
}

// take returns and forgets the owner remembered for key ("" if none, or on a nil u).
func (u *unsureStarts) take(key string) string {
	if u == nil {
		return ""
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	owner := u.owners[key]
	delete(u.owners, key)
	return owner
}
