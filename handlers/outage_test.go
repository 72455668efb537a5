package handlers_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestPostgresOutage runs a real asynq server with the runner against a PostgreSQL server
// of the test's own, stopped after the jobs were enqueued. Every delivery fails to start;
// each goes back to asynq's retry set due within UnavailableRetryMaxDelay (asynq's default
// backoff put the first retry 15 to 45 s away and the fourth minutes away), counted in
// idemscrape_not_started_unavailable_total, and no attempt is recorded. When PostgreSQL is
// back, every job completes in one attempt.
func TestPostgresOutage(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	pgSrv := testutil.StartPostgres(t)
	st := store.New(pgSrv.MigratedPool(t))

	client := asynq.NewClient(r.ns.AsynqOpt())
	t.Cleanup(func() { _ = client.Close() })
	enq, err := tasks.NewEnqueuer(client, st, &tasks.EnqueuerConfig{Queue: r.ns.Queue, Redis: r.ns.Client})
	require.NoError(t, err)
	const jobs = 4
	keys := make([]string, jobs)
	for i := range keys {
		res, err := enq.Enqueue(ctx, tasks.Spec{Kind: catalog.Kind, SourceID: fmt.Sprintf("sku-%d", i+1), Country: "US", Window: "2026-04-23", ParserVersion: 1})
		require.NoError(t, err)
		keys[i] = res.Key
	}

	metrics := prometheus.NewRegistry()
	reg := r.registry(t, func(c *handlers.Config) { c.Store, c.Registerer = st, metrics })
	serve := func() *asynq.Server {
		srv := asynq.NewServer(r.ns.AsynqOpt(), reg.ServerConfig(asynq.Config{
			Queues: map[string]int{r.ns.Queue: 1}, Concurrency: 3, LogLevel: asynq.FatalLevel,
			DelayedTaskCheckInterval: 100 * time.Millisecond,
		}))
		require.NoError(t, srv.Start(reg))
		return srv
	}
	unavailable := func() float64 { return sumCounter(t, metrics, "idemscrape_not_started_unavailable_total") }

	pgSrv.Stop()
	srv := serve()
	// Three failed starts per job: the retries are due after 0.5–1, 1–2 and 2–4 s (asynq's
	// default backoff would take minutes, past WaitTimeout, to get here).
	handlers.WaitUntil(t, "three failed starts per job", 50*time.Millisecond, func() bool { return unavailable() >= 3*jobs })
	srv.Shutdown() // the deliveries in flight fail to start and go to the retry set too

	for _, key := range keys {
		due, err := r.ns.Client.ZScore(ctx, "asynq:{"+r.ns.Queue+"}:retry", key).Result()
		require.NoError(t, err, "job %s: its task waits in the retry set", key)
		// asynq stores the due time in whole seconds.
		require.LessOrEqual(t, time.Unix(int64(due), 0), time.Now().Add(handlers.UnavailableRetryMaxDelay+time.Second),
			"job %s: due within UnavailableRetryMaxDelay", key)
	}

	pgSrv.Start()
	srv = serve()
	defer srv.Shutdown()
	handlers.WaitUntil(t, "every job complete after the outage", 50*time.Millisecond, func() bool {
		return testutil.Count(t, st.Pool(), `SELECT count(*) FROM jobs WHERE key = ANY($1) AND state = 'complete'`, keys) == jobs
	})
	for _, key := range keys {
		job := requireState(t, st, key, tasks.StateComplete)
		require.Equal(t, 1, job.Attempts, "job %s: the outage recorded no attempt", key)
	}
}
