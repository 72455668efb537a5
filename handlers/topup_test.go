package handlers_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
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

// paddedSite is the shop through a reverse proxy that, while pad > 0, adds a header of pad
// bytes to every product page (or, padPrice set, every price answer): an attempt that moves
// several times what the kind's attempts measured.
func paddedSite(t *testing.T, site string, pad *atomic.Int64, padPrice *atomic.Bool) string {
	target, err := url.Parse(site)
	require.NoError(t, err)
	rp := httputil.NewSingleHostReverseProxy(target)
	rp.ModifyResponse = func(res *http.Response) error {
		path := "/product/"
		if padPrice.Load() {
			path = "/api/price/"
		}
		if n := pad.Load(); n > 0 && strings.HasPrefix(res.Request.URL.Path, path) {
			res.Header.Set("X-Pad", strings.Repeat("p", int(n)))
		}
		return nil
	}
	srv := httptest.NewServer(rp)
	t.Cleanup(srv.Close)
	return srv.URL
}

// topUpRig is a rig at one micro-unit a byte whose catalog jobs fetch through a padded
// site behind an armed price gate, with window reservations measured after three attempts
// (their largest, Percentile 1 × Margin 1) and an attempt byte cap of 64 KiB.
type topUpRig struct {
	*rig
	priced   *sessions.Provider
	pad      atomic.Int64
	padPrice atomic.Bool
	gate     *armedGate
}

const topUpCap = 64 << 10

// maxRequest bounds what a catalog request moves: its line and headers, Proxy-Authorization
// included (about 300 bytes).
const maxRequest = 1 << 10

func newTopUpRig(t *testing.T) *topUpRig {
	r := &topUpRig{rig: newRig(t, rigOpts{})}
	var err error
	r.priced, err = r.prov.WithPrice(sessions.Price{Currency: "USD", MicrosPerGB: 1_000_000_000})
	require.NoError(t, err)
	r.gate = newArmedGate(t, paddedSite(t, r.site.URL, &r.pad, &r.padPrice))
	return r
}

func (r *topUpRig) registry(t *testing.T, money int64, mutate func(*handlers.Config)) *handlers.Registry {
	return gatedRegistry(t, r.rig, r.gate.URL, func(c *handlers.Config) {
		c.Provider = r.priced
		if mutate != nil {
			mutate(c)
		}
	}, handlers.WithRetry(handlers.RetryConfig{BandwidthBudget: topUpCap}),
		handlers.WithWindowBudget(handlers.WindowBudget{Money: money, Percentile: 1, Margin: 1, MinSamples: 3}))
}

// warm completes three jobs on reg and returns the largest one's bytes: what an attempt
// reserves from then on (one micro-unit a byte), and what they spent.
func (r *topUpRig) warm(t *testing.T, reg *handlers.Registry) (reservation, spent int64) {
	for i := 1; i <= 3; i++ {
		key, task := r.job(t, fmt.Sprintf("sku-%d", i))
		require.NoError(t, reg.ProcessTask(context.Background(), task))
		atts, err := r.st.AttemptList(context.Background(), key)
		require.NoError(t, err)
		require.Len(t, atts, 1)
		reservation = max(reservation, atts[0].Bytes)
		spent += atts[0].CostMicros
	}
	return reservation, spent
}

// windowState is what Redis holds for the test's window.
func (r *topUpRig) windowState(t *testing.T) (spent, reserved int64) {
	wb, err := lua.NewWindowBudgets(r.ns.Client, r.ns.Prefix)
	require.NoError(t, err)
	spent, reserved, ok, err := wb.Spent(context.Background(), catalog.Kind, "2026-04-23")
	require.NoError(t, err)
	require.True(t, ok)
	return spent, reserved
}

func topUps(t *testing.T, g prometheus.Gatherer, result string) (n float64) {
	for _, m := range metricFamily(t, g, "idemscrape_window_budget_topups_total") {
		if labelled(m, "result", result) {
			n += m.GetCounter().GetValue()
		}
	}
	return n
}

// TestWindowTopUp: an attempt granted the kind's measured cost moves three times that (its
// product page is padded). Its byte cap is what the reservation buys, topped up as it
// reaches it: held at the price step, its reservation in Redis covers what it moved and
// equals the one its row in PostgreSQL records; it completes, and its settlement charges
// its real cost, Redis's total equal to PostgreSQL's. On the old code the reservation
// stayed the measured cost while the attempt moved three times that, ran to its own cap.
func TestWindowTopUp(t *testing.T) {
	ctx := context.Background()
	r := newTopUpRig(t)
	metrics := prometheus.NewRegistry()
	reg := r.registry(t, 10_000_000, func(c *handlers.Config) { c.Registerer = metrics })
	reservation, _ := r.warm(t, reg)

	r.pad.Store(2 * reservation) // the attempt moves ~3 reservations
	r.gate.armed.Store(true)
	key, task := r.job(t, "sku-9")
	done := make(chan error, 1)
	go func() { done <- reg.ProcessTask(ctx, task) }()
	select {
	case <-r.gate.held:
	case err := <-done:
		t.Fatalf("the attempt ended before its price step: %v", err)
	}
	_, held := r.windowState(t)
	recorded := testutil.Count(t, r.st.Pool(), `SELECT attempt_reserved_micros FROM jobs WHERE key = $1`, key)
	t.Logf("reservation at the start %d; held at the price step %d (Redis), %d (PostgreSQL)", reservation, held, recorded)
	assert.Greater(t, held, 2*reservation, "topped up past what the padded page moved")
	assert.EqualValues(t, held, recorded, "the row records the topped-up reservation")
	r.gate.open()
	require.NoError(t, <-done)

	atts, err := r.st.AttemptList(ctx, key)
	require.NoError(t, err)
	require.Len(t, atts, 1)
	a := atts[0]
	assert.Equal(t, store.OutcomeComplete, a.Outcome)
	assert.Greater(t, a.Bytes, 3*reservation-reservation/2, "the attempt moved about three reservations")
	assert.InDelta(t, a.Bytes, a.CostMicros, 1, "charged its real cost (one micro-unit a byte)")
	spent, reserved := r.windowState(t)
	assert.Zero(t, reserved, "settled")
	inPG, err := r.st.WindowCost(ctx, catalog.Kind, "2026-04-23", "USD")
	require.NoError(t, err)
	assert.Equal(t, inPG, spent, "Redis's total is PostgreSQL's")
	assert.GreaterOrEqual(t, topUps(t, metrics, "granted"), 1.0)
	assert.Zero(t, topUps(t, metrics, "refused"))
}

// TestWindowTopUpSpent: the window has one reservation and 300 micro-units left when an
// attempt that needs three reservations starts. It is topped up by the 300, then refused:
// it stops at its cap as capped by the window (budget_exceeded, the window's note), and
// the window's total passes its budget by at most the one byte of the read that crossed
// the cap; Redis and PostgreSQL agree. On the old code the attempt ran to its own cap and
// completed, the window spending past its budget what it moved beyond its reservation.
func TestWindowTopUpSpent(t *testing.T) {
	ctx := context.Background()
	r := newTopUpRig(t)
	reservation, warmSpent := r.warm(t, r.registry(t, 10_000_000, nil))
	budget := warmSpent + reservation + 300
	metrics := prometheus.NewRegistry()
	reg := r.registry(t, budget, func(c *handlers.Config) { c.Registerer = metrics }) // a second worker, a smaller budget

	r.pad.Store(2 * reservation)
	key, task := r.job(t, "sku-9")
	d := decisionOf(reg.ProcessTask(ctx, task))
	assert.True(t, d.Skip, "budget_exceeded is final under WindowFail: %+v", d)
	requireJob(t, r.st, key, tasks.StateFailed, tasks.CategoryBudgetExceeded)
	atts, err := r.st.AttemptList(ctx, key)
	require.NoError(t, err)
	require.Len(t, atts, 1)
	assert.Contains(t, atts[0].Error, `the money budget of window "2026-04-23" of kind catalog`)
	assert.Positive(t, atts[0].Bytes)

	spent, reserved := r.windowState(t)
	inPG, err := r.st.WindowCost(ctx, catalog.Kind, "2026-04-23", "USD")
	require.NoError(t, err)
	t.Logf("budget %d, spent %d (the stopped attempt %d bytes)", budget, spent, atts[0].Bytes)
	assert.Zero(t, reserved)
	assert.Equal(t, inPG, spent, "Redis's total is PostgreSQL's")
	// The cap is checked as bytes arrive: a request written past it is sent, and the read of
	// its answer stops at once (a refused write would leave what is left of the window to
	// attempts that can not send a request, each stopping with nothing moved).
	assert.LessOrEqual(t, spent, budget+maxRequest, "the window passes its budget by at most one request and a byte")
	assert.Greater(t, spent, budget-reservation/2, "the window's money was spent, not left")
	assert.Equal(t, 1.0, topUps(t, metrics, "granted"), "the 300 left")
	assert.Equal(t, 1.0, topUps(t, metrics, "refused"))
}

// TestKilledAttemptChargedAfterTopUp: worker A's attempt is topped up past its measured
// reservation (a padded product page), then A is killed at the price step. When its
// reservation lapses it is charged the topped-up total in Redis, and its attempt row,
// written as lost when worker B takes the job over, carries the same total; B completes
// the job; Redis's total equals PostgreSQL's. On the old code the row and Redis carried
// the reservation at the start, a third of what A moved.
func TestKilledAttemptChargedAfterTopUp(t *testing.T) {
	ctx := context.Background()
	handlers.SetWindowHoldSlack(t, 0) // a reservation lapses at its delivery's deadline
	r := newTopUpRig(t)
	regB := r.registry(t, 10_000_000, func(c *handlers.Config) { c.WorkerID, c.LeaseLength = "B", 2*time.Second })
	reservation, _ := r.warm(t, regB)

	poolA, pgA := testutil.PoolVia(t, r.st.Pool())
	redisA := testutil.NewTCPProxy(t, r.ns.Addr)
	clientA := redis.NewClient(&redis.Options{Addr: redisA.Addr, DB: r.ns.Client.Options().DB, MaxRetries: -1,
		DialTimeout: time.Second, ReadTimeout: 2 * time.Second, WriteTimeout: 2 * time.Second})
	t.Cleanup(func() { _ = clientA.Close() })
	regA := r.registry(t, 10_000_000, func(c *handlers.Config) {
		c.WorkerID, c.Store, c.Redis, c.LeaseLength = "A", store.New(poolA), clientA, 2*time.Second
		c.NoGroupCommit = true
	})

	r.pad.Store(2 * reservation)
	r.gate.armed.Store(true)
	key, task := r.job(t, "sku-9")
	// A bound on A's delivery (a loaded box must still reach the price gate inside it);
	// the hold's lapse is injected below, not waited for.
	actx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	doneA := make(chan error, 1)
	go func() { doneA <- regA.ProcessTask(actx, task) }()
	select {
	case <-r.gate.held:
	case err := <-doneA:
		t.Fatalf("worker A ended before its price step: %v", err)
	}
	_, held := r.windowState(t)
	recorded := testutil.Count(t, r.st.Pool(), `SELECT attempt_reserved_micros FROM jobs WHERE key = $1`, key)
	require.Greater(t, held, 2*reservation, "A was topped up")
	require.EqualValues(t, held, recorded)
	pgA.Refuse() // A is killed: nothing it does reaches the stores again
	redisA.Refuse()
	select {
	case err := <-doneA:
		t.Logf("worker A gave up: %v", err)
	case <-time.After(60 * time.Second):
		t.Fatal("worker A did not end")
	}
	r.gate.armed.Store(false)
	r.gate.open()
	cancel() // A's delivery has ended (ProcessTask returned above)
	// A's delivery deadline passes: its reservation lapses, charged, and its lease ends.
	endDeadWorkersHold(t, r.ns.Client, r.ns.Prefix, catalog.Kind, "2026-04-23", key)
	d := decisionOf(regB.ProcessTask(ctx, task))
	require.True(t, d.Ack, "B completes the job: %+v", d)

	atts, err := r.st.AttemptList(ctx, key)
	require.NoError(t, err)
	require.Len(t, atts, 2)
	assert.Equal(t, store.OutcomeLost, atts[0].Outcome)
	assert.Equal(t, "A", atts[0].Worker)
	assert.Equal(t, held, atts[0].CostMicros, "the lost row carries the topped-up reservation")
	assert.Equal(t, store.OutcomeComplete, atts[1].Outcome)
	spent, reserved := r.windowState(t)
	assert.Zero(t, reserved)
	inPG, err := r.st.WindowCost(ctx, catalog.Kind, "2026-04-23", "USD")
	require.NoError(t, err)
	assert.Equal(t, inPG, spent, "Redis charged A the same total as its lost row")
	t.Logf("reservation %d, topped up to %d; A charged %d, B %d", reservation, held, atts[0].CostMicros, atts[1].CostMicros)
}

// TestWindowTopUpUnknown: Redis loses the window's total while an attempt runs (held at its
// price step), and the attempt's price answer takes it past its reservation: the top-up
// can not be answered (the restore can not know what attempts in flight spend), so the
// attempt stops at its cap — retried as internal, not failed as budget_exceeded, since the
// window is not known to be spent.
func TestWindowTopUpUnknown(t *testing.T) {
	ctx := context.Background()
	r := newTopUpRig(t)
	metrics := prometheus.NewRegistry()
	reg := r.registry(t, 10_000_000, func(c *handlers.Config) { c.Registerer = metrics })
	reservation, _ := r.warm(t, reg)

	r.pad.Store(2 * reservation)
	r.padPrice.Store(true)
	r.gate.armed.Store(true)
	key, task := r.job(t, "sku-9")
	done := make(chan error, 1)
	go func() { done <- reg.ProcessTask(ctx, task) }()
	select {
	case <-r.gate.held:
	case err := <-done:
		t.Fatalf("the attempt ended before its price step: %v", err)
	}
	require.NoError(t, r.ns.Client.Del(ctx, r.ns.Prefix+"{budget:catalog/2026-04-23}").Err())
	r.gate.open()
	d := decisionOf(<-done)
	assert.True(t, d.Retry && d.Counted, "retried: %+v", d)
	requireJob(t, r.st, key, tasks.StateRetryable, tasks.CategoryInternal)
	atts, err := r.st.AttemptList(ctx, key)
	require.NoError(t, err)
	require.Len(t, atts, 1)
	assert.Contains(t, atts[0].Error, "window reservation not topped up")
	assert.Equal(t, 1.0, topUps(t, metrics, "failed"))
}

// TestWindowTopUpAfterRestore: Redis loses the window's total while worker A's attempt is
// held at its price step; worker B's next delivery finds it unknown and restores it from
// PostgreSQL (which knows nothing of A's attempt in flight), and completes. A's price
// answer then takes it past its reservation: its top-up finds the total restored but no
// reservation of A's, re-creates it from what A says it holds and grants the top-up, and
// A completes; Redis's total ends equal to PostgreSQL's. On the old code the top-up read
// the missing reservation as "owner holds nothing" (granted 0): A's job failed for good
// as budget_exceeded with a fraction of the window spent.
func TestWindowTopUpAfterRestore(t *testing.T) {
	ctx := context.Background()
	r := newTopUpRig(t)
	metrics := prometheus.NewRegistry()
	regA := r.registry(t, 10_000_000, func(c *handlers.Config) { c.WorkerID, c.Registerer = "A", metrics })
	regB := r.registry(t, 10_000_000, func(c *handlers.Config) { c.WorkerID = "B" })
	reservation, _ := r.warm(t, regA)

	r.pad.Store(2 * reservation)
	r.padPrice.Store(true) // A's price answer moves three reservations
	r.gate.armed.Store(true)
	key, task := r.job(t, "sku-9")
	done := make(chan error, 1)
	go func() { done <- regA.ProcessTask(ctx, task) }()
	select {
	case <-r.gate.held:
	case err := <-done:
		t.Fatalf("the attempt ended before its price step: %v", err)
	}
	require.NoError(t, r.ns.Client.Del(ctx, r.ns.Prefix+"{budget:catalog/2026-04-23}").Err()) // Redis lost it
	r.gate.armed.Store(false)
	keyB, taskB := r.job(t, "sku-8")
	require.NoError(t, regB.ProcessTask(ctx, taskB), "B restores the window's total and completes")
	requireState(t, r.st, keyB, tasks.StateComplete)

	r.gate.open()
	d := decisionOf(<-done)
	assert.True(t, d.Ack, "A's attempt completes: %+v", d)
	job := requireState(t, r.st, key, tasks.StateComplete)
	assert.Empty(t, job.LastCategory)
	atts, err := r.st.AttemptList(ctx, key)
	require.NoError(t, err)
	require.Len(t, atts, 1)
	assert.Greater(t, atts[0].Bytes, 2*reservation, "A moved past its reservation")
	assert.GreaterOrEqual(t, topUps(t, metrics, "granted"), 1.0)
	assert.Zero(t, topUps(t, metrics, "refused"))
	spent, reserved := r.windowState(t)
	assert.Zero(t, reserved, "settled")
	inPG, err := r.st.WindowCost(ctx, catalog.Kind, "2026-04-23", "USD")
	require.NoError(t, err)
	assert.Equal(t, inPG, spent, "Redis's total is PostgreSQL's")
}

// TestWindowRestoreCatchesUp: Redis loses the window's total while worker B's attempt is
// held at its price step. Worker X's next delivery finds the total unknown and reads
// PostgreSQL; before X writes the restore, B's attempt records its cost and settles — on a
// window Redis does not know, so its settlement is dropped. X's restore, set first, reads
// PostgreSQL again and adds what was recorded since its first read: Redis's total ends
// equal to PostgreSQL's. On the old code B's cost was in neither X's read nor Redis: the
// window's total stayed short by it, and the window could pass its budget by as much.
func TestWindowRestoreCatchesUp(t *testing.T) {
	ctx := context.Background()
	r := newTopUpRig(t)
	regB := r.registry(t, 10_000_000, func(c *handlers.Config) { c.WorkerID = "B" })
	regX := r.registry(t, 10_000_000, func(c *handlers.Config) { c.WorkerID = "X" })
	r.warm(t, regB)

	r.gate.armed.Store(true)
	keyB, taskB := r.job(t, "sku-8")
	doneB := make(chan error, 1)
	go func() { doneB <- regB.ProcessTask(ctx, taskB) }()
	select {
	case <-r.gate.held:
	case err := <-doneB:
		t.Fatalf("B's attempt ended before its price step: %v", err)
	}
	require.NoError(t, r.ns.Client.Del(ctx, r.ns.Prefix+"{budget:catalog/2026-04-23}").Err()) // Redis lost it
	r.gate.armed.Store(false)
	restores := 0
	handlers.SetBeforeWindowRestore(regX, func() {
		restores++
		r.gate.open() // B records its cost and settles between X's read and its restore
		require.NoError(t, <-doneB)
	})
	keyX, taskX := r.job(t, "sku-7")
	require.NoError(t, regX.ProcessTask(ctx, taskX))
	require.Equal(t, 1, restores)
	requireState(t, r.st, keyB, tasks.StateComplete)
	requireState(t, r.st, keyX, tasks.StateComplete)

	spent, reserved := r.windowState(t)
	assert.Zero(t, reserved)
	inPG, err := r.st.WindowCost(ctx, catalog.Kind, "2026-04-23", "USD")
	require.NoError(t, err)
	atts, err := r.st.AttemptList(ctx, keyB)
	require.NoError(t, err)
	require.Len(t, atts, 1)
	t.Logf("PostgreSQL %d, Redis %d (B's attempt cost %d)", inPG, spent, atts[0].CostMicros)
	assert.Equal(t, inPG, spent, "Redis's total is PostgreSQL's: B's cost is counted")
}
