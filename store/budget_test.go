package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestAttemptStartBudget: the attempt start reports the job's current retry budget — the
// attempt number, bytes and start time counted from the last operator requeue — beside the
// whole history, in both the single and the grouped start.
func TestAttemptStartBudget(t *testing.T) {
	ctx := context.Background()
	s := store.New(testutil.PG(t))
	g := s.NewGroupCommitter(0, 0)
	defer g.Close()
	for name, starter := range map[string]interface {
		JobStart(context.Context, store.AttemptStartParams) (store.StartedAttempt, error)
	}{"Single": s, "Group": g} {
		t.Run(name, func(t *testing.T) {
			key := "budget-" + name
			record(t, s, key)
			a, err := starter.JobStart(ctx, store.AttemptStartParams{Key: key, Token: 1})
			require.NoError(t, err)
			require.Equal(t, 1, a.BudgetAttemptNo, "no requeue yet: the budget is the whole history")
			require.Equal(t, a.JobCreatedAt, a.BudgetSince)
			require.NoError(t, s.JobMarkRetryable(ctx, store.AttemptFinishParams{Key: key, Token: 1, Bytes: 700, NextAttemptAt: time.Now()}))

			// An operator's requeue after that attempt: the budget starts at its end.
			since := time.Now().Add(-time.Minute).UTC().Truncate(time.Microsecond)
			_, err = s.Pool().Exec(ctx, `UPDATE jobs SET budget_attempts = attempts, budget_bytes = bytes_total, budget_since = $2 WHERE key = $1`, key, since)
			require.NoError(t, err)
			a, err = starter.JobStart(ctx, store.AttemptStartParams{Key: key, Token: 2})
			require.NoError(t, err)
			require.Equal(t, 2, a.AttemptNo)
			require.Equal(t, int64(700), a.BytesTotal)
			require.Equal(t, 1, a.BudgetAttemptNo)
			require.Zero(t, a.BudgetBytes)
			require.True(t, since.Equal(a.BudgetSince), "%v vs %v", since, a.BudgetSince)
		})
	}
}
