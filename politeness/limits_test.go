package politeness_test

import (
	"context"
	"errors"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/politeness"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// hooks records what a Limits told its hooks.
type hooks struct {
	mu        sync.Mutex
	waits     []time.Duration
	throttled []string // kind/reason
}

func (h *hooks) onWait(_ string, d time.Duration) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.waits = append(h.waits, d)
}

func (h *hooks) onThrottle(kind, reason string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.throttled = append(h.throttled, kind+"/"+reason)
}

func TestHostKey(t *testing.T) {
	for raw, want := range map[string]string{
		"http://Shop.Example/a":         "shop.example",
		"https://shop.example:443/a":    "shop.example",
		"http://shop.example:80/a":      "shop.example",
		"https://shop.example:80/a":     "shop.example:80",
		"http://127.0.0.1:8080/a?b=c":   "127.0.0.1:8080",
		"http://[::1]:8080/a":           "[::1]:8080",
		"https://SHOP.example:8443/x/y": "shop.example:8443",
	} {
		u, err := url.Parse(raw)
		require.NoError(t, err)
		assert.Equal(t, want, politeness.HostKey(u), raw)
	}
}

func TestLimitsConfig(t *testing.T) {
	ns := testutil.Redis(t)
	for _, tc := range []struct {
		name string
		cfg  politeness.LimitsConfig
		want string
	}{
		{"NoRedis", politeness.LimitsConfig{}, "LimitsConfig.Redis"},
		{"NegativeHostWaitMax", politeness.LimitsConfig{Redis: ns.Client, HostWaitMax: -time.Second}, "LimitsConfig.HostWaitMax"},
		{"BadHostLimit", politeness.LimitsConfig{Redis: ns.Client, HostLimits: map[string]politeness.Limit{"shop.example": {Rate: -1}}},
			`LimitsConfig.HostLimits["shop.example"]`},
		{"BadDefaultHostLimit", politeness.LimitsConfig{Redis: ns.Client, DefaultHostLimit: &politeness.Limit{Rate: 1, Burst: -2}},
			"LimitsConfig.DefaultHostLimit"},
		{"BracedPrefix", politeness.LimitsConfig{Redis: ns.Client, KeyPrefix: "{x}:"}, "may not contain"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := politeness.NewLimits(tc.cfg)
			require.ErrorContains(t, err, tc.want)
		})
	}
	t.Run("Defaults", func(t *testing.T) {
		l, err := politeness.NewLimits(politeness.LimitsConfig{Redis: ns.Client})
		require.NoError(t, err)
		assert.Equal(t, politeness.DefaultHostWaitMax, l.HostWaitMax())
		assert.Zero(t, l.Paused(time.Now()))
	})
}

func TestLimiter(t *testing.T) {
	ctx := context.Background()
	const host = "shop.example"
	// newLimits returns limits on a fresh namespace, and the key of host's pause.
	newLimits := func(t *testing.T, mutate func(*politeness.LimitsConfig)) (*politeness.Limits, *hooks, *testutil.RedisNS, string) {
		t.Helper()
		ns, h := testutil.Redis(t), &hooks{}
		cfg := politeness.LimitsConfig{Redis: ns.Client, KeyPrefix: ns.Prefix, OnWait: h.onWait, OnThrottle: h.onThrottle}
		if mutate != nil {
			mutate(&cfg)
		}
		l, err := politeness.NewLimits(cfg)
		require.NoError(t, err)
		keys, err := lua.NewKeys(ns.Prefix)
		require.NoError(t, err)
		return l, h, ns, keys.HostNotBefore(host)
	}

	t.Run("UnlimitedHostCostsNothing", func(t *testing.T) {
		l, h, ns, _ := newLimits(t, nil)
		require.NoError(t, l.Limiter("kind.a", nil).Wait(ctx, host))
		assert.Empty(t, h.waits, "no limit: the hook is not told")
		keys, err := ns.Client.Keys(ctx, ns.Prefix+"*").Result()
		require.NoError(t, err)
		assert.Empty(t, keys, "no limit: nothing in Redis")
	})
	t.Run("HostLimitWinsOverKindAndDefault", func(t *testing.T) {
		// One request per minute for host, whatever the kind's limit or the default say;
		// another host takes the kind's limit, or the default for a kind without one.
		slow, fast := politeness.Limit{Rate: 1.0 / 60}, politeness.Limit{Rate: 1000, Burst: 1000}
		l, h, _, _ := newLimits(t, func(c *politeness.LimitsConfig) {
			c.HostLimits = map[string]politeness.Limit{host: slow}
			c.DefaultHostLimit = &slow
			c.HostWaitMax = time.Second
		})
		kind := l.Limiter("kind.a", &fast)
		require.NoError(t, kind.Wait(ctx, host))
		err := kind.Wait(ctx, host)
		var pe *politeness.Error
		require.ErrorAs(t, err, &pe, "the host's limit: the next slot is a minute away")
		assert.Equal(t, tasks.CategoryThrottled, pe.Category)
		for range 5 {
			require.NoError(t, kind.Wait(ctx, "other.example"), "the kind's limit")
		}
		plain := l.Limiter("kind.b", nil)
		require.NoError(t, plain.Wait(ctx, "third.example"))
		require.Error(t, plain.Wait(ctx, "third.example"), "the default limit")
		assert.Equal(t, []string{"kind.a/" + politeness.ThrottledWaitTooLong, "kind.b/" + politeness.ThrottledWaitTooLong}, h.throttled)
		assert.Equal(t, make([]time.Duration, 7), h.waits, "every request that went went at once")
	})
	t.Run("PausedHostBeyondWaitMaxIsThrottled", func(t *testing.T) {
		l, h, _, _ := newLimits(t, func(c *politeness.LimitsConfig) { c.DefaultHostLimit = &politeness.Limit{Rate: 100, Burst: 10} })
		lim := l.Limiter("kind.a", nil)
		lim.Pause(ctx, host, time.Minute) // another job's Retry-After
		err := lim.Wait(ctx, host)
		var pe *politeness.Error
		require.ErrorAs(t, err, &pe)
		assert.Equal(t, tasks.CategoryThrottled, pe.Category)
		assert.Greater(t, pe.RetryAfter, 50*time.Second, "what is left of the pause")
		assert.LessOrEqual(t, pe.RetryAfter, time.Minute)
		var hw *politeness.HostWaitError
		require.ErrorAs(t, err, &hw, "the fleet's wait, not the job's failure")
		assert.Equal(t, host, hw.Host)
		assert.Equal(t, politeness.DefaultHostWaitMax, hw.Max)
		assert.Equal(t, pe.RetryAfter, hw.Wait)
		assert.Equal(t, []string{"kind.a/" + politeness.ThrottledRetryAfter, "kind.a/" + politeness.ThrottledWaitTooLong}, h.throttled)
	})
	t.Run("PauseIsCappedAndCounted", func(t *testing.T) {
		clock := testutil.NewClock(time.Now())
		l, _, ns, pauseKey := newLimits(t, func(c *politeness.LimitsConfig) { c.Now = clock.Now })
		l.Limiter("kind.a", nil).Pause(ctx, host, 2*time.Hour)
		pttl, err := ns.Client.PTTL(ctx, pauseKey).Result()
		require.NoError(t, err)
		assert.Greater(t, pttl, politeness.MaxHostPause-time.Minute)
		assert.LessOrEqual(t, pttl, politeness.MaxHostPause, "a Retry-After of hours pauses the fleet for MaxHostPause")
		assert.Equal(t, 1, l.Paused(clock.Now()))
		assert.Zero(t, l.Paused(clock.Advance(politeness.MaxHostPause)), "forgotten once the pause is over")
	})
	t.Run("WaitEndsWithTheJobsContext", func(t *testing.T) {
		l, h, _, _ := newLimits(t, func(c *politeness.LimitsConfig) {
			c.DefaultHostLimit = &politeness.Limit{Rate: 100, Burst: 10}
			c.HostWaitMax = time.Hour
		})
		lim := l.Limiter("kind.a", nil)
		lim.Pause(ctx, host, time.Minute)
		lost := errors.New("lease lost")
		wctx, cancel := context.WithCancelCause(ctx)
		time.AfterFunc(50*time.Millisecond, func() { cancel(lost) })
		start := time.Now()
		require.ErrorIs(t, lim.Wait(wctx, host), lost, "the context's cause")
		assert.Less(t, time.Since(start), 30*time.Second, "not the pause's end")
		assert.Empty(t, h.waits, "a wait that ended is not a wait the request went after")
	})
}
