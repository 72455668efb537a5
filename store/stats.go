package store

import (
	"context"
	"fmt"
)

// CounterDuplicateResults is the maintenance_counters row that Commit (and the group
// commit) add to, in the commit statement itself, whenever a job committed but its result
// insert found the observation key taken: a duplicate result write rejected by the unique
// index. StatsGet reports it as DuplicateResultsRejected, not under Maintenance.
const CounterDuplicateResults = "duplicate_results"

// Stats is the duplicate-work picture of the system of record: what `idemscrape stats`
// prints, computed from PostgreSQL alone. The six measures of the design's Measurement
// section are AttemptsPerCompletedJob, CompletedAfterTakeover, DuplicateResultsRejected,
// OutboxReplaysDeduplicated, BytesPerLogicalJob and RetriesCausedByCategory.
type Stats struct {
	JobsByState             map[string]int64 `json:"jobs_by_state"`
	Attempts                int64            `json:"attempts"`
	AttemptsPerCompletedJob float64          `json:"attempts_per_completed_job"`
	// CompletedAfterTakeover counts complete jobs with an attempt that lost its lease: one
	// superseded by a takeover, or rescued by the reconciler (category lease_expired).
	CompletedAfterTakeover int64 `json:"jobs_completed_after_lease_recovery"`
	SupersededAttempts     int64 `json:"superseded_attempts"`
	// LeaseExpiredAttempts counts attempts the reconciler rescued (category lease_expired).
	LeaseExpiredAttempts int64 `json:"lease_expired_attempts"`
	// DuplicateResultsRejected counts commits whose result insert found its observation key
	// taken (ON CONFLICT DO NOTHING), recorded by the commit itself.
	DuplicateResultsRejected int64 `json:"duplicate_result_writes_rejected"`
	// OutboxReplaysDeduplicated is the sum of outbox_inbox.replays: deliveries a consumer's
	// inbox recognised as replays and skipped (store/outbox Consumer.RunTx).
	OutboxReplaysDeduplicated int64 `json:"outbox_events_deduplicated_downstream"`
	// OutboxSent counts outbox events dispatched (behind their topic's position, view
	// outbox_sent) and not yet pruned.
	OutboxSent         int64   `json:"outbox_sent"`
	BytesPerLogicalJob float64 `json:"bytes_per_logical_job"`
	// RetriesByCategory counts attempts that ended retryable, by category.
	RetriesByCategory map[string]int64 `json:"retries_by_category"`
	// RetriesCausedByCategory counts every attempt that was followed by another attempt of
	// its job (each caused one retry), by its category, or by its outcome when it has none
	// (StatsNoCategory if neither says more than "retryable"): superseded and lease_expired
	// attempts are the retries leases caused.
	RetriesCausedByCategory map[string]int64 `json:"retries_caused_by_category"`
	FailuresByCategory      map[string]int64 `json:"failures_by_category"`
	Quarantined             int64            `json:"quarantined_stagings"`
	OutboxUnsent            int64            `json:"outbox_unsent"`
	// Maintenance holds the maintenance counters (CountersAdd): the reconciler's actions.
	// CounterDuplicateResults is reported as DuplicateResultsRejected instead.
	Maintenance map[string]int64 `json:"maintenance"`
}

// StatsNoCategory is the key under which RetriesByCategory and FailuresByCategory count
// attempts and jobs that carry no category.
const StatsNoCategory = ""

// StatsGet computes Stats in one round trip (one snapshot). Attempts and jobs without a
// category are counted under StatsNoCategory. It reads whole tables: an operator's query,
// not one for a hot path.
func (s *PG) StatsGet(ctx context.Context) (Stats, error) {
	st := Stats{JobsByState: map[string]int64{}, RetriesByCategory: map[string]int64{}, FailuresByCategory: map[string]int64{},
		RetriesCausedByCategory: map[string]int64{}, Maintenance: map[string]int64{}}
	var byState, retries, caused, failures, maintenance map[string]int64
	err := s.pool.QueryRow(ctx, `
SELECT
	COALESCE((SELECT jsonb_object_agg(state, n) FROM (SELECT state, count(*) AS n FROM jobs GROUP BY state) s), '{}'),
	(SELECT count(*) FROM attempts) + (SELECT count(*) FROM jobs j WHERE j.state = 'running'
		AND NOT EXISTS (SELECT 1 FROM attempts a WHERE a.job_key = j.key AND a.fence = j.fence)),
	COALESCE((SELECT avg(attempts) FROM jobs WHERE state = 'complete'), 0),
	(SELECT count(DISTINCT a.job_key) FROM attempts a JOIN jobs j ON j.key = a.job_key
		WHERE j.state = 'complete' AND (a.outcome IN ('superseded', 'lost') OR a.category = $2)),
	(SELECT count(*) FROM attempts WHERE outcome IN ('superseded', 'lost') AND category IS DISTINCT FROM $2),
	(SELECT count(*) FROM attempts WHERE category = $2),
	COALESCE((SELECT n FROM maintenance_counters WHERE name = $3), 0),
	COALESCE((SELECT sum(replays) FROM outbox_inbox), 0)::bigint,
	(SELECT count(*) FROM outbox_sent),
	COALESCE((SELECT avg(bytes_total) FROM jobs WHERE state IN ('complete', 'failed')), 0),
	COALESCE((SELECT jsonb_object_agg(COALESCE(category, $1), n) FROM (SELECT category, count(*) AS n FROM attempts
		WHERE outcome = 'retryable' GROUP BY category) r), '{}'),
	COALESCE((SELECT jsonb_object_agg(c, n) FROM (
		SELECT COALESCE(a.category, CASE WHEN a.outcome = 'retryable' THEN $1 ELSE a.outcome END) AS c, count(*) AS n
		FROM attempts a JOIN jobs j ON j.key = a.job_key
		WHERE a.attempt_no < j.attempts GROUP BY 1) rc), '{}'),
	COALESCE((SELECT jsonb_object_agg(COALESCE(last_category, $1), n) FROM (SELECT last_category, count(*) AS n FROM jobs
		WHERE state = 'failed' GROUP BY last_category) f), '{}'),
	(SELECT count(*) FROM quarantine),
	(SELECT count(*) FROM outbox_unsent),
	COALESCE((SELECT jsonb_object_agg(name, n) FROM maintenance_counters WHERE name <> $3), '{}')`,
		StatsNoCategory, CategoryLeaseExpired, CounterDuplicateResults).Scan(
		&byState, &st.Attempts, &st.AttemptsPerCompletedJob, &st.CompletedAfterTakeover, &st.SupersededAttempts,
		&st.LeaseExpiredAttempts, &st.DuplicateResultsRejected, &st.OutboxReplaysDeduplicated, &st.OutboxSent,
		&st.BytesPerLogicalJob, &retries, &caused, &failures, &st.Quarantined, &st.OutboxUnsent, &maintenance)
	if err != nil {
		return Stats{}, fmt.Errorf("store: StatsGet: %w", err)
	}
	for k, v := range byState {
		st.JobsByState[k] = v
	}
	for k, v := range retries {
		st.RetriesByCategory[k] = v
	}
	for k, v := range caused {
		st.RetriesCausedByCategory[k] = v
	}
	for k, v := range failures {
		st.FailuresByCategory[k] = v
	}
	for k, v := range maintenance {
		st.Maintenance[k] = v
	}
	return st, nil
}
