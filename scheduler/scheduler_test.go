package scheduler_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemscrape/idemscrape/scheduler"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.Cleanup(func(code int) {
		if buildDir != "" {
			_ = os.RemoveAll(buildDir)
		}
		os.Exit(code)
	}))
}

// bundle is the services one scheduler test runs against.
type bundle struct {
	st     *store.PG
	ns     *testutil.RedisNS
	client *asynq.Client
}

func setup(t testing.TB) *bundle {
	t.Helper()
	b := &bundle{st: store.New(testutil.PG(t)), ns: testutil.Redis(t)}
	b.client = asynq.NewClient(b.ns.AsynqOpt())
	t.Cleanup(func() { _ = b.client.Close() })
	return b
}

// file parses a YAML template list with kind "catalog" on the namespace's queue.
func (b *bundle) file(t testing.TB, templates string) *scheduler.File {
	t.Helper()
	f, err := scheduler.ParseFile([]byte(templates+"\nkinds:\n  catalog: {queue: "+b.ns.Queue+"}\n"), t.TempDir(), nil)
	require.NoError(t, err)
	return f
}

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func (b *bundle) scheduler(t testing.TB, f *scheduler.File, now func() time.Time, signal chan scheduler.TickReport) *scheduler.Scheduler {
	t.Helper()
	s, err := scheduler.New(scheduler.Config{File: f, Client: b.client, Redis: b.ns.Client, Store: b.st,
		Logger: quietLogger(), Now: now, TestSignal: signal})
	require.NoError(t, err)
	return s
}

func (b *bundle) windows(t testing.TB) map[string]int {
	t.Helper()
	rows, err := b.st.Pool().Query(context.Background(), `SELECT "window", count(*) FROM jobs GROUP BY 1`)
	require.NoError(t, err)
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var w string
		var n int
		require.NoError(t, rows.Scan(&w, &n))
		out[w] = n
	}
	require.NoError(t, rows.Err())
	return out
}

func TestCatchUpAfterDowntime(t *testing.T) {
	b := setup(t)
	f := b.file(t, `
templates:
  - name: daily
    cron: "0 6 * * *"
    window: daily
    kind: catalog
    sources: {ids: [sku-1, sku-2, sku-3]}
    countries: [US, DE]
    parser_version: 1
  - name: no-catchup
    cron: "0 6 * * *"
    window: daily
    kind: catalog
    sources: {ids: [other]}
    countries: [US]
    parser_version: 1
    catchup: none
`)
	clock := testutil.NewClock(time.Date(2026, 4, 23, 10, 0, 0, 0, time.UTC))
	signal := make(chan scheduler.TickReport, 4)
	s := b.scheduler(t, f, clock.Now, signal)

	runOnce := func(t *testing.T) scheduler.TickReport {
		t.Helper()
		require.NoError(t, s.Start(context.Background()))
		rep := <-signal
		s.Stop()
		require.Empty(t, signal, "only the catch-up tick runs before the next scheduled time")
		require.NoError(t, rep.Err)
		require.True(t, rep.CatchUp)
		require.Equal(t, "daily", rep.Template, "catchup: none never catches up")
		return rep
	}

	t.Run("StartAfterMissedTickEnqueuesThatWindow", func(t *testing.T) {
		rep := runOnce(t)
		assert.Equal(t, "2026-04-23", rep.Window)
		assert.Equal(t, time.Date(2026, 4, 23, 6, 0, 0, 0, time.UTC), rep.At)
		assert.Equal(t, map[string]int{"created": 6}, rep.Outcomes)
		assert.Equal(t, map[string]int{"2026-04-23": 6}, b.windows(t))
		assert.Equal(t, 6, b.ns.AsynqPending(t))
	})
	t.Run("RestartInSameWindowEnqueuesNothingNew", func(t *testing.T) {
		rep := runOnce(t)
		assert.Equal(t, "2026-04-23", rep.Window)
		assert.Equal(t, map[string]int{"already_queued": 6}, rep.Outcomes)
		assert.Equal(t, 6, b.ns.AsynqPending(t))
	})
	t.Run("LongDowntimeCatchesUpOnlyTheLastWindow", func(t *testing.T) {
		clock.Set(time.Date(2026, 4, 26, 5, 59, 59, 0, time.UTC)) // down 3 days, just before the 26th's tick
		rep := runOnce(t)
		assert.Equal(t, "2026-04-25", rep.Window)
		assert.Equal(t, map[string]int{"created": 6}, rep.Outcomes)
		assert.Equal(t, map[string]int{"2026-04-23": 6, "2026-04-25": 6}, b.windows(t))
	})
	t.Run("JobsCompletedMeanwhileAreNotEnqueuedAgain", func(t *testing.T) {
		// Workers finished the window's jobs (asynq deleted their tasks, Retention 0).
		_, err := b.st.Pool().Exec(context.Background(),
			`UPDATE jobs SET state = 'complete', completed_at = now() WHERE "window" = '2026-04-25'`)
		require.NoError(t, err)
		insp := asynq.NewInspector(b.ns.AsynqOpt())
		defer insp.Close()
		_, err = insp.DeleteAllPendingTasks(b.ns.Queue)
		require.NoError(t, err)
		rep := runOnce(t)
		assert.Equal(t, map[string]int{"already_complete": 6}, rep.Outcomes)
		assert.Equal(t, 0, b.ns.AsynqPending(t))
	})
}

func TestTick(t *testing.T) {
	b := setup(t)
	dir := t.TempDir()
	_, err := scheduler.ParseFile([]byte(`
templates:
  - name: from-file
    cron: "0 * * * *"
    window: hourly
    kind: catalog
    sources: {file: skus.txt, urls: ["http://127.0.0.1:9/p/1"]}
    countries: [US]
    parser_version: 1
kinds:
  catalog: {queue: `+b.ns.Queue+`}
`), dir, nil)
	require.Error(t, err, "the source file must exist at start")

	writeSources := func(lines ...string) {
		require.NoError(t, writeFile(dir+"/skus.txt", strings.Join(lines, "\n")))
	}
	writeSources("sku-1")
	f, err := scheduler.ParseFile([]byte(`
templates:
  - name: from-file
    cron: "0 * * * *"
    window: hourly
    kind: catalog
    sources: {file: skus.txt, ids: [inline-1]}
    countries: [US]
    parser_version: 1
kinds:
  catalog: {queue: `+b.ns.Queue+`}
`), dir, nil)
	require.NoError(t, err)
	at := time.Date(2026, 4, 23, 14, 0, 0, 0, time.UTC)
	s := b.scheduler(t, f, testutil.NewClock(at).Now, nil)
	ctx := context.Background()

	t.Run("FileReadAgainEveryTick", func(t *testing.T) {
		rep := s.Tick(ctx, "from-file", at)
		require.NoError(t, rep.Err)
		assert.Equal(t, "2026-04-23T14", rep.Window)
		assert.Equal(t, map[string]int{"created": 2}, rep.Outcomes)
		writeSources("# more skus", "sku-1", "sku-2", "", "https://shop.example.com/p/3")
		rep = s.Tick(ctx, "from-file", at)
		require.NoError(t, rep.Err)
		assert.Equal(t, map[string]int{"created": 2, "already_queued": 2}, rep.Outcomes)
	})
	t.Run("BadLineSkippedRestEnqueued", func(t *testing.T) {
		writeSources("sku-1", "https://169.254.169.254/latest/meta-data", "sku-9")
		rep := s.Tick(ctx, "from-file", at)
		require.NoError(t, rep.Err)
		assert.Equal(t, 1, rep.Invalid, "the metadata address is refused by the destination policy")
		assert.Equal(t, map[string]int{"created": 1, "already_queued": 2}, rep.Outcomes)
	})
	t.Run("FileGoneFailsTheTick", func(t *testing.T) {
		require.NoError(t, removeFile(dir+"/skus.txt"))
		rep := s.Tick(ctx, "from-file", at)
		assert.ErrorContains(t, rep.Err, "sources.file")
	})
	t.Run("UnknownTemplate", func(t *testing.T) {
		assert.ErrorContains(t, s.Tick(ctx, "nope", at).Err, `no template "nope"`)
	})
	t.Run("RespectsContextCancellation", func(t *testing.T) {
		writeSources("sku-1")
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		rep := s.Tick(cctx, "from-file", at.Add(time.Hour))
		assert.ErrorIs(t, rep.Err, context.Canceled)
	})
	t.Run("KeysAreThoseOfTasks", func(t *testing.T) {
		key, err := tasks.Spec{Kind: "catalog", SourceID: "sku-9", Country: "US", Window: "2026-04-23T14", ParserVersion: 1}.Key()
		require.NoError(t, err)
		assert.True(t, b.ns.AsynqTaskExists(t, key), fmt.Sprintf("task %s", key))
	})
}

// TestRetryBoundsDefaults: unset, the backoff between tries of a failed tick is bounded
// by DefaultRetryMin and DefaultRetryMax (it once became 1 ms with neither set, as
// cmd/scheduler runs); a RetryMax below the default minimum bounds the minimum too.
func TestRetryBoundsDefaults(t *testing.T) {
	b := setup(t)
	f := b.file(t, "templates: []")
	for _, c := range []struct{ min, max, wantMin, wantMax time.Duration }{
		{0, 0, scheduler.DefaultRetryMin, scheduler.DefaultRetryMax},
		{0, 200 * time.Millisecond, 200 * time.Millisecond, 200 * time.Millisecond},
		{0, 5 * time.Minute, scheduler.DefaultRetryMin, 5 * time.Minute},
		{3 * time.Minute, 0, 3 * time.Minute, 3 * time.Minute},
		{10 * time.Millisecond, 50 * time.Millisecond, 10 * time.Millisecond, 50 * time.Millisecond},
	} {
		cfg := scheduler.Config{File: f, Client: b.client, Redis: b.ns.Client, Store: b.st, RetryMin: c.min, RetryMax: c.max}
		require.NoError(t, cfg.Validate())
		assert.Equal(t, c.wantMin, cfg.RetryMin, "RetryMin %v RetryMax %v", c.min, c.max)
		assert.Equal(t, c.wantMax, cfg.RetryMax, "RetryMin %v RetryMax %v", c.min, c.max)
	}
}
