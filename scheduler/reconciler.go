package scheduler

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/internal/retry"
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
	// The record of the queues' tasks-checked markers (reconciler_requeue.go).
	RequeueMarkers(ctx context.Context, prefix string) (map[string]store.RequeueMarker, error)
	RequeueMarkersAdvance(ctx context.Context, prefix string, seen map[string]store.RequeueMarker) error
	RequeueMarkerReplace(ctx context.Context, prefix, queue, old, next string) (bool, error)
	JobsRescue(ctx context.Context, ps []store.JobRescueParams) ([]error, error)
	CountersAdd(ctx context.Context, deltas map[string]int64) error
}

var _ ReconcileStore = (*store.PG)(nil)

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
	// dueSlack widens the re-enqueue pass's due bound (DueBefore) past this process's
	// clock, so a job whose next_attempt_at is the database's now() (rescued or failed
	// moments ago) counts as due despite clock skew between the two.
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
	// ActionAlreadyQueued: the enqueue found the job's task there after all (a live
	// enqueue raced; an archived task when there is no Inspector), or found the job
	// terminal by then: nothing to do.
	ActionAlreadyQueued = "reconciler_already_queued"
	ActionOutboxPruned  = "reconciler_outbox_pruned" // sent outbox rows deleted
	ActionInboxPruned   = "reconciler_inbox_pruned"  // inbox rows deleted
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
	// Outbox reports lag and prunes (Maintainer). Optional: without it that part is skipped.
	Outbox OutboxMaintainer
	// Inputs prunes saved inputs (store/inputs) after File.Reconciler.SavedInputRetention.
	// Defaults to inputs.New on the Store's pool when Store is a *store.PG; otherwise that
	// part is skipped.
	Inputs InputsPruner
	// Retention deletes terminal jobs, quarantine and windows past their retention
	// (File.Reconciler.JobRetention, QuarantineRetention; see reconciler_retention.go).
	// Defaults to the Store when it is a *store.PG; otherwise that part is skipped.
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
	// TestOrphanSignal, when set, receives the report of every orphan pass of the loop
	// (tests only).
	TestOrphanSignal chan<- SweepReport
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
	// FullRequeue: the Redis of one queue or more had lost or rolled back its data (the
	// queue's tasks-checked marker was absent, of another epoch or behind PostgreSQL's
	// record), so the re-enqueue pass checked every runnable job of those queues.
	FullRequeue bool
	// Time spent in each part of the sweep, from its start. The rescue and the re-enqueue
	// pass run at once: RescueTime and RequeueTime overlap; OutboxTime is what follows (outbox
	// lag and pruning, saved-input pruning, retention).
	RescueTime, RequeueTime, OutboxTime time.Duration
	Err                                 error
}

// Reconciler repairs what a lost Redis or a dead worker leaves behind, from PostgreSQL,
// in keyset-paged sweeps; any number of reconcilers may sweep at once:
//
//   - (reconciler_rescue.go) a running job whose attempt is older than its kind's longest
//     lease: the reconciler claims the job's lease itself (floor = the job's fence). If a
//     worker holds it, the job is left alone — a live worker is never robbed. Otherwise it
//     holds a token above the fence and moves the job to retryable with store.JobsRescue
//     (one statement per page), fenced per job on the fence it listed and raising it to its
//     token, so a stale worker's commit is refused and a second reconciler's rescue is
//     refused; then it releases the lease and enqueues the rescued jobs;
//   - (reconciler_requeue.go) a due pending or retryable job whose asynq task is missing or
//     archived: its task is enqueued again, in the queue recorded with the job (TaskID = key
//     deduplicates a race with a live enqueue; the Inspector deletes an archived task first);
//   - (reconciler_orphans.go, in a loop of its own, RequeueOrphans) an active asynq task
//     that no live asynq server lists, whose job's lease is free: it is given back to
//     pending with asynq's own requeue, long before asynq's recoverer would;
//   - (reconciler_outbox.go) unsent outbox rows older than the threshold are reported
//     (metric, log); sent outbox rows and inbox rows older than their retention are
//     deleted in bounded batches;
//   - (reconciler_retention.go) saved inputs (with the bodies nothing references any
//     more), terminal jobs with all their rows, quarantine and schedule windows past their
//     retention are deleted in bounded batches.
//
// This file holds the configuration and the sweep that runs them; reconciler_metrics.go
// its Prometheus metrics.
//
// Every action is counted in Prometheus metrics and in store.CountersAdd.
type Reconciler struct {
	cfg     ReconcilerConfig
	leases  *lua.Leases
	enq     *enqueuers
	metrics *reconcilerMetrics
	gath    prometheus.Gatherer

	requeue requeueCursor // guarded by requeueMu: where the re-enqueue pass goes on
	// seenQueues (guarded by requeueMu) are the queues of the jobs the re-enqueue pass read:
	// their tasks-checked markers are read too (RequeueMarkerKey).
	seenQueues map[string]bool
	// requeueMu serialises the re-enqueue passes of concurrent Sweep calls.
	requeueMu sync.Mutex
	// recordedQueues (guarded by queuesMu) are the queues recorded with the jobs the
	// re-enqueue pass read: the orphan pass looks at them too (reconciler_orphans.go).
	recordedQueues map[string]bool
	queuesMu       sync.Mutex

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
	r := &Reconciler{cfg: cfg, leases: leases, seenQueues: map[string]bool{}, recordedQueues: map[string]bool{}}
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

// Start runs a sweep at once and then another File.Reconciler.Interval ± 10 % after each
// one ends; and, in a loop of its own, an orphan pass (RequeueOrphans) every
// File.Reconciler.OrphanInterval. Calling Start on a started Reconciler does nothing.
func (r *Reconciler) Start(ctx context.Context) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.running {
		return nil
	}
	ctx, r.cancel = context.WithCancel(ctx)
	r.done = make(chan struct{})
	r.running = true
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { wg.Wait(); close(r.done) }()
	go func() {
		defer wg.Done()
		r.orphanLoop(ctx)
	}()
	go func() {
		defer wg.Done()
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
			if !retry.Sleep(ctx, retry.Jitter(r.cfg.File.Reconciler.Interval, 0.1)) {
				return
			}
		}
	}()
	return nil
}

// orphanLoop runs an orphan pass at once and then another File.Reconciler.OrphanInterval
// ± 10 % after each one ends, until ctx ends.
func (r *Reconciler) orphanLoop(ctx context.Context) {
	for {
		rep := r.RequeueOrphans(ctx)
		if ctx.Err() != nil {
			return
		}
		if r.cfg.TestOrphanSignal != nil {
			select {
			case r.cfg.TestOrphanSignal <- rep:
			case <-ctx.Done():
				return
			}
		}
		if !retry.Sleep(ctx, retry.Jitter(r.cfg.File.Reconciler.OrphanInterval, 0.1)) {
			return
		}
	}
}

// Stop ends the loops (a sweep in progress stops at its next statement) and waits for them.
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
// and, at the same time, runnable jobs without a task; then outbox lag and pruning,
// saved-input pruning and retention. It stops at the first error (reported in
// SweepReport.Err and counted; the rescue and the re-enqueue pass both finish first),
// keeping the counts of what it did before.
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
	r.metrics.sweepSeconds.Observe(time.Since(begun).Seconds())
	r.account(ctx, &rep, "reconciler sweep", begun)
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
