package scheduler

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/internal/retry"
	"github.com/idemscrape/idemscrape/lua"
)

// The reconciler's orphan pass: active asynq tasks whose asynq server died (SIGKILL, a
// crash, a lost host) go back to pending as soon as that is known, instead of when asynq's
// recoverer takes them: it moves a task out of the active set only once its asynq lease
// (30 s, extended by every heartbeat of the live server that holds it) ended 30 s ago, and
// looks once a minute, then retries it after a delay (handlers.LeaseExpiredRetryDelay) —
// 65 to 125 s after the death, during which the job's own lease (shorter) is long free.
//
// It relies on asynq v0.26's heartbeats (heartbeat.go): every 5 s a live server writes
// asynq:servers:{host:pid:sid} (SETEX 10 s), asynq:workers:{host:pid:sid} (a hash of the
// IDs of the tasks it processes, EXPIRE 10 s), their members in the asynq:servers and
// asynq:workers sorted sets (score: its clock + 10 s), and then extends the leases of its
// tasks (asynq:{<queue>}:lease, score: its clock + 30 s). A server's task reaches its
// workers hash at its next heartbeat after the dequeue (the processor hands the task to the
// heartbeater before it runs the handler).
//
// A task is given back only when all of these hold:
//
//  1. No live server lists it: it is in no workers hash of a server whose key exists (the
//     key's TTL runs on Redis's clock). A killed server's key is gone 10 s after its last
//     heartbeat.
//  2. Every live server has beaten since the task's lease was last written (its sorted-set
//     score − 10 s is at least the lease score − 30 s + asynqBeatSlack): a live server that
//     dequeued the task before that heartbeat lists it in the heartbeat's hash (1). Both
//     scores of a server that holds the task are on that server's own clock; clock skew
//     between servers only delays a give-back.
//  3. The reconciler takes the job's own lease (lua.Leases.Take: no worker holds it: a
//     worker running the job renews it) and holds it while it moves the task, so no
//     delivery of the job starts meanwhile; then it releases it.
//  4. asynq_requeue.lua finds the task still active under the lease score read in this
//     pass (a task done, retried, recovered or dequeued again since is left alone) and moves
//     it with asynq's own requeue, atomically.
//
// The job's row is not touched: the next delivery's start takes the dead attempt over
// (store.JobStart: running under a lower fence, written as lost). One task per job stays
// true: the task is moved, never enqueued a second time.

//go:embed asynq_requeue.lua
var asynqRequeueSrc string

var asynqRequeueScript = redis.NewScript(asynqRequeueSrc)

// asynq v0.26's layout and timings (internal/base, internal/rdb, heartbeat.go, server.go).
const (
	asynqAllServers  = "asynq:servers" // ZSET of asynq:servers:{host:pid:sid}, score: expiry
	asynqAllWorkers  = "asynq:workers" // ZSET of asynq:workers:{host:pid:sid}, score: expiry
	asynqServerPfx   = "asynq:servers:"
	asynqWorkersPfx  = "asynq:workers:"
	asynqLeaseLength = 30 * time.Second // rdb.LeaseDuration: each heartbeat extends to now + this
	asynqServerTTL   = 10 * time.Second // 2 × the 5 s heartbeat interval
	// asynqBeatSlack is how long after a task's lease was written a live server's heartbeat
	// must have begun to count as one after the dequeue (the scores are whole seconds).
	asynqBeatSlack = 2 * time.Second
)

// Counter names of the orphan pass (see the Action* constants).
const (
	// ActionOrphanRequeued: an active asynq task of a dead asynq server given back to pending.
	ActionOrphanRequeued = "reconciler_orphan_requeued"
	// ActionOrphanLeaseHeld: the task's server is dead but a worker holds the job's lease:
	// left alone until the lease is free.
	ActionOrphanLeaseHeld = "reconciler_orphan_lease_held"
)

// asynqQueueKey is asynq v0.26's key name of queue (internal/base): active, lease,
// pending.
func asynqQueueKey(queue, name string) string { return "asynq:{" + queue + "}:" + name }

// orphanQueues returns the queues the orphan pass looks at: the configured kinds' and the
// ones recorded with jobs the re-enqueue pass read.
func (r *Reconciler) orphanQueues() []string {
	set := map[string]bool{}
	for kind := range r.cfg.File.Kinds {
		set[r.cfg.File.QueueFor(kind)] = true
	}
	r.queuesMu.Lock()
	for q := range r.recordedQueues {
		set[q] = true
	}
	r.queuesMu.Unlock()
	return slices.Sorted(maps.Keys(set))
}

// noteQueue records a queue a job's task is in, for the orphan pass.
func (r *Reconciler) noteQueue(q string) {
	r.queuesMu.Lock()
	defer r.queuesMu.Unlock()
	if len(r.recordedQueues) < maxRecordedQueues {
		r.recordedQueues[q] = true
	}
}

// maxRecordedQueues bounds the queues noteQueue remembers.
const maxRecordedQueues = 1024

// liveServers is what the orphan pass read of asynq's servers.
type liveServers struct {
	listed map[string]bool // task IDs in the workers hash of a live server
	// oldestBeat is the earliest latest heartbeat of the live servers (their sorted-set
	// score, whole seconds), or ok false when no server is live.
	oldestBeat int64
	ok         bool
}

// RequeueOrphans runs one orphan pass synchronously (the loop of Start runs one every
// reconciler.orphan_interval): the active asynq tasks of the configured queues whose asynq
// server is dead are given back to pending (see the top of reconciler_orphans.go). It
// reports ActionOrphanRequeued and ActionOrphanLeaseHeld, counted like a sweep's actions.
func (r *Reconciler) RequeueOrphans(ctx context.Context) SweepReport {
	rep := SweepReport{Actions: map[string]int64{}}
	begun := time.Now()
	err := r.requeueOrphans(ctx, &rep)
	rep.RescueTime = time.Since(begun)
	if err != nil {
		rep.Err = err
		rep.Actions[ActionSweepErrors]++
		if ctx.Err() == nil {
			r.cfg.Logger.ErrorContext(ctx, "reconciler orphan pass failed", "err", err)
		}
	}
	r.account(ctx, &rep, "reconciler orphan pass", begun)
	return rep
}

func (r *Reconciler) requeueOrphans(ctx context.Context, rep *SweepReport) error {
	queues := r.orphanQueues()
	if len(queues) == 0 {
		return nil
	}
	rctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
	defer cancel()
	// Every queue's lease set, then the servers that may be live.
	pipe := r.cfg.Redis.Pipeline()
	leaseCmds := make([]*redis.ZSliceCmd, len(queues))
	for i, q := range queues {
		leaseCmds[i] = pipe.ZRangeWithScores(rctx, asynqQueueKey(q, "lease"), 0, -1)
	}
	rep.RedisTrips++
	rep.RedisCommands += int64(len(queues))
	if _, err := pipe.Exec(rctx); err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("scheduler: reconciler read asynq's leases: %w", err)
	}
	oldest, active := int64(0), 0
	for _, c := range leaseCmds {
		for _, z := range c.Val() {
			if active == 0 || int64(z.Score) < oldest {
				oldest = int64(z.Score)
			}
			active++
		}
	}
	if active == 0 {
		return nil
	}
	// asynq never removes a dead server from its sorted sets (an Inspector's listing
	// does): those whose last heartbeat is older than every lease by more than a lease and
	// a minute of clock skew are not read (a server that holds a task beat since its lease
	// was written).
	since := strconv.FormatInt(oldest-int64((asynqLeaseLength+time.Minute)/time.Second), 10)
	pipe = r.cfg.Redis.Pipeline()
	srvCmd := pipe.ZRangeByScoreWithScores(rctx, asynqAllServers, &redis.ZRangeBy{Min: since, Max: "+inf"})
	wrkCmd := pipe.ZRangeByScoreWithScores(rctx, asynqAllWorkers, &redis.ZRangeBy{Min: since, Max: "+inf"})
	rep.RedisTrips++
	rep.RedisCommands += 2
	if _, err := pipe.Exec(rctx); err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("scheduler: reconciler read asynq's servers: %w", err)
	}
	live, err := r.readLiveServers(rctx, rep, srvCmd.Val(), wrkCmd.Val())
	if err != nil {
		return err
	}
	slack := int64((asynqLeaseLength - asynqServerTTL - asynqBeatSlack) / time.Second)
	var firstErr error
	for i, q := range queues {
		for _, z := range leaseCmds[i].Val() {
			id, ok := z.Member.(string)
			if !ok || live.listed[id] {
				continue
			}
			score := int64(z.Score)
			// A live server whose latest heartbeat began before the lease was written may
			// hold the task without listing it yet.
			if live.ok && live.oldestBeat < score-slack {
				continue
			}
			if err := r.requeueOrphan(ctx, rep, q, id, score); err != nil && firstErr == nil {
				firstErr = err
			}
		}
	}
	return firstErr
}

// readLiveServers reads which servers of the sorted sets are live (their server key
// exists) and the task IDs their workers hashes list, in one round trip.
func (r *Reconciler) readLiveServers(ctx context.Context, rep *SweepReport, servers, workers []redis.Z) (liveServers, error) {
	// A server by its "{host:pid:sid}", with its latest score in either sorted set.
	beats := map[string]int64{}
	add := func(zs []redis.Z, prefix string) {
		for _, z := range zs {
			m, _ := z.Member.(string)
			id, ok := strings.CutPrefix(m, prefix)
			if !ok || id == "" {
				continue
			}
			beats[id] = max(beats[id], int64(z.Score))
		}
	}
	add(servers, asynqServerPfx)
	add(workers, asynqWorkersPfx)
	ids := slices.Sorted(maps.Keys(beats))
	pipe := r.cfg.Redis.Pipeline()
	exists := make([]*redis.IntCmd, len(ids))
	hkeys := make([]*redis.StringSliceCmd, len(ids))
	for i, id := range ids {
		exists[i] = pipe.Exists(ctx, asynqServerPfx+id)
		hkeys[i] = pipe.HKeys(ctx, asynqWorkersPfx+id)
	}
	rep.RedisTrips++
	rep.RedisCommands += int64(2 * len(ids))
	if len(ids) > 0 {
		if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
			return liveServers{}, fmt.Errorf("scheduler: reconciler read asynq's live servers: %w", err)
		}
	}
	live := liveServers{listed: map[string]bool{}}
	for i, id := range ids {
		// A workers hash expires a moment after its server's key: its IDs count even when
		// the key is gone.
		for _, task := range hkeys[i].Val() {
			live.listed[task] = true
		}
		if exists[i].Val() == 0 {
			continue
		}
		if !live.ok || beats[id] < live.oldestBeat {
			live.oldestBeat = beats[id]
		}
		live.ok = true
	}
	return live, nil
}

// requeueOrphan gives task id of queue, active under lease score, back to pending while
// holding the job's lease (the task ID is the job key).
func (r *Reconciler) requeueOrphan(ctx context.Context, rep *SweepReport, queue, id string, score int64) error {
	rctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
	defer cancel()
	owner := "reconciler/" + r.cfg.ID + "/" + retry.Nonce(4)
	lease, err := r.leases.Take(rctx, id, owner, r.cfg.RescueLease)
	rep.RedisTrips++
	rep.RedisCommands++
	switch {
	case errors.Is(err, lua.ErrLeaseHeld):
		rep.Actions[ActionOrphanLeaseHeld]++
		return nil
	case err != nil:
		return fmt.Errorf("scheduler: reconciler take the lease of orphaned task %q: %w", id, err)
	}
	defer func() {
		dctx, dcancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.QueryTimeout)
		defer dcancel()
		if rerr := r.leases.Release(dctx, lease); rerr != nil && !errors.Is(rerr, lua.ErrLeaseLost) {
			r.cfg.Logger.WarnContext(ctx, "reconciler lease release failed", "job", id, "err", rerr)
		}
		rep.RedisTrips++
		rep.RedisCommands++
	}()
	n, err := asynqRequeueScript.Run(rctx, r.cfg.Redis,
		[]string{asynqQueueKey(queue, "active"), asynqQueueKey(queue, "lease"), asynqQueueKey(queue, "pending"), AsynqTaskKey(queue, id)},
		id, strconv.FormatInt(score, 10)).Int64()
	rep.RedisTrips++
	rep.RedisCommands++
	if err != nil {
		return fmt.Errorf("scheduler: reconciler give orphaned task %q back to queue %q: %w", id, queue, err)
	}
	if n == 1 {
		rep.Actions[ActionOrphanRequeued]++
		r.cfg.Logger.InfoContext(ctx, "active task of a dead asynq server given back to pending", "job", id, "queue", queue,
			"asynq_lease_end", time.Unix(score, 0).UTC())
	}
	return nil
}

// account counts rep's actions in the metrics and in store.CountersAdd and logs them as
// what, when there are any.
func (r *Reconciler) account(ctx context.Context, rep *SweepReport, what string, begun time.Time) {
	for a, n := range rep.Actions {
		r.metrics.actions.WithLabelValues(strings.TrimPrefix(a, "reconciler_")).Add(float64(n))
	}
	counts := nonZero(rep.Actions)
	if len(counts) == 0 {
		return
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.QueryTimeout)
	if cerr := r.cfg.Store.CountersAdd(cctx, counts); cerr != nil {
		r.cfg.Logger.WarnContext(ctx, "reconciler counters not recorded", "err", cerr)
	}
	cancel()
	rep.Statements++
	r.cfg.Logger.InfoContext(ctx, what, "actions", counts, "statements", rep.Statements,
		"redis_round_trips", rep.RedisTrips, "seconds", time.Since(begun).Seconds())
}
