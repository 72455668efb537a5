package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"regexp"
	"time"
)

// OutboxNotifyChannel is the LISTEN/NOTIFY channel signalled after a commit that wrote
// outbox events, so dispatchers wake without polling. A NOTIFY means "new rows may exist";
// it is sent after the commit returned (in a transaction of its own), never before.
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
	Cost          Cost // what the attempt's bytes cost at its proxy's price (zero: no price)
	// SessionUnits is how many units the attempt's session had served before it (0: a new
	// session; > 0: a warm one from the worker's session pool).
	SessionUnits int
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
	case p.SessionUnits < 0 || p.SessionUnits > math.MaxInt32:
		return fmt.Errorf("store: commit %q: SessionUnits %d is out of range", p.Key, p.SessionUnits)
	}
	return p.Cost.check("commit", p.Key)
}

// Cost is what an attempt's bytes cost at its proxy's price, in integer micro-units of
// Currency (1 USD = 1,000,000 micro-units): no floats reach the database. The zero Cost is
// "no price configured".
type Cost struct {
	Micros   int64
	Currency string // ISO 4217 code, e.g. "USD"; required when Micros > 0
}

var currencyCode = regexp.MustCompile(`^[A-Z]{3}$`)

// String writes the cost as a decimal amount with its currency, e.g. "0.000021 USD".
func (c Cost) String() string {
	return fmt.Sprintf("%d.%06d %s", c.Micros/1_000_000, c.Micros%1_000_000, c.Currency)
}

// check refuses what the attempts table would refuse, naming the attempt.
func (c Cost) check(op, key string) error {
	switch {
	case c.Micros < 0:
		return fmt.Errorf("store: %s %q: cost %d micro-units is negative", op, key, c.Micros)
	case c.Currency != "" && !currencyCode.MatchString(c.Currency):
		return fmt.Errorf("store: %s %q: currency %q is not an ISO 4217 code (three capital letters)", op, key, c.Currency)
	case c.Micros > 0 && c.Currency == "":
		return fmt.Errorf("store: %s %q: cost %d micro-units has no currency", op, key, c.Micros)
	}
	return nil
}

// Commit makes an attempt's observation take effect, in ONE statement (one transaction,
// one round trip): the job becomes complete only WHERE fence = Token AND state = 'running';
// the result is inserted behind the unique observation key (ON CONFLICT DO NOTHING, the
// conflict reported); the outbox event is inserted (unique event key); the attempt is closed with its evidence. If the fence or state does not match,
// nothing at all is written and a *TransitionError is returned (the attempt was
// superseded). The job's row is locked first (waiting, within ctx, for a lock another
// transaction holds). It is the statement of the GroupCommitter, for a batch of one. After
// a commit that inserted its event, dispatchers are notified by a second, asynchronously
// committed statement (see GroupConfig.NotifyInterval for why not in the commit).
func (s *PG) Commit(ctx context.Context, p CommitParams) (CommitResult, error) {
	if err := p.Validate(); err != nil {
		return CommitResult{}, err
	}
	out, err := s.commitRows(ctx, []CommitParams{p}, lockWait, false)
	if err != nil {
		return CommitResult{}, fmt.Errorf("store: Commit %q: %w", p.Key, err)
	}
	if out[0].err == nil && out[0].res.EventInserted {
		// Committed: a failed NOTIFY only delays the event to the dispatchers' next poll,
		// so it does not make the commit an error.
		_ = sendNotify(ctx, s.pool)
	}
	return out[0].res, out[0].err
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
