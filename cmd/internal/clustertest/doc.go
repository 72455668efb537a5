// Package clustertest holds idemscrape's Redis Cluster tests (issue 14, DESIGN § Scale-out):
// the real binaries — cmd/worker (asynq server, runner, outbox dispatcher) and
// cmd/scheduler (the reconciler) — configured for a throwaway 3-master Redis Cluster with
// IDEMSCRAPE_REDIS_CLUSTER, one PostgreSQL database of their own, and inbox consumers of
// the outbox stream in the test process.
//
//   - TestClusterEndToEnd: 2,000 jobs, 3 worker processes (2 of them dispatching) ⇒ one
//     result and one outbox event per job, each event taking effect once downstream.
//   - TestClusterFailover: the master holding the asynq queue, and with it the outbox
//     stream, restarts empty mid-run ⇒ no job lost, no duplicate result; the reconciler
//     re-enqueues what the node held.
//   - TestRequeueMarkerOnCluster: the queue's master restarts empty under 30 pending jobs
//     the changed pass does not see ⇒ the reconciler, swept twice by the test in-process,
//     gives every job its task back (the queue's tasks-checked marker went with the node).
//   - BenchmarkClusterThroughput: jobs/s on the cluster against a single Redis, same run.
//
// The Lua scripts' single-slot check (TestScriptsSingleSlot) lives with the scripts in
// package lua. This package has no code outside its tests.
package clustertest
