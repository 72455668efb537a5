package main

import (
	"bytes"
	"context"
	"fmt"
	"regexp"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestStatsRowsOfNeverAnalysedTables: on a database PostgreSQL never analysed (no row
// estimate: reltuples -1), `stats` shows the tables' real row counts, not 0; and the
// retentions read as an operator writes them (90d), not 2160h0m0s.
func TestStatsRowsOfNeverAnalysedTables(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	cliEnv(t, dsnOf(t, pool), testutil.RedisAddr())
	var recs []tasks.JobRecord
	for i := range 3 {
		s := tasks.Spec{Kind: "catalog", SourceID: fmt.Sprintf("sku-%d", i), Country: "US", Window: "2026-04-23", ParserVersion: 1}
		key, err := s.Key()
		require.NoError(t, err)
		recs = append(recs, tasks.JobRecord{Key: key, Spec: s})
	}
	_, err := store.New(pool).JobsRecord(ctx, recs)
	require.NoError(t, err)
	var reltuples float64
	require.NoError(t, pool.QueryRow(ctx, `SELECT reltuples FROM pg_class WHERE oid = 'jobs'::regclass`).Scan(&reltuples))
	require.Negative(t, reltuples, "the test needs a never-analysed jobs table")

	var stderr bytes.Buffer
	stdout, code := runInProcess(nil, &stderr, "stats")
	require.Equal(t, 0, code, stderr.String())
	assert.Regexp(t, regexp.MustCompile(`(?m)^jobs\s+3\s`), stdout)
	assert.Regexp(t, `\(job_retention \d+d\)`, stdout)
	assert.NotContains(t, stdout, "h0m0s")
}
