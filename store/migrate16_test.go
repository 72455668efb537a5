package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestMigration16DownUp: migration 00016 (the running attempt on the jobs row) goes down
// to the previous form and up again. Down gives a running attempt its row back (the
// previous version writes it at the start, and its reconciler lists running jobs by it)
// and turns 'lost' rows into what that version wrote; up copies a running attempt's row
// onto its job again.
func TestMigration16DownUp(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)
	record(t, s, "run")
	_, err := s.JobStart(ctx, store.AttemptStartParams{Key: "run", Token: 3, Worker: "w1", SessionID: "sess0001", ProxyEndpoint: "gw.example:7777"})
	require.NoError(t, err)
	record(t, s, "taken")
	_, err = start(ctx, s, "taken", 1)
	require.NoError(t, err)
	_, err = start(ctx, s, "taken", 2) // attempt 1 lost to a takeover
	require.NoError(t, err)
	record(t, s, "rescued")
	_, err = start(ctx, s, "rescued", 1)
	require.NoError(t, err)
	require.NoError(t, s.JobRescue(ctx, store.JobRescueParams{Key: "rescued", ExpectFence: 1, Token: 2}))
	record(t, s, "reported") // rescued, then its worker reported: superseded / lease_expired
	_, err = start(ctx, s, "reported", 1)
	require.NoError(t, err)
	require.NoError(t, s.JobRescue(ctx, store.JobRescueParams{Key: "reported", ExpectFence: 1, Token: 2}))
	require.NoError(t, s.AttemptSupersede(ctx, store.AttemptSupersedeParams{Key: "reported", Token: 1, Bytes: 10}))

	db := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { _ = db.Close() })
	p, err := goose.NewProvider(goose.DialectPostgres, db, store.Migrations(), goose.WithDisableGlobalRegistry(true))
	require.NoError(t, err)
	_, err = p.DownTo(ctx, 15)
	require.NoError(t, err)

	outcome := func(key string, no int) string {
		t.Helper()
		var o string
		require.NoError(t, pool.QueryRow(ctx, `SELECT outcome FROM attempts WHERE job_key = $1 AND attempt_no = $2`, key, no).Scan(&o))
		return o
	}
	assert.Equal(t, "running", outcome("run", 1), "the running attempt has its row again")
	assert.Equal(t, "running", outcome("taken", 2))
	assert.Equal(t, "superseded", outcome("taken", 1), "a takeover's lost row, as the previous version wrote it")
	assert.Equal(t, "retryable", outcome("rescued", 1), "a rescue's lost row, as the previous version wrote it")
	assert.Equal(t, "retryable", outcome("reported", 1), "a rescued attempt its worker reported, as the previous version kept it")
	assert.Equal(t, 1, testutil.Count(t, pool, `SELECT count(*) FROM attempts WHERE job_key = 'run' AND worker = 'w1' AND session_id = 'sess0001' AND fence = 3`))
	assert.Zero(t, testutil.Count(t, pool, `SELECT count(*) FROM information_schema.columns WHERE table_name = 'jobs' AND column_name LIKE 'attempt\_%'`))

	_, err = p.Up(ctx)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `DELETE FROM attempts WHERE job_key = 'run'`) // a row the previous version wrote, as before
	require.NoError(t, err)
	atts, err := s.AttemptList(ctx, "run")
	require.NoError(t, err)
	require.Len(t, atts, 1)
	assert.Equal(t, store.OutcomeRunning, atts[0].Outcome, "read from the jobs row, which up filled in again")
	assert.Equal(t, "w1", atts[0].Worker)
	assert.Equal(t, "sess0001", atts[0].SessionID)
}

// TestMigration17DownUp: the attempts' cost columns go with Down and come back, empty, with
// Up; the table refuses a cost without a currency or a currency that is not a code.
func TestMigration17DownUp(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)
	record(t, s, "paid")
	_, err := start(ctx, s, "paid", 1)
	require.NoError(t, err)
	require.NoError(t, s.JobMarkRetryable(ctx, store.AttemptFinishParams{Key: "paid", Token: 1, NextAttemptAt: time.Now(),
		Category: "timeout", Bytes: 1000, Cost: store.Cost{Micros: 8, Currency: "USD"}}))
	for _, bad := range []string{
		`UPDATE attempts SET cost_micros = 5, currency = NULL WHERE job_key = 'paid'`,
		`UPDATE attempts SET currency = 'usd' WHERE job_key = 'paid'`,
		`UPDATE attempts SET cost_micros = -1 WHERE job_key = 'paid'`,
	} {
		_, err := pool.Exec(ctx, bad)
		require.ErrorContains(t, err, "attempts_cost_valid", bad)
	}

	db := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { _ = db.Close() })
	p, err := goose.NewProvider(goose.DialectPostgres, db, store.Migrations(), goose.WithDisableGlobalRegistry(true))
	require.NoError(t, err)
	_, err = p.DownTo(ctx, 16)
	require.NoError(t, err)
	assert.Zero(t, testutil.Count(t, pool, `SELECT count(*) FROM information_schema.columns WHERE table_name = 'attempts' AND column_name IN ('cost_micros', 'currency')`))
	_, err = p.Up(ctx)
	require.NoError(t, err)
	atts, err := s.AttemptList(ctx, "paid")
	require.NoError(t, err)
	require.Len(t, atts, 1)
	assert.Equal(t, int64(0), atts[0].CostMicros)
	assert.Equal(t, "", atts[0].Currency)
}
