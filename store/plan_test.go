package store_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestStartPlanByPrimaryKey: the attempt start's plans find the jobs rows by primary key,
// never through the partial state index, even when the statistics undercount the queued
// jobs (here: 3,000 jobs queued since the template was analysed). Through that index a
// start read every queued job's entry. Both plans: the generic one a pooled connection may
// settle on, and the custom one (its first five executions, and every later one while
// PostgreSQL finds custom plans cheaper — with a fresh database's statistics it always did,
// and each start of a 20,000-job run read ~10,000 index entries).
func TestStartPlanByPrimaryKey(t *testing.T) {
	for _, mode := range []string{"force_generic_plan", "force_custom_plan"} {
		t.Run(mode, func(t *testing.T) { testStartPlan(t, mode) })
	}
}

func testStartPlan(t *testing.T, planMode string) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)
	recs := make([]tasks.JobRecord, 20000)
	for i := range recs {
		k := fmt.Sprintf("catalog:plan-%05d", i)
		recs[i] = tasks.JobRecord{Key: k, Spec: tasks.Spec{Kind: "catalog", SourceID: k, Country: "US", Window: "2026-04-23", ParserVersion: 3}}
	}
	for i := 0; i < len(recs); i += 2000 {
		_, err := s.JobsRecord(ctx, recs[i:i+2000])
		require.NoError(t, err)
	}

	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	_, err = conn.Exec(ctx, `SET plan_cache_mode = `+planMode)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, `PREPARE start_plan AS `+store.StartSQL)
	require.NoError(t, err)
	// EXPLAIN EXECUTE takes literals (the keys are plain: no quoting needed). A batch of
	// five, as the group committer sends at c = 20.
	var keys, owners []string
	for i := 10; i < 15; i++ {
		keys, owners = append(keys, recs[i].Key), append(owners, fmt.Sprintf("w/%d", i))
	}
	five := func(v string) string { return strings.TrimSuffix(strings.Repeat(v+",", 5), ",") }
	rows, err := conn.Query(ctx, fmt.Sprintf(`EXPLAIN EXECUTE start_plan('{%s}', '{%s}', '{%s}', '{%s}', '{%s}', '{%s}', '{%s}', '{%s}', '{%s}', '{%s}', '{%s}', '{%s}')`,
		strings.Join(keys, ","), five("0"), five("w"), five(`""`), five("US"), five("gw:1"),
		strings.Join(store.StartableStates, ","), strings.Join(owners, ","),
		five("0"), five(`""`), five("acct"), five("residential")))
	require.NoError(t, err)
	var plan []string
	for rows.Next() {
		var line string
		require.NoError(t, rows.Scan(&line))
		plan = append(plan, line)
	}
	require.NoError(t, rows.Err())
	text := strings.Join(plan, "\n")
	// Every index the start reads on jobs is its primary key (before migration 00021 a
	// custom plan ANDed it with the partial state index; no state index may come back).
	for _, idx := range []string{"jobs_running_key_idx", "jobs_runnable_key_idx", "jobs_runnable_activity_idx",
		"jobs_problem_idx", "jobs_kind_window_idx", "jobs_terminal_updated_idx"} {
		require.NotContains(t, text, idx, "the start reads a state index:\n%s", text)
	}
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

// TestFencedStatementsGeneric: the attempt start and the commit run their generic plans,
// never a custom plan: PostgreSQL chose custom plans for them on every execution (their
// array parameters' lengths make a custom plan look cheaper), planning each statement
// again (~0.5 ms of server CPU each). One connection, so that pg_prepared_statements (a
// session's own) shows every execution.
func TestFencedStatementsGeneric(t *testing.T) {
	ctx := context.Background()
	shared := testutil.PG(t)
	cfg := shared.Config()
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer pool.Close()
	s := store.New(pool)

	const n = 8 // more than the 5 custom plans PostgreSQL makes before it compares
	recs := make([]tasks.JobRecord, n)
	for i := range recs {
		k := fmt.Sprintf("catalog:generic-%d", i)
		recs[i] = tasks.JobRecord{Key: k, Spec: tasks.Spec{Kind: "catalog", SourceID: k, Country: "US", Window: "2026-04-23", ParserVersion: 3}}
	}
	_, err = s.JobsRecord(ctx, recs)
	require.NoError(t, err)
	for i, rec := range recs {
		st, err := s.JobStart(ctx, store.AttemptStartParams{Key: rec.Key, Worker: "w", Owner: fmt.Sprintf("w/%d", i)})
		require.NoError(t, err)
		_, err = s.Commit(ctx, store.CommitParams{Key: rec.Key, Token: st.Fence, ObservationKey: "obs:" + rec.Key, ParserVersion: 3,
			Data: []byte(`{"ok":true}`), EventKey: "ev:" + rec.Key, Topic: "observed", EventPayload: []byte(`{}`)})
		require.NoError(t, err)
	}

	type plans struct{ generic, custom int64 }
	got := map[string]plans{}
	var sql string
	var p plans
	rows, _ := pool.Query(ctx, `SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements
		WHERE statement LIKE '%WITH input AS%' AND statement NOT LIKE '%INSERT INTO jobs%'`)
	_, err = pgx.ForEachRow(rows, []any{&sql, &p.generic, &p.custom}, func() error {
		name := "start"
		if strings.Contains(sql, "INSERT INTO results") {
			name = "commit"
		}
		got[name] = p
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, map[string]plans{"start": {generic: n}, "commit": {generic: n}}, got,
		"custom plans are statements planned anew on each execution")
}
