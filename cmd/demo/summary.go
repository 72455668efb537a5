package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// summary is what the run did, read back from PostgreSQL, Redis and the fakes.
type summary struct {
	Elapsed time.Duration
	Stats   store.Stats
	Costs   []store.CostStats // what the proxy traffic cost, per currency

	Total        int64
	AttemptsHist [][2]int64 // (attempts, jobs), by attempts
	BytesMin     int64
	BytesMax     int64
	Categories   []catCount // failed attempts by category, most first

	DuplicateEnqueues int
	DuplicateResults  int64
	Events, Entries   int64
	Inbox, Replays    int64
	Alerts            int64
	CrashedBatch      int64

	// Faults.
	Challenges        int64                // challenge pages the shop served
	BySession         []store.SessionStats // attempts on new and on warm sessions
	Disconnects       int64
	Replayed          int64 // stagings quarantined after a lost session
	ThrottledAttempts int64
	ThrottleResends   int64          // requests waited out and sent again on their session
	ThrottleMinGap    *time.Duration // shortest wait from a throttled attempt to the job's next
	Unavailable       string
	UnavailableJobs   map[string]int64 // by state
	UnavailableTries  int64            // their attempts
	UnavailableCats   []string         // the jobs' last categories
	UnavailableExits  int64            // attempts that failed exit_unavailable

	// The schema change: jobs of the window ticked after it, by state and last category;
	// their quarantined stagings and results.
	SchemaWindow      string
	SchemaJobs        map[string]int64 // "state/category" → jobs
	SchemaQuarantined int64
	SchemaResults     int64

	// The JavaScript phase: its jobs by state, those whose result has the shop's price,
	// their stagings quarantined after a lost session, and bytes per rendered job.
	BrowserNote      string // why the phase was skipped ("" when it ran or was not asked for)
	RenderedJobs     map[string]int64
	RenderedRight    int64
	RenderedReplayed int64
	RenderedBytes    int64

	Invariants   []check
	ShowcaseKeys [][2]string // (label, job key) for the UI
}

type catCount struct {
	Category string
	N        int64
}

// check is one invariant: Bad holds up to three offending keys; Violations their number.
type check struct {
	Name       string
	Violations int64
	Bad        []string
}

func collect(ctx context.Context, pool *pgxpool.Pool, rdb redis.UniversalClient, reg *handlers.Registry, proxy *testutil.FakeProxy,
	n names, o options, streams []string, schemaWindow string) (*summary, error) {
	s := &summary{Unavailable: o.Unavailable, UnavailableJobs: map[string]int64{}, SchemaWindow: schemaWindow}
	if o.UnavailableJobs == 0 {
		s.Unavailable = ""
	}
	var err error
	var gap *float64
	if s.Stats, err = store.New(pool).StatsGet(ctx); err != nil {
		return nil, err
	}
	if s.Costs, err = store.New(pool).StatsCost(ctx); err != nil {
		return nil, err
	}
	err = pool.QueryRow(ctx, `
SELECT count(*), COALESCE(min(bytes_total), 0), COALESCE(max(bytes_total), 0),
	(SELECT count(*) FROM outbox), (SELECT count(*) FROM outbox_inbox WHERE consumer_group = $1),
	(SELECT COALESCE(sum(replays), 0) FROM outbox_inbox WHERE consumer_group = $1),
	(SELECT count(*) FROM price_alerts),
	(SELECT count(*) FROM quarantine WHERE reason LIKE $3 || '%'),
	(SELECT count(*) FROM attempts WHERE category = $2),
	(SELECT EXTRACT(EPOCH FROM min(nx.started_at - a.finished_at))::float8 FROM attempts a
		JOIN attempts nx ON nx.job_key = a.job_key AND nx.attempt_no = a.attempt_no + 1
		WHERE a.category = $2 AND a.finished_at IS NOT NULL)
FROM jobs`, consumerGroup, string(tasks.CategoryThrottled), string(tasks.CategorySessionLost)).Scan(&s.Total, &s.BytesMin, &s.BytesMax, &s.Events, &s.Inbox,
		&s.Replays, &s.Alerts, &s.Replayed, &s.ThrottledAttempts, &gap)
	if err != nil {
		return nil, fmt.Errorf("summary: %w", err)
	}
	if gap != nil {
		d := time.Duration(*gap * float64(time.Second))
		s.ThrottleMinGap = &d
	}
	for _, stream := range streams {
		k, err := streamEntries(ctx, rdb, stream)
		if err != nil {
			return nil, fmt.Errorf("summary: stream length: %w", err)
		}
		s.Entries += k
	}
	if err := scanPairs(ctx, pool, `SELECT attempts, count(*) FROM jobs GROUP BY attempts ORDER BY attempts`, func(a, b int64) {
		s.AttemptsHist = append(s.AttemptsHist, [2]int64{a, b})
	}); err != nil {
		return nil, err
	}
	rows, err := pool.Query(ctx, `SELECT COALESCE(category, '-'), count(*) FROM attempts
		WHERE outcome IN ('retryable', 'failed') GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT 5`)
	if err != nil {
		return nil, err
	}
	for rows.Next() {
		var c catCount
		if err := rows.Scan(&c.Category, &c.N); err != nil {
			return nil, err
		}
		s.Categories = append(s.Categories, c)
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	if s.Unavailable != "" {
		rows, err := pool.Query(ctx, `SELECT state, count(*), sum(attempts), string_agg(DISTINCT COALESCE(last_category, '-'), ', ')
			FROM jobs WHERE country = $1 GROUP BY state`, s.Unavailable)
		if err != nil {
			return nil, err
		}
		for rows.Next() {
			var state, cats string
			var k, tries int64
			if err := rows.Scan(&state, &k, &tries, &cats); err != nil {
				return nil, err
			}
			s.UnavailableJobs[state] = k
			s.UnavailableTries += tries
			s.UnavailableCats = append(s.UnavailableCats, cats)
		}
		if err := rows.Err(); err != nil {
			return nil, err
		}
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM attempts a JOIN jobs j ON j.key = a.job_key
			WHERE j.country = $1 AND a.category = $2`, s.Unavailable, string(tasks.CategoryExitUnavailable)).Scan(&s.UnavailableExits); err != nil {
			return nil, err
		}
	}
	if s.SchemaWindow != "" {
		s.SchemaJobs = map[string]int64{}
		rows, err := pool.Query(ctx, `SELECT state || '/' || COALESCE(last_category, '-'), count(*) FROM jobs WHERE "window" = $1 GROUP BY 1`, s.SchemaWindow)
		if err != nil {
			return nil, err
		}
		var k string
		var c int64
		if _, err := pgx.ForEachRow(rows, []any{&k, &c}, func() error { s.SchemaJobs[k] = c; return nil }); err != nil {
			return nil, err
		}
		if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM quarantine q JOIN jobs j ON j.key = q.job_key WHERE j."window" = $1 AND q.reason LIKE $2 || '%'),
			(SELECT count(*) FROM results r JOIN jobs j ON j.key = r.job_key WHERE j."window" = $1)`, s.SchemaWindow, string(tasks.CategoryValidation)).Scan(
			&s.SchemaQuarantined, &s.SchemaResults); err != nil {
			return nil, err
		}
	}
	s.Disconnects = proxy.Disconnects()
	if s.BySession, err = store.New(pool).StatsBySession(ctx); err != nil {
		return nil, err
	}
	s.DuplicateResults = counterSum(reg, "idemscrape_duplicate_results_total")
	s.ThrottleResends = counterSum(reg, "idemscrape_throttle_resends_total")
	if s.Invariants, err = invariants(ctx, pool); err != nil {
		return nil, err
	}
	s.ShowcaseKeys, err = showcase(ctx, pool, s.Unavailable)
	return s, err
}

// collectRendered reads the JavaScript phase back: each job's state, whether its result
// holds the price the shop's script shows, the stagings quarantined after a lost session.
func (s *summary) collectRendered(ctx context.Context, pool *pgxpool.Pool, site *testutil.FakeSite, specs []tasks.Spec) error {
	if len(specs) == 0 {
		return nil
	}
	s.RenderedJobs = map[string]int64{}
	var bytes int64
	for _, spec := range specs {
		spec, err := spec.Normalize()
		if err != nil {
			return err
		}
		key, err := spec.Key()
		if err != nil {
			return err
		}
		var state string
		var b, quarantined int64
		var price *string
		if err := pool.QueryRow(ctx, `SELECT j.state, j.bytes_total,
			(SELECT r.data->>'price' FROM results r WHERE r.job_key = j.key),
			(SELECT count(*) FROM quarantine q WHERE q.job_key = j.key AND q.reason LIKE $2 || '%')
			FROM jobs j WHERE j.key = $1`, key, string(tasks.CategorySessionLost)).Scan(&state, &b, &price, &quarantined); err != nil {
			return fmt.Errorf("summary: rendered job %s: %w", key, err)
		}
		s.RenderedJobs[state]++
		s.RenderedReplayed += quarantined
		bytes += b
		if p, ok := site.Product(spec.SourceID); ok && price != nil && *price == p.Price {
			s.RenderedRight++
		}
	}
	s.RenderedBytes = bytes / int64(len(specs))
	return nil
}

func scanPairs(ctx context.Context, pool *pgxpool.Pool, q string, f func(a, b int64)) error {
	rows, err := pool.Query(ctx, q)
	if err != nil {
		return err
	}
	var a, b int64
	_, err = pgx.ForEachRow(rows, []any{&a, &b}, func() error { f(a, b); return nil })
	return err
}

// counterSum adds up every series of the registry's counter name (0 if absent).
func counterSum(reg *handlers.Registry, name string) int64 {
	g := reg.Gatherer()
	if g == nil {
		return 0
	}
	mfs, err := g.Gather()
	if err != nil {
		return 0
	}
	var total float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			total += m.GetCounter().GetValue()
		}
	}
	return int64(total)
}

// invariants checks exactly-once from PostgreSQL: one result and one event per complete
// job, nothing for a job that is not complete, every event published and taking effect
// exactly once in the consumer's table.
func invariants(ctx context.Context, pool *pgxpool.Pool) ([]check, error) {
	evPrefix := handlers.EventKey("")
	checks := []struct{ name, q string }{
		{"every complete job has exactly one result", `SELECT j.key FROM jobs j WHERE j.state = 'complete'
			AND (SELECT count(*) FROM results r WHERE r.job_key = j.key) <> 1`},
		{"every complete job has exactly one outbox event", `SELECT j.key FROM jobs j WHERE j.state = 'complete'
			AND (SELECT count(*) FROM outbox o WHERE o.event_key = $1 || j.key) <> 1`},
		{"no result without a complete job", `SELECT r.job_key FROM results r JOIN jobs j ON j.key = r.job_key
			WHERE j.state <> 'complete'`},
		{"no outbox event without a complete job", `SELECT o.event_key FROM outbox o WHERE NOT EXISTS
			(SELECT 1 FROM jobs j WHERE o.event_key = $1 || j.key AND j.state = 'complete')`},
		{"every outbox event was published", `SELECT event_key FROM outbox_unsent`},
		{"every event took effect exactly once (price alerts)", `SELECT o.event_key FROM outbox o
			WHERE (SELECT count(*) FROM price_alerts a WHERE a.event_key = o.event_key) <> 1
			UNION ALL SELECT a.event_key FROM price_alerts a WHERE NOT EXISTS (SELECT 1 FROM outbox o WHERE o.event_key = a.event_key)`},
	}
	var out []check
	for _, c := range checks {
		q := `SELECT count(*), COALESCE((array_agg(k ORDER BY k))[1:3], '{}') FROM (` + c.q + `) AS bad(k)`
		var args []any
		if strings.Contains(c.q, "$1") {
			args = append(args, evPrefix)
		}
		ch := check{Name: c.name}
		if err := pool.QueryRow(ctx, q, args...).Scan(&ch.Violations, &ch.Bad); err != nil {
			return nil, fmt.Errorf("invariant %q: %w", c.name, err)
		}
		out = append(out, ch)
	}
	return out, nil
}

// showcase picks jobs worth opening on the job page: the one with most attempts that
// completed, one whose unit was replayed after a disconnect, one of the unavailable
// country.
func showcase(ctx context.Context, pool *pgxpool.Pool, unavailable string) ([][2]string, error) {
	var out [][2]string
	for _, q := range []struct{ label, q string }{
		{"a job that was retried", `SELECT key FROM jobs WHERE state = 'complete' AND attempts > 1 ORDER BY attempts DESC, key LIMIT 1`},
		{"a job replayed after a disconnect", `SELECT q.job_key FROM quarantine q JOIN jobs j ON j.key = q.job_key
			WHERE j.state = 'complete' ORDER BY q.job_key LIMIT 1`},
		{"a job in " + unavailable, `SELECT key FROM jobs WHERE country = '` + strings.ReplaceAll(unavailable, "'", "") + `' ORDER BY key LIMIT 1`},
	} {
		var key string
		err := pool.QueryRow(ctx, q.q).Scan(&key)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			continue
		case err != nil:
			return nil, err
		}
		out = append(out, [2]string{q.label, key})
	}
	return out, nil
}

// fault is one fault of the mix with the evidence that it happened.
type fault struct {
	Name     string
	Happened bool
	Evidence string
	Skipped  bool // not run on this machine (the evidence says why); not a failure
}

func (s *summary) faults() []fault {
	f := []fault{
		s.challengeFault(),
		{"device disconnects", s.Disconnects > 0 && s.Replayed > 0,
			fmt.Sprintf("%d at the proxy; %d half-done units quarantined (session_lost) and replayed on another session", s.Disconnects, s.Replayed), false},
		{"429 with Retry-After", s.ThrottledAttempts > 0 || s.ThrottleResends > 0, s.throttleText(), false},
	}
	if s.Unavailable != "" {
		var states []string
		var n int64
		for _, st := range sortedKeys(s.UnavailableJobs) {
			states = append(states, fmt.Sprintf("%s %d", st, s.UnavailableJobs[st]))
			n += s.UnavailableJobs[st]
		}
		evidence := fmt.Sprintf("%s, %s (%d failed exit_unavailable): %s", plural(n, "job"), plural(s.UnavailableTries, "attempt"), s.UnavailableExits, strings.Join(states, ", "))
		if len(s.UnavailableCats) > 0 {
			evidence += " (last category " + strings.Join(s.UnavailableCats, ", ") + ": the attempt cap)"
		}
		f = append(f, fault{"no proxy peers in " + s.Unavailable,
			n > 0 && s.UnavailableExits > 0 && s.UnavailableJobs["complete"] == 0, evidence, false})
	}
	if s.SchemaWindow != "" {
		var states []string
		var n, failedValidation int64
		for _, k := range sortedKeys(s.SchemaJobs) {
			states = append(states, fmt.Sprintf("%s %d", k, s.SchemaJobs[k]))
			n += s.SchemaJobs[k]
		}
		failedValidation = s.SchemaJobs["failed/"+string(tasks.CategoryValidation)]
		f = append(f, fault{"shop schema change", n > 0 && failedValidation == n && s.SchemaQuarantined > 0 && s.SchemaResults == 0,
			fmt.Sprintf("%s: %s, not retried; %d stagings quarantined as validation failures, %d results written",
				plural(n, "job"), strings.Join(states, ", "), s.SchemaQuarantined, s.SchemaResults), false})
	}
	switch {
	case s.BrowserNote != "":
		f = append(f, fault{Name: "device drop mid-render", Skipped: true, Evidence: "skipped: " + s.BrowserNote})
	case s.RenderedJobs != nil:
		var states []string
		var n int64
		for _, k := range sortedKeys(s.RenderedJobs) {
			states = append(states, fmt.Sprintf("%s %d", k, s.RenderedJobs[k]))
			n += s.RenderedJobs[k]
		}
		f = append(f, fault{"device drop mid-render", s.RenderedJobs["complete"] == n && s.RenderedRight == n && s.RenderedReplayed > 0,
			fmt.Sprintf("%s rendered in Chromium: %s; %d of them hold the price the shop's script shows; %d stagings quarantined (session_lost) and replayed on another session; %s per job",
				plural(n, "job"), strings.Join(states, ", "), s.RenderedRight, s.RenderedReplayed, humanBytes(s.RenderedBytes)), false})
	}
	f = append(f, fault{"dispatcher crash after XADD", s.CrashedBatch > 0 && s.Replays > 0,
		fmt.Sprintf("its batch (%s) was published again; the consumer skipped %s", plural(s.CrashedBatch, "event"), plural(s.Replays, "replay")), false})
	return f
}

// challengeFault: the shop's bot challenge, served once per new exit; the units the
// session pool put on warm sessions skipped it.
func (s *summary) challengeFault() fault {
	var warm, fresh store.SessionStats
	for _, st := range s.BySession {
		if st.Session == "warm" {
			warm = st
		} else {
			fresh = st
		}
	}
	return fault{"bot challenge", s.Challenges > 0 && warm.Attempts > 0,
		fmt.Sprintf("%d challenge pages served (one per new exit); %s on warm sessions (the session pool) skipped it: %s per attempt warm, %s new",
			s.Challenges, plural(warm.Attempts, "attempt"), humanBytes(warm.BytesPerAttempt), humanBytes(fresh.BytesPerAttempt)), false}
}

// throttleText: the 429s waited out on their session (a Retry-After of at most 2 s), and
// the attempts a 429 ended.
func (s *summary) throttleText() string {
	text := fmt.Sprintf("%s waited out and sent again on their session, %s throttled",
		plural(s.ThrottleResends, "request"), plural(s.ThrottledAttempts, "attempt"))
	if s.ThrottledAttempts > 0 {
		text += s.gapText()
	}
	return text
}

func (s *summary) gapText() string {
	if s.ThrottleMinGap == nil {
		return ""
	}
	return fmt.Sprintf("; each job's next attempt began ≥ %v later (asynq moves due retries every ~5 s)", s.ThrottleMinGap.Round(100*time.Millisecond))
}

func (s *summary) render(w io.Writer, o options) {
	fmt.Fprintf(w, "\nSUMMARY (settled in %v)\n", s.Elapsed.Round(100*time.Millisecond))
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	var states []string
	for _, st := range sortedKeys(s.Stats.JobsByState) {
		states = append(states, fmt.Sprintf("%s %d", st, s.Stats.JobsByState[st]))
	}
	fmt.Fprintf(tw, "  jobs by state\t%s (of %d)\n", strings.Join(states, " · "), s.Total)
	var hist []string
	for i, h := range s.AttemptsHist {
		if i == 0 {
			hist = append(hist, fmt.Sprintf("%s: %s", plural(h[0], "attempt"), plural(h[1], "job")))
			continue
		}
		hist = append(hist, fmt.Sprintf("%d: %d", h[0], h[1]))
	}
	fmt.Fprintf(tw, "  attempts per job\t%s (%.2f per complete job, %d in all)\n",
		strings.Join(hist, " · "), s.Stats.AttemptsPerCompletedJob, s.Stats.Attempts)
	fmt.Fprintf(tw, "  duplicates rejected\t%d enqueues (second tick, by hand) · %d result writes (unique observation key)\n",
		s.DuplicateEnqueues, s.DuplicateResults)
	fmt.Fprintf(tw, "  outbox replays deduplicated\t%d (%d events, %d stream entries, %d took effect)\n", s.Replays, s.Events, s.Entries, s.Inbox)
	fmt.Fprintf(tw, "  bytes per job\tmean %s · min %s · max %s (all attempts, through the proxy)\n",
		humanBytes(int64(s.Stats.BytesPerLogicalJob)), humanBytes(s.BytesMin), humanBytes(s.BytesMax))
	var cats []string
	for _, c := range s.Categories {
		cats = append(cats, fmt.Sprintf("%s %d", c.Category, c.N))
	}
	if len(cats) == 0 {
		cats = []string{"none"}
	}
	fmt.Fprintf(tw, "  top failure categories\t%s (failed attempts)\n", strings.Join(cats, " · "))
	for _, c := range s.Costs {
		fmt.Fprintf(tw, "  proxy cost\t%s per completed job · %s in all (%s) · %s\n",
			money(c.PerCompletedJobMicros, c.Currency), money(c.TotalMicros, c.Currency), o.Price, topWaste(c))
	}
	tw.Flush()

	fmt.Fprintln(w, "\nFAULTS (each must have happened at least once)")
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, f := range s.faults() {
		m := mark(f.Happened)
		if f.Skipped {
			m = "skip"
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\n", m, f.Name, f.Evidence)
	}
	tw.Flush()

	fmt.Fprintln(w, "\nINVARIANTS")
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, c := range s.Invariants {
		line := fmt.Sprintf("  %s\t%s", mark(c.Violations == 0), c.Name)
		if c.Violations > 0 {
			line += fmt.Sprintf("\tBROKEN for %d: %s", c.Violations, strings.Join(c.Bad, ", "))
		}
		fmt.Fprintln(tw, line)
	}
	tw.Flush()
}

// verdict is nil when every invariant holds and every fault happened.
func (s *summary) verdict() error {
	var errs []error
	for _, c := range s.Invariants {
		if c.Violations > 0 {
			errs = append(errs, fmt.Errorf("invariant broken: %s (%d violations, e.g. %s)", c.Name, c.Violations, strings.Join(c.Bad, ", ")))
		}
	}
	for _, f := range s.faults() {
		if !f.Happened && !f.Skipped {
			errs = append(errs, fmt.Errorf("fault not demonstrated: %s (%s)", f.Name, f.Evidence))
		}
	}
	return errors.Join(errs...)
}

func plural(n int64, word string) string {
	if n == 1 {
		return fmt.Sprintf("%d %s", n, word)
	}
	return fmt.Sprintf("%d %ss", n, word)
}

func mark(ok bool) string {
	if ok {
		return "ok"
	}
	return "FAIL"
}

func sortedKeys(m map[string]int64) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// money writes micro-units of currency as an amount, e.g. "0.000021 USD".
func money(micros int64, currency string) string {
	return store.Cost{Micros: micros, Currency: currency}.String()
}

// topWaste names the costliest waste category and its share of the total.
func topWaste(c store.CostStats) string {
	top, most := "", int64(0)
	for _, k := range sortedKeys(c.Waste) {
		if c.Waste[k] > most {
			top, most = k, c.Waste[k]
		}
	}
	if top == "" || c.TotalMicros == 0 {
		return "no waste"
	}
	return fmt.Sprintf("top waste: %s %s (%.0f %% of the cost)", top, money(most, c.Currency), 100*float64(most)/float64(c.TotalMicros))
}
