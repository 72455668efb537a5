package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestAttemptCostRecorded: the commit, the failure record (lone and grouped) and a
// superseded worker's evidence each store the attempt's cost with its row; a bad cost is
// refused before anything is written, naming what is wrong.
func TestAttemptCostRecorded(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)
	costOf := func(key string, no int) store.Cost {
		t.Helper()
		atts, err := s.AttemptList(ctx, key)
		require.NoError(t, err)
		require.GreaterOrEqual(t, len(atts), no)
		return store.Cost{Micros: atts[no-1].CostMicros, Currency: atts[no-1].Currency}
	}
	usd := func(m int64) store.Cost { return store.Cost{Micros: m, Currency: "USD"} }

	record(t, s, "a")
	_, err := start(ctx, s, "a", 1)
	require.NoError(t, err)
	require.NoError(t, s.JobMarkRetryable(ctx, store.AttemptFinishParams{Key: "a", Token: 1, NextAttemptAt: time.Now(), Category: "throttled", Bytes: 10, Cost: usd(84)}))
	require.Equal(t, usd(84), costOf("a", 1))
	_, err = start(ctx, s, "a", 2)
	require.NoError(t, err)
	p := commitParams("a", 2)
	p.Cost = usd(17)
	g := s.NewGroupCommitter(0, 0)
	defer g.Close()
	_, err = g.Commit(ctx, p)
	require.NoError(t, err)
	require.Equal(t, usd(17), costOf("a", 2))

	// Taken over: the lost row costs 0 until its worker reports, then its cost, once.
	record(t, s, "b")
	_, err = start(ctx, s, "b", 1)
	require.NoError(t, err)
	_, err = start(ctx, s, "b", 2)
	require.NoError(t, err)
	require.Equal(t, store.Cost{}, costOf("b", 1))
	for range 2 {
		require.NoError(t, s.AttemptSupersede(ctx, store.AttemptSupersedeParams{Key: "b", Token: 1, Bytes: 5, Cost: store.Cost{Micros: 3, Currency: "EUR"}}))
	}
	require.Equal(t, store.Cost{Micros: 3, Currency: "EUR"}, costOf("b", 1))
	// No price: no cost, no currency.
	require.NoError(t, s.JobFail(ctx, store.AttemptFinishParams{Key: "b", Token: 2, Category: "parse_error", Bytes: 9}))
	require.Equal(t, store.Cost{}, costOf("b", 2))

	record(t, s, "bad")
	_, err = start(ctx, s, "bad", 1)
	require.NoError(t, err)
	before := testutil.TableSnapshot(t, pool, "jobs")
	for cost, want := range map[store.Cost]string{
		{Micros: -1, Currency: "USD"}: "cost -1 micro-units is negative",
		{Micros: 5}:                   "cost 5 micro-units has no currency",
		{Micros: 5, Currency: "usd"}:  `currency "usd" is not an ISO 4217 code`,
	} {
		err := s.JobMarkRetryable(ctx, store.AttemptFinishParams{Key: "bad", Token: 1, NextAttemptAt: time.Now(), Category: "x", Cost: cost})
		require.ErrorContains(t, err, want)
		require.ErrorContains(t, err, `"bad"`)
		bp := commitParams("bad", 1)
		bp.Cost = cost
		_, err = s.Commit(ctx, bp)
		require.ErrorContains(t, err, want)
		err = s.AttemptSupersede(ctx, store.AttemptSupersedeParams{Key: "bad", Token: 1, Cost: cost})
		require.ErrorContains(t, err, want)
	}
	require.Equal(t, before, testutil.TableSnapshot(t, pool, "jobs"), "nothing written")
}

// TestWindowCost: a window's cost is the sum of its kind's attempts in that window and
// currency, whatever their outcome; other windows, kinds and currencies stay out.
func TestWindowCost(t *testing.T) {
	ctx := context.Background()
	s := store.New(testutil.PG(t))
	usd := func(m int64) store.Cost { return store.Cost{Micros: m, Currency: "USD"} }
	got := func(kind, window, cur string) int64 {
		t.Helper()
		n, err := s.WindowCost(ctx, kind, window, cur)
		require.NoError(t, err)
		return n
	}
	require.Zero(t, got("catalog", "2026-04-23", "USD"))
	record(t, s, "a") // catalog, 2026-04-23
	_, err := start(ctx, s, "a", 1)
	require.NoError(t, err)
	require.NoError(t, s.JobMarkRetryable(ctx, store.AttemptFinishParams{Key: "a", Token: 1, NextAttemptAt: time.Now(), Category: "throttled", Bytes: 10, Cost: usd(84)}))
	_, err = start(ctx, s, "a", 2)
	require.NoError(t, err)
	require.Zero(t, got("catalog", "2026-04-23", "EUR"))
	require.EqualValues(t, 84, got("catalog", "2026-04-23", "USD"), "a running attempt costs nothing yet")
	p := commitParams("a", 2)
	p.Cost = usd(16)
	_, err = s.Commit(ctx, p)
	require.NoError(t, err)
	_, err = s.JobsRecord(ctx, []tasks.JobRecord{
		{Key: "other-window", Spec: tasks.Spec{Kind: "catalog", SourceID: "o", Country: "US", Window: "2026-04-24", ParserVersion: 3}},
		{Key: "other-kind", Spec: tasks.Spec{Kind: "offers", SourceID: "o", Country: "US", Window: "2026-04-23", ParserVersion: 3}},
	})
	require.NoError(t, err)
	for _, k := range []string{"other-window", "other-kind"} {
		_, err = start(ctx, s, k, 1)
		require.NoError(t, err)
		require.NoError(t, s.JobFail(ctx, store.AttemptFinishParams{Key: k, Token: 1, Category: "blocked", Bytes: 10, Cost: usd(1000)}))
	}
	require.EqualValues(t, 100, got("catalog", "2026-04-23", "USD"))
	require.EqualValues(t, 1000, got("catalog", "2026-04-24", "USD"))
	require.EqualValues(t, 1000, got("offers", "2026-04-23", "USD"))
}
