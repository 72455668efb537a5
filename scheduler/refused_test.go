package scheduler_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/scheduler"
	"github.com/idemscrape/idemscrape/store"
)

// levelLog is a slog.Handler that keeps the messages of each level.
type levelLog struct {
	mu   *sync.Mutex
	msgs map[slog.Level][]string
}

func newLevelLog() *levelLog { return &levelLog{mu: &sync.Mutex{}, msgs: map[slog.Level][]string{}} }

func (h *levelLog) Enabled(context.Context, slog.Level) bool { return true }
func (h *levelLog) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.msgs[r.Level] = append(h.msgs[r.Level], r.Message)
	return nil
}
func (h *levelLog) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *levelLog) WithGroup(string) slog.Handler      { return h }

func (h *levelLog) count(level slog.Level, substr string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, m := range h.msgs[level] {
		if strings.Contains(m, substr) {
			n++
		}
	}
	return n
}

// TestRefusedWindowWarnsOnce: a window first ticked longer ago than the job retention is
// refused at every fire of the loop (here every second, a daily window). That is one WARN
// for the window, no ERROR, and every refused tick is counted as
// ticks_total{result="refused_retention"}, none as an error.
func TestRefusedWindowWarnsOnce(t *testing.T) {
	ctx := context.Background()
	b := setup(t)
	f := b.file(t, "templates:\n  - {name: t, cron: \"* * * * * *\", window: daily, kind: catalog, sources: {ids: [sku-1]}, countries: [US], parser_version: 1}\n")
	// The window of today, first ticked longer ago than the job retention.
	first := b.scheduler(t, f, time.Now, nil)
	rep := first.Tick(ctx, "t", time.Now().Truncate(time.Second))
	require.NoError(t, rep.Err)
	win := rep.Window
	_, err := b.st.Pool().Exec(ctx, `UPDATE schedule_windows SET started_at = now() - $1::interval`,
		fmt.Sprintf("%d seconds", int((f.Reconciler.JobRetention+24*time.Hour).Seconds())))
	require.NoError(t, err)

	logs := newLevelLog()
	signal := make(chan scheduler.TickReport)
	s, err := scheduler.New(scheduler.Config{File: f, Client: b.client, Redis: b.ns.Client, Store: b.st,
		Logger: slog.New(logs), TestSignal: signal})
	require.NoError(t, err)
	require.NoError(t, s.Start(ctx))
	t.Cleanup(s.Stop)
	const refusals = 4
	for seen := 0; seen < refusals; {
		select {
		case rep := <-signal:
			if rep.Window == win { // (a tick past midnight is another window's)
				require.True(t, errors.Is(rep.Err, store.ErrWindowExpired), "%v", rep.Err)
				seen++
			}
		case <-time.After(time.Minute): // a guard against a hang, not a timing assert
			t.Fatal("no tick")
		}
	}
	s.Stop()
	assert.Equal(t, 1, logs.count(slog.LevelWarn, "window not ticked"), "one warning for the window: %v", logs.msgs)
	assert.Zero(t, logs.count(slog.LevelError, ""), "no error: %v", logs.msgs[slog.LevelError])
	mfs, err := s.Gatherer().Gather()
	require.NoError(t, err)
	var refused, failed float64
	for _, mf := range mfs {
		if mf.GetName() != "idemscrape_scheduler_ticks_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "result" && l.GetValue() == "refused_retention" {
					refused += m.GetCounter().GetValue()
				}
				if l.GetName() == "result" && l.GetValue() == "error" {
					failed += m.GetCounter().GetValue()
				}
			}
		}
	}
	assert.GreaterOrEqual(t, refused, float64(refusals))
	assert.Zero(t, failed)
}

// TestRefusedWindowsBounded: the scheduler remembers at most MaxRefusedWindows refused
// windows; the oldest is forgotten first.
func TestRefusedWindowsBounded(t *testing.T) {
	b := setup(t)
	s := b.scheduler(t, b.file(t, ""), time.Now, nil)
	assert.True(t, scheduler.RefusedFirst(s, "t", "w0"))
	assert.False(t, scheduler.RefusedFirst(s, "t", "w0"))
	for i := 1; i <= scheduler.MaxRefusedWindows; i++ {
		require.True(t, scheduler.RefusedFirst(s, "t", fmt.Sprintf("w%d", i)))
	}
	assert.True(t, scheduler.RefusedFirst(s, "t", "w0"), "the oldest was forgotten")
	assert.False(t, scheduler.RefusedFirst(s, "t", fmt.Sprintf("w%d", scheduler.MaxRefusedWindows)))
}
