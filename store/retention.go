package store

import (
	"context"
	"fmt"
	"time"
)

// Retention: what the reconciler deletes so that PostgreSQL does not grow without bound.
// Every statement deletes at most limit rows, oldest first, and skips rows another
// transaction holds, so it never waits on a worker's commit and holds its locks briefly.

// JobsPruneTerminal deletes at most limit terminal jobs (complete or failed) last changed
// more than olderThan ago (by the database's clock), with their attempts, results,
// quarantine and notes (ON DELETE CASCADE). A pruned key enqueued again is a new job.
// It returns the jobs deleted.
func (s *PG) JobsPruneTerminal(ctx context.Context, olderThan time.Duration, limit int) (int64, error) {
	return s.prune(ctx, "JobsPruneTerminal", `
WITH doomed AS (
	SELECT key FROM jobs
	WHERE state IN ('complete', 'failed') AND updated_at < now() - make_interval(secs => $1)
	ORDER BY updated_at LIMIT $2
	FOR UPDATE SKIP LOCKED
)
DELETE FROM jobs j USING doomed d WHERE j.key = d.key AND j.state IN ('complete', 'failed')`, olderThan, limit)
}

// QuarantinePrune deletes at most limit quarantine rows (staged data of abandoned
// sessions, the bulk of the table) created more than olderThan ago, oldest first.
func (s *PG) QuarantinePrune(ctx context.Context, olderThan time.Duration, limit int) (int64, error) {
	return s.prune(ctx, "QuarantinePrune", `
DELETE FROM quarantine WHERE id IN (
	SELECT id FROM quarantine WHERE created_at < now() - make_interval(secs => $1)
	ORDER BY created_at LIMIT $2 FOR UPDATE SKIP LOCKED)`, olderThan, limit)
}

// WindowsPrune deletes at most limit schedule_windows rows due more than olderThan ago
// (the reconciler's window_retention, longer than its job_retention).
func (s *PG) WindowsPrune(ctx context.Context, olderThan time.Duration, limit int) (int64, error) {
	return s.prune(ctx, "WindowsPrune", `
DELETE FROM schedule_windows WHERE (template, "window") IN (
	SELECT template, "window" FROM schedule_windows WHERE due_at < now() - make_interval(secs => $1)
	ORDER BY due_at LIMIT $2 FOR UPDATE SKIP LOCKED)`, olderThan, limit)
}

// prune runs one retention statement of JobsPruneTerminal, QuarantinePrune or
// WindowsPrune: sql deletes at most limit ($2) rows older than olderThan (in seconds, $1).
// It checks both are positive, names op in its errors and returns the rows deleted.
func (s *PG) prune(ctx context.Context, op, sql string, olderThan time.Duration, limit int) (int64, error) {
	if olderThan <= 0 || limit < 1 {
		return 0, fmt.Errorf("store: %s: olderThan %v and limit %d must be positive", op, olderThan, limit)
	}
	tag, err := s.pool.Exec(ctx, sql, olderThan.Seconds(), limit)
	if err != nil {
		return 0, fmt.Errorf("store: %s: %w", op, err)
	}
	return tag.RowsAffected(), nil
}

// RetentionPreview is what retention would delete now: terminal jobs (each with all its
// rows), quarantine rows and schedule windows.
type RetentionPreview struct {
	TerminalJobs int64 `json:"terminal_jobs"`
	Quarantine   int64 `json:"quarantine"`
	Windows      int64 `json:"windows"`
}

// RetentionDue counts what the given retentions (job_retention, quarantine_retention,
// window_retention) would delete now (zero retention: not counted).
func (s *PG) RetentionDue(ctx context.Context, jobs, quarantine, windows time.Duration) (RetentionPreview, error) {
	var p RetentionPreview
	err := s.pool.QueryRow(ctx, `
SELECT
	CASE WHEN $1 > 0 THEN (SELECT count(*) FROM jobs WHERE state IN ('complete', 'failed') AND updated_at < now() - make_interval(secs => $1)) ELSE 0 END,
	CASE WHEN $2 > 0 THEN (SELECT count(*) FROM quarantine WHERE created_at < now() - make_interval(secs => $2)) ELSE 0 END,
	CASE WHEN $3 > 0 THEN (SELECT count(*) FROM schedule_windows WHERE due_at < now() - make_interval(secs => $3)) ELSE 0 END`,
		jobs.Seconds(), quarantine.Seconds(), windows.Seconds()).Scan(&p.TerminalJobs, &p.Quarantine, &p.Windows)
	if err != nil {
		return p, fmt.Errorf("store: RetentionDue: %w", err)
	}
	return p, nil
}

// TableSize is one table's footprint: its rows (the planner's estimate, from the last
// ANALYZE or VACUUM: cheap on a table of millions) and its bytes with indexes and TOAST.
type TableSize struct {
	Table string `json:"table"`
	Rows  int64  `json:"rows_estimate"`
	Bytes int64  `json:"bytes"`
}

// retainedTables are the tables idemscrape writes, in the order TableSizes lists them.
var retainedTables = []string{"jobs", "attempts", "results", "quarantine", "job_notes", "outbox", "outbox_inbox",
	"saved_inputs", "saved_responses", "input_blobs", "schedule_windows"}

// TableSizes returns the footprint of every table idemscrape writes, in one statement.
func (s *PG) TableSizes(ctx context.Context) ([]TableSize, error) {
	rows, err := s.pool.Query(ctx, `
SELECT t.name, greatest(coalesce(c.reltuples, 0), 0)::bigint, coalesce(pg_total_relation_size(c.oid), 0)
FROM unnest($1::text[]) WITH ORDINALITY AS t(name, ord)
LEFT JOIN pg_class c ON c.oid = to_regclass(t.name)
ORDER BY t.ord`, retainedTables)
	if err != nil {
		return nil, fmt.Errorf("store: TableSizes: %w", err)
	}
	defer rows.Close()
	var out []TableSize
	for rows.Next() {
		var ts TableSize
		if err := rows.Scan(&ts.Table, &ts.Rows, &ts.Bytes); err != nil {
			return nil, fmt.Errorf("store: TableSizes: %w", err)
		}
		out = append(out, ts)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("store: TableSizes: %w", err)
	}
	return out, nil
}
