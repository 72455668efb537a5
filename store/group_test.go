package store_test

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestGroupCommit: concurrent commits batched into shared statements give every caller the
// result a lone Commit would have: a stale job is refused alone, a bad row fails alone, and
// the others commit.
func TestGroupCommit(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)
	g := s.NewGroupCommitter(0, 0)
	defer g.Close()

	const n = 40
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("g%d", i)
		record(t, s, keys[i])
	}
	// Starts through the batcher too.
	var wg sync.WaitGroup
	startErrs := make([]error, n)
	for i := range keys {
		wg.Add(1)
		go func() {
			defer wg.Done()
			a, err := g.JobStart(ctx, store.AttemptStartParams{Key: keys[i], Token: 10, Worker: "w"})
			if err == nil && a.AttemptNo != 1 {
				err = fmt.Errorf("attempt %d", a.AttemptNo)
			}
			startErrs[i] = err
		}()
	}
	wg.Wait()
	for _, err := range startErrs {
		require.NoError(t, err)
	}
	// A refused start in a batch is typed like a lone one.
	_, err := g.JobStart(ctx, store.AttemptStartParams{Key: keys[0], Token: 5})
	require.ErrorIs(t, err, store.ErrStaleFence)
	_, err = g.JobStart(ctx, store.AttemptStartParams{Key: "nope", Token: 5})
	require.ErrorIs(t, err, store.ErrJobNotFound)

	// Job 1 was taken over (its commit with token 10 is stale); job 2's row is bad.
	_, err = s.JobStart(ctx, store.AttemptStartParams{Key: keys[1], Token: 11})
	require.NoError(t, err)
	results := make([]error, n)
	inserted := make([]store.CommitResult, n)
	for i := range keys {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p := commitParams(keys[i], 10)
			if i == 2 {
				p.ProxyEndpoint = "u:secret@gw:1"
			}
			if i == 3 {
				p.ObservationKey = keys[4] // duplicate observation: rejected, job still completes
			}
			inserted[i], results[i] = g.Commit(ctx, p)
		}()
	}
	wg.Wait()
	for i, err := range results {
		switch i {
		case 1:
			require.ErrorIs(t, err, store.ErrStaleFence)
		case 2:
			require.Error(t, err)
			require.NotContains(t, err.Error(), "secret")
		default:
			require.NoError(t, err, "job %d", i)
		}
	}
	require.Equal(t, n-2, testutil.Count(t, pool, `SELECT count(*) FROM jobs WHERE state = 'complete'`))
	require.Equal(t, n-3, testutil.Count(t, pool, `SELECT count(*) FROM results`))
	require.Equal(t, n-2, testutil.Count(t, pool, `SELECT count(*) FROM outbox`))
	require.Equal(t, 1, func() int {
		c := 0
		for i := range inserted {
			if results[i] == nil && !inserted[i].ResultInserted {
				c++
			}
		}
		return c
	}(), "exactly one duplicate observation reported")
	job, err := s.JobGet(ctx, keys[1])
	require.NoError(t, err)
	require.Equal(t, tasks.StateRunning, job.State, "the stale commit changed nothing")

	// Two commits of one job in one window: the second runs alone and is refused.
	record(t, s, "dup")
	_, err = s.JobStart(ctx, store.AttemptStartParams{Key: "dup", Token: 1})
	require.NoError(t, err)
	var e1, e2 error
	wg.Add(2)
	go func() { defer wg.Done(); _, e1 = g.Commit(ctx, commitParams("dup", 1)) }()
	go func() { defer wg.Done(); _, e2 = g.Commit(ctx, commitParams("dup", 1)) }()
	wg.Wait()
	require.True(t, (e1 == nil) != (e2 == nil), "one commit wins: %v / %v", e1, e2)

	g.Close()
	_, err = g.Commit(ctx, commitParams("g0", 10))
	require.ErrorIs(t, err, store.ErrGroupCommitterClosed)
}
