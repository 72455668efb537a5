package scheduler

import (
	"context"
	"fmt"
	"time"

	"github.com/idemscrape/idemscrape/store"
)

// Retention: the reconciler's duty that keeps PostgreSQL from growing without bound. Each
// sweep deletes, in statements of at most PruneBatch rows (oldest first, skipping rows
// another transaction holds, so it never waits on a worker's commit) and at most
// DefaultMaxPruneBatches statements per table:
//
//   - quarantined staging older than reconciler.quarantine_retention;
//   - terminal jobs (complete, failed) unchanged for reconciler.job_retention, with their
//     attempts, results, quarantine, notes and saved inputs (ON DELETE CASCADE);
//   - schedule_windows rows due longer than job_retention ago (their jobs are gone too).
//
// Jobs in any other state are never deleted. What the next sweeps will delete is
// store.PG.RetentionDue (shown by `idemscrape stats -config`).

// RetentionPruner deletes what is past its retention, one bounded batch per call
// (*store.PG).
type RetentionPruner interface {
	JobsPruneTerminal(ctx context.Context, olderThan time.Duration, limit int) (int64, error)
	QuarantinePrune(ctx context.Context, olderThan time.Duration, limit int) (int64, error)
	WindowsPrune(ctx context.Context, olderThan time.Duration, limit int) (int64, error)
}

var _ RetentionPruner = (*store.PG)(nil)

// Counter names of the retention duty (see the Action* names in reconciler.go).
const (
	ActionJobsPruned       = "reconciler_jobs_pruned"       // terminal jobs deleted with all their rows
	ActionQuarantinePruned = "reconciler_quarantine_pruned" // quarantined staging deleted
	ActionWindowsPruned    = "reconciler_windows_pruned"    // schedule_windows rows deleted
)

// pruneRetention runs the retention duty of one sweep (quarantine first: it is most of the
// bytes, and a job's delete then has less to cascade to).
func (r *Reconciler) pruneRetention(ctx context.Context, rep *SweepReport) error {
	rc := r.cfg.File.Reconciler
	for _, p := range []struct {
		action string
		prune  func(context.Context, time.Duration, int) (int64, error)
		age    time.Duration
	}{
		{ActionQuarantinePruned, r.cfg.Retention.QuarantinePrune, rc.QuarantineRetention},
		{ActionJobsPruned, r.cfg.Retention.JobsPruneTerminal, rc.JobRetention},
		{ActionWindowsPruned, r.cfg.Retention.WindowsPrune, rc.JobRetention},
	} {
		if err := r.pruneBatches(ctx, rep, p.action, p.prune, p.age); err != nil {
			return err
		}
	}
	return nil
}

// pruneBatches calls prune until a batch is short, at most DefaultMaxPruneBatches times
// (the next sweep goes on), counting what it deleted under action.
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
