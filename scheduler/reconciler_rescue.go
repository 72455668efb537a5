package scheduler

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/idemscrape/idemscrape/internal/retry"
	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
)

// The reconciler's rescue: running jobs whose attempt outlived the longest lease and
// whose lease is gone (the worker died) are moved back to retryable under a new fence and
// enqueued again.

// minMaxLease is the shortest longest-lease of any kind: the page filter; each job is then
// held to its own kind's lease.
func (r *Reconciler) minMaxLease() time.Duration {
	d := r.cfg.File.MaxLeaseFor("")
	for kind := range r.cfg.File.Kinds {
		d = min(d, r.cfg.File.MaxLeaseFor(kind))
	}
	return d
}

// rescueRunning is the rescue of one sweep: it lists running jobs whose attempt started
// before the shortest longest-lease, in key-ordered pages of BatchSize, keeps those older
// than their own kind's lease and rescues them (rescuePage) in batches of at most
// store.MaxRescueBatch, rescuePagesInFlight at once. It returns the first error, once the
// batches in flight have ended.
func (r *Reconciler) rescueRunning(ctx context.Context, rep *SweepReport) error {
	now := r.cfg.Now()
	limit := r.cfg.File.Reconciler.BatchSize
	after := ""
	// rescuePagesInFlight pages are rescued at once, so one page's statement overlaps
	// another's Redis round trips. Pages hold disjoint keys and each statement locks its
	// rows in key order: they can not deadlock with each other.
	var (
		mu       sync.Mutex // guards rep and firstErr across the pages
		firstErr error
		wg       sync.WaitGroup
	)
	inflight := make(chan struct{}, rescuePagesInFlight)
	failed := func() error {
		mu.Lock()
		defer mu.Unlock()
		return firstErr
	}
	defer wg.Wait()
	for {
		pctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
		page, err := r.cfg.Store.JobsListRunning(pctx, store.JobsListParams{
			AfterKey: after, Limit: limit, StartedBefore: now.Add(-r.minMaxLease()),
		})
		cancel()
		mu.Lock()
		rep.Statements++
		rep.RowsRead += int64(len(page))
		mu.Unlock()
		if err != nil {
			wg.Wait()
			return err
		}
		var stranded []store.RunningJob
		for _, job := range page {
			if !job.AttemptStartedAt.After(now.Add(-r.cfg.File.MaxLeaseFor(job.Kind))) {
				stranded = append(stranded, job)
			}
		}
		for len(stranded) > 0 {
			n := min(len(stranded), store.MaxRescueBatch)
			jobs := stranded[:n]
			stranded = stranded[n:]
			inflight <- struct{}{}
			if err := failed(); err != nil {
				<-inflight
				wg.Wait()
				return err
			}
			wg.Add(1)
			go func() {
				defer func() { <-inflight; wg.Done() }()
				if err := r.rescuePage(ctx, jobs, rep, &mu); err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					mu.Unlock()
				}
			}()
		}
		if len(page) < limit {
			wg.Wait()
			return failed()
		}
		after = page[len(page)-1].Key
	}
}

// rescuePage moves the stranded running jobs of one page back to retryable: it claims
// their leases in one pipelined round trip (claimStranded; a job whose lease a worker
// holds is left alone), rescues every claimed job in one fenced store.JobsRescue
// statement, then releases the leases in one more round trip (releaseClaimed), whatever
// the statement did: they only guarded the transition. Last it enqueues the rescued jobs.
// A claim error stops the sweep after the claimed jobs are rescued and released.
func (r *Reconciler) rescuePage(ctx context.Context, jobs []store.RunningJob, rep *SweepReport, mu *sync.Mutex) error {
	pctx, cancel := context.WithTimeout(ctx, r.cfg.QueryTimeout)
	defer cancel()
	held, claimErr := r.claimStranded(pctx, jobs, rep, mu)
	if len(held) == 0 {
		return claimErr
	}
	params := make([]store.JobRescueParams, len(held))
	for i, c := range held {
		params[i] = store.JobRescueParams{Key: c.job.Key, ExpectFence: c.job.Fence, Token: c.lease.Token,
			Error: fmt.Sprintf("lease expired (attempt %d by %s); rescued by %s", c.job.AttemptNo, c.job.Worker, c.lease.Owner)}
	}
	errs, err := r.cfg.Store.JobsRescue(pctx, params)
	mu.Lock()
	rep.Statements++
	mu.Unlock()

	r.releaseClaimed(ctx, held)
	mu.Lock()
	rep.RedisTrips++
	if err != nil {
		mu.Unlock()
		return fmt.Errorf("scheduler: reconciler rescue of %d jobs: %w", len(held), err)
	}
	var firstErr error
	byQueue := map[string][]tasks.Spec{}
	for i, c := range held {
		var te *store.TransitionError
		switch {
		case errs[i] == nil:
			rep.Actions[ActionRescued]++
			r.cfg.Logger.InfoContext(ctx, "stranded job rescued", "job", c.job.Key, "kind", c.job.Kind,
				"attempt", c.job.AttemptNo, "worker", c.job.Worker, "fence", c.job.Fence, "token", c.lease.Token)
			if spec, ok := r.specOf(ctx, c.job.Key, c.job.Spec(), rep); ok {
				q := r.queueOf(c.job.Kind, c.job.Queue)
				byQueue[q] = append(byQueue[q], spec)
			}
		case errors.As(errs[i], &te):
			rep.Actions[ActionRescueRefused]++
		case firstErr == nil:
			firstErr = fmt.Errorf("scheduler: reconciler rescue %q: %w", c.job.Key, errs[i])
		}
	}
	mu.Unlock()
	// The rescued jobs are due now: enqueue them here rather than wait for the re-enqueue
	// pass (which may have passed their keys already; if it meets them too, TaskID = key
	// makes the second enqueue a no-op). A failure leaves them retryable without a task:
	// the next sweep's re-enqueue pass finds them.
	if err := r.enqueueSpecs(ctx, byQueue, rep, mu); err != nil && firstErr == nil {
		firstErr = err
	}
	if claimErr != nil {
		return claimErr
	}
	return firstErr
}

// claimStranded claims the leases of jobs in one pipelined round trip
// (lua.Leases.ClaimMany), each above its job's fence, and returns the jobs it holds. A
// job whose lease a worker holds is counted (ActionLeaseHeld) and left alone; the first
// other claim error is returned with the jobs claimed before and after it. It counts in
// rep under mu.
func (r *Reconciler) claimStranded(ctx context.Context, jobs []store.RunningJob, rep *SweepReport, mu *sync.Mutex) ([]claimed, error) {
	reqs := make([]lua.ClaimRequest, len(jobs))
	for i, job := range jobs {
		// A nonce per claim: two reconcilers configured with the same ID must not
		// re-claim each other's lease as its owner.
		reqs[i] = lua.ClaimRequest{Key: job.Key, Owner: "reconciler/" + r.cfg.ID + "/" + retry.Nonce(4),
			TTL: r.cfg.RescueLease, Floor: job.Fence}
	}
	leases, claimErrs := r.leases.ClaimMany(ctx, reqs)
	var (
		held     []claimed
		claimErr error
	)
	mu.Lock()
	defer mu.Unlock()
	rep.RedisTrips++
	for i, err := range claimErrs {
		switch {
		case errors.Is(err, lua.ErrLeaseHeld):
			rep.Actions[ActionLeaseHeld]++
		case err != nil:
			if claimErr == nil {
				claimErr = fmt.Errorf("scheduler: reconciler claim %q: %w", jobs[i].Key, err)
			}
		default:
			held = append(held, claimed{jobs[i], leases[i]})
		}
	}
	return held, claimErr
}

// releaseClaimed releases the leases of held in one pipelined round trip
// (lua.Leases.ReleaseMany), on a context the sweep's cancellation does not end; a failure
// is logged (a lease already lost or taken over is not one). The token counters stay: the
// rescued jobs run again.
func (r *Reconciler) releaseClaimed(ctx context.Context, held []claimed) {
	rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.QueryTimeout)
	defer rcancel()
	toRelease := make([]lua.Lease, len(held))
	for i, c := range held {
		toRelease[i] = c.lease
	}
	for i, rerr := range r.leases.ReleaseMany(rctx, toRelease) {
		if rerr != nil && !errors.Is(rerr, lua.ErrLeaseLost) && !errors.Is(rerr, lua.ErrNotOwner) {
			r.cfg.Logger.WarnContext(ctx, "reconciler lease release failed", "job", held[i].job.Key, "err", rerr)
		}
	}
}

// claimed is a stranded job whose lease the reconciler holds.
type claimed struct {
	job   store.RunningJob
	lease lua.Lease
}
