package store

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemscrape/idemscrape/tasks"
)

// This file is the ONE source of the fenced attempt-start and commit statements. A lone
// PG.JobStart / PG.Commit is a batch of one; the GroupCommitter sends batches of distinct
// jobs. Every statement locks its jobs rows first, in key order (the order the
// reconciler's JobsRescue locks in, so the two can not deadlock).

// lockMode says how a statement meets a jobs row locked by another transaction.
type lockMode int

const (
	// lockWait waits for the lock (a lone call: bounded by the caller's context).
	lockWait lockMode = iota
	// lockSkip leaves the row alone and reports it busy (the group committer: one locked
	// row must not hold up the commits of unrelated jobs).
	lockSkip
)

func (m lockMode) clause() string {
	if m == lockSkip {
		return "FOR UPDATE SKIP LOCKED"
	}
	return "FOR UPDATE"
}

// rowOutcome is one row's outcome of a fenced statement: applied (res), refused or failed
// (err), or busy (its jobs row was locked by another transaction and nothing of it was
// written: try again).
type rowOutcome[Res any] struct {
	res  Res
	err  error
	busy bool
}

// rowsByKey reads the answer of a fenced statement or of its re-read, one row per job whose
// first column is the job's key, into a map by key; fields gives the scan destinations of a
// row, the key first. n sizes the map. commitRows, resolveCommits, startRows and
// resolveStarts use it.
func rowsByKey[Row any](rows pgx.Rows, n int, fields func(key *string, r *Row) []any) (map[string]Row, error) {
	got := make(map[string]Row, n)
	for rows.Next() {
		var k string
		var r Row
		if err := rows.Scan(fields(&k, &r)...); err != nil {
			rows.Close()
			return nil, err
		}
		got[k] = r
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	return got, nil
}

// In the commit and start statements, `j.key = ANY($1)` in the jobs UPDATE is redundant
// with the join on the input: it gives the planner the primary key (or the running-jobs
// index by key) whatever it thinks of the CTEs' sizes; with stale statistics it walked a
// partial state index over every queued or running job instead (EXPLAIN of a 10-row batch
// over 3,000 queued jobs: 5,990 index entries read). No SQL comments in these statements:
// pg_stat_activity shows only their first 1 KB, and tests find them there by text.
//
// The commit's dup CTE counts the duplicate result writes it rejected (committed jobs whose
// observation key existed) in the commit itself, so idemscrape stats reads them from
// PostgreSQL.
//
// commitSQL notifies dispatchers only when asked (the notify CTE): PostgreSQL serialises the
// commits of every transaction that notified (a database-wide lock held from before the
// commit record until after its WAL flush), which capped fenced commits at a few hundred
// per second whatever the concurrency while every commit notified. The GroupCommitter asks
// at most once per NotifyInterval and otherwise wakes dispatchers after the commit
// (notify.go).
const commitSQL = `
WITH input AS (
	SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::int[], $5::jsonb[], $6::text[],
		$7::text[], $8::text[], $9::jsonb[], $10::int[], $11::bigint[], $12::text[], $13::text[],
		$14::bigint[], $15::text[], $16::int[])
		AS t(key, token, obs_key, pv, data, fp, event_key, topic, payload, status, bytes, session_id, endpoint,
			cost, currency, session_units)
), locked AS MATERIALIZED (
	SELECT j.key FROM jobs j WHERE j.key IN (SELECT key FROM input) ORDER BY j.key %[1]s
), upd AS (
	UPDATE jobs j SET state = 'complete', completed_at = now(), updated_at = now(),
		next_attempt_at = NULL, last_category = NULL, bytes_total = j.bytes_total + i.bytes
	FROM input i JOIN locked USING (key)
	WHERE j.key = ANY($1::text[]) AND j.key = i.key%[4]s
	RETURNING j.key, j.attempts, j.country, j.attempt_worker, j.attempt_session, j.attempt_endpoint,
		j.attempt_started_at, j.attempt_provider, j.attempt_tier
), res AS (
	INSERT INTO results (observation_key, job_key, parser_version, data, response_fingerprint, fence)
	SELECT %[5]s, i.key, i.pv, i.data, i.fp, i.token FROM input i JOIN upd USING (key)
	ON CONFLICT (observation_key) DO NOTHING
	RETURNING job_key
), cur AS (
	SELECT j.key, j.state, j.fence FROM jobs j JOIN input USING (key)
), ev AS (
	INSERT INTO outbox (event_key, topic, payload)
	SELECT i.event_key, i.topic, i.payload FROM input i JOIN upd USING (key)
	ON CONFLICT (event_key) DO NOTHING
	RETURNING event_key
), att AS (
	INSERT INTO attempts AS a (job_key, attempt_no, fence, worker, session_id, country, proxy_endpoint,
		started_at, finished_at, http_status, bytes, outcome, cost_micros, currency, provider, tier, session_units)
	SELECT i.key, u.attempts, i.token, u.attempt_worker, COALESCE(NULLIF(i.session_id, ''), u.attempt_session),
		u.country, COALESCE(NULLIF(i.endpoint, ''), u.attempt_endpoint), COALESCE(u.attempt_started_at, now()),
		now(), NULLIF(i.status, 0), i.bytes, 'complete', i.cost, NULLIF(i.currency, ''), u.attempt_provider, u.attempt_tier,
		i.session_units
	FROM input i JOIN upd u USING (key)
	ON CONFLICT (job_key, fence) DO UPDATE SET outcome = 'complete', finished_at = now(),
		http_status = EXCLUDED.http_status, bytes = EXCLUDED.bytes, session_units = EXCLUDED.session_units,
		cost_micros = EXCLUDED.cost_micros, currency = EXCLUDED.currency,
		session_id = COALESCE(NULLIF(EXCLUDED.session_id, ''), a.session_id),
		proxy_endpoint = COALESCE(NULLIF(EXCLUDED.proxy_endpoint, ''), a.proxy_endpoint)
), dup AS (
	INSERT INTO maintenance_counters (name, n, updated_at)
	SELECT $17, count(*), now() FROM upd WHERE NOT EXISTS (SELECT 1 FROM res WHERE res.job_key = upd.key)
	HAVING count(*) > 0
	ON CONFLICT (name) DO UPDATE SET n = maintenance_counters.n + EXCLUDED.n, updated_at = now()
)%[2]s
SELECT i.key, upd.key IS NOT NULL, res.job_key IS NOT NULL, ev.event_key IS NOT NULL,
	cur.key IS NOT NULL, locked.key IS NOT NULL, COALESCE(cur.state, ''), COALESCE(cur.fence, 0)
FROM input i
LEFT JOIN upd USING (key)
LEFT JOIN res ON res.job_key = i.key
LEFT JOIN ev ON ev.event_key = i.event_key
LEFT JOIN cur ON cur.key = i.key
LEFT JOIN locked ON locked.key = i.key%[3]s`

// commitNotifySQL makes the commit statement notify OutboxNotifyChannel ($18) itself.
const commitNotifySQL, commitNotifyJoin = `, notify AS (
	SELECT pg_notify($18, '') WHERE EXISTS (SELECT 1 FROM ev)
)`, `
CROSS JOIN (SELECT count(*) FROM notify) AS signalled`

// commitSQLs[lock][notify] are the commit statements.
var commitSQLs = [2][2]string{
	lockWait: {fmt.Sprintf(commitSQL, lockWait.clause(), "", "", commitFence, commitResultKey),
		fmt.Sprintf(commitSQL, lockWait.clause(), commitNotifySQL, commitNotifyJoin, commitFence, commitResultKey)},
	lockSkip: {fmt.Sprintf(commitSQL, lockSkip.clause(), "", "", commitFence, commitResultKey),
		fmt.Sprintf(commitSQL, lockSkip.clause(), commitNotifySQL, commitNotifyJoin, commitFence, commitResultKey)},
}

// commitRows runs the fenced commit of distinct jobs in one statement (see PG.Commit);
// with notify, the statement's transaction also NOTIFYs OutboxNotifyChannel if it
// inserted an outbox event. err is a failure of the statement as a whole.
func (s *PG) commitRows(ctx context.Context, batch []CommitParams, lock lockMode, notify bool) ([]rowOutcome[CommitResult], error) {
	n := len(batch)
	var (
		key, obs, fp, evKey, topic, session, endpoint = make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n)
		data, payload                                 = make([]string, n), make([]string, n)
		token, bytes, cost                            = make([]int64, n), make([]int64, n), make([]int64, n)
		pv, status                                    = make([]int32, n), make([]int32, n)
		currency                                      = make([]string, n)
		units                                         = make([]int32, n)
	)
	for i, p := range batch {
		key[i], token[i], obs[i], pv[i], data[i], fp[i] = p.Key, p.Token, p.ObservationKey, int32(p.ParserVersion), string(p.Data), p.Fingerprint
		evKey[i], topic[i], payload[i], status[i] = p.EventKey, p.Topic, string(p.EventPayload), int32(p.HTTPStatus)
		bytes[i], session[i], endpoint[i], cost[i], currency[i] = p.Bytes, p.SessionID, p.ProxyEndpoint, p.Cost.Micros, p.Cost.Currency
		units[i] = int32(p.SessionUnits)
	}
	args := []any{key, token, obs, pv, data, fp, evKey, topic, payload, status, bytes, session, endpoint, cost, currency, units,
		CounterDuplicateResults}
	sql := commitSQLs[lock][0]
	if notify {
		sql = commitSQLs[lock][1]
		args = append(args, OutboxNotifyChannel)
	}
	rows, err := s.queryGeneric(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	type row struct {
		done, resIns, evIns, found, locked bool
		state                              string
		fence                              int64
	}
	got, err := rowsByKey(rows, n, func(k *string, r *row) []any {
		return []any{k, &r.done, &r.resIns, &r.evIns, &r.found, &r.locked, &r.state, &r.fence}
	})
	if err != nil {
		return nil, err
	}
	out := make([]rowOutcome[CommitResult], n)
	for i, p := range batch {
		r, ok := got[p.Key]
		switch {
		case !ok:
			out[i].err = fmt.Errorf("store: Commit %q: no row in the statement's answer", p.Key)
		case r.done:
			out[i].res = CommitResult{ResultInserted: r.resIns, EventInserted: r.evIns}
		case lock == lockSkip && r.found && !r.locked:
			out[i].busy = true
		default:
			out[i].err = s.refusal(ctx, "Commit", p.Key, p.Token, r.found, r.state, r.fence, finishStale(p.Token))
		}
	}
	return out, nil
}

// resolveCommits re-reads the rows of commits whose statement may or may not have taken
// effect (the connection failed after it was sent). A job that is complete under the
// commit's token was completed by that commit (only the token's holder commits with it);
// a job still running under the token was not written and the commit may be tried again
// (busy); anything else is the refusal a new try would get. ResultInserted and
// EventInserted of an applied commit report whether its result row (its observation key,
// job and fence) and its event key exist.
func (s *PG) resolveCommits(ctx context.Context, batch []CommitParams) ([]rowOutcome[CommitResult], error) {
	n := len(batch)
	key, obs, ev := make([]string, n), make([]string, n), make([]string, n)
	token := make([]int64, n)
	for i, p := range batch {
		key[i], token[i], obs[i], ev[i] = p.Key, p.Token, p.ObservationKey, p.EventKey
	}
	rows, err := s.pool.Query(ctx, `
SELECT i.key, j.key IS NOT NULL, COALESCE(j.state, ''), COALESCE(j.fence, 0),
	EXISTS (SELECT 1 FROM results r WHERE r.observation_key = i.obs AND r.job_key = i.key AND r.fence = i.token),
	EXISTS (SELECT 1 FROM outbox o WHERE o.event_key = i.ev)
FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[]) AS i(key, token, obs, ev)
LEFT JOIN jobs j ON j.key = i.key`, key, token, obs, ev)
	if err != nil {
		return nil, err
	}
	type row struct {
		found, resIns, evIns bool
		state                string
		fence                int64
	}
	got, err := rowsByKey(rows, n, func(k *string, r *row) []any {
		return []any{k, &r.found, &r.state, &r.fence, &r.resIns, &r.evIns}
	})
	if err != nil {
		return nil, err
	}
	out := make([]rowOutcome[CommitResult], n)
	for i, p := range batch {
		r := got[p.Key]
		switch {
		case r.found && r.fence == p.Token && tasks.JobState(r.state) == tasks.StateComplete:
			out[i].res = CommitResult{ResultInserted: r.resIns, EventInserted: r.evIns}
		case r.found && r.fence == p.Token && tasks.JobState(r.state) == tasks.StateRunning:
			out[i].busy = true
		default:
			out[i].err = s.refusal(ctx, "Commit", p.Key, p.Token, r.found, r.state, r.fence, finishStale(p.Token))
		}
	}
	return out, nil
}

// startSQL's mine CTE finds the jobs whose running attempt was started by this very start
// (the same non-empty owner, unique per start, on the jobs row): its earlier statement
// landed although its reply was lost, maybe after the re-read that found it not yet written.
// With the same token (or none: issued) it is that attempt again (same): nothing is written
// and it is reported as it was started. With a higher token (the caller re-claimed) the
// attempt moves to it and the earlier attempt's row is written as ended by its own start
// (retryable, CategoryRestarted), not as lost: nobody else took it over.
const startSQL = `
WITH input AS (
	SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[], $5::text[], $6::text[], $8::text[],
		$9::bigint[], $10::text[], $11::text[], $12::text[])
		AS t(key, token, worker, session_id, country, endpoint, owner, reserved, currency, provider, tier)
), locked AS MATERIALIZED (
	SELECT j.key, j.state, j.fence, j.attempts, j.country, j.attempt_worker, j.attempt_session,
		j.attempt_endpoint, j.attempt_started_at, j.attempt_owner, j.attempt_reserved_micros, j.attempt_currency,
		j.attempt_provider, j.attempt_tier, j.created_at, j.bytes_total,
		j.budget_attempts, j.budget_bytes, j.budget_since
	FROM jobs j WHERE j.key IN (SELECT key FROM input) ORDER BY j.key %[1]s
), mine AS (
	SELECT l.key, i.token = 0 OR l.fence = i.token AS again
	FROM locked l JOIN input i USING (key)
	WHERE l.state = 'running' AND i.owner <> '' AND l.attempt_owner = i.owner
), cur AS (
	SELECT j.key, j.state, j.fence FROM jobs j JOIN input USING (key)
), upd AS (
	UPDATE jobs j SET state = 'running', fence = CASE WHEN i.token = 0 THEN j.fence + 1 ELSE i.token END,
		attempts = j.attempts + 1,
		next_attempt_at = NULL, updated_at = now(), attempt_worker = i.worker,
		attempt_session = i.session_id, attempt_endpoint = i.endpoint, attempt_started_at = now(),
		attempt_owner = i.owner, attempt_reserved_micros = i.reserved, attempt_currency = NULLIF(i.currency, ''),
		attempt_provider = i.provider, attempt_tier = i.tier
	FROM input i JOIN locked l USING (key) LEFT JOIN mine m USING (key)
	WHERE j.key = ANY($1::text[]) AND j.key = i.key AND l.state = ANY($7::text[])
		AND (i.token = 0 OR l.fence < i.token) AND m.again IS NOT TRUE
	RETURNING j.key, j.fence, j.attempts, j.created_at, j.bytes_total,
		j.attempts - j.budget_attempts AS budget_no, j.bytes_total - j.budget_bytes AS budget_bytes,
		COALESCE(j.budget_since, j.created_at) AS budget_since
), same AS (
	SELECT l.key, l.fence, l.attempts, l.created_at, l.bytes_total,
		l.attempts - l.budget_attempts AS budget_no, l.bytes_total - l.budget_bytes AS budget_bytes,
		COALESCE(l.budget_since, l.created_at) AS budget_since,
		EXISTS (SELECT 1 FROM attempts p WHERE p.job_key = l.key AND p.attempt_no = l.attempts - 1
			AND p.outcome IN ('lost', 'superseded') AND p.category = 'superseded' AND p.fence < l.fence) AS took_over
	FROM locked l JOIN mine m USING (key) WHERE m.again
), lost AS (
	INSERT INTO attempts AS a (job_key, attempt_no, fence, worker, session_id, country, proxy_endpoint,
		started_at, finished_at, outcome, category, evidence_due, cost_micros, currency, provider, tier)
	SELECT l.key, l.attempts, l.fence, l.attempt_worker, l.attempt_session, l.country, l.attempt_endpoint,
		COALESCE(l.attempt_started_at, now()), now(), CASE WHEN m.key IS NULL THEN 'lost' ELSE 'retryable' END,
		CASE WHEN m.key IS NULL THEN 'superseded' ELSE '%[2]s' END, m.key IS NULL,
		-- A lost attempt is charged what it reserved (its worker may never report); one
		-- restarted by its own start was not taken over: its worker settles it.
		CASE WHEN m.key IS NULL THEN l.attempt_reserved_micros ELSE 0 END,
		CASE WHEN m.key IS NULL AND l.attempt_reserved_micros > 0 THEN l.attempt_currency END,
		l.attempt_provider, l.attempt_tier
	FROM locked l JOIN upd USING (key) LEFT JOIN mine m USING (key)
	WHERE l.state = 'running' AND l.attempts > 0
	ON CONFLICT (job_key, fence) DO UPDATE SET outcome = EXCLUDED.outcome, category = EXCLUDED.category,
		finished_at = now(), evidence_due = EXCLUDED.evidence_due,
		cost_micros = EXCLUDED.cost_micros, currency = EXCLUDED.currency
	WHERE a.outcome = 'running'
)
SELECT i.key, COALESCE(upd.fence, same.fence), COALESCE(upd.attempts, same.attempts),
	COALESCE(upd.created_at, same.created_at), COALESCE(upd.bytes_total, same.bytes_total, 0),
	COALESCE(upd.budget_no, same.budget_no, 0), COALESCE(upd.budget_bytes, same.budget_bytes, 0),
	COALESCE(upd.budget_since, same.budget_since),
	cur.key IS NOT NULL, locked.key IS NOT NULL, COALESCE(cur.state, ''), COALESCE(cur.fence, 0),
	COALESCE(same.took_over, locked.state = 'running' AND mine.key IS NULL, false)
FROM input i
LEFT JOIN upd USING (key)
LEFT JOIN same ON same.key = i.key
LEFT JOIN mine ON mine.key = i.key
LEFT JOIN cur ON cur.key = i.key
LEFT JOIN locked ON locked.key = i.key`

// startableStates are the states a start moves to running. The start checks them on the
// row its locked CTE read (l.state), not on the UPDATE's scan of jobs: a condition on
// j.state let the planner AND the primary key with the partial state index (state <>
// 'complete'), whose entries for every queued job a custom plan read on each start
// (EXPLAIN: 20,000 entries for a 5-row start; a 20,000-job benchmark read 46 million).
// They are a parameter, not a constant list, for the same reason. The jobs rows are found
// by primary key (TestStartPlanByPrimaryKey, both plans).
var startableStates = []string{string(tasks.StatePending), string(tasks.StateRetryable), string(tasks.StateRunning)}

// CategoryRestarted is the category of an attempt whose own start was sent again under a
// higher token (its reply was lost, and its caller re-claimed): the attempt's row is
// written, retryable, by that start, which is no takeover (StartedAttempt.TookOver is false).
const CategoryRestarted = "restarted"

var startSQLs = [...]string{lockWait: fmt.Sprintf(startSQL, lockWait.clause(), CategoryRestarted),
	lockSkip: fmt.Sprintf(startSQL, lockSkip.clause(), CategoryRestarted)}

// startRow is what the start statement and its re-read report for one job.
type startRow struct {
	newFence    *int64 // the fence the attempt runs under
	attemptNo   *int32
	createdAt   *time.Time
	bytes       int64
	budgetNo    int32
	budgetBytes int64
	budgetSince *time.Time
	found       bool
	locked      bool
	state       string
	fence       int64
	tookOver    bool
}

func (r startRow) started() StartedAttempt {
	return StartedAttempt{Fence: *r.newFence, AttemptNo: int(*r.attemptNo), JobCreatedAt: *r.createdAt, BytesTotal: r.bytes,
		TookOver:        r.tookOver,
		BudgetAttemptNo: int(r.budgetNo), BudgetBytes: r.budgetBytes, BudgetSince: *r.budgetSince}
}

// startRows runs the fenced attempt start of distinct jobs in one statement (see
// PG.JobStart). err is a failure of the statement as a whole.
func (s *PG) startRows(ctx context.Context, batch []AttemptStartParams, lock lockMode) ([]rowOutcome[StartedAttempt], error) {
	n := len(batch)
	keys, workers, sessions, countries, endpoints := make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	owners, currencies, providers, tiers := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	tokens, reserved := make([]int64, n), make([]int64, n)
	for i, p := range batch {
		keys[i], tokens[i], workers[i], sessions[i], countries[i], endpoints[i] = p.Key, p.Token, p.Worker, p.SessionID, p.Country, p.ProxyEndpoint
		owners[i], reserved[i], currencies[i] = p.Owner, p.Reserved.Micros, p.Reserved.Currency
		providers[i], tiers[i] = p.Provider, p.Tier
	}
	rows, err := s.queryGeneric(ctx, startSQLs[lock], keys, tokens, workers, sessions, countries, endpoints, startableStates, owners,
		reserved, currencies, providers, tiers)
	if err != nil {
		return nil, err
	}
	got, err := rowsByKey(rows, n, func(k *string, r *startRow) []any {
		// tookOver is read from the locked row, the version the start moved (the same
		// one whose attempt it wrote as lost), not from the statement's snapshot.
		return []any{k, &r.newFence, &r.attemptNo, &r.createdAt, &r.bytes, &r.budgetNo, &r.budgetBytes, &r.budgetSince,
			&r.found, &r.locked, &r.state, &r.fence, &r.tookOver}
	})
	if err != nil {
		return nil, err
	}
	out := make([]rowOutcome[StartedAttempt], n)
	for i, p := range batch {
		r, ok := got[p.Key]
		switch {
		case !ok:
			out[i].err = fmt.Errorf("store: JobStart %q: no row in the statement's answer", p.Key)
		case r.attemptNo != nil:
			out[i].res = r.started()
		case lock == lockSkip && r.found && !r.locked:
			out[i].busy = true
		default:
			// Not applied: a start needs a token above the fence.
			out[i].err = s.refusal(ctx, "JobStart", p.Key, p.Token, r.found, r.state, r.fence, startStale(p.Token))
		}
	}
	return out, nil
}

// resolveStarts re-reads the rows of starts whose statement may or may not have taken
// effect. A job whose fence is the start's token was started by that start (the token is
// unique to its holder and fences never go back): it is reported as the start's result,
// with the job's counters as they are now and TookOver true when the attempt before it
// was ended as lost by a start. A job that a start with the token may still move is
// reported busy (nothing written, try again); anything else is the refusal a new try would
// get.
func (s *PG) resolveStarts(ctx context.Context, batch []AttemptStartParams) ([]rowOutcome[StartedAttempt], error) {
	n := len(batch)
	keys, owners := make([]string, n), make([]string, n)
	tokens := make([]int64, n)
	for i, p := range batch {
		keys[i], tokens[i], owners[i] = p.Key, p.Token, p.Owner
	}
	rows, err := s.pool.Query(ctx, `
SELECT i.key, j.fence, CASE WHEN j.state = 'running' AND (
		(i.owner <> '' AND j.attempt_owner = i.owner AND (i.token = 0 OR j.fence = i.token))
		OR (i.owner = '' AND i.token > 0 AND j.fence = i.token)) THEN j.attempts END, j.created_at,
	COALESCE(j.bytes_total, 0), COALESCE(j.attempts - j.budget_attempts, 0), COALESCE(j.bytes_total - j.budget_bytes, 0),
	COALESCE(j.budget_since, j.created_at), j.key IS NOT NULL, COALESCE(j.state, ''), COALESCE(j.fence, 0),
	EXISTS (SELECT 1 FROM attempts p WHERE p.job_key = i.key AND p.attempt_no = j.attempts - 1
		AND p.outcome IN ('lost', 'superseded') AND p.category = 'superseded' AND p.fence < j.fence)
FROM unnest($1::text[], $2::bigint[], $3::text[]) AS i(key, token, owner)
LEFT JOIN jobs j ON j.key = i.key`, keys, tokens, owners)
	if err != nil {
		return nil, err
	}
	got, err := rowsByKey(rows, n, func(k *string, r *startRow) []any {
		return []any{k, &r.newFence, &r.attemptNo, &r.createdAt, &r.bytes, &r.budgetNo, &r.budgetBytes, &r.budgetSince,
			&r.found, &r.state, &r.fence, &r.tookOver}
	})
	if err != nil {
		return nil, err
	}
	out := make([]rowOutcome[StartedAttempt], n)
	for i, p := range batch {
		r := got[p.Key]
		st := tasks.JobState(r.state)
		switch {
		case r.attemptNo != nil && r.createdAt != nil:
			// Running under this start's owner (unique per start) or, without an owner,
			// its own token: the start took effect.
			out[i].res = r.started()
		case p.Token == 0 && r.found && slices.Contains(startableStates, string(st)):
			// Not this start's (another owner, or none given): it did not take effect yet,
			// or, without an owner to tell, it may have; sent again, it takes the first
			// over (its row written as lost) as after a worker that died there. With an
			// owner, a first send that lands after this re-read is recognised by the
			// start sent again (startSQL's mine), not taken over.
			out[i].busy = true
		case r.found && r.fence < p.Token && slices.Contains(startableStates, string(st)):
			out[i].busy = true
		default:
			out[i].err = s.refusal(ctx, "JobStart", p.Key, p.Token, r.found, r.state, r.fence, startStale(p.Token))
		}
	}
	return out, nil
}
