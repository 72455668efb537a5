package ops

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
)

// Selector selects jobs for the operator's bulk tools and listings: `idemscrape jobs`,
// `idemscrape requeue` with selectors, and the worker's /jobs page. Zero fields do not
// filter, except States: none means failed and retryable (as JobFilter), or pending and
// retryable with Deferred. Every query
// built from it is read-only.
type Selector struct {
	Kind     string
	States   []tasks.JobState // none: failed and retryable
	Category string           // last failure category (tasks.Category values)
	Window   string
	// WindowGiven makes Window a filter even when it is "": only the jobs without a window
	// (an operator's explicit -window ""). Without it, Window "" does not filter.
	WindowGiven bool
	KeyPrefix   string    // matched literally
	Since       time.Time // zero: any; else jobs updated at or after it
	// Deferred keeps only the jobs whose collection window's money budget is spent: the
	// window's recorded attempts cost at least the kind's budget in Budgets (a kind without
	// one is never deferred). A runnable job (pending, retryable) of such a window is what
	// handlers.WindowDefer hands back uncounted, without an attempt; a failed one is what
	// handlers.WindowFail failed as budget_exceeded.
	Deferred bool
	// Budgets are the kinds' window money budgets (handlers.WithWindowBudget), per kind:
	// what Deferred compares each window's spend with. PostgreSQL does not record them: the
	// caller knows them from its configuration.
	Budgets map[string]store.Cost
}

// CheckText refuses a value PostgreSQL's text columns can not hold (a NUL byte, bytes
// that are not UTF-8), naming it: such a value matches no job, and sent as it is it fails
// the query (SQLSTATE 22021), which would read as a database that did not answer.
func CheckText(name, v string) error {
	switch {
	case !utf8.ValidString(v):
		return fmt.Errorf("%s %q is not valid UTF-8", name, v)
	case containsNUL(v):
		return fmt.Errorf("%s %q holds a NUL byte", name, v)
	}
	return nil
}

func containsNUL(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] == 0 {
			return true
		}
	}
	return false
}

// Validate reports a selector that can not be run, naming the field.
func (f Selector) Validate() error {
	for _, x := range []struct{ name, v string }{
		{"kind", f.Kind}, {"category", f.Category}, {"window", f.Window}, {"key prefix", f.KeyPrefix},
	} {
		if err := CheckText(x.name, x.v); err != nil {
			return err
		}
	}
	if len(f.KeyPrefix) > 1000 {
		return errors.New("key prefix longer than 1,000 bytes")
	}
	for k, b := range f.Budgets {
		switch {
		case k == "":
			return errors.New("a window budget has no kind")
		case b.Micros <= 0:
			return fmt.Errorf("the window budget of kind %s, %d micro-units, must be > 0", k, b.Micros)
		case b.Currency == "":
			return fmt.Errorf("the window budget of kind %s has no currency", k)
		}
	}
	if f.Deferred && len(f.Budgets) == 0 {
		return errors.New("deferred jobs are those of windows whose money budget is spent, and no window budget is known here")
	}
	return nil
}

// selectWith and selectWhere select a Selector's jobs j, with its arguments from $1 (args):
// spent is the windows whose budget is spent, only computed for Deferred, once
// (MATERIALIZED: inlined, it was evaluated per job), in one pass over the jobs and attempts
// of the windows with jobs in the selected states. That pass grows with those windows:
// measured on 200,000 jobs in 20 windows (190,000 priced attempts), 1.4-1.9 s per query on
// a 2-core box under load 13. Without Deferred it costs nothing.
const selectWith = `
WITH b AS (
	SELECT * FROM unnest($7::text[], $8::bigint[], $9::text[]) AS b(kind, money, currency)
), spent AS MATERIALIZED (
	SELECT w.kind, w.win
	FROM (SELECT DISTINCT j.kind, j."window" AS win FROM jobs j JOIN b ON b.kind = j.kind
		WHERE $10 AND j.state = ANY($1) AND ($4::text IS NULL OR j."window" = $4)) w
	JOIN b ON b.kind = w.kind
	JOIN jobs j2 ON j2.kind = w.kind AND j2."window" = w.win
	JOIN attempts a ON a.job_key = j2.key AND a.currency = b.currency
	GROUP BY w.kind, w.win, b.money
	HAVING sum(a.cost_micros) >= b.money
)`

const selectWhere = `j.state = ANY($1) AND ($2 = '' OR j.kind = $2) AND ($3 = '' OR j.last_category = $3)
	AND ($4::text IS NULL OR j."window" = $4) AND ($5 = '' OR starts_with(j.key, $5))
	AND ($6::timestamptz IS NULL OR j.updated_at >= $6)
	AND (NOT $10 OR EXISTS (SELECT 1 FROM spent s WHERE s.kind = j.kind AND s.win = j."window"))`

func (f Selector) args() []any {
	states := f.States
	switch {
	case len(states) == 0 && f.Deferred:
		states = []tasks.JobState{tasks.StatePending, tasks.StateRetryable}
	case len(states) == 0:
		states = []tasks.JobState{tasks.StateFailed, tasks.StateRetryable}
	}
	st := make([]string, len(states))
	for i, x := range states {
		st[i] = string(x)
	}
	var since *time.Time
	if !f.Since.IsZero() {
		since = &f.Since
	}
	kinds := sortedBudgetKinds(f.Budgets)
	money, cur := make([]int64, len(kinds)), make([]string, len(kinds))
	for i, k := range kinds {
		money[i], cur[i] = f.Budgets[k].Micros, f.Budgets[k].Currency
	}
	var window *string // NULL: any window
	if f.Window != "" || f.WindowGiven {
		window = &f.Window
	}
	return []any{st, f.Kind, f.Category, window, f.KeyPrefix, since, kinds, money, cur, f.Deferred}
}

func sortedBudgetKinds(m map[string]store.Cost) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// JobSelect returns up to limit jobs the selector selects, most recently updated first
// (as JobList).
func (s *Store) JobSelect(ctx context.Context, f Selector, limit int) ([]ProblemJob, error) {
	if err := f.Validate(); err != nil {
		return nil, fmt.Errorf("ops: JobSelect: %w", err)
	}
	if limit < 1 {
		return nil, fmt.Errorf("ops: JobSelect: limit %d must be >= 1", limit)
	}
	rows, _ := s.pool.Query(ctx, selectWith+`
SELECT j.key, j.kind, j.state, j.attempts, COALESCE(j.last_category, ''), j.updated_at, j.next_attempt_at
FROM jobs j
WHERE `+selectWhere+`
ORDER BY j.updated_at DESC, j.key LIMIT $11`, append(f.args(), limit)...)
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (ProblemJob, error) {
		var x ProblemJob
		err := r.Scan(&x.Key, &x.Kind, &x.State, &x.Attempts, &x.Category, &x.UpdatedAt, &x.NextAttemptAt)
		return x, err
	})
	if err != nil {
		return nil, fmt.Errorf("ops: JobSelect: %w", err)
	}
	return out, nil
}

// JobSelectCount counts the jobs the selector selects.
func (s *Store) JobSelectCount(ctx context.Context, f Selector) (int64, error) {
	if err := f.Validate(); err != nil {
		return 0, fmt.Errorf("ops: JobSelectCount: %w", err)
	}
	var n int64
	if err := s.pool.QueryRow(ctx, selectWith+`
SELECT count(*) FROM jobs j WHERE `+selectWhere, f.args()...).Scan(&n); err != nil {
		return 0, fmt.Errorf("ops: JobSelectCount: %w", err)
	}
	return n, nil
}

// JobSelectKeys returns up to limit keys the selector selects that sort after after ("":
// from the first), in key order: a bulk tool pages through a large set with it, each page
// starting after the last key of the one before, so that jobs changing meanwhile are
// neither skipped nor met twice.
func (s *Store) JobSelectKeys(ctx context.Context, f Selector, after string, limit int) ([]string, error) {
	if err := f.Validate(); err != nil {
		return nil, fmt.Errorf("ops: JobSelectKeys: %w", err)
	}
	if limit < 1 {
		return nil, fmt.Errorf("ops: JobSelectKeys: limit %d must be >= 1", limit)
	}
	rows, _ := s.pool.Query(ctx, selectWith+`
SELECT j.key FROM jobs j
WHERE `+selectWhere+` AND j.key > $11
ORDER BY j.key LIMIT $12`, append(f.args(), after, limit)...)
	keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("ops: JobSelectKeys: %w", err)
	}
	return keys, nil
}

// WindowSpend is what one collection window's recorded attempts cost, per currency
// (micro-units): the figure a window money budget is held against (store.PG.WindowCost,
// for every currency at once). An attempt still running costs nothing yet.
type WindowSpend map[string]int64

// Of returns the spend in currency.
func (w WindowSpend) Of(currency string) store.Cost {
	return store.Cost{Micros: w[currency], Currency: currency}
}

// WindowSpends returns what the attempts of each (kind, window) cost, per currency, in one
// statement (index jobs_kind_window_idx). A window without a priced attempt is missing from
// the map.
func (s *Store) WindowSpends(ctx context.Context, kinds, windows []string) (map[[2]string]WindowSpend, error) {
	if len(kinds) != len(windows) {
		return nil, fmt.Errorf("ops: WindowSpends: %d kinds for %d windows", len(kinds), len(windows))
	}
	rows, _ := s.pool.Query(ctx, `
SELECT w.kind, w.win, a.currency, sum(a.cost_micros)::bigint
FROM (SELECT DISTINCT * FROM unnest($1::text[], $2::text[]) AS w(kind, win)) w
JOIN jobs j ON j.kind = w.kind AND j."window" = w.win
JOIN attempts a ON a.job_key = j.key
WHERE a.currency IS NOT NULL
GROUP BY 1, 2, 3`, kinds, windows)
	out := map[[2]string]WindowSpend{}
	var kind, win, cur string
	var micros int64
	_, err := pgx.ForEachRow(rows, []any{&kind, &win, &cur, &micros}, func() error {
		k := [2]string{kind, win}
		if out[k] == nil {
			out[k] = WindowSpend{}
		}
		out[k][cur] = micros
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("ops: WindowSpends: %w", err)
	}
	return out, nil
}

// ParseSince reads a -since / ?since= value: an RFC 3339 time, or a duration back from now
// ("36h", "90m"). "" is the zero time (no bound).
func ParseSince(v string, now time.Time) (time.Time, error) {
	if v == "" {
		return time.Time{}, nil
	}
	if d, err := time.ParseDuration(v); err == nil {
		if d <= 0 {
			return time.Time{}, fmt.Errorf("%q: a duration back from now must be positive", v)
		}
		return now.Add(-d), nil
	}
	t, err := time.Parse(time.RFC3339, v)
	if err != nil {
		return time.Time{}, fmt.Errorf("%q is neither an RFC 3339 time (2026-04-23T06:00:00Z) nor a duration (36h)", v)
	}
	return t, nil
}
