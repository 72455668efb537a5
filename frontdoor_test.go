package idemscrape_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape"
	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/scheduler"
	"github.com/idemscrape/idemscrape/service"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/testutil"
)

// frontDoor is a Client on a fresh database and a throwaway redis-server, with the catalog
// kind registered against the fake shop through the fake proxy.
type frontDoor struct {
	c    *idemscrape.Client
	site *testutil.FakeSite
}

func newFrontDoor(t *testing.T, cfg idemscrape.Config) (*frontDoor, *testutil.RedisServer) {
	t.Helper()
	pg := testutil.PG(t)
	rs := testutil.StartRedis(t)
	site := testutil.NewFakeSite(t, testutil.FakeSiteConfig{Seed: 45})
	proxy := testutil.NewFakeProxy(t, testutil.FakeProxyConfig{Seed: 45, Format: testutil.ProxyFormatGeneric, User: "acct", Password: canary})
	prov, err := sessions.NewProvider("generic", proxy.Addr, "{user}[-country-{country}]-session-{session}", "{pass}", "acct", canary, 0)
	require.NoError(t, err)
	cfg.PG, cfg.Redis, cfg.Providers, cfg.AllowLoopback, cfg.HTTPAddr = pg, rs.Client(), []*sessions.Provider{prov}, true, "127.0.0.1:0"
	c, err := idemscrape.New(cfg)
	require.NoError(t, err)
	require.NoError(t, c.Register(catalog.Kind, idemscrape.Kind{Workflow: catalog.Workflow(site.URL), Parse: catalog.Parse}))
	return &frontDoor{c: c, site: site}, rs
}

// TestFrontDoorRedisLoss: the front door's Run runs the reconciler, so a job whose task
// Redis lost (a restart without persistence, after the enqueue) still completes, once, and
// its event reaches the consumer.
func TestFrontDoorRedisLoss(t *testing.T) {
	fd, rs := newFrontDoor(t, idemscrape.Config{Reconcile: &scheduler.ReconcilerFile{Interval: 200 * time.Millisecond}})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	spec := idemscrape.Spec{Kind: catalog.Kind, SourceID: "sku-3", Country: "US", Window: "w1", ParserVersion: 1}
	_, err := fd.c.Enqueue(ctx, spec)
	require.NoError(t, err)
	rs.Restart() // every key gone: the task too; PostgreSQL still holds the job as pending

	worker := make(chan error, 1)
	go func() { worker <- fd.c.Run(ctx) }()
	cons, err := fd.c.Consumer(catalog.Kind, "t")
	require.NoError(t, err)
	got := make(chan idemscrape.Event, 4)
	consumed := make(chan error, 1)
	go func() {
		consumed <- cons.Run(ctx, func(_ context.Context, ev idemscrape.Event) error { got <- ev; return nil })
	}()
	select {
	case ev := <-got:
		var e struct{ Data catalog.Record }
		require.NoError(t, json.Unmarshal(ev.Payload, &e))
		want, _ := fd.site.Product("sku-3")
		assert.Equal(t, want.Price, e.Data.Price)
	case <-time.After(2 * time.Minute): // a bound on a hang, not a synchronisation
		t.Fatal("the job of the lost task never completed: no reconciler at the front door?")
	}
	cancel()
	require.NoError(t, <-worker)
	require.NoError(t, <-consumed)
	fd.c.Close()
}

// TestFrontDoorSharedSettingsKept: a Runner or Service hook cannot undo a setting given
// once in Config (here the stream prefix and the fetch guard), and Close waits for Run.
func TestFrontDoorSharedSettingsKept(t *testing.T) {
	fd, _ := newFrontDoor(t, idemscrape.Config{
		NoReconciler: true,
		StreamPrefix: "fd:",
		Service:      func(sc *service.Config) { sc.Dispatcher = nil },
		Runner:       func(hc *handlers.Config) { hc.Collector = sessions.CollectorConfig{RequestTimeout: 5 * time.Second} },
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	_, err := fd.c.Enqueue(ctx, idemscrape.Spec{Kind: catalog.Kind, SourceID: "sku-4", Country: "US", Window: "w1", ParserVersion: 1})
	require.NoError(t, err)
	worker := make(chan error, 1)
	go func() { worker <- fd.c.Run(ctx) }()
	cons, err := fd.c.Consumer(catalog.Kind, "t") // reads fd:stream:{catalog}
	require.NoError(t, err)
	got := make(chan struct{}, 1)
	consumed := make(chan error, 1)
	go func() {
		consumed <- cons.Run(ctx, func(context.Context, idemscrape.Event) error {
			select {
			case got <- struct{}{}:
			default:
			}
			return nil
		})
	}()
	select {
	case <-got:
	case <-time.After(2 * time.Minute):
		t.Fatal("no event on the Config's stream prefix")
	}
	// The hook replaced the collector config; the guard that refuses private addresses
	// stays the one Config says (loopback allowed), else the job above could not have run.
	closed := make(chan struct{})
	go func() { fd.c.Close(); close(closed) }()
	select {
	case <-closed:
		t.Fatal("Close returned while Run was still going")
	default:
	}
	cancel()
	require.NoError(t, <-worker)
	<-closed
	require.NoError(t, <-consumed)
}
