package store_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// failSafe bounds a wait for something that must happen; it is not a timing assertion.
// Tests wait for signals, counts and states, never for time to pass, and never assert
// how fast something happened: a wait that reaches failSafe means it would never have.
const failSafe = 60 * time.Second

// loadAvg is the 1-minute load average, for the message of a wait that did not end.
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if f := strings.Fields(string(b)); err == nil && len(f) > 0 {
		return f[0]
	}
	return "unknown"
}

// notWithin is the failure message of a wait that reached failSafe.
func notWithin(what string) string {
	return fmt.Sprintf("%s did not happen within %d s (load %s)", what, int(failSafe/time.Second), loadAvg())
}

func recv[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	timer := time.NewTimer(failSafe)
	defer timer.Stop()
	select {
	case v := <-ch:
		return v
	case <-timer.C:
		t.Fatal(notWithin(what))
		panic("unreachable")
	}
}

// waitUntil polls cond (on the test's goroutine, so it may fail the test) until it holds.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(failSafe)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal(notWithin(what))
		}
		time.Sleep(5 * time.Millisecond) // the poll's pace, not a wait for anything
	}
}

// noClocks is a GroupConfig whose timeouts no test reaches (and whose committer
// therefore never gives up on its own while a test waits for it): the test decides
// when a locked row is released and when a statement ends.
var noClocks = store.GroupConfig{TryTimeout: time.Hour, LockWait: time.Hour}

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
// returns a channel that receives one value per queued request. The Before and After of
// more, if given, are installed too.
func pauseGroup(g *store.GroupCommitter, more ...store.GroupHooks) (queued <-chan struct{}, release func()) {
	q := make(chan struct{}, 1024)
	gate := make(chan struct{})
	var once sync.Once
	h := store.GroupHooks{
		Queued:  func() { q <- struct{}{} },
		Collect: func() { <-gate },
	}
	for _, m := range more {
		h.Before, h.After = m.Before, m.After
	}
	store.SetGroupHooks(g, h)
	return q, func() { once.Do(func() { close(gate) }) }
}

// okStatements records the keys of every statement that succeeded (the After hook).
type okStatements struct {
	mu   sync.Mutex
	list [][]string
}

func (s *okStatements) after(keys []string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.list = append(s.list, slices.Clone(keys))
	return nil
}

func (s *okStatements) first() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.list) == 0 {
		return nil
	}
	return s.list[0]
}

func jobState(t *testing.T, s *store.PG, key string) tasks.JobState {
	t.Helper()
	j, err := s.JobGet(context.Background(), key)
	require.NoError(t, err)
	return j.State
}

// TestGroupCommitNoHeadOfLineBlocking: a row lock held on job A by another transaction
// does not delay the commits of unrelated jobs in the same batch: they are answered by
// the batch's own statement while A's lock is still held, however long that is. A's
// commit writes nothing while its row is locked and succeeds once the lock goes; with a
// short LockWait it gives up with ErrRowBusy instead, having written nothing.
//
// Nothing here waits for time to pass or bounds how long anything takes: a committer
// that let A's lock hold up the others (waiting for the row, for LockWait or any other
// while) would leave them unanswered while the test holds the lock, and the test fails
// after failSafe.
func TestGroupCommitNoHeadOfLineBlocking(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)
	keys := []string{"a"}
	for i := range 10 {
		keys = append(keys, fmt.Sprintf("b%d", i))
	}
	startedJobs(t, s, keys...)
	startedJobs(t, s, "c")

	t.Run("OthersGoFirst", func(t *testing.T) {
		// LockWait beyond any test: A can only be answered once the test releases its row.
		g, err := s.NewGroupCommitterConfig(noClocks)
		require.NoError(t, err)
		defer g.Close()
		var stmts okStatements
		queued, release := pauseGroup(g, store.GroupHooks{After: stmts.after})

		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck // ended below; runs before g.Close on failure
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
			require.NoError(t, recv(t, bErrs, "an unrelated commit's answer while a's row is locked"))
		}
		for _, k := range keys[1:] {
			assert.Equal(t, tasks.StateComplete, jobState(t, s, k))
		}
		first := stmts.first()
		slices.Sort(first)
		assert.Equal(t, keys, first, "a and the b's went in one statement, which succeeded although a's row was locked")
		select {
		case err := <-aErr:
			t.Fatalf("the locked job was answered while its row was locked: %v", err)
		default:
		}
		assert.Equal(t, tasks.StateRunning, jobState(t, s, "a"), "nothing written while the row is locked")

		require.NoError(t, tx.Rollback(ctx))
		require.NoError(t, recv(t, aErr, "the locked job's answer once its row is free"))
		assert.Equal(t, tasks.StateComplete, jobState(t, s, "a"))
	})

	t.Run("GivesUpAfterLockWait", func(t *testing.T) {
		// A LockWait the test outlasts: it holds the row until the answer comes.
		g, err := s.NewGroupCommitterConfig(store.GroupConfig{TryTimeout: time.Hour, LockWait: 200 * time.Millisecond})
		require.NoError(t, err)
		defer g.Close()
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck // ended below
		_, err = tx.Exec(ctx, `SELECT 1 FROM jobs WHERE key = 'c' FOR UPDATE`)
		require.NoError(t, err)

		cErr := make(chan error, 1)
		go func() { _, err := g.Commit(ctx, commitParams("c", 1)); cErr <- err }()
		require.ErrorIs(t, recv(t, cErr, "the locked job's answer"), store.ErrRowBusy)
		require.NoError(t, tx.Rollback(ctx))
		assert.Equal(t, tasks.StateRunning, jobState(t, s, "c"), "nothing of the busy commit was written")
		_, err = g.Commit(ctx, commitParams("c", 1))
		require.NoError(t, err)
		assert.Equal(t, tasks.StateComplete, jobState(t, s, "c"))
	})
}

// TestGroupCommitLockedRowsRetriedApart: two rows of one batch locked by other
// transactions are each tried again on their own, beside each other: the second is
// committed as soon as its lock goes, while the first is still locked. (Tried one after
// another, the second waited for the first's LockWait and was then refused untried, its
// own wait spent from the batch on.) No clock decides: with LockWait beyond the test, a
// committer that tried them in turn would leave b unanswered until the test fails.
func TestGroupCommitLockedRowsRetriedApart(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)
	startedJobs(t, s, "a", "b")
	g, err := s.NewGroupCommitterConfig(noClocks)
	require.NoError(t, err)
	t.Cleanup(g.Close) // after the locks' rollbacks (cleanups run last first)
	queued, release := pauseGroup(g)
	t.Cleanup(release)

	lock := func(key string) pgx.Tx {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(ctx) })
		_, err = tx.Exec(ctx, `SELECT 1 FROM jobs WHERE key = $1 FOR UPDATE`, key)
		require.NoError(t, err)
		return tx
	}
	txA, txB := lock("a"), lock("b")
	aErr, bErr := make(chan error, 1), make(chan error, 1)
	go func() { _, err := g.Commit(ctx, commitParams("a", 1)); aErr <- err }()
	go func() { _, err := g.Commit(ctx, commitParams("b", 1)); bErr <- err }()
	recv(t, queued, "a queued commit")
	recv(t, queued, "a queued commit")
	release() // one batch: both rows found locked
	waitUntil(t, "both rows found locked", func() bool { return g.Stats().Busy >= 2 })
	require.NoError(t, txB.Rollback(ctx))
	require.NoError(t, recv(t, bErr, "b's answer once its row is free, a's still locked"))
	assert.Equal(t, tasks.StateComplete, jobState(t, s, "b"))
	select {
	case err := <-aErr:
		t.Fatalf("a was answered while its row was locked: %v", err)
	default:
	}
	require.NoError(t, txA.Rollback(ctx))
	require.NoError(t, recv(t, aErr, "a's answer once its row is free"))
	assert.Equal(t, tasks.StateComplete, jobState(t, s, "a"))
}

// TestGroupCommitCallerContext: a caller whose context ends gets its error at once, even
// while its request is in the committer; Close then does not wait for it.
func TestGroupCommitCallerContext(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)
	startedJobs(t, s, "a")
	g, err := s.NewGroupCommitterConfig(noClocks)
	require.NoError(t, err)
	// The locked job is tried again and again until its caller leaves: the hook must not
	// block the committer however many tries that takes.
	tried := make(chan struct{}, 1)
	store.SetGroupHooks(g, store.GroupHooks{After: func([]string) error {
		select {
		case tried <- struct{}{}:
		default:
		}
		return nil
	}})

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
// tried again; neither is reported as "nothing written" by guess. The committers here
// never time out nor give up a busy row on their own (noClocks): the resolution must come
// from the rows, whatever the box's pace.
func TestGroupCommitAmbiguousCommit(t *testing.T) {
	ctx := context.Background()

	t.Run("ReplyLostAfterCommit", func(t *testing.T) {
		s := store.New(testutil.PG(t))
		record(t, s, "s")
		startedJobs(t, s, "c")
		g, err := s.NewGroupCommitterConfig(noClocks)
		require.NoError(t, err)
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
		assert.Equal(t, 1, testutil.Count(t, s.Pool(), `SELECT attempts FROM jobs WHERE key = 's'`), "one start")
	})

	t.Run("IssuedTokenReplyLost", func(t *testing.T) {
		// A start that issues its token (Token 0) and loses its reply is recognised by its
		// owner on the jobs row: reported as started, not sent again. Without an owner it
		// can not tell its fence from a later one: it is sent again and takes the first
		// over (the first attempt's row written as lost).
		s := store.New(testutil.PG(t))
		record(t, s, "s")
		g, err := s.NewGroupCommitterConfig(noClocks)
		require.NoError(t, err)
		defer g.Close()
		var lost atomic.Int32
		store.SetGroupHooks(g, store.GroupHooks{After: func([]string) error {
			if lost.Add(1) == 1 {
				return errors.New("read tcp: connection reset by peer") // the statement ran; its reply is lost
			}
			return nil
		}})
		a, err := g.JobStart(ctx, store.AttemptStartParams{Key: "s", Worker: "w", Owner: "w/0001"})
		require.NoError(t, err)
		assert.EqualValues(t, 1, lost.Load(), "resolved by its owner, not sent again")
		assert.Equal(t, int64(1), a.Fence)
		assert.Equal(t, 1, a.AttemptNo)
		assert.False(t, a.TookOver)
		require.NoError(t, s.JobComplete(ctx, store.AttemptFinishParams{Key: "s", Token: a.Fence}))

		record(t, s, "anon")
		lost.Store(0)
		b, err := g.JobStart(ctx, store.AttemptStartParams{Key: "anon", Worker: "w"})
		require.NoError(t, err)
		assert.EqualValues(t, 2, lost.Load(), "without an owner: sent again")
		assert.Equal(t, int64(2), b.Fence)
		assert.Equal(t, 2, b.AttemptNo)
		assert.True(t, b.TookOver)
		atts, err := s.AttemptList(ctx, "anon")
		require.NoError(t, err)
		require.Len(t, atts, 2)
		assert.Equal(t, []string{store.OutcomeLost, "running"}, []string{atts[0].Outcome, atts[1].Outcome})
	})

	t.Run("LateStatementWinsTheRetry", func(t *testing.T) {
		// The first statement's connection fails after it was sent; the re-read finds the
		// job untouched, so the commit is tried again; but the first statement takes
		// effect on the server before the second try, which is refused. The caller's
		// commit did take effect: it is reported as done, not as ErrJobComplete.
		s := store.New(testutil.PG(t))
		startedJobs(t, s, "c")
		g, err := s.NewGroupCommitterConfig(noClocks)
		require.NoError(t, err)
		defer g.Close()
		var calls atomic.Int32
		late := make(chan error, 1) // the hook runs on the committer's goroutine: no require there
		store.SetGroupHooks(g, store.GroupHooks{Before: func([]string) error {
			switch calls.Add(1) {
			case 1:
				return errors.New("write tcp: broken pipe") // sent? unknown
			case 2:
				_, err := s.Commit(ctx, commitParams("c", 1)) // the first statement, late
				late <- err
			}
			return nil
		}})
		res, err := g.Commit(ctx, commitParams("c", 1))
		require.EqualValues(t, 2, calls.Load(), "tries: one whose reply was lost, one refused (commit: %v)", err)
		require.NoError(t, recv(t, late, "the late statement's answer"), "the late statement")
		require.NoError(t, err)
		assert.True(t, res.ResultInserted)
		assert.Equal(t, tasks.StateComplete, jobState(t, s, "c"))
		assert.EqualValues(t, 2, g.Stats().Resolved, "re-read after the lost reply, then after the refusal")
	})

	t.Run("BackendKilledBeforeCommit", func(t *testing.T) {
		pool := testutil.PG(t)
		s := store.New(pool)
		startedJobs(t, s, "c", "other")
		g, err := s.NewGroupCommitterConfig(noClocks)
		require.NoError(t, err)
		defer g.Close()
		// Another transaction inserts the commit's observation key (for another job, so
		// that c's row is not locked) without committing:
		// the commit's result insert waits on it, after its statement was sent.
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck // ended below; runs before g.Close on failure
		_, err = tx.Exec(ctx, `INSERT INTO results (observation_key, job_key, parser_version, data, fence) VALUES ('c', 'other', 3, '{}', 1)`)
		require.NoError(t, err)
		// The backends of this database waiting on a lock in a commit statement.
		waiters := func() []int32 {
			rows, err := pool.Query(ctx, `SELECT pid FROM pg_stat_activity WHERE datname = current_database()
				AND wait_event_type = 'Lock' AND query LIKE '%INSERT INTO results%' AND pid <> pg_backend_pid()`)
			require.NoError(t, err)
			pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
			require.NoError(t, err)
			return pids
		}

		done := make(chan error, 1)
		go func() { _, err := g.Commit(ctx, commitParams("c", 1)); done <- err }()
		var pid int32
		waitUntil(t, "the commit waiting on the uncommitted result", func() bool {
			pids := waiters()
			if len(pids) == 0 {
				return false
			}
			require.Len(t, pids, 1, "one commit statement")
			pid = pids[0]
			return true
		})
		_, err = pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid)
		require.NoError(t, err)
		// The re-read finds the job still running under the token: not written, tried
		// again; it waits on the same row until the other transaction ends.
		waitUntil(t, "the commit tried again (waiting on the same row)", func() bool {
			return slices.ContainsFunc(waiters(), func(p int32) bool { return p != pid })
		})
		select {
		case err := <-done:
			t.Fatalf("the commit was answered while the other transaction still held its row: %v", err)
		default:
		}
		require.NoError(t, tx.Rollback(ctx))
		require.NoError(t, recv(t, done, "the commit's answer"))
		assert.Equal(t, tasks.StateComplete, jobState(t, s, "c"))
		assert.Equal(t, 1, testutil.Count(t, pool, `SELECT count(*) FROM results WHERE job_key = 'c'`))
		assert.Equal(t, 1, testutil.Count(t, pool, `SELECT count(*) FROM outbox WHERE event_key = 'observed:c'`))
	})
}

// TestGroupCommitCloseDrains: Close runs every queued request and waits for the work in
// flight, including a request tried again alone because its row was locked; later calls
// fail with ErrGroupCommitterClosed.
//
// The test never checks, at the instant Close returns, what the callers' goroutines have
// passed on yet (they run when the scheduler lets them): what Close must have waited for
// is read from the rows, and the request that keeps Close waiting is held by a row lock
// the test releases only once Close can do nothing but wait for it (its loop has taken
// every queued request and waits for the work in flight). A Close that did not wait
// returns while the row is still locked, and the test fails.
func TestGroupCommitCloseDrains(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)
	const n = 30
	const locked = "d07"
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("d%02d", i)
	}
	startedJobs(t, s, keys...)
	cfg := noClocks
	cfg.MaxBatch = 4
	g, err := s.NewGroupCommitterConfig(cfg)
	require.NoError(t, err)
	defer g.Close() // on failure; a no-op after the Close below

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // ended below; runs before g.Close on failure
	_, err = tx.Exec(ctx, `SELECT 1 FROM jobs WHERE key = $1 FOR UPDATE`, locked)
	require.NoError(t, err)

	queued, release := pauseGroup(g)
	type answer struct {
		key string
		err error
	}
	lockedErr := make(chan error, 1)
	answers := make(chan answer, n-1)
	for _, k := range keys {
		go func() {
			_, err := g.Commit(ctx, commitParams(k, 1))
			if k == locked {
				lockedErr <- err
			} else {
				answers <- answer{k, err}
			}
		}()
	}
	for range n {
		recv(t, queued, "a queued commit")
	}
	closed := make(chan struct{})
	go func() { g.Close(); close(closed) }()
	// Close is called while every request is still queued.
	waitUntil(t, "Close called", func() bool { return store.GroupClosing(g) })
	release()
	for range n - 1 {
		a := recv(t, answers, "a queued commit's answer")
		require.NoError(t, a.err, a.key)
	}
	// Now the locked job is tried alone, again and again; Close must wait for it.
	waitUntil(t, "Close left with nothing but the work in flight to wait for", func() bool {
		select {
		case <-closed:
			t.Fatalf("Close returned while %s was still being tried (its row locked)", locked)
		default:
		}
		return store.GroupLoopDrained()
	})
	select {
	case err := <-lockedErr:
		t.Fatalf("%s was answered while its row was locked: %v", locked, err)
	default:
	}
	assert.Equal(t, n-1, testutil.Count(t, pool, `SELECT count(*) FROM jobs WHERE state = 'complete'`))

	require.NoError(t, tx.Rollback(ctx))
	recv(t, closed, "Close")
	// Every statement Close waited for has committed.
	assert.Equal(t, n, testutil.Count(t, pool, `SELECT count(*) FROM jobs WHERE state = 'complete'`))
	require.NoError(t, recv(t, lockedErr, "the locked job's answer"))
	_, err = g.Commit(ctx, commitParams(keys[0], 1))
	require.ErrorIs(t, err, store.ErrGroupCommitterClosed)
	g.Close() // again: no-op
}
