package clustertest

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/cmd/internal/envflag"
	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/scheduler"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestRequeueMarkerOnCluster (issue 36): 30 pending jobs of a queue whose tasks sit on one
// master of a 3-master Redis Cluster; that master restarts empty. The jobs did not change
// lately (the changed pass does not see them) and the key-order scan checks one job per
// sweep (as 1,000 of 1 M would: hours for all). The queue's tasks-checked marker is in the
// queue's slot, so it is lost with the tasks, and the reconciler's next sweeps — two, run
// by the test, no worker — must give every job its task back. The queue is chosen on
// another master than the slot of the former, untagged marker
// (<prefix>reconciler:tasks-checked), which survived such a loss and hid it.
func TestRequeueMarkerOnCluster(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testutil.StartRedisCluster(t, 3, 0)
	rc := envflag.RedisConfig{Cluster: cluster.Addrs()}
	rdb := rc.NewClient()
	t.Cleanup(func() { _ = rdb.Close() })
	client := asynq.NewClient(rc.AsynqConnOpt())
	t.Cleanup(func() { _ = client.Close() })
	insp := asynq.NewInspector(rc.AsynqConnOpt())
	t.Cleanup(func() { _ = insp.Close() })
	st := store.New(testutil.PG(t))

	id := testutil.RandomID(4)
	prefix, queue := "mk"+id+":", "mk"+id
	untagged := cluster.MasterFor(ctx, prefix+"reconciler:tasks-checked")
	for i := 0; cluster.MasterFor(ctx, "asynq:{"+queue+"}:pending") == untagged; i++ {
		require.Less(t, i, 1000, "no queue name off the untagged marker's master")
		queue = fmt.Sprintf("mk%s-%d", id, i)
	}
	victim := cluster.MasterFor(ctx, "asynq:{"+queue+"}:pending")
	markerSlot, err := rdb.ClusterKeySlot(ctx, scheduler.RequeueMarkerKey(prefix, queue)).Result()
	require.NoError(t, err)
	queueSlot, err := rdb.ClusterKeySlot(ctx, scheduler.AsynqTaskKey(queue, "any")).Result()
	require.NoError(t, err)
	require.Equal(t, queueSlot, markerSlot, "the marker shares the slot of the queue's tasks")

	f, err := scheduler.ParseFile([]byte(fmt.Sprintf("kinds:\n  %s: {queue: %s}\nreconciler: {requeue_scan_per_sweep: 1}\n",
		catalog.Kind, queue)), "", nil)
	require.NoError(t, err)
	log := &testutil.SyncBuffer{}
	r, err := scheduler.NewReconciler(scheduler.ReconcilerConfig{File: f, Store: st, Redis: rdb, Client: client,
		Inspector: insp, KeyPrefix: prefix, Logger: slog.New(slog.NewTextHandler(log, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	require.NoError(t, err)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("reconciler log:\n%s", log.String())
		}
	})
	sweep := func(what string) scheduler.SweepReport {
		t.Helper()
		rep := r.Sweep(ctx)
		require.NoError(t, rep.Err, what)
		t.Logf("%s: checked in full %v, %v", what, rep.FullRequeue, nonZero(rep.Actions))
		return rep
	}

	enq, err := tasks.NewEnqueuer(client, st, &tasks.EnqueuerConfig{Queue: queue})
	require.NoError(t, err)
	const n = 30
	var keys []string
	for i := range n {
		res, err := enq.Enqueue(ctx, tasks.Spec{Kind: catalog.Kind, SourceID: fmt.Sprintf("sku-%d", i+1),
			Country: "US", Window: window, ParserVersion: 1})
		require.NoError(t, err)
		require.Equal(t, tasks.Created, res.Outcome)
		keys = append(keys, res.Key)
	}
	// The jobs last changed two days ago: out of reach of the changed pass.
	_, err = st.Pool().Exec(ctx, `UPDATE jobs SET updated_at = now() - interval '2 days' WHERE key = ANY($1)`, keys)
	require.NoError(t, err)

	assert.True(t, sweep("first sweep").FullRequeue, "no marker yet: checked in full")
	assert.False(t, sweep("steady state").FullRequeue)
	require.Equal(t, n, tasksPresent(t, rdb, queue, keys), "every job has its task before the loss")

	cluster.Restart(victim)
	cluster.WaitHealthy()
	// The clients' connections to the restarted node are dead: the first command through one
	// may fail while the client dials again.
	for tries := 0; ; tries++ {
		_, err = rdb.Exists(ctx, scheduler.AsynqTaskKey(queue, keys[0])).Result()
		if err == nil {
			break
		}
		require.Less(t, tries, 100, "the restarted node does not answer: %v", err)
		<-time.After(50 * time.Millisecond)
	}
	require.Zero(t, tasksPresent(t, rdb, queue, keys), "the restarted master lost the queue's tasks")

	sweep("first sweep after the loss")
	sweep("second sweep after the loss")
	assert.Equal(t, n, tasksPresent(t, rdb, queue, keys), "every pending job has its task again within two sweeps")
	// Read from the task hashes, not with the Inspector: it first looks the queue up in
	// asynq's untagged asynq:queues set, which the restart may have emptied (an asynq
	// client adds a queue to it once per process).
	for _, k := range keys {
		state, err := rdb.HGet(ctx, scheduler.AsynqTaskKey(queue, k), "state").Result()
		if assert.NoError(t, err, "job %s", k) {
			assert.Equal(t, "pending", state, "job %s", k)
		}
	}
}

// tasksPresent counts the jobs of keys whose asynq task exists in queue (one pipeline).
func tasksPresent(t *testing.T, rdb redis.UniversalClient, queue string, keys []string) int {
	t.Helper()
	ctx := context.Background()
	pipe := rdb.Pipeline()
	cmds := make([]*redis.IntCmd, len(keys))
	for i, k := range keys {
		cmds[i] = pipe.Exists(ctx, scheduler.AsynqTaskKey(queue, k))
	}
	_, err := pipe.Exec(ctx)
	require.NoError(t, err, "read the tasks")
	n := 0
	for _, c := range cmds {
		n += int(c.Val())
	}
	return n
}

// nonZero returns the actions of a sweep report that happened.
func nonZero(m map[string]int64) map[string]int64 {
	out := map[string]int64{}
	for k, v := range m {
		if v != 0 {
			out[k] = v
		}
	}
	return out
}
