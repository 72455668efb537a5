package store_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/outbox"
	"github.com/idemscrape/idemscrape/testutil"
)

func statsOf(t *testing.T, s *store.PG) store.Stats {
	t.Helper()
	st, err := s.StatsGet(context.Background())
	require.NoError(t, err)
	_, inMaintenance := st.Maintenance[store.CounterDuplicateResults]
	assert.False(t, inMaintenance, "duplicate results are their own measure, not a maintenance action")
	return st
}

// TestDuplicateResultCounted: a commit whose result insert finds its observation key taken
// is counted in PostgreSQL by the commit statement itself (maintenance_counters
// duplicate_results), through Commit and through the group commit alike; a commit that
// inserts its result, and a fenced refusal (which writes nothing), count nothing.
func TestDuplicateResultCounted(t *testing.T) {
	ctx := context.Background()
	// setup records jobs a, b, c, d running under token 1, with a committed.
	setup := func(t *testing.T) *store.PG {
		s := store.New(testutil.PG(t))
		for _, k := range []string{"a", "b", "c", "d"} {
			record(t, s, k)
			_, err := start(ctx, s, k, 1)
			require.NoError(t, err)
		}
		res, err := s.Commit(ctx, commitParams("a", 1))
		require.NoError(t, err)
		require.True(t, res.ResultInserted)
		require.Zero(t, statsOf(t, s).DuplicateResultsRejected)
		return s
	}
	sameAsA := func(key string) store.CommitParams {
		p := commitParams(key, 1)
		p.ObservationKey = "a" // observed what a already committed
		return p
	}

	t.Run("Commit", func(t *testing.T) {
		s := setup(t)
		res, err := s.Commit(ctx, sameAsA("b"))
		require.NoError(t, err)
		assert.False(t, res.ResultInserted)
		assert.EqualValues(t, 1, statsOf(t, s).DuplicateResultsRejected)
		res, err = s.Commit(ctx, sameAsA("c"))
		require.NoError(t, err)
		assert.False(t, res.ResultInserted)
		res, err = s.Commit(ctx, commitParams("d", 1))
		require.NoError(t, err)
		assert.True(t, res.ResultInserted)
		assert.EqualValues(t, 2, statsOf(t, s).DuplicateResultsRejected, "two rejected, one inserted")
	})

	t.Run("GroupCommit", func(t *testing.T) {
		s := setup(t)
		// The committer is paused until the three commits below are queued, so they
		// share one statement.
		g := s.NewGroupCommitter(0, 3)
		t.Cleanup(g.Close)
		queued, release := pauseGroup(g)
		type out struct {
			res store.CommitResult
			err error
		}
		outs := make(chan out, 3)
		for _, p := range []store.CommitParams{sameAsA("b"), sameAsA("c"), commitParams("d", 1)} {
			go func() {
				res, err := g.Commit(ctx, p)
				outs <- out{res, err}
			}()
		}
		for range 3 {
			recv(t, queued, "a queued commit")
		}
		release()
		inserted := 0
		for range 3 {
			o := <-outs
			require.NoError(t, o.err)
			if o.res.ResultInserted {
				inserted++
			}
		}
		assert.Equal(t, 1, inserted)
		assert.EqualValues(t, 2, statsOf(t, s).DuplicateResultsRejected)
		// One batch statement wrote all three jobs and the counter (one transaction, one
		// xmin), not a fallback to three single commits.
		assert.Equal(t, 1, testutil.Count(t, s.Pool(), `SELECT count(DISTINCT xmin::text) FROM (
			SELECT xmin FROM jobs WHERE key IN ('b', 'c', 'd')
			UNION ALL SELECT xmin FROM maintenance_counters WHERE name = $1) x`, store.CounterDuplicateResults))
	})

	t.Run("RefusedCommitNotCounted", func(t *testing.T) {
		s := setup(t)
		_, err := start(ctx, s, "b", 2) // takeover: token 1 is stale now
		require.NoError(t, err)
		_, err = s.Commit(ctx, sameAsA("b"))
		require.ErrorIs(t, err, store.ErrStaleFence)
		assert.Zero(t, statsOf(t, s).DuplicateResultsRejected, "the fence refused it before any insert")
	})
}

// TestStatsSixMeasures: after a run with a lease takeover, a reconciler rescue, a timeout
// retry, a duplicate result write refused and an outbox replay recognised by a consumer's
// inbox, each of the six measures is non-zero, with the exact values the run implies.
func TestStatsSixMeasures(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	ns := testutil.Redis(t)
	s := store.New(pool)
	for _, k := range []string{"take", "rescued", "timeout", "dup"} {
		record(t, s, k)
	}
	commit := func(key string, token int64, obsKey string) store.CommitResult {
		t.Helper()
		p := commitParams(key, token) // 2048 bytes
		p.ObservationKey = obsKey
		res, err := s.Commit(ctx, p)
		require.NoError(t, err)
		return res
	}
	// Lease takeover: attempt 1 is superseded by attempt 2, which commits.
	_, err := start(ctx, s, "take", 1)
	require.NoError(t, err)
	_, err = start(ctx, s, "take", 2)
	require.NoError(t, err)
	commit("take", 2, "take")
	// Reconciler rescue (lease_expired), then a new attempt commits.
	_, err = start(ctx, s, "rescued", 1)
	require.NoError(t, err)
	require.NoError(t, s.JobRescue(ctx, store.JobRescueParams{Key: "rescued", ExpectFence: 1, Token: 2, Error: "lease expired"}))
	_, err = start(ctx, s, "rescued", 3)
	require.NoError(t, err)
	commit("rescued", 3, "rescued")
	// A timeout, retried.
	_, err = start(ctx, s, "timeout", 1)
	require.NoError(t, err)
	require.NoError(t, s.JobMarkRetryable(ctx, store.AttemptFinishParams{Key: "timeout", Token: 1, NextAttemptAt: time.Now(), Category: "timeout", Bytes: 500}))
	_, err = start(ctx, s, "timeout", 2)
	require.NoError(t, err)
	commit("timeout", 2, "timeout")
	// A duplicate result write: dup observed what take committed.
	_, err = start(ctx, s, "dup", 1)
	require.NoError(t, err)
	require.False(t, commit("dup", 1, "take").ResultInserted)

	// The outbox: dispatch the four events, consume them through an inbox, republish one
	// (a dispatcher crash between XADD and the mark), consume again.
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	d, err := outbox.NewDispatcher(pool, ns.Client, &outbox.DispatcherConfig{Prefix: ns.Prefix, Logger: log})
	require.NoError(t, err)
	dispatch := func(want int) {
		t.Helper()
		n, err := d.DispatchOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, want, n)
	}
	reports := make(chan outbox.BatchReport, 100)
	c, err := outbox.NewConsumer(ns.Client, &outbox.ConsumerConfig{Prefix: ns.Prefix, Topic: "catalog", Group: "g", Consumer: "c1",
		Block: 50 * time.Millisecond, Logger: log, OnBatch: func(r outbox.BatchReport) { reports <- r }})
	require.NoError(t, err)
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- c.RunTx(cctx, pool, func(context.Context, pgx.Tx, outbox.Event) error { return nil })
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("consumer: %v", err)
		}
	})
	var handled, dedup int
	waitReports := func(wantHandled, wantDedup int) {
		t.Helper()
		timeout := time.NewTimer(failSafe)
		defer timeout.Stop()
		for handled < wantHandled || dedup < wantDedup {
			select {
			case r := <-reports:
				handled += r.Handled
				dedup += r.Deduplicated
			case <-timeout.C:
				t.Fatalf("%s: consumer handled %d (want %d), deduplicated %d (want %d)",
					notWithin("the consumer's reports"), handled, wantHandled, dedup, wantDedup)
			}
		}
	}
	dispatch(4)
	waitReports(4, 0)
	// Replay observed:timeout alone: its topic's position moved back to just before it, a
	// batch of one, and the position put back.
	var pxid string
	var pid int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT xid::text, id FROM outbox_positions WHERE topic = 'catalog'`).Scan(&pxid, &pid))
	_, err = pool.Exec(ctx, `UPDATE outbox_positions p SET xid = o.xid, id = o.id - 1 FROM outbox o
		WHERE o.event_key = 'observed:timeout' AND p.topic = o.topic`)
	require.NoError(t, err)
	d1, err := outbox.NewDispatcher(pool, ns.Client, &outbox.DispatcherConfig{Prefix: ns.Prefix, BatchSize: 1, Logger: log})
	require.NoError(t, err)
	n, err := d1.DispatchOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	_, err = pool.Exec(ctx, `UPDATE outbox_positions SET xid = $1::xid8, id = $2 WHERE topic = 'catalog'`, pxid, pid)
	require.NoError(t, err)
	waitReports(4, 1)
	assert.Equal(t, 4, handled, "the replay did not reach the handler")

	st := statsOf(t, s)
	// 1. attempts per completed job: 2 + 2 + 2 + 1 attempts for 4 complete jobs.
	assert.Equal(t, 7.0/4, st.AttemptsPerCompletedJob)
	// 2. jobs completed after lease recovery: take (superseded) and rescued (lease_expired).
	assert.EqualValues(t, 2, st.CompletedAfterTakeover)
	// 3. duplicate result writes rejected.
	assert.EqualValues(t, 1, st.DuplicateResultsRejected)
	// 4. outbox events deduplicated downstream.
	assert.EqualValues(t, 1, st.OutboxReplaysDeduplicated)
	// 5. bytes per logical job: four commits of 2048 bytes, plus the timed-out attempt's 500.
	assert.Equal(t, float64(4*2048+500)/4, st.BytesPerLogicalJob)
	// 6. failure categories by retries caused.
	assert.Equal(t, map[string]int64{"superseded": 1, store.CategoryLeaseExpired: 1, "timeout": 1}, st.RetriesCausedByCategory)

	assert.EqualValues(t, 1, st.SupersededAttempts)
	assert.EqualValues(t, 1, st.LeaseExpiredAttempts)
	assert.EqualValues(t, 4, st.OutboxSent)
	assert.Zero(t, st.OutboxUnsent)
}
