package scheduler_test

import (
	"context"
	"os"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/scheduler"
)

// commandCounter counts every Redis command a client sends (each of a pipeline), apart
// from a new connection's handshake.
type commandCounter struct{ n atomic.Int64 }

func (c *commandCounter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (c *commandCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if n := cmd.Name(); n != "hello" && n != "client" {
			c.n.Add(1)
		}
		return next(ctx, cmd)
	}
}
func (c *commandCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			if n := cmd.Name(); n != "hello" && n != "client" {
				c.n.Add(1)
			}
		}
		return next(ctx, cmds)
	}
}

// sweepCost is what one steady-state sweep read and sent.
type sweepCost struct {
	rows, commands, statements int64
}

// TestReconcilerSweepBounded: with 1 M pending jobs a steady-state sweep (Redis has not
// lost its data) reads as many rows and sends as many Redis commands as with 1 k, plus the
// jobs that changed: 100 changed jobs in both, and the key-order scan's slice.
// IDEMSCRAPE_SWEEP_BIG_ROWS sets the big size (default 1,000,000).
func TestReconcilerSweepBounded(t *testing.T) {
	big := 1_000_000
	if v := os.Getenv("IDEMSCRAPE_SWEEP_BIG_ROWS"); v != "" {
		n, err := strconv.Atoi(v)
		require.NoError(t, err, "IDEMSCRAPE_SWEEP_BIG_ROWS")
		big = n
	}
	const changed = 100
	cost := func(t *testing.T, n int) sweepCost {
		ctx := context.Background()
		b := setup(t)
		pool := b.st.Pool()
		// n pending jobs, last changed two days ago; keys that their specs do not derive,
		// so a job found without a task is counted for review (key_mismatch), not enqueued:
		// the cost measured is the reading, the same at both sizes.
		_, err := pool.Exec(ctx, `
INSERT INTO jobs (key, kind, source_id, country, "window", parser_version, state, created_at, updated_at)
SELECT 'bounded-' || lpad(g::text, 8, '0'), 'catalog', 'sku-' || g, 'US', '2026-01-01', 1, 'pending',
	now() - interval '2 days', now() - interval '2 days'
FROM generate_series(1, $1) AS g`, n)
		require.NoError(t, err)
		_, err = pool.Exec(ctx, `ANALYZE jobs`)
		require.NoError(t, err)
		// Redis has not lost its data since the last full check: the queue's marker holds
		// the epoch PostgreSQL records.
		won, err := b.st.RequeueMarkerReplace(ctx, b.ns.Prefix, b.ns.Queue, "", "test")
		require.NoError(t, err)
		require.True(t, won)
		require.NoError(t, b.ns.Client.HSet(ctx, scheduler.RequeueMarkerKey(b.ns.Prefix, b.ns.Queue), "epoch", "test", "seq", 0).Err())

		counter := &commandCounter{}
		rc := redis.NewClient(&redis.Options{Addr: b.ns.Addr})
		t.Cleanup(func() { _ = rc.Close() })
		rc.AddHook(counter)
		f, err := scheduler.ParseFile([]byte("kinds:\n  catalog: {queue: "+b.ns.Queue+"}\n"), "", nil)
		require.NoError(t, err)
		r, err := scheduler.NewReconciler(scheduler.ReconcilerConfig{File: f, Store: b.st, Redis: rc, Client: b.client,
			KeyPrefix: b.ns.Prefix, Logger: quietLogger()})
		require.NoError(t, err)
		// 100 of them change after the reconciler started (a failed attempt, a requeue).
		_, err = pool.Exec(ctx, `UPDATE jobs SET updated_at = now() WHERE key IN (
	SELECT key FROM jobs ORDER BY key DESC LIMIT $1)`, changed)
		require.NoError(t, err)

		rep := r.Sweep(ctx)
		require.NoError(t, rep.Err)
		assert.False(t, rep.FullRequeue)
		assert.EqualValues(t, changed+scheduler.DefaultRequeueScanPerSweep, rep.Actions[scheduler.ActionKeyMismatch],
			"the changed jobs and one scan slice were checked: %v", rep.Actions)
		c := sweepCost{rows: rep.RowsRead, commands: counter.n.Load(), statements: rep.Statements}
		t.Logf("%d pending jobs: a sweep read %d rows in %d statements and sent %d Redis commands", n, c.rows, c.statements, c.commands)
		return c
	}
	small := cost(t, 1000)
	large := cost(t, big)
	assert.LessOrEqual(t, large.rows, 2*small.rows, "rows read at %d jobs vs 1,000", big)
	assert.LessOrEqual(t, large.commands, 2*small.commands, "Redis commands at %d jobs vs 1,000", big)
	assert.LessOrEqual(t, large.statements, 2*small.statements)
}
