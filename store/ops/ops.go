// Package ops holds the operator's queries and transitions on the system of record: what
// `idemscrape status`, `audit` and `requeue` and the worker's job page read and do. Every
// query is read-only except JobRequeue and JobBudgetExempt (which the runner calls after
// an attempt a proxy incident or a wait, not the job, ended); none is on a job's hot path.
//
// The package sits next to store (it reads the same tables and returns store's row types)
// and imports nothing above it: the event key of a job's outbox event is given by the
// caller (handlers.EventKey), not derived here.
package ops

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
)

// Store runs the operator's queries on a pool. It is safe for concurrent use.
type Store struct {
	pool *pgxpool.Pool
	st   *store.PG
}

// New returns a Store on pool. The schema must be migrated (CheckMigrated says so).
func New(pool *pgxpool.Pool) *Store { return &Store{pool: pool, st: store.New(pool)} }

// ErrNotMigrated: the database's schema is older than the migrations this binary embeds
// (or has none). CheckMigrated wraps it.
var ErrNotMigrated = errors.New("database schema is not migrated: run `idemscrape migrate`")

// LatestMigration returns the highest version among store's embedded migrations.
func LatestMigration() (int64, error) {
	entries, err := fs.ReadDir(store.Migrations(), ".")
	if err != nil {
		return 0, fmt.Errorf("ops: read embedded migrations: %w", err)
	}
	var latest int64
	for _, e := range entries {
		prefix, _, ok := strings.Cut(e.Name(), "_")
		if !ok || !strings.HasSuffix(e.Name(), ".sql") {
			continue
		}
		v, err := strconv.ParseInt(prefix, 10, 64)
		if err != nil {
			continue
		}
		latest = max(latest, v)
	}
	return latest, nil
}

// CheckMigrated returns nil if the database holds every embedded migration (a newer schema
// is fine), and an error wrapping ErrNotMigrated that names both versions otherwise.
func (s *Store) CheckMigrated(ctx context.Context) error {
	want, err := LatestMigration()
	if err != nil {
		return err
	}
	var (
		have   int64
		exists bool
	)
	// Two statements: a query naming a table that does not exist fails at planning time,
	// whatever CASE guards it.
	err = s.pool.QueryRow(ctx, `SELECT to_regclass('goose_db_version') IS NOT NULL`).Scan(&exists)
	if err == nil && exists {
		err = s.pool.QueryRow(ctx, `SELECT COALESCE(max(version_id), 0) FROM goose_db_version WHERE is_applied`).Scan(&have)
	}
	if err != nil {
		return fmt.Errorf("ops: read the schema version: %w", err)
	}
	if have < want {
		return fmt.Errorf("%w (the database is at version %d, this binary needs %d)", ErrNotMigrated, have, want)
	}
	return nil
}

// Result is one results row of a job, without its data.
type Result struct {
	ObservationKey string          `json:"observation_key"`
	ParserVersion  int             `json:"parser_version"`
	Fingerprint    string          `json:"response_fingerprint"`
	Fence          int64           `json:"fence"`
	CreatedAt      time.Time       `json:"created_at"`
	Data           json.RawMessage `json:"data"` // the stored record
}

// ResultListByJob returns the results of the job with key, oldest first (a healthy
// complete job has exactly one).
func (s *Store) ResultListByJob(ctx context.Context, key string) ([]Result, error) {
	rows, _ := s.pool.Query(ctx, `
SELECT observation_key, parser_version, response_fingerprint, fence, created_at, data
FROM results WHERE job_key = $1 ORDER BY created_at, observation_key`, key)
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Result, error) {
		var x Result
		err := r.Scan(&x.ObservationKey, &x.ParserVersion, &x.Fingerprint, &x.Fence, &x.CreatedAt, &x.Data)
		return x, err
	})
	if err != nil {
		return nil, fmt.Errorf("ops: ResultListByJob %q: %w", key, err)
	}
	return out, nil
}

// OutboxEvent is one outbox row, without its payload.
type OutboxEvent struct {
	EventKey  string    `json:"event_key"`
	Topic     string    `json:"topic"`
	CreatedAt time.Time `json:"created_at"`
	// SentAt is nil while the event is not dispatched yet (in front of its topic's outbox
	// position); once dispatched, the time its topic's position last moved, at or after the
	// dispatch (the row's own mark for rows dispatched before migration 00020).
	SentAt *time.Time `json:"sent_at"`
}

// OutboxGetByEventKey returns the outbox event with eventKey, or nil if there is none.
func (s *Store) OutboxGetByEventKey(ctx context.Context, eventKey string) (*OutboxEvent, error) {
	var x OutboxEvent
	err := s.pool.QueryRow(ctx, `SELECT o.event_key, o.topic, o.created_at, CASE WHEN (o.xid, o.id) <= (p.xid, p.id) THEN COALESCE(o.sent_at, p.updated_at) END
		FROM outbox o LEFT JOIN outbox_positions p ON p.topic = o.topic WHERE o.event_key = $1`, eventKey).
		Scan(&x.EventKey, &x.Topic, &x.CreatedAt, &x.SentAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("ops: OutboxGetByEventKey %q: %w", eventKey, err)
	}
	return &x, nil
}

// ProblemJob is one failed or retryable job, as the job list shows it.
type ProblemJob struct {
	Key           string     `json:"key"`
	Kind          string     `json:"kind"`
	State         string     `json:"state"`
	Attempts      int        `json:"attempts"`
	Category      string     `json:"category"`
	UpdatedAt     time.Time  `json:"updated_at"`
	NextAttemptAt *time.Time `json:"next_attempt_at"`
}

// JobListProblems returns up to limit failed and retryable jobs, most recently updated
// first (JobList without a filter).
func (s *Store) JobListProblems(ctx context.Context, limit int) ([]ProblemJob, error) {
	return s.JobList(ctx, JobFilter{Limit: limit})
}

// Note is one job_notes row: an operator's action on a job.
type Note struct {
	Action           string    `json:"action"` // NoteRequeue
	Actor            string    `json:"by"`
	Note             string    `json:"note"`
	PreviousState    string    `json:"previous_state"`
	PreviousCategory string    `json:"previous_category"`
	AttemptsBefore   int       `json:"attempts_before"`
	CreatedAt        time.Time `json:"at"`
}

// NoteRequeue is the action of a JobRequeue note.
const NoteRequeue = "requeue"

// NoteListByJob returns the operator notes of the job with key, oldest first.
func (s *Store) NoteListByJob(ctx context.Context, key string) ([]Note, error) {
	rows, _ := s.pool.Query(ctx, `
SELECT action, actor, note, previous_state, COALESCE(previous_category, ''), attempts_before, created_at
FROM job_notes WHERE job_key = $1 ORDER BY id`, key)
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Note, error) {
		var x Note
		err := r.Scan(&x.Action, &x.Actor, &x.Note, &x.PreviousState, &x.PreviousCategory, &x.AttemptsBefore, &x.CreatedAt)
		return x, err
	})
	if err != nil {
		return nil, fmt.Errorf("ops: NoteListByJob %q: %w", key, err)
	}
	return out, nil
}

// Status is everything recorded about one job: the row, its attempts (the timeline), its
// results, its outbox event, the operators' notes and where its retry budget starts.
type Status struct {
	Job      store.Job
	Attempts []store.Attempt
	Results  []Result
	EventKey string
	Outbox   *OutboxEvent // nil: no event with EventKey
	Notes    []Note
	Budget   Budget
	// Quarantine is the staging set aside when a unit lost its session and was replayed
	// from step 1: the half that was never merged with the replay's.
	Quarantine []Quarantined
}

// Quarantined is one quarantine row of a job.
type Quarantined struct {
	AttemptNo int             `json:"attempt_no"`
	SessionID string          `json:"session_id"`
	Reason    string          `json:"reason"`
	Staged    json.RawMessage `json:"staged"`
	CreatedAt time.Time       `json:"created_at"`
}

// QuarantineListByJob returns the quarantined staging of the job with key, oldest first.
func (s *Store) QuarantineListByJob(ctx context.Context, key string) ([]Quarantined, error) {
	rows, _ := s.pool.Query(ctx, `
SELECT attempt_no, session_id, reason, COALESCE(staged, 'null'::jsonb), created_at
FROM quarantine WHERE job_key = $1 ORDER BY id`, key)
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Quarantined, error) {
		var x Quarantined
		err := r.Scan(&x.AttemptNo, &x.SessionID, &x.Reason, &x.Staged, &x.CreatedAt)
		return x, err
	})
	if err != nil {
		return nil, fmt.Errorf("ops: QuarantineListByJob %q: %w", key, err)
	}
	return out, nil
}

// Budget is where a job's current retry budget starts (JobRequeue resets it): the runner's
// attempt cap counts attempts after Attempts, its bandwidth budget bytes after Bytes, its
// total time since Since (nil: since the job was created).
type Budget struct {
	Attempts int        `json:"attempts_before"`
	Bytes    int64      `json:"bytes_before"`
	Since    *time.Time `json:"since"`
}

// BudgetGet returns the retry budget start of the job with key (store.ErrJobNotFound if
// there is none).
func (s *Store) BudgetGet(ctx context.Context, key string) (Budget, error) {
	var b Budget
	err := s.pool.QueryRow(ctx, `SELECT budget_attempts, budget_bytes, budget_since FROM jobs WHERE key = $1`, key).
		Scan(&b.Attempts, &b.Bytes, &b.Since)
	if errors.Is(err, pgx.ErrNoRows) {
		return Budget{}, fmt.Errorf("ops: BudgetGet %q: %w", key, store.ErrJobNotFound)
	}
	if err != nil {
		return Budget{}, fmt.Errorf("ops: BudgetGet %q: %w", key, err)
	}
	return b, nil
}

// JobStatus reads the Status of the job with key; eventKey is the key of the job's outbox
// event (handlers.EventKey(key) for jobs run by the handlers runner). A missing job is an
// error wrapping store.ErrJobNotFound. The reads are separate statements: a job that
// changes meanwhile may show, e.g., an attempt newer than its row.
func (s *Store) JobStatus(ctx context.Context, key, eventKey string) (Status, error) {
	job, err := s.st.JobGet(ctx, key)
	if err != nil {
		return Status{}, err
	}
	st := Status{Job: job, EventKey: eventKey}
	if st.Attempts, err = s.st.AttemptList(ctx, key); err != nil {
		return Status{}, err
	}
	if st.Results, err = s.ResultListByJob(ctx, key); err != nil {
		return Status{}, err
	}
	if st.Outbox, err = s.OutboxGetByEventKey(ctx, eventKey); err != nil {
		return Status{}, err
	}
	if st.Notes, err = s.NoteListByJob(ctx, key); err != nil {
		return Status{}, err
	}
	if st.Budget, err = s.BudgetGet(ctx, key); err != nil {
		return Status{}, err
	}
	if st.Quarantine, err = s.QuarantineListByJob(ctx, key); err != nil {
		return Status{}, err
	}
	return st, nil
}

// ErrNotFailed: JobRequeue was asked to re-queue a job that is not failed.
var ErrNotFailed = errors.New("only a failed job can be re-queued")

// ErrKeyMismatch: JobRequeue was asked to re-queue a job whose recorded spec no longer
// derives its key with RequeueParams.Normalizer. KeyMismatchError wraps it.
var ErrKeyMismatch = errors.New("the job's recorded spec no longer derives its key")

// KeyMismatchError is JobRequeue's refusal of a job whose recorded spec derives another key
// (Derived) or none (Err: the spec is invalid under the current configuration). Such a job
// could never run again from the queue: enqueueing its spec would record a second job under
// Derived, and the reconciler refuses to enqueue it (reconciler_key_mismatch). It wraps
// ErrKeyMismatch.
type KeyMismatchError struct {
	Key     string // the job's key
	Derived string // the key its recorded spec derives now; "" when Err is set
	Err     error  // why the spec derives no key, or nil
}

func (e *KeyMismatchError) Error() string {
	if e.Err != nil {
		return fmt.Sprintf("job %q: its recorded spec derives no key now: %v", e.Key, e.Err)
	}
	return fmt.Sprintf("job %q: its recorded spec now derives key %q, not its own (the normaliser's "+
		"configuration, e.g. its tracking parameters, changed since the job was enqueued)", e.Key, e.Derived)
}

// Unwrap returns ErrKeyMismatch and the derivation error, if any.
func (e *KeyMismatchError) Unwrap() []error {
	if e.Err != nil {
		return []error{ErrKeyMismatch, e.Err}
	}
	return []error{ErrKeyMismatch}
}

// RequeueParams re-queues one failed job.
type RequeueParams struct {
	Key  string
	By   string // the operator, recorded on the note; required
	Note string // free text, optional; cut to 2000 bytes
	// Normalizer, when set, must derive Key from the job's recorded spec (SpecOf), or the
	// job is refused (KeyMismatchError) before anything is written. Set it to the
	// enqueuers' normaliser whenever the caller enqueues the job's task afterwards (as
	// `idemscrape requeue` does), so that a job which could never be enqueued again is not
	// made pending. Defaults to no check (nil), for callers that run the job under its key
	// themselves instead of enqueueing its spec.
	Normalizer *tasks.Normalizer
}

// maxNoteText bounds job_notes.note.
const maxNoteText = 2000

// JobRequeue moves a failed job back to pending with a fresh retry budget and records a
// job note (who, when, the state and category it left), in one statement. The budget is
// fresh because the job's budget_attempts, budget_bytes and budget_since are set to its
// attempts, bytes_total and now: the runner counts its attempt cap, bandwidth and total
// time from there (attempt numbers, bytes_total and created_at keep counting everything,
// as evidence). The fence is kept: fences never go back. It returns the job as updated.
//
// A job that is not failed is refused with an error wrapping ErrNotFailed (naming its
// state); a missing one with store.ErrJobNotFound; with p.Normalizer set, one whose recorded
// spec no longer derives its key with a *KeyMismatchError (wrapping ErrKeyMismatch), checked
// first. A refused job is left exactly as it was: no state change, no note. The caller then
// enqueues the job's task (tasks.Enqueuer, which also deletes an archived task holding the
// key); if that fails the job stays pending and the reconciler enqueues it.
func (s *Store) JobRequeue(ctx context.Context, p RequeueParams) (store.Job, error) {
	switch {
	case p.Key == "":
		return store.Job{}, errors.New("ops: JobRequeue: Key is empty")
	case strings.TrimSpace(p.By) == "":
		return store.Job{}, fmt.Errorf("ops: JobRequeue %q: By (who re-queues) is empty", p.Key)
	}
	if p.Normalizer != nil {
		// A separate read is enough: a job's spec columns are written once, when its row is
		// recorded, and never updated, so the spec checked here is the one re-queued below.
		job, err := s.st.JobGet(ctx, p.Key)
		switch {
		case errors.Is(err, store.ErrJobNotFound):
			return store.Job{}, fmt.Errorf("ops: JobRequeue %q: %w", p.Key, store.ErrJobNotFound)
		case err != nil:
			return store.Job{}, fmt.Errorf("ops: JobRequeue %q: %w", p.Key, err)
		}
		if derived, err := p.Normalizer.Key(SpecOf(job)); err != nil || derived != p.Key {
			return store.Job{}, fmt.Errorf("ops: JobRequeue: %w", &KeyMismatchError{Key: p.Key, Derived: derived, Err: err})
		}
	}
	note := p.Note
	if len(note) > maxNoteText {
		note = strings.ToValidUTF8(note[:maxNoteText], "")
	}
	var done bool
	err := s.pool.QueryRow(ctx, `
WITH old AS (
	SELECT key, last_category FROM jobs WHERE key = $1
), upd AS (
	UPDATE jobs j SET state = 'pending', next_attempt_at = NULL, last_category = NULL,
		budget_attempts = j.attempts, budget_bytes = j.bytes_total, budget_since = now(), updated_at = now()
	FROM old
	WHERE j.key = old.key AND j.state = 'failed'
	RETURNING j.key, j.attempts, old.last_category
), note AS (
	INSERT INTO job_notes (job_key, action, actor, note, previous_state, previous_category, attempts_before)
	SELECT key, $2, $3, $4, 'failed', last_category, attempts FROM upd
)
SELECT EXISTS (SELECT 1 FROM upd)`, p.Key, NoteRequeue, strings.ReplaceAll(p.By, "\x00", ""),
		strings.ReplaceAll(note, "\x00", "")).Scan(&done)
	if err != nil {
		return store.Job{}, fmt.Errorf("ops: JobRequeue %q: %w", p.Key, err)
	}
	job, err := s.st.JobGet(ctx, p.Key)
	switch {
	case errors.Is(err, store.ErrJobNotFound):
		return store.Job{}, fmt.Errorf("ops: JobRequeue %q: %w", p.Key, store.ErrJobNotFound)
	case err != nil:
		return store.Job{}, err
	case !done:
		return store.Job{}, fmt.Errorf("ops: JobRequeue %q: the job is %s: %w", p.Key, job.State, ErrNotFailed)
	}
	return job, nil
}

// SpecOf returns the job's spec as recorded on its row (normalised when it was enqueued),
// for enqueueing its task again.
func SpecOf(job store.Job) tasks.Spec {
	return tasks.Spec{Kind: job.Kind, URL: job.URL, SourceID: job.SourceID, Country: job.Country,
		Window: job.Window, ParserVersion: job.ParserVersion, Scope: job.Scope}
}

// JobBudgetExempt takes one finished attempt out of the job's retry budget: the attempt
// and its bytes stay in the history (attempts, bytes_total), but the runner's attempt cap
// and bandwidth budget no longer count them. The runner calls it for an attempt that met a
// proxy incident (a 407: the account's failure, not the job's). Fenced like every
// transition: it applies only while the job's fence is still token, and reports whether it
// did.
func (s *Store) JobBudgetExempt(ctx context.Context, key string, token, bytes int64) (bool, error) {
	if bytes < 0 {
		return false, fmt.Errorf("ops: JobBudgetExempt %q: bytes %d must be >= 0", key, bytes)
	}
	tag, err := s.pool.Exec(ctx, `
UPDATE jobs SET budget_attempts = budget_attempts + 1,
	budget_bytes = LEAST(budget_bytes + $3, bytes_total)
WHERE key = $1 AND fence = $2 AND budget_attempts < attempts`, key, token, bytes)
	if err != nil {
		return false, fmt.Errorf("ops: JobBudgetExempt %q: %w", key, err)
	}
	return tag.RowsAffected() == 1, nil
}
