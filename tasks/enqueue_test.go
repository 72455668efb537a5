package tasks_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

type enqueueBundle struct {
	store  *store.PG
	ns     *testutil.RedisNS
	client *asynq.Client
	insp   *asynq.Inspector
	enq    *tasks.Enqueuer
}

func setupEnqueue(t testing.TB) *enqueueBundle { return setupEnqueueWith(t, false) }

// setupEnqueueFast is setupEnqueue with EnqueuerConfig.Redis: the duplicate fast path on.
func setupEnqueueFast(t testing.TB) *enqueueBundle { return setupEnqueueWith(t, true) }

func setupEnqueueWith(t testing.TB, fast bool) *enqueueBundle {
	t.Helper()
	pg := store.New(testutil.PG(t))
	ns := testutil.Redis(t)
	client := asynq.NewClient(ns.AsynqOpt())
	t.Cleanup(func() { _ = client.Close() })
	insp := asynq.NewInspector(ns.AsynqOpt())
	t.Cleanup(func() { _ = insp.Close() })
	cfg := &tasks.EnqueuerConfig{Queue: ns.Queue, Inspector: insp}
	if fast {
		cfg.Redis = ns.Client
	}
	enq, err := tasks.NewEnqueuer(client, pg, cfg)
	require.NoError(t, err)
	return &enqueueBundle{store: pg, ns: ns, client: client, insp: insp, enq: enq}
}

// bothPaths runs test with the enqueuer without and with EnqueuerConfig.Redis: every
// outcome must be the same on the duplicate fast path.
func bothPaths(t *testing.T, test func(t *testing.T, setupEnqueue func(testing.TB) *enqueueBundle)) {
	t.Run("ThroughAsynq", func(t *testing.T) { test(t, setupEnqueue) })
	t.Run("FastPath", func(t *testing.T) { test(t, setupEnqueueFast) })
}

var productSpec = tasks.Spec{
	Kind: "catalog", URL: "https://Shop.Example.com:443/p/sku-42?b=2&a=1&utm_source=mail#reviews",
	Country: "US", Window: "2026-04-23", ParserVersion: 3,
}

// enqueueProduct enqueues productSpec with the bundle's enqueuer and requires the outcome.
func enqueueProduct(t *testing.T, b *enqueueBundle, want tasks.Outcome, msgAndArgs ...any) tasks.Result {
	t.Helper()
	res, err := b.enq.Enqueue(context.Background(), productSpec)
	require.NoError(t, err)
	require.Equal(t, want, res.Outcome, msgAndArgs...)
	return res
}

// assertTaskState checks the state of the asynq task of the job key.
func assertTaskState(t *testing.T, b *enqueueBundle, key string, want asynq.TaskState, msgAndArgs ...any) {
	t.Helper()
	info, err := b.insp.GetTaskInfo(b.ns.Queue, key)
	require.NoError(t, err)
	assert.Equal(t, want, info.State, msgAndArgs...)
}

// runUntilComplete runs a real asynq server on the bundle's queue whose handler completes
// the job in Postgres, as the runner will, and waits until asynq has deleted the task
// (Retention(0) frees the task id when the handler succeeds).
func runUntilComplete(t *testing.T, b *enqueueBundle, key string) {
	t.Helper()
	handled := make(chan struct{}, 1)
	srv := asynq.NewServer(b.ns.AsynqOpt(), asynq.Config{
		Queues: map[string]int{b.ns.Queue: 1}, Concurrency: 1, LogLevel: asynq.FatalLevel,
	})
	mux := asynq.NewServeMux()
	mux.HandleFunc("catalog", func(ctx context.Context, task *asynq.Task) error {
		p, err := tasks.DecodePayload(task.Payload(), nil)
		if err != nil {
			return err
		}
		if _, err := b.store.JobStart(ctx, store.AttemptStartParams{Key: p.Key, Token: 1}); err != nil {
			return err
		}
		if err := b.store.JobComplete(ctx, store.AttemptFinishParams{Key: p.Key, Token: 1}); err != nil {
			return err
		}
		handled <- struct{}{}
		return nil
	})
	require.NoError(t, srv.Start(mux))
	defer srv.Shutdown()
	select {
	case <-handled:
	case <-time.After(30 * time.Second):
		t.Fatal("asynq server did not run the task")
	}
	// asynq deletes the task right after the handler returns; wait for that, not a timer.
	deadline := time.Now().Add(30 * time.Second)
	for b.ns.AsynqTaskExists(t, key) {
		if time.Now().After(deadline) {
			t.Fatal("asynq did not delete the completed task")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestEnqueueConcurrentDuplicates(t *testing.T) { bothPaths(t, testEnqueueConcurrentDuplicates) }

func testEnqueueConcurrentDuplicates(t *testing.T, setupEnqueue func(testing.TB) *enqueueBundle) {
	ctx := context.Background()
	b := setupEnqueue(t)

	// The same logical job written 50 ways (host case, default port, parameter order,
	// tracking parameters, fragment), enqueued concurrently.
	variants := []string{
		"https://Shop.Example.com:443/p/sku-42?b=2&a=1&utm_source=mail#reviews",
		"https://shop.example.com/p/sku-42?a=1&b=2",
		"HTTPS://SHOP.EXAMPLE.COM/p/sku-42?a=1&b=2&gclid=xyz",
		"https://shop.example.com/p/sku-42?b=2&a=1#top",
		"https://shop.example.com:443/p/%73ku-42?a=1&fbclid=1&b=2",
	}
	const goroutines = 50
	results := make([]tasks.Result, goroutines)
	errs := make([]error, goroutines)
	var wg sync.WaitGroup
	for i := 0; i < goroutines; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s := productSpec
			s.URL = variants[i%len(variants)]
			s.Meta = map[string]string{"request_id": fmt.Sprint(i)} // volatile: not in the key
			results[i], errs[i] = b.enq.Enqueue(ctx, s)
		}()
	}
	wg.Wait()

	counts := map[tasks.Outcome]int{}
	for i := range results {
		require.NoError(t, errs[i])
		require.Equal(t, results[0].Key, results[i].Key, "variant %d got another key", i)
		counts[results[i].Outcome]++
	}
	// One caller created the row. A non-creator that reaches asynq before the creator
	// enqueues the task itself (Requeued) and the creator then finds it queued; exactly one
	// task exists either way.
	require.Equal(t, 1, counts[tasks.Created], "outcomes: %v", counts)
	require.LessOrEqual(t, counts[tasks.Requeued], 1, "outcomes: %v", counts)
	require.Equal(t, goroutines, counts[tasks.Created]+counts[tasks.Requeued]+counts[tasks.AlreadyQueued], "outcomes: %v", counts)
	key := results[0].Key
	require.Equal(t, 1, testutil.Count(t, b.store.Pool(), `SELECT count(*) FROM jobs`))
	require.Equal(t, 1, b.ns.AsynqPending(t), "exactly one asynq task")
	require.True(t, b.ns.AsynqTaskExists(t, key), "the task id is the job key")

	runUntilComplete(t, b, key)

	for i := 0; i < 3; i++ {
		res := enqueueProduct(t, b, tasks.AlreadyComplete)
		require.Equal(t, tasks.StateComplete, res.State)
	}
	require.False(t, b.ns.AsynqTaskExists(t, key), "a complete job is not enqueued again")
	require.Zero(t, b.ns.AsynqPending(t))
	require.Equal(t, 1, testutil.Count(t, b.store.Pool(), `SELECT count(*) FROM jobs`))
}

func TestEnqueueOutcomes(t *testing.T) { bothPaths(t, testEnqueueOutcomes) }

func testEnqueueOutcomes(t *testing.T, setupEnqueue func(testing.TB) *enqueueBundle) {
	ctx := context.Background()

	t.Run("RequeuedWhenTaskLost", func(t *testing.T) {
		b := setupEnqueue(t)
		res := enqueueProduct(t, b, tasks.Created)
		// Redis loses the task (flush, failover): the row is still pending.
		require.NoError(t, b.insp.DeleteTask(b.ns.Queue, res.Key))
		enqueueProduct(t, b, tasks.Requeued)
		require.Equal(t, 1, b.ns.AsynqPending(t))
	})

	t.Run("RedisDownAfterRowThenRecovered", func(t *testing.T) {
		b := setupEnqueue(t)
		// An asynq client whose Redis refuses connections: the row is written, the task
		// is not, and the error says so.
		dead := asynq.NewClient(asynq.RedisClientOpt{Addr: "127.0.0.1:1", DialTimeout: 200 * time.Millisecond})
		defer dead.Close()
		enqDead, err := tasks.NewEnqueuer(dead, b.store, &tasks.EnqueuerConfig{Queue: b.ns.Queue})
		require.NoError(t, err)
		_, err = enqDead.Enqueue(ctx, productSpec)
		require.Error(t, err)
		require.Equal(t, 1, testutil.Count(t, b.store.Pool(), `SELECT count(*) FROM jobs WHERE state = 'pending'`))
		require.Zero(t, b.ns.AsynqPending(t))

		enqueueProduct(t, b, tasks.Requeued, "the pending row without a task gets its task")
		require.Equal(t, 1, b.ns.AsynqPending(t))
	})

	t.Run("FailedJobNotEnqueued", func(t *testing.T) {
		b := setupEnqueue(t)
		res := enqueueProduct(t, b, tasks.Created)
		require.NoError(t, b.insp.DeleteTask(b.ns.Queue, res.Key))
		_, err := b.store.JobStart(ctx, store.AttemptStartParams{Key: res.Key, Token: 1})
		require.NoError(t, err)
		require.NoError(t, b.store.JobFail(ctx, store.AttemptFinishParams{Key: res.Key, Token: 1, Category: "proxy_auth"}))
		enqueueProduct(t, b, tasks.AlreadyFailed)
		require.Zero(t, b.ns.AsynqPending(t))
	})

	t.Run("ManyInvalidStoresNothing", func(t *testing.T) {
		b := setupEnqueue(t)
		bad := productSpec
		bad.Country = "XX"
		_, err := b.enq.EnqueueMany(ctx, []tasks.Spec{productSpec, bad})
		require.ErrorIs(t, err, tasks.ErrInvalidSpec)
		require.ErrorContains(t, err, "spec 1")
		require.ErrorContains(t, err, "Country")
		require.Zero(t, testutil.Count(t, b.store.Pool(), `SELECT count(*) FROM jobs`))
		require.Zero(t, b.ns.AsynqPending(t))
	})

	t.Run("ManyMixed", func(t *testing.T) {
		b := setupEnqueue(t)
		other := productSpec
		other.Country = "DE"
		first, err := b.enq.Enqueue(ctx, productSpec)
		require.NoError(t, err)
		res, err := b.enq.EnqueueMany(ctx, []tasks.Spec{productSpec, other, other})
		require.NoError(t, err)
		require.Equal(t, []tasks.Outcome{tasks.AlreadyQueued, tasks.Created, tasks.AlreadyQueued},
			[]tasks.Outcome{res[0].Outcome, res[1].Outcome, res[2].Outcome})
		require.Equal(t, first.Key, res[0].Key)
		require.NotEqual(t, res[0].Key, res[1].Key)
		require.Equal(t, 2, b.ns.AsynqPending(t))
		require.Equal(t, 2, testutil.Count(t, b.store.Pool(), `SELECT count(*) FROM jobs`))
	})

	t.Run("PayloadKeyMustMatchSpec", func(t *testing.T) {
		_, err := tasks.DecodePayload([]byte(`{"key":"catalog:forged","spec":{"Kind":"catalog","SourceID":"a","Country":"US","Window":"w","ParserVersion":1}}`), nil)
		require.ErrorContains(t, err, "does not match")
	})
}

func TestEnqueueRepairsArchivedTask(t *testing.T) { bothPaths(t, testEnqueueRepairsArchivedTask) }

func testEnqueueRepairsArchivedTask(t *testing.T, setupEnqueue func(testing.TB) *enqueueBundle) {
	ctx := context.Background()
	other := productSpec
	other.Country = "DE"

	// archived enqueues spec, then archives its task as asynq does on SkipRetry or
	// MaxRetry: the job row stays pending, the task id stays taken.
	archived := func(t *testing.T, b *enqueueBundle) string {
		t.Helper()
		res := enqueueProduct(t, b, tasks.Created)
		require.NoError(t, b.insp.ArchiveTask(b.ns.Queue, res.Key))
		info, err := b.insp.GetTaskInfo(b.ns.Queue, res.Key)
		require.NoError(t, err)
		require.Equal(t, asynq.TaskStateArchived, info.State)
		require.Zero(t, b.ns.AsynqPending(t))
		return res.Key
	}

	t.Run("Enqueue", func(t *testing.T) {
		b := setupEnqueue(t)
		key := archived(t, b)
		res := enqueueProduct(t, b, tasks.Repaired)
		assert.Equal(t, "repaired: archived task deleted and enqueued again", res.Outcome.String())
		assert.Equal(t, tasks.StatePending, res.State)
		assertTaskState(t, b, key, asynq.TaskStatePending)
		assert.Equal(t, 1, b.ns.AsynqPending(t))

		// Repaired once: the next Enqueue finds the live task.
		enqueueProduct(t, b, tasks.AlreadyQueued)
		assert.Equal(t, 1, b.ns.AsynqPending(t))
	})

	t.Run("EnqueueMany", func(t *testing.T) {
		b := setupEnqueue(t)
		key := archived(t, b)
		res, err := b.enq.EnqueueMany(ctx, []tasks.Spec{other, productSpec, productSpec})
		require.NoError(t, err)
		assert.Equal(t, []tasks.Outcome{tasks.Created, tasks.Repaired, tasks.AlreadyQueued},
			[]tasks.Outcome{res[0].Outcome, res[1].Outcome, res[2].Outcome})
		assertTaskState(t, b, key, asynq.TaskStatePending)
		assertTaskState(t, b, res[0].Key, asynq.TaskStatePending)
		assert.Equal(t, 2, b.ns.AsynqPending(t))
	})

	t.Run("RetryableJobRepaired", func(t *testing.T) {
		b := setupEnqueue(t)
		key := archived(t, b)
		_, err := b.store.JobStart(ctx, store.AttemptStartParams{Key: key, Token: 1})
		require.NoError(t, err)
		require.NoError(t, b.store.JobMarkRetryable(ctx, store.AttemptFinishParams{Key: key, Token: 1, Category: "timeout", NextAttemptAt: time.Now()}))
		res := enqueueProduct(t, b, tasks.Repaired)
		assert.Equal(t, tasks.StateRetryable, res.State)
		assert.True(t, b.ns.AsynqTaskExists(t, key))
		info, err := b.insp.GetTaskInfo(b.ns.Queue, key)
		require.NoError(t, err)
		assert.NotEqual(t, asynq.TaskStateArchived, info.State)
	})

	t.Run("FailedJobArchiveLeftAlone", func(t *testing.T) {
		b := setupEnqueue(t)
		key := archived(t, b)
		_, err := b.store.JobStart(ctx, store.AttemptStartParams{Key: key, Token: 1})
		require.NoError(t, err)
		require.NoError(t, b.store.JobFail(ctx, store.AttemptFinishParams{Key: key, Token: 1, Category: "not_found"}))
		enqueueProduct(t, b, tasks.AlreadyFailed)
		assertTaskState(t, b, key, asynq.TaskStateArchived, "a failed job's archive is evidence, not repaired")
	})

	t.Run("WithoutInspectorReportsAlreadyQueued", func(t *testing.T) {
		b := setupEnqueue(t)
		key := archived(t, b)
		blind, err := tasks.NewEnqueuer(b.client, b.store, &tasks.EnqueuerConfig{Queue: b.ns.Queue})
		require.NoError(t, err)
		res, err := blind.Enqueue(ctx, productSpec)
		require.NoError(t, err)
		assert.Equal(t, tasks.AlreadyQueued, res.Outcome, "documented limit without an Inspector")
		assertTaskState(t, b, key, asynq.TaskStateArchived)
	})
}

func TestEnqueueRefusesDestination(t *testing.T) {
	ctx := context.Background()
	b := setupEnqueue(t)
	for _, u := range []string{
		"http://127.0.0.1:8080/p", "http://2130706433/", "http://localhost/", "https://user:hunter2@[::1]/",
		"http://shop.example.com:6379/", "http://169.254.169.254/latest/meta-data/",
	} {
		t.Run(u, func(t *testing.T) {
			s := productSpec
			s.URL = u
			_, err := b.enq.EnqueueMany(ctx, []tasks.Spec{productSpec, s})
			require.ErrorIs(t, err, tasks.ErrInvalidSpec)
			var fe *tasks.FieldError
			require.ErrorAs(t, err, &fe)
			assert.Equal(t, "URL", fe.Field)
			assert.ErrorContains(t, err, "spec 1")
			assert.NotContains(t, err.Error(), "hunter2")
		})
	}
	require.Zero(t, testutil.Count(t, b.store.Pool(), `SELECT count(*) FROM jobs`), "a refused URL is never stored")
	require.Zero(t, b.ns.AsynqPending(t))

	// The one explicit relaxation: loopback on any port.
	loop, err := tasks.NewEnqueuer(b.client, b.store, &tasks.EnqueuerConfig{Queue: b.ns.Queue, Destinations: tasks.LoopbackPolicy()})
	require.NoError(t, err)
	s := productSpec
	s.URL = "http://127.0.0.1:39999/p"
	res, err := loop.Enqueue(ctx, s)
	require.NoError(t, err)
	assert.Equal(t, tasks.Created, res.Outcome)
}

func BenchmarkEnqueue(b *testing.B) {
	ctx := context.Background()
	bb := setupEnqueue(b)
	spec := productSpec
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		spec.URL = fmt.Sprintf("https://shop.example.com/p/sku-%d", i)
		res, err := bb.enq.Enqueue(ctx, spec)
		if err != nil || res.Outcome != tasks.Created {
			b.Fatalf("enqueue %d: %v %v", i, res.Outcome, err)
		}
	}
}

func BenchmarkEnqueueDuplicate(b *testing.B) {
	ctx := context.Background()
	bb := setupEnqueue(b)
	if _, err := bb.enq.Enqueue(ctx, productSpec); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		res, err := bb.enq.Enqueue(ctx, productSpec)
		if err != nil || res.Outcome != tasks.AlreadyQueued {
			b.Fatalf("enqueue %d: %v %v", i, res.Outcome, err)
		}
	}
	b.StopTimer()
	// Dead tuples: backends flush their statistics when they exit, so close the pool first.
	pool := bb.store.Pool()
	dsn := pool.Config().ConnString()
	db := pool.Config().ConnConfig.Database
	pool.Close()
	b.ReportMetric(float64(deadTuples(b, dsn, db)), "dead-tuples")
}

// deadTuples reads n_dead_tup of the jobs table of database db after the backends that
// wrote it have exited and flushed their statistics.
func deadTuples(b *testing.B, dsn, db string) int64 {
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		b.Fatal(err)
	}
	cfg.Database = db
	conn, err := pgx.ConnectConfig(context.Background(), cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close(context.Background())
	time.Sleep(time.Second) // exiting backends flush asynchronously to us
	var n int64
	if err := conn.QueryRow(context.Background(),
		`SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'jobs'`).Scan(&n); err != nil {
		b.Fatal(err)
	}
	return n
}

// asynqCalls counts the commands asynq's client sends (EVALSHA/EVAL: one per task enqueue).
type asynqCalls struct{ scripts atomic.Int64 }

func (h *asynqCalls) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *asynqCalls) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if n := strings.ToLower(cmd.Name()); n == "evalsha" || n == "eval" {
			h.scripts.Add(1)
		}
		return next(ctx, cmd)
	}
}
func (h *asynqCalls) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestEnqueueDuplicateFastPath: with EnqueuerConfig.Redis, a batch of duplicates whose
// tasks are live asks asynq nothing (one pipelined read of the task states), complete and
// failed jobs touch no Redis, and only the jobs without a live task (lost: Requeued;
// archived: Repaired; new: Created) go through asynq. Fails without the fast path: every
// duplicate then costs an asynq enqueue script.
func TestEnqueueDuplicateFastPath(t *testing.T) {
	ctx := context.Background()
	b := setupEnqueue(t)
	calls := &asynqCalls{}
	rdb := redis.NewClient(&redis.Options{Addr: b.ns.Addr})
	rdb.AddHook(calls)
	t.Cleanup(func() { _ = rdb.Close() })
	client := asynq.NewClientFromRedisClient(rdb)
	enq, err := tasks.NewEnqueuer(client, b.store, &tasks.EnqueuerConfig{Queue: b.ns.Queue, Inspector: b.insp, Redis: b.ns.Client})
	require.NoError(t, err)

	specs := make([]tasks.Spec, 8)
	for i := range specs {
		specs[i] = tasks.Spec{Kind: "catalog", SourceID: fmt.Sprintf("sku-%d", i), Country: "US", Window: "2026-04-23", ParserVersion: 1}
	}
	first, err := enq.EnqueueMany(ctx, specs)
	require.NoError(t, err)
	for _, r := range first {
		require.Equal(t, tasks.Created, r.Outcome)
	}
	require.EqualValues(t, len(specs), calls.scripts.Load(), "one asynq enqueue per new job")

	calls.scripts.Store(0)
	again, err := enq.EnqueueMany(ctx, specs)
	require.NoError(t, err)
	for _, r := range again {
		require.Equal(t, tasks.AlreadyQueued, r.Outcome)
	}
	require.Zero(t, calls.scripts.Load(), "live duplicates are answered without asynq")
	require.Equal(t, len(specs), b.ns.AsynqPending(t))

	// 0: task lost; 1: task archived; 2: complete (its task done); 3: failed (its task
	// done); 4: still live; 5: given twice; plus a new spec.
	keys := make([]string, len(first))
	for i, r := range first {
		keys[i] = r.Key
	}
	require.NoError(t, b.insp.DeleteTask(b.ns.Queue, keys[0]))
	require.NoError(t, b.insp.ArchiveTask(b.ns.Queue, keys[1]))
	for i, finish := range []func(context.Context, store.AttemptFinishParams) error{b.store.JobComplete, b.store.JobFail} {
		key := keys[2+i]
		require.NoError(t, b.insp.DeleteTask(b.ns.Queue, key))
		_, err := b.store.JobStart(ctx, store.AttemptStartParams{Key: key, Token: 1})
		require.NoError(t, err)
		require.NoError(t, finish(ctx, store.AttemptFinishParams{Key: key, Token: 1, Category: "not_found"}))
	}
	fresh := specs[0]
	fresh.SourceID = "sku-new"
	calls.scripts.Store(0)
	mixed, err := enq.EnqueueMany(ctx, []tasks.Spec{specs[0], specs[1], specs[2], specs[3], specs[4], specs[5], specs[5], fresh})
	require.NoError(t, err)
	got := make([]tasks.Outcome, len(mixed))
	for i, r := range mixed {
		got[i] = r.Outcome
	}
	assert.Equal(t, []tasks.Outcome{tasks.Requeued, tasks.Repaired, tasks.AlreadyComplete, tasks.AlreadyFailed,
		tasks.AlreadyQueued, tasks.AlreadyQueued, tasks.AlreadyQueued, tasks.Created}, got)
	// Requeued, Repaired (after its conflict: 2) and Created.
	assert.EqualValues(t, 4, calls.scripts.Load(), "only jobs without a live task reach asynq")
	for _, k := range []string{keys[0], keys[1], mixed[7].Key} {
		assertTaskState(t, b, k, asynq.TaskStatePending, k)
	}
	assert.False(t, b.ns.AsynqTaskExists(t, keys[2]), "a complete job is not enqueued again")
	assert.False(t, b.ns.AsynqTaskExists(t, keys[3]), "a failed job is not enqueued again")
}

// TestEnqueuerConfigPayloadVersion: an unknown payload format version is refused by name.
func TestEnqueuerConfigPayloadVersion(t *testing.T) {
	c := tasks.EnqueuerConfig{PayloadVersion: 5}
	require.ErrorContains(t, c.Validate(), "PayloadVersion 5")
}
