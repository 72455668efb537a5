package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/ops"
)

var requeueCmd = command{
	name: "requeue", args: "KEY", npos: 1, db: true,
	summary: "Put a failed job back to pending with a fresh retry budget (attempt cap, bandwidth and total time count\n" +
		"again from now; its attempts stay as evidence), record who and when as a job note, and enqueue its task.\n" +
		"Only failed jobs are re-queued.",
	setFlags: func(fs *flag.FlagSet) func(context.Context, *cli, []string) error {
		by := fs.String("by", os.Getenv("USER"), "who re-queues (recorded on the job note)")
		note := fs.String("note", "", "why (recorded on the job note)")
		queue := fs.String("queue", os.Getenv("IDEMSCRAPE_QUEUE"), "asynq queue (default: the kind's, where cmd/worker listens)")
		return func(ctx context.Context, c *cli, pos []string) error {
			key := pos[0]
			if *by == "" {
				return usageError{"-by is empty and $USER is not set: say who re-queues"}
			}
			job, err := ops.New(c.pool).JobRequeue(ctx, ops.RequeueParams{Key: key, By: *by, Note: *note})
			switch {
			case errors.Is(err, store.ErrJobNotFound):
				return fmt.Errorf("no job with key %q", key)
			case errors.Is(err, ops.ErrNotFailed):
				return fmt.Errorf("refused: %w", err)
			case err != nil:
				return err
			}
			spec := ops.SpecOf(job)
			if k, err := spec.Key(); err != nil || k != key {
				// The row's spec no longer derives its key (a normaliser change): enqueueing it would
				// record a second job under the new key, and the reconciler refuses it too
				// (reconciler_key_mismatch). Say so; the job needs review.
				return fmt.Errorf("job %q is pending again but its spec derives key %q (%v): its task was not enqueued, "+
					"and the reconciler will not enqueue it either (normaliser changed?): review the job", key, k, err)
			}
			enq, closeAll, err := newEnqueuer(c, *queue)
			if err != nil {
				return err
			}
			defer closeAll()
			res, err := enq.Enqueue(ctx, spec)
			if err != nil {
				return fmt.Errorf("job %q is pending again (noted, by %s) but enqueueing its task failed: %w; "+
					"the reconciler enqueues it", key, *by, err)
			}
			fmt.Fprintf(c.stdout, "requeued %s by %s: state %s, task %s\n", key, *by, res.State, res.Outcome)
			return nil
		}
	},
}
