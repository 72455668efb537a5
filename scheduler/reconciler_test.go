package scheduler_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/scheduler"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/inputs"
	"github.com/idemscrape/idemscrape/store/outbox"
	"github.com/idemscrape/idemscrape/tasks"
)

// recordJobs records n pending catalog jobs (rows only, no asynq task) and returns them.
func (b *bundle) recordJobs(t testing.TB, prefix string, n int) []tasks.JobRecord {
	t.Helper()
	recs := make([]tasks.JobRecord, n)
	for i := range recs {
		spec, err := tasks.Spec{Kind: "catalog", SourceID: fmt.Sprintf("%s-%04d", prefix, i), Country: "US",
			Window: "2026-04-23", ParserVersion: 1}.Normalize()
		require.NoError(t, err)
		key, err := spec.Key()
		require.NoError(t, err)
		recs[i] = tasks.JobRecord{Key: key, Spec: spec}
	}
	_, err := b.st.JobsRecord(context.Background(), recs)
	require.NoError(t, err)
	return recs
}

// run starts an attempt of key as a worker would: lease claimed, attempt started under its
// token. It returns the lease.
func (b *bundle) run(t testing.TB, leases *lua.Leases, key, owner string) lua.Lease {
	t.Helper()
	ctx := context.Background()
	job, err := b.st.JobGet(ctx, key)
	require.NoError(t, err)
	lease, err := leases.Claim(ctx, key, owner, time.Minute, job.Fence)
	require.NoError(t, err)
	_, err = b.st.JobStart(ctx, store.AttemptStartParams{Key: key, Token: lease.Token, Worker: owner})
	require.NoError(t, err)
	return lease
}

// die simulates the death of the worker holding lease: its lease expires (deleted).
func (b *bundle) die(t testing.TB, leases *lua.Leases, lease lua.Lease) {
	t.Helper()
	require.NoError(t, b.ns.Client.Del(context.Background(), leases.Keys().Lease(lease.Key)).Err())
}

type recOpts struct {
	now    func() time.Time
	id     string
	outbox scheduler.OutboxMaintainer
	insp   *asynq.Inspector
	yaml   string // reconciler section
}

func (b *bundle) reconciler(t testing.TB, o recOpts) *scheduler.Reconciler {
	t.Helper()
	f, err := scheduler.ParseFile([]byte("kinds:\n  catalog: {queue: "+b.ns.Queue+", max_lease: 10m}\nreconciler: {"+o.yaml+"}\n"), "", nil)
	require.NoError(t, err)
	if o.now == nil {
		// An hour later: every attempt started by the test looks older than its lease.
		o.now = func() time.Time { return time.Now().Add(time.Hour) }
	}
	r, err := scheduler.NewReconciler(scheduler.ReconcilerConfig{
		File: f, Store: b.st, Outbox: o.outbox, Redis: b.ns.Client, Client: b.client, Inspector: o.insp,
		KeyPrefix: b.ns.Prefix, ID: o.id, Logger: quietLogger(), Now: o.now,
	})
	require.NoError(t, err)
	return r
}

func (b *bundle) leases(t testing.TB) *lua.Leases {
	t.Helper()
	l, err := lua.NewLeases(b.ns.Client, b.ns.Prefix)
	require.NoError(t, err)
	return l
}

func TestReconcilerNeverStealsLiveJob(t *testing.T) {
	ctx := context.Background()
	b := setup(t)
	leases := b.leases(t)
	recs := b.recordJobs(t, "live", 2)
	live, dead := recs[0].Key, recs[1].Key
	liveLease := b.run(t, leases, live, "slow-worker")
	deadLease := b.run(t, leases, dead, "dead-worker")
	b.die(t, leases, deadLease)

	t.Run("YoungAttemptsNotExamined", func(t *testing.T) {
		r := b.reconciler(t, recOpts{now: time.Now})
		rep := r.Sweep(ctx)
		require.NoError(t, rep.Err)
		assert.Zero(t, rep.Actions[scheduler.ActionRescued]+rep.Actions[scheduler.ActionLeaseHeld])
		job, err := b.st.JobGet(ctx, dead)
		require.NoError(t, err)
		assert.Equal(t, tasks.StateRunning, job.State, "an attempt younger than its kind's lease is left alone")
	})

	r := b.reconciler(t, recOpts{})
	rep := r.Sweep(ctx)
	require.NoError(t, rep.Err)

	t.Run("SlowLiveWorkerLeftAlone", func(t *testing.T) {
		assert.EqualValues(t, 1, rep.Actions[scheduler.ActionLeaseHeld])
		job, err := b.st.JobGet(ctx, live)
		require.NoError(t, err)
		assert.Equal(t, tasks.StateRunning, job.State)
		assert.Equal(t, liveLease.Token, job.Fence)
		assert.False(t, b.ns.AsynqTaskExists(t, live), "no task enqueued for a job a worker is running")
		// The live worker still holds its lease and commits.
		require.NoError(t, leases.Renew(ctx, liveLease, time.Minute))
		_, err = b.st.Commit(ctx, store.CommitParams{Key: live, Token: liveLease.Token, ObservationKey: live, ParserVersion: 1,
			Data: []byte(`{}`), EventKey: "observed:" + live, Topic: "catalog", EventPayload: []byte(`{}`)})
		require.NoError(t, err)
	})
	t.Run("DeadWorkersJobRescuedAndFenced", func(t *testing.T) {
		assert.EqualValues(t, 1, rep.Actions[scheduler.ActionRescued])
		assert.EqualValues(t, 1, rep.Actions[scheduler.ActionRequeued])
		job, err := b.st.JobGet(ctx, dead)
		require.NoError(t, err)
		assert.Equal(t, tasks.StateRetryable, job.State)
		assert.Greater(t, job.Fence, deadLease.Token)
		assert.True(t, b.ns.AsynqTaskExists(t, dead), "the rescued job is enqueued again")
		// The dead worker wakes up: its commit is refused.
		_, err = b.st.Commit(ctx, store.CommitParams{Key: dead, Token: deadLease.Token, ObservationKey: dead, ParserVersion: 1,
			Data: []byte(`{}`), EventKey: "observed:" + dead, Topic: "catalog", EventPayload: []byte(`{}`)})
		assert.ErrorIs(t, err, store.ErrStaleFence)
		// The reconciler released the lease it claimed: a worker can claim at once.
		l, err := leases.Claim(ctx, dead, "next-worker", time.Minute, job.Fence)
		require.NoError(t, err)
		assert.Greater(t, l.Token, job.Fence)
	})
	t.Run("CountedInStats", func(t *testing.T) {
		st, err := b.st.StatsGet(ctx)
		require.NoError(t, err)
		assert.EqualValues(t, 1, st.Maintenance[scheduler.ActionRescued])
		assert.EqualValues(t, 1, st.Maintenance[scheduler.ActionLeaseHeld])
		assert.EqualValues(t, 1, testutil.ToFloat64(metricOf(t, r, scheduler.ActionRescued)))
	})
}

func TestReconcilerConcurrent(t *testing.T) {
	ctx := context.Background()
	b := setup(t)
	leases := b.leases(t)
	const stranded, lost = 40, 40
	running := b.recordJobs(t, "run", stranded)
	fences := map[string]int64{}
	for _, rec := range running {
		l := b.run(t, leases, rec.Key, "dead-worker")
		b.die(t, leases, l)
		fences[rec.Key] = l.Token
	}
	pending := b.recordJobs(t, "pend", lost) // rows whose task was never enqueued (or lost)

	// Three reconcilers, small pages, sweeping the same jobs at once.
	recs := make([]*scheduler.Reconciler, 3)
	for i := range recs {
		recs[i] = b.reconciler(t, recOpts{id: fmt.Sprintf("r%d", i), yaml: "batch_size: 7"})
	}
	reports := make([]scheduler.SweepReport, len(recs))
	var wg sync.WaitGroup
	for i, r := range recs {
		wg.Add(1)
		go func() { defer wg.Done(); reports[i] = r.Sweep(ctx) }()
	}
	wg.Wait()

	total := map[string]int64{}
	for _, rep := range reports {
		require.NoError(t, rep.Err)
		for a, n := range rep.Actions {
			total[a] += n
		}
	}
	assert.EqualValues(t, stranded, total[scheduler.ActionRescued], "each stranded job rescued exactly once: %v", total)
	for _, rec := range running {
		job, err := b.st.JobGet(ctx, rec.Key)
		require.NoError(t, err)
		assert.Equal(t, tasks.StateRetryable, job.State)
		assert.Equal(t, fences[rec.Key]+1, job.Fence, "%s: one transition, fenced by the first rescuer's token", rec.Key)
		attempts, err := b.st.AttemptList(ctx, rec.Key)
		require.NoError(t, err)
		require.Len(t, attempts, 1, "a rescue is not an attempt")
		assert.Equal(t, store.OutcomeLost, attempts[0].Outcome, "the rescue wrote the stranded attempt's row")
	}
	assert.EqualValues(t, stranded+lost, b.ns.AsynqPending(t), "one task per job, no duplicate")
	for _, rec := range append(running, pending...) {
		assert.True(t, b.ns.AsynqTaskExists(t, rec.Key))
	}
	// A reconciler that re-enqueues a job another one has just re-enqueued is refused by
	// asynq's TaskID and counts it as already queued: each task is created exactly once.
	assert.EqualValues(t, stranded+lost, total[scheduler.ActionRequeued], "every job enqueued once: %v", total)

	t.Run("NextSweepFindsNothing", func(t *testing.T) {
		rep := recs[0].Sweep(ctx)
		require.NoError(t, rep.Err)
		assert.Zero(t, rep.Actions[scheduler.ActionRescued]+rep.Actions[scheduler.ActionRequeued], "%v", rep.Actions)
	})
}

func TestReconcilerArchivedTask(t *testing.T) {
	ctx := context.Background()
	b := setup(t)
	insp := asynq.NewInspector(b.ns.AsynqOpt())
	t.Cleanup(func() { _ = insp.Close() })
	enq, err := tasks.NewEnqueuer(b.client, b.st, &tasks.EnqueuerConfig{Queue: b.ns.Queue})
	require.NoError(t, err)
	recs := b.recordJobs(t, "arch", 1)
	res, err := enq.Enqueue(ctx, recs[0].Spec)
	require.NoError(t, err)
	require.NoError(t, insp.ArchiveTask(b.ns.Queue, res.Key))

	t.Run("WithoutInspectorCountedNotRepaired", func(t *testing.T) {
		rep := b.reconciler(t, recOpts{}).Sweep(ctx)
		require.NoError(t, rep.Err)
		assert.EqualValues(t, 1, rep.Actions[scheduler.ActionAlreadyQueued])
	})
	t.Run("Repaired", func(t *testing.T) {
		rep := b.reconciler(t, recOpts{insp: insp}).Sweep(ctx)
		require.NoError(t, rep.Err)
		assert.EqualValues(t, 1, rep.Actions[scheduler.ActionArchivedRepair], "%v", rep.Actions)
		info, err := insp.GetTaskInfo(b.ns.Queue, res.Key)
		require.NoError(t, err)
		assert.Equal(t, asynq.TaskStatePending, info.State)
	})
}

func TestReconcilerOutbox(t *testing.T) {
	ctx := context.Background()
	b := setup(t)
	pool := b.st.Pool()
	_, err := pool.Exec(ctx, `
INSERT INTO outbox (event_key, topic, payload, created_at)
SELECT 'old-sent-' || i, 't', '{}', now() - interval '30 days' FROM generate_series(1, 25) i;
INSERT INTO outbox (event_key, topic, payload, created_at)
SELECT 'new-sent-' || i, 't', '{}', now() FROM generate_series(1, 3) i;
INSERT INTO outbox_positions (topic, xid, id)
SELECT DISTINCT ON (topic) topic, xid, id FROM outbox ORDER BY topic, xid DESC, id DESC
ON CONFLICT (topic) DO UPDATE SET xid = excluded.xid, id = excluded.id;
INSERT INTO outbox (event_key, topic, payload, created_at) VALUES ('stuck', 't', '{}', now() - interval '1 hour'), ('fresh', 't', '{}', now());
INSERT INTO outbox_inbox (consumer_group, event_key, seen_at)
SELECT 'g', 'old-' || i, now() - interval '90 days' FROM generate_series(1, 12) i;
INSERT INTO outbox_inbox (consumer_group, event_key) VALUES ('g', 'new');`)
	require.NoError(t, err)
	maint, err := outbox.NewMaintainer(pool)
	require.NoError(t, err)
	r := b.reconciler(t, recOpts{outbox: maint, yaml: "prune_batch: 10"})
	rep := r.Sweep(ctx)
	require.NoError(t, rep.Err)
	assert.EqualValues(t, 1, rep.OutboxUnsent, "only the row unsent past the threshold is reported")
	assert.EqualValues(t, 1, rep.Actions[scheduler.ActionOutboxLagging])
	assert.EqualValues(t, 25, rep.Actions[scheduler.ActionOutboxPruned])
	assert.EqualValues(t, 12, rep.Actions[scheduler.ActionInboxPruned])
	assert.Equal(t, 5, countRows(t, b, `SELECT count(*) FROM outbox`), "3 recent sent + 2 unsent remain")
	assert.Equal(t, 1, countRows(t, b, `SELECT count(*) FROM outbox_inbox`))
}

func TestReconcilerLoop(t *testing.T) {
	b := setup(t)
	leases := b.leases(t)
	rec := b.recordJobs(t, "loop", 1)[0]
	b.die(t, leases, b.run(t, leases, rec.Key, "dead"))
	f, err := scheduler.ParseFile([]byte("kinds:\n  catalog: {queue: "+b.ns.Queue+"}\nreconciler: {interval: 1ms}\n"), "", nil)
	require.NoError(t, err)
	signal := make(chan scheduler.SweepReport)
	r, err := scheduler.NewReconciler(scheduler.ReconcilerConfig{File: f, Store: b.st, Redis: b.ns.Client, Client: b.client,
		KeyPrefix: b.ns.Prefix, Logger: quietLogger(), TestSignal: signal,
		Now: func() time.Time { return time.Now().Add(time.Hour) }})
	require.NoError(t, err)
	require.NoError(t, r.Start(context.Background()))
	require.NoError(t, r.Start(context.Background()), "Start twice is a no-op")
	first := <-signal
	second := <-signal
	r.Stop()
	r.Stop()
	assert.EqualValues(t, 1, first.Actions[scheduler.ActionRescued])
	assert.Zero(t, second.Actions[scheduler.ActionRescued]+second.Actions[scheduler.ActionRequeued], "the second sweep finds it done")
}

func countRows(t *testing.T, b *bundle, q string) int {
	t.Helper()
	var n int
	require.NoError(t, b.st.Pool().QueryRow(context.Background(), q).Scan(&n))
	return n
}

// failingRescue is the store with a JobsRescue statement that fails as a whole.
type failingRescue struct {
	*store.PG
	calls int
	mu    sync.Mutex
}

func (f *failingRescue) JobsRescue(context.Context, []store.JobRescueParams) ([]error, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	return nil, fmt.Errorf("connection reset")
}

// TestReconcilerRescueStatementFails: when a page's rescue statement fails, the sweep
// reports it, the jobs stay running, and every lease the reconciler claimed for the page
// is released, so the next sweep rescues them (and enqueues their tasks).
func TestReconcilerRescueStatementFails(t *testing.T) {
	ctx := context.Background()
	b := setup(t)
	leases := b.leases(t)
	recs := b.recordJobs(t, "fail", 3)
	for _, rec := range recs {
		b.die(t, leases, b.run(t, leases, rec.Key, "dead-worker"))
	}
	f, err := scheduler.ParseFile([]byte("kinds:\n  catalog: {queue: "+b.ns.Queue+", max_lease: 10m}\n"), "", nil)
	require.NoError(t, err)
	failing := &failingRescue{PG: b.st}
	r, err := scheduler.NewReconciler(scheduler.ReconcilerConfig{
		File: f, Store: failing, Redis: b.ns.Client, Client: b.client, KeyPrefix: b.ns.Prefix, Logger: quietLogger(),
		Now: func() time.Time { return time.Now().Add(time.Hour) },
	})
	require.NoError(t, err)
	rep := r.Sweep(ctx)
	require.ErrorContains(t, rep.Err, "connection reset")
	assert.EqualValues(t, 1, rep.Actions[scheduler.ActionSweepErrors])
	assert.Zero(t, rep.Actions[scheduler.ActionRescued])
	assert.Equal(t, 1, failing.calls, "one statement for the page")
	for _, rec := range recs {
		job, err := b.st.JobGet(ctx, rec.Key)
		require.NoError(t, err)
		assert.Equal(t, tasks.StateRunning, job.State)
		n, err := b.ns.Client.Exists(ctx, leases.Keys().Lease(rec.Key)).Result()
		require.NoError(t, err)
		assert.Zero(t, n, "lease of %s released", rec.Key)
		assert.False(t, b.ns.AsynqTaskExists(t, rec.Key))
	}

	rep = b.reconciler(t, recOpts{}).Sweep(ctx)
	require.NoError(t, rep.Err)
	assert.EqualValues(t, 3, rep.Actions[scheduler.ActionRescued], "%v", rep.Actions)
	assert.EqualValues(t, 3, rep.Actions[scheduler.ActionRequeued], "%v", rep.Actions)
	for _, rec := range recs {
		job, err := b.st.JobGet(ctx, rec.Key)
		require.NoError(t, err)
		assert.Equal(t, tasks.StateRetryable, job.State)
		assert.True(t, b.ns.AsynqTaskExists(t, rec.Key))
	}
}

// TestReconcilerKeyMismatch: a runnable job whose recorded spec no longer derives its key
// (the normaliser changed since it was enqueued) is counted and left for review — never
// enqueued under another key, which would record a second job.
func TestReconcilerKeyMismatch(t *testing.T) {
	ctx := context.Background()
	b := setup(t)
	recs := b.recordJobs(t, "drift", 1)
	_, err := b.st.Pool().Exec(ctx, `UPDATE jobs SET key = 'catalog:drifted-key' WHERE key = $1`, recs[0].Key)
	require.NoError(t, err)
	before := countRows(t, b, `SELECT count(*) FROM jobs`)
	rep := b.reconciler(t, recOpts{}).Sweep(ctx)
	require.NoError(t, rep.Err)
	assert.EqualValues(t, 1, rep.Actions[scheduler.ActionKeyMismatch], "%v", rep.Actions)
	assert.Zero(t, rep.Actions[scheduler.ActionRequeued])
	assert.Equal(t, before, countRows(t, b, `SELECT count(*) FROM jobs`), "no second job recorded under the derived key")
}

// TestReconcilerPrunesSavedInputs: saved inputs older than saved_input_retention go (their
// responses with them), recent ones stay; a body only an old input used goes, a body a
// recent input shares stays. Counted in the report, the metric and the counters table.
func TestReconcilerPrunesSavedInputs(t *testing.T) {
	ctx := context.Background()
	b := setup(t)
	leases := b.leases(t)
	pool := b.st.Pool()
	in := inputs.New(pool)
	recs := b.recordJobs(t, "saved", 7)
	shared := []byte(strings.Repeat("shared body ", 20))
	for i, rec := range recs {
		lease := b.run(t, leases, rec.Key, "w")
		body := append([]byte(fmt.Sprintf("own body %d ", i)), shared[:40]...)
		res, err := in.Save(ctx, inputs.SaveParams{Key: rec.Key, Fence: lease.Token, Kind: "catalog", ParserVersion: 1,
			Outcome: inputs.OutcomeParsed, Staged: map[string]json.RawMessage{"i": json.RawMessage(fmt.Sprint(i))},
			Responses: []inputs.Response{
				{URL: "https://shop.example.com/p/" + fmt.Sprint(i), Status: 200, FetchedAt: time.Now(), Body: body},
				{URL: "https://shop.example.com/shared", Status: 200, FetchedAt: time.Now(), Body: shared},
			}})
		require.NoError(t, err)
		require.True(t, res.Saved)
	}
	// The first five are 40 days old, and so is every body's last use; the last two are
	// recent (they keep the shared body, their own bodies and staged data).
	old := recs[:5]
	oldKeys := make([]string, len(old))
	for i, r := range old {
		oldKeys[i] = r.Key
	}
	_, err := pool.Exec(ctx, `UPDATE saved_inputs SET created_at = now() - interval '40 days' WHERE job_key = ANY($1)`, oldKeys)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE input_blobs SET last_used_at = now() - interval '40 days'`)
	require.NoError(t, err)
	blobsBefore := countRows(t, b, `SELECT count(*) FROM input_blobs`)
	require.Equal(t, 7*2+1, blobsBefore, "7 staged + 7 own bodies + 1 shared body")

	// prune_batch 2: several batches in one sweep.
	r := b.reconciler(t, recOpts{yaml: "prune_batch: 2, saved_input_retention: 720h"})
	rep := r.Sweep(ctx)
	require.NoError(t, rep.Err)
	assert.EqualValues(t, 5, rep.Actions[scheduler.ActionSavedInputsPruned], "%v", rep.Actions)
	assert.EqualValues(t, 10, rep.Actions[scheduler.ActionInputBlobsPruned], "the old inputs' staged data and own bodies")
	assert.Equal(t, 2, countRows(t, b, `SELECT count(*) FROM saved_inputs`))
	assert.Equal(t, 0, countRows(t, b, `SELECT count(*) FROM saved_inputs WHERE job_key = ANY('{`+strings.Join(oldKeys, ",")+`}')`))
	assert.Equal(t, 4, countRows(t, b, `SELECT count(*) FROM saved_responses`), "the recent inputs' responses stay")
	assert.Equal(t, 5, countRows(t, b, `SELECT count(*) FROM input_blobs`), "2 staged + 2 own bodies + the shared body")
	for _, rec := range recs[5:] {
		got, err := in.Select(ctx, inputs.Selection{Keys: []string{rec.Key}}, "", 10)
		require.NoError(t, err)
		require.Len(t, got, 1, "a recent saved input is still readable")
	}
	assert.Equal(t, 5.0, testutil.ToFloat64(metricOf(t, r, scheduler.ActionSavedInputsPruned)))
	assert.Equal(t, 10.0, testutil.ToFloat64(metricOf(t, r, scheduler.ActionInputBlobsPruned)))
	stats, err := b.st.StatsGet(ctx)
	require.NoError(t, err)
	assert.EqualValues(t, 5, stats.Maintenance[scheduler.ActionSavedInputsPruned], "shown by idemscrape stats")
	assert.EqualValues(t, 10, stats.Maintenance[scheduler.ActionInputBlobsPruned])

	// A second sweep finds nothing more to delete.
	rep = r.Sweep(ctx)
	require.NoError(t, rep.Err)
	assert.Zero(t, rep.Actions[scheduler.ActionSavedInputsPruned]+rep.Actions[scheduler.ActionInputBlobsPruned])
}

// TestReconcilerUsesRecordedQueue: a job enqueued to a queue other than its kind's (an
// enqueuer with its own Queue, `idemscrape enqueue -queue`) keeps that queue: the
// reconciler finds its live task there and adds none to the kind's queue (asynq checks
// ids per queue: a second task would run the job twice), and once the task is gone it
// enqueues it again there. Another enqueuer of the kind's queue does the same.
func TestReconcilerUsesRecordedQueue(t *testing.T) {
	ctx := context.Background()
	b := setup(t)
	other := b.ns.Queue + "-priority"
	insp := asynq.NewInspector(b.ns.AsynqOpt())
	t.Cleanup(func() { _ = insp.Close() })
	enq, err := tasks.NewEnqueuer(b.client, b.st, &tasks.EnqueuerConfig{Queue: other, Redis: b.ns.Client})
	require.NoError(t, err)
	spec := tasks.Spec{Kind: "catalog", SourceID: "q-1", Country: "US", Window: "2026-04-23", ParserVersion: 1}
	res, err := enq.Enqueue(ctx, spec)
	require.NoError(t, err)
	require.Equal(t, tasks.Created, res.Outcome)
	job, err := b.st.JobGet(ctx, res.Key)
	require.NoError(t, err)
	require.Equal(t, other, job.Queue, "recorded with the job")

	kindEnq, err := tasks.NewEnqueuer(b.client, b.st, &tasks.EnqueuerConfig{Queue: b.ns.Queue, Redis: b.ns.Client})
	require.NoError(t, err)
	again, err := kindEnq.Enqueue(ctx, spec)
	require.NoError(t, err)
	assert.Equal(t, tasks.AlreadyQueued, again.Outcome, "the kind's enqueuer finds the task in the job's queue")

	rep := b.reconciler(t, recOpts{insp: insp}).Sweep(ctx)
	require.NoError(t, rep.Err)
	assert.Zero(t, rep.Actions[scheduler.ActionRequeued], "%v", rep.Actions)
	assert.Zero(t, rep.Actions[scheduler.ActionAlreadyQueued], "its task was found where it is, not looked for in vain: %v", rep.Actions)
	assert.False(t, b.ns.AsynqTaskExists(t, res.Key), "no task in the kind's queue %s", b.ns.Queue)
	_, err = insp.GetTaskInfo(other, res.Key)
	require.NoError(t, err, "the task is in the job's queue")

	// The task is lost: enqueued again in the job's queue, not the kind's.
	require.NoError(t, insp.DeleteTask(other, res.Key))
	rep = b.reconciler(t, recOpts{insp: insp}).Sweep(ctx)
	require.NoError(t, rep.Err)
	assert.EqualValues(t, 1, rep.Actions[scheduler.ActionRequeued], "%v", rep.Actions)
	info, err := insp.GetTaskInfo(other, res.Key)
	require.NoError(t, err)
	assert.Equal(t, asynq.TaskStatePending, info.State)
	assert.False(t, b.ns.AsynqTaskExists(t, res.Key))
	_ = insp.DeleteQueue(other, true) // the test's own queue
}
