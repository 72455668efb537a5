package scheduler

import (
	"context"
	"errors"
	"fmt"
	"slices"
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
//   - every runnable job, once, when Redis lost its data: the reconciler keeps a marker key
//     in asynq's Redis, and a sweep that finds it gone checks everything (as every sweep
//     did before), then sets it again.
//
// With 1 k or 1 M pending jobs, a sweep outside a Redis loss reads the same number of rows
// and sends the same number of Redis commands, plus the jobs that changed
// (TestReconcilerSweepBounded).

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

// RequeueMarkerKey is the reconciler's marker in asynq's Redis (STRING, no expiry): gone
// means Redis lost its data since the last full check.
func RequeueMarkerKey(prefix string) string { return prefix + "reconciler:tasks-checked" }

// requeueRunnable is the re-enqueue pass of one sweep.
func (r *Reconciler) requeueRunnable(ctx context.Context, rep *SweepReport) error {
	r.requeueMu.Lock()
	defer r.requeueMu.Unlock()
	now := r.cfg.Now()
	due := now.Add(dueSlack)
	rc := r.cfg.File.Reconciler
	marker := RequeueMarkerKey(r.cfg.KeyPrefix)

	mctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
	err := r.cfg.Redis.Get(mctx, marker).Err()
	cancel()
	rep.RedisTrips++
	rep.RedisCommands++
	switch {
	case errors.Is(err, redis.Nil):
		rep.FullRequeue = true
		if err := r.requeueScan(ctx, rep, due, "", 0); err != nil {
			return err
		}
		mctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
		err := r.cfg.Redis.Set(mctx, marker, now.UTC().Format(time.RFC3339), 0).Err()
		cancel()
		rep.RedisTrips++
		rep.RedisCommands++
		if err != nil {
			return err
		}
		r.requeue = requeueCursor{changed: store.ActivityCursor{At: due}}
		return nil
	case err != nil:
		return err
	}

	// The jobs that changed or came due.
	from := r.requeue.changed
	if !r.requeue.capped {
		from = store.ActivityCursor{At: from.At.Add(-activitySlack)}
	}
	end, err := r.requeuePages(ctx, rep, rc.RequeueChangedPerSweep, func(pctx context.Context, n int) ([]store.Job, error) {
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
	return r.requeueScan(ctx, rep, due, r.requeue.scanKey, rc.RequeueScanPerSweep)
}

// requeueScan checks runnable jobs in key order from after, at most max (0: all), and
// keeps where it stopped ("" when it reached the end).
func (r *Reconciler) requeueScan(ctx context.Context, rep *SweepReport, due time.Time, after string, max int) error {
	end, err := r.requeuePages(ctx, rep, max, func(pctx context.Context, n int) ([]store.Job, error) {
		page, err := r.cfg.Store.JobsListRunnable(pctx, store.JobsListParams{AfterKey: after, Limit: n, DueBefore: due})
		if err == nil && len(page) > 0 {
			after = page[len(page)-1].Key
		}
		return page, err
	})
	if err != nil {
		return err
	}
	if end {
		r.requeue.scanKey = "" // the end: the next scan starts over
	} else {
		r.requeue.scanKey = after
	}
	return nil
}

// requeuePages checks runnable jobs page by page for both passes of requeueRunnable (the
// changed jobs, the key-order scan): next reads the page after the last one (at most n
// jobs, under QueryTimeout; it keeps its own cursor), and requeuePage checks each page's
// tasks. It reads pages of BatchSize until a short page (end) or, with max > 0, until it
// read max jobs (not end). Every read counts as a statement and its rows in rep.
func (r *Reconciler) requeuePages(ctx context.Context, rep *SweepReport, max int,
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
		if len(page) > 0 {
			if err := r.requeuePage(ctx, page, rep); err != nil {
				return false, err
			}
		}
		read += len(page)
		if len(page) < n {
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
		cmds[i] = pipe.HGet(pctx, AsynqTaskKey(r.queueOf(j.Kind, j.Queue), j.Key), "state")
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
