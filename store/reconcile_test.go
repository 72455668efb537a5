package store_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// testNow is the database's clock, against which the rows' timestamps are written.
func testNow(t *testing.T, s *store.PG) time.Time {
	t.Helper()
	var now time.Time
	require.NoError(t, s.Pool().QueryRow(context.Background(), `SELECT now()`).Scan(&now))
	return now
}

func TestJobRescue(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)

	t.Run("HappyPath", func(t *testing.T) {
		const key = "rescue-ok"
		record(t, s, key)
		_, err := start(ctx, s, key, 5)
		require.NoError(t, err)
		before := testNow(t, s)
		require.NoError(t, s.JobRescue(ctx, store.JobRescueParams{Key: key, ExpectFence: 5, Token: 6, Error: "lease expired; rescued by r1"}))

		j, err := s.JobGet(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, jobView{tasks.StateRetryable, 6, 1, "lease_expired", 0}, view(t, s, key), "fence raised to the rescuer's token; not an attempt")
		require.NotNil(t, j.NextAttemptAt)
		assert.False(t, j.NextAttemptAt.Before(before), "due now")
		assert.False(t, j.NextAttemptAt.After(testNow(t, s)), "due now")
		assert.Equal(t, attemptEvidence{Outcome: "lost", Category: "lease_expired", ProxyEndpoint: "gw.example:7777",
			Error: "lease expired; rescued by r1", Finished: true}, evidenceOf(t, s, key, 1))

		// The stale worker holding 5 is refused from now on, and writes nothing.
		snap := testutil.TableSnapshot(t, pool, "jobs")
		_, err = s.Commit(ctx, commitParams(key, 5))
		require.ErrorIs(t, err, store.ErrStaleFence)
		require.Equal(t, snap, testutil.TableSnapshot(t, pool, "jobs"))
		require.Zero(t, testutil.Count(t, pool, `SELECT count(*) FROM results WHERE job_key = $1`, key))
		// A start must now exceed the rescuer's token.
		_, err = start(ctx, s, key, 6)
		require.ErrorIs(t, err, store.ErrStaleFence)
		n, err := start(ctx, s, key, 7)
		require.NoError(t, err)
		assert.Equal(t, 2, n)
		_, err = s.Commit(ctx, commitParams(key, 7))
		require.NoError(t, err)
	})

	t.Run("Refused", func(t *testing.T) {
		record(t, s, "rr-rescued")
		_, err := start(ctx, s, "rr-rescued", 5)
		require.NoError(t, err)
		require.NoError(t, s.JobRescue(ctx, store.JobRescueParams{Key: "rr-rescued", ExpectFence: 5, Token: 6}))
		record(t, s, "rr-running")
		_, err = start(ctx, s, "rr-running", 8)
		require.NoError(t, err)
		record(t, s, "rr-pending")
		record(t, s, "rr-complete")
		_, err = start(ctx, s, "rr-complete", 2)
		require.NoError(t, err)
		_, err = s.Commit(ctx, commitParams("rr-complete", 2))
		require.NoError(t, err)
		record(t, s, "rr-failed")
		_, err = start(ctx, s, "rr-failed", 2)
		require.NoError(t, err)
		p := finish("rr-failed", 2)
		p.Category = "parse_error"
		require.NoError(t, s.JobFail(ctx, p))

		cases := []struct {
			name string
			p    store.JobRescueParams
			want error
		}{
			{"SecondRescueSameExpectFence", store.JobRescueParams{Key: "rr-rescued", ExpectFence: 5, Token: 7}, store.ErrStaleFence},
			{"RunningUnderNewerFence", store.JobRescueParams{Key: "rr-running", ExpectFence: 7, Token: 9}, store.ErrStaleFence},
			{"RunningUnderOlderFence", store.JobRescueParams{Key: "rr-running", ExpectFence: 9, Token: 10}, store.ErrStaleFence},
			{"Pending", store.JobRescueParams{Key: "rr-pending", ExpectFence: 1, Token: 2}, store.ErrInvalidTransition},
			{"Complete", store.JobRescueParams{Key: "rr-complete", ExpectFence: 2, Token: 3}, store.ErrJobComplete},
			{"Failed", store.JobRescueParams{Key: "rr-failed", ExpectFence: 2, Token: 3}, store.ErrJobFailed},
			{"NotFound", store.JobRescueParams{Key: "rr-nope", ExpectFence: 2, Token: 3}, store.ErrJobNotFound},
		}
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				jobs := testutil.TableSnapshot(t, pool, "jobs")
				atts := testutil.TableSnapshot(t, pool, "attempts")
				err := s.JobRescue(ctx, tc.p)
				require.ErrorIs(t, err, tc.want)
				var te *store.TransitionError
				require.ErrorAs(t, err, &te)
				assert.Equal(t, "JobRescue", te.Op)
				assert.Equal(t, tc.p.Token, te.Token)
				if diff := cmp.Diff(jobs, testutil.TableSnapshot(t, pool, "jobs")); diff != "" {
					t.Fatalf("refused rescue changed jobs (-before +after):\n%s", diff)
				}
				if diff := cmp.Diff(atts, testutil.TableSnapshot(t, pool, "attempts")); diff != "" {
					t.Fatalf("refused rescue changed attempts (-before +after):\n%s", diff)
				}
			})
		}
	})

	t.Run("BadInput", func(t *testing.T) {
		for field, p := range map[string]store.JobRescueParams{
			"Key":         {ExpectFence: 1, Token: 2},
			"ExpectFence": {Key: "k", ExpectFence: 0, Token: 2},
			"Token":       {Key: "k", ExpectFence: 3, Token: 3},
		} {
			require.ErrorContains(t, s.JobRescue(ctx, p), field)
		}
	})

	raceOutcome := func(t *testing.T, key string, token int64, commitErr, rescueErr error) string {
		t.Helper()
		return rescueRaceOutcome(t, s, pool, key, token, commitErr, rescueErr)
	}

	t.Run("RaceWithLiveCommit", func(t *testing.T) {
		// Both statements wait on the jobs row lock held by another transaction, then run
		// one after the other against the row the first one left.
		const key = "race-locked"
		record(t, s, key)
		_, err := start(ctx, s, key, 3)
		require.NoError(t, err)
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck // committed below
		_, err = tx.Exec(ctx, `SELECT 1 FROM jobs WHERE key = $1 FOR UPDATE`, key)
		require.NoError(t, err)
		waiting := func(n int) func() bool {
			return func() bool {
				return testutil.Count(t, pool, `SELECT count(*) FROM pg_stat_activity
					WHERE datname = current_database() AND wait_event_type = 'Lock'`) == n
			}
		}
		commitErr, rescueErr := make(chan error, 1), make(chan error, 1)
		go func() { _, err := s.Commit(ctx, commitParams(key, 3)); commitErr <- err }()
		waitUntil(t, "the commit waiting on the row lock", waiting(1))
		go func() { rescueErr <- s.JobRescue(ctx, store.JobRescueParams{Key: key, ExpectFence: 3, Token: 4}) }()
		waitUntil(t, "the rescue waiting on the row lock too", waiting(2))
		require.NoError(t, tx.Commit(ctx))
		raceOutcome(t, key, 3, recv(t, commitErr, "the commit's answer"), recv(t, rescueErr, "the rescue's answer"))
	})

	t.Run("RaceManyJobs", func(t *testing.T) {
		const jobs = 30
		var wg sync.WaitGroup
		type pair struct{ commit, rescue error }
		got := make([]pair, jobs)
		release := make(chan struct{})
		for i := 0; i < jobs; i++ {
			key := fmt.Sprintf("race-%02d", i)
			record(t, s, key)
			_, err := start(ctx, s, key, 10)
			require.NoError(t, err)
			wg.Add(2)
			go func() { defer wg.Done(); <-release; _, got[i].commit = s.Commit(ctx, commitParams(key, 10)) }()
			go func() {
				defer wg.Done()
				<-release
				got[i].rescue = s.JobRescue(ctx, store.JobRescueParams{Key: key, ExpectFence: 10, Token: 11})
			}()
		}
		close(release)
		wg.Wait()
		wins := map[string]int{}
		for i, p := range got {
			wins[raceOutcome(t, fmt.Sprintf("race-%02d", i), 10, p.commit, p.rescue)]++
		}
		t.Logf("winners: %v", wins)
		require.Equal(t, jobs, wins["commit"]+wins["rescue"])
	})
}

// rescueRaceOutcome checks that exactly one of a live worker's commit and a rescue won,
// and that the rows say so; it returns the winner.
func rescueRaceOutcome(t *testing.T, s *store.PG, pool *pgxpool.Pool, key string, token int64, commitErr, rescueErr error) string {
	t.Helper()
	jv := view(t, s, key)
	results := testutil.Count(t, pool, `SELECT count(*) FROM results WHERE job_key = $1`, key)
	events := testutil.Count(t, pool, `SELECT count(*) FROM outbox WHERE event_key = $1`, "observed:"+key)
	switch {
	case commitErr == nil && rescueErr != nil:
		require.ErrorIs(t, rescueErr, store.ErrJobComplete)
		require.Equal(t, jobView{tasks.StateComplete, token, 1, "", 2048}, jv)
		require.Equal(t, 1, results)
		require.Equal(t, 1, events)
		return "commit"
	case rescueErr == nil && commitErr != nil:
		require.ErrorIs(t, commitErr, store.ErrStaleFence)
		require.Equal(t, jobView{tasks.StateRetryable, token + 1, 1, "lease_expired", 0}, jv)
		require.Zero(t, results)
		require.Zero(t, events)
		ev := evidenceOf(t, s, key, 1)
		require.Equal(t, "lost", ev.Outcome, "the rescue wrote the attempt's row")
		require.Equal(t, "lease_expired", ev.Category, "the rescue wrote the attempt's row")
		return "rescue"
	default:
		t.Fatalf("%s: want exactly one winner; commit: %v, rescue: %v", key, commitErr, rescueErr)
		return ""
	}
}

// rescueFixture records, under prefix, one job in every state a rescue can meet, and
// returns the rescues to try on them (keys under prefix).
func rescueFixture(t *testing.T, s *store.PG, prefix string) []store.JobRescueParams {
	t.Helper()
	ctx := context.Background()
	k := func(name string) string { return prefix + name }
	record(t, s, k("ok-1"))
	_, err := start(ctx, s, k("ok-1"), 5)
	require.NoError(t, err)
	record(t, s, k("ok-2"))
	_, err = start(ctx, s, k("ok-2"), 1)
	require.NoError(t, err)
	_, err = start(ctx, s, k("ok-2"), 3) // a takeover: the first attempt is superseded
	require.NoError(t, err)
	record(t, s, k("rescued"))
	_, err = start(ctx, s, k("rescued"), 5)
	require.NoError(t, err)
	require.NoError(t, s.JobRescue(ctx, store.JobRescueParams{Key: k("rescued"), ExpectFence: 5, Token: 6}))
	record(t, s, k("running"))
	_, err = start(ctx, s, k("running"), 8)
	require.NoError(t, err)
	record(t, s, k("pending"))
	record(t, s, k("complete"))
	_, err = start(ctx, s, k("complete"), 2)
	require.NoError(t, err)
	_, err = s.Commit(ctx, commitParams(k("complete"), 2))
	require.NoError(t, err)
	record(t, s, k("failed"))
	_, err = start(ctx, s, k("failed"), 2)
	require.NoError(t, err)
	p := finish(k("failed"), 2)
	p.Category = "parse_error"
	require.NoError(t, s.JobFail(ctx, p))
	return []store.JobRescueParams{
		{Key: k("running"), ExpectFence: 7, Token: 9}, // under a newer fence
		{Key: k("ok-1"), ExpectFence: 5, Token: 6, Error: "lease expired; rescued by r1"},
		{Key: k("rescued"), ExpectFence: 5, Token: 7}, // a second rescue
		{Key: k("pending"), ExpectFence: 1, Token: 2},
		{Key: k("complete"), ExpectFence: 2, Token: 3},
		{Key: k("nope"), ExpectFence: 2, Token: 3},
		{Key: k("ok-2"), ExpectFence: 3, Token: 40, Error: strings.Repeat("é", 1500)}, // cut to 2000 bytes
		{Key: k("failed"), ExpectFence: 2, Token: 3},
	}
}

// TestJobsRescue: the batched rescue does, row for row, what JobRescue does (same rows
// written, same refusals), fences each row on its own, and races live commits exactly as
// JobRescue does.
func TestJobsRescue(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)

	t.Run("EquivalentToJobRescue", func(t *testing.T) {
		single := rescueFixture(t, s, "one-")
		batch := rescueFixture(t, s, "many-")
		errs, err := s.JobsRescue(ctx, batch)
		require.NoError(t, err)
		require.Len(t, errs, len(batch))
		rescued := 0
		for i, p := range single {
			name := strings.TrimPrefix(p.Key, "one-")
			t.Run(name, func(t *testing.T) {
				want := s.JobRescue(ctx, p)
				got := errs[i]
				if want == nil {
					require.NoError(t, got)
					rescued++
				} else {
					var wte, gte *store.TransitionError
					require.ErrorAs(t, want, &wte)
					require.ErrorAs(t, got, &gte, "%v", got)
					require.ErrorIs(t, got, wte.Err)
					assert.Equal(t, store.TransitionError{Op: "JobRescue", Key: batch[i].Key, State: wte.State, Fence: wte.Fence, Token: wte.Token, Err: wte.Err}, *gte)
				}
				oneJob, err := s.JobGet(ctx, p.Key)
				if err != nil {
					require.ErrorIs(t, err, store.ErrJobNotFound)
					_, err = s.JobGet(ctx, batch[i].Key)
					require.ErrorIs(t, err, store.ErrJobNotFound)
					return
				}
				manyJob, err := s.JobGet(ctx, batch[i].Key)
				require.NoError(t, err)
				assert.Equal(t, view(t, s, p.Key), view(t, s, batch[i].Key))
				assert.Equal(t, oneJob.NextAttemptAt == nil, manyJob.NextAttemptAt == nil)
				oneAtts, err := s.AttemptList(ctx, p.Key)
				require.NoError(t, err)
				for n := 1; n <= len(oneAtts); n++ {
					assert.Equal(t, evidenceOf(t, s, p.Key, n), evidenceOf(t, s, batch[i].Key, n), "attempt %d", n)
				}
				assert.Equal(t,
					testutil.Count(t, pool, `SELECT count(*) FROM attempts WHERE job_key = $1 AND evidence_due`, p.Key),
					testutil.Count(t, pool, `SELECT count(*) FROM attempts WHERE job_key = $1 AND evidence_due`, batch[i].Key))
			})
		}
		require.Equal(t, 2, rescued, "ok-1 and ok-2 rescued")
		ev := evidenceOf(t, s, "many-ok-2", 2)
		assert.Len(t, ev.Error, 2000, "error cut to 2000 bytes")
		older := evidenceOf(t, s, "many-ok-2", 1)
		assert.Equal(t, "lost", older.Outcome, "an older attempt is not touched")
		assert.Equal(t, "superseded", older.Category, "written by the takeover's start, not by this rescue (lease_expired)")
	})

	t.Run("RefusedRowsWriteNothing", func(t *testing.T) {
		ps := rescueFixture(t, s, "ref-")
		var refused []store.JobRescueParams
		for _, p := range ps {
			if !strings.HasPrefix(p.Key, "ref-ok-") {
				refused = append(refused, p)
			}
		}
		jobs := testutil.TableSnapshot(t, pool, "jobs")
		atts := testutil.TableSnapshot(t, pool, "attempts")
		errs, err := s.JobsRescue(ctx, refused)
		require.NoError(t, err)
		for i, e := range errs {
			var te *store.TransitionError
			require.ErrorAs(t, e, &te, "row %d", i)
		}
		if diff := cmp.Diff(jobs, testutil.TableSnapshot(t, pool, "jobs")); diff != "" {
			t.Fatalf("refused rescues changed jobs (-before +after):\n%s", diff)
		}
		if diff := cmp.Diff(atts, testutil.TableSnapshot(t, pool, "attempts")); diff != "" {
			t.Fatalf("refused rescues changed attempts (-before +after):\n%s", diff)
		}
	})

	t.Run("BadRows", func(t *testing.T) {
		record(t, s, "bad-ok")
		_, err := start(ctx, s, "bad-ok", 1)
		require.NoError(t, err)
		errs, err := s.JobsRescue(ctx, []store.JobRescueParams{
			{ExpectFence: 1, Token: 2},
			{Key: "bad-ok", ExpectFence: 1, Token: 2},
			{Key: "k", ExpectFence: 0, Token: 2},
			{Key: "k", ExpectFence: 3, Token: 3},
			{Key: "bad-ok", ExpectFence: 1, Token: 3},
		})
		require.NoError(t, err)
		require.ErrorContains(t, errs[0], "Key is empty")
		require.NoError(t, errs[1], "a valid row is rescued beside invalid ones")
		require.ErrorContains(t, errs[2], "ExpectFence")
		require.ErrorContains(t, errs[3], "Token")
		require.ErrorContains(t, errs[4], "Key given twice")
		assert.Equal(t, jobView{tasks.StateRetryable, 2, 1, "lease_expired", 0}, view(t, s, "bad-ok"))

		errs, err = s.JobsRescue(ctx, nil)
		require.NoError(t, err)
		require.Empty(t, errs)
		_, err = s.JobsRescue(ctx, make([]store.JobRescueParams, store.MaxRescueBatch+1))
		require.ErrorContains(t, err, "at most")
	})

	t.Run("RaceWithLockedCommit", func(t *testing.T) {
		// A live commit and the batch both wait on the jobs row lock of another
		// transaction; whichever runs second sees what the first left, and a refused row
		// is classified from the row as it is after the wait, not from the snapshot.
		record(t, s, "lk-race")
		_, err := start(ctx, s, "lk-race", 3)
		require.NoError(t, err)
		record(t, s, "lk-free")
		_, err = start(ctx, s, "lk-free", 3)
		require.NoError(t, err)
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck // committed below
		_, err = tx.Exec(ctx, `SELECT 1 FROM jobs WHERE key = 'lk-race' FOR UPDATE`)
		require.NoError(t, err)
		waiting := func(n int) func() bool {
			return func() bool {
				return testutil.Count(t, pool, `SELECT count(*) FROM pg_stat_activity
					WHERE datname = current_database() AND wait_event_type = 'Lock'`) == n
			}
		}
		commitErr := make(chan error, 1)
		type batchRes struct {
			errs []error
			err  error
		}
		batchDone := make(chan batchRes, 1)
		go func() { _, err := s.Commit(ctx, commitParams("lk-race", 3)); commitErr <- err }()
		waitUntil(t, "the commit waiting on the row lock", waiting(1))
		go func() {
			errs, err := s.JobsRescue(ctx, []store.JobRescueParams{
				{Key: "lk-race", ExpectFence: 3, Token: 4}, {Key: "lk-free", ExpectFence: 3, Token: 4}})
			batchDone <- batchRes{errs, err}
		}()
		waitUntil(t, "the batch waiting on the row lock too", waiting(2))
		require.NoError(t, tx.Commit(ctx))
		cerr := recv(t, commitErr, "the commit's answer")
		br := recv(t, batchDone, "the batch's answer")
		require.NoError(t, br.err)
		require.NoError(t, br.errs[1], "the other row of the batch is rescued")
		winner := rescueRaceOutcome(t, s, pool, "lk-race", 3, cerr, br.errs[0])
		if winner == "commit" {
			var te *store.TransitionError
			require.ErrorAs(t, br.errs[0], &te)
			assert.Equal(t, tasks.StateComplete, te.State, "read under the lock")
		}
	})

	t.Run("RaceWithLiveCommits", func(t *testing.T) {
		// Live workers commit 40 jobs while two batches (reconcilers) rescue them: per job
		// exactly one of the commit and the rescues wins; the losing batch is refused.
		const jobs = 40
		var ps []store.JobRescueParams
		for i := 0; i < jobs; i++ {
			key := fmt.Sprintf("lrace-%02d", i)
			record(t, s, key)
			_, err := start(ctx, s, key, 10)
			require.NoError(t, err)
			ps = append(ps, store.JobRescueParams{Key: key, ExpectFence: 10, Token: 11})
		}
		release := make(chan struct{})
		commitErrs := make([]error, jobs)
		var batchErrs [2][]error
		var wg sync.WaitGroup
		for i := 0; i < jobs; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-release
				_, commitErrs[i] = s.Commit(ctx, commitParams(ps[i].Key, 10))
			}()
		}
		for b := range batchErrs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-release
				mine := slices.Clone(ps)
				if b == 1 {
					slices.Reverse(mine) // another order: the statement sorts its locks
				}
				errs, err := s.JobsRescue(ctx, mine)
				if !assert.NoError(t, err) {
					errs = make([]error, len(mine))
				}
				if b == 1 {
					slices.Reverse(errs)
				}
				batchErrs[b] = errs
			}()
		}
		close(release)
		wg.Wait()
		wins := map[string]int{}
		for i, p := range ps {
			e0, e1 := batchErrs[0][i], batchErrs[1][i]
			rescueErr := e0
			switch {
			case e0 == nil && e1 == nil:
				t.Fatalf("%s rescued twice", p.Key)
			case e0 != nil && e1 == nil:
				rescueErr = e1
				require.ErrorIs(t, e0, store.ErrStaleFence)
			case e0 == nil:
				require.ErrorIs(t, e1, store.ErrStaleFence)
			default:
				require.ErrorIs(t, e1, store.ErrJobComplete)
			}
			wins[rescueRaceOutcome(t, s, pool, p.Key, 10, commitErrs[i], rescueErr)]++
		}
		t.Logf("winners: %v", wins)
		require.Equal(t, jobs, wins["commit"]+wins["rescue"])
	})
}

func TestJobsListRunning(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)

	// Fixture: 23 running jobs whose attempts started an hour ago (every third one was
	// taken over a moment ago, so its current attempt is recent), interleaved with jobs in
	// every other state.
	var wantOld, wantAll []string
	fixtureStart := testNow(t, s)
	for i := 0; i < 23; i++ {
		key := fmt.Sprintf("run-%02d", i)
		record(t, s, key)
		_, err := start(ctx, s, key, 1)
		require.NoError(t, err)
		_, err = pool.Exec(ctx, `UPDATE jobs SET attempt_started_at = now() - interval '1 hour' WHERE key = $1`, key)
		require.NoError(t, err)
		if i%3 == 0 {
			_, err = start(ctx, s, key, 2)
			require.NoError(t, err)
		} else {
			wantOld = append(wantOld, key)
		}
		wantAll = append(wantAll, key)

		other := fmt.Sprintf("run-%02d-x", i)
		record(t, s, other)
		switch i % 3 {
		case 0: // pending
		case 1:
			_, err = start(ctx, s, other, 1)
			require.NoError(t, err)
			_, err = s.Commit(ctx, commitParams(other, 1))
			require.NoError(t, err)
		case 2:
			_, err = start(ctx, s, other, 1)
			require.NoError(t, err)
			require.NoError(t, s.JobRescue(ctx, store.JobRescueParams{Key: other, ExpectFence: 1, Token: 2}))
		}
	}
	sweep := func(t *testing.T, p store.JobsListParams) ([]string, int) {
		t.Helper()
		var keys []string
		pages := 0
		for {
			page, err := s.JobsListRunning(ctx, p)
			require.NoError(t, err)
			pages++
			for _, j := range page {
				keys = append(keys, j.Key)
			}
			if len(page) < p.Limit {
				return keys, pages
			}
			p.AfterKey = page[len(page)-1].Key
		}
	}

	t.Run("KeysetPagesOfStartedBefore", func(t *testing.T) {
		keys, pages := sweep(t, store.JobsListParams{Limit: 4, StartedBefore: testNow(t, s).Add(-30 * time.Minute)})
		require.Equal(t, wantOld, keys)
		require.Equal(t, len(wantOld)/4+1, pages)
	})

	t.Run("NoBound", func(t *testing.T) {
		keys, _ := sweep(t, store.JobsListParams{Limit: 5})
		require.Equal(t, wantAll, keys)
	})

	t.Run("Fields", func(t *testing.T) {
		page, err := s.JobsListRunning(ctx, store.JobsListParams{AfterKey: "run-02-x", Limit: 2})
		require.NoError(t, err)
		require.Len(t, page, 2)
		require.Equal(t, "run-03", page[0].Key)
		require.Equal(t, store.RunningJob{Key: "run-03", Kind: "catalog", Fence: 2, AttemptNo: 2, Worker: "w1",
			AttemptStartedAt: page[0].AttemptStartedAt, SourceID: "run-03", Country: "US", Window: "2026-04-23",
			ParserVersion: 3}, page[0], "the current attempt, after a takeover; the job's spec")
		require.Equal(t, tasks.Spec{Kind: "catalog", SourceID: "run-03", Country: "US", Window: "2026-04-23", ParserVersion: 3},
			page[0].Spec())
		// Started during the fixture (however long it took), not an hour ago.
		require.False(t, page[0].AttemptStartedAt.Before(fixtureStart), "%v before the fixture's start %v", page[0].AttemptStartedAt, fixtureStart)
		require.False(t, page[0].AttemptStartedAt.After(testNow(t, s)), "%v in the future", page[0].AttemptStartedAt)
		require.Equal(t, 1, page[1].AttemptNo)
	})

	t.Run("BadLimit", func(t *testing.T) {
		_, err := s.JobsListRunning(ctx, store.JobsListParams{Limit: -1})
		require.ErrorContains(t, err, "Limit")
		_, err = s.JobsListRunnable(ctx, store.JobsListParams{Limit: store.MaxListLimit + 1})
		require.ErrorContains(t, err, "Limit")
	})

	t.Run("DefaultLimit", func(t *testing.T) {
		page, err := s.JobsListRunning(ctx, store.JobsListParams{})
		require.NoError(t, err)
		require.Len(t, page, len(wantAll))
	})
}

func TestJobsListRunnable(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)
	now := testNow(t, s)

	var wantDue, wantAll []string
	for i := 0; i < 17; i++ {
		key := fmt.Sprintf("rn-%02d", i)
		record(t, s, key)
		switch i % 5 {
		case 0: // pending, never started
			wantDue, wantAll = append(wantDue, key), append(wantAll, key)
		case 1: // retryable, due a minute ago
			_, err := start(ctx, s, key, 1)
			require.NoError(t, err)
			p := finish(key, 1)
			p.Category, p.NextAttemptAt = "timeout", now.Add(-time.Minute)
			require.NoError(t, s.JobMarkRetryable(ctx, p))
			wantDue, wantAll = append(wantDue, key), append(wantAll, key)
		case 2: // retryable, due in an hour
			_, err := start(ctx, s, key, 1)
			require.NoError(t, err)
			p := finish(key, 1)
			p.Category, p.NextAttemptAt = "throttled", now.Add(time.Hour)
			require.NoError(t, s.JobMarkRetryable(ctx, p))
			wantAll = append(wantAll, key)
		case 3: // running
			_, err := start(ctx, s, key, 1)
			require.NoError(t, err)
		case 4: // complete
			_, err := start(ctx, s, key, 1)
			require.NoError(t, err)
			_, err = s.Commit(ctx, commitParams(key, 1))
			require.NoError(t, err)
		}
	}
	sweep := func(t *testing.T, p store.JobsListParams) []string {
		t.Helper()
		var keys []string
		for {
			page, err := s.JobsListRunnable(ctx, p)
			require.NoError(t, err)
			for _, j := range page {
				require.Contains(t, []tasks.JobState{tasks.StatePending, tasks.StateRetryable}, j.State)
				keys = append(keys, j.Key)
			}
			if len(page) < p.Limit {
				return keys
			}
			p.AfterKey = page[len(page)-1].Key
		}
	}

	t.Run("KeysetPagesOfDueJobs", func(t *testing.T) {
		require.Equal(t, wantDue, sweep(t, store.JobsListParams{Limit: 3, DueBefore: now}))
	})
	t.Run("ExactPageBoundary", func(t *testing.T) {
		require.Equal(t, wantDue, sweep(t, store.JobsListParams{Limit: len(wantDue), DueBefore: now}))
	})
	t.Run("NoBound", func(t *testing.T) {
		require.Equal(t, wantAll, sweep(t, store.JobsListParams{Limit: 2}))
	})
	t.Run("SpecFields", func(t *testing.T) {
		page, err := s.JobsListRunnable(ctx, store.JobsListParams{AfterKey: "rn-00", Limit: 1, DueBefore: now})
		require.NoError(t, err)
		require.Len(t, page, 1)
		j := page[0]
		spec := tasks.Spec{Kind: j.Kind, URL: j.URL, SourceID: j.SourceID, Country: j.Country, Window: j.Window,
			ParserVersion: j.ParserVersion, Scope: j.Scope}
		require.Equal(t, tasks.Spec{Kind: "catalog", SourceID: "rn-01", Country: "US", Window: "2026-04-23", ParserVersion: 3}, spec)
		require.Equal(t, "timeout", j.LastCategory)
	})
}

func TestCountersAdd(t *testing.T) {
	ctx := context.Background()
	s := store.New(testutil.PG(t))

	require.NoError(t, s.CountersAdd(ctx, nil), "nothing to add")
	const callers = 10
	errs := make(chan error, callers)
	release := make(chan struct{})
	for i := 0; i < callers; i++ {
		go func() {
			<-release
			// Overlapping names in different map orders: no lost update, no deadlock.
			errs <- s.CountersAdd(ctx, map[string]int64{"jobs_rescued": 1, "tasks_reenqueued": 2, fmt.Sprintf("own_%d", i%2): 5})
		}()
	}
	close(release)
	for i := 0; i < callers; i++ {
		require.NoError(t, <-errs)
	}
	require.ErrorContains(t, s.CountersAdd(ctx, map[string]int64{"": 1}), "empty counter name")
	st, err := s.StatsGet(ctx)
	require.NoError(t, err)
	require.Equal(t, map[string]int64{"jobs_rescued": 10, "tasks_reenqueued": 20, "own_0": 25, "own_1": 25}, st.Maintenance)
	require.NoError(t, s.CountersAdd(ctx, map[string]int64{"jobs_rescued": -3}))
	st, err = s.StatsGet(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(7), st.Maintenance["jobs_rescued"])
}

// TestSweepUsesPartialIndexes: on a table that is mostly complete rows, the sweep queries
// read through the partial indexes of running and runnable jobs (so a sweep costs in
// proportion to those rows), never a scan of the table or of its primary key. The plans
// are the ones the methods really ran, captured by auto_explain.
func TestSweepUsesPartialIndexes(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	_, err := pool.Exec(ctx, `
INSERT INTO jobs (key, kind, source_id, country, "window", parser_version, state, fence, attempts, completed_at, next_attempt_at)
SELECT 'k' || lpad(g::text, 6, '0'), 'catalog', 's' || g, 'US', 'w', 1,
	CASE g % 100 WHEN 0 THEN 'running' WHEN 1 THEN 'pending' WHEN 2 THEN 'retryable' ELSE 'complete' END,
	CASE g % 100 WHEN 1 THEN 0 ELSE 1 END, CASE g % 100 WHEN 1 THEN 0 ELSE 1 END,
	CASE WHEN g % 100 > 2 THEN now() END, CASE g % 100 WHEN 2 THEN now() - interval '1 minute' END
FROM generate_series(1, 20000) g`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `
INSERT INTO attempts (job_key, attempt_no, fence, started_at, outcome)
SELECT key, 1, 1, now() - interval '1 hour', CASE state WHEN 'running' THEN 'running' WHEN 'complete' THEN 'complete' ELSE 'retryable' END
FROM jobs WHERE fence = 1`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `ANALYZE jobs, attempts`)
	require.NoError(t, err)

	// One connection that reports the plan of every statement it runs as a notice.
	var mu sync.Mutex
	var plans []string
	cfg := pool.Config().Copy()
	cfg.MaxConns = 1
	cfg.ConnConfig.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		mu.Lock()
		defer mu.Unlock()
		plans = append(plans, n.Message)
	}
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, `LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0;
			SET auto_explain.log_level = notice; SET auto_explain.log_nested_statements = on`)
		return err
	}
	explained, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer explained.Close()
	s := store.New(explained)
	lastPlan := func() string {
		mu.Lock()
		defer mu.Unlock()
		require.NotEmpty(t, plans)
		p := plans[len(plans)-1]
		plans = nil
		return p
	}

	for _, after := range []string{"", "k010000", "k019900"} {
		t.Run("Running/after="+after, func(t *testing.T) {
			page, err := s.JobsListRunning(ctx, store.JobsListParams{AfterKey: after, Limit: 100, StartedBefore: time.Now()})
			require.NoError(t, err)
			require.NotEmpty(t, page)
			plan := lastPlan()
			require.Contains(t, plan, "jobs_running_key_idx", plan)
			require.False(t, strings.Contains(plan, "Seq Scan") || strings.Contains(plan, "jobs_pkey"), plan)
		})
		t.Run("Runnable/after="+after, func(t *testing.T) {
			page, err := s.JobsListRunnable(ctx, store.JobsListParams{AfterKey: after, Limit: 100, DueBefore: time.Now()})
			require.NoError(t, err)
			require.NotEmpty(t, page)
			plan := lastPlan()
			require.Contains(t, plan, "jobs_runnable_key_idx", plan)
			require.False(t, strings.Contains(plan, "Seq Scan") || strings.Contains(plan, "jobs_pkey"), plan)
		})
	}
}

// TestRequeueMarkers: the record of the reconciler's tasks-checked markers — a
// compare-and-set on the epoch (one of several reconcilers wins), a seq that only grows
// within an epoch and is not written into another epoch, markers kept apart by prefix, and
// bad input refused with the field named and nothing written.
func TestRequeueMarkers(t *testing.T) {
	ctx := context.Background()
	s := store.New(testutil.PG(t))
	get := func(prefix string) map[string]store.RequeueMarker {
		t.Helper()
		m, err := s.RequeueMarkers(ctx, prefix)
		require.NoError(t, err)
		return m
	}
	replace := func(queue, old, next string) bool {
		t.Helper()
		won, err := s.RequeueMarkerReplace(ctx, "p:", queue, old, next)
		require.NoError(t, err)
		return won
	}
	assert.Empty(t, get("p:"))

	assert.True(t, replace("q1", "", "e1"), "the first epoch is created")
	assert.False(t, replace("q1", "", "e1b"), "a second first epoch loses")
	assert.True(t, replace("q2", "", "f1"))
	require.NoError(t, s.RequeueMarkersAdvance(ctx, "p:", map[string]store.RequeueMarker{
		"q1": {Epoch: "e1", Seq: 5}, "q2": {Epoch: "f1", Seq: 2}, "unknown": {Epoch: "x", Seq: 9}}))
	require.NoError(t, s.RequeueMarkersAdvance(ctx, "p:", map[string]store.RequeueMarker{
		"q1": {Epoch: "e1", Seq: 3}, "q2": {Epoch: "other", Seq: 7}}))
	assert.Equal(t, map[string]store.RequeueMarker{"q1": {Epoch: "e1", Seq: 5}, "q2": {Epoch: "f1", Seq: 2}}, get("p:"),
		"seq only grows, and only in its own epoch; a queue without a row is ignored")
	assert.Empty(t, get("other:"), "markers are per prefix")

	assert.False(t, replace("q1", "stale", "e2"), "a replace from an epoch that is no longer recorded loses")
	assert.True(t, replace("q1", "e1", "e2"))
	assert.Equal(t, store.RequeueMarker{Epoch: "e2", Seq: 0}, get("p:")["q1"], "a new epoch starts at seq 0")

	for _, c := range []struct {
		err  error
		want string
	}{
		{func() error { _, err := s.RequeueMarkerReplace(ctx, "p:", "", "", "e"); return err }(), "empty queue name"},
		{func() error { _, err := s.RequeueMarkerReplace(ctx, "p:", "q3", "", ""); return err }(), `queue "q3": empty new epoch`},
		{s.RequeueMarkersAdvance(ctx, "p:", map[string]store.RequeueMarker{"": {Epoch: "e", Seq: 1}}), "empty queue name"},
		{s.RequeueMarkersAdvance(ctx, "p:", map[string]store.RequeueMarker{"q1": {Seq: 1}}), `queue "q1": empty epoch`},
		{s.RequeueMarkersAdvance(ctx, "p:", map[string]store.RequeueMarker{"q1": {Epoch: "e2", Seq: -1}}), `queue "q1": seq -1 is negative`},
	} {
		require.Error(t, c.err)
		assert.Contains(t, c.err.Error(), c.want)
	}
	assert.Equal(t, map[string]store.RequeueMarker{"q1": {Epoch: "e2", Seq: 0}, "q2": {Epoch: "f1", Seq: 2}}, get("p:"), "nothing written by bad input")
}
