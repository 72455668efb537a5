package outbox_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store/outbox"
)

// streamKeys lists the event keys in topic's stream, in stream order.
func streamKeys(t *testing.T, b *bundle, topic string) []string {
	t.Helper()
	msgs, err := b.rdb.XRange(context.Background(), outbox.StreamKey(b.prefix, topic), "-", "+").Result()
	require.NoError(t, err)
	keys := make([]string, 0, len(msgs))
	for _, m := range msgs {
		keys = append(keys, m.Values[outbox.FieldEventKey].(string))
	}
	return keys
}

func begin(t *testing.T, b *bundle) pgx.Tx {
	t.Helper()
	tx, err := b.pool.Begin(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return tx
}

func txExec(t *testing.T, tx pgx.Tx, sql string, args ...any) {
	t.Helper()
	_, err := tx.Exec(context.Background(), sql, args...)
	require.NoError(t, err, sql)
}

// TestCommitOrderBehindHorizon: a row whose transaction commits after a row with a later
// id was dispatched is still dispatched, once. Transaction A takes its id first (so its
// rows sort first), B inserts a row with a smaller id, A inserts one with a larger id and
// commits: A's row goes while B is open, B's row waits for B's commit and then goes too.
func TestCommitOrderBehindHorizon(t *testing.T) {
	const topic = "t"
	b := setup(t)
	ctx := context.Background()
	d := b.dispatcher(t, outbox.DispatcherConfig{Trim: outbox.TrimNever})

	a := begin(t, b)
	txExec(t, a, `SELECT pg_current_xact_id()`) // A's id is assigned first
	bt := begin(t, b)
	txExec(t, bt, `INSERT INTO outbox (event_key, topic, payload) VALUES ('b', $1, '{}')`, topic) // the smaller id
	txExec(t, a, `INSERT INTO outbox (event_key, topic, payload) VALUES ('a', $1, '{}')`, topic)
	require.NoError(t, a.Commit(ctx))

	var idA, idB int64
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT id FROM outbox WHERE event_key = 'a'`).Scan(&idA))
	require.NoError(t, bt.QueryRow(ctx, `SELECT id FROM outbox WHERE event_key = 'b'`).Scan(&idB))
	require.Less(t, idB, idA, "B's row has the smaller id")

	n, err := d.DispatchOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n, "A's row: its transaction is below the horizon")
	require.Equal(t, []string{"a"}, streamKeys(t, b, topic))

	require.NoError(t, bt.Commit(ctx)) // B commits after a row with a later id went
	require.Equal(t, 1, drain(t, d), "B's row is dispatched after all")
	require.Zero(t, drain(t, d))
	require.Equal(t, []string{"a", "b"}, streamKeys(t, b, topic), "each once")
	require.Zero(t, count(t, b.pool, `SELECT count(*) FROM outbox_unsent`))
}

// TestOpenWriteTransactionHoldsDispatch: a write transaction left open on this database
// holds back the dispatch of rows committed after it took its id (they might otherwise be
// joined behind the position by its own rows); dispatch resumes when it ends, however it
// ends. A transaction that writes nothing (no id) holds nothing back.
func TestOpenWriteTransactionHoldsDispatch(t *testing.T) {
	for _, end := range []string{"commit", "rollback"} {
		t.Run(end, func(t *testing.T) {
			const topic = "t"
			b := setup(t)
			ctx := context.Background()
			exec(t, b.pool, `CREATE TABLE side (n int)`)
			d := b.dispatcher(t, outbox.DispatcherConfig{Trim: outbox.TrimNever})
			insertEvents(t, b.pool, topic, 1, 3)
			require.Equal(t, 3, drain(t, d))

			reader := begin(t, b)
			txExec(t, reader, `SELECT count(*) FROM outbox`) // no id: holds nothing
			long := begin(t, b)
			txExec(t, long, `INSERT INTO side VALUES (1)`) // a write: it has an id now
			insertEvents(t, b.pool, topic, 4, 2)
			n, err := d.DispatchOnce(ctx)
			require.NoError(t, err)
			require.Zero(t, n, "held back by the open write transaction")
			rep, err := outbox.Lag(ctx, b.pool, 0)
			require.NoError(t, err)
			require.Equal(t, int64(2), rep.Unsent, "the lag report sees them waiting")

			if end == "commit" {
				require.NoError(t, long.Commit(ctx))
			} else {
				require.NoError(t, long.Rollback(ctx))
			}
			require.Equal(t, 2, drain(t, d), "dispatch resumes once it ended")
			require.Len(t, streamKeys(t, b, topic), 5)
			require.NoError(t, reader.Rollback(ctx))
		})
	}
}
