package store

import (
	"context"
	"fmt"
)

// Stats is the duplicate-work picture of the system of record: what `idemscrape stats`
// prints, computed from PostgreSQL alone.
type Stats struct {
	JobsByState             map[string]int64 `json:"jobs_by_state"`
	Attempts                int64            `json:"attempts"`
	AttemptsPerCompletedJob float64          `json:"attempts_per_completed_job"`
	CompletedAfterTakeover  int64            `json:"jobs_completed_after_lease_recovery"`
	SupersededAttempts      int64            `json:"superseded_attempts"`
	BytesPerLogicalJob      float64          `json:"bytes_per_logical_job"`
	RetriesByCategory       map[string]int64 `json:"retries_by_category"`
	FailuresByCategory      map[string]int64 `json:"failures_by_category"`
	Quarantined             int64            `json:"quarantined_stagings"`
	OutboxUnsent            int64            `json:"outbox_unsent"`
	// Maintenance holds the maintenance counters (CountersAdd): the reconciler's actions.
	Maintenance map[string]int64 `json:"maintenance"`
}

// StatsNoCategory is the key under which RetriesByCategory and FailuresByCategory count
// attempts and jobs that carry no category.
const StatsNoCategory = ""

// StatsGet computes Stats in one round trip. Attempts and jobs without a category are
// counted under StatsNoCategory.
func (s *PG) StatsGet(ctx context.Context) (Stats, error) {
	st := Stats{JobsByState: map[string]int64{}, RetriesByCategory: map[string]int64{}, FailuresByCategory: map[string]int64{},
		Maintenance: map[string]int64{}}
	var byState, retries, failures, maintenance map[string]int64
	err := s.pool.QueryRow(ctx, `
SELECT
	COALESCE((SELECT jsonb_object_agg(state, n) FROM (SELECT state, count(*) AS n FROM jobs GROUP BY state) s), '{}'),
	(SELECT count(*) FROM attempts),
	COALESCE((SELECT avg(attempts) FROM jobs WHERE state = 'complete'), 0),
	(SELECT count(DISTINCT a.job_key) FROM attempts a JOIN jobs j ON j.key = a.job_key
		WHERE j.state = 'complete' AND a.outcome = 'superseded'),
	(SELECT count(*) FROM attempts WHERE outcome = 'superseded'),
	COALESCE((SELECT avg(bytes_total) FROM jobs WHERE state IN ('complete', 'failed')), 0),
	COALESCE((SELECT jsonb_object_agg(COALESCE(category, $1), n) FROM (SELECT category, count(*) AS n FROM attempts
		WHERE outcome = 'retryable' GROUP BY category) r), '{}'),
	COALESCE((SELECT jsonb_object_agg(COALESCE(last_category, $1), n) FROM (SELECT last_category, count(*) AS n FROM jobs
		WHERE state = 'failed' GROUP BY last_category) f), '{}'),
	(SELECT count(*) FROM quarantine),
	(SELECT count(*) FROM outbox WHERE sent_at IS NULL),
	COALESCE((SELECT jsonb_object_agg(name, n) FROM maintenance_counters), '{}')`, StatsNoCategory).Scan(
		&byState, &st.Attempts, &st.AttemptsPerCompletedJob, &st.CompletedAfterTakeover, &st.SupersededAttempts,
		&st.BytesPerLogicalJob, &retries, &failures, &st.Quarantined, &st.OutboxUnsent, &maintenance)
	if err != nil {
		return Stats{}, fmt.Errorf("store: StatsGet: %w", err)
	}
	for k, v := range byState {
		st.JobsByState[k] = v
	}
	for k, v := range retries {
		st.RetriesByCategory[k] = v
	}
	for k, v := range failures {
		st.FailuresByCategory[k] = v
	}
	for k, v := range maintenance {
		st.Maintenance[k] = v
	}
	return st, nil
}
