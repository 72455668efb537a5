package handlers

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
)

// WindowAction is what happens to a window's remaining jobs once its money budget is spent.
type WindowAction int

// Window actions.
const (
	// WindowFail fails each remaining job as budget_exceeded, without fetching (the
	// default). An operator's requeue gives it another chance once the budget is raised.
	WindowFail WindowAction = iota
	// WindowDefer hands each remaining delivery back for WindowBudget.DeferFor, uncounted
	// and without an attempt: the jobs run if the budget is raised meanwhile, or stay
	// pending.
	WindowDefer
)

func (a WindowAction) String() string {
	if a == WindowDefer {
		return "defer"
	}
	return "fail"
}

// DefaultWindowDeferFor is WindowBudget.DeferFor's default.
const DefaultWindowDeferFor = time.Hour

// windowWaitMax bounds the wait of a delivery that found the rest of its window's budget
// reserved by attempts in flight: it comes back within this, spread.
const windowWaitMax = 5 * time.Second

// WindowBudget is a money budget for each collection window of a kind (tasks.Spec.Window;
// jobs without one share the window ""), shared by every worker of the fleet: what the
// window's attempts cost — at the exit's price, wasted attempts included — is held to
// Money while Redis keeps its running total.
//
// Every attempt reserves, before it starts, what it is expected to cost: once MinSamples
// attempts of the kind are known — measured by this process, and at its first reservation
// read from PostgreSQL's record of the kind's recent attempts — Percentile of their bytes
// times Margin, at the exit's price (a few times what a typical attempt costs); before
// that, its whole byte cap (what is left of the job's bandwidth and money budgets), as the
// most it may cost. Its real cost replaces the reservation once its record is written
// (lua.WindowBudgets). So the fleet's concurrency is bounded by Money over the expected
// cost of an attempt, not over its byte cap: a 1 USD budget with a 50 MiB cap at
// 8.40 USD/GB (0.44 USD a cap) once let two attempts run at a time.
//
// The window's last money is granted as it is (what is left, when nothing else is
// reserved). Every attempt's byte cap is what its reservation buys (never above its own
// cap); one that reaches it (beyond Percentile × Margin: rare) is topped up in mid-attempt
// (windowByteCap: Redis, then its row in PostgreSQL) and goes on, or, the window spent,
// stops as budget_exceeded; it is charged what it cost when it settles. So the window
// passes its budget by at most one request written past the last cap and the byte of its
// answer that crossed it, never by what attempts in flight spend beyond their
// reservations.
//
// When Redis loses a window's total (restart without persistence, failover, flush) the
// next worker restores it from PostgreSQL, which records every finished attempt's cost
// (store.PG.WindowCost); the worker whose restore set the total reads PostgreSQL again
// and adds what was recorded in between (a settlement then found the window unknown and
// was dropped). Attempts in flight at that moment are the only ones that can then pass
// the budget: a top-up of one of them re-creates its reservation from what it holds and
// is granted what is left; before the restore, or with nothing left, it fails and the
// attempt stops at its cap, retried as internal — never failed as budget_exceeded on a
// total that did not know of it. A worker that
// dies holding a reservation is charged all of it — its top-ups included — when its
// delivery's deadline passes (the attempt may have spent that much; the proxy bills a
// killed worker's traffic too), and its attempt's row, written as lost when the job is
// taken over, carries the same cost (the start records the reservation on the job, each
// top-up raises it); a report from the worker, if it ever comes, replaces the charge by
// the attempt's real cost.
type WindowBudget struct {
	// Money per window, in micro-units of the providers' currency (all providers must
	// have a price, in one currency). Required.
	Money int64
	// OnSpent: WindowFail (default) or WindowDefer.
	OnSpent WindowAction
	// DeferFor is how long a deferred delivery waits. Defaults to DefaultWindowDeferFor.
	DeferFor time.Duration
	// Percentile of the kind's measured bytes per attempt that an attempt reserves, in
	// (0, 1]. Defaults to DefaultWindowPercentile.
	Percentile float64
	// Margin multiplies the percentile, >= 1. Defaults to DefaultWindowMargin.
	Margin float64
	// MinSamples is how many attempts of the kind must be known (measured, or read from
	// PostgreSQL at the first reservation) before their cost replaces the byte cap as the
	// reservation. Defaults to DefaultWindowMinSamples.
	MinSamples int
	// Concurrency is how many attempts of the kind the fleet runs at once (e.g. the
	// workers' asynq concurrency, summed): the first reservation of each window warns when
	// Money can not cover that many reservations at once. Defaults to 0: no warning.
	Concurrency int

	samples *byteSamples // the kind's measured bytes per attempt (validate makes it)
}

// Window reservation defaults.
const (
	DefaultWindowPercentile = 0.95
	DefaultWindowMargin     = 2.0
	DefaultWindowMinSamples = 20
	// windowSampleWindow is how many recent attempts per kind the estimate reads.
	windowSampleWindow = 500
)

// WithWindowBudget gives the kind a money budget per collection window, shared by the
// fleet (see WindowBudget).
func WithWindowBudget(b WindowBudget) KindOption { return func(k *kind) { k.window = &b } }

func (b *WindowBudget) validate() error {
	switch {
	case b.Money <= 0:
		return fmt.Errorf("WithWindowBudget: Money %d must be > 0 micro-units", b.Money)
	case b.OnSpent != WindowFail && b.OnSpent != WindowDefer:
		return fmt.Errorf("WithWindowBudget: OnSpent %d is neither WindowFail nor WindowDefer", int(b.OnSpent))
	case b.DeferFor < 0:
		return fmt.Errorf("WithWindowBudget: DeferFor %v is negative", b.DeferFor)
	}
	if b.DeferFor == 0 {
		b.DeferFor = DefaultWindowDeferFor
	}
	if b.Percentile == 0 {
		b.Percentile = DefaultWindowPercentile
	}
	if b.Margin == 0 {
		b.Margin = DefaultWindowMargin
	}
	if b.MinSamples == 0 {
		b.MinSamples = DefaultWindowMinSamples
	}
	switch {
	case b.Percentile <= 0 || b.Percentile > 1:
		return fmt.Errorf("WithWindowBudget: Percentile %v must be in (0, 1]", b.Percentile)
	case b.Margin < 1:
		return fmt.Errorf("WithWindowBudget: Margin %v must be >= 1", b.Margin)
	case b.MinSamples < 1:
		return fmt.Errorf("WithWindowBudget: MinSamples %d must be >= 1", b.MinSamples)
	case b.Concurrency < 0:
		return fmt.Errorf("WithWindowBudget: Concurrency %d is negative", b.Concurrency)
	}
	b.samples = &byteSamples{keep: windowSampleWindow}
	return nil
}

// byteSamples holds the bytes of a kind's recent attempts (a ring of at most keep).
type byteSamples struct {
	mu     sync.Mutex
	keep   int
	ring   []int64
	next   int
	sorted []int64 // ring sorted, nil when stale
	seeded bool    // PostgreSQL was asked (seedWindowSamples)
}

// seedDue reports, once, whether the samples should be seeded from PostgreSQL: fewer than
// min measured yet.
func (s *byteSamples) seedDue(min int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.seeded {
		return false
	}
	s.seeded = true
	return len(s.ring) < min
}

func (s *byteSamples) observe(bytes int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.ring) < s.keep {
		s.ring = append(s.ring, bytes)
	} else {
		s.ring[s.next] = bytes
		s.next = (s.next + 1) % s.keep
	}
	s.sorted = nil
}

// estimate is pct of the samples times margin (at least 1 byte), or false before min
// samples.
func (s *byteSamples) estimate(pct, margin float64, min int) (int64, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.ring) < min {
		return 0, false
	}
	if s.sorted == nil {
		s.sorted = slices.Clone(s.ring)
		slices.Sort(s.sorted)
	}
	i := int(math.Ceil(pct*float64(len(s.sorted)))) - 1
	return max(1, int64(math.Ceil(float64(s.sorted[max(i, 0)])*margin))), true
}

// windowWanted is what an attempt of k reserves at price: the measured estimate
// (WindowBudget), at most its byte cap, or the cap before enough attempts were measured.
// measured tells which.
func (k *kind) windowWanted(price sessions.Price, country string) (wanted, capCost int64, measured bool) {
	capBytes, _ := k.retry.attemptByteCap(price, country, 0)
	capCost = max(1, price.Cost(capBytes, country))
	b, ok := k.window.samples.estimate(k.window.Percentile, k.window.Margin, k.window.MinSamples)
	if !ok || b >= capBytes {
		return capCost, capCost, ok
	}
	return max(1, price.Cost(b, country)), capCost, true
}

// WindowSpentError is the failure of a job whose window's money budget is spent.
type WindowSpentError struct {
	Kind, Window string
	Spent, Money int64
	Currency     string
}

func (e *WindowSpentError) Error() string {
	return fmt.Sprintf("the money budget of window %q of kind %s is spent: %s of %s",
		e.Window, e.Kind, store.Cost{Micros: e.Spent, Currency: e.Currency}, store.Cost{Micros: e.Money, Currency: e.Currency})
}

// windowHoldSlack is how long after the delivery's deadline its reservation is held: the
// attempt's record and settlement run on a detached context that long. A reservation
// still held then lapses and is charged in full (lua.WindowBudgets.Reserve). A variable
// for tests only.
var windowHoldSlack = detachedTimeout

// windowHold is an attempt's reservation against its window's budget.
type windowHold struct {
	window string
	owner  string // the delivery's lease owner
	amount int64  // micro-units reserved, top-ups included
	wanted int64  // what the attempt asked for at its start: a top-up asks for as much again
	price  sessions.Price
	// until is when the reservation lapses if never settled (the reserve's hold, on this
	// worker's clock): a top-up that finds it lost with Redis's data re-creates it to then.
	until time.Time
	// The fields below are the running attempt's (written by its top-ups, serialised by the
	// session layer, read once its run returned).
	// capped: the window stopped the attempt — its top-up found the budget spent — not the
	// job's own budgets.
	capped bool
	// topUpErr: a top-up could not be asked (Redis down, or the window's total lost): the
	// attempt stopped at its cap, not because the window is spent.
	topUpErr error
	topUps   int // top-ups granted
}

// reserved is what the hold reserved, recorded with the attempt's start (store.
// AttemptStartParams.Reserved): zero without a window budget.
func (h *windowHold) reserved() store.Cost {
	if h == nil {
		return store.Cost{}
	}
	return store.Cost{Micros: h.amount, Currency: h.price.Currency}
}

// bytes is what the reservation buys, at most the attempt's own cap (ownCap): the whole of
// it once the reservation covers what ownCap costs (a reservation of the cap, converted
// back to bytes, may round a few bytes under it, and must not make the job's own budget
// look like the window's).
func (h *windowHold) bytes(ownCap int64, country string) int64 {
	if h.amount >= h.price.Cost(ownCap, country) {
		return ownCap
	}
	return min(ownCap, h.price.Bytes(h.amount, country))
}

// spentNote is the budget_exceeded note of an attempt the window stopped.
func (h *windowHold) spentNote(kindName string, money int64) string {
	return fmt.Sprintf("the money budget of window %q of kind %s: %s reserved of %s",
		h.window, kindName, store.Cost{Micros: h.amount, Currency: h.price.Currency}, store.Cost{Micros: money, Currency: h.price.Currency})
}

// windowByteCap is the attempt's byte cap under its reservation h: the bytes the
// reservation buys, never above the attempt's own cap (ownCap, which ownNote names), and
// the sessions.RunConfig.MoreBytes that tops the reservation up when the attempt reaches
// it (nil when the cap is the attempt's own). So the window's total passes its budget by
// at most the read that crossed the last cap, never by what attempts in flight spend
// beyond their reservations.
//
// A top-up asks Redis (lua.WindowBudgets.TopUp) for what the attempt moved beyond its
// reservation and as much again as it reserved at its start — or what is left of the
// window, at most what is left of the attempt's own cap — then raises the reservation the
// attempt's row records (store.PG.JobAttemptReserve), so that a worker killed after a
// top-up is charged the total, in Redis when the reservation lapses and on its lost row
// alike. A top-up of 0 stops the attempt as capped by the window (budget_exceeded, with
// the window's note); a top-up that fails (Redis down, the window's total lost) stops it
// too, retried as internal, since the window's budget can not be known to cover it. A
// reservation Redis lost with the window's total, which another worker restored since, is
// re-created from what the attempt holds (h.amount, until h.until) before the top-up is
// granted; with no room left for it the top-up fails the same way (lua.
// ErrReservationUnknown): retried, never budget_exceeded, since the restored total is
// PostgreSQL's and may count finished attempts twice.
func (r *Registry) windowByteCap(k *kind, h *windowHold, job tasks.Payload, token int64, ownCap int64, ownNote string, log *slog.Logger) (int64, string, func(context.Context, int64) (int64, string)) {
	country := job.Spec.Country
	if h == nil || h.bytes(ownCap, country) >= ownCap {
		return ownCap, ownNote, nil
	}
	ownCost := h.price.Cost(ownCap, country)
	more := func(ctx context.Context, moved int64) (int64, string) {
		if moved > ownCap || h.amount >= ownCost {
			return 0, ownNote // the attempt's own budget, not the window's
		}
		want := max(h.price.Cost(moved, country)-h.amount, 0) + h.wanted
		want = max(1, min(want, ownCost-h.amount))
		granted, err := r.windows.TopUp(ctx, k.name, h.window, h.owner, k.window.Money, want, h.amount, time.Until(h.until))
		if err != nil {
			h.topUpErr = err
			r.metrics.windowTopUps.WithLabelValues(k.name, "failed").Inc()
			log.WarnContext(ctx, "window reservation not topped up: the attempt stops at its cap", "window", h.window, "err", err)
			return 0, fmt.Sprintf("the money budget of window %q of kind %s: %s reserved, not topped up: %v",
				h.window, k.name, store.Cost{Micros: h.amount, Currency: h.price.Currency}, err)
		}
		if granted == 0 {
			h.capped = true
			r.metrics.windowTopUps.WithLabelValues(k.name, "refused").Inc()
			return 0, h.spentNote(k.name, k.window.Money)
		}
		h.amount += granted
		h.topUps++
		r.metrics.windowTopUps.WithLabelValues(k.name, "granted").Inc()
		// After Redis: a row that records more than Redis holds would charge a killed
		// attempt more there than in Redis. (A worker killed between the two is charged
		// the total by Redis, the reservation before this top-up on its row.)
		if _, err := r.cfg.Store.JobAttemptReserve(ctx, job.Key, token, h.reserved()); err != nil {
			log.WarnContext(ctx, "window top-up not recorded on the attempt; a lost attempt would be charged its earlier reservation in PostgreSQL",
				"window", h.window, "reserved", h.reserved().String(), "err", err)
		}
		capBytes := h.bytes(ownCap, country)
		if capBytes <= moved {
			// What was left of the window does not cover what the attempt moved already.
			h.capped = capBytes < ownCap
			if !h.capped {
				return 0, ownNote
			}
			r.metrics.windowTopUps.WithLabelValues(k.name, "refused").Inc()
			return 0, h.spentNote(k.name, k.window.Money)
		}
		if capBytes == ownCap {
			return capBytes, ownNote
		}
		return capBytes, ""
	}
	return h.bytes(ownCap, country), ownNote, more
}

// reserveWindow is step 1a for a kind with a window budget: reserve the most the attempt
// may cost. It returns the hold (nil for a kind without a window budget); or, the budget
// being spent, the failure to record (WindowFail); or an error to return to asynq as it
// is — a wait, a deferral (WindowDefer), or Redis or PostgreSQL unavailable.
func (r *Registry) reserveWindow(ctx context.Context, k *kind, job tasks.Payload, slot *providerSlot, owner string, log *slog.Logger) (*windowHold, *sessions.FetchError, error) {
	if k.window == nil {
		return nil, nil, nil
	}
	price := slot.prov.Price()
	r.seedWindowSamples(ctx, k, log)
	wanted, capCost, measured := k.windowWanted(price, job.Spec.Country)
	hold := time.Hour
	if d, ok := ctx.Deadline(); ok {
		hold = time.Until(d) + windowHoldSlack // the settlement may come that late
	}
	window := job.Spec.Window
	g, err := r.windows.Reserve(ctx, k.name, window, owner, k.window.Money, wanted, hold)
	if errors.Is(err, lua.ErrBudgetUnknown) {
		if err = r.restoreWindow(ctx, k, window, price.Currency, log); err != nil {
			return nil, nil, r.unavailable(k, err)
		}
		g, err = r.windows.Reserve(ctx, k.name, window, owner, k.window.Money, wanted, hold)
	}
	if err != nil {
		// The script may have run and its reply been lost: give back what it may hold
		// (nothing, if it did not run), so the window need not wait for it to lapse.
		r.settleWindow(ctx, k, &windowHold{window: window, owner: owner}, &workResult{}, log)
		return nil, nil, r.unavailable(k, err)
	}
	r.windowCoverage(ctx, k, window, wanted, capCost, measured, price.Currency, log)
	switch g.Admission {
	case lua.Granted:
		return &windowHold{window: window, owner: owner, amount: g.Amount, wanted: wanted, price: price, until: time.Now().Add(hold)}, nil, nil
	case lua.Wait:
		r.metrics.windowStops.WithLabelValues(k.name, "waited").Inc()
		return nil, nil, &retryError{delay: time.Second + time.Duration(r.cfg.Rand()*float64(windowWaitMax)), counted: false,
			err: fmt.Errorf("the rest of the money budget of window %q is reserved by attempts in flight", window)}
	}
	spent := &WindowSpentError{Kind: k.name, Window: window, Spent: g.Spent, Money: k.window.Money, Currency: price.Currency}
	r.windowSpentOnce(ctx, k, spent, log)
	if k.window.OnSpent == WindowDefer {
		r.metrics.windowStops.WithLabelValues(k.name, "deferred").Inc()
		return nil, nil, &retryError{delay: k.window.DeferFor + time.Duration(r.cfg.Rand()*float64(windowWaitMax)), counted: false, err: spent}
	}
	r.metrics.windowStops.WithLabelValues(k.name, "failed").Inc()
	return nil, &sessions.FetchError{Category: tasks.CategoryBudgetExceeded, Err: spent}, nil
}

// restoreWindow gives Redis the window's total from PostgreSQL's record of what its
// attempts cost (Redis lost it, or it expired unused). The worker whose restore set the
// total reads PostgreSQL again and adds what was recorded since its first read: an
// attempt that recorded its cost after that read and settled before the restore found
// the window unknown, and its settlement was dropped — its cost would be in neither total,
// and the window would pass its budget by it. (One recorded in between that settles after
// the restore is counted twice: the window stops early by that much, never late.) A
// failure of the second read leaves the total as restored.
func (r *Registry) restoreWindow(ctx context.Context, k *kind, window, currency string, log *slog.Logger) error {
	read, err := r.cfg.Store.WindowCost(ctx, k.name, window, currency)
	if err != nil {
		return err
	}
	if r.beforeWindowRestore != nil {
		r.beforeWindowRestore()
	}
	spent, first, err := r.windows.Restore(ctx, k.name, window, read)
	if err != nil {
		return err
	}
	r.metrics.windowRestores.WithLabelValues(k.name).Inc()
	if first {
		again, err := r.cfg.Store.WindowCost(ctx, k.name, window, currency)
		switch {
		case err != nil:
			log.WarnContext(ctx, "window money budget restored without its catch-up: a settlement dropped while it was read is not counted",
				"window", window, "err", err)
		case again > read:
			if n, ok, err := r.windows.CatchUp(ctx, k.name, window, again-read); err != nil {
				log.WarnContext(ctx, "window money budget restored without its catch-up", "window", window, "err", err)
			} else if ok {
				spent = n
			}
		}
	}
	log.InfoContext(ctx, "window money budget restored from PostgreSQL", "window", window,
		"spent", store.Cost{Micros: spent, Currency: currency}.String(), "first", first)
	return nil
}

// seedWindowSamples fills the kind's measurements from PostgreSQL's record of its recent
// attempts, once per process, when fewer than MinSamples were measured here: a worker that
// starts (or restarts) reserves what the kind's attempts cost, not their byte caps. A
// failure leaves the measurements to this process's attempts.
func (r *Registry) seedWindowSamples(ctx context.Context, k *kind, log *slog.Logger) {
	s := k.window.samples
	if !s.seedDue(k.window.MinSamples) {
		return
	}
	recent, err := r.cfg.Store.AttemptBytesRecent(ctx, k.name, windowSampleWindow)
	if err != nil {
		log.WarnContext(ctx, "the kind's recent attempts not read: window reservations are byte caps until measured", "err", err)
		return
	}
	for i := len(recent) - 1; i >= 0; i-- { // oldest first: the newest are kept longest
		s.observe(recent[i])
	}
}

// windowCoverage logs, once per kind × window and process, how many reservations the
// window's budget covers at once, and warns when that is below WindowBudget.Concurrency:
// the budget, not the workers, then bounds how many attempts run.
func (r *Registry) windowCoverage(ctx context.Context, k *kind, window string, wanted, capCost int64, measured bool, currency string, log *slog.Logger) {
	phase := "cap"
	if measured {
		phase = "measured"
	}
	if !r.windowLogged.first("coverage\x00" + phase + "\x00" + k.name + "\x00" + window) {
		return
	}
	covers := k.window.Money / wanted
	attrs := []any{"window", window, "reservation", store.Cost{Micros: wanted, Currency: currency}.String(),
		"byte_cap_cost", store.Cost{Micros: capCost, Currency: currency}.String(),
		"budget", store.Cost{Micros: k.window.Money, Currency: currency}.String(), "covers", covers,
		"concurrency", k.window.Concurrency, "measured", measured}
	switch {
	case k.window.Concurrency > 0 && covers < int64(k.window.Concurrency) && !measured:
		log.WarnContext(ctx, "window money budget covers fewer attempts at once than the concurrency: "+
			"until the kind's cost per attempt is measured each attempt reserves its byte cap", attrs...)
	case k.window.Concurrency > 0 && covers < int64(k.window.Concurrency):
		log.WarnContext(ctx, "window money budget covers fewer attempts at once than the concurrency, at the measured cost per attempt", attrs...)
	default:
		log.InfoContext(ctx, "window money budget reservations", attrs...)
	}
}

// settleWindow is the last step for a kind with a window budget: the attempt's
// reservation is replaced by its cost, once its record is written, and its bytes join the
// kind's measurements. A reservation whose attempt never started settles at 0. A failure
// here leaves the reservation to lapse at its hold, charged in full: the window runs below
// its budget meanwhile, never above.
func (r *Registry) settleWindow(ctx context.Context, k *kind, h *windowHold, w *workResult, log *slog.Logger) {
	if h == nil {
		return
	}
	if w.unit.Session != nil {
		k.window.samples.observe(w.unit.Bytes)
	}
	sctx, cancel := detached(ctx)
	defer cancel()
	if _, err := r.windows.Settle(sctx, k.name, h.window, h.owner, w.cost.Micros); err != nil {
		log.WarnContext(ctx, "window money budget not settled; the reservation lapses later, charged in full", "window", h.window, "err", err)
	}
}

// windowSpentOnce logs, once per kind × window and process, that the window's budget is
// spent: one line, however many deliveries meet it.
func (r *Registry) windowSpentOnce(ctx context.Context, k *kind, e *WindowSpentError, log *slog.Logger) {
	if !r.windowLogged.first(k.name + "\x00" + e.Window) {
		return
	}
	log.WarnContext(ctx, "window money budget spent: no new attempt starts for it", "window", e.Window,
		"spent", store.Cost{Micros: e.Spent, Currency: e.Currency}.String(),
		"budget", store.Cost{Micros: e.Money, Currency: e.Currency}.String(), "action", k.window.OnSpent.String())
}

// onceSet remembers keys, at most onceSetMax (then it starts over: a window that comes
// back after thousands of others is logged again).
type onceSet struct {
	mu   sync.Mutex
	seen map[string]struct{}
}

const onceSetMax = 4096

func (s *onceSet) first(key string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.seen[key]; ok {
		return false
	}
	if s.seen == nil || len(s.seen) >= onceSetMax {
		s.seen = map[string]struct{}{}
	}
	s.seen[key] = struct{}{}
	return true
}
