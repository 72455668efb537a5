package scheduler

import (
	"context"
	"errors"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/store"
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
	limit := rc.BatchSize
	read := 0
	capped := false
	for {
		n := min(limit, rc.RequeueChangedPerSweep-read)
		pctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
		page, next, err := r.cfg.Store.JobsListRunnableActive(pctx, from, due, n)
		cancel()
		rep.Statements++
		rep.RowsRead += int64(len(page))
		if err != nil {
			return err
		}
		if len(page) > 0 {
			if err := r.requeuePage(ctx, page, rep); err != nil {
				return err
			}
		}
		read += len(page)
		from = next
		if len(page) < n {
			break
		}
		if read >= rc.RequeueChangedPerSweep {
			capped = true
			break
		}
	}
	if capped {
		r.requeue.changed, r.requeue.capped = from, true
	} else {
		r.requeue.changed, r.requeue.capped = store.ActivityCursor{At: due}, false
	}

	// A slice of the rest, in key order.
	return r.requeueScan(ctx, rep, due, r.requeue.scanKey, rc.RequeueScanPerSweep)
}

// requeueScan checks runnable jobs in key order from after, at most max (0: all), and
// keeps where it stopped ("" when it reached the end).
func (r *Reconciler) requeueScan(ctx context.Context, rep *SweepReport, due time.Time, after string, max int) error {
	limit := r.cfg.File.Reconciler.BatchSize
	read := 0
	for {
		n := limit
		if max > 0 {
			n = min(limit, max-read)
		}
		pctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
		page, err := r.cfg.Store.JobsListRunnable(pctx, store.JobsListParams{AfterKey: after, Limit: n, DueBefore: due})
		cancel()
		rep.Statements++
		rep.RowsRead += int64(len(page))
		if err != nil {
			return err
		}
		if len(page) > 0 {
			if err := r.requeuePage(ctx, page, rep); err != nil {
				return err
			}
		}
		read += len(page)
		if len(page) < n {
			r.requeue.scanKey = "" // the end: the next scan starts over
			return nil
		}
		after = page[len(page)-1].Key
		if max > 0 && read >= max {
			r.requeue.scanKey = after
			return nil
		}
	}
}
