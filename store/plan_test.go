package store_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestStartPlanByPrimaryKey: the attempt start's generic plan (the one a pooled connection
// runs after its first executions) finds the jobs rows by primary key, never through the
// partial state index, even when the statistics undercount the queued jobs (here: 3,000
// jobs queued since the template was analysed). Through that index a start read every
// queued job's entry.
func TestStartPlanByPrimaryKey(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)
	recs := make([]tasks.JobRecord, 3000)
	for i := range recs {
		k := fmt.Sprintf("catalog:plan-%05d", i)
		recs[i] = tasks.JobRecord{Key: k, Spec: tasks.Spec{Kind: "catalog", SourceID: k, Country: "US", Window: "2026-04-23", ParserVersion: 3}}
	}
	_, err := s.JobsRecord(ctx, recs)
	require.NoError(t, err)

	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	_, err = conn.Exec(ctx, `SET plan_cache_mode = force_generic_plan`)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, `PREPARE start_plan AS `+store.StartSQL)
	require.NoError(t, err)
	// EXPLAIN EXECUTE takes literals (the keys are plain: no quoting needed).
	rows, err := conn.Query(ctx, fmt.Sprintf(`EXPLAIN EXECUTE start_plan('{%s}', '{0}', '{w}', '{""}', '{US}', '{gw:1}', '{%s}', '{w/1}')`,
		recs[10].Key, strings.Join(store.StartableStates, ",")))
	require.NoError(t, err)
	var plan []string
	for rows.Next() {
		var line string
		require.NoError(t, rows.Scan(&line))
		plan = append(plan, line)
	}
	require.NoError(t, rows.Err())
	text := strings.Join(plan, "\n")
	require.NotContains(t, text, "jobs_state_idx", "the start reads the state index:\n%s", text)
	require.Contains(t, text, "jobs_pkey", text)
}

// TestFencedSQLMarkersInFirstKB: pg_stat_activity shows a statement's first 1 KB
// (track_activity_query_size's default), and tests and operators find the fenced commit by
// its INSERT INTO results there: a longer input list must not push it past.
func TestFencedSQLMarkersInFirstKB(t *testing.T) {
	for _, byLock := range store.CommitSQLs {
		for _, sql := range byLock {
			i := strings.Index(sql, "INSERT INTO results")
			require.GreaterOrEqual(t, i, 0)
			require.Less(t, i+len("INSERT INTO results"), 1024, "the marker ends past the first 1 KB")
		}
	}
}
