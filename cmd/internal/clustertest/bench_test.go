package clustertest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/idemscrape/idemscrape/cmd/internal/envflag"
	"github.com/idemscrape/idemscrape/testutil"
)

// BenchmarkClusterThroughput measures jobs/s of one fleet — three cmd/worker processes at
// concurrency 6, two of them dispatching the outbox — on one Redis server and on a 3-master
// Redis Cluster, both throwaway servers without persistence started by the benchmark, with
// one PostgreSQL database each. An iteration enqueues 1,000 new jobs (a new window) and
// waits until all are complete; a first batch warms the fleet up outside the timer.
//
//	for i in 1 2 3; do go test -run '^$' -bench ClusterThroughput -benchtime 3x ./internal/clustertest; done
//
// A loop of single runs alternates the two (Single, Cluster, Single, …); -count would run
// each several times in a row. On a 2-core machine the cluster's
// three redis-server processes share the cores with the workers and PostgreSQL: the figure
// is the cost of the cluster's routing and extra processes, not a speed-up.
func BenchmarkClusterThroughput(b *testing.B) {
	const batch = 1000
	for _, bc := range []struct {
		name  string
		redis func(b *testing.B) envflag.RedisConfig
	}{
		{"Single", func(b *testing.B) envflag.RedisConfig {
			return envflag.RedisConfig{Addr: testutil.StartRedis(b).Addr}
		}},
		{"Cluster", func(b *testing.B) envflag.RedisConfig {
			return envflag.RedisConfig{Cluster: testutil.StartRedisCluster(b, 3, 0).Addrs()}
		}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			ctx := context.Background()
			w := newWorld(b, bc.redis(b), batch)
			for i := range 3 {
				w.startWorker(workerOpts{id: fmt.Sprintf("w%d", i+1), concurrency: 6, noDispatcher: i == 2})
			}
			const complete = `SELECT count(*) FROM jobs WHERE state = 'complete'`
			w.enqueueWindow(ctx, batch, "US", "bench-warm-up")
			w.waitCount("warm-up jobs complete", batch, 3*time.Minute, complete)

			b.ResetTimer()
			for i := range b.N {
				w.enqueueWindow(ctx, batch, "US", fmt.Sprintf("bench-%d", i))
				w.waitCount("jobs complete", batch*(i+2), 3*time.Minute, complete)
			}
			b.StopTimer()
			b.ReportMetric(float64(batch*b.N)/b.Elapsed().Seconds(), "jobs/s")
			b.ReportMetric(0, "ns/op")
		})
	}
}
