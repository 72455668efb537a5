package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"
)

// OutboxNotifyChannel is the LISTEN/NOTIFY channel a commit signals when it writes an
// outbox event, so dispatchers wake without polling.
const OutboxNotifyChannel = "idemscrape_outbox"

// CommitParams is the complete outcome of a successful attempt.
type CommitParams struct {
	Key   string
	Token int64 // the attempt's fencing token

	// The observation, behind the unique index on ObservationKey.
	ObservationKey string
	ParserVersion  int
	Data           json.RawMessage // the normalised record, valid JSON
	Fingerprint    string          // sha256 of the response(s) the record was parsed from

	// The outbox event published after the commit; EventKey is stable per observation so
	// consumers recognise a replay.
	EventKey     string
	Topic        string
	EventPayload json.RawMessage

	// Attempt evidence.
	HTTPStatus    int
	Bytes         int64
	SessionID     string
	ProxyEndpoint string
}

// CommitResult reports what the commit wrote.
type CommitResult struct {
	ResultInserted bool // false: the observation key existed (a duplicate write, rejected)
	EventInserted  bool // false: the event key existed
}

// Validate checks a commit before anything is sent.
func (p *CommitParams) Validate() error {
	switch {
	case p.Key == "":
		return errors.New("store: commit: Key is empty")
	case p.Token < 1:
		return fmt.Errorf("store: commit %q: token %d must be >= 1", p.Key, p.Token)
	case p.ObservationKey == "":
		return fmt.Errorf("store: commit %q: ObservationKey is empty", p.Key)
	case p.ParserVersion < 1:
		return fmt.Errorf("store: commit %q: ParserVersion %d must be >= 1", p.Key, p.ParserVersion)
	case !json.Valid(p.Data):
		return fmt.Errorf("store: commit %q: Data is not valid JSON", p.Key)
	case JSONHasNUL(p.Data) || JSONHasNUL(p.EventPayload):
		return fmt.Errorf("store: commit %q: Data or EventPayload contains a NUL character (\\u0000), which PostgreSQL jsonb refuses", p.Key)
	case p.EventKey == "" || p.Topic == "":
		return fmt.Errorf("store: commit %q: EventKey and Topic are required", p.Key)
	case !json.Valid(p.EventPayload):
		return fmt.Errorf("store: commit %q: EventPayload is not valid JSON", p.Key)
	case p.Bytes < 0:
		return fmt.Errorf("store: commit %q: Bytes %d is negative", p.Key, p.Bytes)
	}
	return nil
}

// Commit makes an attempt's observation take effect, in ONE statement (one transaction,
// one round trip): the job becomes complete only WHERE fence = Token AND state = 'running';
// the result is inserted behind the unique observation key (ON CONFLICT DO NOTHING, the
// conflict reported); the outbox event is inserted (unique event key) and dispatchers are
// notified; the attempt is closed with its evidence. If the fence or state does not match,
// nothing at all is written and a *TransitionError is returned (the attempt was
// superseded).
func (s *PG) Commit(ctx context.Context, p CommitParams) (CommitResult, error) {
	if err := p.Validate(); err != nil {
		return CommitResult{}, err
	}
	var (
		done, resIns, evIns, found bool
		state                      string
		fence                      int64
	)
	err := s.pool.QueryRow(ctx, `
WITH cur AS (
	SELECT state, fence FROM jobs WHERE key = $1
), upd AS (
	UPDATE jobs SET state = 'complete', completed_at = now(), updated_at = now(),
		next_attempt_at = NULL, last_category = NULL, bytes_total = bytes_total + $11
	WHERE key = $1 AND fence = $2 AND state = 'running'
	RETURNING key
), res AS (
	INSERT INTO results (observation_key, job_key, parser_version, data, response_fingerprint, fence)
	SELECT $3, $1, $4, $5, $6, $2 FROM upd
	ON CONFLICT (observation_key) DO NOTHING
	RETURNING 1
), ev AS (
	INSERT INTO outbox (event_key, topic, payload)
	SELECT $7, $8, $9 FROM upd
	ON CONFLICT (event_key) DO NOTHING
	RETURNING id
), att AS (
	UPDATE attempts SET outcome = 'complete', finished_at = now(), http_status = NULLIF($10, 0),
		bytes = $11, session_id = COALESCE(NULLIF($12, ''), session_id),
		proxy_endpoint = COALESCE(NULLIF($13, ''), proxy_endpoint)
	WHERE job_key = $1 AND fence = $2 AND EXISTS (SELECT 1 FROM upd)
), dup AS (
	-- A duplicate result write rejected (the job committed but its observation key existed)
	-- is counted here, in the commit itself, so idemscrape stats reads it from PostgreSQL.
	INSERT INTO maintenance_counters (name, n, updated_at)
	SELECT $15, 1, now() FROM upd WHERE NOT EXISTS (SELECT 1 FROM res)
	ON CONFLICT (name) DO UPDATE SET n = maintenance_counters.n + 1, updated_at = now()
), notify AS (
	SELECT pg_notify($14, '') FROM ev
)
SELECT EXISTS (SELECT 1 FROM upd), EXISTS (SELECT 1 FROM res), EXISTS (SELECT 1 FROM ev),
	(SELECT count(*) FROM notify) >= 0,
	cur.state IS NOT NULL, COALESCE(cur.state, ''), COALESCE(cur.fence, 0)
FROM (SELECT 1) AS one LEFT JOIN cur ON true`,
		p.Key, p.Token, p.ObservationKey, p.ParserVersion, p.Data, p.Fingerprint,
		p.EventKey, p.Topic, p.EventPayload, p.HTTPStatus, p.Bytes, p.SessionID, p.ProxyEndpoint,
		OutboxNotifyChannel, CounterDuplicateResults,
	).Scan(&done, &resIns, &evIns, new(bool), &found, &state, &fence)
	if err != nil {
		return CommitResult{}, fmt.Errorf("store: Commit %q: %w", p.Key, err)
	}
	if !done {
		return CommitResult{}, s.refusal(ctx, "Commit", p.Key, p.Token, found, state, fence, finishStale(p.Token))
	}
	return CommitResult{ResultInserted: resIns, EventInserted: evIns}, nil
}

// QuarantineParams is the staging of a workflow run that did not finish.
type QuarantineParams struct {
	Key       string
	AttemptNo int
	SessionID string
	Reason    string          // category
	Detail    string          // error text, free of credentials
	Staged    json.RawMessage // may be nil
}

// QuarantineInsert keeps a run's staging for review. It is evidence, not a transition:
// it is written whatever the job's state.
func (s *PG) QuarantineInsert(ctx context.Context, p QuarantineParams) error {
	if p.Key == "" || p.Reason == "" {
		return errors.New("store: QuarantineInsert: Key and Reason are required")
	}
	if p.Staged != nil && !json.Valid(p.Staged) {
		return fmt.Errorf("store: QuarantineInsert %q: Staged is not valid JSON", p.Key)
	}
	reason := p.Reason
	if p.Detail != "" {
		reason += ": " + truncateUTF8(p.Detail, maxErrorText)
	}
	_, err := s.pool.Exec(ctx, `
INSERT INTO quarantine (job_key, attempt_no, session_id, reason, staged)
VALUES ($1, $2, $3, $4, $5)`, p.Key, p.AttemptNo, p.SessionID, reason, p.Staged)
	if err != nil {
		return fmt.Errorf("store: QuarantineInsert %q: %w", p.Key, err)
	}
	return nil
}

// Quarantined is one quarantine row.
type Quarantined struct {
	JobKey    string          `db:"job_key"`
	AttemptNo int             `db:"attempt_no"`
	SessionID string          `db:"session_id"`
	Reason    string          `db:"reason"`
	Staged    json.RawMessage `db:"staged"`
	CreatedAt time.Time       `db:"created_at"`
}
