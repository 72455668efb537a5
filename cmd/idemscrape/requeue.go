package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/idemscrape/idemscrape/cmd/internal/quote"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/ops"
	"github.com/idemscrape/idemscrape/tasks"
)

// Bulk re-queue bounds: requeueDefaultMax is -max's default, requeuePage how many keys are
// read (and re-queued) per page.
const (
	requeueDefaultMax = 1000
	requeuePage       = 200
	// requeueReportMax is how many refusals (and failed enqueues) of one kind a bulk
	// re-queue prints on stderr; the summary counts them all.
	requeueReportMax = 10
)

var requeueCmd = command{
	name: "requeue", args: "KEY | selectors", npos: -1,
	summary: "Put a failed job back to pending with a fresh retry budget (attempt cap, bandwidth and total time count\n" +
		"again from now; its attempts stay as evidence), record who and when as a job note, and enqueue its task.\n" +
		"Only failed jobs are re-queued, and only while their recorded spec still derives their key (a job whose\n" +
		"spec derives another key since a normaliser change is refused and left as it was).\n" +
		"Instead of a KEY, selectors re-queue every failed job they match (-window, -kind, -category, -prefix,\n" +
		"-since; at least one): -dry-run prints the count and the keys and changes nothing; more than -max matches\n" +
		"are refused, and none is an error. Each job goes through the single re-queue's path, one by one.",
	setFlags: func(fs *flag.FlagSet) func(context.Context, *cli, []string) error {
		by := fs.String("by", os.Getenv("USER"), "who re-queues (recorded on the job note)")
		note := fs.String("note", "", "why (recorded on the job note)")
		queue := fs.String("queue", os.Getenv("IDEMSCRAPE_QUEUE"), "asynq queue for a job recorded without one (default: the kind's; a job keeps the queue it was created with)")
		sf := addSelectorFlags(fs, "with selectors: the jobs' state; only failed can be re-queued (the default)")
		dryRun := fs.Bool("dry-run", false, "with selectors: print how many jobs match and their keys, change nothing")
		maxJobs := fs.Int("max", requeueDefaultMax, "with selectors: refuse when more jobs than this match (narrow the selectors or raise it)")
		return func(ctx context.Context, c *cli, pos []string) error {
			if *by == "" && !*dryRun {
				return usageError{"-by is empty and $USER is not set: say who re-queues"}
			}
			selecting := sf.describe() != ""
			switch {
			case len(pos) > 1:
				quoted := make([]string, len(pos)-1)
				for i, a := range pos[1:] {
					quoted[i] = quote.Input(a)
				}
				return usageError{fmt.Sprintf("unexpected argument(s): %s (one KEY; select several jobs with -window, -kind, -category, -prefix, -since)",
					strings.Join(quoted, " "))}
			case len(pos) == 1 && selecting:
				return usageError{"a KEY or selectors, not both"}
			case len(pos) == 0 && !selecting:
				// No accidental re-queue of every failed job.
				return usageError{"missing KEY, or selectors (-window, -kind, -category, -prefix, -since): an empty selection would re-queue every failed job"}
			case len(pos) == 1 && *dryRun:
				return usageError{"-dry-run goes with selectors; `idemscrape status KEY` shows one job"}
			case *maxJobs < 1:
				return usageError{fmt.Sprintf("-max %d must be >= 1", *maxJobs)}
			}
			if len(pos) == 1 {
				return requeueOne(ctx, c, pos[0], *by, *note, *queue)
			}
			sel, err := sf.selector(time.Now())
			if err != nil {
				return err
			}
			if len(sel.States) == 0 {
				sel.States = []tasks.JobState{tasks.StateFailed}
			}
			if slices.ContainsFunc(sel.States, func(s tasks.JobState) bool { return s != tasks.StateFailed }) {
				return usageError{fmt.Sprintf("-state %s: only failed jobs can be re-queued (pending, running and retryable jobs are queued already; complete ones are done)", *sf.state)}
			}
			if *sf.kind == "" && *sf.category == "" && *sf.window == "" && !*sf.windowSet && *sf.prefix == "" && *sf.since == "" {
				// -state failed alone selects every failed job: refused like no selector.
				return usageError{"-state alone would re-queue every failed job: add -window, -kind, -category, -prefix or -since"}
			}
			return requeueSelected(ctx, c, sel, sf.describe(), *by, *note, *queue, *dryRun, *maxJobs)
		}
	},
}

// requeueOne re-queues the job with key: ops.JobRequeue, then its task.
func requeueOne(ctx context.Context, c *cli, key, by, note, queue string) error {
	// The key is checked before anything is written, with the normaliser the enqueuer
	// below derives keys with (newEnqueuer keeps EnqueuerConfig's default): a job whose
	// spec derives another key could never be enqueued again (the reconciler refuses it
	// too), so making it pending would strand it.
	pool, err := c.db(ctx)
	if err != nil {
		return err
	}
	job, err := ops.New(pool).JobRequeue(ctx, ops.RequeueParams{Key: key, By: by, Note: note,
		Normalizer: tasks.DefaultNormalizer})
	switch {
	case errors.Is(err, store.ErrJobNotFound):
		return fmt.Errorf("no job with key %s", quote.Input(key))
	case errors.Is(err, ops.ErrNotFailed):
		return fmt.Errorf("refused: %w", err)
	case errors.Is(err, ops.ErrKeyMismatch):
		return fmt.Errorf("refused, nothing changed: %w; its task could never run under its key (enqueueing "+
			"the spec would record a second job, and the reconciler refuses it): review the job", err)
	case err != nil:
		return err
	}
	enq, _, closeAll, err := newEnqueuer(ctx, c, queue)
	if err != nil {
		return err
	}
	defer closeAll()
	res, err := enq.Enqueue(ctx, ops.SpecOf(job))
	if err != nil {
		return fmt.Errorf("job %s is pending again (noted, by %s) but enqueueing its task failed: %w; "+
			"the reconciler enqueues it", quote.Input(key), quote.Input(by), err)
	}
	fmt.Fprintf(c.stdout, "requeued %s by %s: state %s, task %s\n", key, by, res.State, res.Outcome)
	return nil
}

// requeueSelected re-queues the failed jobs sel matches, page by page in key order, each
// exactly as requeueOne does (ops.JobRequeue moves it only while it is failed, then its task
// is enqueued under its key): a job re-queued meanwhile by someone else is skipped, never
// enqueued twice, and a run stopped midway leaves every job either failed or pending with
// its note (a pending one whose task is missing is enqueued by the reconciler).
func requeueSelected(ctx context.Context, c *cli, sel ops.Selector, what, by, note, queue string, dryRun bool, maxJobs int) error {
	pool, err := c.db(ctx)
	if err != nil {
		return err
	}
	db := ops.New(pool)
	n, err := db.JobSelectCount(ctx, sel)
	if err != nil {
		return err
	}
	switch {
	case n == 0:
		return fmt.Errorf("no failed job matches %s: nothing re-queued", what)
	case n > int64(maxJobs) && !dryRun:
		return fmt.Errorf("refused, nothing changed: %d failed jobs match %s, more than -max %d: narrow the selectors, "+
			"or raise -max (see them with -dry-run or `idemscrape jobs`)", n, what, maxJobs)
	}
	if dryRun {
		keys, err := db.JobSelectKeys(ctx, sel, "", maxJobs)
		if err != nil {
			return err
		}
		for _, k := range keys {
			fmt.Fprintln(c.stdout, k)
		}
		more := ""
		if n > int64(len(keys)) {
			more = fmt.Sprintf(" (the first %d listed; more than -max %d: a re-queue would be refused)", len(keys), maxJobs)
		}
		fmt.Fprintf(c.stdout, "dry run: %d failed job(s) match %s%s; nothing changed\n", n, what, more)
		return nil
	}
	enq, _, closeAll, err := newEnqueuer(ctx, c, queue)
	if err != nil {
		return err
	}
	defer closeAll()
	var requeued, skipped, mismatched, unqueued int
	outcomes := map[string]int{}
	after := ""
	for done := 0; done < maxJobs; {
		keys, err := db.JobSelectKeys(ctx, sel, after, min(requeuePage, maxJobs-done))
		if err != nil {
			return fmt.Errorf("%w (after re-queueing %d)", err, requeued)
		}
		if len(keys) == 0 {
			break
		}
		for _, key := range keys {
			done++
			after = key
			job, err := db.JobRequeue(ctx, ops.RequeueParams{Key: key, By: by, Note: note, Normalizer: tasks.DefaultNormalizer})
			switch {
			case errors.Is(err, ops.ErrNotFailed), errors.Is(err, store.ErrJobNotFound):
				skipped++ // re-queued, run or pruned since it was selected
				continue
			case errors.Is(err, ops.ErrKeyMismatch):
				mismatched++
				if mismatched <= requeueReportMax {
					fmt.Fprintf(c.stderr, "idemscrape requeue: refused, left failed: %v\n", err)
				}
				continue
			case err != nil:
				return fmt.Errorf("%w (after re-queueing %d of %d)", err, requeued, n)
			}
			requeued++
			res, err := enq.Enqueue(ctx, ops.SpecOf(job))
			if err != nil {
				unqueued++
				if unqueued <= requeueReportMax {
					fmt.Fprintf(c.stderr, "idemscrape requeue: job %s is pending again but enqueueing its task failed: %v; the reconciler enqueues it\n", quote.Input(key), err)
				}
				continue
			}
			outcomes[res.Outcome.String()]++
		}
	}
	tasksDone := make([]string, 0, len(outcomes))
	for _, o := range sortedKeys(outcomes) {
		tasksDone = append(tasksDone, fmt.Sprintf("%d %s", outcomes[o], o))
	}
	if len(tasksDone) == 0 {
		tasksDone = append(tasksDone, "none enqueued")
	}
	fmt.Fprintf(c.stdout, "requeued %d of %d failed job(s) matching %s by %s; tasks: %s", requeued, n, what, by,
		strings.Join(tasksDone, ", "))
	if skipped > 0 {
		fmt.Fprintf(c.stdout, "; %d skipped (no longer failed)", skipped)
	}
	if mismatched > 0 {
		fmt.Fprintf(c.stdout, "; %d refused (spec derives another key, left failed; the first %d on stderr)", mismatched, min(mismatched, requeueReportMax))
	}
	if unqueued > 0 {
		fmt.Fprintf(c.stdout, "; %d pending without a task yet (the reconciler enqueues them)", unqueued)
	}
	fmt.Fprintln(c.stdout)
	if mismatched > 0 || unqueued > 0 {
		return exitError{1}
	}
	return nil
}
