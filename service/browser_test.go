package service_test

import (
	"context"
	"encoding/json"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/ops"
	"github.com/idemscrape/idemscrape/tasks"
)

// chromiumInstall is how a Debian machine gets the browser this test drives.
const chromiumInstall = "apt-get install -y chromium"

// chromiumPath finds Debian's chromium; the test fails (never skips) without it.
func chromiumPath(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"/usr/bin/chromium", "chromium", "chromium-browser"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	t.Fatalf("headless Chromium is not installed: run `%s` (.ci/run installs it)", chromiumInstall)
	return ""
}

// newBrowser starts headless Chromium (exe) for the test and returns a context on it for
// 90 s of work; the browser is closed when the test ends.
func newBrowser(t *testing.T, ctx context.Context, exe string) context.Context {
	t.Helper()
	allocCtx, cancelAlloc := chromedp.NewExecAllocator(ctx, append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(exe), chromedp.NoSandbox, chromedp.Headless, chromedp.DisableGPU,
		chromedp.UserDataDir(t.TempDir()), chromedp.WindowSize(1280, 900))...)
	t.Cleanup(cancelAlloc)
	browser, cancelBrowser := chromedp.NewContext(allocCtx)
	t.Cleanup(cancelBrowser)
	require.NoError(t, chromedp.Do(browser), "start %s", exe) // the first run starts the browser: no timeout on it
	tctx, cancel := context.WithTimeout(browser, 90*time.Second)
	t.Cleanup(cancel)
	return tctx
}

func TestJobPageInBrowser(t *testing.T) {
	exe := chromiumPath(t)
	b := setup(t, setupOpts{noDisp: true})
	ctx := context.Background()

	// A queued task, so asynqmon shows the queue, and a job with two attempts.
	b.probeTask(t)
	key := "catalog:sku-7:US:2026-04-23:v1"
	recordJob(t, b.st, key, tasks.Spec{Kind: catalog.Kind, SourceID: "sku-7", Country: "US", Window: "2026-04-23", ParserVersion: 1})
	startAttempt(t, b.st, key, 1, "sessaaa1")
	require.NoError(t, b.st.JobMarkRetryable(ctx, store.AttemptFinishParams{
		Key: key, Token: 1, NextAttemptAt: time.Now().Add(time.Minute), Category: "session_lost", Error: "EOF", Bytes: 10,
	}))
	startAttempt(t, b.st, key, 2, "sessbbb2")
	_, err := b.st.Commit(ctx, store.CommitParams{
		Key: key, Token: 2, ObservationKey: key, ParserVersion: 1, Data: json.RawMessage(`{}`),
		EventKey: "observed:" + key, Topic: "catalog", EventPayload: json.RawMessage(`{}`), HTTPStatus: 200, Bytes: 20,
	})
	require.NoError(t, err)

	tctx := newBrowser(t, ctx, exe)

	dir := t.TempDir()
	shot := func(t *testing.T, name string) {
		t.Helper()
		png, err := chromedp.Run(tctx, chromedp.FullScreenshot(100)) // quality 100: PNG
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), png, 0o600))
		t.Logf("screenshot %s", filepath.Join(dir, name))
	}

	t.Run("Monitoring", func(t *testing.T) {
		require.NoError(t, chromedp.Do(tctx, chromedp.Navigate(b.base+"/monitoring/")))
		_, err := chromedp.Run(tctx, chromedp.Poll[bool](`document.body.innerText.includes(`+strconv.Quote(b.queue)+`)`,
			chromedp.WithPollingTimeout(60*time.Second)))
		require.NoError(t, err, "asynqmon never showed queue %s", b.queue)
		text, err := chromedp.Run(tctx, chromedp.Text(chromedp.CSS("body")))
		require.NoError(t, err)
		assert.Contains(t, text, b.queue)
		shot(t, "monitoring.png")
	})

	t.Run("AsynqTaskLinked", func(t *testing.T) {
		// asynqmon's lists cut a task ID at its first "-" (catalog:sku): the job page links
		// to the task's own page, which shows the whole ID.
		qkey := "catalog:sku-77:US:2026-04-23:v1"
		_, err := b.st.JobsRecord(ctx, []tasks.JobRecord{{Key: qkey, Queue: b.queue,
			Spec: tasks.Spec{Kind: catalog.Kind, SourceID: "sku-77", Country: "US", Window: "2026-04-23", ParserVersion: 1}}})
		require.NoError(t, err)
		client := asynq.NewClient(b.opt)
		defer client.Close()
		_, err = client.Enqueue(asynq.NewTask(catalog.Kind, []byte(`{"key":"`+qkey+`"}`)), asynq.Queue(b.queue), asynq.TaskID(qkey), asynq.ProcessIn(time.Hour))
		require.NoError(t, err)
		require.NoError(t, chromedp.Do(tctx,
			chromedp.Navigate(b.base+"/jobs/"+url.PathEscape(qkey)),
			chromedp.WaitVisible(chromedp.ID("asynq-task")),
		))
		href, err := chromedp.Run(tctx, chromedp.Evaluate[string](`document.getElementById("asynq-task").href`))
		require.NoError(t, err)
		require.NoError(t, chromedp.Do(tctx, chromedp.Navigate(href)))
		_, err = chromedp.Run(tctx, chromedp.Poll[bool](`document.body.innerText.includes(`+strconv.Quote(qkey)+`)`,
			chromedp.WithPollingTimeout(60*time.Second)))
		require.NoError(t, err, "asynqmon's task page never showed the whole task ID %s", qkey)
		loc, err := chromedp.Run(tctx, chromedp.Location())
		require.NoError(t, err)
		assert.Contains(t, loc, "/monitoring/queues/"+b.queue+"/tasks/")
		shot(t, "task.png")
	})

	t.Run("JobTimeline", func(t *testing.T) {
		require.NoError(t, chromedp.Do(tctx,
			chromedp.Navigate(b.base+"/jobs/"+url.PathEscape(key)),
			chromedp.WaitVisible(chromedp.ID("attempts")),
		))
		rows, err := chromedp.Run(tctx, chromedp.Evaluate[[]string](`Array.from(document.querySelectorAll("#attempts tr.attempt")).map(r => r.innerText)`))
		require.NoError(t, err)
		state, err := chromedp.Run(tctx, chromedp.Text(chromedp.ID("job-state")))
		require.NoError(t, err)
		require.Len(t, rows, 2)
		assert.Contains(t, rows[0], "session_lost")
		assert.Contains(t, rows[0], "sessaaa1")
		assert.Contains(t, rows[1], "complete")
		assert.Contains(t, rows[1], "sessbbb2")
		assert.Equal(t, "complete", strings.TrimSpace(state))
		shot(t, "job.png")
	})
}

// TestJobPageShowsRecord, in Chromium: a job's page shows the stored record itself (a
// value holding <script> renders as text and runs nothing), the quarantined half of a unit
// replayed after a lost session, the operator's notes (a requeue) and the retry budget it
// has left.
func TestJobPageShowsRecord(t *testing.T) {
	exe := chromiumPath(t)
	b := setup(t, setupOpts{noDisp: true})
	ctx := context.Background()
	key := "catalog:sku-9:US:2026-04-23:v1"
	recordJob(t, b.st, key, tasks.Spec{Kind: catalog.Kind, SourceID: "sku-9", Country: "US", Window: "2026-04-23", ParserVersion: 1})
	startAttempt(t, b.st, key, 1, "sessq001")
	require.NoError(t, b.st.JobFail(ctx, store.AttemptFinishParams{Key: key, Token: 1, Category: "parse_error", Error: "price is not JSON", Bytes: 100}))
	_, err := b.pool.Exec(ctx, `INSERT INTO quarantine (job_key, attempt_no, session_id, reason, staged) VALUES ($1, 1, 'sessq001', 'session_lost', $2)`,
		key, `{"cookie": {"status": 200}, "token": "<b>half</b>"}`)
	require.NoError(t, err)
	_, err = ops.New(b.pool).JobRequeue(ctx, ops.RequeueParams{Key: key, By: "alice", Note: "parser fixed"})
	require.NoError(t, err)
	startAttempt(t, b.st, key, 2, "sessq002")
	_, err = b.st.Commit(ctx, store.CommitParams{
		Key: key, Token: 2, ObservationKey: key, ParserVersion: 1,
		Data:     json.RawMessage(`{"price": "19.99", "name": "<script>window.pwned = 1</script>"}`),
		EventKey: "observed:" + key, Topic: "catalog", EventPayload: json.RawMessage(`{}`), HTTPStatus: 200, Bytes: 30,
	})
	require.NoError(t, err)

	tctx := newBrowser(t, ctx, exe)

	require.NoError(t, chromedp.Do(tctx, chromedp.Navigate(b.base+"/jobs/"+url.PathEscape(key)), chromedp.WaitVisible(chromedp.ID("results"))))
	records, err := chromedp.Run(tctx, chromedp.Evaluate[[]string](`Array.from(document.querySelectorAll("pre.record")).map(p => p.innerText)`))
	require.NoError(t, err)
	require.Len(t, records, 2, "the result's record and the quarantined staging")
	assert.Contains(t, records[0], `"price": "19.99"`)
	assert.Contains(t, records[0], `"<script>window.pwned = 1</script>"`, "the record as text")
	assert.Contains(t, records[1], `"token": "<b>half</b>"`)
	pwned, err := chromedp.Run(tctx, chromedp.Evaluate[bool](`window.pwned === 1 || document.querySelectorAll("pre.record script, pre.record b").length > 0`))
	require.NoError(t, err)
	assert.False(t, pwned, "markup in a record ran or rendered")
	notes, err := chromedp.Run(tctx, chromedp.Text(chromedp.ID("notes")))
	require.NoError(t, err)
	assert.Contains(t, notes, "alice")
	assert.Contains(t, notes, "parser fixed")
	assert.Contains(t, notes, "failed (parse_error)")
	left, err := chromedp.Run(tctx, chromedp.Text(chromedp.ID("budget-left")))
	require.NoError(t, err)
	assert.Contains(t, left, "7 of 8 attempts", "one attempt since the requeue")
	quarantine, err := chromedp.Run(tctx, chromedp.Text(chromedp.ID("quarantine")))
	require.NoError(t, err)
	assert.Contains(t, quarantine, "session_lost")
	assert.Contains(t, quarantine, "sessq001")
}
