package outbox

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// InboxPrune deletes up to limit outbox_inbox rows (of every group) seen more than
// olderThan ago, oldest first, and returns how many it deleted; call it until it returns
// less than limit. Rows locked by someone else (another pruner, a consumer recording a
// replay) are skipped, not waited for (SKIP LOCKED): pruners running side by side take
// disjoint batches, so a short batch means no old row was free. A replay of a pruned
// event would take effect again, so olderThan must exceed the longest time an event can be
// replayed after its first delivery (in practice: longer than streams are kept). The
// statement walks the index outbox_inbox_seen_at_idx (migration 00002) and is bounded by
// DefaultQueryTimeout and ctx.
func InboxPrune(ctx context.Context, pool *pgxpool.Pool, olderThan time.Duration, limit int) (int64, error) {
	return prune(ctx, pool, "InboxPrune", `
DELETE FROM outbox_inbox WHERE (consumer_group, event_key) IN (
	SELECT consumer_group, event_key FROM outbox_inbox
	WHERE seen_at < now() - $1::interval
	ORDER BY seen_at
	LIMIT $2
	FOR UPDATE SKIP LOCKED)`, olderThan, limit)
}
