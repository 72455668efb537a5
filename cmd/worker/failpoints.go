package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
)

// Failpoints: fault injection for chaos runs (cmd/chaos). Off unless EnvFailpoints is set;
// a production worker never sets it.
const (
	// EnvFailpoints enables failpoints: "name:probability,…", e.g.
	// "after_fetch:0.01,after_commit:0.01,after_xadd:0.05". Each named point fires with its
	// probability every time it is reached.
	EnvFailpoints = "IDEMSCRAPE_FAILPOINTS"
	// EnvChaosRetryScale multiplies every retry backoff of the runner's default policies
	// (handlers.DefaultPolicies) by this factor (0 < f ≤ 1), so that a chaos run's retries
	// happen in seconds rather than minutes. Unset: the defaults.
	EnvChaosRetryScale = "IDEMSCRAPE_CHAOS_RETRY_SCALE"

	// FailAfterFetch kills the process (SIGKILL on itself) after every step of the
	// catalog unit fetched and staged, before validation and commit.
	FailAfterFetch = "after_fetch"
	// FailAfterCommit kills the process after the fenced commit returned success, before
	// the lease is released and asynq acknowledges the task.
	FailAfterCommit = "after_commit"
	// FailBeforeCommit stops the process (SIGSTOP on itself) just before the fenced commit
	// statement is sent, after the runner's last check that its lease holds: the moment a
	// GC pause or a stalled VM would hurt most. cmd/chaos continues it (SIGCONT) once the
	// job was taken over (its fence in PostgreSQL is above this attempt's token); the
	// commit then goes out on a context that ignores the job's cancellation, as a statement
	// already on its way would, and PostgreSQL's fence must refuse it. It fires at most
	// once per process and writes a second line, name=before_commit_sent, with the
	// commit's outcome once the statement returned.
	FailBeforeCommit = "before_commit"
	// FailAfterXadd kills the process in the outbox dispatcher after a batch's XADDs
	// succeeded and before its rows are marked sent (outbox.DispatcherConfig.AfterPublish).
	FailAfterXadd = "after_xadd"
	// FailDupResult is a deliberately BROKEN BUILD, for proving that the chaos harness can
	// fail: after a successful commit it writes a second results row for the same job
	// (another observation key) straight into PostgreSQL, as a build whose result write
	// lost its unique observation key would. It does not kill the process.
	FailDupResult = "dup_result"
)

// failpointLine is the prefix of the line a failpoint writes to stderr just before it
// fires; cmd/chaos counts kills by it. The line holds the point's name and the job key or
// outbox ids, never a secret.
const failpointLine = "FAILPOINT"

// failpoints holds the probability of each enabled point.
type failpoints map[string]float64

// parseFailpoints reads EnvFailpoints' value ("" is none).
func parseFailpoints(s string) (failpoints, error) {
	fp := failpoints{}
	if strings.TrimSpace(s) == "" {
		return fp, nil
	}
	known := map[string]bool{FailAfterFetch: true, FailAfterCommit: true, FailBeforeCommit: true, FailAfterXadd: true, FailDupResult: true}
	for _, part := range strings.Split(s, ",") {
		name, p, ok := strings.Cut(strings.TrimSpace(part), ":")
		if !ok {
			return nil, fmt.Errorf("$%s: %q: want name:probability", EnvFailpoints, part)
		}
		if !known[name] {
			names := make([]string, 0, len(known))
			for n := range known {
				names = append(names, n)
			}
			sort.Strings(names)
			return nil, fmt.Errorf("$%s: unknown failpoint %q (known: %s)", EnvFailpoints, name, strings.Join(names, ", "))
		}
		prob, err := strconv.ParseFloat(p, 64)
		if err != nil || prob < 0 || prob > 1 {
			return nil, fmt.Errorf("$%s: %s: probability %q must be a number in [0, 1]", EnvFailpoints, name, p)
		}
		fp[name] = prob
	}
	return fp, nil
}

// on reports whether the point is enabled at all.
func (fp failpoints) on(name string) bool { return fp[name] > 0 }

// hit draws whether the point fires now.
func (fp failpoints) hit(name string) bool {
	p := fp[name]
	return p > 0 && rand.Float64() < p
}

// kill writes the failpoint line and SIGKILLs this process: nothing after it runs (no
// deferred function, no lease release, no acknowledgement), as in a real crash.
func kill(name, detail string) {
	fmt.Fprintf(os.Stderr, "%s name=%s pid=%d %s\n", failpointLine, name, os.Getpid(), detail)
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {} // the signal is delivered asynchronously; never return into the caller
}

// workflow wraps the catalog workflow: with after_fetch on, a last safe step may kill the
// process once every fetch of the unit is staged.
func (fp failpoints) workflow(inner handlers.WorkflowFunc) handlers.WorkflowFunc {
	if !fp.on(FailAfterFetch) {
		return inner
	}
	return func(job tasks.Payload) (*sessions.Unit, error) {
		u, err := inner(job)
		if err != nil || u == nil {
			return u, err
		}
		u.Steps = append(u.Steps, sessions.Step{Name: "failpoint-after-fetch", Safe: true,
			Run: func(context.Context, *sessions.StepContext) error {
				if fp.hit(FailAfterFetch) {
					kill(FailAfterFetch, "key="+job.Key)
				}
				return nil
			}})
		return u, nil
	}
}

// afterPublish is the dispatcher's failpoint (nil when after_xadd is off).
func (fp failpoints) afterPublish() func(ids []int64) error {
	if !fp.on(FailAfterXadd) {
		return nil
	}
	return func(ids []int64) error {
		if fp.hit(FailAfterXadd) {
			kill(FailAfterXadd, fmt.Sprintf("outbox_ids=%v", ids))
		}
		return nil
	}
}

// failCommitter wraps the group committer for before_commit, after_commit and
// dup_result. It keeps the group committer's JobStart (the runner batches attempt starts
// through it).
type failCommitter struct {
	*store.GroupCommitter
	fp      failpoints
	st      *store.PG
	pool    *pgxpool.Pool
	stopped atomic.Bool // before_commit fired (at most once per process)
}

// committer returns the Committer the registry should use, or nil (the registry's own
// default) when neither commit failpoint is on. The caller closes the returned committer
// after the registry.
func (fp failpoints) committer(st *store.PG, pool *pgxpool.Pool) *failCommitter {
	if !fp.on(FailAfterCommit) && !fp.on(FailDupResult) && !fp.on(FailBeforeCommit) {
		return nil
	}
	return &failCommitter{GroupCommitter: st.NewGroupCommitter(0, 0), fp: fp, st: st, pool: pool}
}

// Commit commits through the group committer, then runs the commit failpoints.
func (c *failCommitter) Commit(ctx context.Context, p store.CommitParams) (store.CommitResult, error) {
	if c.fp.on(FailBeforeCommit) && !c.stopped.Load() && c.fp.hit(FailBeforeCommit) && c.stopped.CompareAndSwap(false, true) {
		return c.staleCommit(ctx, p)
	}
	res, err := c.GroupCommitter.Commit(ctx, p)
	if err != nil {
		return res, err
	}
	if c.fp.hit(FailDupResult) {
		// The broken build: a second result for the job, behind a different observation key.
		_, derr := c.pool.Exec(ctx, `
INSERT INTO results (observation_key, job_key, parser_version, data, response_fingerprint, fence)
SELECT observation_key || ':dup', job_key, parser_version, data, response_fingerprint, fence
FROM results WHERE observation_key = $1
ON CONFLICT (observation_key) DO NOTHING`, p.ObservationKey)
		fmt.Fprintf(os.Stderr, "%s name=%s pid=%d key=%s err=%v\n", failpointLine, FailDupResult, os.Getpid(), p.Key, derr)
	}
	if c.fp.hit(FailAfterCommit) {
		kill(FailAfterCommit, "key="+p.Key)
	}
	return res, nil
}

// retryPolicies returns the retry policies with their backoffs scaled
// (EnvChaosRetryScale), or nil when unset.
func retryPolicies(s string) (map[tasks.Category]handlers.Policy, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || f <= 0 || f > 1 {
		return nil, fmt.Errorf("$%s: %q must be a number in (0, 1]", EnvChaosRetryScale, s)
	}
	scale := func(d time.Duration) time.Duration { return max(time.Duration(float64(d)*f), time.Millisecond) }
	pol := map[tasks.Category]handlers.Policy{}
	for cat, p := range handlers.DefaultPolicies {
		if p.Retry {
			p.Base, p.Max = scale(p.Base), scale(p.Max)
		}
		pol[cat] = p
	}
	return pol, nil
}

// staleCommitTimeout bounds the stale commit's statement: generous, so that PostgreSQL
// judges it. (Through the group committer, a statement cut by its try timeout on a loaded
// box is answered by re-reading the rows, a verdict that assumes the fence: a build
// without it would look refused without PostgreSQL ever judging its write.)
const staleCommitTimeout = 2 * time.Minute

// staleCommit is before_commit: the process stops itself, and once continued sends the
// commit whatever became of the job's lease meanwhile (the same fenced statement as the
// group committer's, on its own: PG.Commit), then reports what PostgreSQL said.
func (c *failCommitter) staleCommit(ctx context.Context, p store.CommitParams) (store.CommitResult, error) {
	// kill(2) of SIGSTOP on itself returns before the process has stopped: the kernel hands a
	// process-directed signal to one thread (often the main one), which then stops the
	// others, so this goroutine runs on for a moment, long enough to send the commit before
	// the stop (it then "commits" before the takeover, and its reply waits out the stop).
	// So it waits for the SIGCONT that continues it.
	cont := make(chan os.Signal, 1)
	signal.Notify(cont, syscall.SIGCONT)
	defer signal.Stop(cont)
	fmt.Fprintf(os.Stderr, "%s name=%s pid=%d key=%s token=%d\n", failpointLine, FailBeforeCommit, os.Getpid(), p.Key, p.Token)
	_ = syscall.Kill(os.Getpid(), syscall.SIGSTOP)
	<-cont // stopped, and continued by cmd/chaos
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), staleCommitTimeout)
	defer cancel()
	began := time.Now()
	res, err := c.st.Commit(sctx, p)
	outcome := "accepted"
	var te *store.TransitionError
	switch {
	case errors.As(err, &te):
		outcome = "refused"
	case err != nil:
		outcome = "error"
	}
	detail := fmt.Sprintf(" took=%s", time.Since(began).Round(time.Millisecond))
	if err != nil {
		detail += " err=" + strconv.Quote(err.Error()) // last: the harness splits the line on spaces
	}
	fmt.Fprintf(os.Stderr, "%s name=%s pid=%d key=%s token=%d outcome=%s%s\n", failpointLine, FailBeforeCommit+"_sent", os.Getpid(), p.Key, p.Token, outcome, detail)
	return res, err
}
