package store

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemscrape/idemscrape/tasks"
)

// MaintenanceStore is what the reconciler needs from the system of record: keyset-paged
// sweeps of stranded jobs, the fenced rescue of a running job, and its action counters.
type MaintenanceStore interface {
	JobsListRunning(ctx context.Context, p JobsListParams) ([]RunningJob, error)
	JobsListRunnable(ctx context.Context, p JobsListParams) ([]Job, error)
	JobRescue(ctx context.Context, p JobRescueParams) error
	JobsRescue(ctx context.Context, ps []JobRescueParams) ([]error, error)
	CountersAdd(ctx context.Context, deltas map[string]int64) error
}

var _ MaintenanceStore = (*PG)(nil)

// Sweep paging limits for JobsListRunning and JobsListRunnable.
const (
	// DefaultListLimit is the page size when JobsListParams.Limit is 0.
	DefaultListLimit = 1000
	// MaxListLimit bounds JobsListParams.Limit.
	MaxListLimit = 10000
)

// CategoryLeaseExpired is the failure category JobRescue records: the worker's lease
// expired while its attempt was running.
const CategoryLeaseExpired = "lease_expired"

// JobsListParams selects one keyset page of a reconciler sweep.
type JobsListParams struct {
	// AfterKey: only jobs whose key sorts after it (the last key of the previous page; ""
	// for the first page). Keys compare in the database's collation, as ORDER BY key does.
	AfterKey string
	// Limit is the page size. Defaults to DefaultListLimit (when 0); at most MaxListLimit.
	// A page shorter than Limit is the last one.
	Limit int
	// StartedBefore (JobsListRunning): only jobs whose current attempt started before it.
	// attempts.started_at is written with the database's clock. Zero means no bound.
	StartedBefore time.Time
	// DueBefore (JobsListRunnable): only jobs with no next_attempt_at or one at or before
	// it. Zero means no bound (every pending and retryable job).
	DueBefore time.Time
}

func (p JobsListParams) limit(op string) (int, error) {
	switch {
	case p.Limit < 0 || p.Limit > MaxListLimit:
		return 0, fmt.Errorf("store: %s: Limit %d must be in 0..%d", op, p.Limit, MaxListLimit)
	case p.Limit == 0:
		return DefaultListLimit, nil
	}
	return p.Limit, nil
}

func timeOrNil(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	return &t
}

// RunningJob is a running job and the attempt it runs under (attempts.fence = jobs.fence).
type RunningJob struct {
	Key              string    `db:"key"`
	Kind             string    `db:"kind"`
	Fence            int64     `db:"fence"` // the job's fence: JobRescue's ExpectFence
	AttemptNo        int       `db:"attempt_no"`
	AttemptStartedAt time.Time `db:"started_at"`
	Worker           string    `db:"worker"`
	Queue            string    `db:"queue"` // the asynq queue recorded at creation ("" none: the kind's)
	// The job's spec, to enqueue it again once rescued (see Spec).
	URL           string `db:"url"`
	SourceID      string `db:"source_id"`
	Country       string `db:"country"`
	Window        string `db:"window"`
	ParserVersion int    `db:"parser_version"`
	Scope         string `db:"scope"`
}

// Spec returns the job's spec, as tasks.Enqueuer takes it.
func (j RunningJob) Spec() tasks.Spec {
	return tasks.Spec{Kind: j.Kind, URL: j.URL, SourceID: j.SourceID, Country: j.Country, Window: j.Window,
		ParserVersion: j.ParserVersion, Scope: j.Scope}
}

// JobsListRunning returns one page of running jobs in key order (key > p.AfterKey, at most
// p.Limit), each with its current attempt and its spec, keeping those whose attempt started before
// p.StartedBefore. It reads through the partial index on running jobs, so a page costs
// in proportion to the running rows it passes, not to the table. The rows are a snapshot:
// a job may have moved on by the time the caller acts, which is why JobRescue is fenced.
func (s *PG) JobsListRunning(ctx context.Context, p JobsListParams) ([]RunningJob, error) {
	limit, err := p.limit("JobsListRunning")
	if err != nil {
		return nil, err
	}
	// The running attempt is described by the jobs row itself (migration 00016): no
	// attempts row exists until it ends.
	rows, _ := s.pool.Query(ctx, `
SELECT j.key, j.kind, j.fence, j.attempts AS attempt_no, COALESCE(j.attempt_started_at, j.updated_at) AS started_at,
	j.attempt_worker AS worker, COALESCE(j.queue, '') AS queue,
	COALESCE(j.url, '') AS url, COALESCE(j.source_id, '') AS source_id, j.country, j."window",
	j.parser_version, j.scope
FROM jobs j
WHERE j.state = 'running' AND j.key > $1
	AND ($2::timestamptz IS NULL OR COALESCE(j.attempt_started_at, j.updated_at) < $2)
ORDER BY j.key
LIMIT $3`, p.AfterKey, timeOrNil(p.StartedBefore), limit)
	out, err := pgx.CollectRows(rows, pgx.RowToStructByName[RunningJob])
	if err != nil {
		return nil, fmt.Errorf("store: JobsListRunning: %w", err)
	}
	return out, nil
}

// JobsListRunnable returns one page of pending and retryable jobs in key order (key >
// p.AfterKey, at most p.Limit) that are due: no next_attempt_at, or one at or before
// p.DueBefore. A Job carries the spec fields (Kind, URL, SourceID, Country, Window,
// ParserVersion, Scope) to rebuild its tasks.Spec and re-enqueue it. It reads through the
// partial index on pending and retryable jobs.
func (s *PG) JobsListRunnable(ctx context.Context, p JobsListParams) ([]Job, error) {
	limit, err := p.limit("JobsListRunnable")
	if err != nil {
		return nil, err
	}
	rows, _ := s.pool.Query(ctx, `
SELECT `+jobColumns+`
FROM jobs
WHERE state IN ('pending', 'retryable') AND key > $1
	AND ($2::timestamptz IS NULL OR next_attempt_at IS NULL OR next_attempt_at <= $2)
ORDER BY key
LIMIT $3`, p.AfterKey, timeOrNil(p.DueBefore), limit)
	out, err := pgx.CollectRows(rows, pgx.RowToStructByName[Job])
	if err != nil {
		return nil, fmt.Errorf("store: JobsListRunnable: %w", err)
	}
	return out, nil
}

// ActivityCursor is a position among pending and retryable jobs ordered by activity
// time — GREATEST(updated_at, next_attempt_at): when the row last changed or when it comes
// due, whichever is later — then key.
type ActivityCursor struct {
	At  time.Time
	Key string
}

// Activity is the job's activity time (see ActivityCursor).
func (j Job) Activity() time.Time {
	if j.NextAttemptAt != nil && j.NextAttemptAt.After(j.UpdatedAt) {
		return *j.NextAttemptAt
	}
	return j.UpdatedAt
}

// JobsListRunnableActive returns one page of pending and retryable jobs whose activity
// time is after the cursor and at or before until, in (activity, key) order, at most
// limit (JobsListParams' bounds); and the cursor after the page. It reads through the
// activity index (migration 00011), so its cost follows the jobs that changed or came due,
// not the backlog.
func (s *PG) JobsListRunnableActive(ctx context.Context, after ActivityCursor, until time.Time, limit int) ([]Job, ActivityCursor, error) {
	limit, err := JobsListParams{Limit: limit}.limit("JobsListRunnableActive")
	if err != nil {
		return nil, after, err
	}
	rows, _ := s.pool.Query(ctx, `
SELECT `+jobColumns+`
FROM jobs
WHERE state IN ('pending', 'retryable')
	AND (GREATEST(updated_at, next_attempt_at), key) > ($1::timestamptz, $2::text)
	AND GREATEST(updated_at, next_attempt_at) <= $3
ORDER BY GREATEST(updated_at, next_attempt_at), key
LIMIT $4`, after.At, after.Key, until, limit)
	out, err := pgx.CollectRows(rows, pgx.RowToStructByName[Job])
	if err != nil {
		return nil, after, fmt.Errorf("store: JobsListRunnableActive: %w", err)
	}
	if len(out) > 0 {
		last := out[len(out)-1]
		after = ActivityCursor{At: last.Activity(), Key: last.Key}
	}
	return out, after, nil
}

// JobRescueParams moves a running job whose worker's lease expired back to retryable.
type JobRescueParams struct {
	Key string
	// ExpectFence is the fence of the stranded attempt (RunningJob.Fence).
	ExpectFence int64
	// Token is the fencing token of the lease the rescuer claimed for the job; it must
	// exceed ExpectFence. The job's fence is raised to it.
	Token int64
	// Error is recorded on the stranded attempt, e.g. "lease expired; rescued by
	// reconciler host/pid"; free of credentials, cut to 2000 bytes.
	Error string
}

// JobRescue moves the job from running to retryable, in one statement, only if it is
// still running under p.ExpectFence and p.Token is higher: the job's fence is raised to
// p.Token (so the stale worker holding p.ExpectFence is refused from then on, its commit
// included), next_attempt_at is now and last_category is lease_expired; the attempt
// started with p.ExpectFence, if still running, is written as lost (category
// lease_expired, finished now, p.Error) and awaits its worker's bytes (AttemptSupersede).
// jobs.attempts is not raised: a rescue is not an attempt.
//
// The statement and a live worker's Commit or finish lock the same row and test the same
// fence, so exactly one of them wins. A refused rescue writes nothing and returns a
// *TransitionError: ErrStaleFence when the job runs under another fence or was already
// moved past p.ExpectFence (e.g. by another reconciler), ErrJobComplete / ErrJobFailed
// when it finished, ErrInvalidTransition when it is not running, ErrJobNotFound.
func (s *PG) JobRescue(ctx context.Context, p JobRescueParams) error {
	switch {
	case p.Key == "":
		return errors.New("store: JobRescue: Key is empty")
	case p.ExpectFence < 1:
		return fmt.Errorf("store: JobRescue %q: ExpectFence %d must be >= 1", p.Key, p.ExpectFence)
	case p.Token <= p.ExpectFence:
		return fmt.Errorf("store: JobRescue %q: Token %d must exceed ExpectFence %d", p.Key, p.Token, p.ExpectFence)
	}
	var (
		done, found bool
		state       string
		fence       int64
	)
	err := s.pool.QueryRow(ctx, `
WITH cur AS (
	SELECT state, fence FROM jobs WHERE key = $1
), upd AS (
	UPDATE jobs SET state = 'retryable', fence = $3, next_attempt_at = now(),
		last_category = $5, updated_at = now()
	WHERE key = $1 AND state = 'running' AND fence = $2 AND fence < $3
	RETURNING attempts, country, attempt_worker, attempt_session, attempt_endpoint, attempt_started_at,
		attempt_reserved_micros, attempt_currency, attempt_provider, attempt_tier
), att AS (
	INSERT INTO attempts AS a (job_key, attempt_no, fence, worker, session_id, country, proxy_endpoint,
		started_at, finished_at, outcome, category, error, evidence_due, cost_micros, currency, provider, tier)
	SELECT $1, u.attempts, $2, u.attempt_worker, u.attempt_session, u.country, u.attempt_endpoint,
		COALESCE(u.attempt_started_at, now()), now(), 'lost', $5, NULLIF($4, ''), true,
		u.attempt_reserved_micros, CASE WHEN u.attempt_reserved_micros > 0 THEN u.attempt_currency END,
		u.attempt_provider, u.attempt_tier
	FROM upd u WHERE u.attempts > 0
	ON CONFLICT (job_key, fence) DO UPDATE SET outcome = 'lost', category = EXCLUDED.category,
		finished_at = now(), error = EXCLUDED.error, evidence_due = true
	WHERE a.outcome = 'running'
)
SELECT EXISTS (SELECT 1 FROM upd), cur.state IS NOT NULL, COALESCE(cur.state, ''), COALESCE(cur.fence, 0)
FROM (SELECT 1) AS one LEFT JOIN cur ON true`,
		p.Key, p.ExpectFence, p.Token, truncateUTF8(p.Error, maxErrorText), CategoryLeaseExpired,
	).Scan(&done, &found, &state, &fence)
	if err != nil {
		return fmt.Errorf("store: JobRescue %q: %w", p.Key, err)
	}
	if done {
		return nil
	}
	return s.refusal(ctx, "JobRescue", p.Key, p.Token, found, state, fence, rescueStale(p.ExpectFence))
}

// MaxRescueBatch bounds the rows of one JobsRescue call.
const MaxRescueBatch = MaxListLimit

// JobsRescue is JobRescue for a batch of distinct jobs, in ONE statement: each row is
// moved from running to retryable exactly as JobRescue would (only if it is still running
// under its ExpectFence and its Token is higher; fence raised to Token, next_attempt_at
// now, last_category lease_expired; the attempt started with ExpectFence, if still
// running, is written as lost with its Error and evidence_due), and each row is fenced on
// its own: a refused row writes nothing and does not hold back the others.
//
// It returns one error per element of ps, in order: nil when rescued, a *TransitionError
// (Op "JobRescue", classified as JobRescue classifies it) when refused, or an error naming
// the field when the element is invalid (then it is not sent; a key given twice is invalid
// the second time). The second return value is non-nil only when the statement failed as
// a whole: then nothing was written.
//
// The jobs rows are locked first, in key order, before any attempts row (as JobRescue,
// Commit and the finishes — JobComplete, JobMarkRetryable, JobFail — lock the jobs row
// first), so two batches can not deadlock with each
// other; a refused row's state and fence are read under that lock, so the classification
// is what a live worker's commit left, not the statement's snapshot. A batch races a
// worker's commit exactly like JobRescue: one of them wins per job.
func (s *PG) JobsRescue(ctx context.Context, ps []JobRescueParams) ([]error, error) {
	if len(ps) > MaxRescueBatch {
		return nil, fmt.Errorf("store: JobsRescue: %d rows, at most %d", len(ps), MaxRescueBatch)
	}
	errs := make([]error, len(ps))
	idx := make(map[string]int, len(ps)) // key → index in ps of the row sent
	var keys, msgs []string
	var expect, tokens []int64
	for i, p := range ps {
		switch {
		case p.Key == "":
			errs[i] = fmt.Errorf("store: JobsRescue row %d: Key is empty", i)
		case p.ExpectFence < 1:
			errs[i] = fmt.Errorf("store: JobsRescue %q: ExpectFence %d must be >= 1", p.Key, p.ExpectFence)
		case p.Token <= p.ExpectFence:
			errs[i] = fmt.Errorf("store: JobsRescue %q: Token %d must exceed ExpectFence %d", p.Key, p.Token, p.ExpectFence)
		default:
			if j, dup := idx[p.Key]; dup {
				errs[i] = fmt.Errorf("store: JobsRescue %q: Key given twice (rows %d and %d)", p.Key, j, i)
				continue
			}
			idx[p.Key] = i
			keys = append(keys, p.Key)
			expect = append(expect, p.ExpectFence)
			tokens = append(tokens, p.Token)
			msgs = append(msgs, truncateUTF8(p.Error, maxErrorText))
		}
	}
	if len(keys) == 0 {
		return errs, nil
	}
	// lk locks the jobs rows in key order (LockRows above the Sort) and returns each row's
	// newest version; upd and att act only on rows lk locked, so every attempts row is
	// locked after its jobs row.
	rows, _ := s.pool.Query(ctx, `
WITH input AS (
	SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::text[]) AS t(key, expect, token, error)
), lk AS MATERIALIZED (
	SELECT j.key, j.state, j.fence FROM jobs j
	WHERE j.key = ANY ($1::text[])
	ORDER BY j.key
	FOR UPDATE OF j
), upd AS (
	UPDATE jobs j SET state = 'retryable', fence = i.token, next_attempt_at = now(),
		last_category = $5, updated_at = now()
	FROM lk JOIN input i USING (key)
	WHERE j.key = lk.key AND lk.state = 'running' AND lk.fence = i.expect AND lk.fence < i.token
		AND j.state = 'running' AND j.fence = i.expect
	RETURNING j.key, i.expect, i.error, j.attempts, j.country, j.attempt_worker, j.attempt_session,
		j.attempt_endpoint, j.attempt_started_at, j.attempt_reserved_micros, j.attempt_currency,
		j.attempt_provider, j.attempt_tier
), att AS (
	INSERT INTO attempts AS a (job_key, attempt_no, fence, worker, session_id, country, proxy_endpoint,
		started_at, finished_at, outcome, category, error, evidence_due, cost_micros, currency, provider, tier)
	SELECT u.key, u.attempts, u.expect, u.attempt_worker, u.attempt_session, u.country, u.attempt_endpoint,
		COALESCE(u.attempt_started_at, now()), now(), 'lost', $5, NULLIF(u.error, ''), true,
		u.attempt_reserved_micros, CASE WHEN u.attempt_reserved_micros > 0 THEN u.attempt_currency END,
		u.attempt_provider, u.attempt_tier
	FROM upd u WHERE u.attempts > 0
	ON CONFLICT (job_key, fence) DO UPDATE SET outcome = 'lost', category = EXCLUDED.category,
		finished_at = now(), error = EXCLUDED.error, evidence_due = true
	WHERE a.outcome = 'running'
)
SELECT i.key, upd.key IS NOT NULL, lk.key IS NOT NULL, COALESCE(lk.state, ''), COALESCE(lk.fence, 0)
FROM input i
LEFT JOIN upd ON upd.key = i.key
LEFT JOIN lk ON lk.key = i.key`, keys, expect, tokens, msgs, CategoryLeaseExpired)
	type row struct {
		done, found bool
		state       string
		fence       int64
	}
	got := make(map[string]row, len(keys))
	var key string
	var r row
	_, err := pgx.ForEachRow(rows, []any{&key, &r.done, &r.found, &r.state, &r.fence}, func() error {
		got[key] = r
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("store: JobsRescue (%d rows): %w", len(keys), err)
	}
	for k, i := range idx {
		r, ok := got[k]
		switch {
		case !ok:
			errs[i] = fmt.Errorf("store: JobsRescue %q: no result row", k)
		case !r.done:
			errs[i] = classifyRefusal("JobRescue", k, ps[i].Token, r.found, r.state, r.fence, rescueStale(ps[i].ExpectFence))
		}
	}
	return errs, nil
}

// classifyRefusal tells which sentinel a refused transition wraps, from the row as read
// (under its lock by the rescue; again, after the statement, by PG.refusal).
func classifyRefusal(op, key string, token int64, found bool, state string, fence int64,
	stale func(state tasks.JobState, fence int64) bool) *TransitionError {
	te := &TransitionError{Op: op, Key: key, State: tasks.JobState(state), Fence: fence, Token: token}
	switch {
	case !found:
		te.Err = ErrJobNotFound
	case te.State == tasks.StateComplete:
		te.Err = ErrJobComplete
	case te.State == tasks.StateFailed:
		te.Err = ErrJobFailed
	case stale(te.State, fence):
		te.Err = ErrStaleFence
	default:
		te.Err = ErrInvalidTransition
	}
	return te
}

// rescueStale: a rescue is refused for its fence when the job runs under another fence,
// or when the fence has already moved past the expected one (someone else acted first).
func rescueStale(expect int64) func(tasks.JobState, int64) bool {
	return func(state tasks.JobState, fence int64) bool {
		return state == tasks.StateRunning || fence > expect
	}
}

// CountersAdd adds each delta to its named maintenance counter (created at 0 when new), in
// one statement. Any number of reconcilers may add at once; no increment is lost. Names
// must not be empty; an empty map is a no-op.
func (s *PG) CountersAdd(ctx context.Context, deltas map[string]int64) error {
	if len(deltas) == 0 {
		return nil
	}
	names := make([]string, 0, len(deltas))
	for name := range deltas {
		if name == "" {
			return errors.New("store: CountersAdd: empty counter name")
		}
		names = append(names, name)
	}
	// One order for every caller: concurrent upserts of overlapping names then lock the
	// rows in the same order and can not deadlock.
	sort.Strings(names)
	ns := make([]int64, len(names))
	for i, name := range names {
		ns[i] = deltas[name]
	}
	_, err := s.pool.Exec(ctx, `
INSERT INTO maintenance_counters (name, n, updated_at)
SELECT name, n, now() FROM unnest($1::text[], $2::bigint[]) WITH ORDINALITY AS t(name, n, ord)
ORDER BY ord
ON CONFLICT (name) DO UPDATE SET n = maintenance_counters.n + EXCLUDED.n, updated_at = now()`, names, ns)
	if err != nil {
		return fmt.Errorf("store: CountersAdd: %w", err)
	}
	return nil
}

// RequeueMarker is PostgreSQL's record of one asynq queue's "tasks checked" marker (table
// reconciler_markers, migration 00018): the epoch the marker in Redis must hold, and the
// highest seq a sweep recorded having incremented it to. The reconciler
// (scheduler/reconciler_requeue.go) compares the marker with it to tell that the queue's
// Redis node lost or rolled back its data.
type RequeueMarker struct {
	Epoch string
	Seq   int64
}

// RequeueMarkers returns the markers recorded under the reconciler key prefix, by queue,
// in one statement.
func (s *PG) RequeueMarkers(ctx context.Context, prefix string) (map[string]RequeueMarker, error) {
	rows, _ := s.pool.Query(ctx, `SELECT queue, epoch, seq FROM reconciler_markers WHERE prefix = $1`, prefix)
	out := map[string]RequeueMarker{}
	var q string
	var m RequeueMarker
	_, err := pgx.ForEachRow(rows, []any{&q, &m.Epoch, &m.Seq}, func() error {
		out[q] = m
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("store: RequeueMarkers (table reconciler_markers, migration 00018): %w", err)
	}
	return out, nil
}

// RequeueMarkersAdvance records, for each queue of seen, that its marker reached seen[queue].Seq
// in epoch seen[queue].Epoch: the row's seq becomes the greater of the two, and only while
// the row still holds that epoch (a reconciler that replaced it meanwhile wins). One
// statement; the rows are locked in queue order, so concurrent calls can not deadlock.
// Queues without a row are ignored; an empty map is a no-op.
func (s *PG) RequeueMarkersAdvance(ctx context.Context, prefix string, seen map[string]RequeueMarker) error {
	if len(seen) == 0 {
		return nil
	}
	queues := make([]string, 0, len(seen))
	for q, m := range seen {
		switch {
		case q == "":
			return errors.New("store: RequeueMarkersAdvance: empty queue name")
		case m.Epoch == "":
			return fmt.Errorf("store: RequeueMarkersAdvance: queue %q: empty epoch", q)
		case m.Seq < 0:
			return fmt.Errorf("store: RequeueMarkersAdvance: queue %q: seq %d is negative", q, m.Seq)
		}
		queues = append(queues, q)
	}
	sort.Strings(queues)
	epochs := make([]string, len(queues))
	seqs := make([]int64, len(queues))
	for i, q := range queues {
		epochs[i], seqs[i] = seen[q].Epoch, seen[q].Seq
	}
	_, err := s.pool.Exec(ctx, `
WITH t AS (
	SELECT * FROM unnest($2::text[], $3::text[], $4::bigint[]) AS t(queue, epoch, seq)
), lk AS MATERIALIZED (
	SELECT m.queue FROM reconciler_markers m JOIN t USING (queue, epoch)
	WHERE m.prefix = $1 AND m.seq < t.seq
	ORDER BY m.queue
	FOR UPDATE OF m
)
UPDATE reconciler_markers m SET seq = GREATEST(m.seq, t.seq), updated_at = now()
FROM lk JOIN t USING (queue)
WHERE m.prefix = $1 AND m.queue = lk.queue AND m.epoch = t.epoch`, prefix, queues, epochs, seqs)
	if err != nil {
		return fmt.Errorf("store: RequeueMarkersAdvance (%d queues): %w", len(queues), err)
	}
	return nil
}

// RequeueMarkerReplace starts a new epoch for queue's marker, seq 0, only if the row still
// holds old ("" for no row: the row is created): a compare-and-set, so that of several
// reconcilers that each checked the queue after a loss exactly one epoch is recorded. It
// reports whether this call replaced (or created) it.
func (s *PG) RequeueMarkerReplace(ctx context.Context, prefix, queue, old, next string) (bool, error) {
	switch {
	case queue == "":
		return false, errors.New("store: RequeueMarkerReplace: empty queue name")
	case next == "":
		return false, fmt.Errorf("store: RequeueMarkerReplace: queue %q: empty new epoch", queue)
	}
	var sql string
	args := []any{prefix, queue, next}
	if old == "" {
		sql = `INSERT INTO reconciler_markers (prefix, queue, epoch) VALUES ($1, $2, $3) ON CONFLICT (prefix, queue) DO NOTHING`
	} else {
		sql = `UPDATE reconciler_markers SET epoch = $3, seq = 0, updated_at = now() WHERE prefix = $1 AND queue = $2 AND epoch = $4`
		args = append(args, old)
	}
	tag, err := s.pool.Exec(ctx, sql, args...)
	if err != nil {
		return false, fmt.Errorf("store: RequeueMarkerReplace %q: %w", queue, err)
	}
	return tag.RowsAffected() == 1, nil
}
