package handlers_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestRetryAfterHonoured runs a real asynq server: a throttled attempt puts the task in
// asynq's retry set no earlier than the destination's Retry-After, and PostgreSQL's
// next_attempt_at says the same.
func TestRetryAfterHonoured(t *testing.T) {
	r := newRig(t, rigOpts{})
	key, task := r.job(t, "sku-2")
	reg := r.registry(t, func(c *handlers.Config) { c.Rand = func() float64 { return 0 } })
	r.site.Throttle(1, 120*time.Second)

	handled := make(chan error, 1)
	srv := asynq.NewServer(r.ns.AsynqOpt(), reg.ServerConfig(asynq.Config{
		Queues: map[string]int{r.ns.Queue: 1}, Concurrency: 1, LogLevel: asynq.FatalLevel,
	}))
	mux := asynq.NewServeMux()
	mux.HandleFunc(catalog.Kind, func(ctx context.Context, t *asynq.Task) error {
		err := reg.ProcessTask(ctx, t)
		handled <- err
		return err
	})
	require.NoError(t, srv.Start(mux))
	defer srv.Shutdown()
	client := asynq.NewClient(r.ns.AsynqOpt())
	defer client.Close()
	before := time.Now()
	_, err := client.Enqueue(task, asynq.TaskID(key), asynq.Queue(r.ns.Queue))
	require.NoError(t, err)
	herr := recv(t, handled, "the delivery")
	require.Error(t, herr)
	delay := handlers.RetryDelay(1, herr, nil)
	require.GreaterOrEqual(t, delay, 120*time.Second, "the Retry-After")

	insp := asynq.NewInspector(r.ns.AsynqOpt())
	defer insp.Close()
	var info *asynq.TaskInfo
	handlers.WaitUntil(t, "asynq putting the task in its retry set", 10*time.Millisecond, func() bool {
		info, err = insp.GetTaskInfo(r.ns.Queue, key)
		return err == nil && info.State == asynq.TaskStateRetry
	})
	seen := time.Now()
	// Both schedules are now + the runner's delay, each with its own now between before and
	// seen: the runner's when it recorded the attempt, asynq's a little later (in whole
	// seconds). How long the delivery took on this box only widens the interval.
	lo, hi := before.Add(delay), seen.Add(delay)
	require.False(t, info.NextProcessAt.Before(lo.Truncate(time.Second)) || info.NextProcessAt.After(hi),
		"asynq retries after the runner's delay (the Retry-After): %v not in [%v, %v]", info.NextProcessAt, lo, hi)
	require.Equal(t, 1, info.Retried, "a throttled attempt counts")
	job := requireState(t, r.st, key, tasks.StateRetryable)
	require.NotNil(t, job.NextAttemptAt)
	require.False(t, job.NextAttemptAt.Before(lo.Truncate(time.Microsecond)) || job.NextAttemptAt.After(hi),
		"PostgreSQL mirrors asynq: %v not in [%v, %v]", *job.NextAttemptAt, lo, hi)
	require.False(t, job.NextAttemptAt.After(info.NextProcessAt.Add(time.Second)),
		"the runner's schedule (recorded first) is no later than asynq's (whole seconds): %v, %v", *job.NextAttemptAt, info.NextProcessAt)
}

func TestTotalBudgetStops(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	key, task := r.job(t, "sku-3")
	// The job is two hours old on the runner's clock; the budget is one hour.
	reg := r.registry(t, func(c *handlers.Config) { c.Now = func() time.Time { return time.Now().Add(2 * time.Hour) } },
		handlers.WithRetry(handlers.RetryConfig{TotalBudget: time.Hour}))
	r.site.Throttle(1, time.Second)
	err := reg.ProcessTask(ctx, task)
	require.ErrorIs(t, err, asynq.SkipRetry)
	requireJob(t, r.st, key, tasks.StateFailed, tasks.CategoryBudgetExceeded)
	atts, _ := r.st.AttemptList(ctx, key)
	require.Contains(t, atts[0].Error, "total budget")
}

func TestBandwidthBudgetStops(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	key, task := r.job(t, "sku-4")
	reg := r.registry(t, nil, handlers.WithRetry(handlers.RetryConfig{BandwidthBudget: 2000}))
	// Each throttled attempt moves some hundred bytes; the job fails once all its
	// attempts together pass 2,000 bytes, though the throttle itself is retryable.
	var err error
	var attempts int
	for attempts = 1; attempts <= 20; attempts++ {
		r.site.Throttle(1, time.Second)
		err = reg.ProcessTask(ctx, task)
		if decisionOf(err).Skip {
			break
		}
	}
	require.ErrorIs(t, err, asynq.SkipRetry)
	job := requireJob(t, r.st, key, tasks.StateFailed, tasks.CategoryBudgetExceeded)
	require.Greater(t, job.BytesTotal, int64(2000))
	require.Greater(t, attempts, 1, "the first attempts stayed under the budget")
	sum := testutil.Count(t, r.st.Pool(), `SELECT sum(bytes)::int FROM attempts WHERE job_key = $1`, key)
	require.Equal(t, int(job.BytesTotal), sum, "jobs.bytes_total is the sum over attempts")
}

func TestLeaseLossAbortsWithoutCommit(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	key, task := r.job(t, "sku-5")
	reg := r.registry(t, func(c *handlers.Config) {
		c.KeepOptions = &lua.KeepOptions{Interval: 50 * time.Millisecond}
		c.Collector.RequestTimeout = time.Hour
	})
	// The workflow is mid-request when the lease goes, and the request would take an hour:
	// only the keeper cancelling the job context can end this delivery (else the fail-safe
	// wait runs out — no wall-clock assert needed).
	r.site.SetSlow(time.Hour)
	done := make(chan error, 1)
	go func() { done <- reg.ProcessTask(ctx, task) }()
	leaseKey := r.ns.Prefix + "{" + key + "}:lease"
	// The site has the workflow's first request (and holds it): the attempt is mid-request.
	handlers.WaitUntil(t, "the workflow's first request at the site", time.Millisecond, func() bool { return r.site.Hits("/search") == 1 })
	require.Equal(t, int64(1), r.ns.Client.Exists(ctx, leaseKey).Val(), "under its lease")
	require.NoError(t, r.ns.Client.Del(ctx, leaseKey).Err())
	err := recv(t, done, "the delivery's end after its lease was lost")
	dec := decisionOf(err)
	require.True(t, dec.Retry && dec.Counted, "%v", err)
	require.Zero(t, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM results`))
	require.Zero(t, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM outbox`))
	requireJob(t, r.st, key, tasks.StateRetryable, tasks.CategoryLeaseLost)
}

func TestPanicRecorded(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	key, task := r.job(t, "sku-6")
	reg := r.registryKind(t, catalog.Workflow(r.site.URL),
		func(tasks.Payload, map[string]json.RawMessage) (handlers.Observation, error) {
			var m map[string]int
			m["boom"]++ //nolint:staticcheck // nil map: the parser panics on purpose
			return handlers.Observation{}, nil
		})
	err := reg.ProcessTask(ctx, task)
	dec := decisionOf(err)
	require.True(t, dec.Retry && dec.Counted, "a panic leaves the job retryable: %v", err)
	requireState(t, r.st, key, tasks.StateRetryable)
	atts, _ := r.st.AttemptList(ctx, key)
	require.Len(t, atts, 1)
	require.Equal(t, string(tasks.CategoryPanic), atts[0].Category)
	require.Contains(t, atts[0].Error, "assignment to entry in nil map")
	require.Zero(t, r.ns.Client.Exists(ctx, r.ns.Prefix+"{"+key+"}:lease").Val(), "the lease was released")
}

// TestMetrics: after a scripted run the metrics read back equal the counts in PostgreSQL.
func TestMetrics(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	reg := prometheus.NewRegistry()
	runner := r.registry(t, func(c *handlers.Config) { c.Registerer = reg; c.MaxSessionRestarts = 3 })

	// Script: 3 clean jobs, 1 job throttled once then complete, 1 job with a session loss
	// replayed inside its attempt, 1 job failing validation, 1 duplicate delivery of a
	// complete job.
	run := func(sku string, prepare func()) (string, *asynq.Task) {
		key, task := r.job(t, sku)
		if prepare != nil {
			prepare()
		}
		_ = runner.ProcessTask(ctx, task)
		return key, task
	}
	for _, sku := range []string{"sku-1", "sku-2", "sku-3"} {
		run(sku, nil)
	}
	_, task := run("sku-4", func() { r.site.Throttle(1, time.Second) })
	require.NoError(t, runner.ProcessTask(ctx, task))
	run("sku-5", func() { r.proxy.SetDisconnectProb(1) })
	r.proxy.SetDisconnectProb(0)
	_, task = run("sku-5", nil) // retry after the session losses exhausted the restarts
	run("sku-6", func() { r.site.SetSchemaChange(true) })
	r.site.SetSchemaChange(false)
	require.NoError(t, runner.ProcessTask(ctx, task), "duplicate delivery of a complete job")

	pool := r.st.Pool()
	for _, outcome := range []string{store.OutcomeComplete, store.OutcomeRetryable, store.OutcomeFailed} {
		var total float64
		mfs, err := reg.Gather()
		require.NoError(t, err)
		for _, mf := range mfs {
			if mf.GetName() != "idemscrape_attempts_total" {
				continue
			}
			for _, m := range mf.GetMetric() {
				for _, l := range m.GetLabel() {
					if l.GetName() == "outcome" && l.GetValue() == outcome {
						total += m.GetCounter().GetValue()
					}
				}
			}
		}
		require.Equal(t, float64(testutil.Count(t, pool, `SELECT count(*) FROM attempts WHERE outcome = $1`, outcome)), total, "attempts with outcome %s", outcome)
	}
	complete := testutil.Count(t, pool, `SELECT count(*) FROM jobs WHERE state = 'complete'`)
	require.Equal(t, 5, complete)
	require.Equal(t, uint64(complete), histogramCount(t, reg, "idemscrape_attempts_per_completed_job"))
	require.Equal(t, float64(testutil.Count(t, pool, `SELECT sum(attempts)::int FROM jobs WHERE state = 'complete'`)),
		histogramSum(t, reg, "idemscrape_attempts_per_completed_job"))
	require.Equal(t, float64(testutil.Count(t, pool, `SELECT sum(bytes_total)::int FROM jobs WHERE state IN ('complete', 'failed')`)),
		histogramSum(t, reg, "idemscrape_job_bytes"), "bytes per logical job")
	require.Equal(t, float64(testutil.Count(t, pool, `SELECT count(*) FROM quarantine WHERE reason LIKE 'session_lost%'`)-1),
		sumCounter(t, reg, "idemscrape_session_restarts_total"), "every session loss but the last of its attempt caused a restart")
	require.Equal(t, 1.0, sumCounter(t, reg, "idemscrape_deliveries_acknowledged_total"))
	require.Zero(t, sumCounter(t, reg, "idemscrape_duplicate_results_total"))
	require.Equal(t, float64(testutil.Count(t, pool, `SELECT count(*) FROM results`)), float64(complete))
}

// metricSum adds up value over the metrics of family name.
func metricSum[T float64 | uint64](t *testing.T, g prometheus.Gatherer, name string, value func(*dto.Metric) T) T {
	t.Helper()
	var v T
	for _, m := range metricFamily(t, g, name) {
		v += value(m)
	}
	return v
}

func sumCounter(t *testing.T, reg *prometheus.Registry, name string) float64 {
	return metricSum(t, reg, name, func(m *dto.Metric) float64 { return m.GetCounter().GetValue() })
}

func gaugeValue(t *testing.T, reg *prometheus.Registry, name string) float64 {
	return metricSum(t, reg, name, func(m *dto.Metric) float64 { return m.GetGauge().GetValue() })
}

func histogramCount(t *testing.T, reg *prometheus.Registry, name string) uint64 {
	return metricSum(t, reg, name, func(m *dto.Metric) uint64 { return m.GetHistogram().GetSampleCount() })
}

func histogramSum(t *testing.T, reg *prometheus.Registry, name string) float64 {
	return metricSum(t, reg, name, func(m *dto.Metric) float64 { return m.GetHistogram().GetSampleSum() })
}
