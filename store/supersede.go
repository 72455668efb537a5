package store

import (
	"context"
	"errors"
	"fmt"
)

// AttemptSupersedeParams is the evidence of an attempt whose commit or finish was refused
// (its job was taken over, rescued, or finished under a newer token).
type AttemptSupersedeParams struct {
	Key           string
	Token         int64  // the fencing token the attempt was started with
	Bytes         int64  // bytes the attempt transferred; added to jobs.bytes_total once
	HTTPStatus    int    // last destination status, 0 if none
	SessionID     string // proxy session id ("" keeps the recorded one)
	ProxyEndpoint string // redacted endpoint, host:port only ("" keeps the recorded one)
	Category      string // why the worker stopped, e.g. "superseded" ("" means "superseded")
	Error         string // error text, already free of credentials; cut to 2000 bytes, NULs dropped
	Cost          Cost   // what Bytes cost at the proxy's price (zero: no price); added once
}

// ErrAttemptLive: AttemptSupersede was called for the attempt the job is running under;
// that attempt must be finished (JobComplete, Commit, JobMarkRetryable, JobFail) instead.
var ErrAttemptLive = errors.New("store: attempt is the job's live attempt")

// AttemptSupersede records the evidence of a refused attempt, in one statement: the
// attempt row (p.Key, fence p.Token) gets its bytes, status, session and error, and
// p.Bytes is added to jobs.bytes_total, so bytes per logical job count duplicate work too.
//
// It is an additive, unfenced evidence update: it never changes the job's state or fence,
// and it applies at most once per attempt. It applies to an attempt whose row was written
// as lost by whoever raised the fence past it (a takeover's JobStart, the reconciler's
// JobRescue) and that has not reported yet: it becomes superseded, its category and error
// are kept, the bytes and the worker's evidence added. (A row still 'running', written by
// a worker of a version before migration 00016, becomes superseded with p.Category.) A repeated call, a call for an attempt its worker already finished, or
// for an attempt that does not exist (e.g. a start lost in a crash) writes nothing and
// returns nil. A call for the job's live attempt (state running, fence = p.Token) writes
// nothing and returns an error wrapping ErrAttemptLive.
func (s *PG) AttemptSupersede(ctx context.Context, p AttemptSupersedeParams) error {
	switch {
	case p.Key == "":
		return errors.New("store: AttemptSupersede: Key is empty")
	case p.Token < 1:
		return fmt.Errorf("store: AttemptSupersede %q: Token %d must be >= 1", p.Key, p.Token)
	case p.Bytes < 0:
		return fmt.Errorf("store: AttemptSupersede %q: Bytes %d is negative", p.Key, p.Bytes)
	case p.HTTPStatus < 0:
		return fmt.Errorf("store: AttemptSupersede %q: HTTPStatus %d is negative", p.Key, p.HTTPStatus)
	}
	if err := p.Cost.check("AttemptSupersede", p.Key); err != nil {
		return err
	}
	category := p.Category
	if category == "" {
		category = OutcomeSuperseded
	}
	var live bool
	// The jobs row is locked first, as every transition does (jobs, then attempts), so the
	// live check sees the row as it is now and the lock order can not deadlock with a
	// takeover. Two concurrent calls serialise on it: the second then re-checks
	// outcome/evidence_due on the updated attempt and matches nothing, so jobs.bytes_total
	// is raised only by the call that updated the attempt.
	err := s.pool.QueryRow(ctx, `
WITH job AS (
	SELECT state = 'running' AND fence = $2 AS live FROM jobs WHERE key = $1 FOR UPDATE
), att AS (
	UPDATE attempts a SET
		outcome = CASE WHEN a.outcome IN ('running', 'lost') THEN 'superseded' ELSE a.outcome END,
		category = CASE WHEN a.outcome = 'running' THEN $7 ELSE COALESCE(a.category, $7) END,
		finished_at = COALESCE(a.finished_at, now()),
		bytes = a.bytes + $3,
		-- A lost row carries its reservation (its worker might never report): the
		-- worker's report replaces it by what the attempt really cost.
		cost_micros = CASE WHEN a.outcome = 'lost' THEN $9 ELSE a.cost_micros + $9 END,
		currency = CASE WHEN a.outcome = 'lost' AND $9 = 0 THEN NULL ELSE COALESCE(NULLIF($10, ''), a.currency) END,
		http_status = COALESCE(NULLIF($4, 0), a.http_status),
		session_id = COALESCE(NULLIF($5, ''), a.session_id),
		proxy_endpoint = COALESCE(NULLIF($6, ''), a.proxy_endpoint),
		error = COALESCE(a.error, NULLIF($8, '')),
		evidence_due = false
	WHERE a.job_key = $1 AND a.fence = $2 AND (a.outcome = 'running' OR a.evidence_due)
		AND NOT COALESCE((SELECT live FROM job), false)
	RETURNING a.bytes
), upd AS (
	UPDATE jobs SET bytes_total = bytes_total + $3
	WHERE key = $1 AND EXISTS (SELECT 1 FROM att)
)
SELECT COALESCE((SELECT live FROM job), false)`,
		p.Key, p.Token, p.Bytes, p.HTTPStatus, p.SessionID, p.ProxyEndpoint, category,
		truncateUTF8(p.Error, maxErrorText), p.Cost.Micros, p.Cost.Currency,
	).Scan(&live)
	if err != nil {
		return fmt.Errorf("store: AttemptSupersede %q: %w", p.Key, err)
	}
	if live {
		return fmt.Errorf("store: AttemptSupersede %q token %d: %w", p.Key, p.Token, ErrAttemptLive)
	}
	return nil
}
