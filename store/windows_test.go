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
	t.Run("Refused", func(t *testing.T) {
		s := setup(t)
		assert.ErrorContains(t, s.WindowBegin(ctx, store.WindowParams{Template: "daily", Kind: "catalog", Due: due}), "window")
		assert.ErrorIs(t, s.WindowEnqueued(ctx, "daily", "never", 1, 1), store.ErrWindowNotFound)
	})
}
