package lua_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/testutil"
)

func TestWindowBudgetScript(t *testing.T) {
	ctx := context.Background()
	c, mr, now := frozenMini(t)
	b, err := lua.NewWindowBudgets(c, "mini:")
	require.NoError(t, err)
	const kind, window = "catalog", "2026-04-23"

	// Unknown until restored.
	_, err = b.Reserve(ctx, kind, window, "a", 1000, 300, time.Minute)
	require.ErrorIs(t, err, lua.ErrBudgetUnknown)
	ok, err := b.Settle(ctx, kind, window, "a", 10)
	require.NoError(t, err)
	assert.False(t, ok, "a settlement of an unknown window is dropped (PostgreSQL counts it)")
	spent, first, err := b.Restore(ctx, kind, window, 100)
	require.NoError(t, err)
	assert.EqualValues(t, 100, spent)
	assert.True(t, first)
	spent, first, err = b.Restore(ctx, kind, window, 5)
	require.NoError(t, err)
	assert.EqualValues(t, 100, spent, "the first restore wins")
	assert.False(t, first)
	// The first restorer's catch-up: what PostgreSQL recorded after its read.
	spent, ok, err = b.CatchUp(ctx, kind, window, 0)
	require.NoError(t, err)
	assert.True(t, ok)
	assert.EqualValues(t, 100, spent)
	_, ok, err = b.CatchUp(ctx, kind, "unknown", 7)
	require.NoError(t, err)
	assert.False(t, ok, "nothing to catch up on an unknown window")
	_, _, err = b.CatchUp(ctx, kind, window, -1)
	require.ErrorContains(t, err, "negative amount -1")

	// 900 left: three reservations of 300 fill it; the fourth waits.
	for i, owner := range []string{"a", "b", "c"} {
		g, err := b.Reserve(ctx, kind, window, owner, 1000, 300, time.Minute)
		require.NoError(t, err)
		assert.Equal(t, lua.Grant{Admission: lua.Granted, Amount: 300, Spent: 100, Reserved: int64(300 * i)}, g)
	}
	g, err := b.Reserve(ctx, kind, window, "d", 1000, 300, time.Minute)
	require.NoError(t, err)
	assert.Equal(t, lua.Wait, g.Admission)
	// a cost 50: 250 back, but 300 are wanted and b, c still hold theirs: wait.
	ok, err = b.Settle(ctx, kind, window, "a", 50)
	require.NoError(t, err)
	assert.True(t, ok)
	g, err = b.Reserve(ctx, kind, window, "d", 1000, 300, time.Minute)
	require.NoError(t, err)
	assert.Equal(t, lua.Grant{Admission: lua.Wait, Spent: 150, Reserved: 600}, g)
	g, err = b.Reserve(ctx, kind, window, "d", 1000, 250, time.Minute)
	require.NoError(t, err)
	assert.Equal(t, lua.Granted, g.Admission, "what fits is granted")
	// b's worker dies: its reservation lapses after its hold.
	_, err = b.Settle(ctx, kind, window, "c", 300)
	require.NoError(t, err)
	_, err = b.Settle(ctx, kind, window, "d", 250)
	require.NoError(t, err)
	g, err = b.Reserve(ctx, kind, window, "e", 1000, 400, time.Minute)
	require.NoError(t, err)
	assert.Equal(t, lua.Grant{Admission: lua.Wait, Spent: 700, Reserved: 300}, g, "b still holds 300")
	mr.SetTime(now.Add(time.Minute + time.Millisecond))
	g, err = b.Reserve(ctx, kind, window, "e", 1000, 400, time.Minute)
	require.NoError(t, err)
	assert.Equal(t, lua.Grant{Admission: lua.Spent, Spent: 1000, Reserved: 0}, g,
		"b lapsed and is charged its 300 in full: the proxy bills a killed worker's traffic too")
	s, r, ok, err := b.Spent(ctx, kind, window)
	require.NoError(t, err)
	assert.True(t, ok)
	assert.EqualValues(t, 1000, s)
	assert.Zero(t, r)
	// b's worker was not dead after all: its report replaces the charge by its cost.
	ok, err = b.Settle(ctx, kind, window, "b", 120)
	require.NoError(t, err)
	assert.True(t, ok)
	s, _, _, err = b.Spent(ctx, kind, window)
	require.NoError(t, err)
	assert.EqualValues(t, 820, s, "1000 - 300 charged + 120 cost")
	g, err = b.Reserve(ctx, kind, window, "e", 1000, 400, time.Minute)
	require.NoError(t, err)
	assert.Equal(t, lua.Grant{Admission: lua.Granted, Amount: 180, Spent: 820, Reserved: 0}, g,
		"nothing else reserved: the last attempt gets what is left")
	_, err = b.Settle(ctx, kind, window, "e", 180)
	require.NoError(t, err)
	g, err = b.Reserve(ctx, kind, window, "f", 1000, 1, time.Minute)
	require.NoError(t, err)
	assert.Equal(t, lua.Grant{Admission: lua.Spent, Spent: 1000}, g)
	s, r, ok, err = b.Spent(ctx, kind, window)
	require.NoError(t, err)
	assert.True(t, ok)
	assert.EqualValues(t, 1000, s)
	assert.Zero(t, r)

	// The key expires unused, and is unknown again.
	mr.FastForward(lua.WindowBudgetKeep + time.Second)
	_, err = b.Reserve(ctx, kind, window, "g", 1000, 1, time.Minute)
	require.ErrorIs(t, err, lua.ErrBudgetUnknown)

	// Bad arguments are named.
	_, err = b.Reserve(ctx, kind, window, "g", 0, 1, time.Minute)
	require.ErrorContains(t, err, "budget 0 and wanted 1 must be positive")
	_, err = b.Settle(ctx, kind, window, "g", -1)
	require.ErrorContains(t, err, "negative cost -1")
}

// TestWindowBudgetConcurrent: 16 goroutines on a real Redis reserve, spend part of their
// grant, and settle until the budget is spent: what was settled never passes the budget,
// and ends within one grant of it.
func TestWindowBudgetConcurrent(t *testing.T) {
	ctx := context.Background()
	ns := testutil.Redis(t)
	b, err := lua.NewWindowBudgets(ns.Client, ns.Prefix)
	require.NoError(t, err)
	const kind, window, budget, want = "k", "w", 100_000, 700
	_, _, err = b.Restore(ctx, kind, window, 0)
	require.NoError(t, err)
	var total atomic.Int64
	var wg sync.WaitGroup
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				owner := fmt.Sprintf("g%d-%d", g, i)
				gr, err := b.Reserve(ctx, kind, window, owner, budget, want, time.Minute)
				if !assert.NoError(t, err) {
					return
				}
				switch gr.Admission {
				case lua.Spent:
					return
				case lua.Wait:
					continue
				}
				cost := gr.Amount - int64(i%3)*100 // an attempt spends at most what it reserved
				cost = max(cost, 0)
				total.Add(cost)
				_, err = b.Settle(ctx, kind, window, owner, cost)
				if !assert.NoError(t, err) {
					return
				}
			}
		}()
	}
	wg.Wait()
	spent, reserved, ok, err := b.Spent(ctx, kind, window)
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, total.Load(), spent)
	assert.Zero(t, reserved)
	assert.LessOrEqual(t, spent, int64(budget))
	assert.GreaterOrEqual(t, spent, int64(budget), "Spent is answered only once spent >= budget")
}

// TestWindowBudgetLapse: an attempt whose worker was killed never settles; its reservation
// lapses at its hold and is charged in full (the proxy billed its traffic all the same),
// kept as l:<owner> so that a settlement that comes after all replaces the charge by the
// real cost, and forgotten after keep. A top-up grows a live reservation, or the charge of
// a lapsed one, by what is left of the budget. On miniredis (server time moved by hand) and
// on a real Redis (a hold of 1 ms, waited for by reading the server's TIME).
func TestWindowBudgetLapse(t *testing.T) {
	ctx := context.Background()
	type backend struct {
		b      *lua.WindowBudgets
		hold   time.Duration
		lapse  func() // the server's clock passes every hold given so far
		expire func() // keep passes (miniredis only)
	}
	backends := map[string]func(t *testing.T) backend{
		"miniredis": func(t *testing.T) backend {
			c, mr, now := frozenMini(t)
			b, err := lua.NewWindowBudgets(c, "mini:")
			require.NoError(t, err)
			return backend{b: b, hold: time.Minute, lapse: func() {
				now = now.Add(time.Minute + time.Millisecond)
				mr.SetTime(now)
			}, expire: func() {
				now = now.Add(lua.WindowBudgetKeep)
				mr.SetTime(now)
			}}
		},
		"redis": func(t *testing.T) backend {
			ns := testutil.Redis(t)
			b, err := lua.NewWindowBudgets(ns.Client, ns.Prefix)
			require.NoError(t, err)
			return backend{b: b, hold: time.Millisecond, lapse: func() {
				start, err := ns.Client.Time(ctx).Result()
				require.NoError(t, err)
				for {
					now, err := ns.Client.Time(ctx).Result()
					require.NoError(t, err)
					if now.Sub(start) > 2*time.Millisecond {
						return
					}
				}
			}}
		},
	}
	for name, setup := range backends {
		t.Run(name, func(t *testing.T) {
			be := setup(t)
			b := be.b
			const kind, window, budget = "k", "w", 100
			_, _, err := b.Restore(ctx, kind, window, 0)
			require.NoError(t, err)
			spent := func() (int64, int64) {
				s, r, ok, err := b.Spent(ctx, kind, window)
				require.NoError(t, err)
				require.True(t, ok)
				return s, r
			}

			// Three attempts in turn are each granted the whole budget, and killed.
			killed := 0
			for _, owner := range []string{"a", "b", "c"} {
				g, err := b.Reserve(ctx, kind, window, owner, budget, budget, be.hold)
				require.NoError(t, err)
				if g.Admission != lua.Granted {
					assert.Equal(t, lua.Grant{Admission: lua.Spent, Spent: budget}, g, "the killed attempt's 100 are spent")
					continue
				}
				killed++
				be.lapse()
			}
			assert.Equal(t, 1, killed, "one attempt killed holding the whole budget spends it: no second one is granted")
			s, r := spent()
			assert.EqualValues(t, budget, s, "charged in full")
			assert.Zero(t, r)

			// a's worker reports after all: 30. The charge becomes the cost.
			ok, err := b.Settle(ctx, kind, window, "a", 30)
			require.NoError(t, err)
			assert.True(t, ok)
			s, _ = spent()
			assert.EqualValues(t, 30, s)

			// Top-ups: d reserves 50 and outgrows it.
			g, err := b.Reserve(ctx, kind, window, "d", budget, 50, time.Hour)
			require.NoError(t, err)
			require.Equal(t, lua.Granted, g.Admission)
			more, err := b.TopUp(ctx, kind, window, "d", budget, 10, 50, time.Hour)
			require.NoError(t, err)
			assert.EqualValues(t, 10, more)
			more, err = b.TopUp(ctx, kind, window, "d", budget, 50, 60, time.Hour)
			require.NoError(t, err)
			assert.EqualValues(t, 10, more, "what is left: 100 - 30 spent - 60 reserved")
			more, err = b.TopUp(ctx, kind, window, "d", budget, 5, 70, time.Hour)
			require.NoError(t, err)
			assert.Zero(t, more, "nothing left")
			s, r = spent()
			assert.EqualValues(t, 30, s)
			assert.EqualValues(t, 70, r, "d holds 50 + 10 + 10")
			// An owner whose reservation Redis does not know (lost with a restored total) has
			// it re-created; with no room left for more, the top-up is not answered as spent.
			_, err = b.TopUp(ctx, kind, window, "nobody", budget, 5, 5, time.Hour)
			require.ErrorIs(t, err, lua.ErrReservationUnknown)
			_, r = spent()
			assert.EqualValues(t, 75, r, "nobody's 5 re-created")
			ok, err = b.Settle(ctx, kind, window, "nobody", 0)
			require.NoError(t, err)
			assert.True(t, ok)
			ok, err = b.Settle(ctx, kind, window, "d", 65)
			require.NoError(t, err)
			assert.True(t, ok)
			s, r = spent()
			assert.EqualValues(t, 95, s)
			assert.Zero(t, r)

			// A lapsed reservation's top-up is charged at once.
			g, err = b.Reserve(ctx, kind, window, "e", budget, 2, be.hold)
			require.NoError(t, err)
			require.Equal(t, lua.Grant{Admission: lua.Granted, Amount: 2, Spent: 95}, g)
			be.lapse()
			g, err = b.Reserve(ctx, kind, window, "f", budget, 1, time.Hour) // finds e lapsed
			require.NoError(t, err)
			require.Equal(t, lua.Grant{Admission: lua.Granted, Amount: 1, Spent: 97}, g)
			more, err = b.TopUp(ctx, kind, window, "e", budget, 1, 2, time.Hour)
			require.NoError(t, err)
			assert.EqualValues(t, 1, more)
			s, r = spent()
			assert.EqualValues(t, 98, s, "e's 2, charged when it lapsed, and its top-up of 1")
			assert.EqualValues(t, 1, r)
			ok, err = b.Settle(ctx, kind, window, "e", 3)
			require.NoError(t, err)
			assert.True(t, ok)
			s, _ = spent()
			assert.EqualValues(t, 98, s, "its cost, 3, replaces the 3 charged")
			_, err = b.Settle(ctx, kind, window, "f", 0)
			require.NoError(t, err)
			s, _ = spent()
			require.EqualValues(t, 98, s, "f cost nothing")

			if be.expire != nil {
				// A settlement later than keep no longer finds the charge: it is added.
				g, err = b.Reserve(ctx, kind, window, "g", 1000, 1, be.hold)
				require.NoError(t, err)
				require.Equal(t, lua.Granted, g.Admission)
				be.lapse()
				_, err = b.Reserve(ctx, kind, window, "h", 1000, 1, lua.WindowBudgetKeep*2) // g lapses: 99
				require.NoError(t, err)
				be.expire()
				_, err = b.Reserve(ctx, kind, window, "i", 1000, 1, lua.WindowBudgetKeep*2) // l:g dropped
				require.NoError(t, err)
				ok, err = b.Settle(ctx, kind, window, "g", 1)
				require.NoError(t, err)
				assert.True(t, ok)
				s, _ = spent()
				assert.EqualValues(t, 100, s, "99 + 1: the charge stays, the late cost is added")
			}

			_, err = b.TopUp(ctx, kind, "unknown", "d", budget, 1, 1, time.Hour)
			require.ErrorIs(t, err, lua.ErrBudgetUnknown)
			_, err = b.TopUp(ctx, kind, window, "d", budget, 0, 1, time.Hour)
			require.ErrorContains(t, err, "budget 100 and more 0 must be positive")
			_, err = b.TopUp(ctx, kind, window, "d", budget, 1, 0, time.Hour)
			require.ErrorContains(t, err, "held 0 must be positive")
		})
	}
}

// TestWindowBudgetTopUpAfterRestore: Redis loses the window while a holds a reservation of
// 10; before a restore a's top-up is unknown (ErrBudgetUnknown). After another worker's
// restore (PostgreSQL's 20, which knows nothing of a), a's top-up re-creates its
// reservation from what it holds and is granted on top of it; its settlement replaces
// both by its cost. b's re-created reservation leaves no room: ErrReservationUnknown, not
// a refusal, and the reservation is held, lapsing at the hold b gave (charged in full).
// On the old script the top-up answered 0 ("owner holds nothing"), as if the window were
// spent.
func TestWindowBudgetTopUpAfterRestore(t *testing.T) {
	ctx := context.Background()
	c, mr, now := frozenMini(t)
	b, err := lua.NewWindowBudgets(c, "mini:")
	require.NoError(t, err)
	const kind, window, budget = "catalog", "2026-04-23", 100
	_, _, err = b.Restore(ctx, kind, window, 0)
	require.NoError(t, err)
	g, err := b.Reserve(ctx, kind, window, "a", budget, 10, time.Hour)
	require.NoError(t, err)
	require.Equal(t, lua.Granted, g.Admission)
	mr.Del("mini:{budget:catalog/2026-04-23}") // Redis lost it
	_, err = b.TopUp(ctx, kind, window, "a", budget, 5, 10, time.Hour)
	require.ErrorIs(t, err, lua.ErrBudgetUnknown, "before the restore")
	_, _, err = b.Restore(ctx, kind, window, 20)
	require.NoError(t, err)
	more, err := b.TopUp(ctx, kind, window, "a", budget, 5, 10, time.Hour)
	require.NoError(t, err)
	assert.EqualValues(t, 5, more, "granted on top of the re-created reservation")
	s, r, _, err := b.Spent(ctx, kind, window)
	require.NoError(t, err)
	assert.EqualValues(t, 20, s)
	assert.EqualValues(t, 15, r, "a's 10 re-created and its 5")
	ok, err := b.Settle(ctx, kind, window, "a", 12)
	require.NoError(t, err)
	assert.True(t, ok)
	s, r, _, err = b.Spent(ctx, kind, window)
	require.NoError(t, err)
	assert.EqualValues(t, 32, s)
	assert.Zero(t, r)

	// b holds 60 when Redis is lost again; the restore says 50: no room beyond b's 60.
	g, err = b.Reserve(ctx, kind, window, "b", budget, 60, time.Hour)
	require.NoError(t, err)
	require.Equal(t, lua.Granted, g.Admission)
	mr.Del("mini:{budget:catalog/2026-04-23}")
	_, _, err = b.Restore(ctx, kind, window, 50)
	require.NoError(t, err)
	_, err = b.TopUp(ctx, kind, window, "b", budget, 10, 60, time.Minute)
	require.ErrorIs(t, err, lua.ErrReservationUnknown)
	s, r, _, err = b.Spent(ctx, kind, window)
	require.NoError(t, err)
	assert.EqualValues(t, 50, s)
	assert.EqualValues(t, 60, r, "b's 60 held again")
	mr.SetTime(now.Add(time.Minute + time.Millisecond)) // b's worker died: its hold passes
	g, err = b.Reserve(ctx, kind, window, "c", budget, 1, time.Hour)
	require.NoError(t, err)
	assert.Equal(t, lua.Grant{Admission: lua.Spent, Spent: 110}, g, "b's re-created reservation lapsed, charged in full")
}
