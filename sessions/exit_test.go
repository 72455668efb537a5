package sessions_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestExitIntegrity: a session whose responses come from another exit than its first one
// ends as session_lost. Exit integrity is sessions' own check, not politeness (robots.txt
// and host limits are tested in package politeness).
func TestExitIntegrity(t *testing.T) {
	// The provider silently re-assigns the session's exit after step 1 of the first run
	// (the fake proxy's lifetime passes on its stub clock); the fake site is not strict, so
	// nothing else would notice.
	run := func(t *testing.T, exitHeader string) (sessions.Result, *env) {
		clock := testutil.NewClock(time.Date(2026, 4, 23, 15, 0, 0, 0, time.UTC))
		e := setup(t, testutil.FakeProxyConfig{Seed: 11, SessionLifetime: time.Minute, Now: clock.Now}, testutil.FakeSiteConfig{Seed: 11})
		if exitHeader != "" {
			var err error
			e.provider, err = e.provider.WithExitHeader(exitHeader)
			require.NoError(t, err)
		}
		unit, err := catalog.Unit(e.site.URL, "sku-4")
		require.NoError(t, err)
		orig := unit.Steps[0].Run
		var moved atomic.Bool
		unit.Steps[0].Run = func(ctx context.Context, sc *sessions.StepContext) error {
			err := orig(ctx, sc)
			if moved.CompareAndSwap(false, true) {
				clock.Advance(2 * time.Minute)
			}
			return err
		}
		res, err := unit.Run(context.Background(), e.runCfg())
		require.NoError(t, err)
		return res, e
	}

	t.Run("ChangedExitIsSessionLoss", func(t *testing.T) {
		res, e := run(t, "x-exit")
		require.Equal(t, 1, res.Restarts)
		require.Equal(t, []tasks.Category{tasks.CategorySessionLost}, res.RestartReasons)
		got := exits(t, res.Staged)
		assert.Equal(t, []string{got[0], got[0], got[0]}, got, "every step from one exit")
		assert.Equal(t, got[0], res.Exit)
		assert.True(t, res.ExitVerified)
		assert.Equal(t, "exit "+got[0]+" (verified)", res.ExitEvidence())
		require.Len(t, e.quarantined, 1)
		assert.Equal(t, tasks.CategorySessionLost, e.quarantined[0].Reason)
		assert.Contains(t, e.quarantined[0].Detail, "exit changed")
	})
	t.Run("WithoutExitHeaderNotVerified", func(t *testing.T) {
		res, _ := run(t, "")
		assert.Zero(t, res.Restarts, "nothing noticed the change")
		got := exits(t, res.Staged)
		assert.NotEqual(t, got[0], got[2], "the halves came from two exits")
		assert.False(t, res.ExitVerified)
		assert.Equal(t, "exit not verified (provider has no exit header)", res.ExitEvidence())
	})
	t.Run("BadHeaderName", func(t *testing.T) {
		e := setup(t, testutil.FakeProxyConfig{}, testutil.FakeSiteConfig{})
		_, err := e.provider.WithExitHeader("bad name:")
		require.ErrorContains(t, err, "exit header")
		p, err := e.provider.WithExitHeader("x-exit")
		require.NoError(t, err)
		assert.Equal(t, "X-Exit", p.ExitHeader())
		p2, err := p.WithGateway("127.0.0.1:1")
		require.NoError(t, err)
		assert.Equal(t, "X-Exit", p2.ExitHeader(), "WithGateway keeps it")
	})
}
