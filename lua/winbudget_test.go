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
	spent, err := b.Restore(ctx, kind, window, 100)
	require.NoError(t, err)
	assert.EqualValues(t, 100, spent)
	spent, err = b.Restore(ctx, kind, window, 5)
	require.NoError(t, err)
	assert.EqualValues(t, 100, spent, "the first restore wins")

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
	assert.Equal(t, lua.Grant{Admission: lua.Granted, Amount: 300, Spent: 700, Reserved: 0}, g,
		"b lapsed; nothing else reserved: the last attempt gets what is left")
	_, err = b.Settle(ctx, kind, window, "e", 300)
	require.NoError(t, err)
	g, err = b.Reserve(ctx, kind, window, "f", 1000, 1, time.Minute)
	require.NoError(t, err)
	assert.Equal(t, lua.Grant{Admission: lua.Spent, Spent: 1000}, g)
	s, r, ok, err := b.Spent(ctx, kind, window)
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
	_, err = b.Restore(ctx, kind, window, 0)
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
