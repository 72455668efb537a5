package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Window states (schedule_windows.state).
const (
	// WindowRunning: a tick recorded the window and is enqueuing its specs (or died doing
	// so: the row says when it started).
	WindowRunning = "running"
	// WindowEnqueued: a tick enqueued every spec of the window (jobs created or found).
	WindowEnqueued = "enqueued"
	// WindowFailed: the last tick failed; the scheduler retries it until its deadline.
	WindowFailed = "failed"
)

// maxWindowError bounds the error text a failed tick records.
const maxWindowError = 500

// WindowParams names one due window of a template.
type WindowParams struct {
	Template string
	Window   string
	Kind     string
	Due      time.Time // the scheduled instant
	// JobHorizon, when positive, makes WindowBegin refuse (ErrWindowExpired) a window first
	// ticked longer ago than this by the database's clock: the reconciler's job_retention,
	// after which the window's jobs may have been pruned, and ticking it again would create
	// them anew. (WindowBegin only.)
	JobHorizon time.Duration
	// NoNewRow makes WindowBegin refuse (ErrWindowExpired) a window that has no row: one
	// due longer ago than the ledger's retention, whose row may have been pruned.
	// (WindowBegin only.)
	NoNewRow bool
	// Force ticks the window whatever JobHorizon and NoNewRow say (a forced fill).
	Force bool
}

// Window is one template × window row.
type Window struct {
	Template   string
	Window     string
	Kind       string
	Due        time.Time
	State      string
	Tries      int
	Specs      int
	Enqueued   int
	Started    time.Time
	EnqueuedAt *time.Time
	LastError  string
	Updated    time.Time
}

// WindowBegin records that a tick of the window starts, before anything of it is
// enqueued: a new row (running), or one more try of an existing one. A window already
// enqueued stays enqueued (a second scheduler or a fill ticks it again: nothing new is
// enqueued, the keys exist). Unless p.Force, a window first ticked longer ago than
// p.JobHorizon, or (p.NoNewRow) one without a row, is refused with ErrWindowExpired and
// nothing is written: its jobs may have been pruned, and a tick would create them anew.
func (s *PG) WindowBegin(ctx context.Context, p WindowParams) error {
	if p.Template == "" || p.Window == "" || p.Kind == "" || p.Due.IsZero() {
		return fmt.Errorf("store: WindowBegin: template %q, window %q, kind %q and due time are required", p.Template, p.Window, p.Kind)
	}
	horizon := p.JobHorizon.Seconds()
	if p.Force {
		horizon = 0
	}
	var started time.Time
	err := s.pool.QueryRow(ctx, `
INSERT INTO schedule_windows (template, "window", kind, due_at)
SELECT $1, $2, $3, $4
WHERE NOT $6 OR EXISTS (SELECT 1 FROM schedule_windows WHERE template = $1 AND "window" = $2)
ON CONFLICT (template, "window") DO UPDATE SET tries = schedule_windows.tries + 1, updated_at = now(),
	state = CASE WHEN schedule_windows.state = 'enqueued' THEN 'enqueued' ELSE 'running' END
WHERE $5 <= 0 OR schedule_windows.started_at >= now() - make_interval(secs => $5)
RETURNING started_at`,
		p.Template, p.Window, p.Kind, p.Due, horizon, p.NoNewRow && !p.Force).Scan(&started)
	if errors.Is(err, pgx.ErrNoRows) {
		return s.windowExpired(ctx, p)
	}
	if err != nil {
		return fmt.Errorf("store: WindowBegin %s/%s: %w", p.Template, p.Window, err)
	}
	return nil
}

// ErrWindowExpired: a tick of a window whose jobs may have been pruned (first ticked
// longer ago than the job retention, or due longer ago than the ledger keeps rows and
// without one), refused because it would create them again as new jobs: fetched,
// committed and published again under the same event keys.
var ErrWindowExpired = errors.New("store: window too old to tick again")

// windowExpired explains why WindowBegin refused p's window.
func (s *PG) windowExpired(ctx context.Context, p WindowParams) error {
	var started time.Time
	var state string
	err := s.pool.QueryRow(ctx, `SELECT started_at, state FROM schedule_windows WHERE template = $1 AND "window" = $2`,
		p.Template, p.Window).Scan(&started, &state)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("%w: %s/%s (due %s) has no record, and windows due that long ago may have had theirs pruned: whether its jobs ran is unknown",
			ErrWindowExpired, p.Template, p.Window, p.Due.UTC().Format(time.RFC3339))
	case err != nil:
		return fmt.Errorf("store: WindowBegin %s/%s: %w", p.Template, p.Window, err)
	}
	return fmt.Errorf("%w: %s/%s (%s) was first ticked at %s, longer ago than the job retention %v: its jobs may have been pruned",
		ErrWindowExpired, p.Template, p.Window, state, started.UTC().Format(time.RFC3339), p.JobHorizon)
}

// WindowEnqueued records a tick that enqueued every spec of the window: specs in all,
// enqueued of them with a job (created or already queued).
func (s *PG) WindowEnqueued(ctx context.Context, template, window string, specs, enqueued int) error {
	tag, err := s.pool.Exec(ctx, `
UPDATE schedule_windows SET state = 'enqueued', specs = $3, enqueued = $4, last_error = NULL,
	enqueued_at = COALESCE(enqueued_at, now()), updated_at = now()
WHERE template = $1 AND "window" = $2`, template, window, specs, enqueued)
	if err != nil {
		return fmt.Errorf("store: WindowEnqueued %s/%s: %w", template, window, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("store: WindowEnqueued %s/%s: %w", template, window, ErrWindowNotFound)
	}
	return nil
}

// WindowFailed records a tick that failed with cause (its text, cut to 500 bytes). A
// window another tick enqueued meanwhile stays enqueued.
func (s *PG) WindowFailed(ctx context.Context, template, window string, cause error) error {
	msg := ""
	if cause != nil {
		msg = cause.Error()
	}
	if len(msg) > maxWindowError {
		msg = msg[:maxWindowError]
	}
	_, err := s.pool.Exec(ctx, `
UPDATE schedule_windows SET last_error = $3, updated_at = now(),
	state = CASE WHEN state = 'enqueued' THEN 'enqueued' ELSE 'failed' END
WHERE template = $1 AND "window" = $2`, template, window, msg)
	if err != nil {
		return fmt.Errorf("store: WindowFailed %s/%s: %w", template, window, err)
	}
	return nil
}

// WindowTriesLost records tries of the window that happened while PostgreSQL did not
// answer, so could not be recorded then (the scheduler keeps them in memory and writes
// them with its next statement that reaches PostgreSQL): tries more tries (0 for none:
// only the error of a try WindowBegin recorded), and lastErr (cut to 500 bytes) as the last
// error of a window not enqueued, which is then failed. A window without a row gets one,
// failed, with tries tries.
func (s *PG) WindowTriesLost(ctx context.Context, p WindowParams, tries int, lastErr string) error {
	if p.Template == "" || p.Window == "" || p.Kind == "" || p.Due.IsZero() || tries < 0 {
		return fmt.Errorf("store: WindowTriesLost: template %q, window %q, kind %q, due time and tries %d >= 0 are required", p.Template, p.Window, p.Kind, tries)
	}
	if len(lastErr) > maxWindowError {
		lastErr = lastErr[:maxWindowError]
	}
	_, err := s.pool.Exec(ctx, `
INSERT INTO schedule_windows (template, "window", kind, due_at, state, tries, last_error)
VALUES ($1, $2, $3, $4, 'failed', greatest($5, 1), NULLIF($6, ''))
ON CONFLICT (template, "window") DO UPDATE SET tries = schedule_windows.tries + $5, updated_at = now(),
	last_error = CASE WHEN schedule_windows.state = 'enqueued' OR $6 = '' THEN schedule_windows.last_error ELSE $6 END,
	state = CASE WHEN schedule_windows.state = 'enqueued' THEN 'enqueued' ELSE 'failed' END`,
		p.Template, p.Window, p.Kind, p.Due, tries, lastErr)
	if err != nil {
		return fmt.Errorf("store: WindowTriesLost %s/%s: %w", p.Template, p.Window, err)
	}
	return nil
}

// ErrWindowNotFound: no row for the template × window.
var ErrWindowNotFound = errors.New("store: window not recorded")

// WindowsListParams selects windows.
type WindowsListParams struct {
	Template string    // "" for every template
	DueFrom  time.Time // zero for no lower bound
	Limit    int       // 0 for 1,000
}

// WindowsList returns windows by template and due time, newest first.
func (s *PG) WindowsList(ctx context.Context, p WindowsListParams) ([]Window, error) {
	if p.Limit <= 0 {
		p.Limit = 1000
	}
	var from *time.Time
	if !p.DueFrom.IsZero() {
		from = &p.DueFrom
	}
	rows, err := s.pool.Query(ctx, `
SELECT template, "window", kind, due_at, state, tries, specs, enqueued, started_at, enqueued_at,
	COALESCE(last_error, ''), updated_at
FROM schedule_windows
WHERE ($1 = '' OR template = $1) AND ($2::timestamptz IS NULL OR due_at >= $2)
ORDER BY template, due_at DESC LIMIT $3`, p.Template, from, p.Limit)
	if err != nil {
		return nil, fmt.Errorf("store: WindowsList: %w", err)
	}
	defer rows.Close()
	var out []Window
	for rows.Next() {
		var w Window
		if err := rows.Scan(&w.Template, &w.Window, &w.Kind, &w.Due, &w.State, &w.Tries, &w.Specs, &w.Enqueued,
			&w.Started, &w.EnqueuedAt, &w.LastError, &w.Updated); err != nil {
			return nil, err
		}
		out = append(out, w)
	}
	return out, rows.Err()
}

// WindowsFirstDue returns each template's earliest recorded due time: where its gap
// search starts (a template never recorded has no gaps yet).
func (s *PG) WindowsFirstDue(ctx context.Context) (map[string]time.Time, error) {
	rows, err := s.pool.Query(ctx, `SELECT template, min(due_at) FROM schedule_windows GROUP BY template`)
	if err != nil {
		return nil, fmt.Errorf("store: WindowsFirstDue: %w", err)
	}
	defer rows.Close()
	out := map[string]time.Time{}
	for rows.Next() {
		var t string
		var due time.Time
		if err := rows.Scan(&t, &due); err != nil {
			return nil, err
		}
		out[t] = due
	}
	return out, rows.Err()
}

// WindowsEnqueued returns, of the given windows of template, those recorded enqueued.
func (s *PG) WindowsEnqueued(ctx context.Context, template string, windows []string) (map[string]bool, error) {
	rows, err := s.pool.Query(ctx, `SELECT "window" FROM schedule_windows WHERE template = $1 AND "window" = ANY($2) AND state = 'enqueued'`,
		template, windows)
	if err != nil {
		return nil, fmt.Errorf("store: WindowsEnqueued: %w", err)
	}
	defer rows.Close()
	out := map[string]bool{}
	for rows.Next() {
		var w string
		if err := rows.Scan(&w); err != nil {
			return nil, err
		}
		out[w] = true
	}
	return out, rows.Err()
}
