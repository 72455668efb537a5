package sessions_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// moreBytes is a RunConfig.MoreBytes that raises the cap by step, up to raises times,
// then stops with note; it records what it was asked and checks that calls never overlap.
type moreBytes struct {
	step   int64
	raises int
	note   string

	inCall atomic.Int32
	mu     sync.Mutex
	asked  []int64 // moved, per call
	caps   []int64 // what each call returned
}

func (m *moreBytes) fn(t *testing.T) func(context.Context, int64) (int64, string) {
	return func(_ context.Context, moved int64) (int64, string) {
		if m.inCall.Add(1) != 1 {
			t.Error("MoreBytes called while another call runs")
		}
		defer m.inCall.Add(-1)
		m.mu.Lock()
		defer m.mu.Unlock()
		m.asked = append(m.asked, moved)
		if len(m.asked) > m.raises {
			m.caps = append(m.caps, 0)
			return 0, m.note
		}
		m.caps = append(m.caps, moved+m.step)
		return moved + m.step, ""
	}
}

// TestMoreBytesRaisesTheCap: a run whose cap (MaxBytes) is a fraction of what it moves
// asks MoreBytes, at the wire, each time it passes the cap: raised, the read goes on and
// the run completes; told to stop, it fails budget_exceeded at the cap it last got, with
// the note MoreBytes gave, and is not asked again. The cap is one value for the run: a
// replayed unit's new session goes on under the raised cap, without asking again. (On
// the old code a run's cap was fixed when each session started: nothing could raise it.)
func TestMoreBytesRaisesTheCap(t *testing.T) {
	const (
		bigSize = 1 << 20
		first   = 128 << 10
		step    = 256 << 10
	)
	e := setup(t, testutil.FakeProxyConfig{Seed: 41}, testutil.FakeSiteConfig{Seed: 41, BigSize: bigSize})
	u := oneStep(func(_ context.Context, sc *sessions.StepContext) error {
		_, err := sc.Get(e.site.URL + "/big")
		return err
	})

	t.Run("Raised", func(t *testing.T) {
		m := &moreBytes{step: step, raises: 100}
		cfg := e.runCfg()
		cfg.MaxBytes, cfg.MoreBytes = first, m.fn(t)
		cfg.Collector.MaxBodyBytes = 2 * bigSize
		res, err := u.Run(context.Background(), cfg)
		require.NoError(t, err)
		assert.Greater(t, res.Bytes, int64(bigSize))
		require.NotEmpty(t, m.asked)
		// Asked each time the run passed its cap, by at most the one byte a read may go past it.
		assert.Equal(t, int64(first+1), m.asked[0], "asked at the first cap")
		for i := 1; i < len(m.asked); i++ {
			assert.Equal(t, m.caps[i-1]+1, m.asked[i], "asked at the raised cap, call %d", i)
		}
		assert.LessOrEqual(t, res.Bytes, m.caps[len(m.caps)-1])
		assert.GreaterOrEqual(t, len(m.asked), int((bigSize-first)/step))
		t.Logf("%d bytes moved under a cap of %d raised %d times by %d", res.Bytes, first, len(m.asked), step)
	})

	t.Run("Stopped", func(t *testing.T) {
		m := &moreBytes{step: step, raises: 2, note: "the window is spent"}
		cfg := e.runCfg()
		cfg.MaxBytes, cfg.MoreBytes, cfg.BudgetNote = first, m.fn(t), "the job's money"
		cfg.Collector.MaxBodyBytes = 2 * bigSize
		res, err := u.Run(context.Background(), cfg)
		require.Error(t, err)
		assert.Equal(t, tasks.CategoryBudgetExceeded, sessions.CategoryOf(err), "got %v", err)
		assert.ErrorIs(t, err, sessions.ErrBudgetExceeded)
		assert.Contains(t, err.Error(), "(the window is spent)", "the note MoreBytes gave")
		require.Len(t, m.asked, 3, "raised twice, then told to stop; never asked again")
		last := m.caps[1]
		assert.Greater(t, res.Bytes, last)
		assert.LessOrEqual(t, res.Bytes, last+1, "stopped at the last cap")
		assert.Zero(t, res.Restarts)
	})

	t.Run("OneCapForTheRun", func(t *testing.T) {
		probe, err := oneStep(func(_ context.Context, sc *sessions.StepContext) error {
			_, err := sc.Get(e.site.URL + "/")
			return err
		}).Run(context.Background(), e.runCfg())
		require.NoError(t, err)
		one := probe.Bytes
		firstSession := true
		replayOnce := oneStep(func(_ context.Context, sc *sessions.StepContext) error {
			if _, err := sc.Get(e.site.URL + "/"); err != nil {
				return err
			}
			if firstSession {
				firstSession = false
				return &sessions.FetchError{Category: tasks.CategorySessionLost, Err: errors.New("device gone")}
			}
			return nil
		})
		// The first session passes half of one session's bytes and gets three sessions'
		// worth: the second session needs no more.
		m := &moreBytes{step: 3 * one, raises: 1}
		cfg := e.runCfg()
		cfg.MaxBytes, cfg.MoreBytes = one/2, m.fn(t)
		res, err := replayOnce.Run(context.Background(), cfg)
		require.NoError(t, err)
		assert.Equal(t, 1, res.Restarts)
		assert.Len(t, m.asked, 1, "the raise holds for the run's next session")
	})
}

// TestMoreBytesRaisesRenderCap: a render under a cap below its picture asks MoreBytes on
// its forwarder's connections, as a fetch does, and completes once raised; refused more,
// it stops budget_exceeded, without replay.
func TestMoreBytesRaisesRenderCap(t *testing.T) {
	e := setup(t, testutil.FakeProxyConfig{Seed: 42}, testutil.FakeSiteConfig{Seed: 42})
	pool := newPool(t, sessions.BrowserConfig{MaxBrowsers: 1, LoadResources: []string{"Image"}})
	cfg := e.runCfg()
	cfg.Collector.Browsers = pool
	cfg.Collector.IgnoreRobotsTxt = true
	cfg.MaxBytes = 32 << 10 // below the picture
	m := &moreBytes{step: 32 << 10, raises: 1000}
	cfg.MoreBytes = m.fn(t)
	unit := renderUnit(e.site.URL, "sku-5", sessions.RenderOptions{WaitFor: "#price.ready"}, nil)
	res, err := unit.Run(context.Background(), cfg)
	require.NoError(t, err)
	assert.Greater(t, res.Bytes, int64(len(testutil.FakeSiteImage())), "the picture was loaded")
	assert.NotEmpty(t, m.asked, "the render's bytes asked for more")
	assert.Zero(t, res.Restarts)
	t.Logf("render moved %d bytes; cap raised %d times", res.Bytes, len(m.asked))

	stop := &moreBytes{step: 1, raises: 0, note: "no more"}
	cfg.MoreBytes = stop.fn(t)
	unit = renderUnit(e.site.URL, "sku-5", sessions.RenderOptions{WaitFor: "#price.ready"}, nil)
	res, err = unit.Run(context.Background(), cfg)
	assert.Equal(t, tasks.CategoryBudgetExceeded, sessions.CategoryOf(err), "%v", err)
	assert.Zero(t, res.Restarts, "not replayed")
	assert.Len(t, stop.asked, 1)
}
