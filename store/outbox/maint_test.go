package outbox_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	ptu "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store/outbox"
	"github.com/idemscrape/idemscrape/testutil"
)

// outboxRows inserts n rows key<i> (i from 1) created createdAgo ago, dispatched (with
// every row before them: the position passes them) unless sentAgo is empty; row i is i
// seconds older than row i+1, so "oldest first" is observable. Retention counts from
// created_at: sentAgo only says whether they were dispatched.
func outboxRows(t *testing.T, b *bundle, key string, n int, createdAgo, sentAgo string) {
	t.Helper()
	exec(t, b.pool, `INSERT INTO outbox (event_key, topic, payload, created_at)
		SELECT $1 || g, 't', '{}', now() - $3::interval - make_interval(secs => $2 - g)
		FROM generate_series(1, $2::int) AS g`, key, n, createdAgo)
	if sentAgo != "" {
		markAllSent(t, b.pool) // dispatched: the position passes them (and every row before)
	}
}

func outboxKeys(t *testing.T, b *bundle) []string {
	t.Helper()
	rows, err := b.pool.Query(context.Background(), `SELECT event_key FROM outbox ORDER BY event_key`)
	require.NoError(t, err)
	keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return keys
}

func TestPruneSent(t *testing.T) {
	ctx := context.Background()
	const week = 7 * 24 * time.Hour

	t.Run("BoundedOldestFirstSentOnly", func(t *testing.T) {
		b := setup(t)
		outboxRows(t, b, "old:", 5, "9 days", "8 days")
		outboxRows(t, b, "recent:", 2, "2 hours", "1 hour")
		outboxRows(t, b, "unsent:", 3, "9 days", "")

		n, err := outbox.PruneSent(ctx, b.pool, week, 3)
		require.NoError(t, err)
		require.Equal(t, int64(3), n, "bounded by limit")
		assert.Equal(t, []string{"old:4", "old:5", "recent:1", "recent:2", "unsent:1", "unsent:2", "unsent:3"},
			outboxKeys(t, b), "the three sent longest ago go first")
		n, err = outbox.PruneSent(ctx, b.pool, week, 3)
		require.NoError(t, err)
		require.Equal(t, int64(2), n, "a short batch: done")
		n, err = outbox.PruneSent(ctx, b.pool, week, 3)
		require.NoError(t, err)
		require.Zero(t, n)
		assert.Equal(t, []string{"recent:1", "recent:2", "unsent:1", "unsent:2", "unsent:3"}, outboxKeys(t, b),
			"unsent rows are never pruned, however old; recent sent rows are kept")
	})

	t.Run("SkipsLockedRows", func(t *testing.T) {
		b := setup(t)
		outboxRows(t, b, "old:", 3, "9 days", "8 days")
		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck // the test ends here
		_, err = tx.Exec(ctx, `SELECT 1 FROM outbox WHERE event_key = 'old:1' FOR UPDATE`)
		require.NoError(t, err)
		// Waiting for the lock would block until the statement timeout and fail.
		n, err := outbox.PruneSent(ctx, b.pool, week, 10)
		require.NoError(t, err)
		assert.Equal(t, int64(2), n)
		assert.Equal(t, []string{"old:1"}, outboxKeys(t, b))
	})

	t.Run("ConcurrentPrunersDeleteEachRowOnce", func(t *testing.T) {
		b := setup(t)
		const rows, pruners, limit = 300, 4, 7
		outboxRows(t, b, "old:", rows, "9 days", "8 days")
		assert.Equal(t, int64(rows), pruneConcurrently(t, pruners, func() (int64, error) {
			return outbox.PruneSent(ctx, b.pool, week, limit)
		}))
		assert.Zero(t, testutil.Count(t, b.pool, `SELECT count(*) FROM outbox`))
	})

	t.Run("UsesPositionIndex", func(t *testing.T) {
		b := setup(t)
		conn, err := b.pool.Acquire(ctx)
		require.NoError(t, err)
		defer conn.Release()
		_, err = conn.Exec(ctx, `SET enable_seqscan = off`)
		require.NoError(t, err)
		defer conn.Exec(ctx, `RESET enable_seqscan`) //nolint:errcheck // connection-local, test ends
		exec(t, b.pool, `INSERT INTO outbox_positions (topic) VALUES ('t')`)
		rows, err := conn.Query(ctx, `EXPLAIN SELECT o.id FROM outbox_positions p CROSS JOIN LATERAL (
			SELECT o.id, o.created_at FROM outbox o WHERE o.topic = p.topic AND (o.xid, o.id) <= (p.xid, p.id)
			ORDER BY o.xid, o.id LIMIT 10 FOR UPDATE SKIP LOCKED) o WHERE o.created_at < now() - '7 days'::interval LIMIT 10`)
		require.NoError(t, err)
		plan, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		assert.Contains(t, strings.Join(plan, "\n"), "outbox_topic_xid_idx")
	})

	t.Run("BadArguments", func(t *testing.T) {
		b := setup(t)
		_, err := outbox.PruneSent(ctx, b.pool, 0, 10)
		assert.ErrorContains(t, err, "olderThan (0s)")
		_, err = outbox.PruneSent(ctx, b.pool, week, 0)
		assert.ErrorContains(t, err, "limit (0)")
	})
}

func TestLag(t *testing.T) {
	ctx := context.Background()

	t.Run("Empty", func(t *testing.T) {
		b := setup(t)
		rep, err := outbox.Lag(ctx, b.pool, time.Minute)
		require.NoError(t, err)
		assert.Equal(t, outbox.LagReport{}, rep)
	})

	t.Run("CountsUnsentPastThreshold", func(t *testing.T) {
		b := setup(t)
		outboxRows(t, b, "sent:", 4, "3 days", "3 days") // first: the position passes them
		outboxRows(t, b, "late:", 2, "2 hours", "")
		outboxRows(t, b, "fresh:", 1, "1 second", "")
		var oldest time.Time
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT created_at FROM outbox WHERE event_key = 'late:1'`).Scan(&oldest))

		rep, err := outbox.Lag(ctx, b.pool, time.Hour)
		require.NoError(t, err)
		assert.Equal(t, int64(2), rep.Unsent, "sent rows and rows younger than the threshold do not count")
		assert.True(t, oldest.Equal(rep.Oldest), "oldest: want %v, got %v", oldest, rep.Oldest)

		rep, err = outbox.Lag(ctx, b.pool, 0)
		require.NoError(t, err)
		assert.Equal(t, int64(3), rep.Unsent, "threshold 0: every unsent row")

		rep, err = outbox.Lag(ctx, b.pool, 24*time.Hour)
		require.NoError(t, err)
		assert.Equal(t, outbox.LagReport{}, rep)
	})

	t.Run("NegativeThreshold", func(t *testing.T) {
		b := setup(t)
		_, err := outbox.Lag(ctx, b.pool, -time.Second)
		assert.ErrorContains(t, err, "olderThan -1s is negative")
	})
}

func TestMaintainer(t *testing.T) {
	ctx := context.Background()
	b := setup(t)
	_, err := outbox.NewMaintainer(nil)
	require.Error(t, err)
	m, err := outbox.NewMaintainer(b.pool)
	require.NoError(t, err)

	outboxRows(t, b, "old:", 2, "9 days", "8 days")
	outboxRows(t, b, "late:", 1, "2 hours", "")
	exec(t, b.pool, `INSERT INTO outbox_inbox (consumer_group, event_key, seen_at)
		SELECT 'g', 'old:' || g, now() - interval '8 days' FROM generate_series(1, 2) AS g`)

	unsent, oldest, err := m.Lag(ctx, time.Hour)
	require.NoError(t, err)
	assert.Equal(t, int64(1), unsent)
	assert.False(t, oldest.IsZero())
	n, err := m.PruneSent(ctx, 7*24*time.Hour, 10)
	require.NoError(t, err)
	assert.Equal(t, int64(2), n)
	n, err = m.PruneInbox(ctx, 7*24*time.Hour, 10)
	require.NoError(t, err)
	assert.Equal(t, int64(2), n)
}

// TestConsumerInboxCountsReplays: RunTx records every replay it recognises on the event's
// inbox row (outbox_inbox.replays), so `idemscrape stats` can count the events deduplicated
// downstream from PostgreSQL; without the column (a database not migrated yet) consuming
// goes on and only the metric counts.
func TestConsumerInboxCountsReplays(t *testing.T) {
	ctx := context.Background()
	const (
		topic = "t"
		group = "g"
	)
	// consume runs a RunTx consumer until every entry of the stream is acknowledged and
	// returns the batches it reported.
	consume := func(t *testing.T, b *bundle, c *outbox.Consumer, batches chan outbox.BatchReport) []outbox.BatchReport {
		t.Helper()
		progress := make(chan struct{}, 1)
		var reports []outbox.BatchReport
		stop := runConsumer(t, func(ctx context.Context) error {
			return c.RunTx(ctx, b.pool, func(ctx context.Context, tx pgx.Tx, ev outbox.Event) error {
				_, err := tx.Exec(ctx, `INSERT INTO side_effects VALUES ($1)`, ev.EventKey)
				return err
			})
		})
		stream := outbox.StreamKey(b.prefix, topic)
		waitFor(t, 30*time.Second, progress, "every entry acknowledged", func() bool {
			for len(batches) > 0 {
				reports = append(reports, <-batches)
			}
			return groupDone(t, b.rdb, stream, group)
		})
		stop()
		for len(batches) > 0 {
			reports = append(reports, <-batches)
		}
		return reports
	}
	replay := func(t *testing.T, b *bundle, key string) {
		t.Helper()
		replayRow(t, b, key)
	}
	newConsumer := func(t *testing.T, b *bundle) (*outbox.Consumer, chan outbox.BatchReport) {
		batches := make(chan outbox.BatchReport, 100)
		return b.consumer(t, outbox.ConsumerConfig{Topic: topic, Group: group, Consumer: "c",
			Block: 50 * time.Millisecond, OnBatch: func(r outbox.BatchReport) { batches <- r }}), batches
	}
	replays := func(t *testing.T, b *bundle) map[string]int64 {
		t.Helper()
		rows, err := b.pool.Query(ctx, `SELECT event_key, replays FROM outbox_inbox WHERE consumer_group = $1`, group)
		require.NoError(t, err)
		out := map[string]int64{}
		var (
			k string
			n int64
		)
		_, err = pgx.ForEachRow(rows, []any{&k, &n}, func() error { out[k] = n; return nil })
		require.NoError(t, err)
		return out
	}

	t.Run("Counted", func(t *testing.T) {
		b := setup(t)
		// Until the store's migration adds it, the column is added here (IF NOT EXISTS: a
		// no-op once migrated).
		exec(t, b.pool, `ALTER TABLE outbox_inbox ADD COLUMN IF NOT EXISTS replays bigint NOT NULL DEFAULT 0`)
		exec(t, b.pool, `CREATE TABLE side_effects (event_key text PRIMARY KEY)`)
		b.publish(t, topic, 1, 3)
		c, batches := newConsumer(t, b)
		consume(t, b, c, batches)
		assert.Equal(t, map[string]int64{"ev:1": 0, "ev:2": 0, "ev:3": 0}, replays(t, b))

		// With the consumer down, ev:1 is republished three times and ev:2 once: one batch
		// holds four replays, three of them of the same event.
		replay(t, b, "ev:1")
		replay(t, b, "ev:1")
		replay(t, b, "ev:1")
		replay(t, b, "ev:2")
		dedup := 0
		for _, r := range consume(t, b, c, batches) {
			assert.Zero(t, r.Handled, "a replay must not reach the handler")
			dedup += r.Deduplicated
		}
		assert.Equal(t, 4, dedup)
		assert.Equal(t, map[string]int64{"ev:1": 3, "ev:2": 1, "ev:3": 0}, replays(t, b))
		assert.Equal(t, 4, count(t, b.pool, `SELECT sum(replays)::int FROM outbox_inbox`))
		assert.Equal(t, 4.0, ptu.ToFloat64(c.Metrics().Deduplicated.WithLabelValues(group)), "metric and table agree")
		assert.Equal(t, 3, count(t, b.pool, `SELECT count(*) FROM side_effects`))
	})

	t.Run("ColumnMissing", func(t *testing.T) {
		b := setup(t)
		exec(t, b.pool, `ALTER TABLE outbox_inbox DROP COLUMN IF EXISTS replays`)
		exec(t, b.pool, `CREATE TABLE side_effects (event_key text PRIMARY KEY)`)
		b.publish(t, topic, 1, 2)
		c, batches := newConsumer(t, b)
		consume(t, b, c, batches)
		replay(t, b, "ev:1")
		replay(t, b, "ev:2")
		dedup := 0
		for _, r := range consume(t, b, c, batches) {
			dedup += r.Deduplicated
			assert.Equal(t, r.Entries, r.Acked, "replays acknowledged although they could not be recorded")
		}
		assert.Equal(t, 2, dedup)
		assert.Equal(t, 2.0, ptu.ToFloat64(c.Metrics().Deduplicated.WithLabelValues(group)))
		assert.Equal(t, 2, count(t, b.pool, `SELECT count(*) FROM side_effects`))
	})
}

// TestInboxPruneConcurrent: pruners side by side skip each other's rows instead of waiting,
// delete each row once, and a row another transaction holds is left for later.
func TestInboxPruneConcurrent(t *testing.T) {
	ctx := context.Background()
	const week = 7 * 24 * time.Hour

	t.Run("SkipsLockedRows", func(t *testing.T) {
		b := setup(t)
		exec(t, b.pool, `INSERT INTO outbox_inbox (consumer_group, event_key, seen_at)
			SELECT 'g', 'old:' || g, now() - interval '8 days' FROM generate_series(1, 3) AS g`)
		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck // the test ends here
		_, err = tx.Exec(ctx, `SELECT 1 FROM outbox_inbox WHERE event_key = 'old:2' FOR UPDATE`)
		require.NoError(t, err)
		n, err := outbox.InboxPrune(ctx, b.pool, week, 10)
		require.NoError(t, err, "waiting for the lock would end in the statement timeout")
		assert.Equal(t, int64(2), n)
		require.NoError(t, tx.Rollback(ctx))
		n, err = outbox.InboxPrune(ctx, b.pool, week, 10)
		require.NoError(t, err)
		assert.Equal(t, int64(1), n, "the row is pruned once it is free")
	})

	t.Run("EachRowOnce", func(t *testing.T) {
		b := setup(t)
		const rows, pruners, limit = 300, 4, 7
		exec(t, b.pool, `INSERT INTO outbox_inbox (consumer_group, event_key, seen_at)
			SELECT 'g' || (g % 3), 'old:' || g, now() - interval '8 days' - make_interval(secs => g)
			FROM generate_series(1, $1::int) AS g`, rows)
		assert.Equal(t, int64(rows), pruneConcurrently(t, pruners, func() (int64, error) {
			return outbox.InboxPrune(ctx, b.pool, week, limit)
		}))
		assert.Zero(t, count(t, b.pool, `SELECT count(*) FROM outbox_inbox`))
	})

	t.Run("BadArguments", func(t *testing.T) {
		b := setup(t)
		_, err := outbox.InboxPrune(ctx, b.pool, -time.Second, 10)
		assert.ErrorContains(t, err, "olderThan (-1s)")
		_, err = outbox.InboxPrune(ctx, b.pool, week, -1)
		assert.ErrorContains(t, err, "limit (-1)")
	})
}

// pruneConcurrently runs prune from pruners goroutines at once, each until it prunes
// nothing or fails, and returns how many rows they pruned together (no error allowed).
func pruneConcurrently(t *testing.T, pruners int, prune func() (int64, error)) int64 {
	t.Helper()
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		total int64
		errs  []error
	)
	for range pruners {
		wg.Go(func() {
			for {
				n, err := prune()
				mu.Lock()
				total += n
				if err != nil {
					errs = append(errs, err)
				}
				mu.Unlock()
				if err != nil || n == 0 {
					return
				}
			}
		})
	}
	wg.Wait()
	require.Empty(t, errs)
	return total
}
