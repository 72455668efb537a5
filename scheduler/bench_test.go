package scheduler_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/scheduler"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/testutil"
)

// BenchmarkReconcileSweep: one sweep over a jobs table of `rows` rows of which `stranded`
// need the reconciler: half running under an expired lease (attempt an hour old, no lease
// in Redis), half pending without an asynq task. The rest are complete. Between sweeps the
// stranded rows are put back and the throwaway Redis flushed (not timed). Every job but
// the pending ones has its attempt row, as in production. Reports
// statements and Redis round trips per sweep and logs the EXPLAIN of both page queries.
func BenchmarkReconcileSweep(b *testing.B) {
	for _, c := range []struct{ rows, stranded int }{{1_000_000, 10_000}, {1_000_000, 1_000}, {100_000, 1_000}} {
		b.Run(fmt.Sprintf("rows=%d/stranded=%d", c.rows, c.stranded), func(b *testing.B) {
			benchSweep(b, c.rows, c.stranded, 0)
		})
	}
}

// BenchmarkReconcileSweepConcurrency is one sweep over 10,000 stranded jobs (of 100,000)
// with ReconcilerConfig.Concurrency re-enqueue batches at once (asynq enqueues one task
// per round trip).
func BenchmarkReconcileSweepConcurrency(b *testing.B) {
	for _, conc := range []int{16, 32, 64} {
		b.Run(fmt.Sprintf("concurrency=%d", conc), func(b *testing.B) {
			benchSweep(b, 100_000, 10_000, conc)
		})
	}
}

func benchSweep(b *testing.B, rows, stranded, concurrency int) {
	ctx := context.Background()
	pool := testutil.PG(b)
	st := store.New(pool)
	rs := testutil.StartRedis(b)
	rdb := rs.Client()
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: rs.Addr})
	b.Cleanup(func() { _ = client.Close() })

	// One statement: every row; stranded ones are spread over the key space (every
	// rows/stranded-th), the even ones running (their attempt described by the jobs row, as
	// since migration 00016: no attempts row until it ends), the odd ones pending; the
	// complete ones have their ended attempt's row.
	every := rows / stranded
	_, err := pool.Exec(ctx, `
WITH j AS (
	INSERT INTO jobs (key, kind, source_id, country, "window", parser_version, state, fence, attempts, completed_at, created_at,
		attempt_worker, attempt_started_at)
	SELECT 'catalog:sku-' || lpad(i::text, 8, '0') || ':US:2026-04-23:v1', 'catalog', 'sku-' || lpad(i::text, 8, '0'), 'US', '2026-04-23', 1,
		CASE WHEN i % $2 <> 0 THEN 'complete' WHEN (i / $2) % 2 = 0 THEN 'running' ELSE 'pending' END,
		CASE WHEN i % $2 <> 0 OR (i / $2) % 2 = 0 THEN 1 ELSE 0 END,
		CASE WHEN i % $2 <> 0 OR (i / $2) % 2 = 0 THEN 1 ELSE 0 END,
		CASE WHEN i % $2 <> 0 THEN now() END,
		now() - interval '2 hours',
		CASE WHEN i % $2 = 0 AND (i / $2) % 2 = 0 THEN 'dead-worker' ELSE '' END,
		CASE WHEN i % $2 = 0 AND (i / $2) % 2 = 0 THEN now() - interval '1 hour' END
	FROM generate_series(1, $1) AS i
	RETURNING key, state
)
INSERT INTO attempts (job_key, attempt_no, fence, worker, started_at, outcome, finished_at)
SELECT key, 1, 1, 'dead-worker', now() - interval '1 hour', state, now()
FROM j WHERE state = 'complete'`, rows, every)
	require.NoError(b, err)
	_, err = pool.Exec(ctx, `ANALYZE jobs; ANALYZE attempts`)
	require.NoError(b, err)

	// The page queries of store.JobsListRunning / JobsListRunnable (store/reconcile.go),
	// explained on this table.
	for name, q := range map[string]string{
		"JobsListRunning": `EXPLAIN SELECT j.key, j.kind, j.fence, j.attempts, COALESCE(j.attempt_started_at, j.updated_at), j.attempt_worker
			FROM jobs j WHERE j.state = 'running' AND j.key > ''
			AND COALESCE(j.attempt_started_at, j.updated_at) < now() - interval '35 minutes' ORDER BY j.key LIMIT 1000`,
		"JobsListRunnable": `EXPLAIN SELECT key FROM jobs WHERE state IN ('pending', 'retryable') AND key > ''
			AND (next_attempt_at IS NULL OR next_attempt_at <= now()) ORDER BY key LIMIT 1000`,
	} {
		r, err := pool.Query(ctx, q)
		require.NoError(b, err)
		var plan []string
		for r.Next() {
			var line string
			require.NoError(b, r.Scan(&line))
			plan = append(plan, line)
		}
		require.NoError(b, r.Err())
		b.Logf("EXPLAIN %s:\n%s", name, strings.Join(plan, "\n"))
		require.Contains(b, strings.Join(plan, "\n"), map[string]string{
			"JobsListRunning": "jobs_running_key_idx", "JobsListRunnable": "jobs_runnable_key_idx"}[name])
	}

	f, err := scheduler.ParseFile([]byte("kinds:\n  catalog: {max_lease: 30m}\n"), "", nil)
	require.NoError(b, err)
	rec, err := scheduler.NewReconciler(scheduler.ReconcilerConfig{File: f, Store: st, Redis: rdb, Client: client,
		Concurrency: concurrency, Logger: quietLogger()})
	require.NoError(b, err)

	reset := func() {
		_, err := pool.Exec(ctx, `
WITH s AS (
	UPDATE jobs SET state = CASE WHEN last_category = 'lease_expired' THEN 'running' ELSE state END,
		next_attempt_at = NULL, last_category = NULL
	WHERE state IN ('retryable', 'pending') RETURNING key, fence, state
)
DELETE FROM attempts a USING s WHERE a.job_key = s.key AND s.state = 'running' AND a.outcome = 'lost'`)
		require.NoError(b, err)
		require.NoError(b, rdb.FlushAll(ctx).Err())
	}
	var stmts, trips int64
	var rescue, requeue time.Duration
	b.ResetTimer()
	var redisCPU float64
	for i := 0; i < b.N; i++ {
		cpu0 := redisCPUSeconds(b, rdb)
		rep := rec.Sweep(ctx)
		redisCPU += redisCPUSeconds(b, rdb) - cpu0
		require.NoError(b, rep.Err)
		require.EqualValues(b, stranded/2, rep.Actions[scheduler.ActionRescued], "%v", rep.Actions)
		require.EqualValues(b, stranded, rep.Actions[scheduler.ActionRequeued], "%v", rep.Actions)
		stmts += rep.Statements
		trips += rep.RedisTrips
		rescue += rep.RescueTime
		requeue += rep.RequeueTime
		b.StopTimer()
		reset()
		b.StartTimer()
	}
	b.StopTimer()
	explainRescue(b, pool, st)
	reset()
	b.ReportMetric(float64(stmts)/float64(b.N), "stmts/op")
	b.ReportMetric(float64(trips)/float64(b.N), "redis-trips/op")
	b.ReportMetric(rescue.Seconds()/float64(b.N), "rescue-s/op")
	b.ReportMetric(redisCPU/float64(b.N), "redis-cpu-s/op")
	b.ReportMetric(requeue.Seconds()/float64(b.N), "requeue-s/op")
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(stranded), "ns/stranded")
}

// redisCPUSeconds is the CPU time (user + system) the Redis server has used so far.
func redisCPUSeconds(b *testing.B, rdb redis.UniversalClient) float64 {
	info, err := rdb.Info(context.Background(), "cpu").Result()
	require.NoError(b, err)
	var total float64
	for _, line := range strings.Split(info, "\r\n") {
		k, v, ok := strings.Cut(line, ":")
		if ok && (k == "used_cpu_sys" || k == "used_cpu_user") {
			f, err := strconv.ParseFloat(v, 64)
			require.NoError(b, err)
			total += f
		}
	}
	return total
}

// explainRescue logs the executed plan (auto_explain, ANALYZE) of one store.JobsRescue
// statement over a page of the stranded running jobs, and checks it reaches the rows
// through their indexes: its cost grows with the page, not with the table. It rescues
// the page; the caller resets.
func explainRescue(b *testing.B, pool *pgxpool.Pool, st *store.PG) {
	ctx := context.Background()
	page, err := st.JobsListRunning(ctx, store.JobsListParams{Limit: 1000})
	require.NoError(b, err)
	require.NotEmpty(b, page)
	cfg := pool.Config().Copy()
	cfg.MaxConns = 1
	var mu sync.Mutex
	var plans []string
	cfg.ConnConfig.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		mu.Lock()
		defer mu.Unlock()
		plans = append(plans, n.Message)
	}
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, `LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0;
			SET auto_explain.log_analyze = on; SET client_min_messages = log`)
		return err
	}
	ep, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(b, err)
	defer ep.Close()
	ps := make([]store.JobRescueParams, len(page))
	for i, j := range page {
		ps[i] = store.JobRescueParams{Key: j.Key, ExpectFence: j.Fence, Token: j.Fence + 1, Error: "explain"}
	}
	errs, err := store.New(ep).JobsRescue(ctx, ps)
	require.NoError(b, err)
	for i, e := range errs {
		require.NoError(b, e, "row %d", i)
	}
	mu.Lock()
	defer mu.Unlock()
	var plan string
	for _, p := range plans {
		if strings.Contains(p, "unnest") {
			plan = p
		}
	}
	// The plan without the statement text and with the key arrays cut short.
	if i := strings.Index(plan, "Query Text:"); i >= 0 {
		if j := strings.Index(plan[i:], "\n)\nSELECT"); j >= 0 {
			if k := strings.Index(plan[i+j:], "\n"+"Merge"); k >= 0 {
				plan = plan[:i] + plan[i+j+k+1:]
			}
		}
	}
	lines := strings.Split(plan, "\n")
	for i, l := range lines {
		if len(l) > 160 {
			lines[i] = l[:160] + "…"
		}
	}
	b.Logf("EXPLAIN ANALYZE JobsRescue (%d rows):\n%s", len(ps), strings.Join(lines, "\n"))
	require.Contains(b, plan, "jobs_pkey")
	require.Contains(b, plan, "attempts_job_key_fence_key")
	require.NotContains(b, plan, "Seq Scan on jobs")
	require.NotContains(b, plan, "Seq Scan on attempts")
}

// BenchmarkTick: one tick of a template of 10,000 sources. FirstTick enqueues a new window
// every iteration (10,000 rows and tasks); SteadyState ticks a window whose 10,000 jobs
// are all enqueued already.
func BenchmarkTick(b *testing.B) {
	const sources = 10_000
	base := time.Date(2026, 4, 23, 0, 0, 0, 0, time.UTC)
	setupTick := func(b *testing.B) (*scheduler.Scheduler, *bundle) {
		bu := setup(b)
		dir := b.TempDir()
		var sb strings.Builder
		for i := range sources {
			fmt.Fprintf(&sb, "sku-%05d\n", i)
		}
		require.NoError(b, os.WriteFile(filepath.Join(dir, "skus.txt"), []byte(sb.String()), 0o600))
		f, err := scheduler.ParseFile([]byte(`
templates:
  - name: big
    cron: "0 * * * *"
    window: hourly
    kind: catalog
    sources: {file: skus.txt}
    countries: [US]
    parser_version: 1
kinds:
  catalog: {queue: `+bu.ns.Queue+`}
`), dir, nil)
		require.NoError(b, err)
		return bu.scheduler(b, f, func() time.Time { return base }, nil), bu // windows due now, not months ago
	}
	ctx := context.Background()

	b.Run("FirstTick", func(b *testing.B) {
		s, _ := setupTick(b)
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			rep := s.Tick(ctx, "big", base.Add(time.Duration(i)*time.Hour))
			require.NoError(b, rep.Err)
			require.Equal(b, sources, rep.Outcomes["created"])
		}
	})
	b.Run("SteadyState", func(b *testing.B) {
		s, _ := setupTick(b)
		rep := s.Tick(ctx, "big", base)
		require.NoError(b, rep.Err)
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			rep := s.Tick(ctx, "big", base)
			require.NoError(b, rep.Err)
			require.Equal(b, sources, rep.Outcomes["already_queued"])
		}
	})
	b.Run("SteadyStateAllComplete", func(b *testing.B) {
		s, bu := setupTick(b)
		rep := s.Tick(ctx, "big", base)
		require.NoError(b, rep.Err)
		_, err := bu.st.Pool().Exec(ctx, `UPDATE jobs SET state = 'complete', completed_at = now()`)
		require.NoError(b, err)
		_, err = bu.ns.Client.Del(ctx, "asynq:{"+bu.ns.Queue+"}:pending").Result()
		require.NoError(b, err)
		iter := bu.ns.Client.Scan(ctx, 0, "asynq:{"+bu.ns.Queue+"}:t:*", 1000).Iterator()
		for iter.Next(ctx) {
			require.NoError(b, bu.ns.Client.Del(ctx, iter.Val()).Err())
		}
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			rep := s.Tick(ctx, "big", base)
			require.NoError(b, rep.Err)
			require.Equal(b, sources, rep.Outcomes["already_complete"])
		}
	})
}
