package scheduler_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/scheduler"
	"github.com/idemscrape/idemscrape/store"
	tu "github.com/idemscrape/idemscrape/testutil"
)

// recvTick reads the next tick report, failing the test when none comes within 2 min.
func recvTick(t *testing.T, signal <-chan scheduler.TickReport) scheduler.TickReport {
	t.Helper()
	select {
	case rep := <-signal:
		return rep
	case <-time.After(2 * time.Minute):
		t.Fatalf("no tick report within 2 min%s", loadNote())
		return scheduler.TickReport{}
	}
}

// TestGiveUpAtDeadlineTriesKept: PostgreSQL refuses the scheduler's connections; a window
// whose backoff (10 s) is longer than its retry_until (2 s) is tried again at its deadline
// and given up only then, not at the first failure; its tries and last error, which
// PostgreSQL could not take then, are kept in memory and written by the next tick once it
// answers again.
func TestGiveUpAtDeadlineTriesKept(t *testing.T) {
	b := setup(t)
	st, proxy := storeVia(t, b)
	f := b.file(t, `templates:
  - name: a
    cron: "0 6 * * *"
    window: daily
    kind: catalog
    catchup: none
    retry_until: 2s
    sources: {ids: [sku-1]}
    countries: [US]
    parser_version: 1
  - name: b
    cron: "0 5 * * *"
    window: daily
    kind: catalog
    catchup: none
    sources: {ids: [sku-2]}
    countries: [US]
    parser_version: 1
`)
	due := time.Date(2026, 4, 23, 6, 0, 0, 0, time.UTC)
	offset := time.Until(due.Add(-300 * time.Millisecond))
	now := func() time.Time { return time.Now().Add(offset) }
	signal := make(chan scheduler.TickReport)
	s, err := scheduler.New(scheduler.Config{File: f, Client: b.client, Redis: b.ns.Client, Store: st,
		Logger: quietLogger(), Now: now, TestSignal: signal, RetryMin: 10 * time.Second, RetryMax: 10 * time.Second})
	require.NoError(t, err)
	proxy.Refuse()
	ctx := context.Background()
	require.NoError(t, s.Start(ctx))
	defer s.Stop()

	rep := recvTick(t, signal)
	require.Error(t, rep.Err)
	assert.Equal(t, 1, rep.Try)
	assert.False(t, rep.GaveUp, "given up at %v, before its deadline %v", now(), due.Add(2*time.Second))
	rep = recvTick(t, signal)
	require.Error(t, rep.Err)
	assert.Equal(t, 2, rep.Try, "tried again at its deadline")
	assert.True(t, rep.GaveUp)
	assert.False(t, now().Before(due.Add(2*time.Second)), "given up at %v, its deadline is %v", now(), due.Add(2*time.Second))
	assert.Empty(t, b.windows(t))

	proxy.Accept()
	require.NoError(t, s.Tick(ctx, "b", due.Add(-time.Hour)).Err)
	w := windowRow(t, b, "a", "2026-04-23")
	assert.Equal(t, 2, w.Tries, "both tries recorded once PostgreSQL answered")
	assert.Equal(t, store.WindowFailed, w.State)
	assert.NotEmpty(t, w.LastError)
	assert.True(t, due.Equal(w.Due), "%v", w.Due)
	gaps, err := s.Gaps(ctx)
	require.NoError(t, err)
	require.Len(t, gaps, 1)
	assert.Equal(t, "2026-04-23", gaps[0].Window)
}

// TestLongRetryDoesNotSkipWindows: a template firing every second with retry_until 1h
// while PostgreSQL refuses the scheduler: the next seconds' windows are ticked at their
// time while the earlier ones are tried again, and once PostgreSQL answers every window
// from the first on has its job (none skipped, none given up).
func TestLongRetryDoesNotSkipWindows(t *testing.T) {
	b := setup(t)
	st, proxy := storeVia(t, b)
	f := b.file(t, `templates:
  - name: s
    cron: "* * * * * *"
    window: secondly
    kind: catalog
    catchup: none
    retry_until: 1h
    sources: {ids: [sku-1]}
    countries: [US]
    parser_version: 1
`)
	start := time.Date(2026, 4, 23, 6, 0, 0, 0, time.UTC)
	offset := time.Until(start.Add(-300 * time.Millisecond))
	now := func() time.Time { return time.Now().Add(offset) }
	signal := make(chan scheduler.TickReport)
	s, err := scheduler.New(scheduler.Config{File: f, Client: b.client, Redis: b.ns.Client, Store: st,
		Logger: quietLogger(), Now: now, TestSignal: signal, RetryMin: 20 * time.Millisecond, RetryMax: 100 * time.Millisecond})
	require.NoError(t, err)
	proxy.Refuse()
	ctx := context.Background()
	require.NoError(t, s.Start(ctx))
	defer s.Stop()

	seen := map[string]time.Time{} // window → due
	ok := map[string]bool{}
	for range 30 {
		rep := recvTick(t, signal)
		require.False(t, rep.GaveUp)
		seen[rep.Window] = rep.At
		ok[rep.Window] = ok[rep.Window] || rep.Err == nil
	}
	require.GreaterOrEqual(t, len(seen), 2, "windows ticked while the first is retried: %v", seen)
	before := len(seen)
	proxy.Accept()
	for {
		rep := recvTick(t, signal)
		require.False(t, rep.GaveUp)
		seen[rep.Window] = rep.At
		ok[rep.Window] = ok[rep.Window] || rep.Err == nil
		all := true
		for w := range seen {
			all = all && ok[w]
		}
		if all && len(seen) > before+1 {
			break
		}
	}
	s.Stop()
	var first, last time.Time
	for _, at := range seen {
		if first.IsZero() || at.Before(first) {
			first = at
		}
		if at.After(last) {
			last = at
		}
	}
	jobs := b.windows(t)
	for at := first; !at.After(last); at = at.Add(time.Second) {
		w := at.Format("2006-01-02T15:04:05")
		assert.Equal(t, 1, jobs[w], "window %s (between %v and %v) has its job", w, first, last)
	}
}

// TestFillEverySecond: a template firing every second fills a listed gap at once (the fill
// computes the window's tick instead of walking a year of seconds).
func TestFillEverySecond(t *testing.T) {
	b := setup(t)
	f := b.file(t, `templates:
  - name: s
    cron: "* * * * * *"
    window: secondly
    kind: catalog
    catchup: none
    sources: {ids: [sku-1]}
    countries: [US]
    parser_version: 1
`)
	ctx := context.Background()
	clock := tu.NewClock(time.Date(2026, 4, 23, 6, 0, 0, 0, time.UTC))
	s := b.scheduler(t, f, clock.Now, nil)
	require.NoError(t, s.Tick(ctx, "s", clock.Now().Add(-100*time.Second)).Err)
	gaps, err := s.Gaps(ctx)
	require.NoError(t, err)
	require.Len(t, gaps, 99, "the 99 seconds after the first tick, each past its deadline (the next second)")
	for _, g := range []scheduler.Gap{gaps[0], gaps[50], gaps[98]} {
		rep, err := s.Fill(ctx, "s", g.Window)
		require.NoError(t, err, g.Window)
		assert.True(t, g.Due.Equal(rep.At), "%v", rep.At)
		assert.Equal(t, 1, rep.Outcomes["created"])
	}
	gaps, err = s.Gaps(ctx)
	require.NoError(t, err)
	assert.Len(t, gaps, 96)
}
