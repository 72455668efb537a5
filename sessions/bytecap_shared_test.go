package sessions_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestByteCapSharedConnection: plain-HTTP requests of different runs share the gateway's
// kept-alive connections, and an idle connection's pending read was started for the
// previous run's request, with that run's room under its cap (4 KiB, a whole read
// buffer, for a run without one). The next run's cap holds from its first byte all the
// same: its response's bytes that arrive in that read beyond the next run's own room are
// held back, and the run stops at its cap plus the one byte a read may go past it.
func TestByteCapSharedConnection(t *testing.T) {
	e := setup(t, testutil.FakeProxyConfig{Seed: 52}, testutil.FakeSiteConfig{Seed: 52, BigSize: 64 << 10})
	cfg := e.runCfg()
	cfg.Collector.IgnoreRobotsTxt = true
	// A collector of the gateway held open keeps the shared transport, and its idle
	// connection, between the runs (as a worker's other units do).
	holder, err := e.provider.NewSession("US", time.Hour, time.Now())
	require.NoError(t, err)
	hb, err := sessions.NewCollector(context.Background(), holder, &cfg.Collector)
	require.NoError(t, err)
	defer hb.Close()
	get := func(path string) *sessions.Unit {
		return oneStep(func(_ context.Context, sc *sessions.StepContext) error {
			_, err := sc.Get(e.site.URL + path)
			return err
		})
	}

	// A run without a cap leaves the connection idle, its read pending.
	_, err = get("/").Run(context.Background(), cfg)
	require.NoError(t, err)
	require.Equal(t, 1, e.proxy.OpenClients(), "one kept-alive connection to the gateway, idle")
	// The same request as the capped run's, uncapped, on that connection: what it sends.
	from0, _ := e.proxy.ClientBytes()
	_, err = get("/big").Run(context.Background(), cfg)
	require.NoError(t, err)
	from1, _ := e.proxy.ClientBytes()
	sent := from1 - from0
	require.Positive(t, sent)
	require.Equal(t, 1, e.proxy.OpenClients(), "the same connection, idle again")

	// The capped run: its request fits, and 8 bytes of the answer do. The response's
	// status line alone (17 bytes, one write of the proxy) arrives in the pending read.
	capped := cfg
	capped.MaxBytes = sent + 8
	res, err := get("/big").Run(context.Background(), capped)
	require.Error(t, err)
	assert.Equal(t, tasks.CategoryBudgetExceeded, sessions.CategoryOf(err), "got %v", err)
	t.Logf("request %d bytes; cap %d; the capped run moved %d", sent, capped.MaxBytes, res.Bytes)
	assert.LessOrEqual(t, res.Bytes, capped.MaxBytes+1, "the cap holds from the run's first byte, on a shared connection too")
	assert.GreaterOrEqual(t, res.Bytes, capped.MaxBytes, "the run read up to its cap")
}
