package tasks_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// batchSpecs are n specs of kind catalog, source ids sku-from..
func batchSpecs(from, n int) []tasks.Spec {
	specs := make([]tasks.Spec, n)
	for i := range specs {
		specs[i] = tasks.Spec{Kind: "catalog", SourceID: fmt.Sprintf("sku-%d", from+i), Country: "US", Window: "2026-04-23", ParserVersion: 1}
	}
	return specs
}

// completeJobs marks the jobs of keys complete in PostgreSQL, as a runner's commit leaves
// them (their tasks done and deleted).
func completeJobs(t *testing.T, st *store.PG, keys ...string) {
	t.Helper()
	_, err := st.Pool().Exec(context.Background(), `UPDATE jobs SET state = 'complete', completed_at = now() WHERE key = ANY($1)`, keys)
	require.NoError(t, err)
}

// TestEnqueueManyConcurrency: with EnqueuerConfig.Concurrency 16 a batch gets the outcomes
// it gets one enqueue at a time — new jobs Created, a lost task Requeued, an archived one
// Repaired, complete and failed jobs left alone, a live task and a key given twice
// AlreadyQueued — and asynq holds one task per runnable job. A negative Concurrency is
// refused.
func TestEnqueueManyConcurrency(t *testing.T) {
	_, err := tasks.NewEnqueuer(&asynq.Client{}, failingRecorder{}, &tasks.EnqueuerConfig{Concurrency: -1})
	require.ErrorContains(t, err, "Concurrency -1 is negative")

	for _, fast := range []bool{false, true} {
		t.Run(map[bool]string{false: "ThroughAsynq", true: "FastPath"}[fast], func(t *testing.T) { testEnqueueManyConcurrency(t, fast) })
	}
}

func testEnqueueManyConcurrency(t *testing.T, fast bool) {
	ctx := context.Background()
	b := setupEnqueue(t)
	cfg := &tasks.EnqueuerConfig{Queue: b.ns.Queue, Inspector: b.insp, Concurrency: 16}
	if fast {
		cfg.Redis = b.ns.Client
	}
	enq, err := tasks.NewEnqueuer(b.client, b.store, cfg)
	require.NoError(t, err)

	old := batchSpecs(0, 5)
	first, err := enq.EnqueueMany(ctx, old)
	require.NoError(t, err)
	keys := make([]string, len(first))
	for i, r := range first {
		require.Equal(t, tasks.Created, r.Outcome)
		keys[i] = r.Key
	}
	require.NoError(t, b.insp.DeleteTask(b.ns.Queue, keys[0]))  // lost
	require.NoError(t, b.insp.ArchiveTask(b.ns.Queue, keys[1])) // archived
	require.NoError(t, b.insp.DeleteTask(b.ns.Queue, keys[2]))
	require.NoError(t, b.insp.DeleteTask(b.ns.Queue, keys[3]))
	completeJobs(t, b.store, keys[2])
	_, err = b.store.Pool().Exec(ctx, `UPDATE jobs SET state = 'failed' WHERE key = $1`, keys[3])
	require.NoError(t, err)

	fresh := batchSpecs(100, 60)
	specs := append(append(append([]tasks.Spec{}, old...), fresh...), fresh[7], old[4])
	res, err := enq.EnqueueMany(ctx, specs)
	require.NoError(t, err)
	require.Len(t, res, len(specs))
	want := []tasks.Outcome{tasks.Requeued, tasks.Repaired, tasks.AlreadyComplete, tasks.AlreadyFailed, tasks.AlreadyQueued}
	for range fresh {
		want = append(want, tasks.Created)
	}
	want = append(want, tasks.AlreadyQueued, tasks.AlreadyQueued)
	got := make([]tasks.Outcome, len(res))
	for i, r := range res {
		got[i] = r.Outcome
		key, err := specs[i].Key()
		require.NoError(t, err)
		assert.Equal(t, key, r.Key, "results in the order of specs")
	}
	assert.Equal(t, want, got)
	assert.Equal(t, 3+len(fresh), b.ns.AsynqPending(t), "one task per runnable job")
}

// failingRecorder's JobsRecord fails, as a PostgreSQL that went away does.
type failingRecorder struct{ err error }

func (f failingRecorder) JobsRecord(context.Context, []tasks.JobRecord) ([]tasks.JobRecordResult, error) {
	return nil, f.err
}

// TestEnqueueManyBatchError: a batch that fails after validation says what is in place.
// The jobs statement fails: nothing recorded, no outcome, the error itself. Redis goes
// away (a proxy of the test's own refuses) before the tasks: the rows are recorded, the
// complete jobs are in place, the others have no outcome — whatever the Concurrency; the
// same batch again, Redis back, enqueues those (Requeued) and one task each.
func TestEnqueueManyBatchError(t *testing.T) {
	ctx := context.Background()
	pgDown := errors.New("store: JobsRecord: unexpected EOF")
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: testutil.RedisAddr()})
	t.Cleanup(func() { _ = client.Close() })
	enq, err := tasks.NewEnqueuer(client, failingRecorder{pgDown}, nil)
	require.NoError(t, err)
	_, err = enq.EnqueueMany(ctx, batchSpecs(0, 3))
	var be *tasks.BatchError
	require.ErrorAs(t, err, &be)
	assert.ErrorIs(t, err, pgDown)
	assert.Equal(t, pgDown.Error(), err.Error())
	assert.False(t, be.Recorded)
	require.Len(t, be.Results, 3)
	for _, r := range be.Results {
		assert.NotEmpty(t, r.Key)
		assert.Zero(t, r.Outcome)
	}
	_, err = enq.EnqueueMany(ctx, []tasks.Spec{{Kind: "catalog"}})
	assert.ErrorIs(t, err, tasks.ErrInvalidSpec)
	assert.False(t, errors.As(err, &be), "an invalid spec stores nothing: no BatchError")

	for _, conc := range []int{1, 16} {
		t.Run(fmt.Sprintf("RedisGoesAway/Concurrency%d", conc), func(t *testing.T) {
			b := setupEnqueue(t)
			proxy := testutil.NewTCPProxy(t, b.ns.Addr)
			client := asynq.NewClient(asynq.RedisClientOpt{Addr: proxy.Addr})
			t.Cleanup(func() { _ = client.Close() })
			enq, err := tasks.NewEnqueuer(client, b.store, &tasks.EnqueuerConfig{Queue: b.ns.Queue, Inspector: b.insp, Concurrency: conc})
			require.NoError(t, err)
			specs := batchSpecs(0, 40)
			// Jobs 5 and 30 are complete already: in place without Redis.
			first, err := b.enq.EnqueueMany(ctx, []tasks.Spec{specs[5], specs[30]})
			require.NoError(t, err)
			require.NoError(t, b.insp.DeleteTask(b.ns.Queue, first[0].Key))
			require.NoError(t, b.insp.DeleteTask(b.ns.Queue, first[1].Key))
			completeJobs(t, b.store, first[0].Key, first[1].Key)

			proxy.Refuse()
			_, err = enq.EnqueueMany(ctx, specs)
			require.ErrorAs(t, err, &be)
			assert.ErrorContains(t, err, "tasks: enqueue ")
			assert.True(t, be.Recorded)
			require.Len(t, be.Results, len(specs))
			for i, r := range be.Results {
				if i == 5 || i == 30 {
					assert.Equal(t, tasks.AlreadyComplete, r.Outcome, i)
					continue
				}
				assert.Zero(t, r.Outcome, "spec %d: Redis refused every enqueue", i)
				assert.Equal(t, tasks.StatePending, r.State, "spec %d: its row is recorded", i)
			}
			assert.Zero(t, b.ns.AsynqPending(t))

			proxy.Accept()
			res, err := enq.EnqueueMany(ctx, specs)
			require.NoError(t, err)
			for i, r := range res {
				want := tasks.Requeued
				if i == 5 || i == 30 {
					want = tasks.AlreadyComplete
				}
				assert.Equal(t, want, r.Outcome, i)
			}
			assert.Equal(t, len(specs)-2, b.ns.AsynqPending(t))
		})
	}
}
