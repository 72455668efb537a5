package store_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

func record(t *testing.T, s *store.PG, key string) tasks.JobRecordResult {
	t.Helper()
	res, err := s.JobsRecord(context.Background(), []tasks.JobRecord{{
		Key:  key,
		Spec: tasks.Spec{Kind: "catalog", SourceID: key, Country: "US", Window: "2026-04-23", ParserVersion: 3},
	}})
	require.NoError(t, err)
	require.Len(t, res, 1)
	return res[0]
}

func start(ctx context.Context, s *store.PG, key string, token int64) (int, error) {
	a, err := s.JobStart(ctx, store.AttemptStartParams{Key: key, Token: token, Worker: "w1", Country: "US", ProxyEndpoint: "gw.example:7777"})
	return a.AttemptNo, err
}

func finish(key string, token int64) store.AttemptFinishParams {
	return store.AttemptFinishParams{Key: key, Token: token, Bytes: 100, HTTPStatus: 200}
}

type jobView struct {
	State    tasks.JobState
	Fence    int64
	Attempts int
	Category string
	Bytes    int64
}

func view(t *testing.T, s *store.PG, key string) jobView {
	t.Helper()
	j, err := s.JobGet(context.Background(), key)
	require.NoError(t, err)
	return jobView{State: j.State, Fence: j.Fence, Attempts: j.Attempts, Category: j.LastCategory, Bytes: j.BytesTotal}
}

func outcomes(t *testing.T, s *store.PG, key string) []string {
	t.Helper()
	atts, err := s.AttemptList(context.Background(), key)
	require.NoError(t, err)
	var out []string
	for _, a := range atts {
		out = append(out, a.Outcome)
	}
	return out
}

func TestTransitions(t *testing.T) {
	ctx := context.Background()
	s := store.New(testutil.PG(t))

	t.Run("Allowed", func(t *testing.T) {
		const key = "allowed"
		got := record(t, s, key)
		require.Equal(t, tasks.JobRecordResult{Key: key, Created: true, State: tasks.StatePending}, got)
		got = record(t, s, key)
		require.Equal(t, tasks.JobRecordResult{Key: key, Created: false, State: tasks.StatePending}, got, "recording twice must not create")

		steps := []struct {
			name string
			do   func() error
			want jobView
			outs []string
		}{
			{"pending→running", func() error { n, err := start(ctx, s, key, 5); require.Equal(t, 1, n); return err },
				jobView{tasks.StateRunning, 5, 1, "", 0}, []string{"running"}},
			{"running→retryable", func() error {
				p := finish(key, 5)
				p.Category, p.NextAttemptAt = "timeout", time.Now().Add(time.Minute)
				return s.JobMarkRetryable(ctx, p)
			}, jobView{tasks.StateRetryable, 5, 1, "timeout", 100}, []string{"retryable"}},
			{"retryable→running", func() error { n, err := start(ctx, s, key, 6); require.Equal(t, 2, n); return err },
				jobView{tasks.StateRunning, 6, 2, "timeout", 100}, []string{"retryable", "running"}},
			{"running→running takeover with higher token", func() error { n, err := start(ctx, s, key, 9); require.Equal(t, 3, n); return err },
				jobView{tasks.StateRunning, 9, 3, "timeout", 100}, []string{"retryable", "lost", "running"}},
			{"running→complete", func() error { return s.JobComplete(ctx, finish(key, 9)) },
				jobView{tasks.StateComplete, 9, 3, "", 200}, []string{"retryable", "lost", "complete"}},
		}
		for _, st := range steps {
			require.NoError(t, st.do(), st.name)
			if diff := cmp.Diff(st.want, view(t, s, key)); diff != "" {
				t.Fatalf("%s: job (-want +got):\n%s", st.name, diff)
			}
			if diff := cmp.Diff(st.outs, outcomes(t, s, key)); diff != "" {
				t.Fatalf("%s: attempt outcomes (-want +got):\n%s", st.name, diff)
			}
		}
		j, err := s.JobGet(ctx, key)
		require.NoError(t, err)
		require.NotNil(t, j.CompletedAt)
		require.Nil(t, j.NextAttemptAt, "a running/complete job has no next attempt time")

		const failKey = "allowed-fail"
		record(t, s, failKey)
		_, err = start(ctx, s, failKey, 1)
		require.NoError(t, err)
		p := finish(failKey, 1)
		p.Category, p.Error = "proxy_auth", "proxy answered 407"
		require.NoError(t, s.JobFail(ctx, p))
		require.Equal(t, jobView{tasks.StateFailed, 1, 1, "proxy_auth", 100}, view(t, s, failKey))
		atts, err := s.AttemptList(ctx, failKey)
		require.NoError(t, err)
		require.Equal(t, "proxy answered 407", atts[0].Error)
	})

	t.Run("Refused", func(t *testing.T) {
		// Fixture: one job per state, each with a known fence.
		record(t, s, "r-pending")
		record(t, s, "r-running")
		_, err := start(ctx, s, "r-running", 7)
		require.NoError(t, err)
		record(t, s, "r-retryable")
		_, err = start(ctx, s, "r-retryable", 3)
		require.NoError(t, err)
		p := finish("r-retryable", 3)
		p.NextAttemptAt, p.Category = time.Now().Add(time.Hour), "throttled"
		require.NoError(t, s.JobMarkRetryable(ctx, p))
		record(t, s, "r-complete")
		_, err = start(ctx, s, "r-complete", 4)
		require.NoError(t, err)
		require.NoError(t, s.JobComplete(ctx, finish("r-complete", 4)))
		record(t, s, "r-failed")
		_, err = start(ctx, s, "r-failed", 2)
		require.NoError(t, err)
		p = finish("r-failed", 2)
		p.Category = "parse_error"
		require.NoError(t, s.JobFail(ctx, p))

		retry := func(key string, token int64) error {
			p := finish(key, token)
			p.NextAttemptAt, p.Category = time.Now().Add(time.Minute), "timeout"
			return s.JobMarkRetryable(ctx, p)
		}
		fail := func(key string, token int64) error {
			p := finish(key, token)
			p.Category = "validation"
			return s.JobFail(ctx, p)
		}
		startErr := func(key string, token int64) error { _, err := start(ctx, s, key, token); return err }

		cases := []struct {
			name string
			do   func() error
			want error
		}{
			{"complete→running", func() error { return startErr("r-complete", 100) }, store.ErrJobComplete},
			{"complete→retryable (retry overwrites result)", func() error { return retry("r-complete", 4) }, store.ErrJobComplete},
			{"complete→failed", func() error { return fail("r-complete", 4) }, store.ErrJobComplete},
			{"complete→complete again", func() error { return s.JobComplete(ctx, finish("r-complete", 4)) }, store.ErrJobComplete},
			{"failed→running", func() error { return startErr("r-failed", 100) }, store.ErrJobFailed},
			{"failed→complete", func() error { return s.JobComplete(ctx, finish("r-failed", 2)) }, store.ErrJobFailed},
			{"running, complete with older token", func() error { return s.JobComplete(ctx, finish("r-running", 6)) }, store.ErrStaleFence},
			{"running, complete with newer token", func() error { return s.JobComplete(ctx, finish("r-running", 8)) }, store.ErrStaleFence},
			{"running, retryable with wrong token", func() error { return retry("r-running", 1) }, store.ErrStaleFence},
			{"running, fail with wrong token", func() error { return fail("r-running", 70) }, store.ErrStaleFence},
			{"running, start with equal token", func() error { return startErr("r-running", 7) }, store.ErrStaleFence},
			{"running, start with lower token", func() error { return startErr("r-running", 6) }, store.ErrStaleFence},
			{"retryable, start with token not above fence", func() error { return startErr("r-retryable", 3) }, store.ErrStaleFence},
			{"pending→complete (no attempt)", func() error { return s.JobComplete(ctx, finish("r-pending", 0)) }, store.ErrInvalidTransition},
			{"pending→retryable", func() error { return retry("r-pending", 0) }, store.ErrInvalidTransition},
			{"retryable→complete (skips running)", func() error { return s.JobComplete(ctx, finish("r-retryable", 3)) }, store.ErrInvalidTransition},
			{"retryable→failed", func() error { return fail("r-retryable", 3) }, store.ErrInvalidTransition},
			{"unknown key start", func() error { return startErr("r-nope", 1) }, store.ErrJobNotFound},
			{"unknown key complete", func() error { return s.JobComplete(ctx, finish("r-nope", 1)) }, store.ErrJobNotFound},
		}
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				jobsBefore := testutil.TableSnapshot(t, s.Pool(), "jobs")
				attemptsBefore := testutil.TableSnapshot(t, s.Pool(), "attempts")
				err := tc.do()
				require.ErrorIs(t, err, tc.want)
				var te *store.TransitionError
				require.True(t, errors.As(err, &te), "want *store.TransitionError, got %T: %v", err, err)
				require.NotEmpty(t, te.Op)
				if diff := cmp.Diff(jobsBefore, testutil.TableSnapshot(t, s.Pool(), "jobs")); diff != "" {
					t.Fatalf("refused transition changed jobs (-before +after):\n%s", diff)
				}
				if diff := cmp.Diff(attemptsBefore, testutil.TableSnapshot(t, s.Pool(), "attempts")); diff != "" {
					t.Fatalf("refused transition changed attempts (-before +after):\n%s", diff)
				}
			})
		}
	})

	t.Run("BadInputStoresNothing", func(t *testing.T) {
		record(t, s, "bad-input")
		jobsBefore := testutil.TableSnapshot(t, s.Pool(), "jobs")
		// A proxy endpoint carrying credentials is refused by the table itself.
		_, err := s.JobStart(ctx, store.AttemptStartParams{Key: "bad-input", Token: 1, ProxyEndpoint: "user:secret@gw.example:7777"})
		require.Error(t, err)
		require.NotContains(t, err.Error(), "secret")
		_, err = s.JobStart(ctx, store.AttemptStartParams{Key: "bad-input", Token: -1})
		require.ErrorContains(t, err, "token -1 is negative")
		err = s.JobMarkRetryable(ctx, store.AttemptFinishParams{Key: "bad-input", Token: 1})
		require.ErrorContains(t, err, "NextAttemptAt")
		err = s.JobFail(ctx, store.AttemptFinishParams{Key: "bad-input", Token: 1})
		require.ErrorContains(t, err, "Category")
		require.Equal(t, jobsBefore, testutil.TableSnapshot(t, s.Pool(), "jobs"))
		require.Zero(t, testutil.Count(t, s.Pool(), `SELECT count(*) FROM attempts WHERE job_key = 'bad-input'`))
	})
}

func TestJobsRecordBatch(t *testing.T) {
	ctx := context.Background()
	s := store.New(testutil.PG(t))
	rec := func(key string) tasks.JobRecord {
		return tasks.JobRecord{Key: key, Spec: tasks.Spec{Kind: "catalog", SourceID: key, Country: "US", Window: "w", ParserVersion: 1}}
	}
	record(t, s, "old")
	res, err := s.JobsRecord(ctx, []tasks.JobRecord{rec("a"), rec("a"), rec("old"), rec("b"), rec("a"), rec("c")})
	require.NoError(t, err)
	var got []string
	for _, r := range res {
		got = append(got, fmt.Sprintf("%s:%v:%s", r.Key, r.Created, r.State))
	}
	want := []string{"a:true:pending", "a:false:pending", "old:false:pending", "b:true:pending", "a:false:pending", "c:true:pending"}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("results (-want +got):\n%s", diff)
	}
	require.Equal(t, 4, testutil.Count(t, s.Pool(), `SELECT count(*) FROM jobs`))
	_, err = s.JobsRecord(ctx, []tasks.JobRecord{rec("d"), {Spec: rec("e").Spec}})
	require.ErrorContains(t, err, "empty key")
	require.Zero(t, testutil.Count(t, s.Pool(), `SELECT count(*) FROM jobs WHERE key = 'd'`), "a bad batch stores nothing")
}

func TestJobsRecordConcurrent(t *testing.T) {
	ctx := context.Background()
	s := store.New(testutil.PG(t))
	const workers = 32
	type outcome struct {
		res []tasks.JobRecordResult
		err error
	}
	out := make(chan outcome, workers)
	spec := tasks.Spec{Kind: "catalog", SourceID: "same", Country: "US", Window: "w", ParserVersion: 1}
	for i := 0; i < workers; i++ {
		go func() {
			res, err := s.JobsRecord(ctx, []tasks.JobRecord{{Key: "same", Spec: spec}, {Key: "same", Spec: spec}})
			out <- outcome{res, err}
		}()
	}
	created := 0
	for i := 0; i < workers; i++ {
		o := <-out
		require.NoError(t, o.err)
		require.False(t, o.res[1].Created, "second occurrence of a key in one call reported Created")
		require.Equal(t, tasks.StatePending, o.res[0].State)
		if o.res[0].Created {
			created++
		}
	}
	require.Equal(t, 1, created, "exactly one caller creates the row")
	require.Equal(t, 1, testutil.Count(t, s.Pool(), `SELECT count(*) FROM jobs`))
}

// TestRefusalSeesConcurrentWriter: a start that waited for a concurrent writer's lock is
// refused for what the row became, not for the snapshot the statement began with.
func TestRefusalSeesConcurrentWriter(t *testing.T) {
	ctx := context.Background()
	s := store.New(testutil.PG(t))
	record(t, s, "k")
	_, err := start(ctx, s, "k", 5)
	require.NoError(t, err)
	tx, err := s.Pool().Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // committed below
	_, err = tx.Exec(ctx, `UPDATE jobs SET state = 'complete', completed_at = now() WHERE key = 'k'`)
	require.NoError(t, err)
	errc := make(chan error, 1)
	go func() { _, err := start(ctx, s, "k", 6); errc <- err }()
	// Wait until the start is blocked on the row lock.
	waitUntil(t, "the start blocked on the row lock", func() bool {
		return testutil.Count(t, s.Pool(), `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`) == 1
	})
	require.NoError(t, tx.Commit(ctx))
	err = recv(t, errc, "the start's answer")
	require.ErrorIs(t, err, store.ErrJobComplete)
	var te *store.TransitionError
	require.ErrorAs(t, err, &te)
	require.Equal(t, tasks.StateComplete, te.State)
}

// TestMigrateConcurrent: every worker migrates at start; many at once on an empty database
// all succeed, and the schema is applied exactly once.
func TestMigrateConcurrent(t *testing.T) {
	ctx := context.Background()
	admin, err := pgx.Connect(ctx, testutil.PGAdminDSN())
	require.NoError(t, err)
	defer admin.Close(ctx)
	name := "idemscrape_m_" + testutil.RandomID(6)
	_, err = admin.Exec(ctx, "CREATE DATABASE "+name)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = admin.Exec(context.Background(), "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)") })
	cfg, err := pgxpool.ParseConfig(testutil.PGAdminDSN())
	require.NoError(t, err)
	cfg.ConnConfig.Database = name
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer pool.Close()

	const workers = 4
	applied := make([][]int64, workers)
	errs := make([]error, workers)
	var wg sync.WaitGroup
	for i := 0; i < workers; i++ {
		wg.Add(1)
		go func() { defer wg.Done(); applied[i], errs[i] = store.Migrate(ctx, pool, nil) }()
	}
	wg.Wait()
	total := 0
	for i := range errs {
		require.NoError(t, errs[i])
		total += len(applied[i])
	}
	migrations, err := fs.Glob(store.Migrations(), "*.sql")
	require.NoError(t, err)
	require.NotEmpty(t, migrations)
	require.Equal(t, len(migrations), total, "each migration applied once across all workers")
	_, err = store.New(pool).JobsRecord(ctx, []tasks.JobRecord{{Key: "k", Spec: tasks.Spec{Kind: "k", SourceID: "k", Country: "US", Window: "w", ParserVersion: 1}}})
	require.NoError(t, err, "the schema works")
}

// TestSchemaFingerprints: a fingerprint is stored once per kind and parser version (a
// known one only refreshed), read back most recently seen first; bad input is refused
// with an error naming it, and nothing is stored.
func TestSchemaFingerprints(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)
	a, b := json.RawMessage(`{"selectors":[{"selector":"h1","count":1}]}`), json.RawMessage(`{"selectors":[{"selector":"h2","count":2}]}`)
	require.NoError(t, s.SchemaFingerprintRecord(ctx, "shop", 1, a))
	require.NoError(t, s.SchemaFingerprintRecord(ctx, "shop", 1, b))
	require.NoError(t, s.SchemaFingerprintRecord(ctx, "shop", 2, a))
	_, err := pool.Exec(ctx, `UPDATE schema_fingerprints SET last_seen = now() - interval '1 hour'`)
	require.NoError(t, err)
	require.NoError(t, s.SchemaFingerprintRecord(ctx, "shop", 1, a)) // seen again: most recent
	got, err := s.SchemaFingerprintsRecent(ctx, "shop", 1, 10)
	require.NoError(t, err)
	require.Len(t, got, 2)
	require.JSONEq(t, string(a), string(got[0]))
	require.JSONEq(t, string(b), string(got[1]))
	got, err = s.SchemaFingerprintsRecent(ctx, "shop", 1, 1)
	require.NoError(t, err)
	require.Len(t, got, 1)
	got, err = s.SchemaFingerprintsRecent(ctx, "other", 1, 10)
	require.NoError(t, err)
	require.Empty(t, got)

	require.ErrorContains(t, s.SchemaFingerprintRecord(ctx, "", 1, a), "kind is empty")
	require.ErrorContains(t, s.SchemaFingerprintRecord(ctx, "shop", 0, a), "parser version 0")
	require.ErrorContains(t, s.SchemaFingerprintRecord(ctx, "shop", 1, json.RawMessage(`[1]`)), "not a JSON object")
	require.ErrorContains(t, s.SchemaFingerprintRecord(ctx, "shop", 1, json.RawMessage(`{`)), "not a JSON object")
	_, err = s.SchemaFingerprintsRecent(ctx, "shop", 1, 0)
	require.ErrorContains(t, err, "limit 0")
	require.Equal(t, 3, testutil.Count(t, pool, `SELECT count(*) FROM schema_fingerprints`))
}

// TestJobStartIssuesToken: Token 0 issues fence + 1 (the runner's starts); a token of the
// caller's (the reconciler's and reparse's, from a Redis counter) still applies only above
// the fence, so the two kinds of start never share a token.
func TestJobStartIssuesToken(t *testing.T) {
	ctx := context.Background()
	s := store.New(testutil.PG(t))
	record(t, s, "j")
	issue := func() store.StartedAttempt {
		t.Helper()
		a, err := s.JobStart(ctx, store.AttemptStartParams{Key: "j", Worker: "w1", Country: "US"})
		require.NoError(t, err)
		return a
	}
	a := issue()
	require.Equal(t, int64(1), a.Fence)
	require.Equal(t, 1, a.AttemptNo)
	b := issue() // the holder of 1 lost its lease: a takeover
	require.Equal(t, int64(2), b.Fence)
	require.True(t, b.TookOver)
	require.ErrorIs(t, s.JobComplete(ctx, finish("j", 1)), store.ErrStaleFence, "the first attempt is fenced out")

	c, err := s.JobStart(ctx, store.AttemptStartParams{Key: "j", Token: 7, Worker: "reparse", Country: "US"})
	require.NoError(t, err)
	require.Equal(t, int64(7), c.Fence)
	_, err = s.JobStart(ctx, store.AttemptStartParams{Key: "j", Token: 7, Worker: "reparse", Country: "US"})
	require.ErrorIs(t, err, store.ErrStaleFence)
	d := issue()
	require.Equal(t, int64(8), d.Fence, "issued above a counter's token")
	require.NoError(t, s.JobComplete(ctx, finish("j", 8)))
	_, err = s.JobStart(ctx, store.AttemptStartParams{Key: "j", Worker: "w1", Country: "US"})
	require.ErrorIs(t, err, store.ErrJobComplete)
	var te *store.TransitionError
	require.ErrorAs(t, err, &te)
	require.Equal(t, int64(8), te.Fence)
}
