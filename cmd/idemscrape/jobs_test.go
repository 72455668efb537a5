package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/ops"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// jobsFixture is a database and Redis namespace for in-process runs of the CLI, with a
// kind whose queue is the namespace's.
type jobsFixture struct {
	pool *pgxpool.Pool
	st   *store.PG
	ns   *testutil.RedisNS
	kind string
}

func newJobsFixture(t *testing.T) jobsFixture {
	t.Helper()
	pool := testutil.PG(t)
	ns := testutil.Redis(t)
	cliEnv(t, dsnOf(t, pool), ns.Addr)
	t.Setenv("USER", "tester")
	return jobsFixture{pool: pool, st: store.New(pool), ns: ns, kind: queueKind(t, ns)}
}

// job records the job of source src in window and ends its first attempt as state says
// (failed or retryable with category; pending: no attempt), its attempt costing micros USD
// micro-units. It returns the key.
func (f jobsFixture) job(t *testing.T, src, window string, state tasks.JobState, category tasks.Category, micros int64) string {
	t.Helper()
	ctx := context.Background()
	spec, err := tasks.DefaultNormalizer.Normalize(tasks.Spec{Kind: f.kind, SourceID: src, Country: "US", Window: window, ParserVersion: 1})
	require.NoError(t, err)
	key, err := tasks.DefaultNormalizer.Key(spec)
	require.NoError(t, err)
	_, err = f.st.JobsRecord(ctx, []tasks.JobRecord{{Key: key, Spec: spec}})
	require.NoError(t, err)
	if state == tasks.StatePending {
		return key
	}
	_, err = f.st.JobStart(ctx, store.AttemptStartParams{Key: key, Token: 1, Worker: "w1"})
	require.NoError(t, err)
	p := store.AttemptFinishParams{Key: key, Token: 1, Category: string(category), Error: "x", Bytes: 100}
	if micros > 0 {
		p.Cost = store.Cost{Micros: micros, Currency: "USD"}
	}
	switch state {
	case tasks.StateFailed:
		require.NoError(t, f.st.JobFail(ctx, p))
	case tasks.StateRetryable:
		p.NextAttemptAt = time.Now().Add(time.Hour)
		require.NoError(t, f.st.JobMarkRetryable(ctx, p))
	default:
		t.Fatalf("state %s", state)
	}
	return key
}

func (f jobsFixture) run(t *testing.T, args ...string) cliRun {
	t.Helper()
	var stderr bytes.Buffer
	out, code := runInProcess(strings.NewReader(""), &stderr, args...)
	return cliRun{stdout: out, stderr: stderr.String(), code: code}
}

func (f jobsFixture) snapshot(t *testing.T) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	for _, tbl := range []string{"jobs", "job_notes", "attempts"} {
		out[tbl] = testutil.TableSnapshot(t, f.pool, tbl)
	}
	return out
}

func sortedStrings(s ...string) []string { sort.Strings(s); return s }

var requeuedRE = regexp.MustCompile(`requeued (\d+) of (\d+) failed job`)

// TestRequeueBySelector: `idemscrape requeue` with selectors re-queues exactly the failed
// jobs they match, each through the single re-queue's path (a note, a fresh budget, its
// task enqueued under its key); -dry-run counts and lists and changes nothing; an empty
// selection, -state alone, a state other than failed, a selection that matches nothing
// and one larger than -max are refused with nothing changed; two re-queues of the same
// large selection at once (more than one page) re-queue each job exactly once.
func TestRequeueBySelector(t *testing.T) {
	f := newJobsFixture(t)
	const winA, winB, winC = "2026-04-23", "2026-04-24", "2026-04-25"
	var spentA []string
	for i := range 3 {
		spentA = append(spentA, f.job(t, fmt.Sprintf("a-%d", i), winA, tasks.StateFailed, tasks.CategoryBudgetExceeded, 0))
	}
	parseA := f.job(t, "a-parse", winA, tasks.StateFailed, tasks.CategoryParseError, 0)
	pendingA := f.job(t, "a-pending", winA, tasks.StatePending, "", 0)
	var spentB []string
	for i := range 2 {
		spentB = append(spentB, f.job(t, fmt.Sprintf("b-%d", i), winB, tasks.StateFailed, tasks.CategoryBudgetExceeded, 0))
	}

	refused := func(t *testing.T, code int, want string, args ...string) {
		t.Helper()
		before := f.snapshot(t)
		r := f.run(t, args...)
		assert.Equal(t, code, r.code, "stdout %q stderr %q", r.stdout, r.stderr)
		assert.Contains(t, r.stderr, want)
		assert.Empty(t, r.stdout)
		assert.Equal(t, before, f.snapshot(t), "nothing written")
		assert.Zero(t, f.ns.AsynqPending(t), "nothing enqueued")
	}
	t.Run("EmptySelectionRefused", func(t *testing.T) {
		refused(t, 2, "an empty selection would re-queue every failed job", "requeue")
		refused(t, 2, "-state alone would re-queue every failed job", "requeue", "-state", "failed")
		refused(t, 2, "a KEY or selectors, not both", "requeue", "-window", winA, spentA[0])
	})
	t.Run("StateOtherThanFailedRefused", func(t *testing.T) {
		refused(t, 2, "only failed jobs can be re-queued", "requeue", "-window", winA, "-state", "failed,pending")
	})
	t.Run("NothingMatchesRefused", func(t *testing.T) {
		refused(t, 1, `no failed job matches -window "2026-01-01": nothing re-queued`, "requeue", "-window", "2026-01-01")
		refused(t, 1, `no failed job matches -window "2026-04-23" -kind "nosuchkind"`, "requeue", "-kind", "nosuchkind", "-window", winA)
	})
	t.Run("BadSelectorsRefused", func(t *testing.T) {
		refused(t, 2, "-since: ", "requeue", "-window", winA, "-since", "yesterday")
		refused(t, 2, "-window", "requeue", "-window", "2026\x00")
	})
	t.Run("MoreThanMaxRefused", func(t *testing.T) {
		refused(t, 1, `3 failed jobs match -window "2026-04-23" -category "budget_exceeded", more than -max 2`,
			"requeue", "-window", winA, "-category", "budget_exceeded", "-max", "2")
	})
	t.Run("DryRun", func(t *testing.T) {
		before := f.snapshot(t)
		r := f.run(t, "requeue", "-window", winA, "-category", "budget_exceeded", "-dry-run")
		require.Equal(t, 0, r.code, r.stderr)
		want := strings.Join(sortedStrings(spentA...), "\n") +
			"\ndry run: 3 failed job(s) match -window \"2026-04-23\" -category \"budget_exceeded\"; nothing changed\n"
		assert.Equal(t, want, r.stdout)
		assert.Equal(t, before, f.snapshot(t))
		assert.Zero(t, f.ns.AsynqPending(t))
	})
	t.Run("Requeued", func(t *testing.T) {
		r := f.run(t, "requeue", "-window", winA, "-category", "budget_exceeded", "-by", "alice", "-note", "budget raised")
		require.Equal(t, 0, r.code, r.stderr)
		assert.Contains(t, r.stdout, `requeued 3 of 3 failed job(s) matching -window "2026-04-23" -category "budget_exceeded" by alice; tasks: 3 requeued`)
		for _, key := range spentA {
			job, err := f.st.JobGet(context.Background(), key)
			require.NoError(t, err)
			assert.Equal(t, tasks.StatePending, job.State, key)
			assert.Equal(t, 1, testutil.Count(t, f.pool, `SELECT count(*) FROM job_notes WHERE job_key = $1 AND actor = 'alice' AND note = 'budget raised'`, key))
			assert.True(t, f.ns.AsynqTaskExists(t, key), key)
		}
		assert.Equal(t, 3, f.ns.AsynqPending(t))
		for _, key := range append([]string{parseA}, spentB...) {
			job, err := f.st.JobGet(context.Background(), key)
			require.NoError(t, err)
			assert.Equal(t, tasks.StateFailed, job.State, "%s: not selected", key)
		}
		job, err := f.st.JobGet(context.Background(), pendingA)
		require.NoError(t, err)
		assert.Equal(t, tasks.StatePending, job.State)
		assert.False(t, f.ns.AsynqTaskExists(t, pendingA), "a pending job is not selected")

		// Again: nothing failed matches any more, nothing changes (one note per job).
		before := f.snapshot(t)
		r = f.run(t, "requeue", "-window", winA, "-category", "budget_exceeded")
		assert.Equal(t, 1, r.code)
		assert.Contains(t, r.stderr, "no failed job matches")
		assert.Equal(t, before, f.snapshot(t))
		assert.Equal(t, 3, f.ns.AsynqPending(t))
	})
	t.Run("ConcurrentLargeSelectionExactlyOnce", func(t *testing.T) {
		n := requeuePage + 7 // more than one page
		keys := make([]string, n)
		for i := range keys {
			keys[i] = f.job(t, fmt.Sprintf("c-%03d", i), winC, tasks.StateFailed, tasks.CategoryBlocked, 0)
		}
		var wg sync.WaitGroup
		runs := make([]cliRun, 2)
		for i := range runs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				var stderr bytes.Buffer
				out, code := runInProcess(strings.NewReader(""), &stderr, "requeue", "-window", winC, "-by", fmt.Sprintf("op%d", i))
				runs[i] = cliRun{stdout: out, stderr: stderr.String(), code: code}
			}()
		}
		wg.Wait()
		total := 0
		for _, r := range runs {
			if m := requeuedRE.FindStringSubmatch(r.stdout); m != nil {
				assert.Equal(t, 0, r.code, r.stderr)
				got, _ := strconv.Atoi(m[1])
				total += got
			} else {
				assert.Equal(t, 1, r.code, "the other run found nothing left: %q %q", r.stdout, r.stderr)
				assert.Contains(t, r.stderr, "no failed job matches")
			}
		}
		assert.Equal(t, n, total, "every job re-queued once between the two runs")
		assert.Equal(t, n, testutil.Count(t, f.pool, `SELECT count(*) FROM jobs WHERE "window" = $1 AND state = 'pending'`, winC))
		assert.Zero(t, testutil.Count(t, f.pool, `SELECT count(*) FROM (SELECT job_key FROM job_notes GROUP BY job_key HAVING count(*) > 1) x`),
			"one note per job: no job re-queued twice")
		assert.Equal(t, n+3, f.ns.AsynqPending(t), "one task per re-queued job")
		for _, k := range keys {
			require.True(t, f.ns.AsynqTaskExists(t, k), k)
		}
	})
	t.Run("EmptyWindowSelectable", func(t *testing.T) {
		// A job recorded without a window (before windows were required): -window "" selects
		// it, and only it; no -window at all is no selector.
		noWin := f.job(t, "w-none", "2026-04-26", tasks.StateFailed, tasks.CategoryParseError, 0)
		_, err := f.pool.Exec(context.Background(), `UPDATE jobs SET "window" = '' WHERE key = $1`, noWin)
		require.NoError(t, err)
		before := f.snapshot(t)
		r := f.run(t, "requeue", "-window", "", "-dry-run")
		require.Equal(t, 0, r.code, r.stderr)
		assert.Equal(t, noWin+"\ndry run: 1 failed job(s) match -window \"\"; nothing changed\n", r.stdout)
		assert.Equal(t, before, f.snapshot(t))
		r = f.run(t, "jobs", "-window", "", "-state", "any", "-json")
		require.Equal(t, 0, r.code, r.stderr)
		var listed []map[string]any
		require.NoError(t, json.Unmarshal([]byte(r.stdout), &listed))
		require.Len(t, listed, 1, "jobs -window \"\" lists the job without a window only: %s", r.stdout)
		assert.Equal(t, noWin, listed[0]["key"])
		// Re-queued through the single path: its spec (no window) derives no key, so it is
		// refused and left failed, and nothing else is touched.
		r = f.run(t, "requeue", "-window", "", "-by", "alice")
		assert.Equal(t, 1, r.code, r.stderr)
		assert.Contains(t, r.stdout, `requeued 0 of 1 failed job(s) matching -window "" by alice`)
		assert.Contains(t, r.stdout, "1 refused")
		assert.Equal(t, before, f.snapshot(t), "refused: nothing written")
	})

}

// TestJobsListing: `idemscrape jobs` lists keys with /jobs' filters (kind, state, category,
// window, key prefix) and -since, as a table with the count, or as JSON; -deferred lists
// the runnable jobs of windows whose money budget (-window-budget) is spent; bad filters
// are usage errors naming the flag.
func TestJobsListing(t *testing.T) {
	f := newJobsFixture(t)
	const winA, winB = "2026-04-23", "2026-04-24"
	failA := f.job(t, "a-fail", winA, tasks.StateFailed, tasks.CategoryParseError, 40)
	retryA := f.job(t, "a-retry", winA, tasks.StateRetryable, tasks.CategoryThrottled, 30)
	pendA := f.job(t, "a-pending", winA, tasks.StatePending, "", 0)
	failB := f.job(t, "b-fail", winB, tasks.StateFailed, tasks.CategoryBudgetExceeded, 5)
	pendB := f.job(t, "b-pending", winB, tasks.StatePending, "", 0)

	listJSON := func(t *testing.T, args ...string) []string {
		t.Helper()
		r := f.run(t, append([]string{"jobs", "-json"}, args...)...)
		require.Equal(t, 0, r.code, r.stderr)
		var rows []ops.ProblemJob
		require.NoError(t, json.Unmarshal([]byte(r.stdout), &rows), r.stdout)
		keys := []string{}
		for _, x := range rows {
			keys = append(keys, x.Key)
		}
		sort.Strings(keys)
		return keys
	}
	assert.Equal(t, sortedStrings(failA, retryA, failB), listJSON(t), "default: failed and retryable")
	assert.Equal(t, sortedStrings(failA, retryA, pendA), listJSON(t, "-window", winA, "-state", "any"))
	assert.Equal(t, []string{failB}, listJSON(t, "-category", "budget_exceeded"))
	assert.Equal(t, sortedStrings(pendA, pendB), listJSON(t, "-state", "pending", "-kind", f.kind))
	assert.Equal(t, []string{}, listJSON(t, "-kind", "other"))
	prefix, _, _ := strings.Cut(failA, "a-fail")
	assert.Equal(t, []string{failA}, listJSON(t, "-prefix", prefix+"a-f", "-state", "any"))
	assert.Equal(t, sortedStrings(failA, retryA, failB), listJSON(t, "-since", "1h"))
	assert.Equal(t, []string{}, listJSON(t, "-since", time.Now().Add(time.Hour).UTC().Format(time.RFC3339)))

	// The table, with the count when the limit cuts it.
	r := f.run(t, "jobs", "-window", winA, "-state", "any", "-limit", "2")
	require.Equal(t, 0, r.code, r.stderr)
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	require.Len(t, lines, 4, r.stdout)
	assert.Regexp(t, `^KEY\s+KIND\s+STATE\s+ATTEMPTS\s+CATEGORY\s+UPDATED\s+NEXT ATTEMPT$`, lines[0])
	assert.Equal(t, "2 of 3 matching job(s)", lines[3])
	r = f.run(t, "jobs", "-category", "throttled")
	require.Equal(t, 0, r.code, r.stderr)
	assert.Regexp(t, regexp.MustCompile(`(?m)^`+regexp.QuoteMeta(retryA)+`\s+`+f.kind+`\s+retryable\s+1\s+throttled\s+\S+\s+\S+$`), r.stdout)
	assert.Contains(t, r.stdout, "1 of 1 matching job(s)\n")

	// Deferred: window A's attempts cost 70 micro-units, B's 5; with a budget of 50 per
	// window, A is spent: its runnable jobs are deferred.
	assert.Equal(t, sortedStrings(retryA, pendA), listJSON(t, "-deferred", "-window-budget", f.kind+"=0.00005 USD"))
	t.Setenv(envWindowBudgets, f.kind+"=0.00005 USD")
	assert.Equal(t, sortedStrings(retryA, pendA), listJSON(t, "-deferred"), "budgets from the environment")
	assert.Equal(t, []string{failA}, listJSON(t, "-deferred", "-state", "failed"))
	assert.Equal(t, []string{}, listJSON(t, "-deferred", "-window-budget", f.kind+"=1 USD"), "nothing spent")
	t.Setenv(envWindowBudgets, "")

	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"-state", "bogus"}, `-state: state "bogus": want one of`},
		{[]string{"-since", "last week"}, `-since: "last week" is neither`},
		{[]string{"-since", "-3h"}, "must be positive"},
		{[]string{"-kind", "cat\x00"}, `-kind "cat\x00": byte 3 ("\x00") not allowed (PostgreSQL text holds no NUL)`},
		{[]string{"-window", "\xff"}, `-window "\xff": not valid UTF-8 at byte 0 ("\xff")`},
		{[]string{"-deferred"}, "-deferred: deferred jobs are those of windows whose money budget is spent"},
		{[]string{"-window-budget", f.kind + "=25"}, "is not \"<amount> <CUR>\""},
		{[]string{"-limit", "0"}, "-limit 0 must be >= 1"},
	} {
		r := f.run(t, append([]string{"jobs"}, tc.args...)...)
		assert.Equal(t, 2, r.code, "%q: %s", tc.args, r.stderr)
		assert.Contains(t, r.stderr, tc.want, "%q", tc.args)
		assert.Contains(t, r.stderr, "usage: idemscrape jobs")
	}
}

// TestWindowBudgetShown: with the kinds' window budgets (-window-budget or
// $IDEMSCRAPE_WINDOW_BUDGETS), `status` of a runnable job whose window's budget is spent
// says "deferred: window budget spent (x of y)" (and -json says so), a job of a window with
// money left shows its spend against the budget, and `windows` shows each window's spend
// against its budget; without budgets, status is as before and windows shows the spend.
func TestWindowBudgetShown(t *testing.T) {
	ctx := context.Background()
	f := newJobsFixture(t)
	const winA, winB = "2026-04-23", "2026-04-24"
	f.job(t, "a-fail", winA, tasks.StateFailed, tasks.CategoryParseError, 40)
	retryA := f.job(t, "a-retry", winA, tasks.StateRetryable, tasks.CategoryThrottled, 30)
	pendA := f.job(t, "a-pending", winA, tasks.StatePending, "", 0)
	failB := f.job(t, "b-fail", winB, tasks.StateFailed, tasks.CategoryBudgetExceeded, 5)
	budget := f.kind + "=0.00005 USD"

	statusLine := func(t *testing.T, args ...string) string {
		t.Helper()
		r := f.run(t, append([]string{"status"}, args...)...)
		require.Equal(t, 0, r.code, r.stderr)
		for _, l := range strings.Split(r.stdout, "\n") {
			if strings.HasPrefix(l, "window money") {
				return strings.TrimSpace(strings.TrimPrefix(l, "window money"))
			}
		}
		return ""
	}
	const spentA = "(0.000070 USD of 0.000050 USD)"
	assert.Equal(t, "deferred: window budget spent "+spentA, statusLine(t, "-window-budget", budget, pendA))
	assert.Equal(t, "deferred: window budget spent "+spentA, statusLine(t, "-window-budget", budget, retryA))
	assert.Equal(t, "0.000005 USD of 0.000050 USD spent", statusLine(t, "-window-budget", budget, failB))
	assert.Empty(t, statusLine(t, pendA), "no budget known: as before")

	t.Setenv(envWindowBudgets, budget)
	r := f.run(t, "status", "-json", pendA)
	require.Equal(t, 0, r.code, r.stderr)
	var st struct {
		WindowMoney *windowMoneyJSON `json:"window_money"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &st))
	require.NotNil(t, st.WindowMoney)
	assert.Equal(t, windowMoneyJSON{SpentMicros: 70, BudgetMicros: 50, Currency: "USD", BudgetSpent: true,
		Text: "deferred: window budget spent " + spentA}, *st.WindowMoney)

	// windows: spend against budget per window.
	due := time.Date(2026, 4, 23, 6, 0, 0, 0, time.UTC)
	for i, w := range []string{winA, winB} {
		require.NoError(t, f.st.WindowBegin(ctx, store.WindowParams{Template: "daily", Window: w, Kind: f.kind, Due: due.Add(time.Duration(i) * 24 * time.Hour), Force: true}))
	}
	r = f.run(t, "windows")
	require.Equal(t, 0, r.code, r.stderr)
	assert.Contains(t, r.stdout, "SPENT / BUDGET")
	assert.Regexp(t, `(?m)^daily\s+2026-04-23\s.*\s0\.000070 USD of 0\.000050 USD \(spent\)\s*$`, r.stdout)
	assert.Regexp(t, `(?m)^daily\s+2026-04-24\s.*\s0\.000005 USD of 0\.000050 USD\s*$`, r.stdout)
	r = f.run(t, "windows", "-json")
	require.Equal(t, 0, r.code, r.stderr)
	var ws []windowJSON
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &ws))
	require.Len(t, ws, 2)
	byWin := map[string]windowJSON{ws[0].Window: ws[0], ws[1].Window: ws[1]}
	assert.True(t, byWin[winA].BudgetSpent)
	assert.Equal(t, []windowSpentJSON{{Currency: "USD", Micros: 70}}, byWin[winA].Spent)
	assert.False(t, byWin[winB].BudgetSpent)

	t.Setenv(envWindowBudgets, "")
	r = f.run(t, "windows")
	require.Equal(t, 0, r.code, r.stderr)
	assert.Regexp(t, `(?m)^daily\s+2026-04-23\s.*\s0\.000070 USD\s*$`, r.stdout, "no budget known: the spend alone")
}
