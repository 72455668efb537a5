package store_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/testutil"
)

func TestWindows(t *testing.T) {
	ctx := context.Background()
	setup := func(t *testing.T) *store.PG { return store.New(testutil.PG(t)) }
	due := time.Date(2026, 4, 23, 6, 0, 0, 0, time.UTC)
	row := func(t *testing.T, s *store.PG, w string) store.Window {
		t.Helper()
		ws, err := s.WindowsList(ctx, store.WindowsListParams{Template: "daily"})
		require.NoError(t, err)
		for _, x := range ws {
			if x.Window == w {
				return x
			}
		}
		t.Fatalf("no row for %s", w)
		return store.Window{}
	}
	p := store.WindowParams{Template: "daily", Window: "2026-04-23", Kind: "catalog", Due: due}

	t.Run("FailedThenEnqueued", func(t *testing.T) {
		s := setup(t)
		require.NoError(t, s.WindowBegin(ctx, p))
		assert.Equal(t, store.WindowRunning, row(t, s, p.Window).State)
		require.NoError(t, s.WindowFailed(ctx, "daily", p.Window, errors.New("connection refused")))
		w := row(t, s, p.Window)
		assert.Equal(t, store.WindowFailed, w.State)
		assert.Equal(t, "connection refused", w.LastError)
		assert.Nil(t, w.EnqueuedAt)

		require.NoError(t, s.WindowBegin(ctx, p))
		require.NoError(t, s.WindowEnqueued(ctx, "daily", p.Window, 3, 3))
		w = row(t, s, p.Window)
		assert.Equal(t, store.WindowEnqueued, w.State)
		assert.Equal(t, 2, w.Tries)
		assert.Equal(t, 3, w.Enqueued)
		assert.Empty(t, w.LastError)
		assert.NotNil(t, w.EnqueuedAt)
		assert.True(t, due.Equal(w.Due))
	})
	t.Run("EnqueuedStaysEnqueued", func(t *testing.T) {
		// A second scheduler's tick, or a fill, of an enqueued window that then fails
		// leaves the window enqueued: its jobs exist.
		s := setup(t)
		require.NoError(t, s.WindowBegin(ctx, p))
		require.NoError(t, s.WindowEnqueued(ctx, "daily", p.Window, 3, 3))
		require.NoError(t, s.WindowBegin(ctx, p))
		assert.Equal(t, store.WindowEnqueued, row(t, s, p.Window).State)
		require.NoError(t, s.WindowFailed(ctx, "daily", p.Window, errors.New("boom")))
		assert.Equal(t, store.WindowEnqueued, row(t, s, p.Window).State)
		done, err := s.WindowsEnqueued(ctx, "daily", []string{p.Window, "2026-04-24"})
		require.NoError(t, err)
		assert.Equal(t, map[string]bool{p.Window: true}, done)
		first, err := s.WindowsFirstDue(ctx)
		require.NoError(t, err)
		assert.True(t, due.Equal(first["daily"]))
	})
	t.Run("ExpiredRefusedUnlessForced", func(t *testing.T) {
		s := setup(t)
		old := p
		old.JobHorizon = 48 * time.Hour
		require.NoError(t, s.WindowBegin(ctx, old), "a new window within the horizon")
		_, err := s.Pool().Exec(ctx, `UPDATE schedule_windows SET started_at = now() - interval '72 hours'`)
		require.NoError(t, err)
		err = s.WindowBegin(ctx, old)
		assert.ErrorIs(t, err, store.ErrWindowExpired)
		assert.ErrorContains(t, err, "first ticked at")
		assert.Equal(t, 1, row(t, s, p.Window).Tries, "a refused tick writes nothing")
		noHorizon := p
		require.NoError(t, s.WindowBegin(ctx, noHorizon), "no horizon: no check")
		old.Force = true
		require.NoError(t, s.WindowBegin(ctx, old))
		assert.Equal(t, 3, row(t, s, p.Window).Tries)

		// Without a row, NoNewRow refuses (and writes nothing) unless forced; with one, the
		// horizon decides.
		other := store.WindowParams{Template: "daily", Window: "2025-01-01", Kind: "catalog", Due: due.AddDate(-1, 0, 0), NoNewRow: true}
		err = s.WindowBegin(ctx, other)
		assert.ErrorIs(t, err, store.ErrWindowExpired)
		assert.ErrorContains(t, err, "no record")
		ws, err := s.WindowsList(ctx, store.WindowsListParams{Template: "daily"})
		require.NoError(t, err)
		assert.Len(t, ws, 1)
		other.Force = true
		require.NoError(t, s.WindowBegin(ctx, other))
		other.Force = false
		require.NoError(t, s.WindowBegin(ctx, other), "recorded now: a recent first tick")
	})
	t.Run("TriesLost", func(t *testing.T) {
		s := setup(t)
		// Three tries PostgreSQL could not record: a failed row with them and the error.
		require.NoError(t, s.WindowTriesLost(ctx, p, 3, "dial tcp: connection refused"))
		w := row(t, s, p.Window)
		assert.Equal(t, 3, w.Tries)
		assert.Equal(t, store.WindowFailed, w.State)
		assert.Equal(t, "dial tcp: connection refused", w.LastError)
		// The next try is counted on top, and succeeds.
		require.NoError(t, s.WindowBegin(ctx, p))
		require.NoError(t, s.WindowEnqueued(ctx, "daily", p.Window, 1, 1))
		// A lost error of an enqueued window leaves it enqueued, without the error.
		require.NoError(t, s.WindowTriesLost(ctx, p, 1, "late"))
		w = row(t, s, p.Window)
		assert.Equal(t, 5, w.Tries)
		assert.Equal(t, store.WindowEnqueued, w.State)
		assert.Empty(t, w.LastError)
		assert.ErrorContains(t, s.WindowTriesLost(ctx, p, -1, "x"), "tries")
		assert.ErrorContains(t, s.WindowTriesLost(ctx, store.WindowParams{Template: "daily", Kind: "catalog", Due: due}, 1, "x"), "window")
	})
	t.Run("Refused", func(t *testing.T) {
		s := setup(t)
		assert.ErrorContains(t, s.WindowBegin(ctx, store.WindowParams{Template: "daily", Kind: "catalog", Due: due}), "window")
		assert.ErrorIs(t, s.WindowEnqueued(ctx, "daily", "never", 1, 1), store.ErrWindowNotFound)
	})
}
