package store

import (
	"context"
	"fmt"
)

// ProviderStats is what the attempts of one proxy provider (account) and tier did:
// several accounts or tiers may share a gateway address, so they are told apart by the
// name and tier each attempt recorded (migration 00019), not by proxy_endpoint. Attempts
// recorded before that have Provider and Tier "".
type ProviderStats struct {
	Provider string `json:"provider"`
	Tier     string `json:"tier"`
	// Attempts counts all its recorded attempts (the attempts table: running ones are not
	// there yet), charged or not.
	Attempts int64 `json:"attempts"`
	// Charged counts those with a cost (cost_micros > 0), the attempts CostStats.Attempts
	// counts: the others cost nothing (the proxy refused them, a 407 or a 502; they were
	// lost and their worker has not reported; their worker has no price).
	Charged int64 `json:"charged"`
	// Complete counts its attempts that completed their job.
	Complete int64 `json:"complete"`
	// Lost counts its attempts written as lost or superseded (taken over).
	Lost  int64 `json:"lost"`
	Bytes int64 `json:"bytes"`
	// Costs is what its attempts cost, one entry per currency (sorted; none without a
	// price).
	Costs []ProviderCost `json:"costs"`
}

// ProviderCost is what a provider's attempts cost in one currency, how many were charged
// in it, and that cost per completed attempt (wasted attempts included) rounded to whole
// micro-units.
type ProviderCost struct {
	Currency          string `json:"currency"`
	Micros            int64  `json:"micros"`
	Attempts          int64  `json:"attempts"` // its attempts with a cost in Currency
	PerCompleteMicros int64  `json:"per_complete_micros"`
}

// StatsByProvider adds up the attempts by provider and tier, ordered by provider then
// tier, in one statement. An operator's query: it reads the attempts table. Its Charged
// attempts are the ones StatsCost counts (cost_micros > 0), so that the two add up.
func (s *PG) StatsByProvider(ctx context.Context) ([]ProviderStats, error) {
	rows, err := s.pool.Query(ctx, `
SELECT provider, tier, COALESCE(currency, ''), count(*), count(*) FILTER (WHERE cost_micros > 0),
	count(*) FILTER (WHERE outcome = 'complete'), count(*) FILTER (WHERE outcome IN ('lost', 'superseded')),
	COALESCE(sum(bytes), 0)::bigint, COALESCE(sum(cost_micros), 0)::bigint
FROM attempts
GROUP BY provider, tier, COALESCE(currency, '')
ORDER BY provider, tier, COALESCE(currency, '')`)
	if err != nil {
		return nil, fmt.Errorf("store: StatsByProvider: %w", err)
	}
	defer rows.Close()
	var out []ProviderStats
	for rows.Next() {
		var provider, tier, currency string
		var n, charged, complete, lost, bytes, cost int64
		if err := rows.Scan(&provider, &tier, &currency, &n, &charged, &complete, &lost, &bytes, &cost); err != nil {
			return nil, fmt.Errorf("store: StatsByProvider: %w", err)
		}
		if len(out) == 0 || out[len(out)-1].Provider != provider || out[len(out)-1].Tier != tier {
			out = append(out, ProviderStats{Provider: provider, Tier: tier, Costs: []ProviderCost{}})
		}
		p := &out[len(out)-1]
		p.Attempts += n
		p.Charged += charged
		p.Complete += complete
		p.Lost += lost
		p.Bytes += bytes
		if currency != "" && cost > 0 { // rows come sorted by currency: one entry each
			p.Costs = append(p.Costs, ProviderCost{Currency: currency, Micros: cost, Attempts: charged})
		}
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("store: StatsByProvider: %w", err)
	}
	for i := range out {
		if p := &out[i]; p.Complete > 0 {
			for j := range p.Costs {
				p.Costs[j].PerCompleteMicros = (p.Costs[j].Micros + p.Complete/2) / p.Complete
			}
		}
	}
	return out, nil
}

// SessionStats is what the attempts that ended on new sessions, or on warm ones from a
// worker's session pool (migration 00022: attempts.session_units > 0), did: bytes per
// attempt and the block rate, to judge what the pool saves. Attempts that never reached a
// session (lost ones, whose worker never reported; refusals before any fetch) are left out.
type SessionStats struct {
	Session  string `json:"session"` // "new" or "warm"
	Attempts int64  `json:"attempts"`
	Complete int64  `json:"complete"`
	// Blocked counts its attempts that failed with category blocked.
	Blocked int64 `json:"blocked"`
	Bytes   int64 `json:"bytes"`
	// BytesPerAttempt is Bytes / Attempts, rounded down (0 without attempts).
	BytesPerAttempt int64 `json:"bytes_per_attempt"`
	// BlockRate is Blocked / Attempts (0 without attempts).
	BlockRate float64 `json:"block_rate"`
}

// StatsBySession adds up the attempts by session kind, new first then warm, in one
// statement; a kind with no attempts is left out. An operator's query: it reads the
// attempts table.
func (s *PG) StatsBySession(ctx context.Context) ([]SessionStats, error) {
	rows, err := s.pool.Query(ctx, `
SELECT CASE WHEN session_units > 0 THEN 'warm' ELSE 'new' END AS session, count(*),
	count(*) FILTER (WHERE outcome = 'complete'), count(*) FILTER (WHERE category = 'blocked'),
	COALESCE(sum(bytes), 0)::bigint
FROM attempts
WHERE session_id <> ''
GROUP BY 1 ORDER BY 1`)
	if err != nil {
		return nil, fmt.Errorf("store: StatsBySession: %w", err)
	}
	defer rows.Close()
	out := []SessionStats{}
	for rows.Next() {
		var st SessionStats
		if err := rows.Scan(&st.Session, &st.Attempts, &st.Complete, &st.Blocked, &st.Bytes); err != nil {
			return nil, fmt.Errorf("store: StatsBySession: %w", err)
		}
		if st.Attempts > 0 {
			st.BytesPerAttempt = st.Bytes / st.Attempts
			st.BlockRate = float64(st.Blocked) / float64(st.Attempts)
		}
		out = append(out, st)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("store: StatsBySession: %w", err)
	}
	return out, nil
}
