package scheduler_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/scheduler"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestReconcilerScriptCacheLost: the Redis under the reconciler lost its script cache
// (restart, failover: SCRIPT FLUSH here, on a throwaway server). The page's pipelined
// lease claims and releases fail with NOSCRIPT, the scripts are loaded once each and the
// failed ones sent again: the stranded jobs are rescued, a live worker's job is left
// alone, and every lease the reconciler claimed is released.
func TestReconcilerScriptCacheLost(t *testing.T) {
	ctx := context.Background()
	srv := testutil.StartRedis(t)
	b := &bundle{st: store.New(testutil.PG(t)),
		ns: &testutil.RedisNS{Client: srv.Client(), Addr: srv.Addr, Prefix: "x:", Queue: "q" + testutil.RandomID(4)}}
	b.client = asynq.NewClient(b.ns.AsynqOpt())
	t.Cleanup(func() { _ = b.client.Close() })
	leases := b.leases(t)

	recs := b.recordJobs(t, "noscript", 5)
	live := b.run(t, leases, recs[0].Key, "slow-worker")
	dead := map[string]int64{}
	for _, rec := range recs[1:] {
		l := b.run(t, leases, rec.Key, "dead-worker")
		b.die(t, leases, l)
		dead[rec.Key] = l.Token
	}
	r := b.reconciler(t, recOpts{})
	require.NoError(t, b.ns.Client.ScriptFlush(ctx).Err())
	require.NoError(t, b.ns.Client.ConfigResetStat(ctx).Err())

	rep := r.Sweep(ctx)
	require.NoError(t, rep.Err)
	assert.EqualValues(t, len(dead), rep.Actions[scheduler.ActionRescued], "%v", rep.Actions)
	assert.EqualValues(t, 1, rep.Actions[scheduler.ActionLeaseHeld], "%v", rep.Actions)

	info, err := b.ns.Client.Info(ctx, "commandstats").Result()
	require.NoError(t, err)
	assert.Contains(t, info, "cmdstat_script|load:calls=2,", "claim.lua and release.lua loaded once each")

	for key, token := range dead {
		job, err := b.st.JobGet(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, tasks.StateRetryable, job.State, key)
		assert.Equal(t, token+1, job.Fence, "%s: fenced by the reconciler's token", key)
		n, err := b.ns.Client.Exists(ctx, leases.Keys().Lease(key)).Result()
		require.NoError(t, err)
		assert.Zero(t, n, "lease of %s released", key)
		assert.True(t, b.ns.AsynqTaskExists(t, key))
	}
	require.NoError(t, leases.Renew(ctx, live, time.Minute), "the live worker still holds its lease")
	job, err := b.st.JobGet(ctx, live.Key)
	require.NoError(t, err)
	assert.Equal(t, tasks.StateRunning, job.State)
}

// tripCounter counts the round trips of a client: single commands (and their names),
// pipelines, and the EVALSHA commands sent in pipelines.
type tripCounter struct {
	mu                           sync.Mutex
	single, pipelines, pipedEval int
	names                        []string
}

func (c *tripCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *tripCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		// A new connection's handshake (HELLO, CLIENT SETINFO) is not the caller's work.
		if name := cmd.Name(); name != "hello" && name != "client" {
			c.mu.Lock()
			c.single++
			c.names = append(c.names, name)
			c.mu.Unlock()
		}
		return next(ctx, cmd)
	}
}

func (c *tripCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		handshake := true // a new connection's HELLO / CLIENT SETINFO go as a pipeline too
		for _, cmd := range cmds {
			if n := cmd.Name(); n != "hello" && n != "client" && n != "auth" && n != "select" {
				handshake = false
			}
		}
		if handshake {
			return next(ctx, cmds)
		}
		c.mu.Lock()
		c.pipelines++
		for _, cmd := range cmds {
			if cmd.Name() == "evalsha" {
				c.pipedEval++
			}
		}
		c.mu.Unlock()
		return next(ctx, cmds)
	}
}

// TestReconcilerRescuePagePipelined: a page of stranded jobs costs two lease round trips
// (one pipeline of claims, one of releases), not two per job, counted on the reconciler's
// own Redis client.
func TestReconcilerRescuePagePipelined(t *testing.T) {
	ctx := context.Background()
	b := setup(t)
	leases := b.leases(t)
	const n = 60
	for _, rec := range b.recordJobs(t, "pipe", n) {
		b.die(t, leases, b.run(t, leases, rec.Key, "dead-worker"))
	}
	// Both scripts are in the server's cache, as in steady state (NOSCRIPT is tested above).
	warm, err := leases.Claim(ctx, "warm-up", "test", time.Minute, 0)
	require.NoError(t, err)
	require.NoError(t, leases.Release(ctx, warm))

	counter := &tripCounter{}
	rc := redis.NewClient(&redis.Options{Addr: b.ns.Addr})
	t.Cleanup(func() { _ = rc.Close() })
	rc.AddHook(counter)
	f, err := scheduler.ParseFile([]byte("kinds:\n  catalog: {queue: "+b.ns.Queue+", max_lease: 10m}\n"), "", nil)
	require.NoError(t, err)
	r, err := scheduler.NewReconciler(scheduler.ReconcilerConfig{File: f, Store: b.st, Redis: rc, Client: b.client,
		KeyPrefix: b.ns.Prefix, Logger: quietLogger(), Now: func() time.Time { return time.Now().Add(time.Hour) }})
	require.NoError(t, err)

	rep := r.Sweep(ctx)
	require.NoError(t, rep.Err)
	require.EqualValues(t, n, rep.Actions[scheduler.ActionRescued], "%v", rep.Actions)
	counter.mu.Lock()
	defer counter.mu.Unlock()
	// Nothing outside pipelines: the queue's tasks-checked marker is read (HMGET) and, at
	// this first, full check, written (HSET) in pipelines of one command per queue
	// (RequeueMarkerKey): per sweep, never per job.
	assert.Empty(t, counter.names, "no per-job command outside a pipeline")
	assert.Equal(t, 2*n, counter.pipedEval, "one claim and one release per job")
	// The claims, the releases, the marker's read and write, and at most one task-state page
	// of the re-enqueue pass (it runs while the rescue does: it finds the jobs runnable only
	// if it reads after their rescue; connection handshakes are not counted).
	assert.LessOrEqual(t, counter.pipelines, 5)
	assert.GreaterOrEqual(t, counter.pipelines, 4)
}
