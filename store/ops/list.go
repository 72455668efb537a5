package ops

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/idemscrape/idemscrape/tasks"
)

// JobFilter selects the jobs of JobList. Zero fields do not filter, except States: none
// means failed and retryable (the jobs that need a look).
type JobFilter struct {
	Kind      string
	States    []tasks.JobState // none: failed and retryable
	Category  string           // last failure category (tasks.Category values)
	Window    string
	KeyPrefix string
	Limit     int // >= 1
}

// AllStates lists every job state, for a JobFilter that wants any.
var AllStates = []tasks.JobState{tasks.StatePending, tasks.StateRunning, tasks.StateRetryable, tasks.StateComplete, tasks.StateFailed}

// ParseStates reads a comma-separated list of job states ("" is failed and retryable,
// "any" every state), with an error that names the value and the states there are.
func ParseStates(s string) ([]tasks.JobState, error) {
	switch strings.TrimSpace(s) {
	case "":
		return nil, nil
	case "any":
		return AllStates, nil
	}
	var out []tasks.JobState
	for _, p := range strings.Split(s, ",") {
		st := tasks.JobState(strings.TrimSpace(p))
		ok := false
		for _, known := range AllStates {
			ok = ok || st == known
		}
		if !ok {
			names := make([]string, len(AllStates))
			for i, k := range AllStates {
				names[i] = string(k)
			}
			return nil, fmt.Errorf("state %q: want one of %s, or any", p, strings.Join(names, ", "))
		}
		out = append(out, st)
	}
	return out, nil
}

// Validate reports a filter that can not be run, naming the field.
func (f JobFilter) Validate() error {
	switch {
	case f.Limit < 1:
		return fmt.Errorf("ops: JobList: limit %d must be >= 1", f.Limit)
	case len(f.KeyPrefix) > 1000:
		return errors.New("ops: JobList: key prefix longer than 1,000 bytes")
	}
	return nil
}

// JobList returns up to Limit jobs that pass the filter, most recently updated first.
// The key prefix is matched literally (no pattern characters).
func (s *Store) JobList(ctx context.Context, f JobFilter) ([]ProblemJob, error) {
	if err := f.Validate(); err != nil {
		return nil, err
	}
	states := f.States
	if len(states) == 0 {
		states = []tasks.JobState{tasks.StateFailed, tasks.StateRetryable}
	}
	st := make([]string, len(states))
	for i, x := range states {
		st[i] = string(x)
	}
	rows, _ := s.pool.Query(ctx, `
SELECT key, kind, state, attempts, COALESCE(last_category, ''), updated_at, next_attempt_at
FROM jobs
WHERE state = ANY($1) AND ($2 = '' OR kind = $2) AND ($3 = '' OR last_category = $3)
	AND ($4 = '' OR "window" = $4) AND ($5 = '' OR starts_with(key, $5))
ORDER BY updated_at DESC, key LIMIT $6`, st, f.Kind, f.Category, f.Window, f.KeyPrefix, f.Limit)
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (ProblemJob, error) {
		var x ProblemJob
		err := r.Scan(&x.Key, &x.Kind, &x.State, &x.Attempts, &x.Category, &x.UpdatedAt, &x.NextAttemptAt)
		return x, err
	})
	if err != nil {
		return nil, fmt.Errorf("ops: JobList: %w", err)
	}
	return out, nil
}

// WindowJobs counts one window's jobs by state.
type WindowJobs struct {
	Kind, Window                string
	Pending, Running, Retryable int
	Complete, Failed            int
}

// WindowJobCounts counts the jobs of each (kind, window) by state, in one statement
// (index jobs_kind_window_idx, migration 00015).
func (s *Store) WindowJobCounts(ctx context.Context, kinds, windows []string) (map[[2]string]WindowJobs, error) {
	if len(kinds) != len(windows) {
		return nil, fmt.Errorf("ops: WindowJobCounts: %d kinds for %d windows", len(kinds), len(windows))
	}
	rows, _ := s.pool.Query(ctx, `
SELECT w.kind, w.win, j.state, count(*)
FROM unnest($1::text[], $2::text[]) AS w(kind, win)
JOIN jobs j ON j.kind = w.kind AND j."window" = w.win
GROUP BY 1, 2, 3`, kinds, windows)
	out := map[[2]string]WindowJobs{}
	var kind, win, state string
	var n int
	_, err := pgx.ForEachRow(rows, []any{&kind, &win, &state, &n}, func() error {
		k := [2]string{kind, win}
		c := out[k]
		c.Kind, c.Window = kind, win
		switch tasks.JobState(state) {
		case tasks.StatePending:
			c.Pending = n
		case tasks.StateRunning:
			c.Running = n
		case tasks.StateRetryable:
			c.Retryable = n
		case tasks.StateComplete:
			c.Complete = n
		case tasks.StateFailed:
			c.Failed = n
		}
		out[k] = c
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("ops: WindowJobCounts: %w", err)
	}
	return out, nil
}
