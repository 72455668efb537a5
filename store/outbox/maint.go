package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// LagReport is what Lag found: unsent outbox rows older than the threshold.
type LagReport struct {
	// Unsent is the number of unsent rows created more than the threshold ago.
	Unsent int64
	// Oldest is the created_at (PostgreSQL's clock) of the oldest of them; zero when
	// Unsent is 0.
	Oldest time.Time
}

// Lag counts the outbox rows still unsent that were created more than olderThan ago (0:
// every unsent row) and returns the oldest one's created_at. A count above zero past a
// threshold longer than the dispatcher's poll interval means no dispatcher is publishing
// (or it cannot reach Redis). The statement reads only unsent rows (the partial index
// outbox_unsent_idx), so it costs in proportion to the backlog, not to the table; it is
// bounded by DefaultQueryTimeout and ctx.
func Lag(ctx context.Context, pool *pgxpool.Pool, olderThan time.Duration) (LagReport, error) {
	if olderThan < 0 {
		return LagReport{}, fmt.Errorf("outbox: Lag: olderThan %v is negative", olderThan)
	}
	ctx, cancel := context.WithTimeout(ctx, DefaultQueryTimeout)
	defer cancel()
	var (
		rep    LagReport
		oldest *time.Time
	)
	err := pool.QueryRow(ctx, `
SELECT count(*), min(created_at) FROM outbox
WHERE sent_at IS NULL AND created_at < now() - $1::interval`, olderThan).Scan(&rep.Unsent, &oldest)
	if err != nil {
		return LagReport{}, fmt.Errorf("outbox: Lag: %w", err)
	}
	if oldest != nil {
		rep.Oldest = *oldest
	}
	return rep, nil
}

// PruneSent deletes up to limit outbox rows that were sent more than olderThan ago, oldest
// first, and returns how many it deleted; call it until it returns less than limit. Unsent
// rows are never deleted. Rows another pruner is deleting at the same moment are skipped
// (SKIP LOCKED), so any number of reconcilers can prune side by side without waiting on
// each other. The statement walks the partial index outbox_sent_at_idx (migration 00003)
// and is bounded by DefaultQueryTimeout and ctx.
//
// A pruned row's event_key is free again: an event committed again under the same key
// after its row was pruned is published again, and only the consumers' inbox or ledger
// (while it still remembers the key) recognises the replay. Keep olderThan shorter than
// the consumers' inbox retention and ledger TTL.
func PruneSent(ctx context.Context, pool *pgxpool.Pool, olderThan time.Duration, limit int) (int64, error) {
	return prune(ctx, pool, "PruneSent", `
DELETE FROM outbox WHERE id IN (
	SELECT id FROM outbox
	WHERE sent_at IS NOT NULL AND sent_at < now() - $1::interval
	ORDER BY sent_at
	LIMIT $2
	FOR UPDATE SKIP LOCKED)`, olderThan, limit)
}

// prune runs one pruning statement of PruneSent or InboxPrune: sql deletes up to limit
// ($2) rows older than olderThan ($1). It checks both are positive, bounds the statement
// by DefaultQueryTimeout and ctx, names op in its errors and returns the rows deleted.
func prune(ctx context.Context, pool *pgxpool.Pool, op, sql string, olderThan time.Duration, limit int) (int64, error) {
	if olderThan <= 0 || limit <= 0 {
		return 0, fmt.Errorf("outbox: %s: olderThan (%v) and limit (%d) must be positive", op, olderThan, limit)
	}
	ctx, cancel := context.WithTimeout(ctx, DefaultQueryTimeout)
	defer cancel()
	tag, err := pool.Exec(ctx, sql, olderThan, limit)
	if err != nil {
		return 0, fmt.Errorf("outbox: %s: %w", op, err)
	}
	return tag.RowsAffected(), nil
}

// Maintainer is the outbox maintenance a reconciler runs (lag report and pruning) bound
// to one pool; its methods have the shape of scheduler.OutboxMaintainer.
type Maintainer struct {
	Pool *pgxpool.Pool
}

// NewMaintainer returns a Maintainer on pool.
func NewMaintainer(pool *pgxpool.Pool) (*Maintainer, error) {
	if pool == nil {
		return nil, errors.New("outbox: NewMaintainer: pool is required")
	}
	return &Maintainer{Pool: pool}, nil
}

// Lag is the package's Lag on m's pool: unsent rows older than olderThan and the oldest
// one's created_at (zero when none).
func (m *Maintainer) Lag(ctx context.Context, olderThan time.Duration) (unsent int64, oldest time.Time, err error) {
	rep, err := Lag(ctx, m.Pool, olderThan)
	return rep.Unsent, rep.Oldest, err
}

// PruneSent is the package's PruneSent on m's pool.
func (m *Maintainer) PruneSent(ctx context.Context, olderThan time.Duration, limit int) (int64, error) {
	return PruneSent(ctx, m.Pool, olderThan, limit)
}

// PruneInbox is InboxPrune on m's pool.
func (m *Maintainer) PruneInbox(ctx context.Context, olderThan time.Duration, limit int) (int64, error) {
	return InboxPrune(ctx, m.Pool, olderThan, limit)
}
