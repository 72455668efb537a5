package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/store/outbox"
)

// Invariant names, as the table prints them.
const (
	InvLost          = "0 lost jobs (complete, or failed with a category)"
	InvDupResults    = "0 duplicate results (one per complete job)"
	InvDupEffects    = "0 duplicate side effects (inbox consumer)"
	InvEffectsLost   = "every complete job's event took effect"
	InvEffectsWiped  = "events in the stream at the Redis wipe took effect"
	InvReexec        = "re-executions >= execution kills"
	InvXaddReplays   = "replays recognised >= after_xadd kills"
	InvStale         = "0 stale commits accepted"
	InvStaleRefused  = "PostgreSQL refused >= k stale commits"
	InvFences        = "fences strictly increase per job"
	InvAttemptRows   = "one attempt row per start of every ended job"
	InvTwoSessions   = "no result from two sessions"
	InvBudget        = "no job over its bandwidth budget"
	InvCanary        = "canary password absent everywhere"
	InfoBytes        = "bytes per completed job: proxy fault mix vs fault-free, same jobs"
	InfoBytesChaos   = "bytes per completed job: chaos phase vs fault-free"
	InfoBytesWire    = "worker↔proxy bytes per completed job: fault mix vs replay floor"
	resultPass       = "PASS"
	resultFail       = "FAIL"
	resultInfo       = "INFO"
	resultGap        = "GAP"
	resultIncomplete = "INCOMPLETE"
	maxOffenders     = 5
	bytesRatioTarget = 1.25
	// The goals of resumes on a proven exit (issue 37), on worker↔proxy bytes: with every cut losing
	// the exit, at most floorMargin above the replay floor measured in the same run; with
	// half the cuts exit-alive, at most aliveRatioTarget × the fault-free bytes.
	floorMargin      = 0.03
	aliveRatioTarget = 1.12
)

// Row is one line of the report.
type Row struct {
	Name      string
	Injected  string
	Observed  string
	Result    string // PASS, FAIL, INFO or GAP (a failure that -strict-events=false tolerates)
	Offenders []string
}

// Report is what a chaos run found.
type Report struct {
	Faults     []Row
	Invariants []Row
	// Incomplete says why the run did not show everything it set out to (it reached its
	// timeout with jobs open, a targeted fault never fired) although nothing was violated:
	// exit status 4, not 1.
	Incomplete []string
	Wall       time.Duration
	Database   string
	Logs       string
}

// Failed returns the names of the invariants that failed.
func (r *Report) Failed() []string {
	var out []string
	for _, row := range r.Invariants {
		if row.Result == resultFail {
			out = append(out, row.Name)
		}
	}
	return out
}

// Print writes the report as two tables.
func (r *Report) Print(w io.Writer) {
	tw := tabwriter.NewWriter(w, 2, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "FAULT\tINJECTED\tOBSERVED")
	for _, f := range r.Faults {
		fmt.Fprintf(tw, "%s\t%s\t%s\n", f.Name, f.Injected, f.Observed)
	}
	fmt.Fprintln(tw, "\t\t")
	fmt.Fprintln(tw, "INVARIANT\tOBSERVED\tRESULT\tFIRST OFFENDING JOB KEYS")
	for _, inv := range r.Invariants {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", inv.Name, inv.Observed, inv.Result, strings.Join(inv.Offenders, " "))
	}
	_ = tw.Flush()
	if r.hasBytes() {
		fmt.Fprintln(w, "\n"+bytesLegend)
	}
	fmt.Fprintf(w, "\nwall time %v; database %s; logs %s\n", r.Wall.Round(time.Second), r.Database, r.Logs)
	switch failed := r.Failed(); {
	case len(failed) > 0:
		fmt.Fprintf(w, "FAIL: %s\n", strings.Join(failed, "; "))
		if len(r.Incomplete) > 0 {
			fmt.Fprintf(w, "(also incomplete: %s)\n", strings.Join(r.Incomplete, "; "))
		}
	case len(r.Incomplete) > 0:
		fmt.Fprintf(w, "INCOMPLETE: %s (no invariant was violated by what did run)\n", strings.Join(r.Incomplete, "; "))
	default:
		fmt.Fprintln(w, "PASS: every invariant held")
	}
	for _, inv := range r.Invariants {
		if inv.Result == resultGap {
			fmt.Fprintf(w, "GAP (not failing the run because of -strict-events=false): %s: %s\n", inv.Name, inv.Observed)
		}
	}
}

// bytesLegend names the three byte measures of the report, one name each.
const bytesLegend = `bytes: bytes_total = what the workers charged their jobs (jobs.bytes_total: each attempt's own count on its connections to the proxy, refusals and robots.txt apart), the measure of the <= 1.25x goal; ` +
	`proxy↔shop = what the proxy relayed to and from the shop, both ways, all traffic (FakeProxy.Bytes); ` +
	`worker↔proxy = what the proxy exchanged with the workers, both ways, all traffic, proxy headers and the proxy's refusals included: what a provider bills (FakeProxy.ClientBytes), the measure of the resume goals`

// hasBytes reports whether the report has a row of bytes per job.
func (r *Report) hasBytes() bool {
	for _, inv := range r.Invariants {
		if inv.Name == InfoBytes || inv.Name == InfoBytesChaos || inv.Name == InfoBytesWire {
			return true
		}
	}
	return false
}

func passIf(ok bool) string {
	if ok {
		return resultPass
	}
	return resultFail
}

// keys runs a query returning one text column and returns up to maxOffenders values and
// the total count.
func (h *harness) keys(ctx context.Context, query string, args ...any) ([]string, int, error) {
	rows, err := h.pool.Query(ctx, query, args...)
	if err != nil {
		return nil, 0, err
	}
	defer rows.Close()
	var out []string
	n := 0
	for rows.Next() {
		var k string
		if err := rows.Scan(&k); err != nil {
			return nil, 0, err
		}
		if n < maxOffenders {
			out = append(out, k)
		}
		n++
	}
	return out, n, rows.Err()
}

// check builds the report from PostgreSQL, Redis, the stream, the consumer's side-effect
// table, the logs and the scraped metrics.
func (h *harness) check(ctx context.Context) (*Report, error) {
	k := &checker{h: h, rep: &Report{Wall: h.wall, Database: h.dbName, Logs: h.logs}, c: h.cfg}
	k.checkSnapshot = h.snapshot()
	k.faults(ctx)
	k.lostJobs(ctx)
	k.duplicateResults(ctx)
	k.duplicateEffects(ctx)
	k.effectsTaken(ctx)
	k.reexecutions(ctx)
	k.staleCommits(ctx)
	k.fences(ctx)
	k.attemptRows(ctx)
	k.twoSessions(ctx)
	k.budget(ctx)
	k.bytesPerJob(ctx)
	k.canary(ctx)
	k.checkQueriesRead()
	return k.rep, nil
}

// checkSnapshot is what the run counted of its faults, copied under the harness's lock.
type checkSnapshot struct {
	fp                     map[string]int
	fpKeys                 map[string][]string
	randomKills, execKills int
	pauses, pausesHeld     int
	pausedAtt              []pausedAttempt
	stale                  []staleCommit
	extraJobs              int
	wipes                  int
	lastWipe               time.Time
	pgRounds, pgTerminated int
	throttled, restarts    int
	keys                   []string // the chaos window's enqueued keys
	pending                map[string]int
	timedOut               bool
}

// snapshot is check's first step: it copies the run's fault counters under h.mu.
func (h *harness) snapshot() checkSnapshot {
	h.mu.Lock()
	defer h.mu.Unlock()
	s := checkSnapshot{fp: map[string]int{}, fpKeys: map[string][]string{}}
	for k, v := range h.fpKills {
		s.fp[k] = v
	}
	for k, v := range h.fpKeys {
		s.fpKeys[k] = append([]string(nil), v...)
	}
	s.randomKills, s.execKills = h.randomKills, h.execKills
	s.pauses, s.pausesHeld = h.pauses, h.pausesHeld
	s.pausedAtt = append([]pausedAttempt(nil), h.pausedAtt...)
	for _, sc := range h.stale {
		s.stale = append(s.stale, *sc)
	}
	s.extraJobs = h.extraJobs
	s.wipes, s.lastWipe = h.redisWipes, h.lastWipe
	s.pgRounds, s.pgTerminated, s.throttled, s.restarts = h.pgRounds, h.pgTerminated, h.throttled, h.restarts
	s.keys = h.enqueued[windowChaos]
	s.pending = map[string]int{}
	for k, v := range h.pendingArms {
		s.pending[k] = v
	}
	s.timedOut = h.timedOut
	return s
}

// checker builds one Report: each of its methods below adds the rows of one group.
type checker struct {
	h   *harness
	rep *Report
	c   Config
	checkSnapshot
	quarantined int                // staging quarantined in the chaos window (the fault table reads it)
	queryErrs   map[string][]error // counts that could not be read, by the row they feed (scan)
}

// add appends an invariant row. A row one of whose counts could not be read (scan) fails,
// and says which: a count left at zero must never pass an invariant.
func (k *checker) add(r Row) {
	for _, err := range k.queryErrs[r.Name] {
		r.Result = resultFail
		r.Observed += "; a count failed: " + err.Error()
	}
	delete(k.queryErrs, r.Name)
	k.rep.Invariants = append(k.rep.Invariants, r)
}

// rowFaultCounts is the row that fails the run when a count of the fault table could not
// be read.
const rowFaultCounts = "the fault table's counts"

// scan reads one row of counts for the rows named (invariants, or rowFaultCounts). A query
// that fails is kept against those rows, and add fails them; counts no row claims fail the
// run in checkQueriesRead.
func (k *checker) scan(ctx context.Context, query string, args, dest []any, rows ...string) {
	if err := k.h.pool.QueryRow(ctx, query, args...).Scan(dest...); err != nil {
		if k.queryErrs == nil {
			k.queryErrs = map[string][]error{}
		}
		for _, row := range rows {
			k.queryErrs[row] = append(k.queryErrs[row], err)
		}
	}
}

// checkQueriesRead is check's last step: counts whose query failed and whose row was not
// added (the fault table's, or a row its step skipped) fail the run too.
func (k *checker) checkQueriesRead() {
	names := make([]string, 0, len(k.queryErrs))
	for name := range k.queryErrs {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		k.add(Row{Name: name, Observed: "its counts could not be read"})
	}
}

// fail appends the row of an invariant whose check could not run.
func (k *checker) fail(name string, err error) {
	k.add(Row{Name: name, Observed: "check failed: " + err.Error(), Result: resultFail})
}

// incomplete notes a reason why the run did not show everything it set out to.
func (k *checker) incomplete(why string) { k.rep.Incomplete = append(k.rep.Incomplete, why) }

// onOff is how the fault table shows a switch.
func onOff(b bool) string {
	if b {
		return "on"
	}
	return "off"
}

// faults is the step that fills the fault table: what was injected and what was seen.
func (k *checker) faults(ctx context.Context) {
	h, c, fp, pending := k.h, k.c, k.fp, k.pending
	var disconnects int64 = h.proxy.Disconnects()
	var unavailable, throttledAttempts int
	k.scan(ctx, `SELECT count(*) FROM quarantine q JOIN jobs j ON j.key = q.job_key WHERE j."window" = $1`, []any{windowChaos}, []any{&k.quarantined}, rowFaultCounts, InvTwoSessions)
	k.scan(ctx, `SELECT count(*) FROM attempts a JOIN jobs j ON j.key = a.job_key WHERE j."window" = $1 AND a.category = 'throttled'`, []any{windowChaos}, []any{&throttledAttempts}, rowFaultCounts)
	k.scan(ctx, `SELECT count(*) FROM jobs WHERE "window" = $1 AND country = $2`, []any{windowChaos, unavailableCC}, []any{&unavailable}, rowFaultCounts)
	k.rep.Faults = []Row{
		{Name: "jobs / workers × concurrency", Injected: fmt.Sprintf("%d / %d × %d", c.Jobs, c.Workers, c.Concurrency), Observed: fmt.Sprintf("%d worker restarts", k.restarts)},
		{Name: "random SIGKILLs", Injected: fmt.Sprint(c.RandomKills), Observed: fmt.Sprintf("%d sent, %d while attempts ran", k.randomKills, k.execKills)},
		{Name: "failpoint after_fetch (SIGKILL)", Injected: fmt.Sprint(c.AfterFetch), Observed: fmt.Sprintf("%d fired (%d not armed in time) %s", fp[fpAfterFetch], pending[fpAfterFetch], strings.Join(k.fpKeys[fpAfterFetch], " "))},
		{Name: "failpoint after_commit (SIGKILL)", Injected: fmt.Sprint(c.AfterCommit), Observed: fmt.Sprintf("%d fired (%d not armed in time) %s", fp[fpAfterCommit], pending[fpAfterCommit], strings.Join(k.fpKeys[fpAfterCommit], " "))},
		{Name: "failpoint after_xadd (dispatcher SIGKILL)", Injected: fmt.Sprint(c.AfterXadd), Observed: fmt.Sprintf("%d fired (%d not armed in time)", fp[fpAfterXadd], pending[fpAfterXadd])},
		{Name: "failpoint before_commit (SIGSTOP until taken over)", Injected: fmt.Sprint(c.BeforeCommit), Observed: staleObserved(k.stale, pending[fpBeforeCommit])},
		{Name: fmt.Sprintf("SIGSTOP pauses of %v (lease %v)", c.Lease*5/2, c.Lease), Injected: fmt.Sprint(c.Pauses), Observed: fmt.Sprintf("%d done, %d held running attempts", k.pauses, k.pausesHeld)},
		{Name: "redis-server killed, restarted empty", Injected: fmt.Sprint(c.RedisWipes), Observed: fmt.Sprint(k.wipes)},
		{Name: "pg_terminate_backend rounds (workers)", Injected: fmt.Sprint(c.PGRounds), Observed: fmt.Sprintf("%d rounds, %d connections terminated", k.pgRounds, k.pgTerminated)},
		{Name: fmt.Sprintf("proxy: %.4g%% disconnects per request, %.4g%% of them exit-alive", 100*c.DisconnectProb, 100*c.CutExitAlive), Injected: onOff(c.ProxyFaults),
			Observed: fmt.Sprintf("%d disconnects (%d exit-alive), %d staging quarantined", disconnects, h.proxy.CutsExitAlive(), k.quarantined)},
		{Name: "shop: ~5% 429 Retry-After 1s", Injected: onOff(c.ProxyFaults), Observed: fmt.Sprintf("%d throttled answers set, %d throttled attempts", k.throttled, throttledAttempts)},
		{Name: "proxy: 2% jobs in a country without exits", Injected: onOff(c.ProxyFaults), Observed: fmt.Sprintf("%d jobs ask for %s", unavailable, unavailableCC)},
		{Name: "canary proxy password", Injected: onOff(c.Canary), Observed: "not searched"},
	}
	if c.Canary {
		k.rep.Faults[len(k.rep.Faults)-1].Observed = "searched in logs, pg_dump, Redis, stream, /metrics"
	}
	if c.Challenge {
		// The workers' session pools carry each exit's clearance cookie between units:
		// attempts that ended on a warm session (attempts.session_units > 0) met no
		// challenge unless their exit changed. Lost attempts (their worker never reported,
		// so session_units 0) are counted apart.
		var attempts, warm, lost int
		k.scan(ctx, `SELECT count(*) FILTER (WHERE a.outcome <> 'lost'), count(*) FILTER (WHERE a.session_units > 0), count(*) FILTER (WHERE a.outcome = 'lost')
			FROM attempts a JOIN jobs j ON j.key = a.job_key WHERE j."window" = $1`,
			[]any{windowChaos}, []any{&attempts, &warm, &lost}, rowFaultCounts)
		k.rep.Faults = append(k.rep.Faults, Row{Name: "shop: bot challenge (clearance per exit)", Injected: "on",
			Observed: fmt.Sprintf("%d challenge pages served (whole run); %d of %d chaos-window attempts ended on a warm session (%d lost attempts apart)",
				h.site.Challenges(), warm, attempts, lost)})
	}

	if k.extraJobs > 0 {
		k.rep.Faults[0].Observed += fmt.Sprintf("; %d extra jobs so that every targeted failpoint fired", k.extraJobs)
	}
	for _, name := range []string{fpAfterFetch, fpAfterCommit, fpAfterXadd, fpBeforeCommit} {
		if pending[name] > 0 {
			k.incomplete(fmt.Sprintf("failpoint %s: %d of its injections never fired (no worker reached it before the jobs ran out)", name, pending[name]))
		}
	}
	if c.BuildTags != "" {
		k.rep.Faults = append(k.rep.Faults, Row{Name: "BROKEN BUILD (build tags)", Injected: c.BuildTags, Observed: "workers built without the guards named"})
	}
	if c.Break != "" {
		k.rep.Faults = append(k.rep.Faults, Row{Name: "BROKEN BUILD (worker failpoint)", Injected: c.Break, Observed: fmt.Sprintf("%d fired", fp[strings.SplitN(c.Break, ":", 2)[0]])})
	}
}

// lostJobs checks that no job was lost: every enqueued key terminal (failed with a
// category). A job still open when the run reached its timeout is not shown lost: the run
// is INCOMPLETE.
func (k *checker) lostJobs(ctx context.Context) {
	h := k.h
	off, n, err := h.keys(ctx, `
SELECT k FROM unnest($1::text[]) AS k LEFT JOIN jobs j ON j.key = k
WHERE j.key IS NULL OR (j.state = 'failed' AND COALESCE(j.last_category, '') = '')
	OR (NOT $2 AND j.state NOT IN ('complete', 'failed'))
ORDER BY k`, k.keys, k.timedOut)
	if err != nil {
		k.fail(InvLost, err)
		return
	}
	var complete, failed int
	var cats, open string
	var nOpen int
	k.scan(ctx, `SELECT count(*) FILTER (WHERE state = 'complete'), count(*) FILTER (WHERE state = 'failed'),
	COALESCE(string_agg(DISTINCT last_category, ',') FILTER (WHERE state = 'failed'), ''),
	count(*) FILTER (WHERE state NOT IN ('complete', 'failed'))
FROM jobs WHERE "window" = $1`, []any{windowChaos}, []any{&complete, &failed, &cats, &nOpen}, InvLost)
	k.scan(ctx, `SELECT COALESCE(string_agg(state || ' ' || n, ', ' ORDER BY state), '') FROM (
	SELECT state, count(*) AS n FROM jobs WHERE "window" = $1 AND state NOT IN ('complete', 'failed') GROUP BY state) t`, []any{windowChaos}, []any{&open}, InvLost)
	obs := fmt.Sprintf("%d enqueued: %d complete, %d failed [%s], %d lost", len(k.keys), complete, failed, cats, n)
	res := passIf(n == 0)
	if k.timedOut {
		if nOpen > 0 {
			obs += fmt.Sprintf("; %d still open at the timeout (%s)", nOpen, open)
			k.incomplete(fmt.Sprintf("%d jobs still open (%s) when the run reached its %v timeout%s", nOpen, open, k.c.Timeout, loadAvg()))
			if n == 0 {
				res = resultIncomplete
			}
		}
	}
	k.add(Row{Name: InvLost, Observed: obs, Result: res, Offenders: off})
}

// duplicateResults checks for duplicate results: exactly one result per complete job,
// none for others.
func (k *checker) duplicateResults(ctx context.Context) {
	h := k.h
	off, n, err := h.keys(ctx, `
SELECT j.key FROM jobs j LEFT JOIN results r ON r.job_key = j.key
WHERE j."window" = $1
GROUP BY j.key, j.state
HAVING count(r.job_key) <> CASE WHEN j.state = 'complete' THEN 1 ELSE 0 END
ORDER BY j.key`, windowChaos)
	if err != nil {
		k.fail(InvDupResults, err)
		return
	}
	var results, rejected int
	k.scan(ctx, `SELECT count(*) FROM results r JOIN jobs j ON j.key = r.job_key WHERE j."window" = $1`, []any{windowChaos}, []any{&results}, InvDupResults)
	k.scan(ctx, `SELECT COALESCE((SELECT n FROM maintenance_counters WHERE name = 'duplicate_results'), 0)`, []any{}, []any{&rejected}, InvDupResults)
	k.add(Row{Name: InvDupResults, Observed: fmt.Sprintf("%d results, %d jobs off by count, %d duplicate writes rejected; after_commit kills %d", results, n, rejected, k.fp[fpAfterCommit]),
		Result: passIf(n == 0), Offenders: off})
}

// duplicateEffects checks for duplicate side effects, and that the inbox recognised the
// replays the after_xadd kills cause.
func (k *checker) duplicateEffects(ctx context.Context) {
	h := k.h
	off, n, err := h.keys(ctx, `SELECT event_key FROM chaos_side_effects GROUP BY event_key HAVING count(*) > 1 ORDER BY event_key`)
	if err != nil {
		k.fail(InvDupEffects, err)
		return
	}
	var effects, replays int
	k.scan(ctx, `SELECT count(*) FROM chaos_side_effects s JOIN jobs j ON j.key = s.job_key WHERE j."window" = $1`, []any{windowChaos}, []any{&effects}, InvDupEffects)
	k.scan(ctx, `SELECT COALESCE(sum(replays), 0) FROM outbox_inbox WHERE consumer_group = $1`, []any{consumerGroup}, []any{&replays}, InvDupEffects, InvXaddReplays)
	k.add(Row{Name: InvDupEffects, Observed: fmt.Sprintf("%d side effects, %d events duplicated, %d replays recognised by the inbox", effects, n, replays),
		Result: passIf(n == 0), Offenders: off})
	// A replay the inbox recognised is the proof that a dispatcher crash between XADD
	// and moving its position republished; wiped Redis data may have taken copies with it.
	want := k.fp[fpAfterXadd]
	ok := replays >= want || k.wipes > 0 && replays > 0 || want == 0
	k.add(Row{Name: InvXaddReplays, Observed: fmt.Sprintf("%d replays, %d after_xadd kills (%d Redis wipes)", replays, want, k.wipes), Result: passIf(ok)})
}

// missingEffects selects the complete jobs of window $1 whose event never took effect.
const missingEffects = `
SELECT j.key FROM jobs j JOIN outbox o ON o.event_key = 'observed:' || j.key
LEFT JOIN chaos_side_effects s ON s.event_key = o.event_key
WHERE j."window" = $1 AND j.state = 'complete' AND s.id IS NULL`

// effectsTaken checks for events of complete jobs that never took effect. Those sent to
// the stream before a Redis wipe and not consumed by then went with Redis's data: the
// dispatchers must find the loss and publish them again (their topic's outbox position
// moves back over the rows created within the recover window); the events created before
// the wipe (there is no per-row sent time since migration 00020) without an effect are on a
// row of their own (FAIL, or GAP with -strict-events=false).
func (k *checker) effectsTaken(ctx context.Context) {
	h := k.h
	off, n, err := h.keys(ctx, missingEffects+` AND NOT ($2::timestamptz IS NOT NULL AND o.created_at <= $2) ORDER BY j.key`, windowChaos, nullTime(k.lastWipe))
	if err != nil {
		k.fail(InvEffectsLost, err)
	} else {
		var noEvent int
		k.scan(ctx, `SELECT count(*) FROM jobs j LEFT JOIN outbox o ON o.event_key = 'observed:' || j.key
WHERE j."window" = $1 AND j.state = 'complete' AND o.id IS NULL`, []any{windowChaos}, []any{&noEvent}, InvEffectsLost)
		k.add(Row{Name: InvEffectsLost, Observed: fmt.Sprintf("%d missing (not counting the row below), %d without an outbox row", n, noEvent),
			Result: passIf(n == 0 && noEvent == 0), Offenders: off})
	}
	if !k.lastWipe.IsZero() {
		k.effectsWiped(ctx)
	}
}

// effectsWiped checks the events that were in the stream at the last Redis wipe.
func (k *checker) effectsWiped(ctx context.Context) {
	off, n, err := k.h.keys(ctx, missingEffects+` AND o.created_at <= $2 ORDER BY j.key`, windowChaos, k.lastWipe)
	if err != nil {
		k.fail(InvEffectsWiped, err)
		return
	}
	recoveries, remarked := k.h.recoveriesFromLogs()
	// Every dispatch after a wipe finds the epoch marker gone, so a wipe the
	// dispatchers never noticed means the detection (or the log it is read
	// from) is broken, even if no event happened to be in the stream.
	res := passIf(n == 0 && recoveries > 0)
	if n > 0 && !k.c.StrictEvents {
		res = resultGap
	}
	k.add(Row{Name: InvEffectsWiped, Observed: fmt.Sprintf("dispatchers found the loss %d times and moved positions back over %d rows to publish them again; %d events created before the wipe never took effect", recoveries, remarked, n),
		Result: res, Offenders: off})
}

// reexecutions checks that the killed attempts ran again.
func (k *checker) reexecutions(ctx context.Context) {
	h := k.h
	var reexec int
	err := h.pool.QueryRow(ctx, `SELECT COALESCE(sum(n - 1), 0) FROM (SELECT count(*) AS n FROM attempts a JOIN jobs j ON j.key = a.job_key WHERE j."window" = $1 GROUP BY a.job_key) t`, windowChaos).Scan(&reexec)
	if err != nil {
		k.fail(InvReexec, err)
		return
	}
	kills := k.execKills + k.fp[fpAfterFetch]
	// Every job an after_fetch kill hit must have run again.
	off, n, err := h.keys(ctx, `SELECT k FROM unnest($1::text[]) AS k WHERE (SELECT count(*) FROM attempts WHERE job_key = k) < 2`, k.fpKeys[fpAfterFetch])
	if err != nil {
		k.fail(InvReexec, err)
		return
	}
	k.add(Row{Name: InvReexec, Observed: fmt.Sprintf("%d re-executions (attempts beyond the first), %d kills during attempts; %d after_fetch victims not re-run", reexec, kills, n),
		Result: passIf(reexec >= kills && n == 0), Offenders: off})
}

// staleCommits checks that no stale commit was accepted: the result's fence is the job's
// highest, its attempt is the only complete one.
func (k *checker) staleCommits(ctx context.Context) {
	h := k.h
	off, n, err := h.keys(ctx, `
SELECT r.job_key FROM results r JOIN jobs j ON j.key = r.job_key
WHERE j."window" = $1 AND (
	r.fence <> (SELECT max(fence) FROM attempts a WHERE a.job_key = r.job_key)
	OR r.fence <> j.fence
	OR NOT EXISTS (SELECT 1 FROM attempts a WHERE a.job_key = r.job_key AND a.fence = r.fence AND a.outcome = 'complete')
	OR (SELECT count(*) FROM attempts a WHERE a.job_key = r.job_key AND a.outcome = 'complete') > 1)
ORDER BY r.job_key`, windowChaos)
	if err != nil {
		k.fail(InvStale, err)
		return
	}
	var superseded, leaseLost int
	k.scan(ctx, `SELECT count(*) FILTER (WHERE a.outcome IN ('superseded', 'lost') AND a.category = 'superseded'), count(*) FILTER (WHERE a.category IN ('lease_lost', 'lease_expired'))
FROM attempts a JOIN jobs j ON j.key = a.job_key WHERE j."window" = $1`, []any{windowChaos}, []any{&superseded, &leaseLost}, InvStale)
	// What became of the attempts that were running when their worker was paused
	// for 2.5 leases: refused (superseded, lease lost, rescued) unless nobody had
	// taken the job over by the time they committed.
	var pk []string
	var pn []int
	for _, a := range k.pausedAtt {
		pk, pn = append(pk, a.Key), append(pn, a.AttemptNo)
	}
	var pRefused, pComplete, pNewer int
	var how string
	k.scan(ctx, `
SELECT count(*) FILTER (WHERE a.outcome <> 'complete'), count(*) FILTER (WHERE a.outcome = 'complete'),
	count(*) FILTER (WHERE a.outcome = 'complete' AND EXISTS (SELECT 1 FROM attempts b WHERE b.job_key = a.job_key AND b.fence > a.fence)),
	COALESCE(string_agg(DISTINCT a.outcome || '/' || COALESCE(a.category, '-'), ',') FILTER (WHERE a.outcome <> 'complete'), '')
FROM unnest($1::text[], $2::int[]) AS p(k, n) JOIN attempts a ON a.job_key = p.k AND a.attempt_no = p.n`, []any{pk, pn}, []any{&pRefused, &pComplete, &pNewer, &how}, InvStale)
	// A result under a fence below its job's is the mark of a stale commit accepted while
	// another attempt held the job (a commit that checks the job's state but not its fence).
	var below int
	var belowEg string
	k.scan(ctx, `SELECT count(*), COALESCE(min(r.job_key || ' (result fence ' || r.fence || ', job fence ' || j.fence || ')'), '')
FROM results r JOIN jobs j ON j.key = r.job_key WHERE j."window" = $1 AND r.fence < j.fence`, []any{windowChaos}, []any{&below, &belowEg}, InvStale)
	sAcc, sRef, sNone, sOff, serr := h.staleVerdicts(ctx, k.stale)
	if serr != nil {
		k.fail(InvStale, serr)
		return
	}
	obs := fmt.Sprintf("%d accepted; stale commits sent after a takeover: %d accepted; %d results with result fence < job fence%s; paused attempts: %d held, %d ended without committing [%s], %d committed (%d with a newer fence); all: %d superseded, %d lease lost/expired",
		n+pNewer+sAcc, sAcc, below, eg(belowEg), len(k.pausedAtt), pRefused, how, pComplete, pNewer, superseded, leaseLost)
	k.add(Row{Name: InvStale, Observed: obs, Result: passIf(n == 0 && pNewer == 0 && sAcc == 0 && below == 0), Offenders: union(off, sOff)})
	// PostgreSQL's fence is the last line of defence: every commit that reached
	// it after its job was taken over must have been refused. Only a refusal counts as one:
	// a commit that ended in error got no verdict (another was armed in its place).
	stale := sRef + sAcc
	var wanted, met, cutRunning int
	for _, sc := range k.stale {
		switch {
		case sc.WhileRunning && sc.Outcome != "" && !hasVerdict(sc.Outcome):
			cutRunning++
		case sc.WhileRunning:
			wanted++
		}
		if sc.MetRunning {
			met++
		}
	}
	robs := fmt.Sprintf("%d refused of k = %d stale commits that reached a verdict after a takeover (%d stopped before committing; %d of %d meant to be sent while another attempt held the job running were)",
		sRef, stale, len(k.stale), met, wanted)
	if sNone > 0 || cutRunning > 0 {
		robs += fmt.Sprintf("; %d ended in error, no verdict, not counted (%d of them meant to be sent while another attempt held the job running): %s",
			sNone, cutRunning, rearmedObserved(k.stale))
	}
	row := Row{Name: InvStaleRefused, Observed: robs, Result: passIf(sRef >= stale), Offenders: sOff}
	switch {
	case k.c.BeforeCommit > 0 && stale == 0:
		row.Result = resultIncomplete
		row.Observed += "; none reached a verdict"
		k.incomplete(fmt.Sprintf("no stale commit reached a verdict in PostgreSQL after a takeover (%d wanted)", k.c.BeforeCommit))
	case (wanted > 0 || cutRunning > 0) && met == 0:
		// Only the fence predicate refuses a commit that meets a running job: a run that
		// never sent one so could not tell a build that lost it.
		if row.Result == resultPass {
			row.Result = resultIncomplete
		}
		row.Observed += "; none reached a verdict while another attempt held the job running"
		k.incomplete("no stale commit reached a verdict in PostgreSQL while another attempt held its job running (the case only the commit's fence predicate refuses)")
	}
	k.add(row)
}

// fences checks that fences strictly increase per job.
func (k *checker) fences(ctx context.Context) {
	h := k.h
	off, n, err := h.keys(ctx, `
SELECT DISTINCT job_key FROM (
	SELECT a.job_key, a.fence, lag(a.fence) OVER (PARTITION BY a.job_key ORDER BY a.attempt_no) AS prev
	FROM attempts a JOIN jobs j ON j.key = a.job_key WHERE j."window" = $1) t
WHERE prev IS NOT NULL AND fence <= prev ORDER BY job_key`, windowChaos)
	if err != nil {
		k.fail(InvFences, err)
		return
	}
	var attempts int
	k.scan(ctx, `SELECT count(*) FROM attempts a JOIN jobs j ON j.key = a.job_key WHERE j."window" = $1`, []any{windowChaos}, []any{&attempts}, InvFences)
	k.add(Row{Name: InvFences, Observed: fmt.Sprintf("%d attempts, %d jobs with a fence that did not increase (%d Redis wipes)", attempts, n, k.wipes),
		Result: passIf(n == 0), Offenders: off})
}

// attemptRows checks one attempt row per start: an attempt's row is written when it ends,
// or as 'lost' by whoever raised the fence past it (the next start, a rescue), so a killed
// or stopped worker's attempt has one too (idemscrape audit's
// terminal_job_has_one_attempt_row_per_start).
func (k *checker) attemptRows(ctx context.Context) {
	h := k.h
	off, n, err := h.keys(ctx, `
SELECT j.key FROM jobs j
WHERE j."window" = $1 AND j.state IN ('complete', 'failed') AND NOT (
	SELECT count(*) = j.attempts AND count(DISTINCT a.attempt_no) = j.attempts
		AND COALESCE(min(a.attempt_no), 1) = 1 AND COALESCE(max(a.attempt_no), 0) = j.attempts
		AND NOT bool_or(a.outcome = 'running') IS TRUE
	FROM attempts a WHERE a.job_key = j.key)
ORDER BY j.key`, windowChaos)
	if err != nil {
		k.fail(InvAttemptRows, err)
		return
	}
	var lost, superseded int
	k.scan(ctx, `SELECT count(*) FILTER (WHERE a.outcome = 'lost'), count(*) FILTER (WHERE a.outcome = 'superseded')
FROM attempts a JOIN jobs j ON j.key = a.job_key WHERE j."window" = $1`, []any{windowChaos}, []any{&lost, &superseded}, InvAttemptRows)
	k.add(Row{Name: InvAttemptRows, Observed: fmt.Sprintf("%d ended jobs without exactly one row per start; %d rows written as lost by a successor, %d of them reported later as superseded by their worker", n, lost+superseded, superseded),
		Result: passIf(n == 0), Offenders: off})
}

// twoSessions checks that no result came from two sessions: the shop binds its cookie and
// price token to the exit that created them (StrictExit), so a record is right only if
// one session fetched all of it; every result must equal the shop's truth and come from an
// attempt with one session id.
func (k *checker) twoSessions(ctx context.Context) {
	h := k.h
	rows, err := h.pool.Query(ctx, `
SELECT r.job_key, j.source_id, r.data, COALESCE(a.session_id, '') FROM results r JOIN jobs j ON j.key = r.job_key
LEFT JOIN attempts a ON a.job_key = r.job_key AND a.fence = r.fence
WHERE j."window" = $1 ORDER BY r.job_key`, windowChaos)
	if err != nil {
		k.fail(InvTwoSessions, err)
		return
	}
	var off []string
	total, bad := 0, 0
	for rows.Next() {
		var key, sku, sess string
		var data []byte
		if err := rows.Scan(&key, &sku, &data, &sess); err != nil {
			rows.Close()
			k.fail(InvTwoSessions, err)
			return
		}
		total++
		var rec struct{ SKU, Name, Price, Currency string }
		_ = json.Unmarshal(data, &rec) // an unreadable record stays empty: a wrong one
		p, ok := h.site.Product(sku)
		if !ok || rec.Name != p.Name || rec.Price != p.Price || rec.Currency != p.Currency || sess == "" || strings.Contains(sess, ",") {
			bad++
			if len(off) < maxOffenders {
				off = append(off, key)
			}
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		// A read cut short must not pass on the rows it saw.
		k.fail(InvTwoSessions, err)
		return
	}
	k.add(Row{Name: InvTwoSessions, Observed: fmt.Sprintf("%d of %d results equal the shop's record, one session each; %d staging quarantined after session loss", total-bad, total, k.quarantined),
		Result: passIf(bad == 0), Offenders: off})
}

// budget checks that no job went over its bandwidth budget, and shows the bytes the
// budget does not see.
func (k *checker) budget(ctx context.Context) {
	h := k.h
	off, n, err := h.keys(ctx, `SELECT key FROM jobs WHERE "window" = $1 AND bytes_total - budget_bytes > $2 ORDER BY key`, windowChaos, int64(handlers.DefaultBandwidthBudget))
	if err != nil {
		k.fail(InvBudget, err)
		return
	}
	var maxBytes, jobBytes, attBytes int64
	k.scan(ctx, `SELECT COALESCE(max(bytes_total), 0), COALESCE(sum(bytes_total), 0) FROM jobs WHERE "window" = $1`, []any{windowChaos}, []any{&maxBytes, &jobBytes}, InvBudget)
	k.scan(ctx, `SELECT COALESCE(sum(a.bytes), 0) FROM attempts a JOIN jobs j ON j.key = a.job_key WHERE j."window" = $1`, []any{windowChaos}, []any{&attBytes}, InvBudget)
	k.add(Row{Name: InvBudget, Observed: fmt.Sprintf("max %d B of %d B; jobs.bytes_total %d B, attempts %d B, proxy↔shop %d B", maxBytes, int64(handlers.DefaultBandwidthBudget), jobBytes, attBytes, h.chaosProxy),
		Result: passIf(n == 0), Offenders: off})
}

// bytesPerJob adds the bytes per completed job against the fault-free baseline: in the
// fault-mix phase (the baseline's SKUs with the proxy fault mix alone, compared job by
// job: the figure), and in the chaos phase (every fault; killed attempts never
// report their bytes, so there jobs.bytes_total undercounts what the proxy carried).
func (k *checker) bytesPerJob(ctx context.Context) {
	h := k.h
	if h.baselineJobs <= 0 {
		return
	}
	baseP := float64(h.baseProxy) / float64(h.baselineJobs)
	if h.mixJobs > 0 {
		k.faultMixBytes(ctx, baseP)
		k.wireBytes(ctx)
	}
	var complete int
	var bytes int64
	k.scan(ctx, `SELECT count(*), COALESCE(sum(bytes_total), 0) FROM jobs WHERE "window" = $1 AND state = 'complete'`, []any{windowChaos}, []any{&complete, &bytes}, InfoBytesChaos)
	if complete > 0 {
		base := float64(h.baseBytes) / float64(h.baselineJobs)
		got := float64(bytes) / float64(complete)
		gotP := float64(h.chaosProxy) / float64(complete)
		k.add(Row{Name: InfoBytesChaos, Observed: fmt.Sprintf("bytes_total %.0f vs %.0f B/job = %.2fx; proxy↔shop %.0f vs %.0f B/job = %.2fx (kills, pauses, wipe and dropped connections on top of the fault mix)",
			got, base, got/base, gotP, baseP, gotP/baseP), Result: resultInfo})
	}
}

// faultMixBytes adds the fault-mix phase's bytes per job against the baseline's, job by
// job (baseP: the baseline's proxy bytes per job).
func (k *checker) faultMixBytes(ctx context.Context, baseP float64) {
	h := k.h
	var pairs int
	var mixBytes, baseBytes, mixAll int64
	var mixComplete int
	k.scan(ctx, `
SELECT count(*), COALESCE(sum(m.bytes_total), 0), COALESCE(sum(b.bytes_total), 0) FROM jobs m
JOIN jobs b ON b.source_id = m.source_id AND b."window" = $2 AND b.state = 'complete'
WHERE m."window" = $1 AND m.state = 'complete'`, []any{windowFaultMix, windowBaseline}, []any{&pairs, &mixBytes, &baseBytes}, InfoBytes)
	k.scan(ctx, `SELECT count(*) FILTER (WHERE state = 'complete'), COALESCE(sum(bytes_total), 0) FROM jobs WHERE "window" = $1`, []any{windowFaultMix}, []any{&mixComplete, &mixAll}, InfoBytes)
	if pairs > 0 && baseBytes > 0 && mixComplete > 0 {
		r := float64(mixBytes) / float64(baseBytes)
		gotP := float64(h.mixProxy) / float64(mixComplete)
		verdict := "goal met"
		if r > bytesRatioTarget {
			verdict = "over the goal"
		}
		k.add(Row{Name: InfoBytes, Observed: fmt.Sprintf("%d jobs complete in both runs: bytes_total %.0f vs %.0f B/job = %.2fx (%s, goal <= %.2fx on bytes_total); proxy↔shop %.0f vs %.0f B/job = %.2fx; %d of %d fault-mix jobs complete, their attempts %d B, proxy↔shop %d B",
			pairs, float64(mixBytes)/float64(pairs), float64(baseBytes)/float64(pairs), r, verdict, bytesRatioTarget, gotP, baseP, gotP/baseP, mixComplete, h.mixJobs, mixAll, h.mixProxy),
			Result: resultInfo})
	}
}

// canary checks, when the run planted one, that the canary password is nowhere.
func (k *checker) canary(ctx context.Context) {
	if !k.c.Canary {
		return
	}
	where, err := k.h.searchCanary(ctx)
	if err != nil {
		k.fail(InvCanary, err)
		return
	}
	k.add(Row{Name: InvCanary, Observed: fmt.Sprintf("found in %d places", len(where)), Result: passIf(len(where) == 0), Offenders: where})
}

// recoveriesFromLogs counts, in the worker logs, the dispatchers' recoveries of a stream
// that Redis lost (store/outbox logs one line per recovery) and the rows they re-marked.
func (h *harness) recoveriesFromLogs() (recoveries int, remarked int64) {
	logs, _ := filepath.Glob(filepath.Join(h.logs, "worker-*.log"))
	for _, f := range logs {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, line := range bytes.Split(b, []byte("\n")) {
			if !bytes.Contains(line, []byte(recoveryLogMsg)) {
				continue
			}
			var rec struct {
				Remarked int64 `json:"remarked"`
			}
			if json.Unmarshal(line, &rec) == nil {
				recoveries++
				remarked += rec.Remarked
			}
		}
	}
	return recoveries, remarked
}

// recoveryLogMsg begins the message store/outbox logs when it recovers a lost stream.
const recoveryLogMsg = outbox.LogStreamLost

func nullTime(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	return &t
}

// searchCanary looks for the proxy password in every log the run wrote, a pg_dump of the
// run's database, every Redis key and value (streams included) and the scraped /metrics.
func (h *harness) searchCanary(ctx context.Context) ([]string, error) {
	needle := []byte(h.password)
	var where []string
	logs, _ := filepath.Glob(filepath.Join(h.logs, "*.log"))
	for _, f := range logs {
		b, err := os.ReadFile(f)
		if err == nil && bytes.Contains(b, needle) {
			where = append(where, "log:"+filepath.Base(f))
		}
	}
	dump, err := exec.CommandContext(ctx, "pg_dump", "--no-owner", "-d", h.dsn).Output()
	if err != nil {
		return nil, fmt.Errorf("pg_dump: %w", err)
	}
	if bytes.Contains(dump, needle) {
		where = append(where, "pg_dump")
	}
	rdb := h.redis.Client()
	iter := rdb.Scan(ctx, 0, "*", 1000).Iterator()
	nkeys := 0
	for iter.Next(ctx) {
		k := iter.Val()
		nkeys++
		if strings.Contains(k, h.password) {
			where = append(where, "redis-key:"+k)
			continue
		}
		if v := redisValue(ctx, rdb, k); strings.Contains(v, h.password) {
			where = append(where, "redis:"+k)
		}
	}
	if err := iter.Err(); err != nil {
		return nil, fmt.Errorf("redis scan: %w", err)
	}
	h.mu.Lock()
	for i, m := range h.metricsText {
		if strings.Contains(m, h.password) {
			where = append(where, fmt.Sprintf("metrics#%d", i))
		}
	}
	nm := len(h.metricsText)
	h.mu.Unlock()
	h.logf("canary search: %d log files, pg_dump %d bytes, %d Redis keys, %d /metrics pages", len(logs), len(dump), nkeys, nm)
	if nkeys == 0 || nm == 0 || len(dump) == 0 {
		return append(where, fmt.Sprintf("search incomplete: %d redis keys, %d metrics pages, %d dump bytes", nkeys, nm, len(dump))), nil
	}
	return where, nil
}

// redisValue renders every field and member of key as text.
func redisValue(ctx context.Context, rdb *redis.Client, key string) string {
	var sb strings.Builder
	switch rdb.Type(ctx, key).Val() {
	case "string":
		sb.WriteString(rdb.Get(ctx, key).Val())
	case "hash":
		for k, v := range rdb.HGetAll(ctx, key).Val() {
			sb.WriteString(k + "=" + v + "\n")
		}
	case "list":
		sb.WriteString(strings.Join(rdb.LRange(ctx, key, 0, -1).Val(), "\n"))
	case "set":
		sb.WriteString(strings.Join(rdb.SMembers(ctx, key).Val(), "\n"))
	case "zset":
		sb.WriteString(strings.Join(rdb.ZRange(ctx, key, 0, -1).Val(), "\n"))
	case "stream":
		for _, m := range rdb.XRange(ctx, key, "-", "+").Val() {
			for k, v := range m.Values {
				fmt.Fprintf(&sb, "%s=%v\n", k, v)
			}
		}
	}
	return sb.String()
}

// eg is ", e.g. s", or "" when s is.
func eg(s string) string {
	if s == "" {
		return ""
	}
	return ", e.g. " + s
}

// staleObserved is the before_commit fault row's observation.
func staleObserved(stale []staleCommit, notArmed int) string {
	var took, fin, running, met int
	outcomes := map[string]int{}
	for _, sc := range stale {
		if sc.TookOver {
			took++
		}
		if sc.Finished {
			fin++
		}
		if sc.RunningFence > 0 {
			running++
		}
		if sc.MetRunning {
			met++
		}
		o := sc.Outcome
		if o == "" {
			o = "never sent"
		}
		outcomes[o]++
	}
	var parts []string
	for _, o := range []string{"refused", "accepted", "error", "never sent"} {
		if outcomes[o] > 0 {
			parts = append(parts, fmt.Sprintf("%s %d", o, outcomes[o]))
		}
	}
	for _, sc := range stale {
		if sc.Err != "" { // why, as the worker said: a refusal or an error that was not the fence's
			parts = append(parts, fmt.Sprintf("%s token %d: %s", sc.Key, sc.Token, sc.Err))
		}
	}
	obs := fmt.Sprintf("%d fired (%d not armed in time), %d continued after a takeover (%d while another attempt held the job running, %d of whose commits met it so; %d after another worker finished the job); worker says: %s",
		len(stale), notArmed, took, running, met, fin, strings.Join(parts, ", "))
	var cut, redo int
	for _, sc := range stale {
		if sc.Cut {
			cut++
		}
		if sc.Redo {
			redo++
		}
	}
	if cut > 0 || redo > 0 {
		obs += fmt.Sprintf("; %d cut on their way by the harness (-cut-stale), %d armed in place of one that ended in error", cut, redo)
	}
	return obs
}

// rearmedObserved says, of the stale commits that ended in error, whether another was
// armed in each one's place.
func rearmedObserved(stale []staleCommit) string {
	var armed, not int
	for _, sc := range stale {
		switch {
		case sc.Outcome == "" || hasVerdict(sc.Outcome):
		case sc.Rearmed:
			armed++
		default:
			not++
		}
	}
	if not == 0 {
		return fmt.Sprintf("another armed in the place of each (%d)", armed)
	}
	return fmt.Sprintf("another armed in the place of %d, not of %d (the phase had ended, or the re-arms ran out)", armed, not)
}

// staleVerdicts reads from PostgreSQL what became of the stale commits that were sent
// after their job was taken over: accepted if the attempt of that token completed or a
// result carries that token (whatever the worker said: a commit cut after it committed
// is accepted all the same); refused if not and the worker was refused (store's
// TransitionError: PostgreSQL's fence or state check turned it down). One that ended in
// error and left nothing reached no verdict (noVerdict): its connection was cut on the
// way, it says nothing of the fence, and it is not counted as refused. Offenders are the
// accepted ones' keys.
func (h *harness) staleVerdicts(ctx context.Context, stale []staleCommit) (accepted, refused, noVerdict int, offenders []string, err error) {
	var keys []string
	var tokens []int64
	var refusedSaid []bool
	for _, sc := range stale {
		if sc.TookOver && sc.Outcome != "" {
			keys, tokens, refusedSaid = append(keys, sc.Key), append(tokens, sc.Token), append(refusedSaid, sc.Outcome == "refused")
		}
	}
	if len(keys) == 0 {
		return 0, 0, 0, nil, nil
	}
	rows, err := h.pool.Query(ctx, `
SELECT s.k, s.r, EXISTS (SELECT 1 FROM attempts a WHERE a.job_key = s.k AND a.fence = s.t AND a.outcome = 'complete')
	OR EXISTS (SELECT 1 FROM results r WHERE r.job_key = s.k AND r.fence = s.t)
FROM unnest($1::text[], $2::bigint[], $3::bool[]) AS s(k, t, r) ORDER BY s.k`, keys, tokens, refusedSaid)
	if err != nil {
		return 0, 0, 0, nil, err
	}
	defer rows.Close()
	for rows.Next() {
		var k string
		var said, acc bool
		if err := rows.Scan(&k, &said, &acc); err != nil {
			return 0, 0, 0, nil, err
		}
		switch {
		case acc:
			accepted++
			if len(offenders) < maxOffenders {
				offenders = append(offenders, k)
			}
		case said:
			refused++
		default:
			noVerdict++
		}
	}
	return accepted, refused, noVerdict, offenders, rows.Err()
}

// loadAvg is ", load L" with the box's 1-minute load average, for messages about time
// that ran out ("" where /proc/loadavg can not be read).
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return ""
	}
	return ", load " + f[0]
}

// union is a followed by the values of b that a lacks, at most maxOffenders.
func union(a, b []string) []string {
	out := append([]string(nil), a...)
	for _, v := range b {
		if !slices.Contains(out, v) && len(out) < maxOffenders {
			out = append(out, v)
		}
	}
	return out
}

// wireBytes adds the fault mix's and the replay floor's worker↔proxy bytes (what the proxy
// exchanged with its clients, FakeProxy.ClientBytes) per completed job against the
// baseline's, and the verdict against the goal of the run's cut model.
func (k *checker) wireBytes(ctx context.Context) {
	h := k.h
	if h.baseWire <= 0 || h.baselineJobs <= 0 {
		return
	}
	completeIn := func(window string) int {
		var n int
		k.scan(ctx, `SELECT count(*) FROM jobs WHERE "window" = $1 AND state = 'complete'`, []any{window}, []any{&n}, InfoBytesWire)
		return n
	}
	base := float64(h.baseWire) / float64(h.baselineJobs)
	mixN := completeIn(windowFaultMix)
	if mixN == 0 {
		return
	}
	mix := float64(h.mixWire) / float64(mixN) / base
	obs := fmt.Sprintf("worker↔proxy: fault-free %.0f B/job; fault mix %.0f B/job = %.3fx (%d of %d complete)", base, mix*base, mix, mixN, h.mixJobs)
	floor := 0.0
	if h.floorJobs > 0 {
		if n := completeIn(windowFloor); n > 0 {
			floor = float64(h.floorWire) / float64(n) / base
			obs += fmt.Sprintf("; replay floor (no resumes) %.0f B/job = %.3fx (%d of %d complete); fault mix − floor = %+.1f points",
				floor*base, floor, n, h.floorJobs, 100*(mix-floor))
		}
	}
	switch {
	case k.c.CutExitAlive == 0 && floor > 0:
		obs += fmt.Sprintf(" (every cut loses the exit: goal <= floor + %.0f points, %s)", 100*floorMargin, goal(mix <= floor+floorMargin))
	case k.c.CutExitAlive >= 0.5:
		obs += fmt.Sprintf(" (%.0f%% of cuts exit-alive: goal <= %.2fx, %s)", 100*k.c.CutExitAlive, aliveRatioTarget, goal(mix <= aliveRatioTarget))
	}
	obs += fmt.Sprintf("; fault mix: %s; replay floor: %s", h.resumeCounts(phaseFaultMix), h.resumeCounts(phaseFloor))
	k.add(Row{Name: InfoBytesWire, Observed: obs, Result: resultInfo})
}

// resumeCounts sums, over the /metrics pages scraped at the end of phase (each worker runs
// one phase), the units replayed on another session and the steps run again on their own.
func (h *harness) resumeCounts(phase string) string {
	h.mu.Lock()
	pages := h.phaseMetrics[phase]
	h.mu.Unlock()
	var restarts, resumes float64
	for _, page := range pages {
		for _, line := range strings.Split(page, "\n") {
			name, rest, ok := strings.Cut(line, "{")
			if !ok {
				continue
			}
			_, val, ok := strings.Cut(rest, "} ")
			if !ok {
				continue
			}
			v, err := strconv.ParseFloat(strings.TrimSpace(val), 64)
			if err != nil {
				continue
			}
			switch name {
			case "idemscrape_session_restarts_total":
				restarts += v
			case "idemscrape_session_resumes_total":
				resumes += v
			}
		}
	}
	return fmt.Sprintf("%.0f replays on another session, %.0f steps run again on their own", restarts, resumes)
}

func goal(met bool) string {
	if met {
		return "goal met"
	}
	return "over the goal"
}
