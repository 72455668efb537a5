package store_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestStartsSurviveCrash: every start waits for its WAL flush (before issue 23's tokens
// from PostgreSQL, starts with a token of their own skipped it, and a crash lost some). On a
// throwaway server whose WAL writer holds asynchronous commits in memory, attempts are
// started with counter tokens, alone and batched, and the server is killed as `pg_ctl stop
// -m immediate` does: after crash recovery every start is there (none half-applied, none
// lost), its worker commits, and what was committed before the crash is intact. Were a
// start lost, a counter token could equal the fence the next start issues: two attempts
// under one token.
func TestStartsSurviveCrash(t *testing.T) {
	ctx := context.Background()
	srv, pool := crashFixture(t)
	s := store.New(pool)

	const jobs = 100
	key := func(i int) string { return fmt.Sprintf("crash-%03d", i) }
	recs := make([]tasks.JobRecord, jobs)
	for i := range recs {
		recs[i] = tasks.JobRecord{Key: key(i), Spec: tasks.Spec{Kind: "catalog", SourceID: key(i), Country: "US", Window: "w", ParserVersion: 3}}
	}
	_, err := s.JobsRecord(ctx, recs)
	require.NoError(t, err)
	// Committed synchronously before the crash: jobs 0-9 complete, 10-19 retryable.
	for i := 0; i < 20; i++ {
		_, err := start(ctx, s, key(i), 1)
		require.NoError(t, err)
		if i < 10 {
			_, err = s.Commit(ctx, commitParams(key(i), 1))
		} else {
			err = s.JobMarkRetryable(ctx, store.AttemptFinishParams{Key: key(i), Token: 1, NextAttemptAt: time.Now(), Category: "timeout"})
		}
		require.NoError(t, err)
	}
	beforeStarts := map[string][]string{}
	for _, tbl := range []string{"results", "outbox"} {
		beforeStarts[tbl] = testutil.TableSnapshot(t, pool, tbl)
	}
	type rowState struct {
		State    tasks.JobState
		Fence    int64
		Attempts int
		Outcomes string // outcome@fence of every attempt, in order
	}
	read := func(k string) rowState {
		t.Helper()
		j, err := s.JobGet(ctx, k)
		require.NoError(t, err)
		atts, err := s.AttemptList(ctx, k)
		require.NoError(t, err)
		rs := rowState{State: j.State, Fence: j.Fence, Attempts: j.Attempts}
		for _, a := range atts {
			rs.Outcomes += fmt.Sprintf("%s@%d ", a.Outcome, a.Fence)
		}
		return rs
	}
	before := map[string]rowState{}
	for i := 10; i < jobs; i++ {
		before[key(i)] = read(key(i))
	}

	// The starts that may be lost: token 5 for jobs 10-99, alone and batched.
	for i := 10; i < 55; i++ {
		_, err := start(ctx, s, key(i), 5)
		require.NoError(t, err)
	}
	g := s.NewGroupCommitter(0, 0)
	var wg sync.WaitGroup
	errs := make([]error, jobs)
	for i := 55; i < jobs; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = g.JobStart(ctx, store.AttemptStartParams{Key: key(i), Token: 5, Worker: "w1", Country: "US"})
		}()
	}
	wg.Wait()
	g.Close()
	for i := 55; i < jobs; i++ {
		require.NoError(t, errs[i], key(i))
	}

	srv.Crash()
	srv.Start()
	pool.Reset()

	// Each start survived whole or was lost whole.
	var lost, survived []string
	for i := 10; i < jobs; i++ {
		k := key(i)
		got, was := read(k), before[k]
		startedWant := rowState{State: tasks.StateRunning, Fence: 5, Attempts: was.Attempts + 1,
			Outcomes: was.Outcomes + "running@5 "}
		switch got {
		case was:
			lost = append(lost, k)
		case startedWant:
			survived = append(survived, k)
		default:
			t.Fatalf("%s: half-applied start after the crash:\n%s", k, cmp.Diff(was, got))
		}
	}
	t.Logf("after the crash: %d starts lost, %d survived", len(lost), len(survived))
	require.Empty(t, lost, "starts lost in the crash")
	for tbl, rows := range beforeStarts {
		require.Equal(t, rows, testutil.TableSnapshot(t, pool, tbl), "%s committed before the crash changed", tbl)
	}

	for _, k := range lost {
		// The worker that believes it started with 5 finishes and commits: refused, and
		// nothing is written; recording its bytes writes nothing either.
		jobsBefore := testutil.TableSnapshot(t, pool, "jobs")
		attsBefore := testutil.TableSnapshot(t, pool, "attempts")
		_, err := s.Commit(ctx, commitParams(k, 5))
		require.ErrorIs(t, err, store.ErrInvalidTransition, "%s: the job is not running under any token", k)
		require.NoError(t, s.AttemptSupersede(ctx, store.AttemptSupersedeParams{Key: k, Token: 5, Bytes: 10}))
		require.Equal(t, jobsBefore, testutil.TableSnapshot(t, pool, "jobs"), k)
		require.Equal(t, attsBefore, testutil.TableSnapshot(t, pool, "attempts"), k)
		require.Zero(t, testutil.Count(t, pool, `SELECT count(*) FROM results WHERE job_key = $1`, k))

		// The next claim's token starts the job again and completes it.
		n, err := start(ctx, s, k, 6)
		require.NoError(t, err, k)
		require.Equal(t, before[k].Attempts+1, n, k)
		_, err = s.Commit(ctx, commitParams(k, 6))
		require.NoError(t, err, k)
		// And the old token stays refused.
		_, err = s.Commit(ctx, commitParams(k, 5))
		require.ErrorIs(t, err, store.ErrJobComplete, k)
	}
	for _, k := range survived {
		_, err := s.Commit(ctx, commitParams(k, 5))
		require.NoError(t, err, k)
	}

	// Every job complete, exactly one result and one event each, attempts consistent.
	require.Equal(t, jobs, testutil.Count(t, pool, `SELECT count(*) FROM jobs WHERE state = 'complete'`))
	require.Equal(t, jobs, testutil.Count(t, pool, `SELECT count(DISTINCT job_key) FROM results`))
	require.Equal(t, jobs, testutil.Count(t, pool, `SELECT count(*) FROM results`))
	require.Equal(t, jobs, testutil.Count(t, pool, `SELECT count(*) FROM outbox`))
	require.Zero(t, testutil.Count(t, pool, `
SELECT count(*) FROM jobs j
WHERE j.attempts <> (SELECT count(*) FROM attempts a WHERE a.job_key = j.key)
	OR NOT EXISTS (SELECT 1 FROM attempts a WHERE a.job_key = j.key AND a.fence = j.fence AND a.outcome = 'complete')
	OR NOT EXISTS (SELECT 1 FROM results r WHERE r.job_key = j.key AND r.fence = j.fence)`), "a job whose rows disagree")
}

// crashFixture is a throwaway server that keeps an async commit's WAL in shared memory until
// a crash: a process crash loses only WAL not yet handed to the kernel, which the WAL writer
// does every wal_writer_delay (and the background writer or autovacuum can force earlier).
func crashFixture(t *testing.T) (*testutil.PostgresServer, *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	srv := testutil.StartPostgres(t)
	admin := srv.Pool(t, "postgres")
	for _, set := range []string{
		`ALTER SYSTEM SET wal_writer_delay = '10s'`,
		`ALTER SYSTEM SET bgwriter_lru_maxpages = 0`,
		`ALTER SYSTEM SET autovacuum = off`,
	} {
		_, err := admin.Exec(ctx, set)
		require.NoError(t, err)
	}
	admin.Close()
	srv.Restart()
	return srv, srv.MigratedPool(t)
}

// TestIssuedTokenSurvivesCrash: a start that issues its token (Token 0, the runner's) waits
// for its WAL flush, so a crash right after it never takes the fence back and the next
// start never issues that token again. Same fixture as TestStartsSurviveCrash; here, alone
// and grouped, every issued start survives the crash, and the next start issues a higher
// token.
func TestIssuedTokenSurvivesCrash(t *testing.T) {
	ctx := context.Background()
	srv, pool := crashFixture(t)
	s := store.New(pool)

	const jobs = 60
	key := func(i int) string { return fmt.Sprintf("issued-%03d", i) }
	recs := make([]tasks.JobRecord, jobs)
	for i := range recs {
		recs[i] = tasks.JobRecord{Key: key(i), Spec: tasks.Spec{Kind: "catalog", SourceID: key(i), Country: "US", Window: "w", ParserVersion: 3}}
	}
	_, err := s.JobsRecord(ctx, recs)
	require.NoError(t, err)
	// A first attempt each, so the issued token is 2, not 1.
	for i := range jobs {
		a, err := s.JobStart(ctx, store.AttemptStartParams{Key: key(i), Worker: "w1", Country: "US"})
		require.NoError(t, err)
		require.Equal(t, int64(1), a.Fence)
		require.NoError(t, s.JobMarkRetryable(ctx, store.AttemptFinishParams{Key: key(i), Token: 1, NextAttemptAt: time.Now(), Category: "timeout"}))
	}

	issued := make([]int64, jobs)
	for i := range jobs / 2 {
		a, err := s.JobStart(ctx, store.AttemptStartParams{Key: key(i), Worker: "w1", Country: "US"})
		require.NoError(t, err)
		issued[i] = a.Fence
	}
	g := s.NewGroupCommitter(0, 0)
	var wg sync.WaitGroup
	errs := make([]error, jobs)
	for i := jobs / 2; i < jobs; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var a store.StartedAttempt
			a, errs[i] = g.JobStart(ctx, store.AttemptStartParams{Key: key(i), Worker: "w1", Country: "US"})
			issued[i] = a.Fence
		}()
	}
	wg.Wait()
	g.Close()
	for i := jobs / 2; i < jobs; i++ {
		require.NoError(t, errs[i], key(i))
	}

	srv.Crash()
	srv.Start()
	pool.Reset()

	for i := range jobs {
		require.Equal(t, int64(2), issued[i], key(i))
		j, err := s.JobGet(ctx, key(i))
		require.NoError(t, err)
		require.Equal(t, tasks.StateRunning, j.State, "%s: the issued start was lost in the crash", key(i))
		require.Equal(t, issued[i], j.Fence, key(i))
		// A takeover after the crash gets a token nobody held.
		a, err := s.JobStart(ctx, store.AttemptStartParams{Key: key(i), Worker: "w2", Country: "US"})
		require.NoError(t, err)
		require.Equal(t, issued[i]+1, a.Fence, key(i))
		require.True(t, a.TookOver, key(i))
	}
}
