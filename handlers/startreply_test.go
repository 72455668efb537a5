package handlers_test

import (
	"context"
	"encoding/binary"
	"errors"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/ops"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// cancelRequestCode opens a PostgreSQL CancelRequest message (after its length).
const cancelRequestCode = 80877102

// poolDroppingCancels is testutil.PoolVia whose connections never deliver a cancel
// request: pgx, when a connection fails during a statement, asks PostgreSQL to cancel it
// through a new connection; in a partition that request is lost too, and the statement
// runs on. Here it is lost on purpose, so the statement whose connection the proxy cuts
// lands late whatever the order of the cancel and the proxy's Accept.
func poolDroppingCancels(t *testing.T, pool *pgxpool.Pool) (*pgxpool.Pool, *testutil.TCPProxy) {
	t.Helper()
	via, proxy := testutil.PoolVia(t, pool)
	cfg := via.Config().Copy()
	dial := cfg.ConnConfig.DialFunc
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &cancelDropper{Conn: c}, nil
	}
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(p.Close)
	return p, proxy
}

// cancelDropper closes its connection instead of sending a cancel request.
type cancelDropper struct {
	net.Conn
	wrote atomic.Bool
}

func (c *cancelDropper) Write(b []byte) (int, error) {
	if !c.wrote.Swap(true) && len(b) >= 8 && binary.BigEndian.Uint32(b[4:8]) == cancelRequestCode {
		_ = c.Close()
		return 0, errors.New("cancel request lost (test partition)")
	}
	return c.Conn.Write(b)
}

// TestLostStartReplyNoSelfTakeover: the attempt start's reply is lost while its statement
// lands late — a real PostgreSQL, the worker's connection cut (testutil.PoolVia's proxy)
// while the statement waits for the job's row, which the test holds; PostgreSQL runs it
// once the row is free. The worker must not take its own attempt over: the job completes
// with one attempt row (fence 1, complete), no attempt written as lost, and the
// took-over metric at 0. Before, the start sent again (by the next delivery) found the job
// running under the first send's fence, took it over as another worker's abandoned attempt
// and wrote attempt 1 as lost, reporting TookOver.
func TestLostStartReplyNoSelfTakeover(t *testing.T) {
	for _, tc := range []struct {
		name string
		// cut: the proxy refuses connections until the delivery gave up (its start sent
		// again in vain), instead of only cutting the one the statement was sent on.
		cut bool
	}{
		{name: "SentAgainInTheDelivery"},
		{name: "NextDelivery", cut: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			r := newRig(t, rigOpts{})
			pool := r.st.Pool()
			via, proxy := poolDroppingCancels(t, pool)
			metrics := prometheus.NewRegistry()
			reg := r.registry(t, func(c *handlers.Config) {
				c.Store, c.NoGroupCommit, c.Registerer = store.New(via), true, metrics
			})
			key, task := r.job(t, "sku-1")

			waiters := func() int {
				return testutil.Count(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
					AND wait_event_type = 'Lock' AND query LIKE '%AS t(key, token, worker, session_id%'`)
			}
			tx, err := pool.Begin(ctx)
			require.NoError(t, err)
			defer tx.Rollback(ctx) //nolint:errcheck // ended below; a no-op then
			_, err = tx.Exec(ctx, `SELECT 1 FROM jobs WHERE key = $1 FOR UPDATE`, key)
			require.NoError(t, err)

			done := make(chan error, 1)
			go func() { done <- reg.ProcessTask(ctx, task) }()
			handlers.WaitUntil(t, "the attempt start waiting for the job's row", 10*time.Millisecond, func() bool { return waiters() == 1 })
			proxy.Refuse() // the reply is lost; PostgreSQL still holds the statement
			if !tc.cut {
				proxy.Accept()
			}
			// The delivery sends its start again (waiting behind the first), or gives up.
			var first error
			gaveUp := false
			handlers.WaitUntil(t, "the start sent again, or the delivery ended", 10*time.Millisecond, func() bool {
				select {
				case first = <-done:
					gaveUp = true
					return true
				default:
				}
				return waiters() == 2
			})
			proxy.Accept()
			require.NoError(t, tx.Rollback(ctx)) // the first statement lands now
			if gaveUp {
				require.Error(t, first)
				require.True(t, decisionOf(first).Retry, "the task is kept: %v", first)
				handlers.WaitUntil(t, "the first start landing late", 10*time.Millisecond, func() bool {
					j, err := r.st.JobGet(ctx, key)
					require.NoError(t, err)
					return j.State == tasks.StateRunning
				})
				require.NoError(t, reg.ProcessTask(ctx, task), "the next delivery")
			} else {
				require.NoError(t, recv(t, done, "the delivery's end"))
			}

			var state string
			var fence int64
			var attempts int
			require.NoError(t, pool.QueryRow(ctx, `SELECT state, fence, attempts FROM jobs WHERE key = $1`, key).Scan(&state, &fence, &attempts))
			assert.Equal(t, "complete", state)
			assert.Equal(t, int64(1), fence, "one start raised the fence")
			assert.Equal(t, 1, attempts)
			rows, err := pool.Query(ctx, `SELECT attempt_no || '/' || fence || '/' || outcome FROM attempts WHERE job_key = $1 ORDER BY attempt_no`, key)
			require.NoError(t, err)
			var got []string
			for rows.Next() {
				var s string
				require.NoError(t, rows.Scan(&s))
				got = append(got, s)
			}
			require.NoError(t, rows.Err())
			assert.Equal(t, []string{"1/1/complete"}, got, "attempt 1 is the one that completed; none written as lost")
			assert.Zero(t, testutil.Count(t, pool, `SELECT count(*) FROM attempts WHERE outcome = 'lost' OR evidence_due`))
			assert.Zero(t, sumCounter(t, metrics, "idemscrape_jobs_completed_after_lease_recovery_total"), "no takeover reported")
			rep, err := ops.New(pool).Audit(ctx, ops.AuditConfig{TaskLive: func(context.Context, string, string) (bool, error) { return true, nil }})
			require.NoError(t, err)
			assert.True(t, rep.OK(), "%+v", rep.Broken())
		})
	}
}
