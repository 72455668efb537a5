package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/ops"
	"github.com/idemscrape/idemscrape/tasks"
)

var requeueCmd = command{
	name: "requeue", args: "KEY", npos: 1,
	summary: "Put a failed job back to pending with a fresh retry budget (attempt cap, bandwidth and total time count\n" +
		"again from now; its attempts stay as evidence), record who and when as a job note, and enqueue its task.\n" +
		"Only failed jobs are re-queued, and only while their recorded spec still derives their key (a job whose\n" +
		"spec derives another key since a normaliser change is refused and left as it was).",
	setFlags: func(fs *flag.FlagSet) func(context.Context, *cli, []string) error {
		by := fs.String("by", os.Getenv("USER"), "who re-queues (recorded on the job note)")
		note := fs.String("note", "", "why (recorded on the job note)")
		queue := fs.String("queue", os.Getenv("IDEMSCRAPE_QUEUE"), "asynq queue for a job recorded without one (default: the kind's; a job keeps the queue it was created with)")
		return func(ctx context.Context, c *cli, pos []string) error {
			key := pos[0]
			if *by == "" {
				return usageError{"-by is empty and $USER is not set: say who re-queues"}
			}
			// The key is checked before anything is written, with the normaliser the enqueuer
			// below derives keys with (newEnqueuer keeps EnqueuerConfig's default): a job whose
			// spec derives another key could never be enqueued again (the reconciler refuses it
			// too), so making it pending would strand it.
			pool, err := c.db(ctx)
			if err != nil {
				return err
			}
			job, err := ops.New(pool).JobRequeue(ctx, ops.RequeueParams{Key: key, By: *by, Note: *note,
				Normalizer: tasks.DefaultNormalizer})
			switch {
			case errors.Is(err, store.ErrJobNotFound):
				return fmt.Errorf("no job with key %q", key)
			case errors.Is(err, ops.ErrNotFailed):
				return fmt.Errorf("refused: %w", err)
			case errors.Is(err, ops.ErrKeyMismatch):
				return fmt.Errorf("refused, nothing changed: %w; its task could never run under its key (enqueueing "+
					"the spec would record a second job, and the reconciler refuses it): review the job", err)
			case err != nil:
				return err
			}
			enq, _, closeAll, err := newEnqueuer(ctx, c, *queue)
			if err != nil {
				return err
			}
			defer closeAll()
			res, err := enq.Enqueue(ctx, ops.SpecOf(job))
			if err != nil {
				return fmt.Errorf("job %q is pending again (noted, by %s) but enqueueing its task failed: %w; "+
					"the reconciler enqueues it", key, *by, err)
			}
			fmt.Fprintf(c.stdout, "requeued %s by %s: state %s, task %s\n", key, *by, res.State, res.Outcome)
			return nil
		}
	},
}
