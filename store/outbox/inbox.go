package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// InboxPrune deletes up to limit outbox_inbox rows (of every group) seen more than
// olderThan ago and returns how many it deleted; call it until it returns less than
// limit. A replay of a pruned event would take effect again, so olderThan must exceed the
// longest time an event can be replayed after its first delivery (in practice: longer
// than streams are kept). The statement is bounded by DefaultQueryTimeout and ctx.
func InboxPrune(ctx context.Context, pool *pgxpool.Pool, olderThan time.Duration, limit int) (int64, error) {
	if olderThan <= 0 || limit <= 0 {
		return 0, errors.New("outbox: InboxPrune: olderThan and limit must be positive")
	}
	ctx, cancel := context.WithTimeout(ctx, DefaultQueryTimeout)
	defer cancel()
	tag, err := pool.Exec(ctx, `
DELETE FROM outbox_inbox WHERE ctid = ANY (ARRAY(
	SELECT ctid FROM outbox_inbox WHERE seen_at < now() - $1::interval LIMIT $2))`, olderThan, limit)
	if err != nil {
		return 0, fmt.Errorf("outbox: InboxPrune: %w", err)
	}
	return tag.RowsAffected(), nil
}
