package catalogjs_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/examples/catalogjs"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

const canary = "pw-catalogjs-canary-93d1"

// TestRenderedKind: the example kind through the runner, three products of a shop that
// renders prices with JavaScript and binds its cookie and token to the exit. For the
// second, the proxy drops the device during the render: its staging is quarantined, the
// unit replays on a new session, and the job completes in the same attempt. Each job has
// exactly one result with the price JavaScript wrote; the registry's Close leaves no
// Chromium process.
func TestRenderedKind(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	ns := testutil.Redis(t)
	st := store.New(pool)
	site := testutil.NewFakeSite(t, testutil.FakeSiteConfig{Seed: 31, StrictExit: true})
	proxy := testutil.NewFakeProxy(t, testutil.FakeProxyConfig{Seed: 31, Format: testutil.ProxyFormatGeneric, User: "acct", Password: canary})
	prov, err := sessions.NewProvider("generic", proxy.Addr, "{user}[-country-{country}]-session-{session}", "{pass}", "acct", canary, 0)
	require.NoError(t, err)
	browsers, err := sessions.NewBrowserPool(sessions.BrowserConfig{MaxBrowsers: 1})
	require.NoError(t, err, "Chromium is needed: make test-deps installs Debian's chromium")
	reg, err := handlers.NewRegistry(handlers.Config{Store: st, Redis: ns.Client, Provider: prov, KeyPrefix: ns.Prefix,
		Collector: sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), IgnoreRobotsTxt: true},
		Browsers:  browsers, Logger: slog.New(slog.NewTextHandler(testWriter{t}, nil))})
	require.NoError(t, err)
	closed := false
	t.Cleanup(func() {
		if !closed {
			reg.Close()
		}
	})
	drop := "sku-12"
	wf := catalogjs.Workflow(site.URL)
	require.NoError(t, reg.Register(catalogjs.Kind, func(job tasks.Payload) (*sessions.Unit, error) {
		u, err := wf(job)
		if err != nil || job.Spec.SourceID != drop {
			return u, err
		}
		render := u.Steps[1].Run
		u.Steps[1].Run = func(ctx context.Context, sc *sessions.StepContext) error {
			if drop != "" {
				drop = ""
				proxy.SetDisconnectProb(1) // the device drops on the render's first request
				defer proxy.SetDisconnectProb(0)
			}
			return render(ctx, sc)
		}
		return u, nil
	}, catalogjs.Parse))

	var keys []string
	for _, sku := range []string{"sku-11", "sku-12", "sku-13"} {
		spec, err := tasks.Spec{Kind: catalogjs.Kind, SourceID: sku, Country: "US", Window: "2026-12-06", ParserVersion: 1}.Normalize()
		require.NoError(t, err)
		key, err := spec.Key()
		require.NoError(t, err)
		_, err = st.JobsRecord(ctx, []tasks.JobRecord{{Key: key, Spec: spec}})
		require.NoError(t, err)
		payload, err := json.Marshal(tasks.Payload{Key: key, Spec: spec})
		require.NoError(t, err)
		require.NoError(t, reg.ProcessTask(ctx, asynq.NewTask(catalogjs.Kind, payload)), sku)
		keys = append(keys, key)
	}
	for i, key := range keys {
		job, err := st.JobGet(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, tasks.StateComplete, job.State)
		assert.Equal(t, 1, job.Attempts, "%s: one attempt", key)
		var rec catalog.Record
		require.NoError(t, pool.QueryRow(ctx, `SELECT data FROM results WHERE job_key = $1`, key).Scan(&rec))
		p, _ := site.Product(fmt.Sprintf("sku-%d", 11+i))
		assert.Equal(t, p.Price, rec.Price, key)
		assert.Equal(t, p.Name, rec.Name, key)
	}
	assert.Equal(t, 1, testutil.Count(t, pool, `SELECT count(*) FROM quarantine WHERE job_key = $1 AND reason LIKE 'session_lost%'`, keys[1]),
		"the lost session's staging quarantined")
	assert.Equal(t, 3, testutil.Count(t, pool, `SELECT count(*) FROM results`))

	pids := browsers.Processes()
	require.NotEmpty(t, pids)
	reg.Close()
	closed = true
	for _, pid := range pids {
		assert.NoFileExists(t, fmt.Sprintf("/proc/%d/cmdline", pid), "Chromium %d outlived Registry.Close", pid)
	}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) { w.t.Log(string(p)); return len(p), nil }
