package scheduler_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/scheduler"
	"github.com/idemscrape/idemscrape/store"
	tu "github.com/idemscrape/idemscrape/testutil"
)

// storeVia returns a store whose connections go through a proxy that can refuse them.
func storeVia(t *testing.T, b *bundle) (*store.PG, *tu.TCPProxy) {
	t.Helper()
	pool, proxy := tu.PoolVia(t, b.st.Pool())
	return store.New(pool), proxy
}

func windowRow(t *testing.T, b *bundle, template, window string) store.Window {
	t.Helper()
	ws, err := b.st.WindowsList(context.Background(), store.WindowsListParams{Template: template})
	require.NoError(t, err)
	for _, w := range ws {
		if w.Window == window {
			return w
		}
	}
	t.Fatalf("no schedule_windows row for %s/%s among %d", template, window, len(ws))
	return store.Window{}
}

// TestFailedTickRetried: PostgreSQL refuses the scheduler's connections when a window
// comes due; the tick fails, is tried again with backoff, and once PostgreSQL answers
// again the window's jobs exist, once, and its row says enqueued.
func TestFailedTickRetried(t *testing.T) {
	b := setup(t)
	st, proxy := storeVia(t, b)
	f := b.file(t, `templates:
  - name: daily
    cron: "0 6 * * *"
    window: daily
    kind: catalog
    catchup: none
    sources: {ids: [sku-1, sku-2, sku-3]}
    countries: [US]
    parser_version: 1
`)
	// A clock 300 ms before 06:00 (real time goes on under it), so the loop's first tick
	// comes due at once.
	due := time.Date(2026, 4, 23, 6, 0, 0, 0, time.UTC)
	offset := time.Until(due.Add(-300 * time.Millisecond))
	now := func() time.Time { return time.Now().Add(offset) }
	signal := make(chan scheduler.TickReport)
	s, err := scheduler.New(scheduler.Config{File: f, Client: b.client, Redis: b.ns.Client, Store: st,
		Logger: quietLogger(), Now: now, TestSignal: signal, RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond})
	require.NoError(t, err)

	proxy.Refuse() // PostgreSQL is gone for the scheduler when 06:00 comes
	ctx := context.Background()
	require.NoError(t, s.Start(ctx))
	defer s.Stop()

	recv := func() scheduler.TickReport {
		select {
		case rep := <-signal:
			return rep
		case <-time.After(2 * time.Minute):
			t.Fatalf("no tick report within 2 min%s", loadNote())
			return scheduler.TickReport{}
		}
	}
	for try := 1; try <= 3; try++ {
		rep := recv()
		require.Error(t, rep.Err, "try %d while PostgreSQL refuses connections", try)
		assert.Equal(t, try, rep.Try)
		assert.False(t, rep.GaveUp, "the window's deadline is the next day's tick")
		assert.True(t, due.Equal(rep.At), "%v", rep.At)
	}
	assert.Positive(t, proxy.Refused())
	assert.Empty(t, b.windows(t), "nothing enqueued while PostgreSQL refused")
	proxy.Accept()
	var rep scheduler.TickReport
	for rep = recv(); rep.Err != nil; rep = recv() { // a try may still have been on its way
		require.False(t, rep.GaveUp)
	}
	assert.GreaterOrEqual(t, rep.Try, 4)
	assert.Equal(t, "2026-04-23", rep.Window)
	assert.Equal(t, 3, rep.Outcomes["created"])
	assert.Equal(t, map[string]int{"2026-04-23": 3}, b.windows(t), "the window's jobs exist, once")
	w := windowRow(t, b, "daily", "2026-04-23")
	assert.Equal(t, store.WindowEnqueued, w.State)
	assert.Equal(t, 3, w.Enqueued)
	assert.Equal(t, rep.Try, w.Tries, "every try is counted, those PostgreSQL refused too")
	assert.Empty(t, w.LastError)
	assert.Equal(t, 1.0, schedulerMetric(t, s, "idemscrape_scheduler_tick_retries_total", "ok"))
}

// TestWindowGapsListed: a scheduler down across three hourly windows (catchup: none)
// leaves three gaps, counted at start and listed; a fill of one by two schedulers at
// once creates its jobs exactly once, and the gap is gone.
func TestWindowGapsListed(t *testing.T) {
	b := setup(t)
	f := b.file(t, `templates:
  - name: hourly
    cron: "0 * * * *"
    window: hourly
    kind: catalog
    catchup: none
    sources: {ids: [sku-1, sku-2, sku-3]}
    countries: [US]
    parser_version: 1
`)
	ctx := context.Background()
	day := time.Date(2026, 4, 23, 0, 0, 0, 0, time.UTC)
	clock := tu.NewClock(day.Add(10 * time.Hour))
	s1 := b.scheduler(t, f, clock.Now, nil)
	// The scheduler ran at 10:00 and 11:00, then was down from 11:30 to 15:30.
	for _, h := range []int{10, 11} {
		clock.Set(day.Add(time.Duration(h) * time.Hour))
		require.NoError(t, s1.Tick(ctx, "hourly", clock.Now()).Err)
	}
	clock.Set(day.Add(15*time.Hour + 30*time.Minute))

	gaps, err := s1.Gaps(ctx)
	require.NoError(t, err)
	var wins []string
	for _, g := range gaps {
		wins = append(wins, g.Window)
		assert.Equal(t, "hourly", g.Template)
	}
	require.Len(t, gaps, 3, "12:00, 13:00 and 14:00 (15:00 is still within its retry deadline): %v", wins)
	assert.True(t, day.Add(12*time.Hour).Equal(gaps[0].Due), "%v", gaps[0].Due)
	assert.True(t, day.Add(14*time.Hour).Equal(gaps[2].Due), "%v", gaps[2].Due)

	// A scheduler starting now counts them (catchup: none: it ticks nothing now).
	s2 := b.scheduler(t, f, clock.Now, nil)
	require.NoError(t, s2.Start(ctx))
	s2.Stop()
	assert.Equal(t, 3.0, schedulerMetric(t, s2, "idemscrape_scheduler_window_gaps", "hourly"))

	// Two schedulers fill 13:00 at once: its jobs are created once.
	target := gaps[1].Window
	before := b.windows(t)
	var wg sync.WaitGroup
	reps := make([]scheduler.TickReport, 2)
	errs := make([]error, 2)
	for i, s := range []*scheduler.Scheduler{s1, s2} {
		wg.Add(1)
		go func() { defer wg.Done(); reps[i], errs[i] = s.Fill(ctx, "hourly", target) }()
	}
	wg.Wait()
	require.NoError(t, errs[0])
	require.NoError(t, errs[1])
	assert.Equal(t, 3, reps[0].Outcomes["created"]+reps[1].Outcomes["created"], "each job created once: %v %v", reps[0].Outcomes, reps[1].Outcomes)
	after := b.windows(t)
	assert.Equal(t, 3, after[target]-before[target])
	assert.True(t, day.Add(13*time.Hour).Equal(reps[0].At), "%v", reps[0].At)

	gaps, err = s1.Gaps(ctx)
	require.NoError(t, err)
	assert.Len(t, gaps, 2)
	for _, g := range gaps {
		assert.NotEqual(t, target, g.Window)
	}
	assert.Equal(t, store.WindowEnqueued, windowRow(t, b, "hourly", target).State)

	// A window that was never due is refused, naming the form windows take.
	_, err = s1.Fill(ctx, "hourly", "2030-01-01T00")
	assert.True(t, errors.Is(err, scheduler.ErrNoSuchWindow), "%v", err)
	_, err = s1.Fill(ctx, "nope", target)
	assert.ErrorContains(t, err, `no template "nope"`)
}

// loadNote is ", load L" with the box's 1-minute load average, for a wait that ran out.
func loadNote() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	return fmt.Sprintf(", load %s", strings.Fields(string(b))[0])
}

// schedulerMetric is the value of the scheduler's metric name whose labels include every
// value in labels (gauge or counter).
func schedulerMetric(t *testing.T, s *scheduler.Scheduler, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := s.Gatherer().Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metric:
		for _, m := range mf.GetMetric() {
			have := map[string]bool{}
			for _, l := range m.GetLabel() {
				have[l.GetValue()] = true
			}
			for _, v := range labels {
				if !have[v] {
					continue metric
				}
			}
			if m.GetGauge() != nil {
				return m.GetGauge().GetValue()
			}
			return m.GetCounter().GetValue()
		}
	}
	t.Fatalf("no metric %s%v", name, labels)
	return 0
}
