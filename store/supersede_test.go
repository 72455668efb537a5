package store_test

import (
	"context"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// attemptEvidence is what AttemptSupersede writes on an attempt row.
type attemptEvidence struct {
	Outcome, Category, SessionID, ProxyEndpoint, Error string
	HTTPStatus                                         int
	Bytes                                              int64
	Finished                                           bool
}

func evidenceOf(t *testing.T, s *store.PG, key string, attemptNo int) attemptEvidence {
	t.Helper()
	atts, err := s.AttemptList(context.Background(), key)
	require.NoError(t, err)
	require.GreaterOrEqual(t, len(atts), attemptNo)
	a := atts[attemptNo-1]
	return attemptEvidence{Outcome: a.Outcome, Category: a.Category, SessionID: a.SessionID, ProxyEndpoint: a.ProxyEndpoint,
		Error: a.Error, HTTPStatus: a.HTTPStatus, Bytes: a.Bytes, Finished: a.FinishedAt != nil}
}

// TestSupersededBytesCounted: a worker whose commit or finish is refused because its job
// moved on records the bytes it transferred with AttemptSupersede; they reach the attempt
// row and jobs.bytes_total exactly once, and the job's state and fence are untouched.
func TestSupersededBytesCounted(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)

	stale := func(key string, token int64) store.AttemptSupersedeParams {
		return store.AttemptSupersedeParams{Key: key, Token: token, Bytes: 700, HTTPStatus: 503,
			SessionID: "sessa001", ProxyEndpoint: "gw2.example:7777", Error: "commit refused: stale fencing token\x00"}
	}

	t.Run("TakeoverThenRefusedCommit", func(t *testing.T) {
		const key = "sup-takeover"
		record(t, s, key)
		_, err := start(ctx, s, key, 3) // worker A
		require.NoError(t, err)
		_, err = start(ctx, s, key, 4) // worker B takes over after A's lease expired
		require.NoError(t, err)
		_, err = s.Commit(ctx, commitParams(key, 3))
		require.ErrorIs(t, err, store.ErrStaleFence, "A's commit is refused")

		for i := 0; i < 2; i++ { // a retried call counts once
			require.NoError(t, s.AttemptSupersede(ctx, stale(key, 3)))
			assert.Equal(t, attemptEvidence{Outcome: "superseded", Category: "superseded", SessionID: "sessa001",
				ProxyEndpoint: "gw2.example:7777", Error: "commit refused: stale fencing token", HTTPStatus: 503, Bytes: 700, Finished: true},
				evidenceOf(t, s, key, 1), "call %d", i+1)
			assert.Equal(t, jobView{tasks.StateRunning, 4, 2, "", 700}, view(t, s, key), "call %d: only bytes_total changes", i+1)
		}
		assert.Equal(t, "running", evidenceOf(t, s, key, 2).Outcome, "B's attempt is untouched")

		_, err = s.Commit(ctx, commitParams(key, 4)) // 2048 bytes
		require.NoError(t, err)
		assert.Equal(t, int64(700+2048), view(t, s, key).Bytes)
		require.NoError(t, s.AttemptSupersede(ctx, stale(key, 3)))
		assert.Equal(t, int64(700+2048), view(t, s, key).Bytes, "a call after the job completed counts nothing again")
		st, err := s.StatsGet(ctx)
		require.NoError(t, err)
		assert.Equal(t, float64(700+2048), st.BytesPerLogicalJob, "bytes per logical job include the duplicate work")
	})

	t.Run("RescueThenRefusedCommit", func(t *testing.T) {
		const key = "sup-rescue"
		record(t, s, key)
		_, err := start(ctx, s, key, 5)
		require.NoError(t, err)
		require.NoError(t, s.JobRescue(ctx, store.JobRescueParams{Key: key, ExpectFence: 5, Token: 6, Error: "lease expired"}))
		_, err = s.Commit(ctx, commitParams(key, 5))
		require.ErrorIs(t, err, store.ErrStaleFence)
		for i := 0; i < 2; i++ {
			require.NoError(t, s.AttemptSupersede(ctx, stale(key, 5)))
			// The row the reconciler wrote (lost, lease_expired, its error) becomes
			// superseded with its category and error kept; the worker's evidence is added.
			assert.Equal(t, attemptEvidence{Outcome: "superseded", Category: "lease_expired", SessionID: "sessa001",
				ProxyEndpoint: "gw2.example:7777", Error: "lease expired", HTTPStatus: 503, Bytes: 700, Finished: true},
				evidenceOf(t, s, key, 1), "call %d", i+1)
			assert.Equal(t, jobView{tasks.StateRetryable, 6, 1, "lease_expired", 700}, view(t, s, key), "call %d", i+1)
		}
	})

	t.Run("RunningAttemptBecomesSuperseded", func(t *testing.T) {
		// An attempt row still running under a job that moved on (rows written before
		// migration 3, when a closing statement did not mark them, or a start before
		// migration 16 wrote them): it becomes superseded.
		const key = "sup-running"
		record(t, s, key)
		_, err := start(ctx, s, key, 2)
		require.NoError(t, err)
		_, err = pool.Exec(ctx, `INSERT INTO attempts (job_key, attempt_no, fence, proxy_endpoint) VALUES ($1, 1, 2, 'gw.example:7777')`, key)
		require.NoError(t, err)
		_, err = pool.Exec(ctx, `UPDATE jobs SET state = 'retryable', fence = 9 WHERE key = $1`, key)
		require.NoError(t, err)
		p := stale(key, 2)
		p.Category, p.Error = "lease_lost", ""
		require.NoError(t, s.AttemptSupersede(ctx, p))
		require.NoError(t, s.AttemptSupersede(ctx, p))
		assert.Equal(t, attemptEvidence{Outcome: "superseded", Category: "lease_lost", SessionID: "sessa001",
			ProxyEndpoint: "gw2.example:7777", HTTPStatus: 503, Bytes: 700, Finished: true}, evidenceOf(t, s, key, 1))
		assert.Equal(t, jobView{tasks.StateRetryable, 9, 1, "", 700}, view(t, s, key))
	})

	t.Run("ConcurrentCallsCountOnce", func(t *testing.T) {
		const key = "sup-concurrent"
		record(t, s, key)
		_, err := start(ctx, s, key, 1)
		require.NoError(t, err)
		_, err = start(ctx, s, key, 2)
		require.NoError(t, err)
		const callers = 8
		release := make(chan struct{})
		errs := make(chan error, callers)
		var wg sync.WaitGroup
		for i := 0; i < callers; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-release
				errs <- s.AttemptSupersede(ctx, stale(key, 1))
			}()
		}
		close(release)
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(t, err)
		}
		assert.Equal(t, int64(700), view(t, s, key).Bytes)
		assert.Equal(t, int64(700), evidenceOf(t, s, key, 1).Bytes)
	})

	t.Run("WritesNothing", func(t *testing.T) {
		// The live attempt, an attempt its own worker finished, and an attempt that was
		// never recorded (a start lost in a crash) are left alone.
		record(t, s, "sup-live")
		_, err := start(ctx, s, "sup-live", 3)
		require.NoError(t, err)
		record(t, s, "sup-finished")
		_, err = start(ctx, s, "sup-finished", 1)
		require.NoError(t, err)
		p := finish("sup-finished", 1)
		p.Category, p.NextAttemptAt = "timeout", testNow(t, s)
		require.NoError(t, s.JobMarkRetryable(ctx, p))
		record(t, s, "sup-lost")

		cases := []struct {
			name string
			p    store.AttemptSupersedeParams
			want error
		}{
			{"LiveAttempt", stale("sup-live", 3), store.ErrAttemptLive},
			{"FinishedByItsWorker", stale("sup-finished", 1), nil},
			{"NoSuchAttempt", stale("sup-lost", 7), nil},
			{"NoSuchJob", stale("sup-nope", 1), nil},
		}
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				jobs := testutil.TableSnapshot(t, pool, "jobs")
				atts := testutil.TableSnapshot(t, pool, "attempts")
				err := s.AttemptSupersede(ctx, tc.p)
				if tc.want == nil {
					require.NoError(t, err)
				} else {
					require.ErrorIs(t, err, tc.want)
				}
				if diff := cmp.Diff(jobs, testutil.TableSnapshot(t, pool, "jobs")); diff != "" {
					t.Fatalf("jobs changed (-before +after):\n%s", diff)
				}
				if diff := cmp.Diff(atts, testutil.TableSnapshot(t, pool, "attempts")); diff != "" {
					t.Fatalf("attempts changed (-before +after):\n%s", diff)
				}
			})
		}
	})

	t.Run("BadInput", func(t *testing.T) {
		for field, p := range map[string]store.AttemptSupersedeParams{
			"Key":        {Token: 1},
			"Token":      {Key: "k", Token: 0},
			"Bytes":      {Key: "k", Token: 1, Bytes: -1},
			"HTTPStatus": {Key: "k", Token: 1, HTTPStatus: -1},
		} {
			require.ErrorContains(t, s.AttemptSupersede(ctx, p), field)
		}
		// A credential in the endpoint is refused by the table; the error does not echo it.
		record(t, s, "sup-cred")
		_, err := start(ctx, s, "sup-cred", 1)
		require.NoError(t, err)
		_, err = start(ctx, s, "sup-cred", 2)
		require.NoError(t, err)
		before := testutil.TableSnapshot(t, pool, "jobs")
		p := stale("sup-cred", 1)
		p.ProxyEndpoint = "user:secret@gw:1"
		err = s.AttemptSupersede(ctx, p)
		require.Error(t, err)
		require.NotContains(t, err.Error(), "secret")
		require.Equal(t, before, testutil.TableSnapshot(t, pool, "jobs"), "bytes_total not raised when the attempt update fails")
	})
}
