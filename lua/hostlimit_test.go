package lua_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/testutil"
)

// miniHostLimits runs the scripts on miniredis with the server clock frozen at a fixed
// instant, so waits are exact; advance moves the server clock (TIME and key expiry).
func miniHostLimits(t *testing.T) (*lua.HostLimits, func(time.Duration)) {
	t.Helper()
	c, mr, now := frozenMini(t)
	h, err := lua.NewHostLimits(c, "mini:")
	require.NoError(t, err)
	return h, func(d time.Duration) {
		now = now.Add(d)
		mr.SetTime(now)
		mr.FastForward(d)
	}
}

func TestHostLimits(t *testing.T) {
	ctx := context.Background()
	const host = "shop.example"

	t.Run("BurstThenPaced", func(t *testing.T) {
		h, advance := miniHostLimits(t)
		lim := lua.Limit{Rate: 10, Burst: 3} // one slot per 100 ms, 3 back to back
		for i := range 3 {
			wait, ok, err := h.Reserve(ctx, host, lim, time.Second)
			require.NoError(t, err)
			require.True(t, ok)
			assert.Zero(t, wait, "request %d of the burst goes at once", i+1)
		}
		for i, want := range []time.Duration{100 * time.Millisecond, 200 * time.Millisecond} {
			wait, ok, err := h.Reserve(ctx, host, lim, time.Second)
			require.NoError(t, err)
			require.True(t, ok)
			assert.Equal(t, want, wait, "request %d after the burst", i+4)
		}
		// Idle long enough and the burst is back.
		advance(time.Second)
		for range 3 {
			wait, ok, err := h.Reserve(ctx, host, lim, time.Second)
			require.NoError(t, err)
			require.True(t, ok)
			assert.Zero(t, wait)
		}
	})
	t.Run("UnpacedIgnoresTheBucket", func(t *testing.T) {
		h, _ := miniHostLimits(t)
		for range 5 {
			_, ok, err := h.Reserve(ctx, host, lua.Limit{Rate: 1}, time.Minute)
			require.NoError(t, err)
			require.True(t, ok)
		}
		wait, ok, err := h.Reserve(ctx, host, lua.Limit{}, 0)
		require.NoError(t, err)
		assert.True(t, ok)
		assert.Zero(t, wait, "an unpaced caller waits for pauses only, not for paced reservations")
	})
	t.Run("BeyondMaxWaitReservesNothing", func(t *testing.T) {
		h, advance := miniHostLimits(t)
		lim := lua.Limit{Rate: 1}
		wait, ok, err := h.Reserve(ctx, host, lim, 0)
		require.NoError(t, err)
		require.True(t, ok)
		require.Zero(t, wait)
		for range 3 { // refused reservations do not push the next slot later
			wait, ok, err = h.Reserve(ctx, host, lim, 500*time.Millisecond)
			require.NoError(t, err)
			assert.False(t, ok)
			assert.Equal(t, time.Second, wait)
		}
		advance(time.Second)
		wait, ok, err = h.Reserve(ctx, host, lim, 0)
		require.NoError(t, err)
		assert.True(t, ok)
		assert.Zero(t, wait)
	})
	t.Run("PauseHoldsPacedAndUnpaced", func(t *testing.T) {
		h, advance := miniHostLimits(t)
		moved, err := h.Pause(ctx, host, 2*time.Second)
		require.NoError(t, err)
		require.True(t, moved)
		moved, err = h.Pause(ctx, host, time.Second)
		require.NoError(t, err)
		assert.False(t, moved, "a shorter pause never shortens a longer one")

		for _, lim := range []lua.Limit{{}, {Rate: 100, Burst: 10}} {
			wait, ok, err := h.Reserve(ctx, host, lim, time.Second)
			require.NoError(t, err)
			assert.False(t, ok, "%+v: the pause is longer than the caller waits", lim)
			assert.Equal(t, 2*time.Second, wait)
		}
		wait, ok, err := h.Reserve(ctx, "other.example", lua.Limit{}, 0)
		require.NoError(t, err)
		assert.True(t, ok, "another host is not paused")
		assert.Zero(t, wait)

		advance(1500 * time.Millisecond)
		wait, ok, err = h.Reserve(ctx, host, lua.Limit{Rate: 100, Burst: 10}, time.Second)
		require.NoError(t, err)
		assert.True(t, ok)
		assert.Equal(t, 500*time.Millisecond, wait, "reserved for the end of the pause")
		advance(time.Second)
		wait, ok, err = h.Reserve(ctx, host, lua.Limit{}, 0)
		require.NoError(t, err)
		assert.True(t, ok)
		assert.Zero(t, wait, "the pause is over")
	})
	t.Run("BadArguments", func(t *testing.T) {
		h, _ := miniHostLimits(t)
		_, _, err := h.Reserve(ctx, host, lua.Limit{Rate: -1}, 0)
		require.ErrorContains(t, err, "Limit.Rate")
		_, _, err = h.Reserve(ctx, host, lua.Limit{Rate: 1, Burst: -1}, 0)
		require.ErrorContains(t, err, "Limit.Burst")
		_, _, err = h.Reserve(ctx, "", lua.Limit{}, 0)
		require.ErrorContains(t, err, "empty host")
		_, err = h.Pause(ctx, host, 0)
		require.ErrorContains(t, err, "below 1ms")
	})
	t.Run("KeysShareTheHostTag", func(t *testing.T) {
		k, err := lua.NewKeys("p:")
		require.NoError(t, err)
		for _, h := range []string{host, "127.0.0.1:8080", "we{ird}"} {
			tag := k.HostTag(h)
			for _, key := range []string{k.HostTAT(h), k.HostNotBefore(h), k.Robots(h), k.RobotsLock(h)} {
				assert.True(t, strings.HasPrefix(key, "p:"+tag+":"), key)
			}
			assert.Equal(t, 1, strings.Count(tag, "{"))
			assert.Equal(t, 1, strings.Count(tag, "}"))
		}
	})
	t.Run("RealRedisFleetNeverExceedsTheRate", func(t *testing.T) {
		// Many goroutines reserve at once on the real server: the reserved send times
		// (server clock, as returned) are never closer than the emission interval beyond
		// the burst. No sleeping: the slots are checked, not waited for.
		ns := testutil.Redis(t)
		h, err := lua.NewHostLimits(ns.Client, ns.Prefix)
		require.NoError(t, err)
		lim := lua.Limit{Rate: 100, Burst: 5} // 10 ms apart
		const n = 96
		var (
			mu    sync.Mutex
			slots []time.Time
			wg    sync.WaitGroup
		)
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range n / 8 {
					sent := time.Now()
					wait, ok, err := h.Reserve(ctx, host, lim, time.Minute)
					if !assert.NoError(t, err) || !assert.True(t, ok) {
						return
					}
					mu.Lock()
					slots = append(slots, sent.Add(wait))
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		require.Len(t, slots, n)
		// n reservations need at least (n - burst) intervals between the first and the
		// last slot, whatever the goroutines' order.
		first, last := slots[0], slots[0]
		for _, s := range slots {
			if s.Before(first) {
				first = s
			}
			if s.After(last) {
				last = s
			}
		}
		// The send times are counted from the client's send time, which is earlier than the
		// server's by up to a round trip: allow 200 ms of that (without a limit the span
		// would be a few milliseconds).
		assert.GreaterOrEqual(t, last.Sub(first), time.Duration(n-lim.Burst)*10*time.Millisecond-200*time.Millisecond)
	})
}
