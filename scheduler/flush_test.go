package scheduler_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/scheduler"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestReconcilerAfterRedisFlush: jobs pending (with tasks), retryable, and running under a
// worker that was SIGKILLed mid-job; then Redis loses everything (FLUSHALL, on a throwaway
// redis-server). One reconciler sweep and a worker must complete every job exactly once,
// with fences strictly increasing across the attempts of each job.
func TestReconcilerAfterRedisFlush(t *testing.T) {
	ctx := context.Background()
	rs := testutil.StartRedis(t)
	rdb := rs.Client()
	pool := testutil.PG(t)
	st := store.New(pool)
	connOpt := asynq.RedisClientOpt{Addr: rs.Addr}
	client := asynq.NewClient(connOpt)
	t.Cleanup(func() { _ = client.Close() })
	enq, err := tasks.NewEnqueuer(client, st, &tasks.EnqueuerConfig{Queue: catalog.Kind})
	require.NoError(t, err)
	leases, err := lua.NewLeases(rdb, handlers.DefaultKeyPrefix)
	require.NoError(t, err)
	spec := func(sku string) tasks.Spec {
		return tasks.Spec{Kind: catalog.Kind, SourceID: sku, Country: "US", Window: "2026-04-23", ParserVersion: 1}
	}
	var all []string

	// Running: a worker process takes them and is SIGKILLed in the middle of the step (first,
	// so that the queue holds only these two while it runs).
	var killed []string
	for i := 8; i <= 9; i++ {
		res, err := enq.Enqueue(ctx, spec(fmt.Sprintf("sku-%d", i)))
		require.NoError(t, err)
		all = append(all, res.Key)
		killed = append(killed, res.Key)
	}
	killedFence := killWorkerMidJob(t, st, pool, rs.Addr, killed)

	// Pending: enqueued, task in Redis.
	for i := 1; i <= 4; i++ {
		res, err := enq.Enqueue(ctx, spec(fmt.Sprintf("sku-%d", i)))
		require.NoError(t, err)
		all = append(all, res.Key)
	}
	// Retryable: an attempt failed and asked for a retry.
	for i := 5; i <= 7; i++ {
		res, err := enq.Enqueue(ctx, spec(fmt.Sprintf("sku-%d", i)))
		require.NoError(t, err)
		all = append(all, res.Key)
		l, err := leases.Claim(ctx, res.Key, "earlier-worker", time.Minute, 0)
		require.NoError(t, err)
		_, err = st.JobStart(ctx, store.AttemptStartParams{Key: res.Key, Token: l.Token, Worker: "earlier-worker"})
		require.NoError(t, err)
		require.NoError(t, st.JobMarkRetryable(ctx, store.AttemptFinishParams{Key: res.Key, Token: l.Token,
			NextAttemptAt: time.Now().Add(-time.Second), Category: "network_timeout", Error: "timeout"}))
		require.NoError(t, leases.Release(ctx, l))
	}
	// Redis loses its data.
	require.NoError(t, rdb.FlushAll(ctx).Err())

	// One sweep: the killed worker's jobs are rescued (their attempts are older than the
	// kind's lease, 1ms here), every runnable job gets its task again.
	f, err := scheduler.ParseFile([]byte("kinds:\n  catalog: {max_lease: 1ms}\n"), "", nil)
	require.NoError(t, err)
	rec, err := scheduler.NewReconciler(scheduler.ReconcilerConfig{File: f, Store: st, Redis: rdb, Client: client,
		Logger: quietLogger()})
	require.NoError(t, err)
	rep := rec.Sweep(ctx)
	require.NoError(t, rep.Err)
	assert.EqualValues(t, len(killed), rep.Actions[scheduler.ActionRescued], "%v", rep.Actions)
	assert.EqualValues(t, len(all), rep.Actions[scheduler.ActionRequeued], "%v", rep.Actions)

	// A worker completes everything.
	completeAll(t, st, rdb, connOpt, all)

	for _, key := range all {
		t.Run(key, func(t *testing.T) {
			job, err := st.JobGet(ctx, key)
			require.NoError(t, err)
			assert.Equal(t, tasks.StateComplete, job.State)
			assert.Equal(t, 1, countOf(t, st, `SELECT count(*) FROM results WHERE job_key = $1`, key), "one result")
			assert.Equal(t, 1, countOf(t, st, `SELECT count(*) FROM outbox WHERE event_key = $1`, handlers.EventKey(key)), "one outbox event")
			attempts, err := st.AttemptList(ctx, key)
			require.NoError(t, err)
			require.NotEmpty(t, attempts)
			for i := 1; i < len(attempts); i++ {
				assert.Greater(t, attempts[i].Fence, attempts[i-1].Fence, "fences strictly increase: %+v", attempts)
			}
			last := attempts[len(attempts)-1]
			assert.Equal(t, store.OutcomeComplete, last.Outcome)
			assert.Equal(t, job.Fence, last.Fence)
			if f, ok := killedFence[key]; ok {
				assert.Equal(t, store.OutcomeLost, attempts[0].Outcome, "the killed attempt's row was written by its rescue")
				assert.Greater(t, last.Fence, f+1, "above the killed attempt's fence and the rescuer's token")
			}
		})
	}
}

// killWorkerMidJob runs the fixture worker (internal/testworker) on the catalog queue of
// the Redis at redisAddr until it has reached the step of every job of keys, the only
// jobs in the queue, then SIGKILLs it. The jobs stay running; it returns their fences.
// args are more flags of the worker.
func killWorkerMidJob(t *testing.T, st *store.PG, pool *pgxpool.Pool, redisAddr string, keys []string, args ...string) map[string]int64 {
	t.Helper()
	ctx := context.Background()
	bin := buildBinary(t, "github.com/idemscrape/idemscrape/internal/testworker", "testworker")
	cmd := exec.Command(bin, append([]string{"-pg", dsnOf(pool), "-redis", redisAddr, "-queue", catalog.Kind}, args...)...)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = testWriter{t}
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	stepped := map[string]bool{}
	sc := bufio.NewScanner(stdout)
	for len(stepped) < len(keys) && sc.Scan() {
		if key, ok := strings.CutPrefix(sc.Text(), "STEP "); ok {
			stepped[key] = true
		}
	}
	require.Len(t, stepped, len(keys), "the fixture worker never reached the step: %v", sc.Err())
	for _, key := range keys {
		require.True(t, stepped[key], key)
	}
	require.NoError(t, cmd.Process.Signal(syscallKill))
	_ = cmd.Wait()
	go func() { _, _ = io.Copy(io.Discard, stdout) }()
	fences := map[string]int64{}
	for _, key := range keys {
		job, err := st.JobGet(ctx, key)
		require.NoError(t, err)
		require.Equal(t, tasks.StateRunning, job.State, "killed mid-job")
		fences[key] = job.Fence
	}
	return fences
}

// completeAll runs a worker (catalog's workflow, through a fake proxy, on a fake site) on
// the catalog queue until every job of keys has completed.
func completeAll(t *testing.T, st *store.PG, rdb *redis.Client, connOpt asynq.RedisClientOpt, keys []string) {
	t.Helper()
	proxy := testutil.NewFakeProxy(t, testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: "acct", Password: "pw-flush"})
	site := testutil.NewFakeSite(t, testutil.FakeSiteConfig{})
	prov, err := sessions.NewProvider("generic", proxy.Addr, "{user}[-country-{country}]-session-{session}", "{pass}", "acct", "pw-flush", 0)
	require.NoError(t, err)
	reg, err := handlers.NewRegistry(handlers.Config{Store: st, Redis: rdb, Provider: prov,
		Collector: sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), RequestTimeout: 5 * time.Second},
		Logger:    quietLogger()})
	require.NoError(t, err)
	require.NoError(t, reg.Register(catalog.Kind, catalog.Workflow(site.URL), catalog.Parse))
	done := make(chan string, len(keys)*2)
	srv := asynq.NewServer(connOpt, reg.ServerConfig(asynq.Config{Queues: map[string]int{catalog.Kind: 1}, Concurrency: 4,
		LogLevel: asynq.ErrorLevel}))
	require.NoError(t, srv.Start(asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		err := reg.ProcessTask(ctx, task)
		if err == nil {
			p, _ := tasks.DecodePayload(task.Payload(), nil)
			done <- p.Key
		}
		return err
	})))
	completed := map[string]int{}
	timeout := time.After(2 * time.Minute) // a guard against a hang, not a timing assert
	for len(completed) < len(keys) {
		select {
		case key := <-done:
			completed[key]++
		case <-timeout:
			t.Fatalf("completed %d of %d jobs: %v", len(completed), len(keys), completed)
		}
	}
	srv.Shutdown()
	reg.Close()
}

func countOf(t *testing.T, st *store.PG, q string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, st.Pool().QueryRow(context.Background(), q, args...).Scan(&n))
	return n
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
