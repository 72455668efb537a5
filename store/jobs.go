package store

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/idemscrape/idemscrape/tasks"
)

// Job is one jobs row.
type Job struct {
	Key           string         `db:"key"`
	Kind          string         `db:"kind"`
	URL           string         `db:"url"`
	SourceID      string         `db:"source_id"`
	Country       string         `db:"country"`
	Window        string         `db:"window"`
	ParserVersion int            `db:"parser_version"`
	Scope         string         `db:"scope"`
	Queue         string         `db:"queue"` // the asynq queue recorded at creation ("" none: the kind's)
	State         tasks.JobState `db:"state"`
	Fence         int64          `db:"fence"`
	Attempts      int            `db:"attempts"`
	NextAttemptAt *time.Time     `db:"next_attempt_at"`
	LastCategory  string         `db:"last_category"`
	BytesTotal    int64          `db:"bytes_total"`
	CreatedAt     time.Time      `db:"created_at"`
	UpdatedAt     time.Time      `db:"updated_at"`
	CompletedAt   *time.Time     `db:"completed_at"`
}

// Attempt is one attempts row: the evidence of one execution of a job.
type Attempt struct {
	JobKey        string     `db:"job_key"`
	AttemptNo     int        `db:"attempt_no"`
	Fence         int64      `db:"fence"`
	Worker        string     `db:"worker"`
	SessionID     string     `db:"session_id"`
	Country       string     `db:"country"`
	ProxyEndpoint string     `db:"proxy_endpoint"`
	StartedAt     time.Time  `db:"started_at"`
	FinishedAt    *time.Time `db:"finished_at"`
	HTTPStatus    int        `db:"http_status"`
	Bytes         int64      `db:"bytes"`
	Outcome       string     `db:"outcome"`
	Category      string     `db:"category"`
	Error         string     `db:"error"`
	// CostMicros is what Bytes cost, micro-units of Currency (0: no price). A lost attempt
	// costs what it reserved of its window's money budget until its worker reports, and a
	// running one shows its reservation.
	CostMicros int64  `db:"cost_micros"`
	Currency   string `db:"currency"`
	// Provider is the configured name of the proxy account the attempt ran on, Tier its
	// tier (sessions.Tier): two accounts or tiers on one gateway differ here, not in
	// ProxyEndpoint. "" for attempts before migration 00019.
	Provider string `db:"provider"`
	Tier     string `db:"tier"`
	// SessionUnits is how many units the attempt's session had served before it: 0 for a
	// new session (and a running or lost attempt, and those before migration 00022), n > 0
	// for a warm one from the worker's session pool.
	SessionUnits int `db:"session_units"`
}

// Attempt outcomes recorded in attempts.outcome.
const (
	OutcomeRunning    = "running"
	OutcomeComplete   = "complete"
	OutcomeRetryable  = "retryable"
	OutcomeFailed     = "failed"
	OutcomeSuperseded = "superseded"
	// OutcomeLost: the attempt never ended by its worker's hand (killed, or stopped past its
	// lease); its row was written by whoever raised the fence next. Its worker, if it wakes
	// and reports, turns it into OutcomeSuperseded with its bytes (AttemptSupersede).
	OutcomeLost = "lost"
)

// maxErrorText bounds attempts.error; longer texts are cut at a rune boundary.
const maxErrorText = 2000

const jobColumns = `key, kind, COALESCE(url, '') AS url, COALESCE(source_id, '') AS source_id,
	country, "window", parser_version, scope, COALESCE(queue, '') AS queue, state, fence, attempts, next_attempt_at,
	COALESCE(last_category, '') AS last_category, bytes_total, created_at, updated_at, completed_at`

const attemptColumns = `job_key, attempt_no, fence, worker, session_id, country, proxy_endpoint,
	started_at, finished_at, COALESCE(http_status, 0) AS http_status, bytes, outcome,
	COALESCE(category, '') AS category, COALESCE(error, '') AS error, cost_micros, COALESCE(currency, '') AS currency,
	provider, tier, session_units`

// JobGet returns the jobs row with key, or ErrJobNotFound.
func (s *PG) JobGet(ctx context.Context, key string) (Job, error) {
	rows, _ := s.pool.Query(ctx, `SELECT `+jobColumns+` FROM jobs WHERE key = $1`, key)
	job, err := pgx.CollectExactlyOneRow(rows, pgx.RowToStructByName[Job])
	if errors.Is(err, pgx.ErrNoRows) {
		return Job{}, fmt.Errorf("JobGet %q: %w", key, ErrJobNotFound)
	}
	if err != nil {
		return Job{}, fmt.Errorf("store: JobGet %q: %w", key, err)
	}
	return job, nil
}

// AttemptList returns the attempts of the job with key, oldest first. An attempt still
// running has no attempts row yet (it is written when the attempt ends): it is read from
// the jobs row, with outcome OutcomeRunning and, as its cost, what it reserved of its
// window's money budget.
func (s *PG) AttemptList(ctx context.Context, key string) ([]Attempt, error) {
	rows, _ := s.pool.Query(ctx, `SELECT `+attemptColumns+` FROM attempts WHERE job_key = $1
UNION ALL
SELECT j.key, j.attempts, j.fence, j.attempt_worker, j.attempt_session, j.country, j.attempt_endpoint,
	COALESCE(j.attempt_started_at, j.updated_at), NULL, 0, 0, 'running', '', '',
	j.attempt_reserved_micros, COALESCE(j.attempt_currency, ''), j.attempt_provider, j.attempt_tier, 0
FROM jobs j WHERE j.key = $1 AND j.state = 'running'
	AND NOT EXISTS (SELECT 1 FROM attempts a WHERE a.job_key = j.key AND a.fence = j.fence)
ORDER BY attempt_no`, key)
	attempts, err := pgx.CollectRows(rows, pgx.RowToStructByName[Attempt])
	if err != nil {
		return nil, fmt.Errorf("store: AttemptList %q: %w", key, err)
	}
	return attempts, nil
}

// JobsRecord inserts a pending jobs row for every record whose key does not exist yet, in
// one statement, and reports for each record whether it was created and the row's state.
// Existing rows are never modified; a duplicate costs no dead tuple (ON CONFLICT DO
// NOTHING). Records must be normalised specs with their keys (tasks.Enqueuer does that).
func (s *PG) JobsRecord(ctx context.Context, records []tasks.JobRecord) ([]tasks.JobRecordResult, error) {
	if len(records) == 0 {
		return nil, nil
	}
	n := len(records)
	keys := make([]string, 0, n)
	kinds := make([]string, 0, n)
	urls := make([]*string, 0, n)
	sourceIDs := make([]*string, 0, n)
	countries := make([]string, 0, n)
	windows := make([]string, 0, n)
	versions := make([]int32, 0, n)
	scopes := make([]string, 0, n)
	queues := make([]*string, 0, n)
	firstAt := make(map[string]int, n) // a key twice in one call is recorded once
	for i, r := range records {
		if r.Key == "" {
			return nil, fmt.Errorf("store: JobsRecord: record with empty key (kind %q)", r.Spec.Kind)
		}
		if _, dup := firstAt[r.Key]; dup {
			continue
		}
		firstAt[r.Key] = i
		keys = append(keys, r.Key)
		kinds = append(kinds, r.Spec.Kind)
		urls = append(urls, nullIfEmpty(r.Spec.URL))
		sourceIDs = append(sourceIDs, nullIfEmpty(r.Spec.SourceID))
		countries = append(countries, r.Spec.Country)
		windows = append(windows, r.Spec.Window)
		versions = append(versions, int32(r.Spec.ParserVersion))
		scopes = append(scopes, r.Spec.Scope)
		queues = append(queues, nullIfEmpty(r.Queue))
	}

	// The outer SELECT sees the snapshot taken when the statement started, so a row that a
	// concurrent transaction committed after that point conflicts in the INSERT but is not
	// visible to the join: its state comes back NULL and is read again below.
	rows, _ := s.pool.Query(ctx, `
WITH input AS (
	SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::int[], $8::text[], $9::text[])
		AS t(key, kind, url, source_id, country, win, parser_version, scope, queue)
), ins AS (
	INSERT INTO jobs (key, kind, url, source_id, country, "window", parser_version, scope, queue)
	SELECT key, kind, url, source_id, country, win, parser_version, scope, queue FROM input
	ON CONFLICT (key) DO NOTHING
	RETURNING key, state, queue
)
SELECT input.key, ins.key IS NOT NULL, COALESCE(ins.state, jobs.state), jobs.next_attempt_at,
	COALESCE(ins.queue, jobs.queue, '')
FROM input
LEFT JOIN ins ON ins.key = input.key
LEFT JOIN jobs ON jobs.key = input.key AND ins.key IS NULL`,
		keys, kinds, urls, sourceIDs, countries, windows, versions, scopes, queues)

	byKey := make(map[string]tasks.JobRecordResult, len(keys))
	var unseen []string
	var (
		key     string
		created bool
		state   *string
		nextAt  *time.Time
		queue   string
	)
	_, err := pgx.ForEachRow(rows, []any{&key, &created, &state, &nextAt, &queue}, func() error {
		if state == nil {
			unseen = append(unseen, key)
			return nil
		}
		byKey[key] = tasks.JobRecordResult{Key: key, Created: created, State: tasks.JobState(*state), NextAttemptAt: nextAt, Queue: queue}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("store: JobsRecord: %w", err)
	}
	if len(unseen) > 0 {
		rows, _ := s.pool.Query(ctx, `SELECT key, state, next_attempt_at, COALESCE(queue, '') FROM jobs WHERE key = ANY($1)`, unseen)
		_, err := pgx.ForEachRow(rows, []any{&key, &state, &nextAt, &queue}, func() error {
			byKey[key] = tasks.JobRecordResult{Key: key, State: tasks.JobState(*state), NextAttemptAt: nextAt, Queue: queue}
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("store: JobsRecord: %w", err)
		}
	}

	out := make([]tasks.JobRecordResult, len(records))
	for i, r := range records {
		res, ok := byKey[r.Key]
		if !ok {
			return nil, fmt.Errorf("store: JobsRecord: job %q neither inserted nor found (deleted concurrently?)", r.Key)
		}
		if firstAt[r.Key] != i && res.Created {
			// Only the first occurrence of a key in the call created the row.
			res.Created = false
		}
		out[i] = res
	}
	return out, nil
}

// AttemptStartParams starts an attempt of a job under a fencing token.
type AttemptStartParams struct {
	Key string
	// Token is the fencing token from the lease claim, which must exceed the job's fence;
	// or 0: the start issues the token itself, the job's fence + 1 (StartedAttempt.Fence).
	Token         int64
	Worker        string // worker identity, e.g. host/pid
	SessionID     string // proxy session id, if known at start
	Country       string // requested exit country
	ProxyEndpoint string // redacted proxy endpoint, host:port only (the table refuses '@' and '/')
	// Owner identifies this start, unique per start (the runner passes its lease owner,
	// "<worker>/<random>", or the owner of the job's last start on that worker whose
	// outcome stayed unknown), recorded on the jobs row. A start whose reply was lost is
	// recognised by it, by the re-read that resolves the lost reply and by the start
	// itself when it is sent again (even after the first landed late): with the same
	// token, or 0, it reports the attempt the first started and writes nothing; with a
	// higher token it moves that attempt to it, writing the first's row as retryable
	// (CategoryRestarted). Neither is a takeover. Without an Owner, a lost start that
	// issued its token is sent again and takes the first over.
	Owner string
	// Reserved is what the attempt reserved of its window's money budget (zero: none),
	// recorded on the jobs row: the attempt, if written as lost by whoever raises the fence
	// past it (a takeover's start, the reconciler's rescue), carries it as its cost, since
	// a killed worker never reports what it spent (migration 00019).
	Reserved Cost
	// Provider and Tier name the proxy account and tier the attempt runs on (sessions.
	// Provider.Name, Tier), recorded with it: several accounts may share a gateway.
	// Optional; at most 64 bytes each.
	Provider, Tier string
}

// maxProviderName bounds AttemptStartParams.Provider and Tier.
const maxProviderName = 64

// check refuses a start's reservation, provider or tier that its row would not hold,
// naming the job.
func (p AttemptStartParams) check() error {
	if err := p.Reserved.check("JobStart", p.Key); err != nil {
		return err
	}
	switch {
	case len(p.Provider) > maxProviderName:
		return fmt.Errorf("store: JobStart %q: provider name of %d bytes is longer than %d", p.Key, len(p.Provider), maxProviderName)
	case len(p.Tier) > maxProviderName:
		return fmt.Errorf("store: JobStart %q: tier of %d bytes is longer than %d", p.Key, len(p.Tier), maxProviderName)
	}
	return nil
}

// StartedAttempt is what JobStart reports about the attempt it started.
type StartedAttempt struct {
	Fence        int64     // the fencing token the attempt runs under (AttemptStartParams.Token, or issued)
	AttemptNo    int       // 1 for the first attempt of the job
	JobCreatedAt time.Time // when the job was created
	BytesTotal   int64     // bytes of the job's earlier attempts (all of them: evidence)
	// TookOver: the job was running under an older token of another start (its lease
	// expired), whose attempt this start wrote as lost. A start recognised as its own
	// (AttemptStartParams.Owner) reports what its first send did.
	TookOver bool

	// The job's current retry budget, which an operator's requeue (store/ops.JobRequeue)
	// starts afresh; equal to the fields above until then. The runner applies its attempt
	// cap, bandwidth and total time budgets to these.
	BudgetAttemptNo int       // this attempt's number within the budget, from 1
	BudgetBytes     int64     // bytes of earlier attempts within the budget
	BudgetSince     time.Time // when the budget started (creation or the last requeue)
}

// JobStart moves the job to running under a new fencing token and records attempt number
// attempts+1, in one statement. Allowed from pending, retryable, and running with a lower
// fence (a takeover after the previous holder's lease expired; that holder's attempt is
// written as lost, and its worker's bytes are added later by AttemptSupersede). A job
// running under this very start (the same p.Owner: its earlier send landed, its reply
// lost) is not taken over: see AttemptStartParams.Owner.
//
// The token is p.Token, applied only if it is above the job's fence (fences never go
// backwards), or, with p.Token 0, issued here: the fence + 1, reported as
// StartedAttempt.Fence. The runner issues its tokens here (it holds a lua.Take lease, which
// has none); the reconciler and reparse bring theirs from a Redis counter.
//
// Every start waits for its WAL flush (one per grouped statement), so a crash never takes a
// fence back: an issued token would otherwise be issued again, and a counter token lost in
// a crash could equal one the next start issues (TestStartsSurviveCrash). Tokens are as
// durable as PostgreSQL's commits: with a standby, use synchronous replication, or a
// failover may lose the last starts with the last commits. The job's row is locked first (waiting, within
// ctx, for a lock another transaction holds). It is the statement of the GroupCommitter,
// for a batch of one.
func (s *PG) JobStart(ctx context.Context, p AttemptStartParams) (StartedAttempt, error) {
	if p.Token < 0 {
		return StartedAttempt{}, fmt.Errorf("store: JobStart %q: token %d is negative (0 issues one)", p.Key, p.Token)
	}
	if err := p.check(); err != nil {
		return StartedAttempt{}, err
	}
	out, err := s.startRows(ctx, []AttemptStartParams{p}, lockWait)
	if err != nil {
		return StartedAttempt{}, fmt.Errorf("store: JobStart %q: %w", p.Key, err)
	}
	return out[0].res, out[0].err
}

// AttemptFinishParams ends the running attempt started with Token.
type AttemptFinishParams struct {
	Key           string
	Token         int64     // the fencing token the attempt was started with
	NextAttemptAt time.Time // JobMarkRetryable only: when the job may run again
	Category      string    // failure category ("" on success)
	Error         string    // error text, already free of credentials; cut to 2000 bytes
	HTTPStatus    int       // last destination status, 0 if none
	Bytes         int64     // bytes this attempt transferred; added to jobs.bytes_total
	SessionID     string    // proxy session id (overwrites the start value when set)
	ProxyEndpoint string    // redacted endpoint (overwrites the start value when set)
	Cost          Cost      // what Bytes cost at the proxy's price (zero: no price)
	SessionUnits  int       // units the session had served before this attempt's (0: new)
}

// JobComplete moves the job from running to complete, only if its fence still equals
// p.Token, and closes the attempt, in one statement. A refused call writes nothing at all.
// (The attempt of a worker that lost its job to a takeover was already closed by the
// takeover's JobStart or the reconciler's JobRescue; that worker records its bytes with
// AttemptSupersede.)
func (s *PG) JobComplete(ctx context.Context, p AttemptFinishParams) error {
	return s.finish(ctx, "JobComplete", tasks.StateComplete, p)
}

// JobMarkRetryable moves the job from running to retryable with p.NextAttemptAt, only if
// its fence still equals p.Token, and closes the attempt with p's evidence. It is the
// worker's own finish of a failed attempt. (The reconciler does not use it: a job whose
// worker's lease expired is rescued with JobRescue, which raises the fence so that the
// stale worker is refused later.)
func (s *PG) JobMarkRetryable(ctx context.Context, p AttemptFinishParams) error {
	if p.NextAttemptAt.IsZero() {
		return fmt.Errorf("store: JobMarkRetryable %q: NextAttemptAt is required", p.Key)
	}
	return s.finish(ctx, "JobMarkRetryable", tasks.StateRetryable, p)
}

// JobFail moves the job from running to failed (terminal), only if its fence still equals
// p.Token.
func (s *PG) JobFail(ctx context.Context, p AttemptFinishParams) error {
	if p.Category == "" {
		return fmt.Errorf("store: JobFail %q: Category is required", p.Key)
	}
	return s.finish(ctx, "JobFail", tasks.StateFailed, p)
}

func (s *PG) finish(ctx context.Context, op string, to tasks.JobState, p AttemptFinishParams) error {
	if p.Bytes < 0 {
		return fmt.Errorf("store: %s %q: Bytes %d is negative", op, p.Key, p.Bytes)
	}
	if p.SessionUnits < 0 || p.SessionUnits > math.MaxInt32 {
		return fmt.Errorf("store: %s %q: SessionUnits %d is out of range", op, p.Key, p.SessionUnits)
	}
	if err := p.Cost.check(op, p.Key); err != nil {
		return err
	}
	var nextAt *time.Time
	if to == tasks.StateRetryable {
		nextAt = &p.NextAttemptAt
	}
	var (
		done  bool
		found bool
		state string
		fence int64
	)
	err := s.pool.QueryRow(ctx, `
WITH cur AS (
	SELECT state, fence FROM jobs WHERE key = $1
), upd AS (
	UPDATE jobs SET state = $3, next_attempt_at = $4, last_category = NULLIF($5, ''),
		bytes_total = bytes_total + $8, updated_at = now(),
		completed_at = CASE WHEN $3 = 'complete' THEN now() END
	WHERE key = $1 AND state = 'running' AND fence = $2
	RETURNING attempts, country, attempt_worker, attempt_session, attempt_endpoint, attempt_started_at,
		attempt_provider, attempt_tier
), att AS (
	INSERT INTO attempts AS a (job_key, attempt_no, fence, worker, session_id, country, proxy_endpoint,
		started_at, finished_at, http_status, bytes, outcome, category, error, cost_micros, currency, provider, tier,
		session_units)
	SELECT $1, u.attempts, $2, u.attempt_worker, COALESCE(NULLIF($9, ''), u.attempt_session), u.country,
		COALESCE(NULLIF($10, ''), u.attempt_endpoint), COALESCE(u.attempt_started_at, now()), now(),
		NULLIF($7, 0), $8, $3, NULLIF($5, ''), NULLIF($6, ''), $11, NULLIF($12, ''), u.attempt_provider, u.attempt_tier, $13
	FROM upd u
	ON CONFLICT (job_key, fence) DO UPDATE SET outcome = EXCLUDED.outcome, category = EXCLUDED.category,
		session_units = EXCLUDED.session_units,
		error = EXCLUDED.error, http_status = EXCLUDED.http_status, bytes = EXCLUDED.bytes, finished_at = now(),
		cost_micros = EXCLUDED.cost_micros, currency = EXCLUDED.currency,
		session_id = COALESCE(NULLIF(EXCLUDED.session_id, ''), a.session_id),
		proxy_endpoint = COALESCE(NULLIF(EXCLUDED.proxy_endpoint, ''), a.proxy_endpoint)
)
SELECT EXISTS (SELECT 1 FROM upd), cur.state IS NOT NULL, COALESCE(cur.state, ''), COALESCE(cur.fence, 0)
FROM (SELECT 1) AS one LEFT JOIN cur ON true`,
		p.Key, p.Token, string(to), nextAt, p.Category, truncateUTF8(p.Error, maxErrorText),
		p.HTTPStatus, p.Bytes, p.SessionID, p.ProxyEndpoint, p.Cost.Micros, p.Cost.Currency, int32(p.SessionUnits),
	).Scan(&done, &found, &state, &fence)
	if err != nil {
		return fmt.Errorf("store: %s %q: %w", op, p.Key, err)
	}
	if done {
		return nil
	}
	// Not applied: a running job refused us only because its fence is not our token.
	return s.refusal(ctx, op, p.Key, p.Token, found, state, fence, finishStale(p.Token))
}

// refusal explains a transition the statement did not apply. The statement's own view of
// the row is its snapshot, taken before it waited for a concurrent writer's lock, so the row
// is read again in a new statement (this costs a round trip on the refusal path only);
// the snapshot is the fallback if that read fails. stale tells, from the row, whether the
// token rather than the state is what was wrong.
func (s *PG) refusal(ctx context.Context, op, key string, token int64, found bool, state string, fence int64,
	stale func(state tasks.JobState, fence int64) bool) *TransitionError {
	var st *string
	var f int64
	switch err := s.pool.QueryRow(ctx, `SELECT state, fence FROM jobs WHERE key = $1`, key).Scan(&st, &f); {
	case err == nil:
		found, state, fence = true, *st, f
	case errors.Is(err, pgx.ErrNoRows):
		found, state, fence = false, "", 0
	}
	return classifyRefusal(op, key, token, found, state, fence, stale)
}

// startStale: a start is refused for its token when the fence is not below it.
func startStale(token int64) func(tasks.JobState, int64) bool {
	return func(_ tasks.JobState, fence int64) bool { return token > 0 && fence >= token }
}

// finishStale: a finish is refused for its token when the job runs under another one, or
// when the job's fence has moved past the token (a rescue or a newer attempt took it over,
// whatever the state now). A job that is not running and whose fence is not above the
// token (e.g. the attempt start was lost in a crash) is an invalid transition instead.
func finishStale(token int64) func(tasks.JobState, int64) bool {
	return func(state tasks.JobState, fence int64) bool { return state == tasks.StateRunning || fence > token }
}

func nullIfEmpty(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// truncateUTF8 cuts s to at most max bytes at a rune boundary and drops NUL characters,
// which PostgreSQL text can not hold.
func truncateUTF8(s string, max int) string {
	s = strings.ReplaceAll(s, "\x00", "")
	if len(s) <= max {
		return s
	}
	s = s[:max]
	for len(s) > 0 && !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return strings.ToValidUTF8(s, "")
}

// AttemptBytesRecent returns the bytes of up to limit attempts of kind's most recently
// finished jobs (complete or failed; newest first), for an estimate of what an attempt of
// the kind moves (handlers' window reservations, at a worker's start). Lost attempts are
// left out: their bytes were never reported. One backward scan of the terminal jobs'
// index, bounded: a kind without recent jobs among the last 50,000 finished returns none.
func (s *PG) AttemptBytesRecent(ctx context.Context, kind string, limit int) ([]int64, error) {
	if limit <= 0 {
		return nil, fmt.Errorf("store: AttemptBytesRecent %q: limit %d must be positive", kind, limit)
	}
	rows, err := s.pool.Query(ctx, `
SELECT a.bytes
FROM (SELECT key, kind, updated_at FROM jobs WHERE state IN ('complete', 'failed')
	ORDER BY updated_at DESC LIMIT 50000) j
JOIN attempts a ON a.job_key = j.key
WHERE j.kind = $1 AND a.outcome <> 'lost'
ORDER BY j.updated_at DESC, a.fence DESC
LIMIT $2`, kind, limit)
	if err != nil {
		return nil, fmt.Errorf("store: AttemptBytesRecent %q: %w", kind, err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("store: AttemptBytesRecent %q: %w", kind, err)
	}
	return out, nil
}

// JobAttemptReserve raises what the running attempt of token has reserved of its window's
// money budget to total (a top-up in mid-attempt, lua.WindowBudgets.TopUp): the attempt,
// if it is written as lost, carries it as its cost. It reports false, writing nothing,
// when the job no longer runs under token (taken over, finished), or when total is not
// above what is recorded: a reservation only grows.
func (s *PG) JobAttemptReserve(ctx context.Context, key string, token int64, total Cost) (bool, error) {
	if token < 1 {
		return false, fmt.Errorf("store: JobAttemptReserve %q: token %d must be >= 1", key, token)
	}
	if err := total.check("JobAttemptReserve", key); err != nil {
		return false, err
	}
	tag, err := s.pool.Exec(ctx, `
UPDATE jobs SET attempt_reserved_micros = $3, attempt_currency = NULLIF($4, '')
WHERE key = $1 AND state = 'running' AND fence = $2 AND attempt_reserved_micros < $3
	AND COALESCE(attempt_currency, $4) = $4`, key, token, total.Micros, total.Currency)
	if err != nil {
		return false, fmt.Errorf("store: JobAttemptReserve %q: %w", key, err)
	}
	return tag.RowsAffected() == 1, nil
}
