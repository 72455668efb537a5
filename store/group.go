package store

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/idemscrape/idemscrape/tasks"
)

// Group commit defaults.
const (
	DefaultGroupWindow   = 2 * time.Millisecond
	DefaultGroupMaxBatch = 64
)

// GroupCommitter batches the statements of concurrent handlers: the commits (and attempt
// starts) that arrive within a short window go to PostgreSQL as ONE statement each kind
// (one transaction, one fsync for commits), with every job's fence checked row by row — a
// stale job is refused on its own and never rolls back the others. Each caller gets
// exactly the result Commit (JobStart) would have given it.
//
// Start it with NewGroupCommitter and Close it when the workers stop.
type GroupCommitter struct {
	st      *PG
	commits *batcher[CommitParams, CommitResult]
	starts  *batcher[AttemptStartParams, StartedAttempt]
}

// ErrGroupCommitterClosed: Commit was called after Close.
var ErrGroupCommitterClosed = errors.New("store: group committer closed")

// NewGroupCommitter starts a group committer. window is how long the first statement of a
// batch waits for company (0 = DefaultGroupWindow); maxBatch caps a batch (0 =
// DefaultGroupMaxBatch).
func (s *PG) NewGroupCommitter(window time.Duration, maxBatch int) *GroupCommitter {
	if window <= 0 {
		window = DefaultGroupWindow
	}
	if maxBatch <= 0 {
		maxBatch = DefaultGroupMaxBatch
	}
	g := &GroupCommitter{st: s}
	g.commits = newBatcher(window, maxBatch, func(p CommitParams) string { return p.Key }, g.commitMany, s.Commit)
	g.starts = newBatcher(window, maxBatch, func(p AttemptStartParams) string { return p.Key }, g.startMany, s.JobStart)
	return g
}

// Commit is store.PG.Commit through the batch: same validation, same fencing, same result.
func (g *GroupCommitter) Commit(ctx context.Context, p CommitParams) (CommitResult, error) {
	if err := p.Validate(); err != nil {
		return CommitResult{}, err
	}
	return g.commits.do(ctx, p)
}

// JobStart is store.PG.JobStart through the batch.
func (g *GroupCommitter) JobStart(ctx context.Context, p AttemptStartParams) (StartedAttempt, error) {
	if p.Token < 1 {
		return StartedAttempt{}, fmt.Errorf("store: JobStart %q: token %d must be >= 1", p.Key, p.Token)
	}
	return g.starts.do(ctx, p)
}

// Close stops the committer after the batches in flight. Safe to call more than once.
func (g *GroupCommitter) Close() {
	g.commits.close()
	g.starts.close()
}

// batcher collects requests for up to window (or maxBatch of them) and runs them with
// many; requests for a key already in the batch run alone with single afterwards, and so
// does every request of a batch whose statement failed as a whole.
type batcher[Req, Res any] struct {
	window   time.Duration
	maxBatch int
	keyOf    func(Req) string
	many     func([]Req) ([]Res, []error, error)
	single   func(context.Context, Req) (Res, error)
	reqs     chan *batchReq[Req, Res]
	done     chan struct{}
	once     sync.Once
}

type batchReq[Req, Res any] struct {
	ctx   context.Context
	req   Req
	reply chan batchReply[Res]
}

type batchReply[Res any] struct {
	res Res
	err error
}

func newBatcher[Req, Res any](window time.Duration, maxBatch int, keyOf func(Req) string,
	many func([]Req) ([]Res, []error, error), single func(context.Context, Req) (Res, error)) *batcher[Req, Res] {
	b := &batcher[Req, Res]{window: window, maxBatch: maxBatch, keyOf: keyOf, many: many, single: single,
		reqs: make(chan *batchReq[Req, Res]), done: make(chan struct{})}
	go b.loop()
	return b
}

func (b *batcher[Req, Res]) do(ctx context.Context, req Req) (Res, error) {
	r := &batchReq[Req, Res]{ctx: ctx, req: req, reply: make(chan batchReply[Res], 1)}
	select {
	case b.reqs <- r:
	case <-b.done:
		var zero Res
		return zero, ErrGroupCommitterClosed
	case <-ctx.Done():
		var zero Res
		return zero, ctx.Err()
	}
	// Once handed over, the statement runs; its outcome is reported even if ctx ends.
	rep := <-r.reply
	return rep.res, rep.err
}

func (b *batcher[Req, Res]) close() { b.once.Do(func() { close(b.done) }) }

func (b *batcher[Req, Res]) loop() {
	for {
		var first *batchReq[Req, Res]
		select {
		case first = <-b.reqs:
		case <-b.done:
			return
		}
		batch := []*batchReq[Req, Res]{first}
		timer := time.NewTimer(b.window)
	collect:
		for len(batch) < b.maxBatch {
			select {
			case r := <-b.reqs:
				batch = append(batch, r)
			case <-timer.C:
				break collect
			}
		}
		timer.Stop()
		b.run(batch)
	}
}

func (b *batcher[Req, Res]) run(batch []*batchReq[Req, Res]) {
	seen := make(map[string]bool, len(batch))
	var now, later []*batchReq[Req, Res]
	for _, r := range batch {
		if k := b.keyOf(r.req); seen[k] {
			later = append(later, r)
		} else {
			seen[k] = true
			now = append(now, r)
		}
	}
	reqs := make([]Req, len(now))
	for i, r := range now {
		reqs[i] = r.req
	}
	res, errs, err := b.many(reqs)
	if err != nil {
		// The statement failed as a whole (connection, a CHECK on one row): nothing of the
		// batch was written. Run each alone so one bad row can not fail the others.
		later = append(now, later...)
	} else {
		for i, r := range now {
			r.reply <- batchReply[Res]{res[i], errs[i]}
		}
	}
	for _, r := range later {
		res, err := b.single(context.WithoutCancel(r.ctx), r.req)
		r.reply <- batchReply[Res]{res, err}
	}
}

func (g *GroupCommitter) commitMany(batch []CommitParams) ([]CommitResult, []error, error) {
	n := len(batch)
	cols := struct {
		key, obs, fp, evKey, topic, session, endpoint []string
		token, bytes                                  []int64
		pv, status                                    []int32
		data, payload                                 []string
	}{}
	for _, p := range batch {
		cols.key = append(cols.key, p.Key)
		cols.token = append(cols.token, p.Token)
		cols.obs = append(cols.obs, p.ObservationKey)
		cols.pv = append(cols.pv, int32(p.ParserVersion))
		cols.data = append(cols.data, string(p.Data))
		cols.fp = append(cols.fp, p.Fingerprint)
		cols.evKey = append(cols.evKey, p.EventKey)
		cols.topic = append(cols.topic, p.Topic)
		cols.payload = append(cols.payload, string(p.EventPayload))
		cols.status = append(cols.status, int32(p.HTTPStatus))
		cols.bytes = append(cols.bytes, p.Bytes)
		cols.session = append(cols.session, p.SessionID)
		cols.endpoint = append(cols.endpoint, p.ProxyEndpoint)
	}
	// The batch's own context: no single caller may cancel the others' commits.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rows, err := g.st.pool.Query(ctx, `
WITH input AS (
	SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::int[], $5::jsonb[], $6::text[],
		$7::text[], $8::text[], $9::jsonb[], $10::int[], $11::bigint[], $12::text[], $13::text[])
		AS t(key, token, obs_key, pv, data, fp, event_key, topic, payload, status, bytes, session_id, endpoint)
), cur AS (
	SELECT j.key, j.state, j.fence FROM jobs j JOIN input USING (key)
), upd AS (
	UPDATE jobs j SET state = 'complete', completed_at = now(), updated_at = now(),
		next_attempt_at = NULL, last_category = NULL, bytes_total = j.bytes_total + i.bytes
	FROM input i
	WHERE j.key = i.key AND j.fence = i.token AND j.state = 'running'
	RETURNING j.key
), res AS (
	INSERT INTO results (observation_key, job_key, parser_version, data, response_fingerprint, fence)
	SELECT i.obs_key, i.key, i.pv, i.data, i.fp, i.token FROM input i JOIN upd USING (key)
	ON CONFLICT (observation_key) DO NOTHING
	RETURNING job_key
), ev AS (
	INSERT INTO outbox (event_key, topic, payload)
	SELECT i.event_key, i.topic, i.payload FROM input i JOIN upd USING (key)
	ON CONFLICT (event_key) DO NOTHING
	RETURNING event_key
), att AS (
	UPDATE attempts a SET outcome = 'complete', finished_at = now(), http_status = NULLIF(i.status, 0),
		bytes = i.bytes, session_id = COALESCE(NULLIF(i.session_id, ''), a.session_id),
		proxy_endpoint = COALESCE(NULLIF(i.endpoint, ''), a.proxy_endpoint)
	FROM input i JOIN upd USING (key)
	WHERE a.job_key = i.key AND a.fence = i.token
), dup AS (
	-- Duplicate result writes rejected (committed jobs whose observation key existed) are
	-- counted in the commit itself, as in Commit.
	INSERT INTO maintenance_counters (name, n, updated_at)
	SELECT $15, count(*), now() FROM upd WHERE NOT EXISTS (SELECT 1 FROM res WHERE res.job_key = upd.key)
	HAVING count(*) > 0
	ON CONFLICT (name) DO UPDATE SET n = maintenance_counters.n + EXCLUDED.n, updated_at = now()
), notify AS (
	SELECT pg_notify($14, '') WHERE EXISTS (SELECT 1 FROM ev)
)
SELECT i.key, upd.key IS NOT NULL, res.job_key IS NOT NULL, ev.event_key IS NOT NULL,
	cur.key IS NOT NULL, COALESCE(cur.state, ''), COALESCE(cur.fence, 0)
FROM input i
LEFT JOIN upd USING (key)
LEFT JOIN res ON res.job_key = i.key
LEFT JOIN ev ON ev.event_key = i.event_key
LEFT JOIN cur ON cur.key = i.key
CROSS JOIN (SELECT count(*) FROM notify) AS signalled`,
		cols.key, cols.token, cols.obs, cols.pv, cols.data, cols.fp, cols.evKey, cols.topic,
		cols.payload, cols.status, cols.bytes, cols.session, cols.endpoint, OutboxNotifyChannel, CounterDuplicateResults)
	if err != nil {
		return nil, nil, err
	}
	type row struct {
		done, resIns, evIns, found bool
		state                      string
		fence                      int64
	}
	got := make(map[string]row, n)
	for rows.Next() {
		var key string
		var r row
		if err := rows.Scan(&key, &r.done, &r.resIns, &r.evIns, &r.found, &r.state, &r.fence); err != nil {
			rows.Close()
			return nil, nil, err
		}
		got[key] = r
	}
	if err := rows.Err(); err != nil {
		return nil, nil, err
	}
	res := make([]CommitResult, n)
	errs := make([]error, n)
	for i, p := range batch {
		r, ok := got[p.Key]
		switch {
		case !ok:
			errs[i] = fmt.Errorf("store: group commit: no row for %q", p.Key)
		case r.done:
			res[i] = CommitResult{ResultInserted: r.resIns, EventInserted: r.evIns}
		default:
			errs[i] = g.st.refusal(ctx, "Commit", p.Key, p.Token, r.found, r.state, r.fence, finishStale(p.Token))
		}
	}
	return res, errs, nil
}

// startMany is JobStart for a batch of distinct jobs, in one statement.
func (g *GroupCommitter) startMany(batch []AttemptStartParams) ([]StartedAttempt, []error, error) {
	n := len(batch)
	var keys, workers, sessions, countries, endpoints []string
	var tokens []int64
	for _, p := range batch {
		keys = append(keys, p.Key)
		tokens = append(tokens, p.Token)
		workers = append(workers, p.Worker)
		sessions = append(sessions, p.SessionID)
		countries = append(countries, p.Country)
		endpoints = append(endpoints, p.ProxyEndpoint)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rows, err := g.st.pool.Query(ctx, `
WITH async AS (
	SELECT set_config('synchronous_commit', 'off', true)
), input AS (
	SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[], $5::text[], $6::text[])
		AS t(key, token, worker, session_id, country, endpoint)
), cur AS (
	SELECT j.key, j.state, j.fence FROM jobs j JOIN input USING (key)
), upd AS (
	UPDATE jobs j SET state = 'running', fence = i.token, attempts = j.attempts + 1,
		next_attempt_at = NULL, updated_at = now()
	FROM input i
	WHERE j.key = i.key AND j.state IN ('pending', 'retryable', 'running') AND j.fence < i.token
	RETURNING j.key, j.attempts, j.created_at, j.bytes_total,
		j.attempts - j.budget_attempts AS budget_no, j.bytes_total - j.budget_bytes AS budget_bytes,
		COALESCE(j.budget_since, j.created_at) AS budget_since
), ins AS (
	INSERT INTO attempts (job_key, attempt_no, fence, worker, session_id, country, proxy_endpoint)
	SELECT i.key, u.attempts, i.token, i.worker, i.session_id, i.country, i.endpoint
	FROM input i JOIN upd u USING (key)
	RETURNING job_key, attempt_no
), superseded AS (
	UPDATE attempts a SET outcome = 'superseded', category = 'superseded', finished_at = now(),
		evidence_due = true
	FROM input i JOIN upd USING (key)
	WHERE a.job_key = i.key AND a.outcome = 'running' AND a.fence < i.token
)
SELECT i.key, ins.attempt_no, upd.created_at, COALESCE(upd.bytes_total, 0),
	COALESCE(upd.budget_no, 0), COALESCE(upd.budget_bytes, 0), upd.budget_since,
	cur.key IS NOT NULL, COALESCE(cur.state, ''), COALESCE(cur.fence, 0)
FROM input i
LEFT JOIN upd USING (key)
LEFT JOIN ins ON ins.job_key = i.key
LEFT JOIN cur ON cur.key = i.key
CROSS JOIN async`, keys, tokens, workers, sessions, countries, endpoints)
	if err != nil {
		return nil, nil, err
	}
	type row struct {
		attemptNo   *int32
		createdAt   *time.Time
		bytes       int64
		budgetNo    int32
		budgetBytes int64
		budgetSince *time.Time
		found       bool
		state       string
		fence       int64
	}
	got := make(map[string]row, n)
	for rows.Next() {
		var key string
		var r row
		if err := rows.Scan(&key, &r.attemptNo, &r.createdAt, &r.bytes, &r.budgetNo, &r.budgetBytes, &r.budgetSince, &r.found, &r.state, &r.fence); err != nil {
			rows.Close()
			return nil, nil, err
		}
		got[key] = r
	}
	if err := rows.Err(); err != nil {
		return nil, nil, err
	}
	res := make([]StartedAttempt, n)
	errs := make([]error, n)
	for i, p := range batch {
		r, ok := got[p.Key]
		switch {
		case !ok:
			errs[i] = fmt.Errorf("store: group start: no row for %q", p.Key)
		case r.attemptNo != nil:
			res[i] = StartedAttempt{AttemptNo: int(*r.attemptNo), JobCreatedAt: *r.createdAt, BytesTotal: r.bytes,
				TookOver:        tasks.JobState(r.state) == tasks.StateRunning,
				BudgetAttemptNo: int(r.budgetNo), BudgetBytes: r.budgetBytes, BudgetSince: *r.budgetSince}
		default:
			errs[i] = g.st.refusal(ctx, "JobStart", p.Key, p.Token, r.found, r.state, r.fence, startStale(p.Token))
		}
	}
	return res, errs, nil
}
