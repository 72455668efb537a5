package handlers_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestUnsureStartReservationRaised: a window-budgeted kind's attempt start whose reply is
// lost lands late (TestLostStartReplyNoSelfTakeover's NextDelivery case), recording the
// first delivery's reservation R1 on the job's row. The next delivery on the worker
// reserves R2 > R1 in Redis (the kind's measured bytes grew) and starts with the first
// delivery's owner, which the store recognises as its own start and writes nothing. While
// that attempt runs, the row must record R2, what Redis charges if the worker is killed
// now; before, it kept R1, and a lost row (the source of a restored window total) would
// have under-counted by R2 - R1.
func TestUnsureStartReservationRaised(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	pool := r.st.Pool()
	via, proxy := poolDroppingCancels(t, pool)
	// 1000 USD/GB: one micro-unit per byte. An attempt may move 4 KiB; it reserves the
	// largest measured attempt (Percentile 1, Margin 1) once one is measured.
	priced, err := r.prov.WithPrice(sessions.Price{Currency: "USD", MicrosPerGB: 1_000_000_000})
	require.NoError(t, err)
	const r1, r2 = 100, 3000
	gate := newPriceGate(t, r.site.URL, 1) // holds the second delivery's attempt
	reg := gatedRegistry(t, r, gate.URL, func(c *handlers.Config) {
		c.Store, c.NoGroupCommit, c.Provider = store.New(via), true, priced
	}, handlers.WithRetry(handlers.RetryConfig{BandwidthBudget: 4 << 10}),
		handlers.WithWindowBudget(handlers.WindowBudget{Money: 1_000_000, Percentile: 1, Margin: 1, MinSamples: 1}))
	handlers.ObserveWindowBytes(reg, catalog.Kind, r1)
	key, task := r.job(t, "sku-1")
	reservedPG := func() int64 {
		var m int64
		require.NoError(t, pool.QueryRow(ctx, `SELECT attempt_reserved_micros FROM jobs WHERE key = $1`, key).Scan(&m))
		return m
	}
	wb, err := lua.NewWindowBudgets(r.ns.Client, r.ns.Prefix)
	require.NoError(t, err)

	// 1. The first delivery's start waits for the job's row (held here); its connection is
	// cut and stays refused until the delivery gave up.
	waiters := func() int {
		return testutil.Count(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
			AND wait_event_type = 'Lock' AND query LIKE '%AS t(key, token, worker, session_id%'`)
	}
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // ended below; a no-op then
	_, err = tx.Exec(ctx, `SELECT 1 FROM jobs WHERE key = $1 FOR UPDATE`, key)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- reg.ProcessTask(ctx, task) }()
	handlers.WaitUntil(t, "the attempt start waiting for the job's row", 10*time.Millisecond, func() bool { return waiters() == 1 })
	proxy.Refuse() // the reply is lost; PostgreSQL still holds the statement
	first := recv(t, done, "the first delivery giving up")
	require.Error(t, first)
	require.True(t, decisionOf(first).Retry, "the task is kept: %v", first)
	proxy.Accept()
	require.NoError(t, tx.Rollback(ctx)) // the first start lands now
	handlers.WaitUntil(t, "the first start landing late", 10*time.Millisecond, func() bool {
		j, err := r.st.JobGet(ctx, key)
		require.NoError(t, err)
		return j.State == tasks.StateRunning
	})
	require.Equal(t, int64(r1), reservedPG(), "the late start recorded the first delivery's reservation")
	_, reserved, _, err := wb.Spent(ctx, catalog.Kind, "2026-04-23")
	require.NoError(t, err)
	require.Zero(t, reserved, "the first delivery's reservation settled")

	// 2. The kind's attempts measure more now: the next delivery reserves R2 > R1, and
	// starts under the first delivery's owner (its own start, recognised).
	handlers.ObserveWindowBytes(reg, catalog.Kind, r2)
	go func() { done <- reg.ProcessTask(ctx, task) }()
	gate.waitHeld(t, 1) // the attempt runs: a worker killed now is charged its reservation
	_, reserved, _, err = wb.Spent(ctx, catalog.Kind, "2026-04-23")
	require.NoError(t, err)
	assert.Equal(t, int64(r2), reserved, "Redis holds the second delivery's reservation")
	assert.Equal(t, int64(r2), reservedPG(), "the job's row records the second delivery's reservation, as Redis does")
	gate.open()
	require.NoError(t, recv(t, done, "the second delivery"))

	var state string
	var fence int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT state, fence FROM jobs WHERE key = $1`, key).Scan(&state, &fence))
	assert.Equal(t, "complete", state)
	assert.Equal(t, int64(1), fence, "one start raised the fence: the first delivery's, recognised as its own")
	assert.Zero(t, testutil.Count(t, pool, `SELECT count(*) FROM attempts WHERE outcome = 'lost'`))
}
