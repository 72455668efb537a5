package handlers_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestUnavailableRetryBounded: a delivery that can not start because PostgreSQL or Redis
// does not answer (here: loopback port 1, where nothing listens) goes back to asynq with a
// delay of 1 s doubling with asynq's retry count, never above UnavailableRetryMaxDelay —
// asynq's own default, which the runner used before, is n⁴ s and more: hours after ten
// retries, so a job that met an outage of half an hour would wait past its window. The
// retry counts against MaxRetry (the backstop), and the job's row is untouched.
func TestUnavailableRetryBounded(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	down, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:1/nowhere?sslmode=disable&connect_timeout=2")
	require.NoError(t, err)
	t.Cleanup(down.Close)
	redisDown := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", DialTimeout: 2 * time.Second, MaxRetries: -1})
	t.Cleanup(func() { _ = redisDown.Close() })

	priced, err := r.prov.WithPrice(sessions.Price{Currency: "USD", MicrosPerGB: 1_000_000_000})
	require.NoError(t, err)
	window := handlers.WithWindowBudget(handlers.WindowBudget{Money: 1_000_000})

	for _, tc := range []struct {
		name   string
		mutate func(*handlers.Config)
		opts   []handlers.KindOption
		names  string // in the error asynq records
	}{
		{"PostgreSQL", func(c *handlers.Config) { c.Store = store.New(down) }, nil, "127.0.0.1"},
		{"Redis", func(c *handlers.Config) { c.Redis = redisDown }, nil, "127.0.0.1:1"},
		// A window with a money budget and no total in Redis yet: the reservation reads
		// what the window spent from PostgreSQL, which does not answer.
		{"WindowBudgetRestore", func(c *handlers.Config) { c.Store, c.Provider = store.New(down), priced }, []handlers.KindOption{window}, "127.0.0.1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			metrics := prometheus.NewRegistry()
			reg := r.registry(t, func(c *handlers.Config) {
				c.Registerer = metrics
				tc.mutate(c)
			}, tc.opts...)
			key, task := r.job(t, "sku-down-"+tc.name)
			err := reg.ProcessTask(ctx, task)
			require.Error(t, err)
			require.ErrorContains(t, err, "not started")
			require.ErrorContains(t, err, tc.names)
			require.True(t, handlers.IsFailure(err), "counts against MaxRetry, the backstop")
			require.Equal(t, 1.0, sumCounter(t, metrics, "idemscrape_not_started_unavailable_total"))

			// The delay by asynq's retry count n: within [step/2, step], step = 1 s · 2ⁿ
			// capped at UnavailableRetryMaxDelay.
			for _, n := range []int{0, 1, 3, 5, 6, 10, 40, 999} {
				step := handlers.UnavailableRetryMaxDelay
				if n < 6 {
					step = time.Second << n
				}
				for range 20 {
					d := handlers.RetryDelay(n, err, task)
					require.GreaterOrEqual(t, d, step/2, "retry %d", n)
					require.LessOrEqual(t, d, step, "retry %d", n)
				}
			}
			// The same through a service's asynq configuration, whose own RetryDelayFunc
			// (asynq's default here) serves only its own task types.
			cfg := reg.ServerConfig(asynq.Config{RetryDelayFunc: asynq.DefaultRetryDelayFunc, IsFailure: func(error) bool { return false }})
			require.LessOrEqual(t, cfg.RetryDelayFunc(10, err, task), handlers.UnavailableRetryMaxDelay)
			require.True(t, cfg.IsFailure(err))

			job := requireState(t, r.st, key, tasks.StatePending, "the job's row is untouched")
			require.Zero(t, job.Attempts, "no attempt recorded")
		})
	}
}

// TestPostgresOutage runs a real asynq server with the runner, whose PostgreSQL goes through
// a TCP proxy that refuses every connection after the jobs were enqueued (the shared server
// itself is not touched). Every delivery fails to start;
// each goes back to asynq's retry set due within UnavailableRetryMaxDelay (asynq's default
// backoff put the first retry 15 to 45 s away and the fourth minutes away), counted in
// idemscrape_not_started_unavailable_total, and no attempt is recorded. When PostgreSQL is
// back, every job completes in one attempt.
func TestPostgresOutage(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	via, pgProxy := testutil.PoolVia(t, r.st.Pool())
	st := store.New(via)

	client := asynq.NewClient(r.ns.AsynqOpt())
	t.Cleanup(func() { _ = client.Close() })
	enq, err := tasks.NewEnqueuer(client, r.st, &tasks.EnqueuerConfig{Queue: r.ns.Queue, Redis: r.ns.Client})
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

	pgProxy.Refuse()
	srv := serve()
	// Three failed starts per job on average: the retries are due after 0.5–1, 1–2 and
	// 2–4 s (asynq's default backoff would take minutes, past WaitTimeout, to get here).
	handlers.WaitUntil(t, "three failed starts per job on average", 50*time.Millisecond, func() bool { return unavailable() >= 3*jobs })
	srv.Shutdown() // the deliveries in flight fail to start and go to the retry set too

	// Each task waits in the retry set, due within UnavailableRetryMaxDelay, or is due
	// already: the forwarder moved it to the queue and the processor, which polls an
	// empty queue every 0.5–1.5 s, had not taken it when the server stopped.
	for _, key := range keys {
		due, err := r.ns.Client.ZScore(ctx, "asynq:{"+r.ns.Queue+"}:retry", key).Result()
		if errors.Is(err, redis.Nil) {
			_, err = r.ns.Client.LPos(ctx, "asynq:{"+r.ns.Queue+"}:pending", key, redis.LPosArgs{}).Result()
			require.NoError(t, err, "job %s: its task is neither in the retry set nor pending", key)
			continue
		}
		require.NoError(t, err)
		// asynq stores the due time in whole seconds.
		require.LessOrEqual(t, time.Unix(int64(due), 0), time.Now().Add(handlers.UnavailableRetryMaxDelay+time.Second),
			"job %s: due within UnavailableRetryMaxDelay", key)
	}

	pgProxy.Accept()
	srv = serve()
	defer srv.Shutdown()
	handlers.WaitUntil(t, "every job complete after the outage", 50*time.Millisecond, func() bool {
		return testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM jobs WHERE key = ANY($1) AND state = 'complete'`, keys) == jobs
	})
	for _, key := range keys {
		job := requireState(t, r.st, key, tasks.StateComplete)
		require.Equal(t, 1, job.Attempts, "job %s: the outage recorded no attempt", key)
	}
}

// TestRefusedStartKeepsBackoff: PostgreSQL that answers and refuses the start (here: a
// search_path without the schema, as a database not migrated: undefined table) is no
// outage. The delivery keeps asynq's own backoff, is not counted as not started for an
// outage, and the error says what PostgreSQL said.
func TestRefusedStartKeepsBackoff(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	cfg := r.st.Pool().Config().Copy()
	cfg.ConnConfig.RuntimeParams["search_path"] = "no_such_schema"
	unmigrated, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(unmigrated.Close)

	metrics := prometheus.NewRegistry()
	reg := r.registry(t, func(c *handlers.Config) { c.Store, c.Registerer = store.New(unmigrated), metrics })
	key, task := r.job(t, "sku-refused")
	err = reg.ProcessTask(ctx, task)
	require.Error(t, err)
	require.ErrorContains(t, err, "42P01", "PostgreSQL's own code, for the operator")
	require.NotContains(t, err.Error(), "not started")
	require.Zero(t, sumCounter(t, metrics, "idemscrape_not_started_unavailable_total"))
	require.GreaterOrEqual(t, handlers.RetryDelay(0, err, task), 15*time.Second, "asynq's own backoff (15 s and more)")
	requireState(t, r.st, key, tasks.StatePending, "the job's row is untouched")
}
