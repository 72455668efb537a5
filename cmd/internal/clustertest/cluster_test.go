package clustertest

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/cmd/internal/envflag"
	"github.com/idemscrape/idemscrape/testutil"
)

const clusterJobs = 2000

// TestClusterEndToEnd: 2,000 jobs on a 3-master Redis Cluster and one PostgreSQL, run by
// three cmd/worker processes (two of them running the outbox dispatcher) configured only
// through IDEMSCRAPE_REDIS_CLUSTER, consumed by two inbox consumers of one group: every
// job completes with exactly one result and one outbox event, and every event takes effect
// exactly once downstream.
func TestClusterEndToEnd(t *testing.T) {
	// Side by side with TestClusterFailover's subtests, which mostly wait: the package's
	// wall time is about the longest test's, not the sum (each test has its own cluster,
	// database, shop and proxy).
	t.Parallel()
	ctx := context.Background()
	cluster := testutil.StartRedisCluster(t, 3, 0)
	w := newWorld(t, envflag.RedisConfig{Cluster: cluster.Addrs()}, clusterJobs)
	rdb := w.rdb

	keys := w.enqueue(ctx, clusterJobs, "US")
	w.consumers(2)
	http1 := freeAddr(t)
	workers := []*proc{
		w.startWorker(workerOpts{id: "w1", concurrency: 6, http: http1}),
		w.startWorker(workerOpts{id: "w2", concurrency: 6}),
		w.startWorker(workerOpts{id: "w3", concurrency: 6, noDispatcher: true}),
	}
	w.waitCount("jobs complete", clusterJobs, 3*time.Minute, `SELECT count(*) FROM jobs WHERE state = 'complete'`)
	w.waitTookEffect(time.Minute, keys)
	w.checkExactlyOnce(keys)

	// Every worker process took part, and none died.
	for _, p := range workers {
		done, err := p.exited()
		require.False(t, done, "worker %s exited: %v", p.name, err)
		assert.Positive(t, w.count(`SELECT count(*) FROM attempts WHERE worker = $1`, p.name), "attempts of %s", p.name)
	}
	t.Logf("attempts per job %.3f; attempts by worker: %v",
		float64(w.count(`SELECT count(*) FROM attempts`))/clusterJobs, attemptsByWorker(t, w))

	// The data is on the cluster: the stream received the events (entries-added: the
	// dispatchers trim what the group acknowledged, by default), the consumer group has
	// nothing left pending, and the job leases (released) left no lease key behind.
	info, err := rdb.XInfoStream(ctx, w.stream()).Result()
	require.NoError(t, err)
	assert.GreaterOrEqual(t, info.EntriesAdded, int64(clusterJobs), "stream entries ever added (replays allowed)")
	// A consumer acknowledges a batch after its inbox rows commit: wait for the last
	// acknowledgement rather than read the group once.
	w.waitFor("entries pending in the group", time.Minute, func() (int64, bool) {
		groups, err := rdb.XInfoGroups(ctx, w.stream()).Result()
		require.NoError(t, err)
		require.Len(t, groups, 1)
		return groups[0].Pending, groups[0].Pending == 0
	})
	// The worker's HTTP surfaces work on the cluster: /readyz (Redis answers), asynqmon's
	// API (asynq's Inspector: queues, servers, the cluster's INFO).
	code, body := httpGet(t, "http://"+http1+"/readyz")
	assert.Equal(t, 200, code, "/readyz: %s", body)
	code, body = httpGet(t, "http://"+http1+"/monitoring/api/queues")
	assert.Equal(t, 200, code, "asynqmon queues: %s", body)
	assert.Contains(t, body, w.queue)
	for _, path := range []string{"/monitoring/api/servers", "/monitoring/api/redis_info", "/monitoring/api/queues/" + w.queue + "/completed_tasks"} {
		code, body = httpGet(t, "http://"+http1+path)
		assert.Equal(t, 200, code, "asynqmon %s: %s", path, firstN(body, 300))
	}
	checkLogs(t, workers...)
}

// checkLogs asserts that no process logged the proxy password or a CROSSSLOT error, and
// logs what each one warned about.
func checkLogs(t *testing.T, procs ...*proc) {
	t.Helper()
	for _, p := range procs {
		b, err := os.ReadFile(p.log)
		require.NoError(t, err)
		assert.NotContains(t, string(b), proxyPassword, "%s log", p.name)
		assert.NotContains(t, string(b), "CROSSSLOT", "%s log", p.name)
		if m := p.messages(); len(m) > 0 {
			t.Logf("%s warned: %v", p.name, m)
		}
	}
}

// attemptsByWorker returns the number of attempts of each worker id.
func attemptsByWorker(t *testing.T, w *world) map[string]int {
	t.Helper()
	rows, err := w.pool.Query(context.Background(), `SELECT worker, count(*) FROM attempts GROUP BY worker ORDER BY worker`)
	require.NoError(t, err)
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var id string
		var n int
		require.NoError(t, rows.Scan(&id, &n))
		out[id] = n
	}
	require.NoError(t, rows.Err())
	return out
}

// TestClusterFailover: mid-run, the master that holds the asynq queue's slot — and, chosen
// so, the outbox stream's — is killed, with the workers, dispatchers, consumers and the
// reconciler (the cmd/scheduler binary) running against the cluster:
//
//   - MasterRestartsEmpty: the node comes back at once without its data (no persistence, no
//     replica: the harshest loss). It took the queue's pending and active tasks, the stream
//     and its consumer group, and a third of the jobs' leases and fencing counters with it.
//     The reconciler must re-enqueue the jobs whose tasks were lost, and the dispatchers
//     must notice the lost stream and publish again.
//   - ReplicaPromoted: each master has a replica; the killed master's replica takes its
//     slots over after the node timeout, with whatever asynchronous replication had not
//     copied yet lost.
//
// Either way: no job is lost, no job has two results, and every event takes effect
// exactly once downstream.
func TestClusterFailover(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name     string
		replicas int
		jobs     int
		fail     func(c *testutil.RedisCluster, node int)
		// restarted: the node's data is gone for certain, so the reconciler must have
		// re-enqueued jobs (with a promoted replica it may have nothing to repair).
		restarted bool
	}{
		{"MasterRestartsEmpty", 0, clusterJobs / 2, (*testutil.RedisCluster).Restart, true},
		{"ReplicaPromoted", 1, clusterJobs / 2, (*testutil.RedisCluster).Kill, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// The two mostly wait (node timeout, failover, retries): run them side by side.
			t.Parallel()
			ctx := context.Background()
			cluster := testutil.StartRedisCluster(t, 3, tt.replicas)
			w := newWorld(t, envflag.RedisConfig{Cluster: cluster.Addrs()}, tt.jobs)
			rdb := w.rdb
			victim := cluster.MasterFor(ctx, w.stream())
			for i := 0; cluster.MasterFor(ctx, "asynq:{"+w.queue+"}:pending") != victim; i++ {
				require.Less(t, i, 1000, "no queue name on the stream's master")
				w.queue = fmt.Sprintf("ct%s-%d", testutil.RandomID(2), i)
			}

			keys := w.enqueue(ctx, tt.jobs, "US")
			w.consumers(2)
			// Short leases (and the chaos retry scale) so that what the lost node held is
			// repaired in seconds rather than minutes.
			const lease = 3 * time.Second
			retry := "IDEMSCRAPE_CHAOS_RETRY_SCALE=0.02"
			procs := []*proc{
				w.startWorker(workerOpts{id: "w1", concurrency: 6, lease: lease, env: []string{retry}}),
				w.startWorker(workerOpts{id: "w2", concurrency: 6, lease: lease, env: []string{retry}}),
				w.startWorker(workerOpts{id: "w3", concurrency: 6, lease: lease, env: []string{retry}, noDispatcher: true}),
				w.startReconciler("reconciler", time.Second, 2*lease),
			}

			const complete = `SELECT count(*) FROM jobs WHERE state = 'complete'`
			w.waitCount("jobs complete before the failure", tt.jobs/4, 3*time.Minute, complete)
			before := w.count(complete)
			require.Less(t, before, tt.jobs*9/10, "enough jobs still queued when the node fails")
			queued, err := rdb.LLen(ctx, "asynq:{"+w.queue+"}:pending").Result()
			require.NoError(t, err)
			require.Positive(t, queued, "tasks pending on the node that fails")

			tt.fail(cluster, victim)
			cluster.WaitHealthy()
			// The first command for a moved slot fails and makes the client reload its
			// slot map (envflag's cluster clients); the next ones reach the new master.
			var after int64
			for tries := 0; ; tries++ {
				if after, err = rdb.LLen(ctx, "asynq:{"+w.queue+"}:pending").Result(); err == nil || tries == 100 {
					break
				}
				<-time.After(50 * time.Millisecond)
			}
			require.NoError(t, err)
			t.Logf("node %d failed with %d of %d jobs complete and %d tasks pending; %d pending after", victim, before, tt.jobs, queued, after)
			if tt.restarted {
				require.Less(t, after, queued, "the restarted node lost the queue's tasks")
			}

			failed := time.Now()
			done := keys
			if tt.restarted {
				w.waitCount("jobs complete", tt.jobs, 3*time.Minute, complete)
			} else {
				// With a promoted replica, jobs can be left waiting on asynq: a task the old
				// master handed out just before it died (the dequeue replicated, the reply
				// lost) sits "active" with no worker until asynq's recoverer retries it, 60 to
				// 120 s later (a fixed one-minute sweep of leases expired 30 s ago); a job
				// whose lease claim hit the dead node waits in asynq's retry set (the runner's
				// backoff for an unavailable server: 1 s doubling by asynq retry, up to
				// handlers.UnavailableRetryMaxDelay). Waiting for those could make the test
				// minutes long: it waits until every other job completed, and checks that
				// each waiting job is not lost — asynq holds its task under a lease its
				// recoverer expires, or in its retry set (checkNotLost).
				var waiting map[string]string
				done, waiting = w.waitSettled(ctx, keys, 3*time.Minute)
				assert.LessOrEqual(t, len(waiting), 18, "jobs waiting on asynq: at most the fleet's concurrency")
				for k := range waiting {
					w.checkNotLost(ctx, k)
				}
				t.Logf("%d jobs wait on asynq (task state by job): %v", len(waiting), waiting)
			}
			jobsDone := time.Since(failed)
			w.waitTookEffect(2*time.Minute, done)
			t.Logf("after the failure: %d jobs complete in %v, their events taken effect in %v",
				len(done), jobsDone.Round(time.Millisecond), time.Since(failed).Round(time.Millisecond))
			w.checkExactlyOnce(done)
			// A result exists only with its job complete (one transaction writes both). A job
			// that waited on asynq may complete between the settle and this check (its retry
			// falls due): not a stray result (one per job: its key is the results' key).
			assert.Zero(t, w.count(`SELECT count(*) FROM results r JOIN jobs j ON j.key = r.job_key WHERE j.state <> 'complete'`),
				"results of jobs not complete")

			counter := func(name string) int {
				return w.count(`SELECT COALESCE((SELECT n FROM maintenance_counters WHERE name = $1), 0)`, name)
			}
			if tt.restarted {
				assert.Positive(t, counter("reconciler_requeued"), "the reconciler re-enqueued the jobs whose tasks were lost")
			}
			t.Logf("reconciler: %d re-enqueued, %d rescued; attempts per job %.3f; by worker %v",
				counter("reconciler_requeued"), counter("reconciler_rescued"),
				float64(w.count(`SELECT count(*) FROM attempts`))/float64(tt.jobs), attemptsByWorker(t, w))
			for _, p := range procs {
				done, err := p.exited()
				require.False(t, done, "%s exited: %v", p.name, err)
			}
			checkLogs(t, procs...)
		})
	}
}
