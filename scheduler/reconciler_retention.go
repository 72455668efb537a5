package scheduler

import (
	"context"
	"fmt"
	"time"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/inputs"
)

// Retention: the reconciler's duty that keeps PostgreSQL from growing without bound. Each
// sweep deletes, in statements of at most PruneBatch rows (oldest first, skipping rows
// another transaction holds, so it never waits on a worker's commit) and at most
// DefaultMaxPruneBatches statements per table:
//
//   - quarantined staging older than reconciler.quarantine_retention;
//   - terminal jobs (complete, failed) unchanged for reconciler.job_retention, with their
//     attempts, results, quarantine, notes and saved inputs (ON DELETE CASCADE);
//   - schedule_windows rows (the window ledger) due longer than window_retention ago,
//     which is longer than job_retention: a window is recorded as long as any of its jobs
//     can be, so a tick of a window whose jobs may have been pruned is refused
//     (store.ErrWindowExpired) instead of creating them again.
//
// Jobs in any other state are never deleted. What the next sweeps will delete is
// store.PG.RetentionDue (shown by `idemscrape stats -config`).
//
// It also deletes saved inputs (store/inputs) created longer ago than
// reconciler.saved_input_retention, with the bodies nothing references or used for as
// long: at most PruneBatch of each per call, at most DefaultMaxPruneBatches calls per
// sweep. (Sent outbox rows and old inbox rows are pruned by the outbox upkeep,
// reconciler_outbox.go.)

// RetentionPruner deletes what is past its retention, one bounded batch per call
// (*store.PG).
type RetentionPruner interface {
	JobsPruneTerminal(ctx context.Context, olderThan time.Duration, limit int) (int64, error)
	QuarantinePrune(ctx context.Context, olderThan time.Duration, limit int) (int64, error)
	WindowsPrune(ctx context.Context, olderThan time.Duration, limit int) (int64, error)
}

var _ RetentionPruner = (*store.PG)(nil)

// InputsPruner deletes saved inputs older than a retention, one bounded batch per call
// (*inputs.Store).
type InputsPruner interface {
	Prune(ctx context.Context, p inputs.PruneParams) (inputs.PruneResult, error)
}

var _ InputsPruner = (*inputs.Store)(nil)

// Counter names of the retention duty (see the Action* names in reconciler.go).
const (
	ActionJobsPruned       = "reconciler_jobs_pruned"       // terminal jobs deleted with all their rows
	ActionQuarantinePruned = "reconciler_quarantine_pruned" // quarantined staging deleted
	ActionWindowsPruned    = "reconciler_windows_pruned"    // schedule_windows rows deleted
)

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

// pruneRetention runs the retention duty of one sweep (quarantine first: it is most of the
// bytes, and a job's delete then has less to cascade to).
func (r *Reconciler) pruneRetention(ctx context.Context, rep *SweepReport) error {
	rc := r.cfg.File.Reconciler
	return r.prune(ctx, rep,
		pruneStep{ActionQuarantinePruned, r.cfg.Retention.QuarantinePrune, rc.QuarantineRetention},
		pruneStep{ActionJobsPruned, r.cfg.Retention.JobsPruneTerminal, rc.JobRetention},
		pruneStep{ActionWindowsPruned, r.cfg.Retention.WindowsPrune, rc.WindowRetention})
}

// pruneStep is one kind of row a sweep prunes: what it counts under, how, and from what age.
type pruneStep struct {
	action string
	prune  func(context.Context, time.Duration, int) (int64, error)
	age    time.Duration
}

// prune runs steps in order (pruneBatches each), stopping at the first error.
func (r *Reconciler) prune(ctx context.Context, rep *SweepReport, steps ...pruneStep) error {
	for _, p := range steps {
		if err := r.pruneBatches(ctx, rep, p.action, p.prune, p.age); err != nil {
			return err
		}
	}
	return nil
}

// pruneBatches calls prune until a batch is short, at most DefaultMaxPruneBatches times
// (the next sweep goes on), counting what it deleted under action. The outbox upkeep
// prunes with it too.
func (r *Reconciler) pruneBatches(ctx context.Context, rep *SweepReport, action string,
	prune func(context.Context, time.Duration, int) (int64, error), age time.Duration) error {
	batch := r.cfg.File.Reconciler.PruneBatch
	for range DefaultMaxPruneBatches {
		qctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
		n, err := prune(qctx, age, batch)
		cancel()
		rep.Statements++
		if err != nil {
			return fmt.Errorf("scheduler: reconciler prune (%s): %w", action, err)
		}
		rep.Actions[action] += n
		if n < int64(batch) {
			return nil
		}
	}
	return nil
}
