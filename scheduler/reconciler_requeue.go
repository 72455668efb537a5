package scheduler

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
)

// The re-enqueue pass finds runnable (pending, retryable) jobs whose asynq task is missing
// or archived and enqueues them again. Its cost follows change, not backlog: a job's task
// goes missing when the job changes (a rescue, a failed attempt, a requeue), when Redis
// loses its data, or when someone deletes it by hand. So each sweep checks
//
//   - the jobs that changed or came due since the last sweep (their activity time,
//     GREATEST(updated_at, next_attempt_at), through the index of migration 00011), at most
//     RequeueChangedPerSweep; a sweep that reaches the cap leaves the rest to the next one,
//     from where it stopped;
//   - RequeueScanPerSweep other jobs, in key order, resuming where the last sweep stopped
//     (a full circle every backlog ÷ RequeueScanPerSweep sweeps): what a hand-deleted task
//     needs;
//   - every runnable job of a queue, once, when the queue's Redis lost or rolled back its
//     data (see the markers below), before the two others.
//
// With 1 k or 1 M pending jobs, a sweep outside a Redis loss reads the same number of rows
// and sends the same number of Redis commands, plus the jobs that changed
// (TestReconcilerSweepBounded).
//
// The markers. Each queue has one, RequeueMarkerKey: a HASH {epoch, seq} in the queue's own
// slot, so on a Redis Cluster it lives on the master that holds the queue's tasks and is
// lost, or rolled back, with them (a marker elsewhere would survive the loss and hide it:
// issue 36). PostgreSQL records, per queue, the epoch the marker must hold and the highest
// seq a sweep saw (store.PG.RequeueMarkers, table reconciler_markers), as the outbox records
// its streams' epochs and entries added (store/outbox/epoch.go). A sweep reads PostgreSQL,
// then the markers; a queue whose marker is absent, holds another epoch, or a seq below
// PostgreSQL's (Redis came back from an older copy: a restored RDB, a replica that lagged)
// is lost. Its new epoch is written to the marker first, then every runnable job of the
// queue is checked, then the epoch is recorded in PostgreSQL with a compare-and-set on the
// epoch read (of several reconcilers that checked it at once one wins; the others put the
// winner's epoch in the marker if the marker still holds theirs). A loss during the check
// takes the new marker with it, and the next sweep checks again. Every other sweep ends by
// incrementing each intact marker's seq (HINCRBY, after the sweep's enqueues) and
// recording the result (GREATEST), so a copy of Redis taken before that sweep is told from
// the live one. What the window between the last increment and a loss can hide is in the
// changed pass: a job that changed since is checked by the next sweep anyway. Reading
// PostgreSQL before Redis keeps concurrent sweeps from taking each other's increments for
// a rollback: a recorded seq was in Redis before it was recorded.
//
// The queues checked are those the configuration names (File.QueueFor of each kind), those
// PostgreSQL holds a marker of under KeyPrefix, and those of the jobs a sweep read (a job
// with a recorded queue); a queue first seen by a sweep is checked in full by the next one.

const (
	// requeueLookback is how far back a reconciler that starts looks for changed jobs
	// (one that was down longer leaves the rest to the key-order scan, or to the full
	// check after a Redis loss).
	requeueLookback = time.Hour
	// activitySlack re-reads the last minute of activity at every sweep: a row changed by a
	// transaction that took its now() before the last sweep's read but committed after it.
	activitySlack = time.Minute
)

// requeueCursor is where the re-enqueue pass goes on at the next sweep.
type requeueCursor struct {
	changed store.ActivityCursor // the activity reached
	capped  bool                 // the last changed pass stopped at its cap: go on exactly from changed
	scanKey string               // the key-order scan's last key ("" to start over)
}

// RequeueMarkerKey is the reconciler's "tasks checked" marker of queue in asynq's Redis: a
// HASH with fields epoch and seq, no expiry. Its hash tag is {<queue>}, as in asynq's keys
// asynq:{<queue>}:… (asynq v0.26 internal/base.QueueKeyPrefix), so it shares the slot of
// the queue's tasks (prefix holds no brace: lua.NewKeys refuses one). Absent, of another
// epoch than PostgreSQL's record, or with a lower seq: the queue's Redis lost or rolled back
// its data since the last full check.
func RequeueMarkerKey(prefix, queue string) string {
	return prefix + "reconciler:{" + queue + "}:tasks-checked"
}

// markerState is what a sweep read of one queue's marker.
type markerState struct {
	epoch string // "" when absent
	seq   int64
}

// newMarkerEpoch is a fresh epoch: random, with the time it began for the operator.
func newMarkerEpoch(now time.Time) string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:]) + "@" + now.UTC().Format(time.RFC3339)
}

// requeueRunnable is the re-enqueue pass of one sweep.
func (r *Reconciler) requeueRunnable(ctx context.Context, rep *SweepReport) error {
	r.requeueMu.Lock()
	defer r.requeueMu.Unlock()
	now := r.cfg.Now()
	due := now.Add(dueSlack)
	rc := r.cfg.File.Reconciler

	intact, lost, err := r.readMarkers(ctx, rep)
	if err != nil {
		return err
	}
	// The queues whose jobs this sweep checks in full: the two other passes skip them.
	var full map[string]bool
	if len(lost) > 0 {
		rep.FullRequeue = true
		if err := r.requeueLost(ctx, rep, due, lost); err != nil {
			return err
		}
		full = make(map[string]bool, len(lost))
		for q := range lost {
			full[q] = true
		}
	}

	// The jobs that changed or came due.
	from := r.requeue.changed
	if !r.requeue.capped {
		from = store.ActivityCursor{At: from.At.Add(-activitySlack)}
	}
	end, err := r.requeuePages(ctx, rep, rc.RequeueChangedPerSweep, skipping(full), func(pctx context.Context, n int) ([]store.Job, error) {
		page, next, err := r.cfg.Store.JobsListRunnableActive(pctx, from, due, n)
		if err == nil {
			from = next
		}
		return page, err
	})
	if err != nil {
		return err
	}
	if end {
		r.requeue.changed, r.requeue.capped = store.ActivityCursor{At: due}, false
	} else {
		r.requeue.changed, r.requeue.capped = from, true
	}

	// A slice of the rest, in key order.
	scanKey, err := r.requeueScan(ctx, rep, due, r.requeue.scanKey, rc.RequeueScanPerSweep, full)
	if err != nil {
		return err // the next scan goes on from the same key
	}
	r.requeue.scanKey = scanKey
	return r.advanceMarkers(ctx, rep, intact)
}

// markerQueues returns the queues whose markers a sweep reads, sorted: the configuration's,
// those of recorded, and those the sweeps saw.
func (r *Reconciler) markerQueues(recorded map[string]store.RequeueMarker) []string {
	set := map[string]bool{}
	for kind := range r.cfg.File.Kinds {
		set[r.cfg.File.QueueFor(kind)] = true
	}
	for q := range recorded {
		set[q] = true
	}
	for q := range r.seenQueues {
		set[q] = true
	}
	return slices.Sorted(maps.Keys(set))
}

// readMarkers reads PostgreSQL's record of the markers (one statement), then the markers
// (one pipelined round trip), and sorts the queues into intact (by marker, as read) and
// lost (by the epoch PostgreSQL holds, "" for none).
func (r *Reconciler) readMarkers(ctx context.Context, rep *SweepReport) (intact map[string]markerState, lost map[string]string, err error) {
	qctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
	recorded, err := r.cfg.Store.RequeueMarkers(qctx, r.cfg.KeyPrefix)
	cancel()
	rep.Statements++
	if err != nil {
		return nil, nil, fmt.Errorf("scheduler: reconciler read the queues' marker records: %w", err)
	}
	queues := r.markerQueues(recorded)
	if len(queues) == 0 {
		return nil, nil, nil
	}
	rctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
	defer cancel()
	pipe := r.cfg.Redis.Pipeline()
	cmds := make([]*redis.SliceCmd, len(queues))
	for i, q := range queues {
		cmds[i] = pipe.HMGet(rctx, RequeueMarkerKey(r.cfg.KeyPrefix, q), "epoch", "seq")
	}
	rep.RedisTrips++
	rep.RedisCommands += int64(len(queues))
	if _, err := pipe.Exec(rctx); err != nil {
		return nil, nil, fmt.Errorf("scheduler: reconciler read the queues' tasks-checked markers: %w", err)
	}
	intact, lost = map[string]markerState{}, map[string]string{}
	for i, q := range queues {
		m, err := parseMarker(cmds[i].Val())
		if err != nil {
			// A marker that is not ours (written by hand?) is no witness: a loss.
			r.cfg.Logger.WarnContext(ctx, "reconciler: a queue's tasks-checked marker is malformed: checking the queue in full",
				"queue", q, "marker", RequeueMarkerKey(r.cfg.KeyPrefix, q), "err", err)
		}
		rec, ok := recorded[q]
		if err == nil && ok && m.epoch == rec.Epoch && m.seq >= rec.Seq {
			intact[q] = m
			continue
		}
		lost[q] = rec.Epoch
		if ok {
			why := "absent"
			switch {
			case m.epoch == rec.Epoch:
				why = "seq below the one recorded: Redis came back with an older copy"
			case m.epoch != "":
				why = "another epoch than the one recorded"
			}
			r.cfg.Logger.WarnContext(ctx, "reconciler: Redis lost the queue's data (its tasks-checked marker is "+why+"): checking every runnable job of the queue",
				"queue", q, "marker", RequeueMarkerKey(r.cfg.KeyPrefix, q), "epoch_expected", rec.Epoch, "seq_expected", rec.Seq,
				"epoch_found", m.epoch, "seq_found", m.seq)
		}
	}
	return intact, lost, nil
}

// parseMarker reads HMGET marker epoch seq.
func parseMarker(v []any) (markerState, error) {
	if len(v) != 2 {
		return markerState{}, fmt.Errorf("HMGET replied %d values, want 2", len(v))
	}
	var m markerState
	if v[0] != nil {
		s, ok := v[0].(string)
		if !ok {
			return markerState{}, fmt.Errorf("epoch %v is not a string", v[0])
		}
		m.epoch = s
	}
	if v[1] != nil {
		s, ok := v[1].(string)
		if !ok {
			return markerState{}, fmt.Errorf("seq %v is not a string", v[1])
		}
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil || n < 0 {
			return markerState{}, fmt.Errorf("seq %q is not a count", s)
		}
		m.seq = n
	}
	return m, nil
}

// requeueLost checks every runnable job of the lost queues (queue → PostgreSQL's epoch, ""
// for none): new epochs in the markers first, then the check, then the epochs recorded.
func (r *Reconciler) requeueLost(ctx context.Context, rep *SweepReport, due time.Time, lost map[string]string) error {
	queues := slices.Sorted(maps.Keys(lost))
	epochs := make(map[string]string, len(queues))
	now := r.cfg.Now()
	rctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
	pipe := r.cfg.Redis.Pipeline()
	for _, q := range queues {
		epochs[q] = newMarkerEpoch(now)
		pipe.HSet(rctx, RequeueMarkerKey(r.cfg.KeyPrefix, q), "epoch", epochs[q], "seq", 0)
	}
	_, err := pipe.Exec(rctx)
	cancel()
	rep.RedisTrips++
	rep.RedisCommands += int64(len(queues))
	if err != nil {
		return fmt.Errorf("scheduler: reconciler write new tasks-checked markers: %w", err)
	}

	only := make(map[string]bool, len(queues))
	for _, q := range queues {
		only[q] = true
	}
	if err := r.requeueScanOnly(ctx, rep, due, only); err != nil {
		return err
	}

	for _, q := range queues {
		qctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
		won, err := r.cfg.Store.RequeueMarkerReplace(qctx, r.cfg.KeyPrefix, q, lost[q], epochs[q])
		cancel()
		rep.Statements++
		if err != nil {
			return fmt.Errorf("scheduler: reconciler record queue %q's new marker epoch: %w", q, err)
		}
		if !won {
			if err := r.adoptMarker(ctx, rep, q, epochs[q]); err != nil {
				return err
			}
		}
	}
	return nil
}

// adoptMarker is the end of a full check whose epoch lost the compare-and-set to another
// reconciler's: if the marker still holds mine (no loss since it was written, before my
// check), it takes the epoch PostgreSQL holds, so that the next sweeps find it intact. A
// marker that moved on is left alone (the other reconciler wrote it after its own check, or
// Redis lost it again: the next sweep checks again).
func (r *Reconciler) adoptMarker(ctx context.Context, rep *SweepReport, queue, mine string) error {
	qctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
	recorded, err := r.cfg.Store.RequeueMarkers(qctx, r.cfg.KeyPrefix)
	cancel()
	rep.Statements++
	if err != nil {
		return fmt.Errorf("scheduler: reconciler read queue %q's marker record: %w", queue, err)
	}
	winner, ok := recorded[queue]
	if !ok {
		return nil // deleted by hand: the next sweep starts over
	}
	key := RequeueMarkerKey(r.cfg.KeyPrefix, queue)
	rctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
	defer cancel()
	rep.RedisTrips += 2
	rep.RedisCommands += 2
	err = r.cfg.Redis.Watch(rctx, func(tx *redis.Tx) error {
		cur, err := tx.HGet(rctx, key, "epoch").Result()
		if errors.Is(err, redis.Nil) || (err == nil && cur != mine) {
			return nil
		}
		if err != nil {
			return err
		}
		_, err = tx.TxPipelined(rctx, func(p redis.Pipeliner) error {
			p.HSet(rctx, key, "epoch", winner.Epoch, "seq", winner.Seq)
			return nil
		})
		return err
	}, key)
	if err != nil && !errors.Is(err, redis.TxFailedErr) {
		return fmt.Errorf("scheduler: reconciler adopt queue %q's marker epoch: %w", queue, err)
	}
	return nil
}

// advanceMarkers ends a sweep: each intact marker's seq is incremented (after the sweep's
// enqueues) and the values reached are recorded in PostgreSQL, so that a copy of Redis
// from before this sweep has a seq below the record.
func (r *Reconciler) advanceMarkers(ctx context.Context, rep *SweepReport, intact map[string]markerState) error {
	if len(intact) == 0 {
		return nil
	}
	queues := slices.Sorted(maps.Keys(intact))
	rctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
	pipe := r.cfg.Redis.Pipeline()
	cmds := make([]*redis.IntCmd, len(queues))
	for i, q := range queues {
		// A marker lost since it was read comes back as {seq: 1} without an epoch: the next
		// sweep reads it as lost.
		cmds[i] = pipe.HIncrBy(rctx, RequeueMarkerKey(r.cfg.KeyPrefix, q), "seq", 1)
	}
	_, err := pipe.Exec(rctx)
	cancel()
	rep.RedisTrips++
	rep.RedisCommands += int64(len(queues))
	if err != nil {
		return fmt.Errorf("scheduler: reconciler advance the tasks-checked markers: %w", err)
	}
	seen := make(map[string]store.RequeueMarker, len(queues))
	for i, q := range queues {
		seen[q] = store.RequeueMarker{Epoch: intact[q].epoch, Seq: cmds[i].Val()}
	}
	qctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
	err = r.cfg.Store.RequeueMarkersAdvance(qctx, r.cfg.KeyPrefix, seen)
	cancel()
	rep.Statements++
	if err != nil {
		return fmt.Errorf("scheduler: reconciler record the tasks-checked markers: %w", err)
	}
	return nil
}

// requeueScan checks runnable jobs in key order from after, at most max (0: all), skipping
// the jobs of the queues in skip, and returns where it stopped ("" when it reached the end).
func (r *Reconciler) requeueScan(ctx context.Context, rep *SweepReport, due time.Time, after string, max int, skip map[string]bool) (string, error) {
	end, err := r.requeuePages(ctx, rep, max, skipping(skip), func(pctx context.Context, n int) ([]store.Job, error) {
		page, err := r.cfg.Store.JobsListRunnable(pctx, store.JobsListParams{AfterKey: after, Limit: n, DueBefore: due})
		if err == nil && len(page) > 0 {
			after = page[len(page)-1].Key
		}
		return page, err
	})
	if err != nil || end {
		return "", err // the end: the next scan starts over
	}
	return after, nil
}

// requeueScanOnly checks every runnable job of the queues in only, in key order (it reads
// every runnable row: jobs carry their queue, not an index on it).
func (r *Reconciler) requeueScanOnly(ctx context.Context, rep *SweepReport, due time.Time, only map[string]bool) error {
	after := ""
	_, err := r.requeuePages(ctx, rep, 0, func(q string) bool { return only[q] },
		func(pctx context.Context, n int) ([]store.Job, error) {
			page, err := r.cfg.Store.JobsListRunnable(pctx, store.JobsListParams{AfterKey: after, Limit: n, DueBefore: due})
			if err == nil && len(page) > 0 {
				after = page[len(page)-1].Key
			}
			return page, err
		})
	return err
}

// skipping returns the filter of requeuePages that keeps the jobs of queues not in skip
// (nil: all).
func skipping(skip map[string]bool) func(queue string) bool {
	if len(skip) == 0 {
		return nil
	}
	return func(q string) bool { return !skip[q] }
}

// requeuePages checks runnable jobs page by page for the passes of requeueRunnable (the
// lost queues, the changed jobs, the key-order scan): next reads the page after the last
// one (at most n jobs, under QueryTimeout; it keeps its own cursor), and requeuePage checks
// the tasks of the page's jobs whose queue keep accepts (nil: all). It reads pages of
// BatchSize until a short page (end) or, with max > 0, until it read max jobs (not end).
// Every read counts as a statement and its rows in rep.
func (r *Reconciler) requeuePages(ctx context.Context, rep *SweepReport, max int, keep func(queue string) bool,
	next func(ctx context.Context, n int) ([]store.Job, error)) (end bool, err error) {
	limit := r.cfg.File.Reconciler.BatchSize
	read := 0
	for {
		n := limit
		if max > 0 {
			n = min(limit, max-read)
		}
		pctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
		page, err := next(pctx, n)
		cancel()
		rep.Statements++
		rep.RowsRead += int64(len(page))
		if err != nil {
			return false, err
		}
		read += len(page)
		short := len(page) < n
		if keep != nil {
			page = slices.DeleteFunc(page, func(j store.Job) bool { return !keep(r.queueOf(j.Kind, j.Queue)) })
		}
		if len(page) > 0 {
			if err := r.requeuePage(ctx, page, rep); err != nil {
				return false, err
			}
		}
		if short {
			return true, nil
		}
		if max > 0 && read >= max {
			return false, nil
		}
	}
}

// forEach calls f(0..n-1) with at most limit calls at once and returns when all are done.
func forEach(limit, n int, f func(i int)) {
	sem := make(chan struct{}, limit)
	var wg sync.WaitGroup
	for i := range n {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			f(i)
		}()
	}
	wg.Wait()
}

// queueOf is the queue of a job's tasks: the one recorded with the job (an enqueuer sent
// it to a queue other than its kind's), else its kind's in the configuration. Checking or
// enqueuing in another would give the job a second task.
func (r *Reconciler) queueOf(kind, recorded string) string {
	if recorded != "" {
		return recorded
	}
	return r.cfg.File.QueueFor(kind)
}

// requeuePage checks the asynq task of every job of the page in one pipelined round trip
// and enqueues again those whose task is missing or archived, by queue (enqueueSpecs:
// EnqueueMany on chunks, Concurrency at once).
func (r *Reconciler) requeuePage(ctx context.Context, page []store.Job, rep *SweepReport) error {
	pctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
	defer cancel()
	pipe := r.cfg.Redis.Pipeline()
	cmds := make([]*redis.StringCmd, len(page))
	for i, j := range page {
		q := r.queueOf(j.Kind, j.Queue)
		cmds[i] = pipe.HGet(pctx, AsynqTaskKey(q, j.Key), "state")
		r.seenQueues[q] = true // under requeueMu: its marker is read from the next sweep on
		r.noteQueue(q)
	}
	rep.RedisTrips++
	rep.RedisCommands += int64(len(page))
	if _, err := pipe.Exec(pctx); err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("scheduler: reconciler read task states: %w", err)
	}
	byQueue := map[string][]tasks.Spec{}
	for i, j := range page {
		state, err := cmds[i].Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			return fmt.Errorf("scheduler: reconciler read task state: %w", err)
		}
		if state != "" && state != asynqArchived {
			continue
		}
		spec, ok := r.specOf(ctx, j.Key, tasks.Spec{Kind: j.Kind, URL: j.URL, SourceID: j.SourceID, Country: j.Country,
			Window: j.Window, ParserVersion: j.ParserVersion, Scope: j.Scope}, rep)
		if !ok {
			continue
		}
		q := r.queueOf(j.Kind, j.Queue)
		byQueue[q] = append(byQueue[q], spec)
	}
	var mu sync.Mutex
	return r.enqueueSpecs(ctx, byQueue, rep, &mu)
}

// specOf returns spec when it still derives key with the enqueuers' normaliser. A spec that
// derives another key (the normaliser's configuration changed since the job was enqueued)
// is not enqueued: that would record a second job under the new key and leave this one
// pending for ever. It is counted (ActionKeyMismatch) and logged for review.
func (r *Reconciler) specOf(ctx context.Context, key string, spec tasks.Spec, rep *SweepReport) (tasks.Spec, bool) {
	derived, err := r.cfg.Normalizer.Key(spec)
	if err == nil && derived == key {
		return spec, true
	}
	rep.Actions[ActionKeyMismatch]++
	r.cfg.Logger.WarnContext(ctx, "job's recorded spec no longer derives its key: not enqueued (normaliser changed?)",
		"job", key, "derived", derived, "err", err)
	return tasks.Spec{}, false
}

// enqueueSpecs enqueues the specs, by queue, with EnqueueMany on chunks of at least
// minRequeueChunk specs, Concurrency chunks at once (EnqueueMany enqueues one task after
// another, so a batch costs about one chunk's round trips), and counts the outcomes in
// rep under mu.
func (r *Reconciler) enqueueSpecs(ctx context.Context, byQueue map[string][]tasks.Spec, rep *SweepReport, mu *sync.Mutex) error {
	queues := slices.Sorted(func(yield func(string) bool) {
		for q := range byQueue {
			if !yield(q) {
				return
			}
		}
	})
	type chunk struct {
		enq   *tasks.Enqueuer
		specs []tasks.Spec
	}
	var chunks []chunk
	for _, q := range queues {
		enq, err := r.enq.get(q)
		if err != nil {
			return err
		}
		specs := byQueue[q]
		size := max(minRequeueChunk, (len(specs)+r.cfg.Concurrency-1)/r.cfg.Concurrency)
		for len(specs) > 0 {
			n := min(size, len(specs))
			chunks = append(chunks, chunk{enq, specs[:n]})
			specs = specs[n:]
		}
	}
	var firstErr error // guarded by mu
	forEach(r.cfg.Concurrency, len(chunks), func(i int) {
		c := chunks[i]
		cctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
		defer cancel()
		res, err := c.enq.EnqueueMany(cctx, c.specs)
		mu.Lock()
		defer mu.Unlock()
		rep.Statements++
		rep.RedisTrips += int64(len(c.specs))
		rep.RedisCommands += int64(len(c.specs))
		if err != nil {
			if firstErr == nil {
				firstErr = fmt.Errorf("scheduler: reconciler re-enqueue: %w", err)
			}
			return
		}
		for _, x := range res {
			switch x.Outcome {
			case tasks.Created, tasks.Requeued:
				rep.Actions[ActionRequeued]++
			case tasks.Repaired:
				rep.Actions[ActionArchivedRepair]++
			default:
				rep.Actions[ActionAlreadyQueued]++
			}
		}
	})
	mu.Lock()
	defer mu.Unlock()
	return firstErr
}
