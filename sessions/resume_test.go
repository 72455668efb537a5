package sessions_test

import (
	"context"
	"strings"
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

// searchPaths counts the search requests the site got: each is one (re)start of the unit.
func searchPaths(s *testutil.FakeSite) int {
	return s.Hits("/search")
}

// TestResumeOnSameExit: after a dropped connection that left the exit alive, the cut step
// runs again on the same session and the unit continues there — the exit proven unchanged
// by the exit header — instead of replaying from its first step on a new session.
func TestResumeOnSameExit(t *testing.T) {
	t.Run("ExitProven", func(t *testing.T) {
		// StrictExit: the shop binds its cookie and price token to the exit, so only a
		// continuation on the very same exit can succeed without a replay.
		e := setup(t, testutil.FakeProxyConfig{Seed: 21}, testutil.FakeSiteConfig{Seed: 21, StrictExit: true})
		var err error
		e.provider, err = e.provider.WithExitHeader("X-Exit")
		require.NoError(t, err)
		unit, err := catalog.Unit(e.site.URL, "sku-3")
		require.NoError(t, err)
		e.proxy.DropNextKeepExit("/product/")

		res, err := unit.Run(context.Background(), e.runCfg())
		require.NoError(t, err)
		assert.Equal(t, int64(1), e.proxy.Disconnects(), "the product page was cut")
		assert.Equal(t, int64(1), e.proxy.CutsExitAlive())
		assert.Len(t, res.Sessions, 1, "no new session")
		assert.Zero(t, res.Restarts)
		assert.Equal(t, []string{sessions.ResumeExitHeader}, res.ResumeReasons)
		assert.Equal(t, 1, searchPaths(e.site), "the search step was not fetched again")
		got := exits(t, res.Staged)
		assert.Equal(t, []string{got[0], got[0], got[0]}, got, "every step from one exit")
		assert.Equal(t, got[0], res.Exit)
		assert.Equal(t, int64(5), e.proxy.RequestsFor(res.Sessions[0]), "robots.txt, search, the cut product page, the product page again, the price")
		assert.Empty(t, e.quarantined, "nothing was given up")
	})

	t.Run("PortableState", func(t *testing.T) {
		// No exit header and a shop that does not bind state to the exit: a unit that
		// declares its state portable continues on its session, even on another exit.
		e := setup(t, testutil.FakeProxyConfig{Seed: 22}, testutil.FakeSiteConfig{Seed: 22})
		unit, err := catalog.Unit(e.site.URL, "sku-5")
		require.NoError(t, err)
		unit.PortableState = true
		e.proxy.DropNextNewExit("/product/")

		res, err := unit.Run(context.Background(), e.runCfg())
		require.NoError(t, err)
		assert.Len(t, res.Sessions, 1)
		assert.Zero(t, res.Restarts)
		assert.Equal(t, []string{sessions.ResumePortable}, res.ResumeReasons)
		assert.Equal(t, 1, searchPaths(e.site))
	})

	t.Run("ThrottledWaitsOnItsSession", func(t *testing.T) {
		// A Retry-After longer than the collector waits out itself (1 ms here): the step
		// runs again on the same, still valid session once it has passed.
		e := setup(t, testutil.FakeProxyConfig{Seed: 23}, testutil.FakeSiteConfig{Seed: 23, StrictExit: true})
		unit, err := catalog.Unit(e.site.URL, "sku-6")
		require.NoError(t, err)
		cfg := e.runCfg()
		cfg.Collector.ThrottleWaitMax = time.Millisecond
		orig := unit.Steps[1].Run
		var once atomic.Bool
		unit.Steps[1].Run = func(ctx context.Context, sc *sessions.StepContext) error {
			if once.CompareAndSwap(false, true) {
				e.site.Throttle(1, time.Second) // the product page answers 429, Retry-After: 1
			}
			return orig(ctx, sc)
		}

		res, err := unit.Run(context.Background(), cfg)
		require.NoError(t, err)
		assert.Len(t, res.Sessions, 1, "no new session")
		assert.Equal(t, []string{sessions.ResumeThrottled}, res.ResumeReasons)
		assert.Equal(t, 1, searchPaths(e.site))
	})

	t.Run("CutUnsafeStepNotSentAgain", func(t *testing.T) {
		// A cut during an unsafe step leaves its effect unknown: it is not run again, on
		// this session or another (unsafe_step_incomplete, as before).
		e := setup(t, testutil.FakeProxyConfig{Seed: 24}, testutil.FakeSiteConfig{Seed: 24, StrictExit: true})
		var err error
		e.provider, err = e.provider.WithExitHeader("X-Exit")
		require.NoError(t, err)
		unit, err := catalog.Unit(e.site.URL, "sku-7")
		require.NoError(t, err)
		unit.Steps[1].Safe = false
		e.proxy.DropNextKeepExit("/product/")

		res, err := unit.Run(context.Background(), e.runCfg())
		require.Error(t, err)
		assert.Equal(t, tasks.CategoryUnsafeStepIncomplete, sessions.CategoryOf(err))
		assert.Zero(t, res.Resumes)
		assert.Len(t, res.Sessions, 1)
		assert.Equal(t, 1, e.site.Hits("/product/sku-7"), "the unsafe step went out once")
	})

	t.Run("CutAfterUnsafeStepResumes", func(t *testing.T) {
		// A cut in a safe step after a completed unsafe one: running the safe step again
		// does not send the unsafe one again, so the unit finishes on its proven exit.
		e := setup(t, testutil.FakeProxyConfig{Seed: 25}, testutil.FakeSiteConfig{Seed: 25, StrictExit: true})
		var err error
		e.provider, err = e.provider.WithExitHeader("X-Exit")
		require.NoError(t, err)
		unit, err := catalog.Unit(e.site.URL, "sku-8")
		require.NoError(t, err)
		unit.Steps[1].Safe = false
		e.proxy.DropNextKeepExit("/api/price/")

		res, err := unit.Run(context.Background(), e.runCfg())
		require.NoError(t, err)
		assert.Equal(t, []string{sessions.ResumeExitHeader}, res.ResumeReasons)
		assert.Equal(t, 1, e.site.Hits("/product/sku-8"), "the unsafe step went out once")
	})
}

// TestReplayOnChangedExit: after a cut the unit tries its session again, but a response
// from another exit (the provider re-assigned the session id silently) or a session whose
// exit was never named ends the session: the unit replays from its first step on a new
// one, and never continues on a changed exit.
func TestReplayOnChangedExit(t *testing.T) {
	t.Run("MovedExit", func(t *testing.T) {
		// The shop is not strict, so nothing but the exit check stands between the unit and
		// an observation made from two exits.
		e := setup(t, testutil.FakeProxyConfig{Seed: 31}, testutil.FakeSiteConfig{Seed: 31})
		var err error
		e.provider, err = e.provider.WithExitHeader("X-Exit")
		require.NoError(t, err)
		unit, err := catalog.Unit(e.site.URL, "sku-2")
		require.NoError(t, err)
		e.proxy.DropNextNewExit("/product/")

		res, err := unit.Run(context.Background(), e.runCfg())
		require.NoError(t, err)
		require.Len(t, res.Sessions, 2, "replayed on a new session")
		first := res.Sessions[0]
		assert.Equal(t, int64(4), e.proxy.RequestsFor(first), "robots.txt, search, the cut product page, the product page tried again on the session")
		assert.Equal(t, 1, res.Restarts)
		assert.Equal(t, []tasks.Category{tasks.CategorySessionLost}, res.RestartReasons)
		assert.Equal(t, []string{sessions.ResumeExitHeader}, res.ResumeReasons, "tried on its session first")
		assert.Equal(t, 2, searchPaths(e.site), "the unit started again from its first step")
		got := exits(t, res.Staged)
		assert.Equal(t, []string{got[0], got[0], got[0]}, got, "every step from one exit")
		assert.Equal(t, e.proxy.ExitOf(res.Sessions[1]), got[0], "the new session's exit")
		require.Len(t, e.quarantined, 1)
		assert.Equal(t, first, e.quarantined[0].SessionID)
		assert.True(t, strings.Contains(e.quarantined[0].Detail, "exit changed"), e.quarantined[0].Detail)
	})

	t.Run("MovedExitAtLastStep", func(t *testing.T) {
		// The last step's response is the only one after the cut: it alone must prove the
		// exit, or the observation would end on another exit than it began.
		e := setup(t, testutil.FakeProxyConfig{Seed: 34}, testutil.FakeSiteConfig{Seed: 34})
		var err error
		e.provider, err = e.provider.WithExitHeader("X-Exit")
		require.NoError(t, err)
		unit, err := catalog.Unit(e.site.URL, "sku-9")
		require.NoError(t, err)
		e.proxy.DropNextNewExit("/api/price/")

		res, err := unit.Run(context.Background(), e.runCfg())
		require.NoError(t, err)
		require.Len(t, res.Sessions, 2, "replayed on a new session")
		assert.Equal(t, []string{sessions.ResumeExitHeader}, res.ResumeReasons, "tried on its session first")
		got := exits(t, res.Staged)
		assert.Equal(t, []string{got[0], got[0], got[0]}, got, "every step from one exit")
	})

	t.Run("NoExitHeaderReplays", func(t *testing.T) {
		// Nothing can prove the exit unchanged: the unit replays as before, even though the
		// exit did survive.
		e := setup(t, testutil.FakeProxyConfig{Seed: 32}, testutil.FakeSiteConfig{Seed: 32, StrictExit: true})
		unit, err := catalog.Unit(e.site.URL, "sku-4")
		require.NoError(t, err)
		e.proxy.DropNextKeepExit("/product/")

		res, err := unit.Run(context.Background(), e.runCfg())
		require.NoError(t, err)
		assert.Len(t, res.Sessions, 2)
		assert.Zero(t, res.Resumes)
		assert.Equal(t, int64(3), e.proxy.RequestsFor(res.Sessions[0]), "robots.txt, search and the cut product page, nothing more")
	})

	t.Run("ResumesOff", func(t *testing.T) {
		// MaxResumes -1: every cut replays, the rule before resumes.
		e := setup(t, testutil.FakeProxyConfig{Seed: 33}, testutil.FakeSiteConfig{Seed: 33, StrictExit: true})
		var err error
		e.provider, err = e.provider.WithExitHeader("X-Exit")
		require.NoError(t, err)
		unit, err := catalog.Unit(e.site.URL, "sku-4")
		require.NoError(t, err)
		e.proxy.DropNextKeepExit("/product/")
		cfg := e.runCfg()
		cfg.MaxResumes = -1

		res, err := unit.Run(context.Background(), cfg)
		require.NoError(t, err)
		assert.Len(t, res.Sessions, 2)
		assert.Zero(t, res.Resumes)
	})
}
