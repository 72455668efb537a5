package lua

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

var (
	//go:embed winbudget.lua
	winBudgetSrc    string
	winBudgetScript = redis.NewScript(winBudgetSrc)
)

// WindowBudgetKeep is how long a window's budget hash lives unused. After that (or after
// Redis lost it) the next reservation finds it unknown and the caller restores it from
// PostgreSQL (WindowBudgets.Restore): a season of windows leaves no key behind.
const WindowBudgetKeep = 24 * time.Hour

// ErrBudgetUnknown: Redis holds no spent amount for the window (never set, expired, or
// lost with Redis's data). Restore it from PostgreSQL, then reserve again.
var ErrBudgetUnknown = errors.New("lua: window budget unknown to Redis: restore it from PostgreSQL")

// Admission is what a reservation against a window's budget got.
type Admission int

// Admissions.
const (
	// Granted: Grant.Amount micro-units are reserved for the attempt.
	Granted Admission = iota + 1
	// Wait: the rest of the budget is reserved by attempts in flight; try again shortly
	// (their settlements may give some back).
	Wait
	// Spent: nothing is left of the budget.
	Spent
)

func (a Admission) String() string {
	switch a {
	case Granted:
		return "granted"
	case Wait:
		return "wait"
	case Spent:
		return "spent"
	}
	return fmt.Sprintf("Admission(%d)", int(a))
}

// Grant is the answer to a reservation.
type Grant struct {
	Admission Admission
	Amount    int64 // micro-units reserved (Granted)
	Spent     int64 // what the window's settled attempts cost, before this reservation
	Reserved  int64 // what attempts in flight hold, before this reservation
}

// WindowBudgets holds the fleet-wide money budgets of collection windows in Redis
// (winbudget.lua): one hash per kind × window, one round trip per reservation and per
// settlement. Amounts are integer micro-units of the price's currency.
type WindowBudgets struct {
	rdb  redis.Cmdable
	keys Keys
}

// NewWindowBudgets returns WindowBudgets on rdb with keys under prefix.
func NewWindowBudgets(rdb redis.Cmdable, prefix string) (*WindowBudgets, error) {
	keys, err := NewKeys(prefix)
	if err != nil {
		return nil, err
	}
	return &WindowBudgets{rdb: rdb, keys: keys}, nil
}

// Reserve asks for wanted micro-units of the window's budget for the attempt of owner
// (unique per delivery), held at most hold if it is never settled (its worker died): then
// it lapses and is charged in full, the most its attempt may have cost. It
// returns ErrBudgetUnknown when Redis has no spent amount for the window.
func (b *WindowBudgets) Reserve(ctx context.Context, kind, window, owner string, budget, wanted int64, hold time.Duration) (Grant, error) {
	switch {
	case budget <= 0 || wanted <= 0:
		return Grant{}, fmt.Errorf("lua: window budget %s/%s: budget %d and wanted %d must be positive", kind, window, budget, wanted)
	case owner == "":
		return Grant{}, fmt.Errorf("lua: window budget %s/%s: empty owner", kind, window)
	}
	reply, err := winBudgetScript.Run(ctx, b.rdb, []string{b.keys.WindowBudget(kind, window)},
		"reserve", budget, wanted, owner, max(hold, time.Millisecond).Milliseconds(), WindowBudgetKeep.Milliseconds()).Int64Slice()
	if err != nil {
		return Grant{}, fmt.Errorf("lua: window budget %s/%s: reserve: %w", kind, window, err)
	}
	if len(reply) != 4 {
		return Grant{}, fmt.Errorf("lua: window budget %s/%s: reserve: unexpected reply %v", kind, window, reply)
	}
	g := Grant{Amount: reply[1], Spent: reply[2], Reserved: reply[3]}
	switch reply[0] {
	case -1:
		return Grant{}, ErrBudgetUnknown
	case 0:
		g.Admission = Spent
	case 1:
		g.Admission = Granted
	case 2:
		g.Admission = Wait
	default:
		return Grant{}, fmt.Errorf("lua: window budget %s/%s: reserve: unexpected reply %v", kind, window, reply)
	}
	return g, nil
}

// Settle replaces the reservation of owner by what its attempt cost (0 for an attempt
// that never started). A reservation that lapsed before its settlement was charged in full
// then (winbudget.lua): the settlement replaces that charge by the cost. Call it after the
// attempt's cost is in PostgreSQL: when Redis lost the window meanwhile, the settlement is
// dropped (reported false) and the restore counts the cost from there (the restorer's
// catch-up, if the restore read PostgreSQL before the cost was recorded: CatchUp). (A
// restore that came between the cost's record and its settlement counts it twice: the
// window then stops early by that much, never late.)
func (b *WindowBudgets) Settle(ctx context.Context, kind, window, owner string, cost int64) (bool, error) {
	if cost < 0 {
		return false, fmt.Errorf("lua: window budget %s/%s: settle: negative cost %d", kind, window, cost)
	}
	n, err := winBudgetScript.Run(ctx, b.rdb, []string{b.keys.WindowBudget(kind, window)},
		"settle", owner, cost, WindowBudgetKeep.Milliseconds()).Int64()
	if err != nil {
		return false, fmt.Errorf("lua: window budget %s/%s: settle: %w", kind, window, err)
	}
	return n >= 0, nil
}

// ErrReservationUnknown: Redis knows the window's spent amount but not the attempt's
// reservation — Redis lost the window while the attempt ran and a restore from PostgreSQL
// came since — and the window, the reservation counted again, has no room for the top-up.
// Not a spent window: the attempt is retried (internal), and the next reservation decides.
var ErrReservationUnknown = errors.New("lua: window reservation unknown to Redis (lost with the window's total, which was restored since)")

// TopUp asks for more micro-units for the attempt of owner, whose cost outgrew its
// reservation while it runs: it gets more, or what is left of the budget (0: nothing is
// left), added to its reservation (to its charge, if the reservation lapsed meanwhile:
// winbudget.lua). held is what the attempt holds (its reservation with its top-ups) and
// hold how long until it lapses (as Reserve's): a reservation Redis lost with the window's
// total, restored since from PostgreSQL, is re-created from them, and the top-up is asked
// on top of it; with no room left it returns ErrReservationUnknown (retry: the window is
// not known to be spent). It returns ErrBudgetUnknown when Redis has no spent amount for
// the window: Redis lost it while the attempt ran, and the restore, from PostgreSQL, can
// not know what the attempt spends.
func (b *WindowBudgets) TopUp(ctx context.Context, kind, window, owner string, budget, more, held int64, hold time.Duration) (int64, error) {
	switch {
	case budget <= 0 || more <= 0:
		return 0, fmt.Errorf("lua: window budget %s/%s: top-up: budget %d and more %d must be positive", kind, window, budget, more)
	case held <= 0:
		return 0, fmt.Errorf("lua: window budget %s/%s: top-up: held %d must be positive", kind, window, held)
	case owner == "":
		return 0, fmt.Errorf("lua: window budget %s/%s: top-up: empty owner", kind, window)
	}
	reply, err := winBudgetScript.Run(ctx, b.rdb, []string{b.keys.WindowBudget(kind, window)},
		"topup", owner, budget, more, WindowBudgetKeep.Milliseconds(), held, max(hold, time.Millisecond).Milliseconds()).Int64Slice()
	if err != nil {
		return 0, fmt.Errorf("lua: window budget %s/%s: top-up: %w", kind, window, err)
	}
	if len(reply) != 3 || reply[0] < -2 {
		return 0, fmt.Errorf("lua: window budget %s/%s: top-up: unexpected reply %v", kind, window, reply)
	}
	switch reply[0] {
	case -1:
		return 0, ErrBudgetUnknown
	case -2:
		return 0, ErrReservationUnknown
	}
	return reply[0], nil
}

// Restore sets the window's spent amount (from PostgreSQL: store.PG.WindowCost) unless
// another worker restored it first, and returns the amount Redis holds and whether this
// call set it. The caller that set it reads PostgreSQL again and adds what was recorded
// since its first read (CatchUp): a settlement that came between that read and the
// restore found the window unknown and was dropped, its cost in neither total.
func (b *WindowBudgets) Restore(ctx context.Context, kind, window string, spent int64) (int64, bool, error) {
	if spent < 0 {
		return 0, false, fmt.Errorf("lua: window budget %s/%s: restore: negative amount %d", kind, window, spent)
	}
	reply, err := winBudgetScript.Run(ctx, b.rdb, []string{b.keys.WindowBudget(kind, window)},
		"restore", spent, WindowBudgetKeep.Milliseconds()).Int64Slice()
	if err != nil {
		return 0, false, fmt.Errorf("lua: window budget %s/%s: restore: %w", kind, window, err)
	}
	if len(reply) != 2 {
		return 0, false, fmt.Errorf("lua: window budget %s/%s: restore: unexpected reply %v", kind, window, reply)
	}
	return reply[0], reply[1] == 1, nil
}

// CatchUp adds amount to the window's spent amount, and returns the total (false: Redis
// has no spent amount for the window, nothing was added): the restorer's second read of
// PostgreSQL, less its first, so that a settlement dropped between the two (it found the
// window unknown) is counted. One that was recorded in between but settled after the
// restore is then counted twice: the window stops early by that much, never late.
func (b *WindowBudgets) CatchUp(ctx context.Context, kind, window string, amount int64) (int64, bool, error) {
	if amount < 0 {
		return 0, false, fmt.Errorf("lua: window budget %s/%s: catch-up: negative amount %d", kind, window, amount)
	}
	n, err := winBudgetScript.Run(ctx, b.rdb, []string{b.keys.WindowBudget(kind, window)},
		"add", amount, WindowBudgetKeep.Milliseconds()).Int64()
	if err != nil {
		return 0, false, fmt.Errorf("lua: window budget %s/%s: catch-up: %w", kind, window, err)
	}
	return n, n >= 0, nil
}

// Spent reads what the window's attempts cost — settled ones, and lapsed reservations
// charged in full — and what attempts in flight reserve, without changing anything (a
// reservation past its hold that no reservation has found yet counts as reserved). ok is
// false when Redis holds nothing.
func (b *WindowBudgets) Spent(ctx context.Context, kind, window string) (spent, reserved int64, ok bool, err error) {
	all, err := b.rdb.HGetAll(ctx, b.keys.WindowBudget(kind, window)).Result()
	if err != nil {
		return 0, 0, false, fmt.Errorf("lua: window budget %s/%s: %w", kind, window, err)
	}
	s, ok := all["spent"]
	if !ok {
		return 0, 0, false, nil
	}
	if _, err := fmt.Sscan(s, &spent); err != nil {
		return 0, 0, false, fmt.Errorf("lua: window budget %s/%s: spent %q: %w", kind, window, s, err)
	}
	for f, v := range all {
		if len(f) > 2 && f[:2] == "r:" {
			var amount, deadline int64
			if _, err := fmt.Sscan(v, &amount, &deadline); err == nil {
				reserved += amount
			}
		}
	}
	return spent, reserved, true, nil
}
