package store

import (
	"context"
	"fmt"
	"slices"
)

// Cost uses of an attempt, the keys of CostStats.Waste (and CostUseful): what the bytes
// of an attempt bought.
const (
	// CostUseful: the complete attempt whose result row is the job's (not wasted).
	CostUseful = "useful"
	// CostDuplicate: a complete attempt whose observation key was taken (a duplicate
	// result write, rejected).
	CostDuplicate = "duplicate"
	// CostSuperseded: an attempt taken over (superseded, or lost and reported later).
	CostSuperseded = "superseded"
	// CostLeaseExpired: an attempt the reconciler rescued after its lease expired.
	CostLeaseExpired = CategoryLeaseExpired
	// Attempts that ended retryable or failed are keyed "retryable/<category>" and
	// "failed/<category>" ("retryable", "failed" without a category).
)

// CostStats is what the attempts' proxy traffic cost in one currency: the sum of
// attempts.cost_micros, by use. Useful + the sum of Waste = TotalMicros, and the sums by
// kind, window and proxy endpoint each add up to TotalMicros too. Micro-units of Currency
// (1,000,000 = 1.00). Attempts without a price (cost 0) are not counted.
type CostStats struct {
	Currency    string `json:"currency"`
	TotalMicros int64  `json:"total_micros"`
	Attempts    int64  `json:"attempts"` // attempts with a cost
	// CompletedJobs are the complete jobs with a cost in this currency, and
	// PerCompletedJobMicros what their attempts cost, all of them, per job.
	CompletedJobs         int64            `json:"completed_jobs"`
	PerCompletedJobMicros int64            `json:"per_completed_job_micros"`
	UsefulMicros          int64            `json:"useful_micros"`
	Waste                 map[string]int64 `json:"waste_micros"` // by use (see CostUseful)
	ByKind                map[string]int64 `json:"by_kind_micros"`
	ByWindow              map[string]int64 `json:"by_window_micros"`
	ByProxyEndpoint       map[string]int64 `json:"by_proxy_endpoint_micros"`
}

// StatsCost adds up the attempts' costs, one CostStats per currency, ordered by currency,
// in one statement (one snapshot). An operator's query: it reads the attempts table.
func (s *PG) StatsCost(ctx context.Context) ([]CostStats, error) {
	rows, err := s.pool.Query(ctx, `
WITH a AS (
	SELECT a.currency, a.cost_micros AS c, a.job_key, j.kind, j."window", a.proxy_endpoint, j.state = 'complete' AS job_done,
		CASE
			WHEN a.outcome = 'complete' AND EXISTS (SELECT 1 FROM results r WHERE r.job_key = a.job_key AND r.fence = a.fence)
				THEN $1
			WHEN a.outcome = 'complete' THEN $2
			WHEN a.category = $4 THEN $4
			WHEN a.outcome IN ('superseded', 'lost') THEN $3
			ELSE a.outcome || COALESCE('/' || a.category, '')
		END AS use
	FROM attempts a JOIN jobs j ON j.key = a.job_key
	WHERE a.cost_micros > 0
)
SELECT g.currency, use, kind, "window", proxy_endpoint, sum(c)::bigint, count(*),
	COALESCE(sum(c) FILTER (WHERE job_done), 0)::bigint, min(d.jobs)
FROM a g JOIN (SELECT currency, count(DISTINCT job_key) FILTER (WHERE job_done) AS jobs FROM a GROUP BY currency) d
	ON d.currency = g.currency
GROUP BY g.currency, use, kind, "window", proxy_endpoint`,
		CostUseful, CostDuplicate, CostSuperseded, CostLeaseExpired)
	if err != nil {
		return nil, fmt.Errorf("store: StatsCost: %w", err)
	}
	defer rows.Close()
	by := map[string]*CostStats{}
	var order []string
	doneCost := map[string]int64{}
	for rows.Next() {
		var cur, use, kind, window, endpoint string
		var sum, n, jobsCost, jobs int64
		if err := rows.Scan(&cur, &use, &kind, &window, &endpoint, &sum, &n, &jobsCost, &jobs); err != nil {
			return nil, fmt.Errorf("store: StatsCost: %w", err)
		}
		cs := by[cur]
		if cs == nil {
			cs = &CostStats{Currency: cur, CompletedJobs: jobs, Waste: map[string]int64{}, ByKind: map[string]int64{},
				ByWindow: map[string]int64{}, ByProxyEndpoint: map[string]int64{}}
			by[cur] = cs
			order = append(order, cur)
		}
		cs.TotalMicros += sum
		cs.Attempts += n
		if use == CostUseful {
			cs.UsefulMicros += sum
		} else {
			cs.Waste[use] += sum
		}
		cs.ByKind[kind] += sum
		cs.ByWindow[window] += sum
		cs.ByProxyEndpoint[endpoint] += sum
		doneCost[cur] += jobsCost
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("store: StatsCost: %w", err)
	}
	slices.Sort(order)
	out := make([]CostStats, 0, len(order))
	for _, cur := range order {
		cs := by[cur]
		if cs.CompletedJobs > 0 {
			cs.PerCompletedJobMicros = (doneCost[cur] + cs.CompletedJobs/2) / cs.CompletedJobs
		}
		out = append(out, *cs)
	}
	return out, nil
}

// WindowCost is what the recorded attempts of one kind's collection window cost in
// currency (micro-units): the system of record for a window's money budget, read when
// Redis has lost its running total (handlers' window budgets). One index scan of the
// window's jobs (jobs_kind_window_idx) and their attempts. An attempt still running costs
// nothing yet: its worker adds its cost when it records the attempt's end.
func (s *PG) WindowCost(ctx context.Context, kind, window, currency string) (int64, error) {
	var micros int64
	err := s.pool.QueryRow(ctx, `
SELECT COALESCE(sum(a.cost_micros), 0)::bigint
FROM jobs j JOIN attempts a ON a.job_key = j.key
WHERE j.kind = $1 AND j."window" = $2 AND a.currency = $3`, kind, window, currency).Scan(&micros)
	if err != nil {
		return 0, fmt.Errorf("store: WindowCost %s/%s: %w", kind, window, err)
	}
	return micros, nil
}
