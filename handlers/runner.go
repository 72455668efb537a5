package handlers

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"runtime/debug"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel/attribute"

	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/ops"
	"github.com/idemscrape/idemscrape/tasks"
)

// ProcessTask runs one delivery of a job, top to bottom:
//
//  0. pick the provider; reserve the attempt's money (attemptMoney, money.go): for a kind
//     with a window money budget, what the attempt is expected to cost (window.go), topped
//     up while it runs and settled with its real cost once the attempt is recorded (the
//     last step, whatever the outcome);
//  1. take the job's lease and start the attempt, which issues the fencing token
//     (jobs.fence = N, the old fence + 1) and records the reservation;
//  2. keep the lease renewed; losing it cancels the job context;
//  3. run the workflow unit on a sticky session (replayed on session loss);
//  4. parse the staged data into the observation;
//  5. commit job + result + outbox event + attempt in one statement, only if fence = N;
//  6. release the lease (a committed job's in the background: see releaseDone).
//
// A failure is classified, recorded on the attempt and the job (retryable with its next
// attempt time, or failed), and returned to asynq as a retry with that same delay or as
// SkipRetry. A job already complete or failed is acknowledged without work.
//
// A task is archived (SkipRetry) only once PostgreSQL holds its job as failed: an archived
// task keeps its task id — the job key — taken for months. A task whose job has no row is
// revoked (deleted, id freed); one whose payload this worker can not read is retried late,
// uncounted, for a newer worker, until its job is older than Config.UndecodableMaxAge (see
// undecodable). While a proxy incident is open (see incident.go) the
// delivery is handed back untouched.
func (r *Registry) ProcessTask(ctx context.Context, task *asynq.Task) error {
	r.mu.RLock()
	k := r.kinds[task.Type()]
	r.mu.RUnlock()
	if k == nil {
		// Not SkipRetry: an archived task would block the job's key for months, and during
		// a rolling deploy another worker may know the kind.
		return fmt.Errorf("handlers: no kind %q registered on worker %s", task.Type(), r.cfg.WorkerID)
	}
	job, err := tasks.DecodePayload(task.Payload(), r.cfg.Normalizer)
	if err != nil {
		return r.undecodable(ctx, k, err)
	}
	ctx, span := r.startAttemptSpan(ctx, k, job)
	defer func() {
		if rec := recover(); rec != nil {
			// asynq recovers a handler's panic; the span still ends, as the failure it is.
			endAttemptSpan(span, fmt.Errorf("panic: %v", rec))
			panic(rec)
		}
	}()
	err = r.process(ctx, k, job)
	endAttemptSpan(span, err)
	return err
}

// process is ProcessTask for a decoded job, steps 0 to 6.
func (r *Registry) process(ctx context.Context, k *kind, job tasks.Payload) error {
	log := jobLogger(r.log, slog.String("job", job.Key), slog.String("kind", k.name))

	// 0. The provider: with several, the cheapest tier the job's destination has not
	// blocked and with exits in its country (routing.go), whose incident breaker admits
	// the delivery. An open incident on every provider: take no work, touch nothing.
	slot, adm := r.pickProvider(ctx, k, job)
	if !adm.ok {
		r.metrics.incidentDeferred.WithLabelValues(k.name).Inc()
		// Spread over one probe interval, so the backlog does not come due all at once.
		delay := adm.wait + time.Duration(r.cfg.Rand()*float64(r.cfg.IncidentProbeInterval))
		return &retryError{delay: delay, counted: false, err: r.incidentState()}
	}
	var w workResult
	if adm.probe {
		defer func() { r.probeDone(slot, w, log) }()
	}
	// Finish before asynq stops waiting for this delivery, so that the runner — not asynq's
	// default backoff — decides and records what happens next.
	ctx, cancel := beforeDeadline(ctx)
	defer cancel()

	// 0b. Reserve: the attempt's money (money.go): a window's money budget (a kind with
	// one) holds what the attempt is expected to cost; settle, deferred, replaces it by the
	// real cost once the attempt's record is written (the commit, or the failure record
	// after the release).
	owner := r.owner()
	money, err := r.reserve(ctx, k, job, slot, owner, log)
	if err != nil {
		return err
	}
	defer func() { money.settle(ctx, &w) }()

	// 1. Lease, then the attempt under its token.
	r.acquireAfterRelease(ctx, job.Key)
	acq, err := acquire(ctx, r.leases, r.starter, acquireParams{
		Key:   job.Key,
		Owner: owner,
		TTL:   r.lengths.For(k.name),
		Start: store.AttemptStartParams{Worker: r.cfg.WorkerID, Country: job.Spec.Country, ProxyEndpoint: slot.prov.Gateway(),
			Provider: slot.prov.Name(), Tier: string(slot.prov.Tier()), Reserved: money.reserved()},
		Unsure: &r.unsure,
	})
	if err != nil {
		return r.notStarted(k, job, err, log)
	}
	acq.slot, acq.money = slot, money
	if acq.reusedOwner {
		money.startReused(ctx, job.Key, acq.Lease.Token)
	}
	if money.spent != nil {
		// The window's budget is spent (WindowFail): the job fails without fetching.
		_ = r.release(ctx, acq.Lease, false)
		return r.failed(ctx, k, job, acq, workResult{err: money.spent}, log)
	}
	log = jobLogger(log, slog.Int("attempt", acq.Attempt.AttemptNo), slog.Int64("token", acq.Lease.Token),
		slog.String("endpoint", slot.prov.Gateway()))
	if span := attemptSpan(ctx); span != nil {
		span.SetAttributes(attribute.Int("idemscrape.attempt", acq.Attempt.AttemptNo),
			attribute.Int64("idemscrape.fence", acq.Lease.Token), attribute.String("idemscrape.provider", slot.prov.Name()))
	}

	// 2. Keep the lease while we work.
	keeper, err := r.leases.Keep(ctx, acq.Lease, r.cfg.KeepOptions)
	if err != nil {
		_ = r.release(ctx, acq.Lease, false)
		return r.failed(ctx, k, job, acq, workResult{err: &sessions.FetchError{Category: tasks.CategoryInternal, Err: err}}, log)
	}
	jobCtx := keeper.Context()
	begun := time.Now()

	// 3 + 4. Workflow on a sticky session, then parse; what its bytes cost. A pooled
	// session goes back warm only if the unit and its parse went well.
	w = r.work(jobCtx, k, job, acq, log)
	r.sessionDone(k, &w)
	w.probe = adm.probe
	w.cost = money.cost(w.unit.Bytes)
	if n := w.unit.RefusedBytes; n > 0 {
		r.metrics.refusedBytes.WithLabelValues(k.name, slot.prov.Name()).Add(float64(n))
	}
	if k.saved.Enabled() {
		r.saveInputs(jobCtx, k, job, acq, &w, log)
	}

	// 5. Commit, only while the lease holds.
	var commitErr error
	committed := false
	if w.err == nil && jobCtx.Err() == nil {
		cctx, span := startSpan(jobCtx, "commit")
		commitErr = r.commit(cctx, k, job, acq, w)
		endSpan(span, commitErr)
		committed = commitErr == nil
	}

	// 6. Release.
	lost := keeper.Stop()
	rctx, rspan := startSpan(ctx, "release")
	r.lengths.Observe(k.name, time.Since(begun))
	if committed {
		// A committed job never runs again and PostgreSQL holds its fence: its lease goes
		// (0 bytes of Redis per completed job) with one DEL, without holding up the
		// delivery's acknowledgement (see releaseDone).
		r.releaseDone(rctx, acq.Lease, log)
	} else if err := r.release(rctx, acq.Lease, false); err != nil {
		if lost == nil && (errors.Is(err, lua.ErrLeaseLost) || errors.Is(err, lua.ErrNotOwner)) {
			lost = err // expired between the keeper's last renewal and now: a loss, not a release failure
		} else if lost == nil {
			log.WarnContext(ctx, "lease release failed", "err", err)
		}
	}
	rspan.End()
	if span := attemptSpan(ctx); span != nil {
		span.SetAttributes(attribute.Int64("idemscrape.bytes", w.unit.Bytes),
			attribute.Int64("idemscrape.cost_micros", w.cost.Micros), attribute.String("idemscrape.session", w.session()),
			attribute.Int("idemscrape.session_restarts", w.unit.Restarts))
	}
	if w.unit.Resent > 0 {
		r.metrics.resent.WithLabelValues(k.name).Add(float64(w.unit.Resent))
	}
	for _, reason := range w.unit.RestartReasons {
		r.metrics.sessionRestarts.WithLabelValues(k.name, string(reason)).Inc()
	}
	for _, reason := range w.unit.ResumeReasons {
		r.metrics.sessionResumes.WithLabelValues(k.name, reason).Inc()
	}
	if lost == nil && isSuperseded(commitErr) {
		lost = commitErr // a newer attempt took the job over: our lease was lost
	}
	if lost != nil {
		r.metrics.leaseLosses.WithLabelValues(k.name).Inc()
	}

	switch {
	case committed:
		if span := attemptSpan(ctx); span != nil {
			span.SetAttributes(attribute.String("idemscrape.outcome", "complete"))
		}
		if w.obs.Schema != nil {
			r.recordSchema(ctx, k, job.Spec.ParserVersion, *w.obs.Schema, log)
		}
		log.InfoContext(ctx, "job complete", "session", w.session(), "bytes", w.unit.Bytes, "exit", w.unit.ExitEvidence())
		return nil
	case isSuperseded(commitErr):
		return r.superseded(ctx, k, job, acq, w, log, commitErr, nil)
	case commitErr != nil && lost != nil:
		// The commit failed because the keeper cancelled the job context on lease loss.
		w.err = &sessions.FetchError{Category: tasks.CategoryLeaseLost, Err: fmt.Errorf("%w (commit: %w)", lost, commitErr)}
	case commitErr != nil:
		// The database refused or failed the commit without a newer attempt owning the job
		// (e.g. our attempt start was lost in a crash): retry.
		w.err = &sessions.FetchError{Category: tasks.CategoryInternal, Err: commitErr}
	case lost != nil && (w.err == nil || k.retry.policy(sessions.CategoryOf(w.err)).Retry):
		// The lease loss is why the work stopped. A terminal failure (an unsafe step that
		// ran, bad credentials) stays terminal: losing the lease must not make it retryable.
		w.err = &sessions.FetchError{Category: tasks.CategoryLeaseLost, Err: lost}
	case w.err == nil: // not committed because the delivery's context ended (shutdown, deadline)
		w.err = &sessions.FetchError{Category: tasks.CategoryTimeout, Err: context.Cause(jobCtx)}
	}
	return r.failed(ctx, k, job, acq, w, log)
}

// undecodableDelay is how long a task whose payload this worker can not read waits before
// it is offered again (to this or a newer worker).
const undecodableDelay = 10 * time.Minute

// DefaultUndecodableMaxAge is Config.UndecodableMaxAge's default.
const DefaultUndecodableMaxAge = 24 * time.Hour

// undecodable handles a task whose payload this worker can not read. Its task id is its
// job key (the Enqueuer's TaskID), so the job's row says what to do:
//
//   - no row: revoked (deleted, id freed), as a readable task without a row is;
//   - complete or failed: acknowledged without work;
//   - runnable and younger than Config.UndecodableMaxAge (from the row's created_at, or
//     its last requeue): not archived — a newer worker (rolling deploy) may read it — but
//     retried late (undecodableDelay), uncounted;
//   - runnable and older: the job fails as internal under a lease and an attempt of its
//     own (the attempt's error says why), and the task is archived (SkipRetry) like any
//     failed job's: no deploy read it in all that time.
//
// A database that can not be read, or a task without an id, is retried late, uncounted.
func (r *Registry) undecodable(ctx context.Context, k *kind, decodeErr error) error {
	r.metrics.tasksDropped.WithLabelValues(k.name, "undecodable").Inc()
	key, _ := asynq.GetTaskID(ctx)
	log := jobLogger(r.log, slog.String("task_id", key), slog.String("kind", k.name))
	late := func(why string) error {
		log.ErrorContext(ctx, "task payload not readable by this worker; retrying it late", "why", why, "err", decodeErr)
		return &retryError{delay: undecodableDelay, counted: false, err: decodeErr}
	}
	if key == "" {
		return late("no task id")
	}
	row, err := r.cfg.Store.JobGet(ctx, key)
	switch {
	case errors.Is(err, store.ErrJobNotFound):
		r.metrics.tasksDropped.WithLabelValues(k.name, "no_job_row").Inc()
		log.ErrorContext(ctx, "unreadable task for a job that has no jobs row: revoked", "err", decodeErr)
		return fmt.Errorf("%w: task %q: %w", asynq.RevokeTask, key, decodeErr)
	case err != nil:
		return late("jobs row not read: " + err.Error())
	case row.State.Terminal():
		r.metrics.acknowledgedNoOps.WithLabelValues(k.name, string(row.State)).Inc()
		return nil
	}
	since := row.CreatedAt
	if b, err := ops.New(r.cfg.Store.Pool()).BudgetGet(ctx, key); err == nil && b.Since != nil && b.Since.After(since) {
		since = *b.Since // an operator's requeue starts the clock again
	}
	age := r.cfg.Now().Sub(since)
	if age <= r.cfg.UndecodableMaxAge {
		return late(fmt.Sprintf("unreadable for up to %v of UndecodableMaxAge %v", age.Round(time.Second), r.cfg.UndecodableMaxAge))
	}
	// Past the bound: fail the job, fenced like any attempt's failure.
	job := tasks.Payload{Key: key, Spec: ops.SpecOf(row)}
	acq, err := acquire(ctx, r.leases, r.starter, acquireParams{
		Key: key, Owner: r.owner(), TTL: r.lengths.For(k.name),
		Start: store.AttemptStartParams{Worker: r.cfg.WorkerID, Country: row.Country, ProxyEndpoint: r.providers[0].prov.Gateway(),
			Provider: r.providers[0].prov.Name(), Tier: string(r.providers[0].prov.Tier())},
		Unsure: &r.unsure,
	})
	if err != nil {
		return r.notStarted(k, job, err, log)
	}
	acq.slot = r.providers[0]
	defer func() { _ = r.release(ctx, acq.Lease, false) }()
	text := fmt.Sprintf("task payload not readable by worker %s, and the job is %v old (UndecodableMaxAge %v): %v",
		r.cfg.WorkerID, age.Round(time.Second), r.cfg.UndecodableMaxAge, decodeErr)
	wctx, cancel := detached(ctx)
	defer cancel()
	err = r.cfg.Store.JobFail(wctx, store.AttemptFinishParams{Key: key, Token: acq.Lease.Token,
		Category: string(tasks.CategoryInternal), Error: text})
	if isSuperseded(err) {
		return nil // another attempt owns the job now
	}
	if err != nil {
		return late("job not failed: " + err.Error())
	}
	r.metrics.attempts.WithLabelValues(k.name, store.OutcomeFailed, string(tasks.CategoryInternal)).Inc()
	log.ErrorContext(ctx, "unreadable task failed its job", "err", text)
	return fmt.Errorf("%w: %s: %s", asynq.SkipRetry, tasks.CategoryInternal, text)
}

// probeDone reports the outcome of the delivery the incident breaker let through as its
// probe. A probe that met the incident again was already handled by failed.
func (r *Registry) probeDone(slot *providerSlot, w workResult, log *slog.Logger) {
	if w.err != nil && isIncident(sessions.CategoryOf(w.err)) {
		return // failed() met the incident again and re-armed the breaker
	}
	switch probeVerdict(w.unit.LastStatus) {
	case probeRefused:
		// The 407 came back but another failure (a lost lease) took its place: still an
		// incident.
		slot.breaker.trip(tasks.CategoryProxyAuth, "the probe met 407 again", r.cfg.Now(), true)
	case probeAuthenticated:
		if slot.breaker.probeDone(true) {
			r.openProviders()
			log.Info("proxy incident over: the probe authenticated; the provider takes work again", "provider", slot.prov.Name())
		}
	default:
		slot.breaker.probeDone(false) // no answer at all: the next delivery probes again
	}
}

// Verdicts of a probe delivery.
const (
	probeInconclusive  = iota // no answer at all (network error, timeout): proves nothing
	probeRefused              // the proxy answered 407 (or 402) again
	probeAuthenticated        // an answer that is not the proxy's 407
)

// probeVerdict judges a probe by the last status it got. An answer that is not a 407 — the
// destination's, or a proxy error about the destination — means the account authenticates.
// Bytes alone prove nothing: a request's own bytes count before it is answered.
func probeVerdict(lastStatus int) int {
	switch {
	case lastStatus == http.StatusProxyAuthRequired, lastStatus == http.StatusPaymentRequired:
		return probeRefused
	case lastStatus != 0:
		return probeAuthenticated
	}
	return probeInconclusive
}

// detachedTimeout bounds writes that must happen even though the delivery's context ended
// (recording a failure, releasing a lease).
const detachedTimeout = 15 * time.Second

// detached returns a context that survives ctx's cancellation but not a hung connection.
func detached(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), detachedTimeout)
}

// releaseDone gives back the lease of a committed job in the background: the commit is
// durable and PostgreSQL refuses every later start of the job, so nothing waits for the
// release but the next claim of the same key. A claim of it by this registry waits for the
// release (acquireAfterRelease); another worker's claim meets a held lease and retries
// later, as any duplicate delivery does. Close waits for every release in flight (after
// Close a release runs in the delivery); one a crash cuts short leaves a lease that
// expires with its TTL.
//
// The releases are sent by one flusher goroutine, all those queued while its previous
// round trip ran in one pipeline (natural batching, as the group committer's): one DEL per
// job, but one write and one read on the connection per batch, not per job.
func (r *Registry) releaseDone(ctx context.Context, lease lua.Lease, log *slog.Logger) {
	r.relMu.Lock()
	if r.closed {
		// A handler still running when Close was called (after the asynq server's drain
		// timeout): release here, Close may be waiting already.
		r.relMu.Unlock()
		r.finishRelease(ctx, lease, log)
		return
	}
	r.releases.Add(1)
	done := make(chan struct{})
	r.releasing.Store(lease.Key, done)
	r.toRelease = append(r.toRelease, pendingRelease{lease: lease, done: done, log: log, ctx: context.WithoutCancel(ctx)})
	start := !r.flushing
	r.flushing = true
	r.relMu.Unlock()
	if start {
		// The flusher serves every job's releases while it runs: it carries no job's
		// context (values, span); each line it logs uses its own job's.
		go r.flushReleases(context.Background())
	}
}

// pendingRelease is a committed job's lease queued for the flusher.
type pendingRelease struct {
	lease lua.Lease
	done  chan struct{}
	log   *slog.Logger
	ctx   context.Context // the job's, without its cancellation: for its log line
}

// flushReleases sends the queued releases, a pipeline per batch, until the queue is empty.
func (r *Registry) flushReleases(ctx context.Context) {
	for {
		r.relMu.Lock()
		batch := r.toRelease
		r.toRelease = nil
		if len(batch) == 0 {
			r.flushing = false
			r.relMu.Unlock()
			return
		}
		r.relMu.Unlock()
		leases := make([]lua.Lease, len(batch))
		for i, p := range batch {
			leases[i] = p.lease
		}
		rctx, cancel := detached(ctx)
		errs := r.leases.ReleaseCommittedMany(rctx, leases)
		cancel()
		for i, p := range batch {
			if errs[i] != nil {
				p.log.WarnContext(p.ctx, "lease release failed", "err", errs[i])
			}
			r.releasing.CompareAndDelete(p.lease.Key, p.done)
			close(p.done)
			r.releases.Done()
		}
	}
}

// finishRelease releases a committed job's lease: one DEL, no owner check
// (lua.Leases.ReleaseCommitted: the job is complete, whoever holds the lease now can do
// nothing with it). A lease that expired between the keeper's last renewal and the commit
// is not seen here; the commit was accepted under the fence, which is what counts.
func (r *Registry) finishRelease(ctx context.Context, lease lua.Lease, log *slog.Logger) {
	if err := r.release(ctx, lease, true); err != nil {
		log.WarnContext(ctx, "lease release failed", "err", err)
	}
}

// acquireAfterRelease waits until a release of key this registry started in the
// background (releaseDone) has ended, so that a delivery right after a commit claims a
// free lease instead of meeting its own.
func (r *Registry) acquireAfterRelease(ctx context.Context, key string) {
	if ch, ok := r.releasing.Load(key); ok {
		select {
		case <-ch.(chan struct{}):
		case <-ctx.Done():
		}
	}
}

// release gives the lease back on a detached context.
func (r *Registry) release(ctx context.Context, lease lua.Lease, done bool) error {
	rctx, cancel := detached(ctx)
	defer cancel()
	if done {
		return r.leases.ReleaseCommitted(rctx, lease)
	}
	return r.leases.Release(rctx, lease)
}

// beforeDeadline returns a context that ends a little before ctx's deadline (asynq's task
// deadline): a tenth of the time left, at most 5 s.
func beforeDeadline(ctx context.Context) (context.Context, context.CancelFunc) {
	d, ok := ctx.Deadline()
	if !ok {
		return context.WithCancel(ctx)
	}
	return context.WithDeadline(ctx, d.Add(-deadlineMargin(time.Until(d))))
}

// deadlineMargin is how much earlier than asynq's deadline the runner stops: a tenth of the
// time left, at most 5 s.
func deadlineMargin(left time.Duration) time.Duration { return min(left/10, 5*time.Second) }

// attemptCost is what an attempt's bytes cost at the provider's price (zero without one),
// counted in idemscrape_proxy_cost_total once per attempt: the provider bills the bytes
// whatever becomes of the attempt. The attempt's record (commit, failure, superseded
// evidence) stores the same figure. It is the attempt's share of the process's running
// total at that price, rounded once (sessions.Price.Charge), so that the attempts of a
// window or a job add up to their bytes' cost, not to a rounding error per attempt.
func (r *Registry) attemptCost(prov *sessions.Provider, k *kind, job tasks.Payload, bytes int64) store.Cost {
	price := prov.Price()
	micros := price.Charge(bytes, job.Spec.Country)
	if micros == 0 {
		return store.Cost{}
	}
	r.metrics.proxyCost.WithLabelValues(k.name, prov.Name(), price.Currency).Add(float64(micros) / 1e6)
	return store.Cost{Micros: micros, Currency: price.Currency}
}

// workResult is what steps 3 and 4 produced.
type workResult struct {
	cost store.Cost // what unit.Bytes cost (attemptCost)
	unit sessions.Result
	obs  Observation
	data json.RawMessage
	err  error // a *sessions.FetchError
	// probe: this delivery is the incident breaker's probe.
	probe bool
	// pooled: the unit ran on sessions of the worker's pool (Config.SessionPool), which
	// retires a session that failed (sessions.Unit.Run) or whose parse found a block
	// (sessionDone): the next attempt starts on another.
	pooled bool
	// capture holds the steps' responses when the kind's saved-input policy may keep
	// them (nil otherwise).
	capture *capture
}

// blockRetired: the attempt failed because the destination refused its session (blocked,
// or a 403 or 429), and that session was a pooled one, which the pool has retired for it
// (sessions' retirement reason "blocked"): the refusal was of that session's exit, and the
// next attempt runs on another. Its retry then waits only for the host (the destination's
// Retry-After, which the politeness host limiter holds for every worker), not for the
// category's backoff (failureInput.NewSession).
func (w *workResult) blockRetired(fe *sessions.FetchError) bool {
	if !w.pooled || w.unit.Session == nil {
		return false
	}
	return fe.Category == tasks.CategoryBlocked || fe.Status == http.StatusForbidden || fe.Status == http.StatusTooManyRequests
}

func (w *workResult) session() string {
	if w.unit.Session == nil {
		return ""
	}
	return w.unit.Session.ID
}

// work runs the workflow unit and the parser. A panic in user code becomes an error of
// category panic: the attempt is recorded and the job stays retryable.
func (r *Registry) work(ctx context.Context, k *kind, job tasks.Payload, acq acquired, log *slog.Logger) (w workResult) {
	attemptNo := acq.Attempt.AttemptNo
	defer func() {
		if rec := recover(); rec != nil {
			log.ErrorContext(ctx, "panic in workflow or parser", "panic", fmt.Sprint(rec), "stack", string(debug.Stack()))
			w.err = &sessions.FetchError{Category: tasks.CategoryPanic, Err: fmt.Errorf("panic: %v", rec)}
		}
	}()
	// A version this worker does not have: refused before anything is fetched.
	parser, ok := k.parserFor(job.Spec.ParserVersion)
	if !ok {
		w.err = &sessions.FetchError{Category: CategoryParserVersion, Err: &ParserVersionError{
			Kind: k.name, Version: job.Spec.ParserVersion, Have: k.versions(), Worker: r.cfg.WorkerID}}
		return w
	}
	// The fleet's schema fingerprints of this version (once per process): read before
	// anything is fetched, so that a database that can not give them costs no bandwidth.
	if _, err := r.schemas(ctx, k, job.Spec.ParserVersion); err != nil {
		cat := tasks.CategoryInternal
		if ctx.Err() != nil {
			// The read was cut by the job's own context (lease lost, shutdown), not by a
			// broken database: the attempt was interrupted, like one cut mid-fetch.
			cat, err = tasks.CategoryInterrupted, fmt.Errorf("%w (reading schema fingerprints: %w)", context.Cause(ctx), err)
		}
		w.err = &sessions.FetchError{Category: cat, Err: err}
		return w
	}
	unit, err := k.workflow(job)
	if err != nil {
		w.err = &sessions.FetchError{Category: tasks.CategoryInternal, Err: fmt.Errorf("build workflow: %w", err)}
		return w
	}
	if k.saved.Enabled() {
		// Responses are captured only when the policy may keep them: with "never" the unit
		// runs untouched.
		w.capture = &capture{now: r.cfg.Now}
		unit = w.capture.wrap(unit)
	}
	collector := r.cfg.Collector
	if collector.Limiter == nil {
		collector.Limiter = k.limiter
	}
	// The job's budgets, and the bytes a window reservation buys, topped up as the attempt
	// reaches them.
	maxBytes, budgetNote, moreBytes := acq.money.byteCap(acq.Attempt.BudgetBytes, acq.Lease.Token)
	// The worker's session pool (Config.SessionPool), unless the kind opted out: the unit
	// may start on a warm session of its host (the workflow's Unit.Site, else the job
	// URL's); a session that served it well is handed back by sessionDone.
	var pool *sessions.Pool
	if !k.noPool {
		pool = r.pool
	}
	if pool != nil && unit.Site == "" && job.Spec.URL != "" {
		if u, err := url.Parse(job.Spec.URL); err == nil {
			cp := *unit // the workflow's unit may be shared between attempts
			cp.Site = u.Host
			unit = &cp
		}
	}
	w.pooled = pool != nil && unit.Site != ""
	w.unit, err = unit.Run(ctx, sessions.RunConfig{
		Pool:               pool,
		PoolCookies:        k.poolCookies,
		PoolScope:          k.poolScope(),
		Profiles:           k.profiles,
		Provider:           acq.slot.prov,
		Country:            job.Spec.Country,
		SessionLifetime:    k.sessionLifetime,
		MaxSessionRestarts: r.cfg.MaxSessionRestarts,
		MaxResumes:         r.cfg.MaxResumes,
		// The job's bandwidth and money budgets are enforced inside the attempt, not only
		// between them.
		MaxBytes:   maxBytes,
		BudgetNote: budgetNote,
		MoreBytes:  moreBytes,
		Collector:  collector,
		Now:        r.cfg.Now,
		Logger:     log,
		Quarantine: func(qctx context.Context, q sessions.Quarantined) error {
			staged, err := json.Marshal(q.Staged)
			if err != nil {
				return err
			}
			// Evidence, not data: a NUL (which jsonb refuses) becomes U+FFFD; the text
			// "\u0000" (an escaped backslash) is left alone.
			staged = store.JSONReplaceNUL(staged)
			qctx, cancel := detached(qctx)
			defer cancel()
			return r.cfg.Store.QuarantineInsert(qctx, store.QuarantineParams{
				Key: job.Key, AttemptNo: attemptNo, SessionID: q.SessionID,
				Reason: string(q.Reason), Detail: q.Detail, Staged: staged,
			})
		},
	})
	if err != nil {
		fe := asFetchError(err, tasks.CategoryInternal)
		if terr := acq.money.topUpErr(); terr != nil && fe.Category == tasks.CategoryBudgetExceeded {
			// Stopped because the window's budget could not be asked, not because it is
			// spent: retried.
			fe = &sessions.FetchError{Category: tasks.CategoryInternal, Step: fe.Step,
				Err: fmt.Errorf("window reservation not topped up: %w (%w)", terr, err)}
		}
		w.err = fe
		return w
	}
	var perr *sessions.FetchError
	w.obs, perr = r.parseTraced(ctx, k, parser, job, w.unit.Staged)
	if perr != nil {
		w.err = perr
		if perr.Category == tasks.CategoryValidation {
			r.quarantineParse(ctx, job, acq, &w, log)
		}
		return w
	}
	if w.obs.ObservationKey == "" {
		w.obs.ObservationKey = job.Key
	}
	if w.data, err = json.Marshal(w.obs.Data); err != nil {
		w.err = &sessions.FetchError{Category: tasks.CategoryParseError, Err: fmt.Errorf("encode observation: %w", err)}
	} else if store.JSONHasNUL(w.data) {
		w.err = &sessions.FetchError{Category: tasks.CategoryValidation,
			Err: errors.New("the record contains a NUL character, which PostgreSQL can not store in jsonb: remove it in the parser")}
	}
	return w
}

// sessionDone ends the unit's hold on its pooled session (Config.SessionPool) once the
// parse is known: kept warm for the next unit of its host after a success, retired after a
// parser's block verdict or any other failure (the unit's own failures retired it already).
// It also counts the unit by session kind (warm, new) and outcome.
func (r *Registry) sessionDone(k *kind, w *workResult) {
	if w.unit.Session == nil {
		return
	}
	outcome := "ok"
	if w.err != nil {
		outcome = "failed"
		if sessions.CategoryOf(w.err) == tasks.CategoryBlocked {
			outcome = "blocked"
		}
	}
	// The session the outcome is about: the unit's last (a replay's), as its attempt row
	// records it (attempts.session_units, stats by session).
	session := "new"
	if w.unit.SessionUnits > 0 {
		session = "warm"
	}
	r.metrics.sessionUnits.WithLabelValues(k.name, session, outcome).Inc()
	switch {
	case w.unit.Lease == nil:
	case w.err == nil:
		w.unit.Lease.Keep()
	case outcome == "blocked":
		w.unit.Lease.Retire(sessions.PoolRetireBlocked)
	default:
		w.unit.Lease.Retire(sessions.PoolRetireFailed)
	}
}

// commit is step 5: the fenced, single-statement commit.
func (r *Registry) commit(ctx context.Context, k *kind, job tasks.Payload, acq acquired, w workResult) error {
	payload, err := eventPayload(w.obs.Event, defaultEvent{JobKey: job.Key, ObservationKey: w.obs.ObservationKey,
		Kind: k.name, ParserVersion: job.Spec.ParserVersion, Data: w.data})
	if err != nil {
		return err
	}
	sess := w.unit.Session
	began := time.Now()
	res, err := r.cfg.Committer.Commit(ctx, store.CommitParams{
		Key: job.Key, Token: acq.Lease.Token,
		ObservationKey: w.obs.ObservationKey, ParserVersion: job.Spec.ParserVersion,
		Data: w.data, Fingerprint: fingerprint(w.unit.Staged),
		EventKey: EventKey(job.Key), Topic: k.topic, EventPayload: payload,
		HTTPStatus: w.unit.LastStatus, Bytes: w.unit.Bytes, SessionID: sess.ID, ProxyEndpoint: sess.Endpoint,
		Cost: w.cost, SessionUnits: w.unit.SessionUnits,
	})
	r.metrics.commitSeconds.Observe(time.Since(began).Seconds())
	if err != nil {
		return err
	}
	r.metrics.attempts.WithLabelValues(k.name, store.OutcomeComplete, "").Inc()
	r.metrics.attemptsPerJob.WithLabelValues(k.name).Observe(float64(acq.Attempt.AttemptNo))
	r.metrics.jobBytes.WithLabelValues(k.name).Observe(float64(acq.Attempt.BytesTotal + w.unit.Bytes))
	if acq.Attempt.TookOver {
		r.metrics.afterRecovery.WithLabelValues(k.name).Inc()
	}
	if !res.ResultInserted {
		r.metrics.duplicateResults.WithLabelValues(k.name).Inc()
	}
	return nil
}

// defaultEvent is the outbox event of an observation whose parser set no Event. Its
// fields are in the order json.Marshal writes a map's keys (sorted): the bytes are those of
// the map[string]any it replaces, encoded without building and sorting a map per job.
type defaultEvent struct {
	Data           json.RawMessage `json:"data"`
	JobKey         string          `json:"job_key"`
	Kind           string          `json:"kind"`
	ObservationKey string          `json:"observation_key"`
	ParserVersion  int             `json:"parser_version"`
}

// eventPayload encodes the parser's event, or def when it set none.
func eventPayload(event any, def defaultEvent) ([]byte, error) {
	var b []byte
	var err error
	if event != nil {
		b, err = json.Marshal(event)
	} else {
		b, err = json.Marshal(&def)
	}
	if err != nil {
		return nil, fmt.Errorf("encode event: %w", err)
	}
	return b, nil
}

// EventPayload is the outbox event payload of job's observation obs, whose record encodes
// to data: obs.Event encoded, or when the parser set none the default event (data, job_key,
// kind, observation_key, parser_version). It is the runner's encoding, byte for byte, for
// a tool that commits observations through the fenced commit itself (package reparse).
func EventPayload(job tasks.Payload, obs Observation, data json.RawMessage) ([]byte, error) {
	return eventPayload(obs.Event, defaultEvent{JobKey: job.Key, ObservationKey: obs.ObservationKey,
		Kind: job.Spec.Kind, ParserVersion: job.Spec.ParserVersion, Data: data})
}

// EventKey is the outbox event key of a job's observation: stable across attempts, so a
// consumer recognises a re-published event.
func EventKey(jobKey string) string { return "observed:" + jobKey }

// notStarted handles a delivery whose attempt could not start.
func (r *Registry) notStarted(k *kind, job tasks.Payload, err error, log *slog.Logger) error {
	var held *lua.HeldError
	switch {
	case errors.As(err, &held):
		r.metrics.leaseBusy.WithLabelValues(k.name).Inc()
		delay := leaseBusyMaxDelay
		if held != nil {
			delay = min(held.Remaining, leaseBusyMaxDelay)
		}
		delay += time.Duration(r.cfg.Rand() * float64(time.Second))
		return &retryError{delay: delay, counted: false, err: fmt.Errorf("%s: %w", tasks.CategoryLeaseBusy, err)}
	case errors.Is(err, store.ErrJobComplete):
		r.metrics.acknowledgedNoOps.WithLabelValues(k.name, string(tasks.StateComplete)).Inc()
		return nil
	case errors.Is(err, store.ErrJobFailed):
		r.metrics.acknowledgedNoOps.WithLabelValues(k.name, string(tasks.StateFailed)).Inc()
		return nil
	case errors.Is(err, store.ErrJobNotFound):
		// Nothing to run and nothing to strand: revoke, which deletes the task and frees
		// its id (SkipRetry would archive it and keep the key taken for months).
		r.metrics.tasksDropped.WithLabelValues(k.name, "no_job_row").Inc()
		log.Error("task for a job that has no jobs row: revoked", "err", err)
		return fmt.Errorf("%w: %w", asynq.RevokeTask, err)
	case errors.As(err, new(*store.TransitionError)), errors.Is(err, store.ErrGroupCommitterClosed), refusedByPostgres(err):
		// The row refused the start for a reason of its own, PostgreSQL refused the
		// statement (e.g. a database not migrated), or this worker is closing: no outage,
		// so not the short retry below (asynq's own backoff).
		return err
	}
	return r.unavailable(k, err)
}

// refusedByPostgres: err is PostgreSQL's answer refusing a statement for a reason of its
// own (an undefined table on a database not migrated, a constraint), which retrying soon
// does not mend. Its SQLSTATE classes 08 (connection), 40 (serialization, deadlock), 53
// (resources: too many connections, disk full) and 57 (shutdown, cancel) pass with time.
func refusedByPostgres(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || len(pgErr.Code) < 2 {
		return false
	}
	switch pgErr.Code[:2] {
	case "08", "40", "53", "57":
		return false
	}
	return true
}

// unavailable is the asynq error of a delivery that did not start because Redis or
// PostgreSQL failed (err). RetryDelay waits for it by asynq's retry count, up to
// UnavailableRetryMaxDelay. It counts against MaxRetry, the backstop: at 30–60 s a retry,
// the default 1,000 last some 8 to 17 hours of outage, a small MaxRetry (e.g. 25: 10 to 20
// minutes) archives the task sooner, and the reconciler repairs an archived task of a
// runnable job. It is no failure of the job: its row is untouched, no attempt recorded.
func (r *Registry) unavailable(k *kind, err error) error {
	r.metrics.unavailable.WithLabelValues(k.name).Inc()
	return &retryError{unavailable: true, counted: true, err: fmt.Errorf("not started: %w", err)}
}

// superseded: a newer attempt owns the job (or it is complete or failed); this delivery
// wrote no result and is done. failure is the attempt's own failure, if it had one. Its
// evidence — bytes moved, session, error — is still recorded: duplicate work is what the
// bandwidth figures must show.
func (r *Registry) superseded(ctx context.Context, k *kind, job tasks.Payload, acq acquired, w workResult, log *slog.Logger, err, failure error) error {
	r.metrics.attempts.WithLabelValues(k.name, store.OutcomeSuperseded, string(tasks.CategorySuperseded)).Inc()
	text := err.Error()
	if failure != nil {
		text = failure.Error() + "; then: " + text
	}
	status := w.unit.LastStatus
	var fe *sessions.FetchError
	if errors.As(failure, &fe) && fe.Status != 0 {
		status = fe.Status
	}
	ectx, cancel := detached(ctx)
	defer cancel()
	if eerr := r.cfg.Store.AttemptSupersede(ectx, store.AttemptSupersedeParams{
		Key: job.Key, Token: acq.Lease.Token, Bytes: w.unit.Bytes, HTTPStatus: status, Cost: w.cost,
		SessionID: w.session(), ProxyEndpoint: acq.slot.prov.Gateway(),
		Category: string(tasks.CategorySuperseded), Error: text,
	}); eerr != nil {
		log.WarnContext(ctx, "superseded attempt's evidence not recorded", "err", eerr)
	}
	if failure != nil {
		log.Info("attempt superseded; nothing written", "err", err, "failure", failure.Error())
	} else {
		log.Info("attempt superseded; nothing written", "err", err)
	}
	return nil
}

// failed records a failed attempt and tells asynq what to do next.
func (r *Registry) failed(ctx context.Context, k *kind, job tasks.Payload, acq acquired, w workResult, log *slog.Logger) error {
	fe := asFetchError(w.err, tasks.CategoryInternal)
	now := r.cfg.Now()
	incident := isIncident(fe.Category)
	// Neither an incident, nor a parser version this worker lacks, nor a wait for a host
	// slot the fleet imposed (another job's Retry-After, the host's booked rate) is the
	// job's failure: out of its budget, not counted by asynq.
	hostWait := isHostWait(fe)
	// An attempt the window's reservation stopped, in a window that defers its jobs.
	windowDefer := fe.Category == tasks.CategoryBudgetExceeded && acq.money.stoppedByWindow() && k.window.OnSpent == WindowDefer
	// A provider without exits in the country, or a tier the destination blocks: the job
	// goes to another provider at once (routing.go).
	routed, isRouted := r.rerouted(ctx, k, job, acq, fe, log)
	exempt := incident || fe.Category == CategoryParserVersion || hostWait || windowDefer || isRouted
	var d decision
	switch {
	case isRouted:
		d = routed
	case windowDefer:
		d = decision{Retry: true, Category: fe.Category,
			Delay: k.window.DeferFor + time.Duration(r.cfg.Rand()*float64(windowWaitMax))}
	case hostWait:
		// Nothing was sent: retry once the slot is due, spread over HostWaitMax so that the
		// host's queued jobs do not all come back at the same instant. Not charged against
		// the total time budget: a job near its end would otherwise fail as
		// budget_exceeded for a pause it did not cause.
		d = decision{Retry: true, Category: fe.Category,
			Delay: fe.RetryAfter + time.Duration(r.cfg.Rand()*float64(r.cfg.HostWaitMax))}
	case fe.Category == CategoryParserVersion:
		p := k.retry.policy(CategoryParserVersion)
		d = decision{Retry: true, Category: fe.Category,
			Delay: max(p.Base/2, backoff(p, acq.Attempt.BudgetAttemptNo, r.cfg.Rand))}
	case incident:
		// The account's failure, not the job's: no cap, no budget, not counted. The job waits
		// until the breaker's probe may run, spread over one probe interval.
		opened, wait := acq.slot.breaker.trip(fe.Category, fe.Error(), now, w.probe)
		if opened {
			r.metrics.incidentTrips.WithLabelValues(string(fe.Category)).Inc()
			if open := r.openProviders(); open < len(r.providers) {
				log.ErrorContext(ctx, "proxy incident: the gateway refused the account; its deliveries go to the next provider until a probe authenticates",
					"category", string(fe.Category), "provider", acq.slot.prov.Name(), "gateway", acq.slot.prov.Gateway(),
					"err", fe.Error(), "probe_in", wait, "providers_open", open, "providers", len(r.providers))
			} else {
				log.ErrorContext(ctx, "proxy incident: the gateway refused the account; taking no work until a probe authenticates",
					"category", string(fe.Category), "provider", acq.slot.prov.Name(), "gateway", acq.slot.prov.Gateway(),
					"err", fe.Error(), "probe_in", wait)
			}
		}
		d = decision{Retry: true, Category: fe.Category,
			Delay: wait + time.Duration(r.cfg.Rand()*float64(r.cfg.IncidentProbeInterval))}
		if r.incidentState() == nil {
			// Another provider takes work: the job goes to it at once (asynq's resolution is
			// a second), on a new session there.
			d.Delay = time.Second
		}
	default:
		d = k.retry.decide(failureInput{
			Category: fe.Category,
			// The budget counts from the job's creation or an operator's requeue.
			AttemptNo:  acq.Attempt.BudgetAttemptNo,
			RetryAfter: fe.RetryAfter,
			JobAge:     now.Sub(acq.Attempt.BudgetSince),
			JobBytes:   acq.Attempt.BudgetBytes + w.unit.Bytes,
			JobCost:    acq.money.jobCost(acq.Attempt.BudgetBytes + w.unit.Bytes),
			NewSession: w.blockRetired(fe),
		}, r.cfg.Rand)
	}
	if d.Retry && !exempt {
		// asynq archives a task past its MaxRetry; fail the job first so the two agree.
		if retried, ok := asynq.GetRetryCount(ctx); ok {
			if maxRetry, ok := asynq.GetMaxRetry(ctx); ok && retried >= maxRetry {
				d = decision{Category: tasks.CategoryBudgetExceeded, Why: fmt.Sprintf("asynq MaxRetry %d reached (last failure: %s)", maxRetry, fe.Category)}
			}
		}
	}
	errText := fe.Error()
	if d.Why != "" {
		errText = d.Why + ": " + errText
	}
	if w.unit.Session != nil {
		// Evidence of which exit the attempt ran on, or that nobody checked.
		errText += "; " + w.unit.ExitEvidence()
	}
	params := store.AttemptFinishParams{
		Key: job.Key, Token: acq.Lease.Token, Category: string(d.Category), Error: errText,
		HTTPStatus: fe.Status, Bytes: w.unit.Bytes, SessionID: w.session(), Cost: w.cost, SessionUnits: w.unit.SessionUnits,
	}
	// The writes below are fenced like the commit: a superseded attempt writes nothing. They
	// run even if the job context was cancelled (lease lost), on a detached context.
	wctx, cancel := detached(ctx)
	defer cancel()
	var err error
	outcome := store.OutcomeFailed
	if d.Retry {
		outcome = store.OutcomeRetryable
		params.NextAttemptAt = now.Add(d.Delay)
		err = r.cfg.Store.JobMarkRetryable(wctx, params)
		if err == nil && exempt {
			// The account's failure (or the deploy's, or the fleet's wait), not the job's: out of the job's
			// attempt cap and bandwidth budget (it stays in the history). A failure here only
			// costs the job one attempt of its budget.
			if _, xerr := ops.New(r.cfg.Store.Pool()).JobBudgetExempt(wctx, job.Key, acq.Lease.Token, w.unit.Bytes); xerr != nil {
				log.WarnContext(ctx, "incident attempt still counts against the job's budget", "err", xerr)
			}
		}
	} else {
		err = r.cfg.Store.JobFail(wctx, params)
	}
	if isSuperseded(err) {
		return r.superseded(ctx, k, job, acq, w, log, err, fe)
	}
	if err != nil {
		// Not recorded: the database is unreachable, or our own attempt start was lost (the
		// job's fence is below our token). Keep the task so a later delivery decides again.
		log.ErrorContext(ctx, "failed attempt not recorded; retrying the delivery", "err", err, "failure", errText)
		delay := d.Delay
		if !d.Retry {
			delay = backoff(k.retry.policy(tasks.CategoryInternal), acq.Attempt.BudgetAttemptNo, r.cfg.Rand)
		}
		return &retryError{delay: delay, counted: true, err: fmt.Errorf("record failed attempt: %w (after %w)", err, fe)}
	}
	r.metrics.attempts.WithLabelValues(k.name, outcome, string(d.Category)).Inc()
	if span := attemptSpan(ctx); span != nil {
		span.SetAttributes(attribute.String("idemscrape.outcome", outcome),
			attribute.String("idemscrape.category", string(d.Category)), attribute.Bool("idemscrape.retry", d.Retry))
	}
	log.WarnContext(ctx, "attempt failed", "category", string(d.Category), "retry", d.Retry,
		"delay", d.Delay, "session", w.session(), "err", errText)
	if !d.Retry {
		r.metrics.jobBytes.WithLabelValues(k.name).Observe(float64(acq.Attempt.BytesTotal + w.unit.Bytes))
		return fmt.Errorf("%w: %s: %w", asynq.SkipRetry, d.Category, fe)
	}
	return &retryError{delay: d.Delay, counted: !exempt, err: fe}
}

// isSuperseded tells a refusal that means "another attempt owns the job" — it is complete
// or failed, or its fence is above our token — from one that means our own start was lost
// (fence below our token), which must not drop the task.
func isSuperseded(err error) bool {
	var te *store.TransitionError
	if !errors.As(err, &te) {
		return false
	}
	return errors.Is(err, store.ErrJobComplete) || errors.Is(err, store.ErrJobFailed) || te.Fence > te.Token
}

// asFetchError keeps a categorised error as it is and gives any other error category def.
func asFetchError(err error, def tasks.Category) *sessions.FetchError {
	var fe *sessions.FetchError
	if errors.As(err, &fe) {
		return fe
	}
	if c, ok := tasks.CategoryFrom(err); ok { // tasks.Fail from a parser or workflow builder
		return &sessions.FetchError{Category: c, Err: err}
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return &sessions.FetchError{Category: tasks.CategoryTimeout, Err: err}
	}
	return &sessions.FetchError{Category: def, Err: err}
}

// fingerprint is the sha256 of the staged data (JSON with sorted keys): the same
// responses give the same fingerprint.
func fingerprint(staged map[string]json.RawMessage) string {
	b, _ := json.Marshal(staged)
	sum := sha256.Sum256(b)
	out := make([]byte, 0, len("sha256:")+2*sha256.Size)
	out = append(out, "sha256:"...)
	return string(hex.AppendEncode(out, sum[:]))
}

// owner is a lease owner of this worker: WorkerID/nonce, built in one allocation.
func (r *Registry) owner() string {
	var n [6]byte
	_, _ = rand.Read(n[:])
	var buf [128]byte
	b := append(buf[:0], r.cfg.WorkerID...)
	b = append(b, '/')
	return string(hex.AppendEncode(b, n[:]))
}
