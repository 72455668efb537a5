package tasks

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/hibiken/asynq"
)

// Outcome tells what Enqueue did for one spec.
type Outcome int

// The outcomes of Enqueue.
const (
	// Created: a new jobs row and a new asynq task.
	Created Outcome = iota + 1
	// AlreadyQueued: the job existed and asynq already holds a task with its id (pending,
	// scheduled, active, retry — or archived, see Enqueuer). Nothing was written.
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
	}
	return fmt.Sprintf("Outcome(%d)", int(o))
}

// Result is what Enqueue reports for one spec.
type Result struct {
	Key     string
	Outcome Outcome
	State   JobState // the jobs row's state as recorded
}

// Payload is the body of every asynq task idemscrape enqueues. The task id is Key.
type Payload struct {
	Key  string `json:"key"`
	Spec Spec   `json:"spec"`
}

// DecodePayload reads a task payload and checks that its key matches its spec, so a task
// edited by hand or written by another version can not run under a foreign key.
func DecodePayload(b []byte, n *Normalizer) (Payload, error) {
	var p Payload
	if err := json.Unmarshal(b, &p); err != nil {
		return Payload{}, fmt.Errorf("tasks: decode payload: %w", err)
	}
	if n == nil {
		n = DefaultNormalizer
	}
	key, err := n.Key(p.Spec)
	if err != nil {
		return Payload{}, fmt.Errorf("tasks: decode payload: %w", err)
	}
	if key != p.Key {
		return Payload{}, fmt.Errorf("tasks: decode payload: key %q does not match its spec (derived %q)", p.Key, key)
	}
	return p, nil
}

// Enqueuer defaults.
const (
	DefaultQueue = "default"
	// DefaultMaxRetry is effectively unlimited: the runner's policy (attempt cap, time and
	// bandwidth budgets) ends a job and tells asynq with SkipRetry. A small asynq MaxRetry
	// would archive tasks behind the runner's back — asynq checks it even for retries the
	// runner does not count (a busy lease) — and an archived task blocks its key.
	DefaultMaxRetry = 1 << 30
	DefaultTimeout  = 30 * time.Minute
)

// EnqueuerConfig configures an Enqueuer.
type EnqueuerConfig struct {
	// Queue is the asynq queue tasks go to. asynq checks task ids per queue, so one job kind
	// must always use one queue. Defaults to DefaultQueue.
	Queue string
	// Normalizer derives keys (URL canonicalisation, tracking parameters). Every process
	// that enqueues the same kinds must use the same one. Defaults to DefaultNormalizer.
	Normalizer *Normalizer
	// MaxRetry is asynq's retry cap per task. Defaults to DefaultMaxRetry (unlimited: the
	// runner decides).
	MaxRetry int
	// Timeout is asynq's per-delivery timeout. Defaults to DefaultTimeout.
	Timeout time.Duration
}

// Validate checks the config and fills in defaults.
func (c *EnqueuerConfig) Validate() error {
	if c.Queue == "" {
		c.Queue = DefaultQueue
	}
	if c.Normalizer == nil {
		c.Normalizer = DefaultNormalizer
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
//     AlreadyQueued — a dedup hit, not an error.
//   - with Retention(0) the id is freed the moment the handler succeeds (the task is
//     deleted). By then the runner has committed the job as complete in Postgres, so a later
//     Enqueue sees AlreadyComplete and enqueues nothing.
//   - an archived task (SkipRetry, or MaxRetry exhausted) blocks its id until it is deleted
//     from the archive (asynq trims archives after 90 days or 10,000 tasks per queue). The
//     runner marks such jobs failed in Postgres first, and Enqueue never re-enqueues a failed
//     job.
//   - ids are per queue: the same key enqueued to two queues is two tasks. Keep one queue
//     per kind.
//
// If the task enqueue fails after the row was inserted (Redis down), Enqueue returns the
// error and the row stays pending; enqueueing the same spec again (or the reconciler)
// enqueues the task then, reported as Requeued. Nothing is lost and nothing runs twice to
// effect.
type Enqueuer struct {
	client *asynq.Client
	rec    JobRecorder
	cfg    EnqueuerConfig
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
	return &Enqueuer{client: client, rec: rec, cfg: c}, nil
}

// Enqueue records one job and enqueues its task unless it is already queued, complete or
// failed. An invalid spec returns an error naming the field (errors.Is ErrInvalidSpec) and
// stores nothing.
func (e *Enqueuer) Enqueue(ctx context.Context, spec Spec) (Result, error) {
	res, err := e.EnqueueMany(ctx, []Spec{spec})
	if err != nil {
		return Result{}, err
	}
	return res[0], nil
}

// EnqueueMany is Enqueue for a batch: every spec is validated before anything is stored
// (one invalid spec stores nothing and the error names its index and field), the rows are
// recorded in one statement, and a task is enqueued for each job that needs one. Results
// are in the order of specs; a key given twice is enqueued once and the second occurrence
// reports AlreadyQueued.
func (e *Enqueuer) EnqueueMany(ctx context.Context, specs []Spec) ([]Result, error) {
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
		records[i] = JobRecord{Key: key, Spec: norm}
	}
	recorded, err := e.rec.JobsRecord(ctx, records)
	if err != nil {
		return nil, err
	}
	if len(recorded) != len(records) {
		return nil, fmt.Errorf("tasks: recorder returned %d results for %d records", len(recorded), len(records))
	}

	results := make([]Result, len(records))
	done := make(map[string]bool, len(records))
	for i, rec := range records {
		r := recorded[i]
		results[i] = Result{Key: rec.Key, State: r.State}
		switch {
		case r.State == StateComplete:
			results[i].Outcome = AlreadyComplete
			continue
		case r.State == StateFailed:
			results[i].Outcome = AlreadyFailed
			continue
		case done[rec.Key]:
			results[i].Outcome = AlreadyQueued
			continue
		}
		done[rec.Key] = true
		enqueued, err := e.enqueueTask(ctx, rec, r.NextAttemptAt)
		if err != nil {
			return nil, fmt.Errorf("tasks: enqueue %q: %w", rec.Key, err)
		}
		switch {
		case r.Created:
			// Ours even if a concurrent duplicate enqueued the task a moment before us.
			results[i].Outcome = Created
		case enqueued:
			results[i].Outcome = Requeued
		default:
			results[i].Outcome = AlreadyQueued
		}
	}
	return results, nil
}

// enqueueTask enqueues the asynq task for rec; false means asynq already holds one. A
// retryable job whose next attempt is in the future (a destination's Retry-After, a
// backoff) is scheduled for then, not run at once.
func (e *Enqueuer) enqueueTask(ctx context.Context, rec JobRecord, notBefore *time.Time) (bool, error) {
	payload, err := json.Marshal(Payload{Key: rec.Key, Spec: rec.Spec})
	if err != nil {
		return false, err
	}
	task := asynq.NewTask(rec.Spec.Kind, payload)
	opts := []asynq.Option{
		asynq.TaskID(rec.Key),
		asynq.Retention(0),
		asynq.Queue(e.cfg.Queue),
		asynq.MaxRetry(e.cfg.MaxRetry),
		asynq.Timeout(e.cfg.Timeout),
	}
	if notBefore != nil && notBefore.After(time.Now()) {
		opts = append(opts, asynq.ProcessAt(*notBefore))
	}
	_, err = e.client.EnqueueContext(ctx, task, opts...)
	if errors.Is(err, asynq.ErrTaskIDConflict) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return true, nil
}
