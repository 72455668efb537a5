package scheduler

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/inputs"
	"github.com/idemscrape/idemscrape/tasks"
)

// ReconcileStore is what the reconciler needs from the system of record.
type ReconcileStore interface {
	tasks.JobRecorder
	JobsListRunning(ctx context.Context, p store.JobsListParams) ([]store.RunningJob, error)
	JobsListRunnable(ctx context.Context, p store.JobsListParams) ([]store.Job, error)
	JobsListRunnableActive(ctx context.Context, after store.ActivityCursor, until time.Time, limit int) ([]store.Job, store.ActivityCursor, error)
	JobsRescue(ctx context.Context, ps []store.JobRescueParams) ([]error, error)
	CountersAdd(ctx context.Context, deltas map[string]int64) error
}

var _ ReconcileStore = (*store.PG)(nil)

// OutboxMaintainer reports outbox lag and prunes old outbox and inbox rows (PGOutbox).
type OutboxMaintainer interface {
	// Lag reports the unsent outbox rows older than olderThan and the oldest one's time.
	Lag(ctx context.Context, olderThan time.Duration) (unsent int64, oldest time.Time, err error)
	// PruneSent deletes at most limit sent outbox rows sent more than olderThan ago.
	PruneSent(ctx context.Context, olderThan time.Duration, limit int) (int64, error)
	// PruneInbox deletes at most limit inbox rows seen more than olderThan ago.
	PruneInbox(ctx context.Context, olderThan time.Duration, limit int) (int64, error)
}

// InputsPruner deletes saved inputs older than a retention, one bounded batch per call
// (*inputs.Store).
type InputsPruner interface {
	Prune(ctx context.Context, p inputs.PruneParams) (inputs.PruneResult, error)
}

var _ InputsPruner = (*inputs.Store)(nil)

// Reconciler defaults.
const (
	// DefaultRescueLease is how long the reconciler holds a job's lease while it moves the
	// job back to retryable.
	DefaultRescueLease = 30 * time.Second
	// DefaultConcurrency is how many re-enqueue batches run at once (a page's lease claims
	// and releases are one pipelined round trip each).
	DefaultConcurrency = 16
	// minRequeueChunk is the smallest re-enqueue batch worth its own jobs statement.
	minRequeueChunk = 32
	// DefaultMaxPruneBatches bounds the delete statements per table per sweep.
	DefaultMaxPruneBatches = 100
	// rescuePagesInFlight is how many pages of stranded running jobs are rescued at once.
	rescuePagesInFlight = 4
	// dueSlack widens DueBefore so jobs rescued moments ago (next_attempt_at = the
	// database's now) are re-enqueued in the same sweep despite clock skew.
	dueSlack = 5 * time.Second
)

// Counter names the reconciler adds to (store.CountersAdd, shown by `idemscrape stats`);
// without the "reconciler_" prefix they are the action label of
// idemscrape_reconciler_actions_total.
const (
	ActionRescued        = "reconciler_rescued"           // running → retryable after its lease expired
	ActionRescueRefused  = "reconciler_rescue_refused"    // the job moved on before the fenced rescue
	ActionLeaseHeld      = "reconciler_lease_held"        // an old attempt whose worker still holds the lease: left alone
	ActionRequeued       = "reconciler_requeued"          // runnable job without an asynq task: enqueued again
	ActionArchivedRepair = "reconciler_archived_repaired" // runnable job whose task asynq archived: deleted and enqueued again
	ActionAlreadyQueued  = "reconciler_already_queued"    // raced with a live enqueue: nothing to do
	ActionOutboxPruned   = "reconciler_outbox_pruned"     // sent outbox rows deleted
	ActionInboxPruned    = "reconciler_inbox_pruned"      // inbox rows deleted
	// ActionSavedInputsPruned counts saved inputs (with their responses) deleted after
	// reconciler.saved_input_retention, ActionInputBlobsPruned the stored bodies deleted
	// because nothing referenced or used them for as long.
	ActionSavedInputsPruned = "reconciler_saved_inputs_pruned"
	ActionInputBlobsPruned  = "reconciler_input_blobs_pruned"
	ActionOutboxLagging     = "reconciler_outbox_lag_reports"
	ActionSweepErrors       = "reconciler_sweep_errors"
	// ActionKeyMismatch: a job whose recorded spec no longer derives its key (the
	// normaliser's configuration changed since it was enqueued) is left for review instead of
	// being enqueued under another key, which would create a second job.
	ActionKeyMismatch = "reconciler_key_mismatch"
)

// ReconcilerConfig configures a Reconciler.
type ReconcilerConfig struct {
	// File gives the kinds' queues and longest leases and the reconciler settings
	// (interval, batch size, thresholds, retentions). Required.
	File *File
	// Store is the system of record (store.PG). Required.
	Store ReconcileStore
	// Outbox reports lag and prunes (PGOutbox). Optional: without it that part is skipped.
	Outbox OutboxMaintainer
	// Inputs prunes saved inputs (store/inputs) after File.Reconciler.SavedInputRetention.
	// Defaults to inputs.New on the Store's pool when Store is a *store.PG; otherwise that
	// part is skipped.
	Inputs InputsPruner
	// Retention deletes terminal jobs, quarantine and windows past their retention
	// (File.Reconciler.JobRetention, QuarantineRetention; see retention.go). Defaults to the
	// Store when it is a *store.PG; otherwise that part is skipped.
	Retention RetentionPruner
	// Redis holds the leases and asynq's tasks (the same server as Client). Required.
	Redis redis.UniversalClient
	// Client enqueues tasks. Required.
	Client *asynq.Client
	// Inspector repairs archived tasks of runnable jobs. Optional; without it such a task
	// is counted as already queued.
	Inspector *asynq.Inspector
	// KeyPrefix of the lease keys: the workers' handlers.Config.KeyPrefix. Defaults to
	// "idemscrape:".
	KeyPrefix string
	// ID names this reconciler; its lease owner is "reconciler/<ID>". Defaults to
	// hostname/pid.
	ID string
	// RescueLease is the lease the reconciler holds while rescuing. Defaults to
	// DefaultRescueLease.
	RescueLease time.Duration
	// Concurrency is how many re-enqueue batches run at once (asynq enqueues one task per
	// round trip; a page's lease claims and releases are pipelined instead). Defaults to
	// DefaultConcurrency.
	Concurrency int
	// Normalizer of the enqueuers. Defaults to tasks.DefaultNormalizer.
	Normalizer *tasks.Normalizer
	// Destinations of the enqueuers. Defaults to tasks' strict policy.
	Destinations *tasks.DestinationPolicy
	// QueryTimeout bounds each page's statements and round trips. Defaults to
	// DefaultQueryTimeout.
	QueryTimeout time.Duration
	// Registerer receives the metrics. Defaults to a private registry (Gatherer).
	Registerer prometheus.Registerer
	// Logger. Defaults to slog.Default().
	Logger *slog.Logger
	// Now is the clock. Defaults to time.Now.
	Now func() time.Time
	// TestSignal, when set, receives the report of every sweep of the loop (tests only).
	TestSignal chan<- SweepReport
}

// Validate checks c and fills in defaults.
func (c *ReconcilerConfig) Validate() error {
	switch {
	case c.File == nil:
		return errors.New("scheduler: ReconcilerConfig.File is required")
	case c.Store == nil:
		return errors.New("scheduler: ReconcilerConfig.Store is required")
	case c.Redis == nil:
		return errors.New("scheduler: ReconcilerConfig.Redis is required")
	case c.Client == nil:
		return errors.New("scheduler: ReconcilerConfig.Client is required")
	case c.RescueLease < 0:
		return fmt.Errorf("scheduler: ReconcilerConfig.RescueLease %v is negative", c.RescueLease)
	case c.Concurrency < 0:
		return fmt.Errorf("scheduler: ReconcilerConfig.Concurrency %d is negative", c.Concurrency)
	case c.QueryTimeout < 0:
		return fmt.Errorf("scheduler: ReconcilerConfig.QueryTimeout %v is negative", c.QueryTimeout)
	}
	if c.KeyPrefix == "" {
		c.KeyPrefix = "idemscrape:"
	}
	if c.ID == "" {
		host, _ := os.Hostname()
		c.ID = fmt.Sprintf("%s/%d", host, os.Getpid())
	}
	if c.RescueLease == 0 {
		c.RescueLease = DefaultRescueLease
	}
	if c.Concurrency == 0 {
		c.Concurrency = DefaultConcurrency
	}
	if c.Normalizer == nil {
		c.Normalizer = tasks.DefaultNormalizer
	}
	if c.QueryTimeout == 0 {
		c.QueryTimeout = DefaultQueryTimeout
	}
	if c.Inputs == nil {
		if pg, ok := c.Store.(*store.PG); ok {
			c.Inputs = inputs.New(pg.Pool())
		}
	}
	if c.Retention == nil {
		if pg, ok := c.Store.(*store.PG); ok {
			c.Retention = pg
		}
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return nil
}

// SweepReport counts what one sweep did, by action (the Action* names).
type SweepReport struct {
	Actions map[string]int64
	// OutboxUnsent is the number of unsent outbox rows older than the threshold.
	OutboxUnsent int64
	// Statements counts PostgreSQL statements, RedisTrips Redis round trips (pipelines
	// count once).
	Statements, RedisTrips int64
	// RowsRead counts the jobs rows the sweep's statements returned; RedisCommands the
	// Redis commands it sent (each of a pipeline; an enqueue counts one).
	RowsRead, RedisCommands int64
	// FullRequeue: Redis had lost its data (the reconciler's marker was gone), so the
	// re-enqueue pass checked every runnable job instead of those that changed.
	FullRequeue bool
	// Time spent in each part of the sweep, from its start. The rescue and the re-enqueue
	// pass run at once: RescueTime and RequeueTime overlap; OutboxTime is what follows (outbox
	// lag and pruning, saved-input pruning).
	RescueTime, RequeueTime, OutboxTime time.Duration
	Err                                 error
}

// Reconciler repairs what a lost Redis or a dead worker leaves behind, from PostgreSQL,
// in keyset-paged sweeps; any number of reconcilers may sweep at once:
//
//   - a running job whose attempt is older than its kind's longest lease: the reconciler
//     claims the job's lease itself (floor = the job's fence). If a worker holds it, the
//     job is left alone — a live worker is never robbed. Otherwise it holds a token above
//     the fence and moves the job to retryable with store.JobsRescue (one statement per
//     page), fenced per job on the fence it listed and raising it to its token, so a stale worker's commit is refused and a
//     second reconciler's rescue is refused; then it releases the lease;
//   - a due pending or retryable job (rescued ones included) whose asynq task is missing or
//     archived: its task is enqueued again (TaskID = key deduplicates a race with a live
//     enqueue; the Inspector deletes an archived task first);
//   - unsent outbox rows older than the threshold are reported (metric, log); sent outbox
//     rows, inbox rows and saved inputs (with the bodies nothing references any more)
//     older than their retention are deleted in bounded batches;
//   - terminal jobs with all their rows, quarantine and schedule windows past their
//     retention are deleted in bounded batches (retention.go).
//
// Every action is counted in Prometheus metrics and in store.CountersAdd.
type Reconciler struct {
	cfg     ReconcilerConfig
	leases  *lua.Leases
	enq     *enqueuers
	metrics *reconcilerMetrics
	gath    prometheus.Gatherer

	requeue requeueCursor // guarded by requeueMu: where the re-enqueue pass goes on
	// requeueMu serialises the re-enqueue passes of concurrent Sweep calls.
	requeueMu sync.Mutex

	mu      sync.Mutex
	cancel  context.CancelFunc
	done    chan struct{}
	running bool
}

// NewReconciler validates cfg and returns a stopped Reconciler.
func NewReconciler(cfg ReconcilerConfig) (*Reconciler, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	leases, err := lua.NewLeases(cfg.Redis, cfg.KeyPrefix)
	if err != nil {
		return nil, err
	}
	r := &Reconciler{cfg: cfg, leases: leases}
	r.requeue.changed.At = cfg.Now().Add(-requeueLookback)
	if r.metrics, r.gath, err = newReconcilerMetrics(cfg.Registerer); err != nil {
		return nil, err
	}
	r.enq = newEnqueuers(Config{Client: cfg.Client, Store: cfg.Store, Normalizer: cfg.Normalizer,
		Inspector: cfg.Inspector, Destinations: cfg.Destinations})
	return r, nil
}

// Gatherer returns the private metrics registry, or nil when ReconcilerConfig.Registerer
// was given.
func (r *Reconciler) Gatherer() prometheus.Gatherer { return r.gath }

// Start runs a sweep at once and then every File.Reconciler.Interval ± 10 %. Calling
// Start on a started Reconciler does nothing.
func (r *Reconciler) Start(ctx context.Context) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.running {
		return nil
	}
	ctx, r.cancel = context.WithCancel(ctx)
	r.done = make(chan struct{})
	r.running = true
	go func() {
		defer close(r.done)
		for {
			rep := r.Sweep(ctx)
			if ctx.Err() != nil {
				return
			}
			if r.cfg.TestSignal != nil {
				select {
				case r.cfg.TestSignal <- rep:
				case <-ctx.Done():
					return
				}
			}
			if !sleepCtx(ctx, jitter(r.cfg.File.Reconciler.Interval)) {
				return
			}
		}
	}()
	return nil
}

// Stop ends the loop (a sweep in progress stops at its next statement) and waits for it.
// Calling Stop on a stopped Reconciler does nothing.
func (r *Reconciler) Stop() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.running {
		return
	}
	r.cancel()
	<-r.done
	r.running = false
}

// Sweep runs one sweep synchronously: stranded running jobs (rescued and enqueued again)
// and, at the same time, runnable jobs without a task; then outbox lag and pruning. It
// stops at the first error (reported in SweepReport.Err and counted; the rescue and the
// re-enqueue pass both finish first), keeping the counts of what it did before.
func (r *Reconciler) Sweep(ctx context.Context) SweepReport {
	rep := SweepReport{Actions: map[string]int64{}}
	begun := time.Now()
	// The rescue (which enqueues the jobs it rescues) and the re-enqueue pass run at once,
	// each on its own report.
	requeueRep := SweepReport{Actions: map[string]int64{}}
	var requeueErr error
	requeued := make(chan struct{})
	go func() {
		defer close(requeued)
		requeueErr = r.requeueRunnable(ctx, &requeueRep)
		requeueRep.RequeueTime = time.Since(begun)
	}()
	err := r.rescueRunning(ctx, &rep)
	rep.RescueTime = time.Since(begun)
	<-requeued
	rep.merge(requeueRep)
	rep.RequeueTime = requeueRep.RequeueTime
	if err == nil {
		err = requeueErr
	}
	requeueEnd := time.Since(begun)
	if err == nil && r.cfg.Outbox != nil {
		err = r.outbox(ctx, &rep)
	}
	if err == nil && r.cfg.Inputs != nil {
		err = r.pruneInputs(ctx, &rep)
	}
	if err == nil && r.cfg.Retention != nil {
		err = r.pruneRetention(ctx, &rep)
	}
	rep.OutboxTime = time.Since(begun) - requeueEnd
	if err != nil {
		rep.Err = err
		rep.Actions[ActionSweepErrors]++
		if ctx.Err() == nil {
			r.cfg.Logger.ErrorContext(ctx, "reconciler sweep failed", "err", err)
		}
	}
	for a, n := range rep.Actions {
		r.metrics.actions.WithLabelValues(strings.TrimPrefix(a, "reconciler_")).Add(float64(n))
	}
	r.metrics.sweepSeconds.Observe(time.Since(begun).Seconds())
	if counts := nonZero(rep.Actions); len(counts) > 0 {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.QueryTimeout)
		if cerr := r.cfg.Store.CountersAdd(cctx, counts); cerr != nil {
			r.cfg.Logger.WarnContext(ctx, "reconciler counters not recorded", "err", cerr)
		}
		cancel()
		rep.Statements++
		r.cfg.Logger.InfoContext(ctx, "reconciler sweep", "actions", counts, "statements", rep.Statements,
			"redis_round_trips", rep.RedisTrips, "seconds", time.Since(begun).Seconds())
	}
	return rep
}

// merge adds o's counts to rep.
func (rep *SweepReport) merge(o SweepReport) {
	for a, n := range o.Actions {
		rep.Actions[a] += n
	}
	rep.Statements += o.Statements
	rep.RedisTrips += o.RedisTrips
	rep.RowsRead += o.RowsRead
	rep.RedisCommands += o.RedisCommands
	rep.FullRequeue = rep.FullRequeue || o.FullRequeue
}

func nonZero(m map[string]int64) map[string]int64 {
	out := map[string]int64{}
	for k, v := range m {
		if v != 0 {
			out[k] = v
		}
	}
	return out
}

// minMaxLease is the shortest longest-lease of any kind: the page filter; each job is then
// held to its own kind's lease.
func (r *Reconciler) minMaxLease() time.Duration {
	d := r.cfg.File.MaxLeaseFor("")
	for kind := range r.cfg.File.Kinds {
		d = min(d, r.cfg.File.MaxLeaseFor(kind))
	}
	return d
}

func (r *Reconciler) rescueRunning(ctx context.Context, rep *SweepReport) error {
	now := r.cfg.Now()
	limit := r.cfg.File.Reconciler.BatchSize
	after := ""
	// rescuePagesInFlight pages are rescued at once, so one page's statement overlaps
	// another's Redis round trips. Pages hold disjoint keys and each statement locks its
	// rows in key order: they can not deadlock with each other.
	var (
		mu       sync.Mutex // guards rep and firstErr across the pages
		firstErr error
		wg       sync.WaitGroup
	)
	inflight := make(chan struct{}, rescuePagesInFlight)
	failed := func() error {
		mu.Lock()
		defer mu.Unlock()
		return firstErr
	}
	defer wg.Wait()
	for {
		pctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
		page, err := r.cfg.Store.JobsListRunning(pctx, store.JobsListParams{
			AfterKey: after, Limit: limit, StartedBefore: now.Add(-r.minMaxLease()),
		})
		cancel()
		mu.Lock()
		rep.Statements++
		rep.RowsRead += int64(len(page))
		mu.Unlock()
		if err != nil {
			wg.Wait()
			return err
		}
		var stranded []store.RunningJob
		for _, job := range page {
			if !job.AttemptStartedAt.After(now.Add(-r.cfg.File.MaxLeaseFor(job.Kind))) {
				stranded = append(stranded, job)
			}
		}
		for len(stranded) > 0 {
			n := min(len(stranded), store.MaxRescueBatch)
			jobs := stranded[:n]
			stranded = stranded[n:]
			inflight <- struct{}{}
			if err := failed(); err != nil {
				<-inflight
				wg.Wait()
				return err
			}
			wg.Add(1)
			go func() {
				defer func() { <-inflight; wg.Done() }()
				if err := r.rescuePage(ctx, jobs, rep, &mu); err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					mu.Unlock()
				}
			}()
		}
		if len(page) < limit {
			wg.Wait()
			return failed()
		}
		after = page[len(page)-1].Key
	}
}

// claimed is a stranded job whose lease the reconciler holds.
type claimed struct {
	job   store.RunningJob
	lease lua.Lease
}

// rescuePage moves the stranded running jobs of one page back to retryable: it claims
// their leases in one pipelined round trip (lua.Leases.ClaimMany; a job whose lease a
// worker holds is left alone), rescues every claimed job in one fenced store.JobsRescue
// statement, then releases the leases in one more round trip (ReleaseMany), whatever the
// statement did: they only guarded the transition. A claim error stops the sweep after the
// claimed jobs are rescued and released.
func (r *Reconciler) rescuePage(ctx context.Context, jobs []store.RunningJob, rep *SweepReport, mu *sync.Mutex) error {
	pctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
	defer cancel()
	reqs := make([]lua.ClaimRequest, len(jobs))
	for i, job := range jobs {
		// A nonce per claim: two reconcilers configured with the same ID must not
		// re-claim each other's lease as its owner.
		reqs[i] = lua.ClaimRequest{Key: job.Key, Owner: "reconciler/" + r.cfg.ID + "/" + nonce(),
			TTL: r.cfg.RescueLease, Floor: job.Fence}
	}
	leases, claimErrs := r.leases.ClaimMany(pctx, reqs)
	var (
		held     []claimed
		claimErr error
	)
	mu.Lock()
	rep.RedisTrips++
	for i, err := range claimErrs {
		switch {
		case errors.Is(err, lua.ErrLeaseHeld):
			rep.Actions[ActionLeaseHeld]++
		case err != nil:
			if claimErr == nil {
				claimErr = fmt.Errorf("scheduler: reconciler claim %q: %w", jobs[i].Key, err)
			}
		default:
			held = append(held, claimed{jobs[i], leases[i]})
		}
	}
	mu.Unlock()
	if len(held) == 0 {
		return claimErr
	}
	params := make([]store.JobRescueParams, len(held))
	for i, c := range held {
		params[i] = store.JobRescueParams{Key: c.job.Key, ExpectFence: c.job.Fence, Token: c.lease.Token,
			Error: fmt.Sprintf("lease expired (attempt %d by %s); rescued by %s", c.job.AttemptNo, c.job.Worker, c.lease.Owner)}
	}
	errs, err := r.cfg.Store.JobsRescue(pctx, params)
	mu.Lock()
	rep.Statements++
	mu.Unlock()

	// Released whatever happened, on a context the sweep's cancellation does not end. The
	// token counters stay: the rescued jobs run again.
	rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.QueryTimeout)
	defer rcancel()
	toRelease := make([]lua.Lease, len(held))
	for i, c := range held {
		toRelease[i] = c.lease
	}
	for i, rerr := range r.leases.ReleaseMany(rctx, toRelease) {
		if rerr != nil && !errors.Is(rerr, lua.ErrLeaseLost) && !errors.Is(rerr, lua.ErrNotOwner) {
			r.cfg.Logger.WarnContext(ctx, "reconciler lease release failed", "job", held[i].job.Key, "err", rerr)
		}
	}
	mu.Lock()
	rep.RedisTrips++
	if err != nil {
		mu.Unlock()
		return fmt.Errorf("scheduler: reconciler rescue of %d jobs: %w", len(held), err)
	}
	var firstErr error
	byQueue := map[string][]tasks.Spec{}
	for i, c := range held {
		var te *store.TransitionError
		switch {
		case errs[i] == nil:
			rep.Actions[ActionRescued]++
			r.cfg.Logger.InfoContext(ctx, "stranded job rescued", "job", c.job.Key, "kind", c.job.Kind,
				"attempt", c.job.AttemptNo, "worker", c.job.Worker, "fence", c.job.Fence, "token", c.lease.Token)
			if spec, ok := r.specOf(ctx, c.job.Key, c.job.Spec(), rep); ok {
				q := r.queueOf(c.job.Kind, c.job.Queue)
				byQueue[q] = append(byQueue[q], spec)
			}
		case errors.As(errs[i], &te):
			rep.Actions[ActionRescueRefused]++
		case firstErr == nil:
			firstErr = fmt.Errorf("scheduler: reconciler rescue %q: %w", c.job.Key, errs[i])
		}
	}
	mu.Unlock()
	// The rescued jobs are due now: enqueue them here rather than wait for the re-enqueue
	// pass (which may have passed their keys already; if it meets them too, TaskID = key
	// makes the second enqueue a no-op). A failure leaves them retryable without a task:
	// the next sweep's re-enqueue pass finds them.
	if err := r.enqueueSpecs(ctx, byQueue, rep, mu); err != nil && firstErr == nil {
		firstErr = err
	}
	if claimErr != nil {
		return claimErr
	}
	return firstErr
}

// forEach calls f(0..n-1) with at most limit calls at once and returns when all are done.
func forEach(limit, n int, f func(i int)) {
	sem := make(chan struct{}, limit)
	var wg sync.WaitGroup
	for i := range n {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			f(i)
		}()
	}
	wg.Wait()
}

// queueOf is the queue of a job's tasks: the one recorded with the job (an enqueuer sent
// it to a queue other than its kind's), else its kind's in the configuration. Checking or
// enqueuing in another would give the job a second task.
func (r *Reconciler) queueOf(kind, recorded string) string {
	if recorded != "" {
		return recorded
	}
	return r.cfg.File.QueueFor(kind)
}

// requeuePage checks the asynq task of every job of the page in one pipelined round trip
// and enqueues again those without a live task, one EnqueueMany per queue.
func (r *Reconciler) requeuePage(ctx context.Context, page []store.Job, rep *SweepReport) error {
	pctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
	defer cancel()
	pipe := r.cfg.Redis.Pipeline()
	cmds := make([]*redis.StringCmd, len(page))
	for i, j := range page {
		cmds[i] = pipe.HGet(pctx, AsynqTaskKey(r.queueOf(j.Kind, j.Queue), j.Key), "state")
	}
	rep.RedisTrips++
	rep.RedisCommands += int64(len(page))
	if _, err := pipe.Exec(pctx); err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("scheduler: reconciler read task states: %w", err)
	}
	byQueue := map[string][]tasks.Spec{}
	for i, j := range page {
		state, err := cmds[i].Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			return fmt.Errorf("scheduler: reconciler read task state: %w", err)
		}
		if state != "" && state != asynqArchived {
			continue
		}
		spec, ok := r.specOf(ctx, j.Key, tasks.Spec{Kind: j.Kind, URL: j.URL, SourceID: j.SourceID, Country: j.Country,
			Window: j.Window, ParserVersion: j.ParserVersion, Scope: j.Scope}, rep)
		if !ok {
			continue
		}
		q := r.queueOf(j.Kind, j.Queue)
		byQueue[q] = append(byQueue[q], spec)
	}
	var mu sync.Mutex
	return r.enqueueSpecs(ctx, byQueue, rep, &mu)
}

// specOf returns spec when it still derives key with the enqueuers' normaliser. A spec that
// derives another key (the normaliser's configuration changed since the job was enqueued)
// is not enqueued: that would record a second job under the new key and leave this one
// pending for ever. It is counted (ActionKeyMismatch) and logged for review.
func (r *Reconciler) specOf(ctx context.Context, key string, spec tasks.Spec, rep *SweepReport) (tasks.Spec, bool) {
	derived, err := r.cfg.Normalizer.Key(spec)
	if err == nil && derived == key {
		return spec, true
	}
	rep.Actions[ActionKeyMismatch]++
	r.cfg.Logger.WarnContext(ctx, "job's recorded spec no longer derives its key: not enqueued (normaliser changed?)",
		"job", key, "derived", derived, "err", err)
	return tasks.Spec{}, false
}

// enqueueSpecs enqueues the specs, by queue, with EnqueueMany on chunks of at least
// minRequeueChunk specs, Concurrency chunks at once (EnqueueMany enqueues one task after
// another, so a batch costs about one chunk's round trips), and counts the outcomes in
// rep under mu.
func (r *Reconciler) enqueueSpecs(ctx context.Context, byQueue map[string][]tasks.Spec, rep *SweepReport, mu *sync.Mutex) error {
	queues := slices.Sorted(func(yield func(string) bool) {
		for q := range byQueue {
			if !yield(q) {
				return
			}
		}
	})
	type chunk struct {
		enq   *tasks.Enqueuer
		specs []tasks.Spec
	}
	var chunks []chunk
	for _, q := range queues {
		enq, err := r.enq.get(q)
		if err != nil {
			return err
		}
		specs := byQueue[q]
		size := max(minRequeueChunk, (len(specs)+r.cfg.Concurrency-1)/r.cfg.Concurrency)
		for len(specs) > 0 {
			n := min(size, len(specs))
			chunks = append(chunks, chunk{enq, specs[:n]})
			specs = specs[n:]
		}
	}
	var firstErr error // guarded by mu
	forEach(r.cfg.Concurrency, len(chunks), func(i int) {
		c := chunks[i]
		cctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
		defer cancel()
		res, err := c.enq.EnqueueMany(cctx, c.specs)
		mu.Lock()
		defer mu.Unlock()
		rep.Statements++
		rep.RedisTrips += int64(len(c.specs))
		rep.RedisCommands += int64(len(c.specs))
		if err != nil {
			if firstErr == nil {
				firstErr = fmt.Errorf("scheduler: reconciler re-enqueue: %w", err)
			}
			return
		}
		for _, x := range res {
			switch x.Outcome {
			case tasks.Created, tasks.Requeued:
				rep.Actions[ActionRequeued]++
			case tasks.Repaired:
				rep.Actions[ActionArchivedRepair]++
			default:
				rep.Actions[ActionAlreadyQueued]++
			}
		}
	})
	mu.Lock()
	defer mu.Unlock()
	return firstErr
}

func (r *Reconciler) outbox(ctx context.Context, rep *SweepReport) error {
	rc := r.cfg.File.Reconciler
	qctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
	unsent, oldest, err := r.cfg.Outbox.Lag(qctx, rc.OutboxLagThreshold)
	cancel()
	rep.Statements++
	if err != nil {
		return fmt.Errorf("scheduler: reconciler outbox lag: %w", err)
	}
	rep.OutboxUnsent = unsent
	r.metrics.outboxUnsent.Set(float64(unsent))
	if unsent > 0 {
		age := r.cfg.Now().Sub(oldest)
		r.metrics.outboxOldest.Set(age.Seconds())
		rep.Actions[ActionOutboxLagging]++
		r.cfg.Logger.WarnContext(ctx, "outbox lagging: rows unsent past the threshold (is a dispatcher running?)",
			"unsent", unsent, "oldest_age", age.Round(time.Second), "threshold", rc.OutboxLagThreshold)
	} else {
		r.metrics.outboxOldest.Set(0)
	}
	for _, p := range []struct {
		action string
		prune  func(context.Context, time.Duration, int) (int64, error)
		age    time.Duration
	}{
		{ActionOutboxPruned, r.cfg.Outbox.PruneSent, rc.OutboxRetention},
		{ActionInboxPruned, r.cfg.Outbox.PruneInbox, rc.InboxRetention},
	} {
		if err := r.pruneBatches(ctx, rep, p.action, p.prune, p.age); err != nil {
			return err
		}
	}
	return nil
}

// pruneInputs deletes saved inputs and unreferenced bodies older than the retention, in
// batches of PruneBatch, at most DefaultMaxPruneBatches calls per sweep (the next sweep goes
// on).
func (r *Reconciler) pruneInputs(ctx context.Context, rep *SweepReport) error {
	rc := r.cfg.File.Reconciler
	for range DefaultMaxPruneBatches {
		qctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
		res, err := r.cfg.Inputs.Prune(qctx, inputs.PruneParams{Retention: rc.SavedInputRetention, Limit: rc.PruneBatch})
		cancel()
		rep.Statements += 2
		rep.Actions[ActionSavedInputsPruned] += res.Inputs
		rep.Actions[ActionInputBlobsPruned] += res.Blobs
		if err != nil {
			return fmt.Errorf("scheduler: reconciler prune saved inputs: %w", err)
		}
		if res.Done(rc.PruneBatch) {
			return nil
		}
	}
	return nil
}

// nonce returns 8 random hex digits.
func nonce() string {
	var b [4]byte
	_, _ = crand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// jitter returns d ± 10 %.
func jitter(d time.Duration) time.Duration {
	return time.Duration(float64(d) * (0.9 + 0.2*rand.Float64()))
}

// sleepCtx sleeps for d; false when ctx ended first.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

type reconcilerMetrics struct {
	actions      *prometheus.CounterVec
	sweepSeconds prometheus.Histogram
	outboxUnsent prometheus.Gauge
	outboxOldest prometheus.Gauge
}

func newReconcilerMetrics(reg prometheus.Registerer) (*reconcilerMetrics, prometheus.Gatherer, error) {
	var gath prometheus.Gatherer
	if reg == nil {
		r := prometheus.NewRegistry()
		reg, gath = r, r
	}
	m := &reconcilerMetrics{
		actions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_reconciler_actions_total", Help: "Reconciler actions (rescued, rescue_refused, lease_held, requeued, archived_repaired, already_queued, outbox_pruned, inbox_pruned, saved_inputs_pruned, input_blobs_pruned, outbox_lag_reports, sweep_errors, key_mismatch).",
		}, []string{"action"}),
		sweepSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "idemscrape_reconciler_sweep_seconds", Help: "Duration of one reconciler sweep.",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 10),
		}),
		outboxUnsent: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "idemscrape_reconciler_outbox_unsent", Help: "Unsent outbox rows older than the lag threshold, at the last sweep.",
		}),
		outboxOldest: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "idemscrape_reconciler_outbox_oldest_unsent_seconds", Help: "Age of the oldest unsent outbox row past the threshold (0: none).",
		}),
	}
	var err error
	m.actions = register(reg, m.actions, &err)
	m.sweepSeconds = register(reg, m.sweepSeconds, &err)
	m.outboxUnsent = register(reg, m.outboxUnsent, &err)
	m.outboxOldest = register(reg, m.outboxOldest, &err)
	return m, gath, err
}
