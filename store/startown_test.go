package store_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/ops"
	"github.com/idemscrape/idemscrape/testutil"
)

// attemptRow is what these tests read of one attempts row.
type attemptRow struct {
	No          int
	Fence       int64
	Outcome     string
	Category    string
	EvidenceDue bool
}

// attemptRows reads the job's attempts rows, by attempt number, with SQL.
func attemptRows(t *testing.T, pool *pgxpool.Pool, key string) []attemptRow {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT attempt_no, fence, outcome, COALESCE(category, ''), evidence_due
		FROM attempts WHERE job_key = $1 ORDER BY attempt_no`, key)
	require.NoError(t, err)
	defer rows.Close()
	var out []attemptRow
	for rows.Next() {
		var a attemptRow
		require.NoError(t, rows.Scan(&a.No, &a.Fence, &a.Outcome, &a.Category, &a.EvidenceDue))
		out = append(out, a)
	}
	require.NoError(t, rows.Err())
	return out
}

// jobRow is what these tests read of the jobs row.
type jobRow struct {
	State    string
	Fence    int64
	Attempts int
	Owner    string
}

func readJob(t *testing.T, pool *pgxpool.Pool, key string) jobRow {
	t.Helper()
	var j jobRow
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT state, fence, attempts, attempt_owner FROM jobs WHERE key = $1`, key).
		Scan(&j.State, &j.Fence, &j.Attempts, &j.Owner))
	return j
}

// lostReplyLandsLate sends p through a connection of its own (via a TCP proxy) while
// another transaction holds the job's row, cuts that connection once the statement waits
// for the row (PostgreSQL has it: the client's error is an unknown outcome), then lets the
// statement run: it lands although its caller got an error (an unknown outcome, checked).
func lostReplyLandsLate(t *testing.T, pool *pgxpool.Pool, p store.AttemptStartParams) {
	t.Helper()
	ctx := context.Background()
	via, proxy := testutil.PoolVia(t, pool)
	before := readJob(t, pool, p.Key)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // ended below; a no-op then
	_, err = tx.Exec(ctx, `SELECT 1 FROM jobs WHERE key = $1 FOR UPDATE`, p.Key)
	require.NoError(t, err)

	done := make(chan error, 1)
	go func() { _, err := store.New(via).JobStart(ctx, p); done <- err }()
	waitUntil(t, "the start statement waiting for the job's row", func() bool {
		return testutil.Count(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
			AND wait_event_type = 'Lock' AND query LIKE '%AS t(key, token, worker, session_id%'`) == 1
	})
	proxy.Refuse() // the reply is lost: the client's connection is cut, the server's statement waits on
	startErr := recv(t, done, "the start's error after its connection was cut")
	require.Error(t, startErr, "the connection was cut before the reply")
	require.True(t, store.OutcomeUnknown(startErr), "sent, and maybe written: %v", startErr)
	require.Equal(t, before, readJob(t, pool, p.Key), "not landed yet")
	require.NoError(t, tx.Rollback(ctx))
	waitUntil(t, "the cut statement landing late", func() bool { return readJob(t, pool, p.Key) != before })
}

// TestStartRecognisesOwnStart: a start whose reply was lost and whose statement landed
// late (a real PostgreSQL, the client's connection cut while the statement waited for the
// row) is recognised by its owner when it is sent again: no attempt row is written as lost
// for it and no takeover is reported. A start of another owner still takes over, writing
// the attempt as lost. On the code before, the second send took the first over (attempt 1
// written lost, TookOver true).
func TestStartRecognisesOwnStart(t *testing.T) {
	ctx := context.Background()

	t.Run("IssuedTokenSentAgain", func(t *testing.T) {
		pool := testutil.PG(t)
		s := store.New(pool)
		record(t, s, "j")
		p := store.AttemptStartParams{Key: "j", Worker: "w", Owner: "w/0001"}
		lostReplyLandsLate(t, pool, p)
		require.Equal(t, jobRow{State: "running", Fence: 1, Attempts: 1, Owner: "w/0001"}, readJob(t, pool, "j"))

		a, err := s.JobStart(ctx, p) // the runner sends its start again
		require.NoError(t, err)
		assert.Equal(t, int64(1), a.Fence, "the attempt the first send started")
		assert.Equal(t, 1, a.AttemptNo)
		assert.False(t, a.TookOver, "its own attempt: no takeover")
		assert.Equal(t, jobRow{State: "running", Fence: 1, Attempts: 1, Owner: "w/0001"}, readJob(t, pool, "j"))
		assert.Empty(t, attemptRows(t, pool, "j"), "no attempt row written as lost")

		_, err = s.Commit(ctx, commitParams("j", a.Fence))
		require.NoError(t, err)
		assert.Equal(t, []attemptRow{{No: 1, Fence: 1, Outcome: store.OutcomeComplete}}, attemptRows(t, pool, "j"))
		rep, err := ops.New(pool).Audit(ctx, ops.AuditConfig{TaskLive: func(context.Context, string, string) (bool, error) { return true, nil }})
		require.NoError(t, err)
		assert.True(t, rep.OK(), "%+v", rep.Broken())
	})

	t.Run("SameTokenSentAgain", func(t *testing.T) {
		// A token from a lease claim (reparse): sent again with it, the start is its own.
		pool := testutil.PG(t)
		s := store.New(pool)
		record(t, s, "j")
		p := store.AttemptStartParams{Key: "j", Token: 5, Worker: "w", Owner: "w/0002"}
		lostReplyLandsLate(t, pool, p)
		a, err := s.JobStart(ctx, p)
		require.NoError(t, err, "not refused as stale: the fence is its own")
		assert.Equal(t, int64(5), a.Fence)
		assert.Equal(t, 1, a.AttemptNo)
		assert.False(t, a.TookOver)
		assert.Equal(t, jobRow{State: "running", Fence: 5, Attempts: 1, Owner: "w/0002"}, readJob(t, pool, "j"))
		assert.Empty(t, attemptRows(t, pool, "j"))

		// The same token without the owner is another start's: refused as stale.
		_, err = s.JobStart(ctx, store.AttemptStartParams{Key: "j", Token: 5, Worker: "w"})
		require.ErrorIs(t, err, store.ErrStaleFence)
	})

	t.Run("ReclaimedTokenSentAgain", func(t *testing.T) {
		// The caller re-claimed (token 6) after its start under 5 landed unseen: the attempt
		// moves to 6, and the row of fence 5 is written as ended by its own start
		// (retryable, restarted, no evidence due), not lost, and no takeover reported.
		pool := testutil.PG(t)
		s := store.New(pool)
		record(t, s, "j")
		p := store.AttemptStartParams{Key: "j", Token: 5, Worker: "w", Owner: "w/0003"}
		lostReplyLandsLate(t, pool, p)
		p.Token = 6
		a, err := s.JobStart(ctx, p)
		require.NoError(t, err)
		assert.Equal(t, int64(6), a.Fence)
		assert.Equal(t, 2, a.AttemptNo)
		assert.False(t, a.TookOver)
		require.NoError(t, s.JobComplete(ctx, store.AttemptFinishParams{Key: "j", Token: 6}))
		assert.Equal(t, []attemptRow{
			{No: 1, Fence: 5, Outcome: store.OutcomeRetryable, Category: store.CategoryRestarted},
			{No: 2, Fence: 6, Outcome: store.OutcomeComplete},
		}, attemptRows(t, pool, "j"), "every fence the job reached has one row")
		// Its worker reporting evidence for it changes nothing: not a lost attempt.
		require.NoError(t, s.AttemptSupersede(ctx, store.AttemptSupersedeParams{Key: "j", Token: 5, Bytes: 10}))
		assert.Equal(t, store.OutcomeRetryable, attemptRows(t, pool, "j")[0].Outcome)
	})

	t.Run("OtherOwnerTakesOver", func(t *testing.T) {
		// Another delivery's start (another owner) is a real takeover: the first attempt's
		// row is written as lost, evidence due, and TookOver reported.
		pool := testutil.PG(t)
		s := store.New(pool)
		record(t, s, "j")
		lostReplyLandsLate(t, pool, store.AttemptStartParams{Key: "j", Worker: "w", Owner: "w/0004"})
		a, err := s.JobStart(ctx, store.AttemptStartParams{Key: "j", Worker: "w2", Owner: "w2/0001"})
		require.NoError(t, err)
		assert.Equal(t, int64(2), a.Fence)
		assert.True(t, a.TookOver)
		assert.Equal(t, []attemptRow{{No: 1, Fence: 1, Outcome: store.OutcomeLost, Category: "superseded", EvidenceDue: true}},
			attemptRows(t, pool, "j"))
		// That start, sent again by its owner, is its own: TookOver as it was, nothing written.
		b, err := s.JobStart(ctx, store.AttemptStartParams{Key: "j", Worker: "w2", Owner: "w2/0001"})
		require.NoError(t, err)
		assert.Equal(t, a, b)
		assert.Len(t, attemptRows(t, pool, "j"), 1)
	})

	t.Run("GroupCommitterLateLanding", func(t *testing.T) {
		// Through the group committer: the first statement's connection fails after it was
		// sent; the re-read finds the job untouched (the statement has not landed), so the
		// start is tried again; the first statement lands just before that try. The try
		// is the same start, not a takeover.
		pool := testutil.PG(t)
		s := store.New(pool)
		record(t, s, "j")
		g, err := s.NewGroupCommitterConfig(noClocks)
		require.NoError(t, err)
		defer g.Close()
		p := store.AttemptStartParams{Key: "j", Worker: "w", Owner: "w/0005"}
		var calls atomic.Int32
		late := make(chan error, 1) // the hook runs on the committer's goroutine: no require there
		store.SetGroupHooks(g, store.GroupHooks{Before: func([]string) error {
			switch calls.Add(1) {
			case 1:
				return errors.New("write tcp: broken pipe") // sent? unknown
			case 2:
				_, err := s.JobStart(ctx, p) // the first statement, landing late
				late <- err
			}
			return nil
		}})
		a, err := g.JobStart(ctx, p)
		require.NoError(t, recv(t, late, "the late statement's answer"), "the late statement")
		require.NoError(t, err)
		assert.EqualValues(t, 2, calls.Load())
		assert.Equal(t, int64(1), a.Fence)
		assert.Equal(t, 1, a.AttemptNo)
		assert.False(t, a.TookOver)
		assert.Equal(t, jobRow{State: "running", Fence: 1, Attempts: 1, Owner: "w/0005"}, readJob(t, pool, "j"))
		assert.Empty(t, attemptRows(t, pool, "j"))
	})
}

// TestOutcomeUnknown: which errors leave a statement's outcome open.
func TestOutcomeUnknown(t *testing.T) {
	assert.False(t, store.OutcomeUnknown(nil))
	assert.True(t, store.OutcomeUnknown(store.ErrOutcomeUnknown))
	assert.True(t, store.OutcomeUnknown(errors.New("read tcp: connection reset by peer")))
	assert.False(t, store.OutcomeUnknown(&store.TransitionError{Op: "JobStart", Key: "k", Err: store.ErrJobComplete}))
	assert.False(t, store.OutcomeUnknown(store.ErrRowBusy))
	assert.False(t, store.OutcomeUnknown(store.ErrGroupCommitterClosed))
}
