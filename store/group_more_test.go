package store_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// failSafe bounds a wait that must end; it is not a timing assertion.
const failSafe = 60 * time.Second

func recv[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(failSafe):
		t.Fatalf("%s never happened", what)
		panic("unreachable")
	}
}

// startedJobs records and starts keys with token 1.
func startedJobs(t *testing.T, s *store.PG, keys ...string) {
	t.Helper()
	for _, k := range keys {
		record(t, s, k)
		_, err := start(context.Background(), s, k, 1)
		require.NoError(t, err)
	}
}

// pauseGroup holds the committer's next batch until the returned release is called, and
// returns a channel that receives one value per queued request.
func pauseGroup(g *store.GroupCommitter) (queued <-chan struct{}, release func()) {
	q := make(chan struct{}, 1024)
	gate := make(chan struct{})
	var once sync.Once
	store.SetGroupHooks(g, store.GroupHooks{
		Queued:  func() { q <- struct{}{} },
		Collect: func() { <-gate },
	})
	return q, func() { once.Do(func() { close(gate) }) }
}

func jobState(t *testing.T, s *store.PG, key string) tasks.JobState {
	t.Helper()
	j, err := s.JobGet(context.Background(), key)
	require.NoError(t, err)
	return j.State
}

// TestGroupCommitNoHeadOfLineBlocking: a row lock held on job A by another transaction
// does not delay the commits of unrelated jobs in the same batch; A's own commit gives up
// after LockWait with ErrRowBusy, having written nothing, and succeeds once the lock goes.
func TestGroupCommitNoHeadOfLineBlocking(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)
	keys := []string{"a"}
	for i := range 10 {
		keys = append(keys, fmt.Sprintf("b%d", i))
	}
	startedJobs(t, s, keys...)
	g, err := s.NewGroupCommitterConfig(store.GroupConfig{LockWait: 200 * time.Millisecond})
	require.NoError(t, err)
	defer g.Close()
	queued, release := pauseGroup(g)

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // ended below
	_, err = tx.Exec(ctx, `SELECT 1 FROM jobs WHERE key = 'a' FOR UPDATE`)
	require.NoError(t, err)

	aErr := make(chan error, 1)
	go func() { _, err := g.Commit(ctx, commitParams("a", 1)); aErr <- err }()
	bErrs := make(chan error, len(keys)-1)
	for _, k := range keys[1:] {
		go func() { _, err := g.Commit(ctx, commitParams(k, 1)); bErrs <- err }()
	}
	for range keys {
		recv(t, queued, "a queued commit")
	}
	release() // a and the b's share the first batch
	for range keys[1:] {
		require.NoError(t, recv(t, bErrs, "an unrelated commit"))
	}
	for _, k := range keys[1:] {
		assert.Equal(t, tasks.StateComplete, jobState(t, s, k))
	}
	err = recv(t, aErr, "the locked job's answer")
	require.ErrorIs(t, err, store.ErrRowBusy)
	require.NoError(t, tx.Rollback(ctx))
	assert.Equal(t, tasks.StateRunning, jobState(t, s, "a"), "nothing of the busy commit was written")
	_, err = g.Commit(ctx, commitParams("a", 1))
	require.NoError(t, err)
	assert.Equal(t, tasks.StateComplete, jobState(t, s, "a"))
}

// TestGroupCommitCallerContext: a caller whose context ends gets its error at once, even
// while its request is in the committer; Close then does not wait for it.
func TestGroupCommitCallerContext(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)
	startedJobs(t, s, "a")
	g, err := s.NewGroupCommitterConfig(store.GroupConfig{LockWait: time.Hour})
	require.NoError(t, err)
	tried := make(chan struct{}, 100)
	store.SetGroupHooks(g, store.GroupHooks{After: func([]string) error { tried <- struct{}{}; return nil }})

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // test end
	_, err = tx.Exec(ctx, `SELECT 1 FROM jobs WHERE key = 'a' FOR UPDATE`)
	require.NoError(t, err)

	cctx, cancel := context.WithCancel(ctx)
	aErr := make(chan error, 1)
	go func() { _, err := g.Commit(cctx, commitParams("a", 1)); aErr <- err }()
	recv(t, tried, "a statement with the locked job") // it is in the committer now
	cancel()
	err = recv(t, aErr, "the cancelled caller's answer")
	require.ErrorIs(t, err, context.Canceled)
	g.Close() // returns although the row is still locked
	assert.Equal(t, tasks.StateRunning, jobState(t, s, "a"))
}

// TestGroupCommitAmbiguousCommit: a failure after the statement was sent is resolved by
// re-reading the rows: a commit that took effect is reported as done, one that did not is
// tried again; neither is reported as "nothing written" by guess.
func TestGroupCommitAmbiguousCommit(t *testing.T) {
	ctx := context.Background()

	t.Run("ReplyLostAfterCommit", func(t *testing.T) {
		s := store.New(testutil.PG(t))
		record(t, s, "s")
		startedJobs(t, s, "c")
		g := s.NewGroupCommitter(0, 0)
		defer g.Close()
		var lost atomic.Int32
		store.SetGroupHooks(g, store.GroupHooks{After: func([]string) error {
			lost.Add(1)
			return errors.New("read tcp: connection reset by peer") // the statement ran; its reply is lost
		}})
		res, err := g.Commit(ctx, commitParams("c", 1))
		require.NoError(t, err)
		assert.True(t, res.ResultInserted)
		assert.True(t, res.EventInserted)
		assert.Equal(t, tasks.StateComplete, jobState(t, s, "c"))

		a, err := g.JobStart(ctx, store.AttemptStartParams{Key: "s", Token: 3, Worker: "w"})
		require.NoError(t, err)
		assert.Equal(t, 1, a.AttemptNo)
		assert.False(t, a.TookOver)
		assert.EqualValues(t, 2, lost.Load(), "each statement lost its reply once and was not sent again")
		assert.Equal(t, 1, testutil.Count(t, s.Pool(), `SELECT count(*) FROM attempts WHERE job_key = 's'`))
	})

	t.Run("LateStatementWinsTheRetry", func(t *testing.T) {
		// The first statement's connection fails after it was sent; the re-read finds the
		// job untouched, so the commit is tried again; but the first statement takes
		// effect on the server before the second try, which is refused. The caller's
		// commit did take effect: it is reported as done, not as ErrJobComplete.
		s := store.New(testutil.PG(t))
		startedJobs(t, s, "c")
		g := s.NewGroupCommitter(0, 0)
		defer g.Close()
		var calls atomic.Int32
		store.SetGroupHooks(g, store.GroupHooks{Before: func([]string) error {
			switch calls.Add(1) {
			case 1:
				return errors.New("write tcp: broken pipe") // sent? unknown
			case 2:
				_, err := s.Commit(ctx, commitParams("c", 1)) // the first statement, late
				require.NoError(t, err)
			}
			return nil
		}})
		res, err := g.Commit(ctx, commitParams("c", 1))
		require.NoError(t, err)
		assert.True(t, res.ResultInserted)
		assert.EqualValues(t, 2, calls.Load())
		assert.Equal(t, tasks.StateComplete, jobState(t, s, "c"))
		assert.EqualValues(t, 2, g.Stats().Resolved, "re-read after the lost reply, then after the refusal")
	})

	t.Run("BackendKilledBeforeCommit", func(t *testing.T) {
		pool := testutil.PG(t)
		s := store.New(pool)
		startedJobs(t, s, "c", "other")
		g := s.NewGroupCommitter(0, 0)
		defer g.Close()
		// Another transaction inserts the commit's observation key (for another job, so
		// that c's row is not locked) without committing:
		// the commit's result insert waits on it, after its statement was sent.
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck // ended below
		_, err = tx.Exec(ctx, `INSERT INTO results (observation_key, job_key, parser_version, data, fence) VALUES ('c', 'other', 3, '{}', 1)`)
		require.NoError(t, err)

		done := make(chan error, 1)
		go func() { _, err := g.Commit(ctx, commitParams("c", 1)); done <- err }()
		var pid int32
		require.Eventually(t, func() bool {
			return pool.QueryRow(ctx, `SELECT pid FROM pg_stat_activity WHERE datname = current_database()
				AND wait_event_type = 'Lock' AND query LIKE '%INSERT INTO results%'`).Scan(&pid) == nil
		}, failSafe, 5*time.Millisecond, "the commit waits on the uncommitted result")
		_, err = pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid)
		require.NoError(t, err)
		// The re-read finds the job still running under the token: not written, tried
		// again; it waits on the same row until the other transaction ends.
		require.Eventually(t, func() bool {
			var other int32
			return pool.QueryRow(ctx, `SELECT pid FROM pg_stat_activity WHERE datname = current_database()
				AND wait_event_type = 'Lock' AND query LIKE '%INSERT INTO results%'`).Scan(&other) == nil && other != pid
		}, failSafe, 5*time.Millisecond, "the commit is tried again")
		require.NoError(t, tx.Rollback(ctx))
		require.NoError(t, recv(t, done, "the commit's answer"))
		assert.Equal(t, tasks.StateComplete, jobState(t, s, "c"))
		assert.Equal(t, 1, testutil.Count(t, pool, `SELECT count(*) FROM results WHERE job_key = 'c'`))
		assert.Equal(t, 1, testutil.Count(t, pool, `SELECT count(*) FROM outbox WHERE event_key = 'observed:c'`))
	})
}

// TestGroupCommitCloseDrains: Close runs every queued request and waits for the
// statements in flight; later calls fail with ErrGroupCommitterClosed.
func TestGroupCommitCloseDrains(t *testing.T) {
	ctx := context.Background()
	s := store.New(testutil.PG(t))
	const n = 30
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("d%02d", i)
	}
	startedJobs(t, s, keys...)
	g, err := s.NewGroupCommitterConfig(store.GroupConfig{MaxBatch: 4})
	require.NoError(t, err)
	queued, release := pauseGroup(g)
	errs := make(chan error, n)
	for _, k := range keys {
		go func() { _, err := g.Commit(ctx, commitParams(k, 1)); errs <- err }()
	}
	for range n {
		recv(t, queued, "a queued commit")
	}
	closed := make(chan struct{})
	go func() { g.Close(); close(closed) }()
	release()
	recv(t, closed, "Close")
	for range n {
		select {
		case err := <-errs:
			require.NoError(t, err)
		default:
			t.Fatal("Close returned before every queued commit was answered")
		}
	}
	assert.Equal(t, n, testutil.Count(t, s.Pool(), `SELECT count(*) FROM jobs WHERE state = 'complete'`))
	_, err = g.Commit(ctx, commitParams(keys[0], 1))
	require.ErrorIs(t, err, store.ErrGroupCommitterClosed)
	g.Close() // again: no-op
}
