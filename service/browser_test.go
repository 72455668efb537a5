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
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/store"
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

	allocCtx, cancelAlloc := chromedp.NewExecAllocator(ctx, append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(exe), chromedp.NoSandbox, chromedp.Headless, chromedp.DisableGPU,
		chromedp.UserDataDir(t.TempDir()), chromedp.WindowSize(1280, 900))...)
	defer cancelAlloc()
	browser, cancelBrowser := chromedp.NewContext(allocCtx)
	defer cancelBrowser()
	require.NoError(t, chromedp.Do(browser), "start %s", exe) // the first run starts the browser: no timeout on it
	tctx, cancel := context.WithTimeout(browser, 90*time.Second)
	defer cancel()

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
