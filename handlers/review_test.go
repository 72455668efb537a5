package handlers_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// registryWith registers catalog with a workflow wrapper.
func registryWith(t *testing.T, r *rig, mutate func(*handlers.Config), wrap func(*sessions.Unit, string)) *handlers.Registry {
	t.Helper()
	cfg := handlers.Config{Store: r.st, Redis: r.ns.Client, Provider: r.prov, KeyPrefix: r.ns.Prefix,
		Collector: sessions.CollectorConfig{Guard: sessions.LoopbackGuard()}, Rand: func() float64 { return 0.5 }}
	if mutate != nil {
		mutate(&cfg)
	}
	reg, err := handlers.NewRegistry(cfg)
	require.NoError(t, err)
	t.Cleanup(reg.Close)
	require.NoError(t, reg.Register(catalog.Kind, func(job tasks.Payload) (*sessions.Unit, error) {
		u, err := catalog.Workflow(r.site.URL)(job)
		if err == nil {
			wrap(u, job.Key)
		}
		return u, err
	}, catalog.Parse))
	return reg
}

// TestLostAttemptStartKeepsTask: when the database lost our attempt start (the job's fence
// is below our token), the refused commit is not "superseded": nothing newer owns the job,
// so the task must stay and be retried.
func TestLostAttemptStartKeepsTask(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	key, task := r.job(t, "sku-1")
	lost := false
	reg := registryWith(t, r, nil, func(u *sessions.Unit, key string) {
		if lost {
			return
		}
		lost = true
		orig := u.Steps[2].Run
		u.Steps[2].Run = func(ctx context.Context, sc *sessions.StepContext) error {
			// The start is lost in a crash: the row is back to what it was before it.
			_, err := r.st.Pool().Exec(ctx, `UPDATE jobs SET state = 'pending', fence = 0, attempts = 0 WHERE key = $1`, key)
			if err != nil {
				return err
			}
			if _, err := r.st.Pool().Exec(ctx, `DELETE FROM attempts WHERE job_key = $1`, key); err != nil {
				return err
			}
			return orig(ctx, sc)
		}
	})
	err := reg.ProcessTask(ctx, task)
	dec := decisionOf(err)
	require.True(t, dec.Retry && dec.Counted, "the task is kept for another delivery: %v", err)
	require.Zero(t, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM results`))
	requireState(t, r.st, key, tasks.StatePending)
	// The next delivery does the job.
	require.NoError(t, reg.ProcessTask(ctx, task))
	requireState(t, r.st, key, tasks.StateComplete)
}

// TestLeaseLossKeepsTerminalFailure: an attempt that failed terminally (here: bad proxy
// credentials discovered late) while also losing its lease stays failed; the lease loss
// must not make it retryable (which would replay unsafe steps).
func TestLeaseLossKeepsTerminalFailure(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	key, task := r.job(t, "sku-1")
	leaseKey := r.ns.Prefix + "{" + key + "}:lease"
	reg := registryWith(t, r, func(c *handlers.Config) { c.KeepOptions = &lua.KeepOptions{Interval: 20 * time.Millisecond} },
		func(u *sessions.Unit, _ string) {
			u.Steps[1].Safe = false
			u.Steps[2].Run = func(ctx context.Context, sc *sessions.StepContext) error {
				if err := r.ns.Client.Del(ctx, leaseKey).Err(); err != nil {
					return err
				}
				<-ctx.Done() // the keeper notices
				return &sessions.FetchError{Category: tasks.CategoryNotFound, Status: 404, Err: errors.New("product withdrawn")}
			}
		})
	err := reg.ProcessTask(ctx, task)
	require.True(t, decisionOf(err).Skip, "%v", err)
	job := requireState(t, r.st, key, tasks.StateFailed)
	require.NotEqual(t, string(tasks.CategoryLeaseLost), job.LastCategory)
}

func TestRegistryConfigChecks(t *testing.T) {
	r := newRig(t, rigOpts{})
	_, err := handlers.NewRegistry(handlers.Config{Store: r.st, Redis: r.ns.Client, Provider: r.prov,
		KeepOptions: &lua.KeepOptions{Interval: 20 * time.Second}})
	require.ErrorContains(t, err, "at most half the lease TTL")
	// Jitter may not push the worst renewal past half the shortest lease either.
	_, err = handlers.NewRegistry(handlers.Config{Store: r.st, Redis: r.ns.Client, Provider: r.prov,
		LeaseLengths: &handlers.LeaseLengthConfig{Min: 10 * time.Second},
		KeepOptions:  &lua.KeepOptions{Interval: 4500 * time.Millisecond, Jitter: 0.2}})
	require.ErrorContains(t, err, "KeepOptions.Interval")
	ok, err := handlers.NewRegistry(handlers.Config{Store: r.st, Redis: r.ns.Client, Provider: r.prov,
		LeaseLengths: &handlers.LeaseLengthConfig{Min: 10 * time.Second},
		KeepOptions:  &lua.KeepOptions{Interval: 4 * time.Second, Jitter: 0.2}})
	require.NoError(t, err)
	ok.Close()
	_, err = handlers.NewRegistry(handlers.Config{Store: r.st, Redis: r.ns.Client})
	require.ErrorContains(t, err, "Provider")

	// A task of a kind this worker does not know is retried, not archived: an archived
	// task would block the job's key.
	reg := r.registry(t, nil)
	err = reg.ProcessTask(context.Background(), asynq.NewTask("unknown-kind", []byte(`{}`)))
	require.Error(t, err)
	require.False(t, errors.Is(err, asynq.SkipRetry))
	require.True(t, handlers.IsFailure(err))
}

// TestEnqueueHonoursNextAttempt: re-enqueueing a retryable job (after Redis lost its task)
// schedules it for its next attempt time — a destination's Retry-After survives.
func TestEnqueueHonoursNextAttempt(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	client := asynq.NewClient(r.ns.AsynqOpt())
	defer client.Close()
	enq, err := tasks.NewEnqueuer(client, r.st, &tasks.EnqueuerConfig{Queue: r.ns.Queue})
	require.NoError(t, err)
	spec := tasks.Spec{Kind: catalog.Kind, SourceID: "sku-1", Country: "US", Window: "w", ParserVersion: 1}
	res, err := enq.Enqueue(ctx, spec)
	require.NoError(t, err)
	insp := asynq.NewInspector(r.ns.AsynqOpt())
	defer insp.Close()
	require.NoError(t, insp.DeleteTask(r.ns.Queue, res.Key))
	_, err = r.st.JobStart(ctx, store.AttemptStartParams{Key: res.Key, Token: 1})
	require.NoError(t, err)
	next := time.Now().Add(time.Hour)
	require.NoError(t, r.st.JobMarkRetryable(ctx, store.AttemptFinishParams{Key: res.Key, Token: 1, NextAttemptAt: next, Category: "throttled"}))

	res, err = enq.Enqueue(ctx, spec)
	require.NoError(t, err)
	require.Equal(t, tasks.Requeued, res.Outcome)
	info, err := insp.GetTaskInfo(r.ns.Queue, res.Key)
	require.NoError(t, err)
	require.Equal(t, asynq.TaskStateScheduled, info.State)
	// The schedule is the absolute next_attempt_at, which asynq keeps in whole seconds: the
	// tolerance is that rounding, not the time this test took.
	require.WithinDuration(t, next, info.NextProcessAt, 2*time.Second)
	require.Zero(t, r.ns.AsynqPending(t))
}
