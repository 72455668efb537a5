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

		wctx, cancel := context.WithTimeout(ctx, failSafe)
		defer cancel()
		n, err := listener.Conn().WaitForNotification(wctx)
		require.NoError(t, err, "the commit notifies dispatchers (load %s)", loadAvg())
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
		require.Equal(t, 1, testutil.Count(t, pool, `SELECT count(*) FROM outbox_unsent WHERE event_key = 'observed:c1'`))
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

	t.Run("EscapedNULTextAccepted", func(t *testing.T) {
		// Scraped inline JavaScript often holds the six characters \u0000; encoded, they are
		// `\\u0000`, which is no NUL and must commit.
		record(t, s, "c6")
		_, err := start(ctx, s, "c6", 1)
		require.NoError(t, err)
		p := commitParams("c6", 1)
		p.Data = json.RawMessage(`{"script":"s.split(\"\\u0000\")"}`)
		p.EventPayload = json.RawMessage(`{"note":"\\u0000"}`)
		_, err = s.Commit(ctx, p)
		require.NoError(t, err)
		var got string
		require.NoError(t, pool.QueryRow(ctx, `SELECT data->>'script' FROM results WHERE job_key = 'c6'`).Scan(&got))
		require.Equal(t, `s.split("\u0000")`, got, "the text survives as written")
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
	// A retryable attempt with no category (NULL): counted under StatsNoCategory, and it
	// does not break the whole query (jsonb_object_agg refuses a NULL key).
	_, err = start(ctx, s, "s3", 1)
	require.NoError(t, err)
	require.NoError(t, s.JobMarkRetryable(ctx, store.AttemptFinishParams{Key: "s3", Token: 1, NextAttemptAt: time.Now()}))
	require.NoError(t, s.CountersAdd(ctx, map[string]int64{"jobs_rescued": 2}))

	st, err := s.StatsGet(ctx)
	require.NoError(t, err)
	require.Equal(t, map[string]int64{"complete": 1, "failed": 1, "retryable": 1}, st.JobsByState)
	require.Equal(t, int64(5), st.Attempts)
	require.Equal(t, 3.0, st.AttemptsPerCompletedJob)
	require.Equal(t, int64(1), st.CompletedAfterTakeover)
	require.Equal(t, int64(1), st.SupersededAttempts)
	require.Equal(t, float64(100+2048+52)/2, st.BytesPerLogicalJob)
	require.Equal(t, map[string]int64{"throttled": 1, store.StatsNoCategory: 1}, st.RetriesByCategory)
	require.Equal(t, map[string]int64{"proxy_auth": 1}, st.FailuresByCategory)
	require.Equal(t, int64(1), st.OutboxUnsent)
	require.Equal(t, map[string]int64{"jobs_rescued": 2}, st.Maintenance)

	// A failed job without category (written by an older version) is counted the same way.
	_, err = pool.Exec(ctx, `UPDATE jobs SET last_category = NULL WHERE key = 's2'`)
	require.NoError(t, err)
	st, err = s.StatsGet(ctx)
	require.NoError(t, err)
	require.Equal(t, map[string]int64{store.StatsNoCategory: 1}, st.FailuresByCategory)
}

// TestAttemptEvidence: every way an attempt ends records the evidence it is given: the
// retryable and failed finishes and the commit (alone and batched) write the session, the
// HTTP status and the bytes from their params, not a fixed value.
func TestAttemptEvidence(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)
	g := s.NewGroupCommitter(0, 0)
	defer g.Close()

	type ev struct {
		Outcome, Category, SessionID, ProxyEndpoint string
		HTTPStatus                                  int
		Bytes, JobBytes                             int64
	}
	got := func(key string) ev {
		atts, err := s.AttemptList(ctx, key)
		require.NoError(t, err)
		require.Len(t, atts, 1)
		a := atts[0]
		require.NotNil(t, a.FinishedAt)
		return ev{a.Outcome, a.Category, a.SessionID, a.ProxyEndpoint, a.HTTPStatus, a.Bytes, view(t, s, key).Bytes}
	}
	fin := func(key string) store.AttemptFinishParams {
		return store.AttemptFinishParams{Key: key, Token: 1, NextAttemptAt: time.Now(), Category: "throttled",
			HTTPStatus: 429, Bytes: 321, SessionID: "sessr001", ProxyEndpoint: "gw9.example:1"}
	}
	cases := []struct {
		name string
		do   func(key string) error
		want ev
	}{
		{"Retryable", func(key string) error { return s.JobMarkRetryable(ctx, fin(key)) },
			ev{"retryable", "throttled", "sessr001", "gw9.example:1", 429, 321, 321}},
		{"Failed", func(key string) error {
			p := fin(key)
			p.Category, p.HTTPStatus = "parse_error", 404
			return s.JobFail(ctx, p)
		}, ev{"failed", "parse_error", "sessr001", "gw9.example:1", 404, 321, 321}},
		{"RetryableNoStatusKeepsStartEvidence", func(key string) error {
			p := fin(key)
			p.HTTPStatus, p.SessionID, p.ProxyEndpoint = 0, "", ""
			return s.JobMarkRetryable(ctx, p)
		}, ev{"retryable", "throttled", "", "gw.example:7777", 0, 321, 321}},
		{"Commit", func(key string) error {
			p := commitParams(key, 1)
			p.HTTPStatus = 206
			_, err := s.Commit(ctx, p)
			return err
		}, ev{"complete", "", "abcd1234", "gw.example:7777", 206, 2048, 2048}},
		{"GroupCommit", func(key string) error {
			p := commitParams(key, 1)
			p.HTTPStatus, p.Bytes = 203, 99
			_, err := g.Commit(ctx, p)
			return err
		}, ev{"complete", "", "abcd1234", "gw.example:7777", 203, 99, 99}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			key := "ev-" + tc.name
			record(t, s, key)
			_, err := start(ctx, s, key, 1)
			require.NoError(t, err)
			require.NoError(t, tc.do(key))
			require.Equal(t, tc.want, got(key))
		})
	}
}
