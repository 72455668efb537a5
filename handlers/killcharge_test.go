package handlers_test

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// priceGate is the shop seen through a reverse proxy that holds the first hold price
// requests until release is closed (at the test's end at the latest), reporting each on
// held.
type priceGate struct {
	URL     string
	held    chan string
	release chan struct{}
	once    sync.Once
}

func newPriceGate(t *testing.T, site string, hold int) *priceGate {
	target, err := url.Parse(site)
	require.NoError(t, err)
	rp := httputil.NewSingleHostReverseProxy(target)
	g := &priceGate{held: make(chan string, 1000), release: make(chan struct{})}
	var mu sync.Mutex
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/api/price/") {
			mu.Lock()
			held := hold > 0
			hold--
			mu.Unlock()
			if held {
				g.held <- r.URL.Path
				select {
				case <-g.release:
				case <-r.Context().Done():
					return
				}
			}
		}
		rp.ServeHTTP(w, r)
	}))
	g.URL = srv.URL
	t.Cleanup(srv.Close)
	t.Cleanup(g.open) // before Close: no handler stays blocked
	return g
}

func (g *priceGate) open() { g.once.Do(func() { close(g.release) }) }

// waitHeld waits until n price requests are held.
func (g *priceGate) waitHeld(t *testing.T, n int) {
	t.Helper()
	timeout := time.After(60 * time.Second)
	for i := range n {
		select {
		case <-g.held:
		case <-timeout:
			t.Fatalf("only %d of %d requests reached the price step", i, n)
		}
	}
}

// gatedRegistry is a runner on the rig whose catalog kind fetches through base.
func gatedRegistry(t *testing.T, r *rig, base string, mutate func(*handlers.Config), opts ...handlers.KindOption) *handlers.Registry {
	t.Helper()
	cfg := handlers.Config{
		Store: r.st, Redis: r.ns.Client, Provider: r.prov, KeyPrefix: r.ns.Prefix,
		Collector: sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), RequestTimeout: 30 * time.Second, ThrottleWaitMax: -1},
		Logger:    slog.New(slog.NewTextHandler(testWriter{t}, nil)),
		Rand:      func() float64 { return 0.5 },
	}
	if mutate != nil {
		mutate(&cfg)
	}
	reg, err := handlers.NewRegistry(cfg)
	require.NoError(t, err)
	t.Cleanup(reg.Close)
	require.NoError(t, reg.Register(catalog.Kind, catalog.Workflow(base), catalog.Parse, opts...))
	return reg
}

// TestKilledAttemptCharged: a window whose budget buys one attempt's reservation. Worker
// A reserves it, starts the attempt (the job's row records the reservation) and is killed
// at the price step: its PostgreSQL and Redis are cut for good, so it neither records nor
// settles anything again. When the reservation lapses it is charged in full — Redis's
// total, not a refund — and worker B, taking the job over, finds the budget spent: the job
// fails budget_exceeded without a second fetch, and A's attempt row, written as lost by
// B's start, carries the same cost, so PostgreSQL (the restore's source) agrees with
// Redis. On the old code the reservation was given back: B was granted the budget again
// and ran, Redis showed only B's cost, and A's lost row cost 0.
func TestKilledAttemptCharged(t *testing.T) {
	ctx := context.Background()
	handlers.SetWindowHoldSlack(t, 0) // a reservation lapses at its delivery's deadline
	r := newRig(t, rigOpts{})
	// 1000 USD/GB: one micro-unit per byte. An attempt may move 4 KiB: it reserves 4,096,
	// the whole window.
	priced, err := r.prov.WithPrice(sessions.Price{Currency: "USD", MicrosPerGB: 1_000_000_000})
	require.NoError(t, err)
	const capBytes = 4096
	opts := []handlers.KindOption{
		handlers.WithRetry(handlers.RetryConfig{BandwidthBudget: capBytes}),
		handlers.WithWindowBudget(handlers.WindowBudget{Money: capBytes}),
	}
	gate := newPriceGate(t, r.site.URL, 1)

	// Worker A reaches PostgreSQL and Redis through proxies the test cuts.
	poolA, pgA := testutil.PoolVia(t, r.st.Pool())
	redisA := testutil.NewTCPProxy(t, r.ns.Addr)
	clientA := redis.NewClient(&redis.Options{Addr: redisA.Addr, DB: r.ns.Client.Options().DB, MaxRetries: -1,
		DialTimeout: time.Second, ReadTimeout: 2 * time.Second, WriteTimeout: 2 * time.Second})
	t.Cleanup(func() { _ = clientA.Close() })
	regA := gatedRegistry(t, r, gate.URL, func(c *handlers.Config) {
		c.WorkerID, c.Store, c.Redis, c.Provider, c.LeaseLength = "A", store.New(poolA), clientA, priced, 2*time.Second
		c.NoGroupCommit = true
	}, opts...)
	regB := gatedRegistry(t, r, gate.URL, func(c *handlers.Config) {
		c.WorkerID, c.Provider, c.LeaseLength = "B", priced, 2*time.Second
	}, opts...)

	key, task := r.job(t, "sku-1")
	// A bound on A's delivery (a loaded box must still reach the price gate inside it);
	// the hold's lapse is injected below, not waited for.
	actx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	doneA := make(chan error, 1)
	go func() { doneA <- regA.ProcessTask(actx, task) }()
	gate.waitHeld(t, 1)
	requireState(t, r.st, key, tasks.StateRunning)
	reserved := testutil.Count(t, r.st.Pool(), `SELECT attempt_reserved_micros FROM jobs WHERE key = $1`, key)
	require.Equal(t, capBytes, reserved, "the start records the reservation")
	pgA.Refuse() // A is killed: nothing it does reaches the stores again
	redisA.Refuse()
	select {
	case err := <-doneA:
		t.Logf("worker A gave up: %v", err)
	case <-time.After(60 * time.Second):
		t.Fatal("worker A did not end")
	}

	// B's delivery waits while A's reservation is held and its lease lives.
	d := decisionOf(regB.ProcessTask(ctx, task))
	require.True(t, d.Retry && !d.Counted, "B waits for A's hold: %+v", d)
	// A's delivery deadline passes: its reservation lapses, charged, and its lease ends.
	endDeadWorkersHold(t, r.ns.Client, r.ns.Prefix, catalog.Kind, "2026-04-23", key)
	d = decisionOf(regB.ProcessTask(ctx, task))
	assert.True(t, d.Skip, "B fails the job: the window is spent: %+v", d)
	requireJob(t, r.st, key, tasks.StateFailed, tasks.CategoryBudgetExceeded)

	wb, err := lua.NewWindowBudgets(r.ns.Client, r.ns.Prefix)
	require.NoError(t, err)
	spent, held, ok, err := wb.Spent(ctx, catalog.Kind, "2026-04-23")
	require.NoError(t, err)
	require.True(t, ok)
	assert.EqualValues(t, capBytes, spent, "Redis charges the killed attempt its reservation")
	assert.Zero(t, held)
	atts, err := r.st.AttemptList(ctx, key)
	require.NoError(t, err)
	require.Len(t, atts, 2)
	assert.Equal(t, store.OutcomeLost, atts[0].Outcome)
	assert.Equal(t, "A", atts[0].Worker)
	assert.Equal(t, store.Cost{Micros: capBytes, Currency: "USD"}, store.Cost{Micros: atts[0].CostMicros, Currency: atts[0].Currency},
		"the lost row carries the reservation")
	assert.Zero(t, atts[1].Bytes, "B fetched nothing")
	for _, a := range atts {
		assert.Equal(t, "generic", a.Provider, "the runner records the provider")
		assert.Equal(t, string(priced.Tier()), a.Tier)
	}
	inPG, err := r.st.WindowCost(ctx, catalog.Kind, "2026-04-23", "USD")
	require.NoError(t, err)
	assert.Equal(t, spent, inPG, "PostgreSQL, the restore's source, agrees with Redis")
	assert.LessOrEqual(t, r.proxy.Bytes(), spent, "what the proxy moved is within what was charged")
	t.Logf("proxy moved %d bytes; charged %d micro-units (1 per byte)", r.proxy.Bytes(), spent)
}

// endDeadWorkersHold puts Redis where the clock would take it once a killed worker's
// delivery deadline passed: the window's reservations lapse (their deadline is moved to
// 0, which the next reservation's script reads as past) and the job's lease is gone. The
// test injects that moment instead of sleeping until it.
func endDeadWorkersHold(t *testing.T, rdb redis.UniversalClient, prefix, kind, window, jobKey string) {
	t.Helper()
	ctx := context.Background()
	keys, err := lua.NewKeys(prefix)
	require.NoError(t, err)
	budget := keys.WindowBudget(kind, window)
	fields, err := rdb.HGetAll(ctx, budget).Result()
	require.NoError(t, err)
	lapsed := 0
	for f, v := range fields {
		if !strings.HasPrefix(f, "r:") {
			continue
		}
		amount, _, ok := strings.Cut(v, " ")
		require.True(t, ok, "reservation %s=%q", f, v)
		require.NoError(t, rdb.HSet(ctx, budget, f, amount+" 0").Err())
		lapsed++
	}
	require.Equal(t, 1, lapsed, "the dead worker's reservation is held: %v", fields)
	require.NoError(t, rdb.Del(ctx, keys.Lease(jobKey)).Err())
}
