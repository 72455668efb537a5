package store_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

func commitParams(key string, token int64) store.CommitParams {
	return store.CommitParams{
		Key: key, Token: token, ObservationKey: key, ParserVersion: 3,
		Data: json.RawMessage(`{"price":"19.99","currency":"USD"}`), Fingerprint: "sha256:abc",
		EventKey: "observed:" + key, Topic: "catalog", EventPayload: json.RawMessage(`{"key":"` + key + `"}`),
		HTTPStatus: 200, Bytes: 2048, SessionID: "abcd1234", ProxyEndpoint: "gw.example:7777",
	}
}

func TestCommit(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)

	t.Run("HappyPath", func(t *testing.T) {
		record(t, s, "c1")
		_, err := start(ctx, s, "c1", 3)
		require.NoError(t, err)

		listener, err := pool.Acquire(ctx)
		require.NoError(t, err)
		defer listener.Release()
		_, err = listener.Exec(ctx, "LISTEN "+store.OutboxNotifyChannel)
		require.NoError(t, err)

		res, err := s.Commit(ctx, commitParams("c1", 3))
		require.NoError(t, err)
		require.Equal(t, store.CommitResult{ResultInserted: true, EventInserted: true}, res)

		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		n, err := listener.Conn().WaitForNotification(wctx)
		require.NoError(t, err, "the commit notifies dispatchers")
		require.Equal(t, store.OutboxNotifyChannel, n.Channel)

		job, err := s.JobGet(ctx, "c1")
		require.NoError(t, err)
		require.Equal(t, tasks.StateComplete, job.State)
		require.Equal(t, int64(2048), job.BytesTotal)
		atts, err := s.AttemptList(ctx, "c1")
		require.NoError(t, err)
		require.Equal(t, store.OutcomeComplete, atts[0].Outcome)
		require.Equal(t, "abcd1234", atts[0].SessionID)
		require.Equal(t, 200, atts[0].HTTPStatus)
		require.Equal(t, 1, testutil.Count(t, pool, `SELECT count(*) FROM results WHERE job_key = 'c1' AND fence = 3`))
		require.Equal(t, 1, testutil.Count(t, pool, `SELECT count(*) FROM outbox WHERE event_key = 'observed:c1' AND sent_at IS NULL`))
	})

	t.Run("StaleTokenWritesNothing", func(t *testing.T) {
		record(t, s, "c2")
		_, err := start(ctx, s, "c2", 3)
		require.NoError(t, err)
		_, err = start(ctx, s, "c2", 4) // takeover
		require.NoError(t, err)
		before := map[string][]string{}
		for _, tbl := range []string{"jobs", "attempts", "results", "outbox"} {
			before[tbl] = testutil.TableSnapshot(t, pool, tbl)
		}
		_, err = s.Commit(ctx, commitParams("c2", 3))
		require.ErrorIs(t, err, store.ErrStaleFence)
		for tbl, rows := range before {
			require.Equal(t, rows, testutil.TableSnapshot(t, pool, tbl), "table %s changed", tbl)
		}
		_, err = s.Commit(ctx, commitParams("c2", 4))
		require.NoError(t, err)
		_, err = s.Commit(ctx, commitParams("c2", 4))
		require.ErrorIs(t, err, store.ErrJobComplete, "a second commit of the same attempt")
	})

	t.Run("DuplicateObservationRejected", func(t *testing.T) {
		// Two jobs that observe the same thing (e.g. a reparse): the second result write is
		// rejected by the unique index and reported, the job still completes.
		record(t, s, "c3")
		_, err := start(ctx, s, "c3", 1)
		require.NoError(t, err)
		p := commitParams("c3", 1)
		p.ObservationKey = "c1"
		res, err := s.Commit(ctx, p)
		require.NoError(t, err)
		require.False(t, res.ResultInserted)
		require.True(t, res.EventInserted)
	})

	t.Run("BadInputStoresNothing", func(t *testing.T) {
		record(t, s, "c4")
		_, err := start(ctx, s, "c4", 1)
		require.NoError(t, err)
		before := testutil.TableSnapshot(t, pool, "jobs")
		for name, mut := range map[string]func(*store.CommitParams){
			"ObservationKey": func(p *store.CommitParams) { p.ObservationKey = "" },
			"ParserVersion":  func(p *store.CommitParams) { p.ParserVersion = 0 },
			"Data":           func(p *store.CommitParams) { p.Data = json.RawMessage(`{"price":`) },
			"EventKey":       func(p *store.CommitParams) { p.EventKey = "" },
			"EventPayload":   func(p *store.CommitParams) { p.EventPayload = nil },
			"negative":       func(p *store.CommitParams) { p.Bytes = -1 },
			"token":          func(p *store.CommitParams) { p.Token = 0 },
			"NUL":            func(p *store.CommitParams) { p.Data = json.RawMessage(`{"title":"a\u0000b"}`) },
		} {
			p := commitParams("c4", 1)
			mut(&p)
			_, err := s.Commit(ctx, p)
			require.ErrorContains(t, err, name)
		}
		p := commitParams("c4", 1)
		p.ProxyEndpoint = "user:pw@gw:1" // refused by the table's CHECK: the whole statement rolls back
		_, err = s.Commit(ctx, p)
		require.Error(t, err)
		require.Equal(t, before, testutil.TableSnapshot(t, pool, "jobs"))
		require.Zero(t, testutil.Count(t, pool, `SELECT count(*) FROM results WHERE job_key = 'c4'`))
		require.Zero(t, testutil.Count(t, pool, `SELECT count(*) FROM outbox WHERE event_key = 'observed:c4'`))
	})

	t.Run("Quarantine", func(t *testing.T) {
		record(t, s, "c5")
		require.NoError(t, s.QuarantineInsert(ctx, store.QuarantineParams{
			Key: "c5", AttemptNo: 1, SessionID: "s1", Reason: "session_lost", Detail: "EOF at step product",
			Staged: json.RawMessage(`{"search":{"exit":"127.0.0.3"}}`),
		}))
		rows, err := pool.Query(ctx, `SELECT job_key, attempt_no, session_id, reason, staged, created_at FROM quarantine`)
		require.NoError(t, err)
		q, err := pgx.CollectExactlyOneRow(rows, pgx.RowToStructByName[store.Quarantined])
		require.NoError(t, err)
		require.Equal(t, "session_lost: EOF at step product", q.Reason)
		require.JSONEq(t, `{"search":{"exit":"127.0.0.3"}}`, string(q.Staged))
		require.ErrorContains(t, s.QuarantineInsert(ctx, store.QuarantineParams{Key: "c5", Reason: "x", Staged: json.RawMessage(`{`)}), "not valid JSON")
	})
}

// TestLostAttemptStartIsHarmless: JobStart commits without waiting for its WAL flush, so a
// crash can lose it. A lost start leaves the row as it was before; the worker that thinks
// it started then can not commit, because the commit requires fence = its token exactly.
func TestLostAttemptStartIsHarmless(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)
	record(t, s, "lost")
	_, err := start(ctx, s, "lost", 4)
	require.NoError(t, err)
	p := store.AttemptFinishParams{Key: "lost", Token: 4, NextAttemptAt: time.Now(), Category: "timeout"}
	require.NoError(t, s.JobMarkRetryable(ctx, p))
	before := testutil.TableSnapshot(t, pool, "jobs")
	var saved []byte
	require.NoError(t, pool.QueryRow(ctx, `SELECT to_jsonb(j) FROM jobs j WHERE key = 'lost'`).Scan(&saved))

	// The start with token 5 "happens" and is then lost in a crash: restore exactly the
	// row as it was before, as crash recovery would.
	_, err = start(ctx, s, "lost", 5)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `
UPDATE jobs SET (state, fence, attempts, next_attempt_at, last_category, bytes_total, updated_at, completed_at) =
	(SELECT state, fence, attempts, next_attempt_at, last_category, bytes_total, updated_at, completed_at
	 FROM jsonb_populate_record(NULL::jobs, $1))
WHERE key = 'lost'`, saved)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `DELETE FROM attempts WHERE job_key = 'lost' AND fence = 5`)
	require.NoError(t, err)
	require.Equal(t, before, testutil.TableSnapshot(t, pool, "jobs"))

	// The worker that holds token 5 finishes its work and commits: refused, nothing written.
	_, err = s.Commit(ctx, commitParams("lost", 5))
	require.ErrorIs(t, err, store.ErrInvalidTransition, "the job is not running under any token")
	require.Equal(t, before, testutil.TableSnapshot(t, pool, "jobs"))
	require.Zero(t, testutil.Count(t, pool, `SELECT count(*) FROM results`))
	require.Zero(t, testutil.Count(t, pool, `SELECT count(*) FROM outbox`))
	// Same if another worker has since started with a higher token.
	_, err = start(ctx, s, "lost", 6)
	require.NoError(t, err)
	_, err = s.Commit(ctx, commitParams("lost", 5))
	require.ErrorIs(t, err, store.ErrStaleFence)
	require.Zero(t, testutil.Count(t, pool, `SELECT count(*) FROM results`))
}

func TestStats(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)
	record(t, s, "s1")
	record(t, s, "s2")
	record(t, s, "s3")
	_, err := start(ctx, s, "s1", 1)
	require.NoError(t, err)
	require.NoError(t, s.JobMarkRetryable(ctx, store.AttemptFinishParams{Key: "s1", Token: 1, NextAttemptAt: time.Now(), Category: "throttled", Bytes: 100}))
	_, err = start(ctx, s, "s1", 2)
	require.NoError(t, err)
	_, err = start(ctx, s, "s1", 3) // takeover
	require.NoError(t, err)
	_, err = s.Commit(ctx, commitParams("s1", 3)) // 2048 bytes
	require.NoError(t, err)
	_, err = start(ctx, s, "s2", 1)
	require.NoError(t, err)
	require.NoError(t, s.JobFail(ctx, store.AttemptFinishParams{Key: "s2", Token: 1, Category: "proxy_auth", Bytes: 52}))

	st, err := s.StatsGet(ctx)
	require.NoError(t, err)
	require.Equal(t, map[string]int64{"complete": 1, "failed": 1, "pending": 1}, st.JobsByState)
	require.Equal(t, int64(4), st.Attempts)
	require.Equal(t, 3.0, st.AttemptsPerCompletedJob)
	require.Equal(t, int64(1), st.CompletedAfterTakeover)
	require.Equal(t, int64(1), st.SupersededAttempts)
	require.Equal(t, float64(100+2048+52)/2, st.BytesPerLogicalJob)
	require.Equal(t, map[string]int64{"throttled": 1}, st.RetriesByCategory)
	require.Equal(t, map[string]int64{"proxy_auth": 1}, st.FailuresByCategory)
	require.Equal(t, int64(1), st.OutboxUnsent)
}
