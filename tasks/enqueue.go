package tasks

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/trace"
)

// Outcome tells what Enqueue did for one spec.
type Outcome int

// The outcomes of Enqueue.
const (
	// Created: a new jobs row and a new asynq task.
	Created Outcome = iota + 1
	// AlreadyQueued: the job existed and asynq already holds a live task with its id
	// (pending, scheduled, active, retry, aggregating). Nothing was written. Without
	// EnqueuerConfig.Inspector an archived task is also reported so (it can not be told
	// apart), although it will never run.
	AlreadyQueued
	// Requeued: the job existed in a runnable state (pending, retryable, running) and this
	// call enqueued its task, because asynq held none: an earlier Enqueue failed between the
	// row and the task, Redis lost its data, or a concurrent Enqueue of the same spec has
	// inserted the row but not yet its task. The lease and the fenced commit make any extra
	// delivery harmless.
	Requeued
	// AlreadyComplete: the job is complete; nothing was enqueued.
	AlreadyComplete
	// AlreadyFailed: the job failed terminally; nothing was enqueued. It needs review or a
	// new job (a new parser version or window gives a new key).
	AlreadyFailed
	// Repaired: the job is runnable (pending or retryable) but asynq held its task id in
	// the archive, where the task would never run and the id would stay taken for up to 90
	// days; Enqueue deleted the archived task and enqueued the job's task again. Needs
	// EnqueuerConfig.Inspector.
	Repaired
)

func (o Outcome) String() string {
	switch o {
	case Created:
		return "created"
	case AlreadyQueued:
		return "already_queued"
	case Requeued:
		return "requeued"
	case AlreadyComplete:
		return "already_complete"
	case AlreadyFailed:
		return "already_failed"
	case Repaired:
		return "repaired: archived task deleted and enqueued again"
	}
	return fmt.Sprintf("Outcome(%d)", int(o))
}

// Result is what Enqueue reports for one spec.
type Result struct {
	Key     string
	Outcome Outcome
	State   JobState // the jobs row's state as recorded
}

// QueueFor is the asynq queue of a job kind when nothing else is configured: the kind's
// name. asynq checks task ids per queue, so a kind must always use one queue; the enqueuer,
// the worker (cmd/worker serves one queue per registered kind), the scheduler and the CLI
// all default to this function, so a job lands where a worker listens.
func QueueFor(kind string) string { return kind }

// Enqueuer defaults.
const (
	// DefaultQueue is asynq's default queue. Enqueuers no longer default to it (see
	// QueueFor); it is kept for callers that name it.
	DefaultQueue = "default"
	// DefaultMaxRetry is asynq's cap on a task's counted retries: a backstop, not the
	// policy. The runner's policy (attempt cap, time and bandwidth budgets) ends a job and
	// tells asynq with SkipRetry, and deliveries that are not failures (a busy lease, an
	// open incident) do not count. A small asynq MaxRetry would archive tasks behind the
	// runner's back, and an archived task blocks its key; the runner fails the job itself
	// (budget_exceeded) on the delivery that reaches this cap, so the two agree.
	DefaultMaxRetry = 1000
	DefaultTimeout  = 30 * time.Minute
)

// EnqueuerConfig configures an Enqueuer.
type EnqueuerConfig struct {
	// Queue is the asynq queue of the jobs this enqueuer creates; it is recorded with the
	// job (jobs.queue), and every later enqueue of the job, by any enqueuer, uses the
	// recorded queue (asynq checks task ids per queue: a second queue would hold a second
	// task). Defaults to "": its kind's queue, QueueFor(kind). A name must match
	// [A-Za-z0-9._-]{1,128} (CheckQueue); NewEnqueuer refuses another.
	Queue string
	// Normalizer derives keys (URL canonicalisation, tracking parameters). Every process
	// that enqueues the same kinds must use the same one. Defaults to DefaultNormalizer.
	Normalizer *Normalizer
	// MaxRetry is asynq's retry cap per task. Defaults to DefaultMaxRetry (1000: a
	// backstop; the runner's attempt, time and bandwidth budgets decide long before).
	// Deliveries that could not start because Redis or PostgreSQL did not answer count
	// too, one every 30–60 s once the outage is long: 1,000 last 8 to 17 hours of it, 25
	// 10 to 20 minutes (then the task is archived until the reconciler repairs it).
	MaxRetry int
	// Timeout is asynq's per-delivery timeout. Defaults to DefaultTimeout.
	Timeout time.Duration
	// Inspector lets Enqueue look at the task that holds a job's id when asynq reports a
	// task-id conflict, so that an archived task (which never runs and keeps the id taken
	// for up to 90 days) is deleted and the job enqueued again (Outcome Repaired). Every
	// binary idemscrape ships sets it. Defaults to nil: an archived task can then not be
	// detected and is reported as AlreadyQueued.
	Inspector *asynq.Inspector
	// TracerProvider receives a span per task enqueued ("idemscrape.enqueue"), whose
	// context the task carries (Payload.TraceParent) so that every attempt of the job
	// continues its trace. Defaults to OpenTelemetry's global provider: a no-op, and no
	// trace context written, unless the program installed one.
	TracerProvider trace.TracerProvider
	// Redis is the server (or cluster) asynq's client writes to. Optional: with it,
	// EnqueueMany reads the asynq task of every job that already existed and is runnable in
	// one pipelined round trip, and enqueues only those asynq holds no live task for — a
	// duplicate enqueue then costs the jobs statement and that one read instead of a
	// task enqueue (a round trip and a script) per job. Without it every such job goes
	// through asynq, which answers ErrTaskIDConflict. It must be the server the Client
	// writes to; a wrong one only costs the fast path (a task it can not see is enqueued
	// through asynq, which deduplicates by id).
	Redis redis.UniversalClient
	// PayloadVersion is the task payload format written (PayloadV1 or PayloadV2). Defaults
	// to DefaultPayloadVersion; set PayloadV1 while workers that can not read V2 still run.
	PayloadVersion int
	// Destinations is the policy a spec's URL must pass before anything is stored (ports,
	// literal loopback/private/metadata addresses, localhost). Use the same value for the
	// fetch guard (sessions.NewGuard). Defaults to the strict policy (the zero
	// DestinationPolicy); tests and the demo pass LoopbackPolicy().
	Destinations *DestinationPolicy
	// Concurrency is how many task enqueues one EnqueueMany call keeps in flight (each is
	// one asynq Client.EnqueueContext, a round trip and a script). Defaults to 1: one after
	// the other. asynq's Client has no pipeline, so a batch is sped up by running its
	// enqueues side by side on the client's connection pool (asynq's default pool holds
	// 10 connections per CPU): `idemscrape enqueue -f` uses 16. The jobs rows are still
	// recorded first, in one statement; keys given twice in one call are enqueued once.
	Concurrency int
}

// Validate checks the config and fills in defaults.
func (c *EnqueuerConfig) Validate() error {
	if c.Normalizer == nil {
		c.Normalizer = DefaultNormalizer
	}
	if c.PayloadVersion == 0 {
		c.PayloadVersion = DefaultPayloadVersion
	}
	if c.PayloadVersion != PayloadV1 && c.PayloadVersion != PayloadV2 {
		return fmt.Errorf("tasks: EnqueuerConfig.PayloadVersion %d must be %d or %d", c.PayloadVersion, PayloadV1, PayloadV2)
	}
	if c.MaxRetry == 0 {
		c.MaxRetry = DefaultMaxRetry
	}
	if c.MaxRetry < 0 {
		return fmt.Errorf("tasks: EnqueuerConfig.MaxRetry %d is negative", c.MaxRetry)
	}
	if c.Timeout == 0 {
		c.Timeout = DefaultTimeout
	}
	if c.Timeout < 0 {
		return fmt.Errorf("tasks: EnqueuerConfig.Timeout %v is negative", c.Timeout)
	}
	if c.Concurrency == 0 {
		c.Concurrency = 1
	}
	if c.Concurrency < 0 {
		return fmt.Errorf("tasks: EnqueuerConfig.Concurrency %d is negative", c.Concurrency)
	}
	if c.Queue != "" {
		if err := CheckQueue(c.Queue); err != nil {
			return fmt.Errorf("tasks: EnqueuerConfig.Queue: %w", err)
		}
	}
	if c.Destinations == nil {
		c.Destinations = StrictDestinationPolicy()
	}
	if err := c.Destinations.Validate(); err != nil {
		return fmt.Errorf("tasks: EnqueuerConfig.Destinations: %w", err)
	}
	return nil
}

// Enqueuer records jobs in the system of record and hands them to asynq, deduplicated by
// job key at both layers.
//
// The jobs row is inserted first (ON CONFLICT DO NOTHING on the key), then the asynq task
// with TaskID = key and Retention(0). asynq semantics this relies on (asynq v0.26):
//   - a task id is taken while asynq holds the task in any state of its queue: pending,
//     scheduled, active, retry, aggregating, archived, and completed while a Retention holds
//     it. A second enqueue gets asynq.ErrTaskIDConflict, which Enqueue reports as
//     AlreadyQueued — a dedup hit, not an error — unless the task is archived (see below).
//   - with Retention(0) the id is freed the moment the handler succeeds (the task is
//     deleted). By then the runner has committed the job as complete in Postgres, so a later
//     Enqueue sees AlreadyComplete and enqueues nothing.
//   - an archived task (SkipRetry, or MaxRetry exhausted) blocks its id until it is deleted
//     from the archive (asynq trims archives after 90 days or 10,000 tasks per queue). A
//     failed job is never enqueued again, whatever asynq holds. For a runnable job
//     (pending, retryable, running) a conflict is inspected (EnqueuerConfig.Inspector): an
//     archived task is deleted and the task enqueued again (Repaired); a task that vanished
//     between the conflict and the inspection is enqueued again (Requeued); a live task is
//     AlreadyQueued. asynq has no conditional delete: when two Enqueues repair the same
//     job at once, one may delete the task the other has just enqueued, and then enqueues
//     it again itself, so one task remains either way.
//   - ids are per queue: the same key enqueued to two queues is two tasks. Keep one queue
//     per kind.
//
// If the task enqueue fails after the row was inserted (Redis down), Enqueue returns the
// error and the row stays pending; enqueueing the same spec again (or the reconciler)
// enqueues the task then, reported as Requeued. Nothing is lost and nothing runs twice to
// effect.
type Enqueuer struct {
	tracer trace.Tracer
	client *asynq.Client
	rec    JobRecorder
	cfg    EnqueuerConfig
	insp   taskInspector // nil without EnqueuerConfig.Inspector
}

// taskInspector is the part of *asynq.Inspector the Enqueuer uses (tests wrap it to
// inject races).
type taskInspector interface {
	GetTaskInfo(queue, id string) (*asynq.TaskInfo, error)
	DeleteTask(queue, id string) error
}

// NewEnqueuer returns an Enqueuer writing rows through rec and tasks through client.
func NewEnqueuer(client *asynq.Client, rec JobRecorder, cfg *EnqueuerConfig) (*Enqueuer, error) {
	if client == nil || rec == nil {
		return nil, errors.New("tasks: NewEnqueuer: client and recorder are required")
	}
	var c EnqueuerConfig
	if cfg != nil {
		c = *cfg
	}
	if err := c.Validate(); err != nil {
		return nil, err
	}
	e := &Enqueuer{client: client, rec: rec, cfg: c, tracer: tracerOf(c.TracerProvider)}
	if c.Inspector != nil {
		e.insp = c.Inspector
	}
	return e, nil
}

// Enqueue records one job and enqueues its task unless it is already queued, complete or
// failed. An invalid spec, or a URL the destination policy refuses, returns an error
// naming the field (errors.Is ErrInvalidSpec) and stores nothing.
func (e *Enqueuer) Enqueue(ctx context.Context, spec Spec) (Result, error) {
	res, err := e.EnqueueMany(ctx, []Spec{spec})
	if err != nil {
		return Result{}, err
	}
	return res[0], nil
}

// EnqueueMany is Enqueue for a batch: every spec is validated before anything is stored
// (one invalid spec stores nothing and the error names its index and field), the rows are
// recorded in one statement, and a task is enqueued for each job that needs one
// (EnqueuerConfig.Concurrency at a time). Results are in the order of specs; a key given
// twice is enqueued once and the second occurrence reports AlreadyQueued.
//
// An error after validation is a *BatchError: it tells whether the rows were recorded and,
// per spec, whether its task is known to be in place (the enqueues stop at the first
// failure; those in flight finish). Enqueueing the same specs again is always safe: what
// is in place is recognised (AlreadyQueued, AlreadyComplete, AlreadyFailed), a recorded
// job without its task is enqueued (Requeued).
func (e *Enqueuer) EnqueueMany(ctx context.Context, specs []Spec) ([]Result, error) {
	records, err := e.validateSpecs(specs)
	if err != nil {
		return nil, err
	}
	results := make([]Result, len(records))
	for i, rec := range records {
		results[i].Key = rec.Key
	}
	recorded, err := e.recordJobs(ctx, records, results)
	if err != nil {
		return nil, err
	}
	live, err := e.liveTasks(ctx, records, recorded)
	if err != nil {
		return nil, &BatchError{Recorded: true, Results: results, Err: err}
	}
	first, todo := planEnqueues(records, recorded, live, results)
	enqueued, errs := e.enqueueTasks(ctx, records, recorded, todo)
	firstErr := enqueueOutcomes(records, recorded, todo, enqueued, errs, results)
	markDuplicates(records, first, results)
	if firstErr != nil {
		return nil, &BatchError{Recorded: true, Results: results, Err: firstErr}
	}
	return results, nil
}

// validateSpecs is EnqueueMany's first step: it normalizes every spec, computes its key and
// checks its URL against the destination policy; the error names the first bad spec.
func (e *Enqueuer) validateSpecs(specs []Spec) ([]JobRecord, error) {
	records := make([]JobRecord, len(specs))
	for i, s := range specs {
		norm, err := e.cfg.Normalizer.Normalize(s)
		if err != nil {
			return nil, fmt.Errorf("spec %d of %d: %w", i, len(specs), err)
		}
		key, err := e.cfg.Normalizer.Key(norm)
		if err != nil {
			return nil, fmt.Errorf("spec %d of %d: %w", i, len(specs), err)
		}
		if norm.URL != "" {
			if err := e.cfg.Destinations.CheckURL(norm.URL); err != nil {
				return nil, fmt.Errorf("spec %d of %d: %w", i, len(specs), err)
			}
		}
		records[i] = JobRecord{Key: key, Spec: norm, Queue: e.queueOf(norm.Kind)}
	}
	return records, nil
}

// recordJobs is the step that records the jobs rows in one statement; it points records at
// the queues the rows name and sets results' states, and the outcomes the rows settle.
// Its error is a *BatchError.
func (e *Enqueuer) recordJobs(ctx context.Context, records []JobRecord, results []Result) ([]JobRecordResult, error) {
	recorded, err := e.rec.JobsRecord(ctx, records)
	if err != nil {
		return nil, &BatchError{Results: results, Err: err}
	}
	if len(recorded) != len(records) {
		return nil, &BatchError{Results: results,
			Err: fmt.Errorf("tasks: recorder returned %d results for %d records", len(recorded), len(records))}
	}

	// A job's tasks go to the queue recorded when it was created, whatever this enqueuer's
	// is: asynq checks ids per queue, and a second queue would hold a second task.
	for i := range records {
		if q := recorded[i].Queue; q != "" {
			records[i].Queue = q
		}
		results[i].State = recorded[i].State
		// Settled by their rows alone: reported as in place even if the queue check fails.
		switch recorded[i].State {
		case StateComplete:
			results[i].Outcome = AlreadyComplete
		case StateFailed:
			results[i].Outcome = AlreadyFailed
		}
	}
	return recorded, nil
}

// planEnqueues is the step that decides which records get a task enqueued (todo, in
// order): not complete or failed, the first occurrence of their key, and not already
// live in asynq (live, the fast path read; such a record is AlreadyQueued). first is the
// index that enqueues each key.
func planEnqueues(records []JobRecord, recorded []JobRecordResult, live []bool, results []Result) (first map[string]int, todo []int) {
	first = make(map[string]int, len(records))
	for i, rec := range records {
		r := recorded[i]
		switch {
		case r.State == StateComplete:
			results[i].Outcome = AlreadyComplete
			continue
		case r.State == StateFailed:
			results[i].Outcome = AlreadyFailed
			continue
		}
		if _, dup := first[rec.Key]; dup {
			continue // AlreadyQueued once the first occurrence's task is in place
		}
		first[rec.Key] = i
		if live != nil && live[i] {
			// The job existed and asynq holds a live task with its id: what asynq would
			// answer with ErrTaskIDConflict, without asking it.
			results[i].Outcome = AlreadyQueued
			continue
		}
		todo = append(todo, i)
	}
	return first, todo
}

// enqueueOutcomes is the step that sets the outcomes of the records enqueueTasks tried
// (todo) and returns the error of the first one that failed.
func enqueueOutcomes(records []JobRecord, recorded []JobRecordResult, todo []int, enqueued []taskDone, errs []error, results []Result) error {
	var firstErr error
	for _, i := range todo { // in the order of specs: the error reported is the first spec's
		if errs[i] != nil {
			if firstErr == nil {
				firstErr = fmt.Errorf("tasks: enqueue %q: %w", records[i].Key, errs[i])
			}
			continue
		}
		switch {
		case !enqueued[i].done:
			// Not attempted: an earlier enqueue failed.
		case enqueued[i].res == taskRepaired:
			results[i].Outcome = Repaired
		case recorded[i].Created:
			// Ours even if a concurrent duplicate enqueued the task a moment before us.
			results[i].Outcome = Created
		case enqueued[i].res == taskEnqueued:
			results[i].Outcome = Requeued
		default:
			results[i].Outcome = AlreadyQueued
		}
	}
	return firstErr
}

// markDuplicates is the step that reports a key given twice as AlreadyQueued once its first
// occurrence's task is in place.
func markDuplicates(records []JobRecord, first map[string]int, results []Result) {
	for i, rec := range records {
		if j, ok := first[rec.Key]; ok && j != i && results[i].Outcome == 0 && results[j].Outcome != 0 {
			results[i].Outcome = AlreadyQueued // its key's task is in place
		}
	}
}

// BatchError is the error of an EnqueueMany that failed after its specs were validated
// (PostgreSQL or Redis went away, the context ended): what is in place and what is not.
// Its message and errors.Is/As are those of the failure it wraps.
type BatchError struct {
	// Recorded: the jobs rows of all the specs were recorded (the one statement
	// succeeded). When false none is known to be: the statement failed, or its answer was
	// lost (it may have committed).
	Recorded bool
	// Results has one entry per spec, in order, Key always set. Outcome is non-zero for a
	// spec whose job is in place: its task enqueued or already queued, or the job complete
	// or failed; State is the row's state when Recorded. Outcome 0: the task is not known
	// to be enqueued (the failing enqueue, those not attempted after it, and a spec whose
	// row was not recorded); enqueueing the spec again enqueues it or finds it in place.
	Results []Result
	// Err is the failure.
	Err error
}

func (e *BatchError) Error() string { return e.Err.Error() }

func (e *BatchError) Unwrap() error { return e.Err }

// taskDone is what enqueueTasks did for one record.
type taskDone struct {
	done bool // enqueueTask returned without error
	res  taskResult
}

// enqueueTasks runs enqueueTask for the records at the indexes todo, EnqueuerConfig.
// Concurrency at a time, and returns per record index what was done and each error. After
// the first error no further enqueue starts; those in flight finish.
//
// asynq's Client has no pipeline API: a batch's enqueues could only share round trips by
// running asynq's enqueue script ourselves, against its internal key layout and message
// encoding (internal/rdb, internal/base), which change between asynq versions. Running
// asynq's own EnqueueContext side by side on the client's connection pool keeps every
// check asynq makes (task id conflicts, the queue registered in asynq:queues), and cuts
// the wall time of a batch to about Concurrency-fold less than one after the other.
func (e *Enqueuer) enqueueTasks(ctx context.Context, records []JobRecord, recorded []JobRecordResult, todo []int) ([]taskDone, []error) {
	done := make([]taskDone, len(records))
	errs := make([]error, len(records))
	one := func(i int) bool {
		res, err := e.enqueueTask(ctx, records[i], recorded[i].NextAttemptAt, len(records) > 1)
		if err != nil {
			errs[i] = err
			return false
		}
		done[i] = taskDone{done: true, res: res}
		return true
	}
	workers := min(e.cfg.Concurrency, len(todo))
	if workers <= 1 {
		for _, i := range todo {
			if !one(i) {
				break
			}
		}
		return done, errs
	}
	var next atomic.Int64
	var failed atomic.Bool
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for !failed.Load() {
				j := int(next.Add(1)) - 1
				if j >= len(todo) {
					return
				}
				if !one(todo[j]) {
					failed.Store(true)
				}
			}
		})
	}
	wg.Wait()
	return done, errs
}

// AsynqTaskKey is asynq's key of the task with id in queue (asynq v0.26
// internal/base.TaskKey: "asynq:{<queue>}:t:<id>"): a HASH whose field "state" is pending,
// active, scheduled, retry, archived, completed or aggregating.
func AsynqTaskKey(queue, id string) string { return "asynq:{" + queue + "}:t:" + id }

// asynqArchived is the state asynq records for an archived task.
const asynqArchived = "archived"

// liveTasks reports, per record, whether the job already existed (not created by this
// call), is runnable, and asynq holds a task with its id in a state other than archived
// (such a task runs, or has run and is kept: a second enqueue would be refused with
// ErrTaskIDConflict). It reads those tasks' states in one pipelined round trip; without
// EnqueuerConfig.Redis, or when no record qualifies, it reads nothing and returns nil.
// A task that is missing or archived is left to enqueueTask (Requeued, Repaired).
func (e *Enqueuer) liveTasks(ctx context.Context, records []JobRecord, recorded []JobRecordResult) ([]bool, error) {
	if e.cfg.Redis == nil {
		return nil, nil
	}
	var idx []int
	for i, r := range recorded {
		if !r.Created && r.State != StateComplete && r.State != StateFailed {
			idx = append(idx, i)
		}
	}
	if len(idx) == 0 {
		return nil, nil
	}
	pipe := e.cfg.Redis.Pipeline()
	cmds := make([]*redis.StringCmd, len(idx))
	for j, i := range idx {
		cmds[j] = pipe.HGet(ctx, AsynqTaskKey(records[i].Queue, records[i].Key), "state")
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("tasks: read asynq task states: %w", err)
	}
	live := make([]bool, len(records))
	for j, i := range idx {
		state, err := cmds[j].Result()
		switch {
		case errors.Is(err, redis.Nil):
		case err != nil:
			return nil, fmt.Errorf("tasks: read asynq task state of %q: %w", records[i].Key, err)
		default:
			live[i] = state != "" && state != asynqArchived
		}
	}
	return live, nil
}

// taskResult is what enqueueTask did.
type taskResult int

const (
	taskQueued   taskResult = iota // asynq already holds a live task with the id
	taskEnqueued                   // a new task was enqueued
	taskRepaired                   // an archived task was deleted and a new one enqueued
)

// maxConflictRounds bounds how often enqueueTask inspects and retries one conflict: each
// extra round needs a concurrent actor to change the task under us, so running out of
// rounds means something keeps interfering.
const maxConflictRounds = 4

// queueOf is the queue of kind's tasks: the configured one, or QueueFor(kind).
func (e *Enqueuer) queueOf(kind string) string {
	if e.cfg.Queue != "" {
		return e.cfg.Queue
	}
	return QueueFor(kind)
}

// enqueueTask enqueues the asynq task for rec. A retryable job whose next attempt is in
// the future (a destination's Retry-After, a backoff) is scheduled for then, not run at
// once. On a task-id conflict it inspects the task (when it has an Inspector): archived
// ⇒ deleted and enqueued again; gone ⇒ enqueued again; live ⇒ taskQueued.
func (e *Enqueuer) enqueueTask(ctx context.Context, rec JobRecord, notBefore *time.Time, batch bool) (res taskResult, err error) {
	ctx, span := e.startEnqueueSpan(ctx, rec, batch)
	defer func() { endEnqueueSpan(span, res, err) }()
	payload, err := EncodePayload(Payload{Key: rec.Key, Spec: rec.Spec, TraceParent: TraceParent(ctx)}, e.cfg.PayloadVersion)
	if err != nil {
		return taskQueued, err
	}
	task := asynq.NewTask(rec.Spec.Kind, payload)
	opts := []asynq.Option{
		asynq.TaskID(rec.Key),
		asynq.Retention(0),
		asynq.Queue(rec.Queue),
		asynq.MaxRetry(e.cfg.MaxRetry),
		asynq.Timeout(e.cfg.Timeout),
	}
	if notBefore != nil && notBefore.After(time.Now()) {
		opts = append(opts, asynq.ProcessAt(*notBefore))
	}
	repaired := false
	var lastErr error // why the previous round did not settle the conflict
	for range maxConflictRounds {
		_, err := e.client.EnqueueContext(ctx, task, opts...)
		switch {
		case err == nil && repaired:
			return taskRepaired, nil
		case err == nil:
			return taskEnqueued, nil
		case !errors.Is(err, asynq.ErrTaskIDConflict):
			return taskQueued, err
		case e.insp == nil:
			return taskQueued, nil
		}
		if err := ctx.Err(); err != nil {
			return taskQueued, err
		}
		// asynq's Inspector takes no context; its calls are single Redis round trips.
		info, err := e.insp.GetTaskInfo(rec.Queue, rec.Key)
		switch {
		case errors.Is(err, asynq.ErrTaskNotFound), errors.Is(err, asynq.ErrQueueNotFound):
			lastErr = err
			continue // the task went away since the conflict: enqueue again
		case err != nil:
			return taskQueued, fmt.Errorf("inspect the task holding the id: %w", err)
		case info.State != asynq.TaskStateArchived:
			return taskQueued, nil
		}
		// Archived: it would never run and keeps the id taken. Delete it, enqueue again.
		if err := e.insp.DeleteTask(rec.Queue, rec.Key); err != nil && !errors.Is(err, asynq.ErrTaskNotFound) {
			// The task changed state under us (a concurrent repair's new task may be
			// active, which can not be deleted): inspect again.
			lastErr = err
			continue
		}
		repaired = true
	}
	return taskQueued, fmt.Errorf("task id still in conflict after %d inspections (last: %v)", maxConflictRounds, lastErr)
}
