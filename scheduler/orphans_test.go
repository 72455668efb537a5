package scheduler_test

import (
	"bufio"
	"context"
	"errors"
	"io"
	"os/exec"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/scheduler"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// orphanRig is a throwaway Redis (asynq's server sets are global to a Redis) and a
// database with an enqueuer on the catalog queue.
type orphanRig struct {
	rs      *testutil.RedisServer
	rdb     *redis.Client
	st      *store.PG
	connOpt asynq.RedisClientOpt
	client  *asynq.Client
	enq     *tasks.Enqueuer
}

func newOrphanRig(t *testing.T) *orphanRig {
	t.Helper()
	rs := testutil.StartRedis(t)
	o := &orphanRig{rs: rs, rdb: rs.Client(), st: store.New(testutil.PG(t)), connOpt: asynq.RedisClientOpt{Addr: rs.Addr}}
	o.client = asynq.NewClient(o.connOpt)
	t.Cleanup(func() { _ = o.client.Close() })
	var err error
	o.enq, err = tasks.NewEnqueuer(o.client, o.st, &tasks.EnqueuerConfig{Queue: catalog.Kind})
	require.NoError(t, err)
	return o
}

func (o *orphanRig) enqueue(t *testing.T, sku string) string {
	t.Helper()
	res, err := o.enq.Enqueue(context.Background(), tasks.Spec{Kind: catalog.Kind, SourceID: sku, Country: "US",
		Window: "2026-04-23", ParserVersion: 1})
	require.NoError(t, err)
	return res.Key
}

// reconciler returns a Reconciler whose orphan passes run every 50 ms, each reported on
// passes (its sweeps every hour: only the orphan pass acts).
func (o *orphanRig) reconciler(t *testing.T, passes chan scheduler.SweepReport) *scheduler.Reconciler {
	t.Helper()
	f, err := scheduler.ParseFile([]byte("kinds:\n  catalog: {}\nreconciler: {interval: 1h, orphan_interval: 50ms}\n"), "", nil)
	require.NoError(t, err)
	r, err := scheduler.NewReconciler(scheduler.ReconcilerConfig{File: f, Store: o.st, Redis: o.rdb, Client: o.client,
		Logger: quietLogger(), TestOrphanSignal: passes})
	require.NoError(t, err)
	return r
}

// asynqLeaseEnd is the end of the asynq lease of task id (its score in the queue's lease
// set, Unix seconds), and whether it is there.
func (o *orphanRig) asynqLeaseEnd(t *testing.T, id string) (int64, bool) {
	t.Helper()
	s, err := o.rdb.ZScore(context.Background(), "asynq:{"+catalog.Kind+"}:lease", id).Result()
	if errors.Is(err, redis.Nil) {
		return 0, false
	}
	require.NoError(t, err)
	return int64(s), true
}

func (o *orphanRig) taskState(t *testing.T, id string) string {
	t.Helper()
	s, err := o.rdb.HGet(context.Background(), scheduler.AsynqTaskKey(catalog.Kind, id), "state").Result()
	if errors.Is(err, redis.Nil) {
		return ""
	}
	require.NoError(t, err)
	return s
}

// TestKilledWorkerTasksBack: a worker process dequeues a job and is SIGKILLed in the
// middle of it, so asynq holds the task active under the dead server's lease (30 s,
// recovered by asynq's recoverer a further 30 s after it ends). The job's own lease (3 s)
// expires first; the reconciler's orphan pass finds the task listed by no live server and
// gives it back to pending, and another worker completes the job while asynq's lease of
// the killed delivery has not even ended — asynq could not have recovered it.
func TestKilledWorkerTasksBack(t *testing.T) {
	ctx := context.Background()
	o := newOrphanRig(t)
	key := o.enqueue(t, "sku-1")
	fences := killWorkerMidJob(t, o.st, o.st.Pool(), o.rs.Addr, []string{key}, "-lease", "3s")
	leaseEnd, ok := o.asynqLeaseEnd(t, key)
	require.True(t, ok, "the killed delivery's task is active under its asynq lease")
	require.Equal(t, "active", o.taskState(t, key))

	passes := make(chan scheduler.SweepReport)
	var given atomic.Int64
	read := make(chan struct{})
	r := o.reconciler(t, passes)
	go func() {
		defer close(read)
		for rep := range passes {
			given.Add(rep.Actions[scheduler.ActionOrphanRequeued])
		}
	}()
	require.NoError(t, r.Start(ctx))
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			r.Stop()
			close(passes)
			<-read
		}
	}
	t.Cleanup(stop)

	completeAll(t, o.st, o.rdb, o.connOpt, []string{key})
	done := time.Now().Unix()
	assert.Less(t, done, leaseEnd, "completed while the killed delivery's asynq lease (to %s) still ran: asynq's recoverer could not have given the task back",
		time.Unix(leaseEnd, 0).UTC())
	stop()
	assert.EqualValues(t, 1, given.Load(), "the orphan pass gave the task back once")

	job, err := o.st.JobGet(ctx, key)
	require.NoError(t, err)
	assert.Equal(t, tasks.StateComplete, job.State)
	attempts, err := o.st.AttemptList(ctx, key)
	require.NoError(t, err)
	require.Len(t, attempts, 2, "the killed attempt and the one that completed")
	assert.Equal(t, store.OutcomeLost, attempts[0].Outcome, "the next start took the killed attempt over")
	assert.Equal(t, fences[key], attempts[0].Fence)
	assert.Equal(t, store.OutcomeComplete, attempts[1].Outcome)
	assert.Greater(t, attempts[1].Fence, attempts[0].Fence)
	assert.Equal(t, 1, countOf(t, o.st, `SELECT count(*) FROM results WHERE job_key = $1`, key))
	assert.Equal(t, 1, countOf(t, o.st, `SELECT count(*) FROM outbox WHERE event_key = $1`, handlers.EventKey(key)))
	// asynq's bookkeeping is whole: the completing server's Done found the task where
	// asynq's own requeue puts it (active, then deleted).
	assert.Equal(t, "", o.taskState(t, key), "task deleted by asynq's Done")
	n, err := o.rdb.LLen(ctx, "asynq:{"+catalog.Kind+"}:active").Result()
	require.NoError(t, err)
	assert.Zero(t, n)
	_, ok = o.asynqLeaseEnd(t, key)
	assert.False(t, ok)
}

// TestOrphanPassSparesLiveWorker: a live worker process runs a job (blocked in its step);
// the job's own lease is deleted, as if it expired, so only asynq's heartbeats tell the
// worker is alive. Orphan passes run all along, from the dequeue (before the server's
// first heartbeat lists the task, perhaps) until the server has beaten twice more: none
// gives the task back.
func TestOrphanPassSparesLiveWorker(t *testing.T) {
	ctx := context.Background()
	o := newOrphanRig(t)
	key := o.enqueue(t, "sku-2")
	leases, err := lua.NewLeases(o.rdb, handlers.DefaultKeyPrefix)
	require.NoError(t, err)

	passes := make(chan scheduler.SweepReport)
	r := o.reconciler(t, passes)
	require.NoError(t, r.Start(ctx))
	t.Cleanup(r.Stop)

	bin := buildBinary(t, "github.com/idemscrape/idemscrape/internal/testworker", "testworker")
	cmd := exec.Command(bin, "-pg", dsnOf(o.st.Pool()), "-redis", o.rs.Addr, "-queue", catalog.Kind)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = testWriter{t}
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }) // only this test's process, by pid
	sc := bufio.NewScanner(stdout)
	stepped := false
	for !stepped && sc.Scan() {
		stepped = sc.Text() == "STEP "+key
	}
	require.True(t, stepped, "the worker never reached the step: %v", sc.Err())
	go func() { _, _ = io.Copy(io.Discard, stdout) }()
	require.NoError(t, o.rdb.Del(ctx, leases.Keys().Lease(key)).Err())

	// The server's heartbeat score when the step began, then passes until it has grown by
	// two heartbeats (10 s of the server's clock).
	beat := func() int64 {
		zs, err := o.rdb.ZRangeWithScores(ctx, "asynq:servers", 0, -1).Result()
		require.NoError(t, err)
		require.Len(t, zs, 1, "one asynq server")
		return int64(zs[0].Score)
	}
	first := beat()
	var given, runs int64
	for beat() < first+11 {
		select {
		case rep := <-passes:
			require.NoError(t, rep.Err)
			given += rep.Actions[scheduler.ActionOrphanRequeued]
			runs++
		case <-time.After(time.Minute): // a guard against a hang, not a timing assert
			t.Fatal("no orphan pass")
		}
	}
	// One pass more, after the last heartbeat read.
	rep := <-passes
	given += rep.Actions[scheduler.ActionOrphanRequeued]
	r.Stop()
	t.Logf("%d orphan passes while the live server beat from %d to %d", runs+1, first, beat())
	assert.Zero(t, given, "a live server's task is never given back")
	assert.Equal(t, "active", o.taskState(t, key))
	_, ok := o.asynqLeaseEnd(t, key)
	assert.True(t, ok)
	job, err := o.st.JobGet(ctx, key)
	require.NoError(t, err)
	assert.Equal(t, tasks.StateRunning, job.State)
	attempts, err := o.st.AttemptList(ctx, key)
	require.NoError(t, err)
	assert.Len(t, attempts, 1, "no second delivery started")
}

// TestOrphanRequeueMatchesAsynq: asynq_requeue.lua leaves a task as asynq v0.26's own
// requeue (a server's shutdown, for its unfinished tasks) leaves another: the same hash
// fields and state, the message untouched, in the pending list, out of the active list and
// the lease set; asynq's Inspector reads it as pending. A task no longer active under the
// lease score read is left alone.
func TestOrphanRequeueMatchesAsynq(t *testing.T) {
	ctx := context.Background()
	o := newOrphanRig(t)
	ours, theirs := o.enqueue(t, "sku-3"), o.enqueue(t, "sku-4")
	started := make(chan string, 2)
	srv := asynq.NewServer(o.connOpt, asynq.Config{Queues: map[string]int{catalog.Kind: 1}, Concurrency: 2,
		ShutdownTimeout: time.Millisecond, LogLevel: asynq.FatalLevel})
	require.NoError(t, srv.Start(asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		started <- id
		<-ctx.Done()
		return ctx.Err()
	})))
	for range 2 {
		<-started
	}
	msgs := map[string]string{}
	for _, id := range []string{ours, theirs} {
		m, err := o.rdb.HGet(ctx, scheduler.AsynqTaskKey(catalog.Kind, id), "msg").Result()
		require.NoError(t, err)
		msgs[id] = m
	}
	score, ok := o.asynqLeaseEnd(t, ours)
	require.True(t, ok)
	n, err := scheduler.AsynqRequeue(ctx, o.rdb, catalog.Kind, ours, score-1)
	require.NoError(t, err)
	assert.Zero(t, n, "not under the lease read: left alone")
	assert.Equal(t, "active", o.taskState(t, ours))
	n, err = scheduler.AsynqRequeue(ctx, o.rdb, catalog.Kind, ours, score)
	require.NoError(t, err)
	assert.EqualValues(t, 1, n)
	n, err = scheduler.AsynqRequeue(ctx, o.rdb, catalog.Kind, ours, score)
	require.NoError(t, err)
	assert.Zero(t, n, "given back once")
	srv.Shutdown() // asynq requeues theirs (and finds ours gone from the active list)

	fields := func(id string) map[string]string {
		h, err := o.rdb.HGetAll(ctx, scheduler.AsynqTaskKey(catalog.Kind, id)).Result()
		require.NoError(t, err)
		assert.Equal(t, msgs[id], h["msg"], "message untouched")
		delete(h, "msg")
		return h
	}
	assert.Equal(t, fields(theirs), fields(ours))
	assert.Equal(t, "pending", o.taskState(t, ours))
	pending, err := o.rdb.LRange(ctx, "asynq:{"+catalog.Kind+"}:pending", 0, -1).Result()
	require.NoError(t, err)
	assert.ElementsMatch(t, []string{ours, theirs}, pending)
	n, err = o.rdb.LLen(ctx, "asynq:{"+catalog.Kind+"}:active").Result()
	require.NoError(t, err)
	assert.Zero(t, n, "active list")
	n, err = o.rdb.ZCard(ctx, "asynq:{"+catalog.Kind+"}:lease").Result()
	require.NoError(t, err)
	assert.Zero(t, n, "lease set")
	insp := asynq.NewInspector(o.connOpt)
	defer insp.Close()
	info, err := insp.GetTaskInfo(catalog.Kind, ours)
	require.NoError(t, err)
	assert.Equal(t, asynq.TaskStatePending, info.State)
}
