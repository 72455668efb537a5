package outbox_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/outbox"
)

// TestMigration20CarriesUnsentRows: rows written under the per-row sent mark (the schema
// before migration 00020) keep their state across it: the sent ones are behind the new
// positions, the unsent ones — older or newer than sent rows, in two topics — are
// dispatched, once, and a row inserted after the migration by a statement that does not
// name the xid column (as a worker of the previous version would) goes too. Down marks
// the dispatched rows sent again.
func TestMigration20CarriesUnsentRows(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	db := stdlib.OpenDBFromPool(b.pool)
	t.Cleanup(func() { _ = db.Close() })
	p, err := goose.NewProvider(goose.DialectPostgres, db, store.Migrations(), goose.WithDisableGlobalRegistry(true))
	require.NoError(t, err)
	_, err = p.DownTo(ctx, 19)
	require.NoError(t, err)
	require.Zero(t, count(t, b.pool, `SELECT count(*) FROM information_schema.columns WHERE table_name = 'outbox' AND column_name = 'xid'`))

	// The previous schema: t has sent rows before and after an unsent one; u has only sent
	// rows; v only unsent ones.
	exec(t, b.pool, `INSERT INTO outbox (event_key, topic, payload, sent_at) VALUES
		('t:1', 't', '{}', now()), ('t:2', 't', '{}', NULL), ('t:3', 't', '{}', now()), ('t:4', 't', '{}', NULL),
		('u:1', 'u', '{}', now()), ('u:2', 'u', '{}', now()),
		('v:1', 'v', '{}', NULL)`)
	_, err = p.Up(ctx)
	require.NoError(t, err)
	exec(t, b.pool, `INSERT INTO outbox (event_key, topic, payload) VALUES ('t:5', 't', '{}'), ('u:3', 'u', '{}')`)

	unsent := func() []string {
		t.Helper()
		rows, err := b.pool.Query(ctx, `SELECT event_key FROM outbox_unsent ORDER BY event_key`)
		require.NoError(t, err)
		var keys []string
		for rows.Next() {
			var k string
			require.NoError(t, rows.Scan(&k))
			keys = append(keys, k)
		}
		require.NoError(t, rows.Err())
		return keys
	}
	// t:3 was sent after t:2, the oldest unsent row of t: it goes once more (a copy).
	require.Equal(t, []string{"t:2", "t:3", "t:4", "t:5", "u:3", "v:1"}, unsent())

	d := b.dispatcher(t, outbox.DispatcherConfig{Trim: outbox.TrimNever})
	require.Equal(t, 6, drain(t, d))
	require.Empty(t, unsent())
	require.Equal(t, []string{"t:2", "t:3", "t:4", "t:5"}, streamKeys(t, b, "t"))
	require.Equal(t, []string{"u:3"}, streamKeys(t, b, "u"))
	require.Equal(t, []string{"v:1"}, streamKeys(t, b, "v"))

	_, err = p.DownTo(ctx, 19)
	require.NoError(t, err)
	require.Zero(t, count(t, b.pool, `SELECT count(*) FROM outbox WHERE sent_at IS NULL`), "down: the dispatched rows are marked sent")
	_, err = p.Up(ctx)
	require.NoError(t, err)
	require.Empty(t, unsent(), "and up again: nothing to send")
}
