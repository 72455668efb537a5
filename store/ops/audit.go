package ops

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// The invariants Audit checks, by name.
const (
	// InvCompleteHasResultAndEvent: every complete job has exactly one result and one
	// outbox event. The result is the job's own, or, when its result write was rejected as
	// a duplicate, the one its event's payload names ("observation_key", as the handlers
	// runner writes it).
	InvCompleteHasResultAndEvent = "complete_job_has_one_result_and_one_event"
	// InvResultHasCompleteJob: every result belongs to a complete job.
	InvResultHasCompleteJob = "result_has_complete_job"
	// InvRunningHasLiveTask: a job whose running attempt started longer than LeaseMax ago
	// has a live queue task (one that will run it again, or a rescue would have moved it).
	InvRunningHasLiveTask = "running_past_lease_has_live_task"
	// InvOutboxLag: no outbox event waits unsent for longer than OutboxLagMax.
	InvOutboxLag = "outbox_lag_within_threshold"
	// InvFencesIncreasing: the fences of a job's attempts strictly increase with the attempt
	// number, and the job's fence is at least the highest of them.
	InvFencesIncreasing = "attempt_fences_strictly_increasing"
	// InvAttemptPerStart: a terminal (complete or failed) job has exactly one attempt row per
	// start: attempt numbers 1..jobs.attempts, none of them still 'running'. An attempt row
	// is written when the attempt ends (commit or failure) or, for one that never ended (a
	// killed or stopped worker), as 'lost' by whoever raised the fence next.
	InvAttemptPerStart = "terminal_job_has_one_attempt_row_per_start"
)

// Audit defaults.
const (
	DefaultAuditLeaseMax     = 10 * time.Minute
	DefaultAuditOutboxLagMax = 5 * time.Minute
	// DefaultAuditOutboxRetention matches the reconciler's default retention of sent outbox rows.
	DefaultAuditOutboxRetention = 7 * 24 * time.Hour
	DefaultAuditBatchSize       = 1000
	DefaultAuditMaxExamples     = 10
	// DefaultEventKeyPrefix is the prefix of a job's outbox event key as the handlers
	// runner writes it (handlers.EventKey(key) == "observed:" + key).
	DefaultEventKeyPrefix = "observed:"
)

// TaskLiveFunc reports whether the queue holds a live task (pending, scheduled, active,
// retry, aggregating: not archived, not completed, not missing) for the job with key and
// kind.
type TaskLiveFunc func(ctx context.Context, kind, key string) (bool, error)

// AuditConfig configures Audit.
type AuditConfig struct {
	// LeaseMax is the longest a running attempt may run before its job must have a live
	// task. Use the longest lease any kind is given. Defaults to DefaultAuditLeaseMax.
	LeaseMax time.Duration
	// OutboxLagMax is the longest an outbox event may wait unsent. Defaults to
	// DefaultAuditOutboxLagMax.
	OutboxLagMax time.Duration
	// EventKeyPrefix + job key is a job's outbox event key. Defaults to
	// DefaultEventKeyPrefix.
	EventKeyPrefix string
	// OutboxRetention is how long sent outbox rows are kept (the reconciler prunes older
	// ones): a job completed before now − OutboxRetention need not have its event row any
	// more. Use the reconciler's setting. Defaults to DefaultAuditOutboxRetention.
	OutboxRetention time.Duration
	// TaskLive checks the queue for InvRunningHasLiveTask. Required.
	TaskLive TaskLiveFunc
	// BatchSize is how many rows one keyset page reads. Defaults to DefaultAuditBatchSize.
	BatchSize int
	// MaxExamples is how many keys each broken invariant names. Defaults to
	// DefaultAuditMaxExamples.
	MaxExamples int
}

// Validate checks the config and fills in defaults.
func (c *AuditConfig) Validate() error {
	if c.LeaseMax == 0 {
		c.LeaseMax = DefaultAuditLeaseMax
	}
	if c.OutboxRetention == 0 {
		c.OutboxRetention = DefaultAuditOutboxRetention
	}
	if c.OutboxLagMax == 0 {
		c.OutboxLagMax = DefaultAuditOutboxLagMax
	}
	if c.EventKeyPrefix == "" {
		c.EventKeyPrefix = DefaultEventKeyPrefix
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultAuditBatchSize
	}
	if c.MaxExamples == 0 {
		c.MaxExamples = DefaultAuditMaxExamples
	}
	switch {
	case c.LeaseMax < 0:
		return fmt.Errorf("ops: AuditConfig.LeaseMax %v is negative", c.LeaseMax)
	case c.OutboxLagMax < 0:
		return fmt.Errorf("ops: AuditConfig.OutboxLagMax %v is negative", c.OutboxLagMax)
	case c.BatchSize < 1:
		return fmt.Errorf("ops: AuditConfig.BatchSize %d must be >= 1", c.BatchSize)
	case c.MaxExamples < 1:
		return fmt.Errorf("ops: AuditConfig.MaxExamples %d must be >= 1", c.MaxExamples)
	case c.TaskLive == nil:
		return errors.New("ops: AuditConfig.TaskLive is required (it checks the queue for running jobs past their lease)")
	}
	return nil
}

// Invariant is the verdict on one invariant.
type Invariant struct {
	Name        string   `json:"name"`
	Description string   `json:"description"`
	Checked     int64    `json:"checked"`    // rows examined
	Violations  int64    `json:"violations"` // rows that break it
	Examples    []string `json:"examples"`   // up to MaxExamples job keys (event keys for events of no job)
}

// OK reports whether nothing breaks the invariant.
func (i Invariant) OK() bool { return i.Violations == 0 }

func (i *Invariant) add(key string, max int) {
	i.Violations++
	if len(i.Examples) < max {
		i.Examples = append(i.Examples, key)
	}
}

// AuditReport is what Audit found, one Invariant per check, in a fixed order.
type AuditReport struct {
	At         time.Time   `json:"at"` // the database's now() the thresholds were measured from
	Invariants []Invariant `json:"invariants"`
}

// OK reports whether every invariant holds.
func (r AuditReport) OK() bool {
	for _, i := range r.Invariants {
		if !i.OK() {
			return false
		}
	}
	return true
}

// Broken returns the invariants that do not hold.
func (r AuditReport) Broken() []Invariant {
	var out []Invariant
	for _, i := range r.Invariants {
		if !i.OK() {
			out = append(out, i)
		}
	}
	return out
}

// Audit checks the invariants of the system of record. Every table is read in keyset pages
// of BatchSize rows (ORDER BY key, key > last), one statement each, so an audit holds no
// long transaction and its cost grows with the tables, page by page. Thresholds are measured
// from the database's clock, read once. An error is returned only when a check could not
// run; broken invariants are in the report.
func (s *Store) Audit(ctx context.Context, cfg AuditConfig) (AuditReport, error) {
	if err := cfg.Validate(); err != nil {
		return AuditReport{}, err
	}
	var rep AuditReport
	if err := s.pool.QueryRow(ctx, `SELECT now()`).Scan(&rep.At); err != nil {
		return AuditReport{}, fmt.Errorf("ops: Audit: %w", err)
	}
	complete := Invariant{Name: InvCompleteHasResultAndEvent, Description: "every complete job has exactly one result (its own, or the one its event names if its write was a rejected duplicate) and one outbox event (unless pruned after the outbox retention); no job that is not complete has an event"}
	fences := Invariant{Name: InvFencesIncreasing, Description: "attempt fences strictly increase per job, and the job's fence is the highest"}
	perStart := Invariant{Name: InvAttemptPerStart, Description: "a complete or failed job has exactly one attempt row per start (numbers 1..attempts), none still running"}
	if err := s.auditJobs(ctx, cfg, &complete, &fences, &perStart); err != nil {
		return AuditReport{}, err
	}
	results := Invariant{Name: InvResultHasCompleteJob, Description: "every result belongs to a complete job"}
	if err := s.auditResults(ctx, cfg, &results); err != nil {
		return AuditReport{}, err
	}
	running := Invariant{Name: InvRunningHasLiveTask,
		Description: fmt.Sprintf("a job running for longer than %v has a live queue task", cfg.LeaseMax)}
	if err := s.auditRunning(ctx, cfg, rep.At.Add(-cfg.LeaseMax), &running); err != nil {
		return AuditReport{}, err
	}
	lag := Invariant{Name: InvOutboxLag, Description: fmt.Sprintf("no outbox event waits unsent for longer than %v", cfg.OutboxLagMax)}
	if err := s.auditOutbox(ctx, cfg, rep.At.Add(-cfg.OutboxLagMax), &lag); err != nil {
		return AuditReport{}, err
	}
	rep.Invariants = []Invariant{complete, results, running, lag, fences, perStart}
	return rep, nil
}

// auditJobs pages through every job once for the per-job invariants.
func (s *Store) auditJobs(ctx context.Context, cfg AuditConfig, complete, fences, perStart *Invariant) error {
	last := ""
	for {
		rows, _ := s.pool.Query(ctx, `
WITH page AS (
	SELECT key, state, fence, attempts, completed_at FROM jobs WHERE key > $1 ORDER BY key LIMIT $2
)
SELECT p.key, p.state = 'complete', COALESCE(p.completed_at < now() - $4::interval, false),
	(SELECT count(*) FROM results r WHERE r.job_key = p.key),
	ev.payload IS NOT NULL,
	EXISTS (SELECT 1 FROM results r WHERE r.observation_key = ev.payload->>'observation_key'),
	NOT EXISTS (SELECT 1 FROM (
		SELECT fence, lag(fence) OVER (ORDER BY attempt_no) AS prev FROM attempts a WHERE a.job_key = p.key
	) x WHERE x.prev >= x.fence)
	AND p.fence >= COALESCE((SELECT max(fence) FROM attempts a WHERE a.job_key = p.key), 0),
	p.state IN ('complete', 'failed'),
	p.state NOT IN ('complete', 'failed') OR (
		SELECT count(*) = p.attempts AND count(DISTINCT attempt_no) = p.attempts
			AND COALESCE(min(attempt_no), 1) = 1 AND COALESCE(max(attempt_no), 0) = p.attempts
			AND NOT bool_or(outcome = 'running') IS TRUE
		FROM attempts a WHERE a.job_key = p.key)
FROM page p LEFT JOIN LATERAL (
	SELECT payload FROM outbox o WHERE o.event_key = $3 || p.key
) ev ON true
ORDER BY p.key`, last, cfg.BatchSize, cfg.EventKeyPrefix, cfg.OutboxRetention)
		var (
			key                                               string
			isComplete, pruned, hasEvent, shared, incr, perOK bool
			isTerminal                                        bool
			nResults                                          int64
			n                                                 int
		)
		_, err := pgx.ForEachRow(rows, []any{&key, &isComplete, &pruned, &nResults, &hasEvent, &shared, &incr, &isTerminal, &perOK}, func() error {
			n++
			last = key
			fences.Checked++
			if !incr {
				fences.add(key, cfg.MaxExamples)
			}
			if isTerminal {
				perStart.Checked++
			}
			if !perOK {
				perStart.add(key, cfg.MaxExamples)
			}
			if isComplete {
				complete.Checked++
				// A job whose observation another job had stored already (a duplicate result
				// write, rejected and counted) has no result row of its own: its event names
				// the observation, which must exist.
				switch {
				case nResults > 1:
					complete.add(key, cfg.MaxExamples)
				case pruned && !hasEvent:
					// Completed before the outbox retention: its sent event row may have been
					// pruned, and with it the proof of a shared observation.
				case !hasEvent || (nResults == 0 && !shared):
					complete.add(key, cfg.MaxExamples)
				}
			} else if hasEvent {
				complete.Checked++
				complete.add(key, cfg.MaxExamples) // an event published for a job not complete
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("ops: Audit: jobs after %q: %w", last, err)
		}
		if n < cfg.BatchSize {
			return nil
		}
	}
}

// auditResults pages through every result.
func (s *Store) auditResults(ctx context.Context, cfg AuditConfig, inv *Invariant) error {
	last := ""
	for {
		rows, _ := s.pool.Query(ctx, `
SELECT r.observation_key, r.job_key, j.state = 'complete'
FROM results r JOIN jobs j ON j.key = r.job_key
WHERE r.observation_key > $1 ORDER BY r.observation_key LIMIT $2`, last, cfg.BatchSize)
		var (
			obs, job string
			ok       bool
			n        int
		)
		_, err := pgx.ForEachRow(rows, []any{&obs, &job, &ok}, func() error {
			n++
			last = obs
			inv.Checked++
			if !ok {
				inv.add(job, cfg.MaxExamples)
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("ops: Audit: results after %q: %w", last, err)
		}
		if n < cfg.BatchSize {
			return nil
		}
	}
}

// auditRunning pages through the running jobs (the partial index of running jobs) and asks
// the queue about each one whose current attempt started before cutoff.
func (s *Store) auditRunning(ctx context.Context, cfg AuditConfig, cutoff time.Time, inv *Invariant) error {
	type cand struct{ key, kind string }
	last := ""
	for {
		rows, _ := s.pool.Query(ctx, `
SELECT j.key, j.kind, COALESCE(j.attempt_started_at, j.updated_at) < $3
FROM jobs j
WHERE j.state = 'running' AND j.key > $1 ORDER BY j.key LIMIT $2`, last, cfg.BatchSize, cutoff)
		var (
			c     cand
			past  bool
			n     int
			cands []cand
		)
		_, err := pgx.ForEachRow(rows, []any{&c.key, &c.kind, &past}, func() error {
			n++
			last = c.key
			inv.Checked++
			if past {
				cands = append(cands, c)
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("ops: Audit: running jobs after %q: %w", last, err)
		}
		// The queue is asked after the page's rows are read: no connection is held meanwhile.
		for _, c := range cands {
			live, err := cfg.TaskLive(ctx, c.kind, c.key)
			if err != nil {
				return fmt.Errorf("ops: Audit: queue task of %q: %w", c.key, err)
			}
			if !live {
				inv.add(c.key, cfg.MaxExamples)
			}
		}
		if n < cfg.BatchSize {
			return nil
		}
	}
}

// auditOutbox pages through the outbox events not dispatched yet (view outbox_unsent,
// migration 00020: the rows in front of their topic's position).
func (s *Store) auditOutbox(ctx context.Context, cfg AuditConfig, cutoff time.Time, inv *Invariant) error {
	var last int64
	for {
		rows, _ := s.pool.Query(ctx, `
SELECT id, event_key, created_at < $3 FROM outbox_unsent
WHERE id > $1 ORDER BY id LIMIT $2`, last, cfg.BatchSize, cutoff)
		var (
			id   int64
			ev   string
			late bool
			n    int
		)
		_, err := pgx.ForEachRow(rows, []any{&id, &ev, &late}, func() error {
			n++
			last = id
			inv.Checked++
			if late {
				// Named by job key when the event is a job's.
				inv.add(strings.TrimPrefix(ev, cfg.EventKeyPrefix), cfg.MaxExamples)
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("ops: Audit: outbox after id %d: %w", last, err)
		}
		if n < cfg.BatchSize {
			return nil
		}
	}
}
