package main

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/testutil"
)

// TestCheckFailsOnUnreadCount: a count the checker could not read fails the row it feeds
// (left at zero it would have passed "0 duplicate results"), and a count of the fault
// table, which has no invariant row, fails the run on a row of its own.
func TestCheckFailsOnUnreadCount(t *testing.T) {
	ctx := context.Background()
	k := &checker{h: &harness{pool: testutil.PG(t)}, rep: &Report{}}

	var ok, results, quarantined int
	k.scan(ctx, `SELECT 1`, nil, []any{&ok}, InvLost)
	k.scan(ctx, `SELECT count(*) FROM no_such_results`, nil, []any{&results}, InvDupResults)
	k.scan(ctx, `SELECT count(*) FROM no_such_quarantine`, nil, []any{&quarantined}, rowFaultCounts)
	k.add(Row{Name: InvLost, Observed: "0 lost", Result: resultPass})
	k.add(Row{Name: InvDupResults, Observed: "0 results", Result: resultPass})
	k.checkQueriesRead()

	require.Equal(t, 1, ok)
	require.Equal(t, []string{InvDupResults, rowFaultCounts}, k.rep.Failed())
	require.Contains(t, k.rep.Invariants[1].Observed, "no_such_results")
	require.Contains(t, k.rep.Invariants[2].Observed, "no_such_quarantine")
}
