package outbox_test

import (
	"context"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store/outbox"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestOutboxWriteCost logs what PostgreSQL writes per event for the outbox, from the
// commit's INSERT to the dispatch (pruning, one DELETE per row, is left out): row writes
// (n_tup_ins + n_tup_upd + n_tup_del of the outbox tables), index entries (each insert and
// each non-HOT update adds one to every index whose predicate the new row satisfies,
// counted from the statistics and the index definitions) and WAL bytes. On a server of its
// own (the WAL is the server's), so the figures do not depend on what else runs. Set
// OUTBOX_WRITE_COST=1 to run it.
func TestOutboxWriteCost(t *testing.T) {
	if os.Getenv("OUTBOX_WRITE_COST") == "" {
		t.Skip("set OUTBOX_WRITE_COST=1 to measure the outbox's write cost")
	}
	const events, perTx = 3000, 1 // one event per transaction, as the runner's commits
	ctx := context.Background()
	srv := testutil.StartPostgres(t)
	pool := srv.MigratedPool(t)
	ns := testutil.Redis(t)
	d, err := outbox.NewDispatcher(pool, ns.Client, &outbox.DispatcherConfig{Prefix: ns.Prefix, Logger: testLogger(), Trim: outbox.TrimNever})
	require.NoError(t, err)
	// The topic's epoch (and position) exist, as on a running system.
	exec(t, pool, `INSERT INTO outbox (event_key, topic, payload) VALUES ('warm', 'observed', '{}')`)
	drain(t, d)

	type stats struct{ rows, hot int64 }
	read := func() (s stats, lsn string) {
		t.Helper()
		exec(t, pool, `SELECT pg_stat_force_next_flush()`)
		require.NoError(t, pool.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&lsn))
		require.NoError(t, pool.QueryRow(ctx, `
SELECT COALESCE(sum(n_tup_ins + n_tup_upd + n_tup_del), 0)::bigint, COALESCE(sum(n_tup_hot_upd), 0)::bigint
FROM pg_stat_user_tables WHERE relname LIKE 'outbox%' AND relname <> 'outbox_inbox'`).Scan(&s.rows, &s.hot))
		return s, lsn
	}
	before, lsn0 := read()
	var insIdx int64
	for i := range events / perTx {
		_, err := pool.Exec(ctx, `INSERT INTO outbox (event_key, topic, payload) VALUES ('ev:' || $1::int, 'observed', '{"job_key":"k","fence":1}')`, i)
		require.NoError(t, err)
	}
	mid, lsn1 := read()
	require.Equal(t, events, drain(t, d))
	after, lsn2 := read()
	// Index entries: every index of outbox takes one per insert (outbox_unsent_idx: new
	// rows are unsent); a non-HOT update of the per-row mark takes one in every index
	// whose predicate the sent row satisfies (primary key, event_key, outbox_sent_at_idx).
	var nIdx, nIdxSent int64
	require.NoError(t, pool.QueryRow(ctx, `
SELECT count(*) FILTER (WHERE indexdef NOT LIKE '%sent_at IS NOT NULL%'),
	count(*) FILTER (WHERE indexdef NOT LIKE '%sent_at IS NULL%') FROM pg_indexes WHERE tablename = 'outbox'`).Scan(&nIdx, &nIdxSent))
	insIdx = int64(events) * nIdx
	var wal0, wal1 int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT pg_wal_lsn_diff($2::pg_lsn, $1::pg_lsn)::bigint, pg_wal_lsn_diff($3::pg_lsn, $2::pg_lsn)::bigint`, lsn0, lsn1, lsn2).Scan(&wal0, &wal1))
	disp := after.rows - mid.rows
	var updOutbox, hotOutbox int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'outbox'`).Scan(&updOutbox, &hotOutbox))
	dispIdx := (updOutbox - hotOutbox) * nIdxSent
	t.Logf("per event (%d events, one per transaction): insert: %.2f row writes, %.2f index entries, %.0f WAL bytes; dispatch: %.3f row writes, %.2f index entries, %.0f WAL bytes; total %.3f row writes, %.2f index entries, %.0f WAL bytes",
		events,
		float64(mid.rows-before.rows)/events, float64(insIdx)/events, float64(wal0)/events,
		float64(disp)/events, float64(dispIdx)/events, float64(wal1)/events,
		float64(after.rows-before.rows)/events, float64(insIdx+dispIdx)/events, float64(wal0+wal1)/events)
}
