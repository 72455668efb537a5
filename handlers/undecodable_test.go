package handlers_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/tasks"
)

// TestUndecodablePayloadAgeBound: a task whose payload no worker can read is retried late
// and uncounted only while its job is younger than UndecodableMaxAge; past it, the job
// fails as internal (its attempt says why) and the task is archived; a task without a jobs
// row is revoked. Delivered by a real asynq server: the task id (the job key) is what the
// runner reads from the delivery's context.
func TestUndecodablePayloadAgeBound(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	later := func(c *handlers.Config) {
		c.Now = func() time.Time { return time.Now().Add(25 * time.Hour) } // a day and more later
	}
	young, old := r.registry(t, nil), r.registry(t, later)
	youngKey, _ := r.job(t, "sku-young")
	oldKey, _ := r.job(t, "sku-old")
	const noRow = "catalog:no-such-job"
	regOf := map[string]*handlers.Registry{youngKey: young, oldKey: old, noRow: old}

	client := asynq.NewClient(r.ns.AsynqOpt())
	defer client.Close()
	for id := range regOf {
		_, err := client.Enqueue(asynq.NewTask(catalog.Kind, []byte(`{"v":99}`)), asynq.TaskID(id), asynq.Queue(r.ns.Queue))
		require.NoError(t, err)
	}
	type delivery struct {
		id  string
		err error
	}
	got := make(chan delivery, 10)
	srv := asynq.NewServer(r.ns.AsynqOpt(), young.ServerConfig(asynq.Config{
		Queues: map[string]int{r.ns.Queue: 1}, Concurrency: 3, LogLevel: asynq.FatalLevel}))
	require.NoError(t, srv.Start(asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		err := regOf[id].ProcessTask(ctx, task)
		got <- delivery{id, err}
		return err
	})))
	errs := map[string]error{}
	for len(errs) < len(regOf) {
		d := <-got
		errs[d.id] = d.err
	}
	srv.Shutdown()

	// Young: retried late, uncounted, the job untouched.
	yd := decisionOf(errs[youngKey])
	require.True(t, yd.Retry, yd.ErrorMsg)
	assert.False(t, yd.Counted)
	assert.GreaterOrEqual(t, yd.Delay, 10*time.Minute)
	requireState(t, r.st, youngKey, tasks.StatePending)

	// Old: the job failed as internal, with an attempt that says why; the task archived.
	od := decisionOf(errs[oldKey])
	require.True(t, od.Skip, od.ErrorMsg)
	requireJob(t, r.st, oldKey, tasks.StateFailed, tasks.CategoryInternal)
	attempts, err := r.st.AttemptList(ctx, oldKey)
	require.NoError(t, err)
	require.Len(t, attempts, 1)
	assert.Equal(t, string(tasks.CategoryInternal), attempts[0].Category)
	assert.Contains(t, attempts[0].Error, "task payload not readable")
	assert.Contains(t, attempts[0].Error, "UndecodableMaxAge 24h0m0s")

	// No jobs row: revoked.
	assert.True(t, errors.Is(errs[noRow], asynq.RevokeTask), "%v", errs[noRow])

	t.Run("Config", func(t *testing.T) {
		_, err := handlers.NewRegistry(handlers.Config{Store: r.st, Redis: r.ns.Client, Provider: r.prov, UndecodableMaxAge: -time.Hour})
		require.ErrorContains(t, err, "UndecodableMaxAge")
	})
}
