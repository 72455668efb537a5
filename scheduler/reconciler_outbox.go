package scheduler

import (
	"context"
	"fmt"
	"time"

	"github.com/idemscrape/idemscrape/store/outbox"
)

// The reconciler's outbox upkeep: outbox lag reported, sent outbox rows and old inbox rows
// pruned. (The reconciler does not relay the outbox: a dispatcher does.)

// OutboxMaintainer reports outbox lag and prunes old outbox and inbox rows (Maintainer).
type OutboxMaintainer interface {
	// Lag reports the unsent outbox rows older than olderThan and the oldest one's time.
	Lag(ctx context.Context, olderThan time.Duration) (unsent int64, oldest time.Time, err error)
	// PruneSent deletes at most limit sent outbox rows sent more than olderThan ago.
	PruneSent(ctx context.Context, olderThan time.Duration, limit int) (int64, error)
	// PruneInbox deletes at most limit inbox rows seen more than olderThan ago.
	PruneInbox(ctx context.Context, olderThan time.Duration, limit int) (int64, error)
}

// outbox.Maintainer (store/outbox's Lag, PruneSent and InboxPrune on one pool) is the
// OutboxMaintainer on PostgreSQL.
var _ OutboxMaintainer = (*outbox.Maintainer)(nil)

// outbox reports the unsent outbox rows older than OutboxLagThreshold (SweepReport,
// metrics, a warning) and deletes, in bounded batches (pruneBatches), sent outbox rows
// older than OutboxRetention and inbox rows older than InboxRetention.
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
	return r.prune(ctx, rep,
		pruneStep{ActionOutboxPruned, r.cfg.Outbox.PruneSent, rc.OutboxRetention},
		pruneStep{ActionInboxPruned, r.cfg.Outbox.PruneInbox, rc.InboxRetention})
}
