package scheduler_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/scheduler"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestRequeueMarkerRollback: Redis comes back from an RDB snapshot taken before 30 jobs
// were enqueued (a restored backup, a replica that lagged): their tasks are gone, but the
// queue's tasks-checked marker is there, as it was then. The jobs did not change since (they
// are not in the changed pass) and the key-order scan checks one job per sweep; the next
// sweep must still tell the rollback (the marker's seq is below PostgreSQL's record) and
// check every runnable job of the queue: all 30 get their task back, and a task the
// snapshot holds archived is repaired in the same pass. (Fails on a marker that only has to
// exist: the restored one does.)
func TestRequeueMarkerRollback(t *testing.T) {
	ctx := context.Background()
	srv := testutil.StartRedis(t)
	rdb := srv.Client()
	opt := asynq.RedisClientOpt{Addr: srv.Addr}
	client := asynq.NewClient(opt)
	t.Cleanup(func() { _ = client.Close() })
	insp := asynq.NewInspector(opt)
	t.Cleanup(func() { _ = insp.Close() })
	st := store.New(testutil.PG(t))
	queue, prefix := "rb"+testutil.RandomID(4), "rb:"
	f, err := scheduler.ParseFile([]byte("kinds:\n  catalog: {queue: "+queue+"}\nreconciler: {requeue_scan_per_sweep: 1}\n"), "", nil)
	require.NoError(t, err)
	r, err := scheduler.NewReconciler(scheduler.ReconcilerConfig{File: f, Store: st, Redis: rdb, Client: client,
		Inspector: insp, KeyPrefix: prefix, Logger: quietLogger()})
	require.NoError(t, err)
	sweep := func(what string) scheduler.SweepReport {
		t.Helper()
		rep := r.Sweep(ctx)
		require.NoError(t, rep.Err, what)
		t.Logf("%s: full %v %v", what, rep.FullRequeue, rep.Actions)
		return rep
	}
	enq, err := tasks.NewEnqueuer(client, st, &tasks.EnqueuerConfig{Queue: queue})
	require.NoError(t, err)
	enqueue := func(prefix string, n int) []string {
		t.Helper()
		var keys []string
		for i := range n {
			res, err := enq.Enqueue(ctx, tasks.Spec{Kind: "catalog", SourceID: fmt.Sprintf("%s-%02d", prefix, i),
				Country: "US", Window: "2026-04-23", ParserVersion: 1})
			require.NoError(t, err)
			keys = append(keys, res.Key)
		}
		// Their rows changed two days ago: out of reach of the changed pass.
		_, err := st.Pool().Exec(ctx, `UPDATE jobs SET updated_at = now() - interval '2 days' WHERE key = ANY($1)`, keys)
		require.NoError(t, err)
		return keys
	}

	// A job whose task asynq archived (its retries spent while the job stayed runnable).
	archived := enqueue("arch", 1)[0]
	require.NoError(t, insp.ArchiveTask(queue, archived))
	rep := sweep("first sweep")
	assert.True(t, rep.FullRequeue, "no marker yet: the first sweep checks the queue in full")
	assert.EqualValues(t, 1, rep.Actions[scheduler.ActionArchivedRepair], "%v", rep.Actions)
	require.NoError(t, insp.ArchiveTask(queue, archived))
	assert.False(t, sweep("steady state").FullRequeue)

	snap := srv.Snapshot("before-the-30")
	keys := enqueue("rb", 30)
	rep = sweep("after the 30")
	assert.False(t, rep.FullRequeue)
	assert.Zero(t, rep.Actions[scheduler.ActionRequeued], "every task is there: %v", rep.Actions)

	srv.RestoreSnapshot(snap)
	require.NoError(t, rdb.Ping(ctx).Err())
	for _, k := range keys {
		n, err := rdb.Exists(ctx, scheduler.AsynqTaskKey(queue, k)).Result()
		require.NoError(t, err)
		require.Zero(t, n, "job %s: its task came after the snapshot", k)
	}
	marker, err := rdb.HGet(ctx, scheduler.RequeueMarkerKey(prefix, queue), "epoch").Result()
	require.NoError(t, err, "the snapshot holds the queue's marker")
	require.NotEmpty(t, marker)

	rep = sweep("after the rollback")
	assert.True(t, rep.FullRequeue, "the marker's seq is below PostgreSQL's record: a rollback")
	assert.EqualValues(t, 30, rep.Actions[scheduler.ActionRequeued], "%v", rep.Actions)
	assert.EqualValues(t, 1, rep.Actions[scheduler.ActionArchivedRepair], "the archived task, repaired in the same pass: %v", rep.Actions)
	for _, k := range append(keys, archived) {
		state, err := rdb.HGet(ctx, scheduler.AsynqTaskKey(queue, k), "state").Result()
		require.NoError(t, err, "job %s has a task again", k)
		assert.Equal(t, "pending", state, "job %s", k)
	}
	assert.False(t, sweep("steady state again").FullRequeue)
}

// TestRequeueMarkerConcurrentSweeps: three reconcilers sweeping at once, round after round,
// agree on one epoch per queue after the first (full) check and never take each other's
// seq increments for a rollback; and a queue's marker deleted (its node lost its data) is
// noticed by each of them and checked again in full.
func TestRequeueMarkerConcurrentSweeps(t *testing.T) {
	ctx := context.Background()
	b := setup(t)
	recs := make([]*scheduler.Reconciler, 3)
	for i := range recs {
		recs[i] = b.reconciler(t, recOpts{id: fmt.Sprintf("r%d", i)})
	}
	round := func() []scheduler.SweepReport {
		reps := make([]scheduler.SweepReport, len(recs))
		var wg sync.WaitGroup
		for i, r := range recs {
			wg.Add(1)
			go func() { defer wg.Done(); reps[i] = r.Sweep(ctx) }()
		}
		wg.Wait()
		for _, rep := range reps {
			require.NoError(t, rep.Err)
		}
		return reps
	}
	round() // the first sweeps check in full (no record yet), at once
	key := scheduler.RequeueMarkerKey(b.ns.Prefix, b.ns.Queue)
	for i := range 5 {
		for j, rep := range round() {
			assert.False(t, rep.FullRequeue, "round %d, reconciler %d: a steady-state sweep checked in full", i, j)
		}
	}
	recorded, err := b.st.RequeueMarkers(ctx, b.ns.Prefix)
	require.NoError(t, err)
	epoch, err := b.ns.Client.HGet(ctx, key, "epoch").Result()
	require.NoError(t, err)
	assert.Equal(t, recorded[b.ns.Queue].Epoch, epoch, "the marker holds the epoch PostgreSQL records")
	seq, err := b.ns.Client.HGet(ctx, key, "seq").Int64()
	require.NoError(t, err)
	assert.GreaterOrEqual(t, seq, recorded[b.ns.Queue].Seq)
	assert.GreaterOrEqual(t, recorded[b.ns.Queue].Seq, int64(15), "15 steady-state sweeps, each recorded")

	require.NoError(t, b.ns.Client.Del(ctx, key).Err())
	for j, r := range recs {
		rep := r.Sweep(ctx)
		require.NoError(t, rep.Err)
		assert.Equal(t, j == 0, rep.FullRequeue, "reconciler %d: only the first sweep after the loss checks in full", j)
	}
	_, err = b.ns.Client.HGet(ctx, key, "epoch").Result()
	assert.False(t, errors.Is(err, redis.Nil), "a new marker")
}

// raceReplace is the store of a reconciler whose compare-and-set of a new marker epoch is
// overtaken: before it runs, before() does what another reconciler would have done.
type raceReplace struct {
	*store.PG
	before func()
}

func (s *raceReplace) RequeueMarkerReplace(ctx context.Context, prefix, queue, old, next string) (bool, error) {
	if s.before != nil {
		before := s.before
		s.before = nil
		before()
	}
	return s.PG.RequeueMarkerReplace(ctx, prefix, queue, old, next)
}

// TestRequeueMarkerEpochRace: two reconcilers check a queue in full after its marker was
// lost; the second one's compare-and-set of its new epoch loses to the first's. If the
// marker still holds the loser's epoch (its write landed last), the loser puts the winner's
// epoch there; if it holds the winner's, it is left alone. Either way the marker and
// PostgreSQL agree afterwards and no later sweep checks in full. A malformed marker counts
// as lost, and is replaced.
func TestRequeueMarkerEpochRace(t *testing.T) {
	ctx := context.Background()
	for _, lastWrite := range []string{"Loser", "Winner"} {
		t.Run("LastWriteBy"+lastWrite, func(t *testing.T) {
			b := setup(t)
			key := scheduler.RequeueMarkerKey(b.ns.Prefix, b.ns.Queue)
			winner := b.reconciler(t, recOpts{id: "winner"})
			require.NoError(t, winner.Sweep(ctx).Err)
			require.NoError(t, b.ns.Client.Del(ctx, key).Err()) // the queue's node lost its data

			st := &raceReplace{PG: b.st}
			f, err := scheduler.ParseFile([]byte("kinds:\n  catalog: {queue: "+b.ns.Queue+"}\n"), "", nil)
			require.NoError(t, err)
			loser, err := scheduler.NewReconciler(scheduler.ReconcilerConfig{File: f, Store: st, Redis: b.ns.Client,
				Client: b.client, KeyPrefix: b.ns.Prefix, ID: "loser", Logger: quietLogger()})
			require.NoError(t, err)
			st.before = func() {
				mine, err := b.ns.Client.HGet(ctx, key, "epoch").Result()
				require.NoError(t, err, "the loser wrote its epoch before its check")
				rep := winner.Sweep(ctx)
				require.NoError(t, rep.Err)
				require.True(t, rep.FullRequeue, "the winner sees another epoch than PostgreSQL's: checks in full")
				if lastWrite == "Loser" {
					require.NoError(t, b.ns.Client.HSet(ctx, key, "epoch", mine, "seq", 0).Err())
				}
			}
			rep := loser.Sweep(ctx)
			require.NoError(t, rep.Err)
			require.True(t, rep.FullRequeue)
			require.Nil(t, st.before, "the race ran")

			recorded, err := b.st.RequeueMarkers(ctx, b.ns.Prefix)
			require.NoError(t, err)
			epoch, err := b.ns.Client.HGet(ctx, key, "epoch").Result()
			require.NoError(t, err)
			assert.Equal(t, recorded[b.ns.Queue].Epoch, epoch, "the marker holds the winner's epoch")
			for _, r := range []*scheduler.Reconciler{winner, loser, winner} {
				rep := r.Sweep(ctx)
				require.NoError(t, rep.Err)
				assert.False(t, rep.FullRequeue)
			}
		})
	}

	t.Run("Malformed", func(t *testing.T) {
		b := setup(t)
		key := scheduler.RequeueMarkerKey(b.ns.Prefix, b.ns.Queue)
		r := b.reconciler(t, recOpts{})
		require.NoError(t, r.Sweep(ctx).Err)
		require.NoError(t, b.ns.Client.HSet(ctx, key, "seq", "not-a-count").Err())
		rep := r.Sweep(ctx)
		require.NoError(t, rep.Err)
		assert.True(t, rep.FullRequeue, "a marker that is not ours is no witness")
		rep = r.Sweep(ctx)
		require.NoError(t, rep.Err)
		assert.False(t, rep.FullRequeue, "replaced by a good one")
	})
}
