package handlers_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestWindowBudgetDefer: two runners (two workers' registries) work 30 jobs of one window
// eight at a time under a window money budget that buys a few of them, with WindowDefer.
// What the window's attempts cost never passes the budget; the deliveries that met the
// rest of the budget reserved came back in seconds, uncounted; those that met it spent
// were deferred by DeferFor without an attempt, with one log line per runner and the
// metric; Redis's total equals PostgreSQL's. After the window's key is lost, the next
// delivery restores the total from PostgreSQL and is deferred too.
func TestWindowBudgetDefer(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	// 1000 USD/GB: one micro-unit per byte. A job's attempt may move 4 KiB, so it reserves
	// 4,096; the window may spend 20,000 (a job moves about 1.7 KB).
	priced, err := r.prov.WithPrice(sessions.Price{Currency: "USD", MicrosPerGB: 1_000_000_000})
	require.NoError(t, err)
	const budget, deferFor = 20_000, 45 * time.Minute
	var logs [2]*testutil.SyncBuffer
	var metrics [2]*prometheus.Registry
	var regs [2]*handlers.Registry
	for i := range regs {
		logs[i], metrics[i] = &testutil.SyncBuffer{}, prometheus.NewRegistry()
		regs[i] = r.registry(t, func(c *handlers.Config) {
			c.WorkerID = fmt.Sprintf("w%d", i)
			c.Provider = priced
			c.Registerer = metrics[i]
			c.Logger = jsonLogger(logs[i])
		}, handlers.WithRetry(handlers.RetryConfig{BandwidthBudget: 4 << 10}),
			handlers.WithWindowBudget(handlers.WindowBudget{Money: budget, OnSpent: handlers.WindowDefer, DeferFor: deferFor}))
	}

	keys := make(chan string, 30)
	taskOf := map[string]func() error{}
	for i := 1; i <= 30; i++ {
		key, task := r.job(t, fmt.Sprintf("sku-%d", i))
		reg := regs[i%2]
		taskOf[key] = func() error { return reg.ProcessTask(ctx, task) }
		keys <- key
	}
	close(keys)
	var mu sync.Mutex
	var deferred, completed []string
	waits := 0
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for key := range keys {
				for {
					d := decisionOf(taskOf[key]())
					mu.Lock()
					switch {
					case d.Ack:
						completed = append(completed, key)
					case d.Retry && !d.Counted && d.Delay < 10*time.Second:
						waits++ // the rest of the budget reserved: back in seconds
						mu.Unlock()
						continue
					case d.Retry && !d.Counted && d.Delay >= deferFor:
						deferred = append(deferred, key)
					default:
						t.Errorf("job %s: unexpected decision %+v", key, d)
					}
					mu.Unlock()
					break
				}
			}
		}()
	}
	wg.Wait()
	spentPG, err := r.st.WindowCost(ctx, catalog.Kind, "2026-04-23", "USD")
	require.NoError(t, err)
	t.Logf("%d complete, %d deferred, %d waits; %d micro-units spent", len(completed), len(deferred), waits, spentPG)
	require.NotEmpty(t, completed)
	require.NotEmpty(t, deferred)
	require.Equal(t, 30, len(completed)+len(deferred))

	// An attempt stopped at its cap may pass it by the rest of the read that crossed it:
	// only the window's last attempt can be stopped so (its cap is what was left).
	assert.LessOrEqual(t, spentPG, int64(budget+4096), "the window spends its budget and at most one attempt's cap more")
	wb, err := lua.NewWindowBudgets(r.ns.Client, r.ns.Prefix)
	require.NoError(t, err)
	spent, reserved, ok, err := wb.Spent(ctx, catalog.Kind, "2026-04-23")
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, spentPG, spent, "Redis's total is PostgreSQL's")
	assert.Zero(t, reserved, "every reservation settled")
	for _, key := range deferred {
		atts, err := r.st.AttemptList(ctx, key)
		require.NoError(t, err)
		job, err := r.st.JobGet(ctx, key)
		require.NoError(t, err)
		if len(atts) == 0 {
			assert.Equal(t, tasks.StatePending, job.State, "a deferred job that never ran stays pending")
			continue
		}
		// The last attempt of the window: capped by what was left, deferred, out of the
		// job's own budget.
		require.Len(t, atts, 1, key)
		assert.Equal(t, string(tasks.CategoryBudgetExceeded), atts[0].Category)
		assert.Contains(t, atts[0].Error, `the money budget of window "2026-04-23" of kind catalog`)
		assert.Equal(t, tasks.StateRetryable, job.State)
	}
	stops := 0.0
	for i := range regs {
		for _, m := range metricFamily(t, metrics[i], "idemscrape_window_budget_stops_total") {
			if labelled(m, "action", "deferred") {
				stops += m.GetCounter().GetValue()
			}
		}
		assert.LessOrEqual(t, countLines(logs[i].String(), "window money budget spent"), 1, "one line per worker:\n%s", logs[i].String())
	}
	assert.GreaterOrEqual(t, stops, float64(len(deferred)-2), "every delivery that met the spent budget is counted")

	// Redis loses the window: the next delivery restores the total from PostgreSQL.
	restores := func() (n float64) {
		for _, m := range metricFamily(t, metrics[0], "idemscrape_window_budget_restores_total") {
			n += m.GetCounter().GetValue()
		}
		return n
	}
	restoresBefore := restores() // the first deliveries found no total either
	require.NoError(t, r.ns.Client.Del(ctx, r.ns.Prefix+"{budget:catalog/2026-04-23}").Err())
	_, task := r.job(t, "sku-40")
	d := decisionOf(regs[0].ProcessTask(ctx, task))
	assert.True(t, d.Retry && !d.Counted && d.Delay >= deferFor, "deferred after the restore: %+v", d)
	spent, _, ok, err = wb.Spent(ctx, catalog.Kind, "2026-04-23")
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, spentPG, spent, "restored from PostgreSQL")
	assert.Equal(t, restoresBefore+1, restores())
	assert.Contains(t, logs[0].String(), "window money budget restored from PostgreSQL")
}

// TestWindowBudgetConfig: a window budget needs a positive amount, a known action, and a
// price on every provider; WindowFail fails a job of a spent window without fetching,
// naming the window and the amounts.
func TestWindowBudgetConfig(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	for _, tc := range []struct {
		b    handlers.WindowBudget
		want string
	}{
		{handlers.WindowBudget{}, "WithWindowBudget: Money 0 must be > 0 micro-units"},
		{handlers.WindowBudget{Money: 5, OnSpent: 7}, "WithWindowBudget: OnSpent 7 is neither WindowFail nor WindowDefer"},
		{handlers.WindowBudget{Money: 5, DeferFor: -time.Second}, "WithWindowBudget: DeferFor -1s is negative"},
		{handlers.WindowBudget{Money: 5}, "a window money budget of 5 micro-units needs a price above 0 on provider generic"},
		{handlers.WindowBudget{Money: 5, Percentile: 1.5}, "WithWindowBudget: Percentile 1.5 must be in (0, 1]"},
		{handlers.WindowBudget{Money: 5, Margin: 0.5}, "WithWindowBudget: Margin 0.5 must be >= 1"},
		{handlers.WindowBudget{Money: 5, MinSamples: -1}, "WithWindowBudget: MinSamples -1 must be >= 1"},
		{handlers.WindowBudget{Money: 5, Concurrency: -2}, "WithWindowBudget: Concurrency -2 is negative"},
	} {
		reg := r.registry(t, nil)
		err := reg.Register("other", catalog.Workflow(r.site.URL), catalog.Parse, handlers.WithWindowBudget(tc.b))
		require.ErrorContains(t, err, tc.want)
	}

	priced, err := r.prov.WithPrice(sessions.Price{Currency: "USD", MicrosPerGB: 1_000_000_000})
	require.NoError(t, err)
	reg := r.registry(t, func(c *handlers.Config) { c.Provider = priced },
		handlers.WithWindowBudget(handlers.WindowBudget{Money: 1_000}))
	wb, err := lua.NewWindowBudgets(r.ns.Client, r.ns.Prefix)
	require.NoError(t, err)
	_, _, err = wb.Restore(ctx, catalog.Kind, "2026-04-23", 1_000) // spent already
	require.NoError(t, err)
	key, task := r.job(t, "sku-1")
	before := r.proxy.Requests()
	err = reg.ProcessTask(ctx, task)
	require.True(t, decisionOf(err).Skip, "failed: %v", err)
	var spent *handlers.WindowSpentError
	require.True(t, errors.As(err, &spent), "%v", err)
	requireJob(t, r.st, key, tasks.StateFailed, tasks.CategoryBudgetExceeded)
	atts, err := r.st.AttemptList(ctx, key)
	require.NoError(t, err)
	require.Len(t, atts, 1)
	assert.Equal(t, `sessions: budget_exceeded: the money budget of window "2026-04-23" of kind catalog is spent: 0.001000 USD of 0.001000 USD`, atts[0].Error)
	assert.Zero(t, atts[0].Bytes)
	assert.Equal(t, before, r.proxy.Requests(), "nothing fetched")
}

func jsonLogger(w *testutil.SyncBuffer) *slog.Logger { return slog.New(slog.NewJSONHandler(w, nil)) }

// countLines counts the lines holding s.
func countLines(text, s string) int {
	n := 0
	for _, line := range strings.Split(text, "\n") {
		if strings.Contains(line, s) {
			n++
		}
	}
	return n
}
