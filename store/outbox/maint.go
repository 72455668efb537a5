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

// Lag counts the outbox rows not dispatched yet (in front of their topic's position) that
// were created more than olderThan ago (0: every such row) and returns the oldest one's
// created_at. A count above zero past a threshold longer than the dispatcher's poll
// interval means no dispatcher is publishing (or it cannot reach Redis), or a write
// transaction has been open on the PostgreSQL server that long and holds the dispatch
// horizon back (see the package doc). The statement walks each topic's rows after its
// position (outbox_topic_xid_idx, one descent per topic to find the topics), so it costs
// in proportion to the topics and the backlog, not to the table; it is bounded by
// DefaultQueryTimeout and ctx.
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
WITH RECURSIVE t(topic) AS (
	SELECT min(topic) FROM outbox
	UNION ALL
	SELECT (SELECT min(o.topic) FROM outbox o WHERE o.topic > t.topic) FROM t WHERE t.topic IS NOT NULL
)
SELECT count(*), min(o.created_at)
FROM t LEFT JOIN outbox_positions p ON p.topic = t.topic
CROSS JOIN LATERAL (
	SELECT o.created_at FROM outbox o
	WHERE o.topic = t.topic AND (o.xid, o.id) > (COALESCE(p.xid, '0'::xid8), COALESCE(p.id, 0))
) o
WHERE t.topic IS NOT NULL AND o.created_at < now() - $1::interval`, olderThan).Scan(&rep.Unsent, &oldest)
	if err != nil {
		return LagReport{}, fmt.Errorf("outbox: Lag: %w", err)
	}
	if oldest != nil {
		rep.Oldest = *oldest
	}
	return rep, nil
}

// PruneSent deletes up to limit dispatched outbox rows (behind their topic's position)
// created more than olderThan ago, oldest first, and returns how many it deleted; call it
// until it returns less than limit. Rows not dispatched yet are never deleted. Each topic's
// oldest limit rows behind its position are read in commit order (outbox_topic_xid_idx)
// and those old enough deleted, so a call stops at the first rows too young (a row of a
// transaction that ran long may end a call early; the next one goes on). Rows another
// pruner is deleting at the same moment are skipped (SKIP LOCKED), so any number of
// reconcilers can prune side by side without waiting on each other. The statement is
// bounded by DefaultQueryTimeout and ctx.
//
// A pruned row's event_key is free again: an event committed again under the same key
// after its row was pruned is published again, and only the consumers' inbox or ledger
// (while it still remembers the key) recognises the replay. Keep olderThan shorter than
// the consumers' inbox retention and ledger TTL.
func PruneSent(ctx context.Context, pool *pgxpool.Pool, olderThan time.Duration, limit int) (int64, error) {
	return prune(ctx, pool, "PruneSent", `
DELETE FROM outbox WHERE id IN (
	SELECT o.id FROM outbox_positions p CROSS JOIN LATERAL (
		SELECT o.id, o.created_at FROM outbox o
		WHERE o.topic = p.topic AND (o.xid, o.id) <= (p.xid, p.id)
		ORDER BY o.xid, o.id
		LIMIT $2
		FOR UPDATE SKIP LOCKED) o
	WHERE o.created_at < now() - $1::interval
	LIMIT $2)`, olderThan, limit)
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
