package lua_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/testutil"
)

// guard bounds a wait on an event that must come; it is a hang guard, never a timing
// assertion (every event waited for here is due in well under a second).
const guard = 30 * time.Second

func recv[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(guard):
		t.Fatalf("no %s within %v", what, guard)
		panic("unreachable")
	}
}

func waitDone(t *testing.T, ctx context.Context, what string) {
	t.Helper()
	recv(t, ctx.Done(), what)
}

// renewals returns a KeepOptions.OnRenew that sends every renewal's outcome on a channel
// (never blocking the keeper: the buffer is larger than any test needs).
func renewals() (chan error, func(error)) {
	ch := make(chan error, 10000)
	return ch, func(err error) { ch <- err }
}

// claimedJob claims "job" for owner A with ttl on the shared Redis, as the keeper's
// caller does before Keep.
func claimedJob(t *testing.T, ttl time.Duration) (*lua.Leases, lua.Lease, *testutil.RedisNS) {
	t.Helper()
	l, ns := realLeases(t)
	lease, err := l.Claim(context.Background(), "job", "A", ttl, 0)
	require.NoError(t, err)
	return l, lease, ns
}

func TestKeeperCancelsOnLoss(t *testing.T) {
	ctx := context.Background()

	t.Run("LeaseDeleted", func(t *testing.T) {
		l, lease, ns := claimedJob(t, 5*time.Second)
		// The keeper's clock stands still, so only the lease's loss in Redis can end it.
		clock := testutil.NewClock(time.Now())
		lease.Claimed = clock.Now()
		// Each renewal's outcome with the order in which the keeper reported it, so the
		// check below needs no timing: reports stamped before the DEL returned are earlier.
		type report struct {
			err      error
			afterDel bool
		}
		var deleted atomic.Bool
		renewed := make(chan report, 10000)
		onRenew := func(err error) { renewed <- report{err, deleted.Load()} }
		k, err := l.Keep(ctx, lease, &lua.KeepOptions{Interval: 100 * time.Millisecond, Clock: clock, OnRenew: onRenew})
		require.NoError(t, err)
		// Renewals go through.
		require.NoError(t, recv(t, renewed, "first renewal").err)
		require.NoError(t, recv(t, renewed, "second renewal").err)
		require.NoError(t, k.Context().Err())

		require.NoError(t, ns.Client.Del(ctx, l.Keys().Lease("job")).Err())
		deleted.Store(true)
		// Within one renewal: a renewal that ran in Redis before the DEL may report its
		// success after it (one at most: the keeper renews one at a time, and a renewal
		// started after the DEL fails); the next reports the loss and cancels the job
		// context. Successes reported before the DEL returned (however many renewals a
		// slow test goroutine let run) do not count.
		succeededAfterDel := 0
		for {
			r := recv(t, renewed, "renewal after the lease was deleted")
			if r.err == nil {
				if r.afterDel {
					succeededAfterDel++
				}
				continue
			}
			require.ErrorIs(t, r.err, lua.ErrLeaseLost)
			break
		}
		assert.LessOrEqual(t, succeededAfterDel, 1)
		waitDone(t, k.Context(), "job context cancelled after the lease was deleted")
		require.ErrorIs(t, context.Cause(k.Context()), lua.ErrLeaseLost)
		require.ErrorIs(t, k.Stop(), lua.ErrLeaseLost)
		require.ErrorIs(t, k.Stop(), lua.ErrLeaseLost, "Stop twice")
		assert.Empty(t, renewed, "no renewal after the loss")
	})

	t.Run("LeaseTakenOver", func(t *testing.T) {
		l, lease, ns := claimedJob(t, time.Second)
		k, err := l.Keep(ctx, lease, &lua.KeepOptions{Interval: 50 * time.Millisecond})
		require.NoError(t, err)
		// Someone else's claim after an expiry we fake by deleting the lease.
		require.NoError(t, ns.Client.Del(ctx, l.Keys().Lease("job")).Err())
		_, err = l.Claim(ctx, "job", "B", time.Minute, 0)
		require.NoError(t, err)
		waitDone(t, k.Context(), "job context cancelled after a takeover")
		cause := context.Cause(k.Context())
		require.True(t, errors.Is(cause, lua.ErrNotOwner) || errors.Is(cause, lua.ErrLeaseLost), "cause: %v", cause)
		require.Error(t, k.Stop())
	})

	t.Run("RedisUnreachable", func(t *testing.T) {
		srv := testutil.StartRedis(t)
		c := redis.NewClient(&redis.Options{Addr: srv.Addr, MaxRetries: -1, DialTimeout: 50 * time.Millisecond})
		defer c.Close()
		l, err := lua.NewLeases(c, "x:")
		require.NoError(t, err)
		const ttl = time.Second
		clock := testutil.NewClock(time.Now())
		lease, err := l.Claim(ctx, "job", "A", ttl, 0)
		require.NoError(t, err)
		lease.Claimed = clock.Now()
		srv.Stop()
		renewed, onRenew := renewals()
		k, err := l.Keep(ctx, lease, &lua.KeepOptions{Interval: 50 * time.Millisecond, Clock: clock, OnRenew: onRenew})
		require.NoError(t, err)
		// While the lease may still hold (by the keeper's clock) failed renewals are retried
		// and the work goes on.
		require.Error(t, recv(t, renewed, "failed renewal"))
		require.Error(t, recv(t, renewed, "retried renewal"))
		require.NoError(t, k.Context().Err(), "gave up while the lease still held")
		// The moment the lease would have expired, counted from the claim, the keeper stops
		// the work: another worker may hold the job from then on.
		clock.Advance(ttl)
		waitDone(t, k.Context(), "job context cancelled at the lease's end")
		require.ErrorIs(t, k.Stop(), lua.ErrLeaseLost)
		require.ErrorContains(t, context.Cause(k.Context()), "not renewed before expiry")
	})

	t.Run("StopWhileHeld", func(t *testing.T) {
		l, lease, ns := claimedJob(t, time.Minute)
		k, err := l.Keep(ctx, lease, nil)
		require.NoError(t, err)
		require.NoError(t, k.Stop())
		require.Error(t, k.Context().Err(), "the job context ends with the keeper")
		require.Equal(t, int64(1), ns.Client.Exists(ctx, l.Keys().Lease("job")).Val(), "Stop does not release")
	})

	t.Run("ParentCancelled", func(t *testing.T) {
		l, lease, _ := claimedJob(t, time.Minute)
		parent, cancel := context.WithCancel(ctx)
		k, err := l.Keep(parent, lease, nil)
		require.NoError(t, err)
		cancel()
		waitDone(t, k.Context(), "job context cancelled with its parent")
		require.NoError(t, k.Stop(), "a cancelled parent is not a lost lease")
	})

	t.Run("BadOptions", func(t *testing.T) {
		l, _ := realLeases(t)
		lease := lua.Lease{Key: "job", Owner: "A", Token: 1, TTL: time.Second}
		_, err := l.Keep(ctx, lease, &lua.KeepOptions{Interval: 2 * time.Second})
		require.ErrorContains(t, err, `keep "job"`)
		require.ErrorContains(t, err, "half the lease TTL")
		_, err = l.Keep(ctx, lease, &lua.KeepOptions{Jitter: 0.7})
		require.ErrorContains(t, err, "KeepOptions.Jitter 0.7")
		_, err = l.Keep(ctx, lua.Lease{Key: "job", Owner: "A", Token: 1}, nil)
		require.ErrorContains(t, err, "TTL")
	})
}

// TestKeeperCountsFromClaim: the keeper counts the lease from when the claim was sent, not
// from when Keep was called: time spent between claim and Keep (a slow attempt start) is
// already gone from the lease, both for when it gives up and for when it renews.
func TestKeeperCountsFromClaim(t *testing.T) {
	ctx := context.Background()

	t.Run("GivesUpAtClaimPlusTTL", func(t *testing.T) {
		l, lease, ns := claimedJob(t, 2*time.Second)
		clock := testutil.NewClock(time.Now())
		require.False(t, lease.Claimed.IsZero())
		lease.Claimed = clock.Now().Add(-2 * time.Second) // as if the start took the whole lease
		renewed, onRenew := renewals()
		k, err := l.Keep(ctx, lease, &lua.KeepOptions{Interval: 500 * time.Millisecond, Clock: clock, OnRenew: onRenew})
		require.NoError(t, err)
		waitDone(t, k.Context(), "job context cancelled")
		require.ErrorIs(t, k.Stop(), lua.ErrLeaseLost)
		assert.Empty(t, renewed, "no renewal once the lease is over by the keeper's count")
		// Redis would still have renewed (its TTL ran from the real claim): the keeper gave
		// up on its own count, which is the conservative one.
		assert.Equal(t, int64(1), ns.Client.Exists(ctx, l.Keys().Lease("job")).Val())
	})

	t.Run("FirstRenewalScheduledFromClaim", func(t *testing.T) {
		l, lease, _ := claimedJob(t, 5*time.Minute)
		clock := testutil.NewClock(time.Now())
		// Two minutes went by since the claim; renewals are due every minute: the first one
		// is overdue and runs at once (counted from Keep it would wait a minute, and the
		// hang guard would fail the test).
		lease.Claimed = clock.Now().Add(-2 * time.Minute)
		renewed, onRenew := renewals()
		k, err := l.Keep(ctx, lease, &lua.KeepOptions{Interval: time.Minute, Clock: clock, OnRenew: onRenew})
		require.NoError(t, err)
		require.NoError(t, recv(t, renewed, "overdue first renewal"))
		require.NoError(t, k.Stop())
	})
}

// TestKeeperWorstAllowedTiming is the probe of issue 15 item 6: with the old rule
// (interval < TTL) jitter pushed renewals past the lease and 12 of 20 healthy leases were
// declared lost before any renewal. With the slowest schedule CheckKeepTiming allows, 20
// healthy leases each renew several times and none is lost (counted by renewal outcomes).
func TestKeeperWorstAllowedTiming(t *testing.T) {
	ctx := context.Background()
	l, _ := realLeases(t)
	const (
		ttl      = 3 * time.Second
		jitter   = 0.49
		leases   = 20
		renewals = 2
	)
	jit := jitter // a variable: the constant expression is not an integral duration
	interval := time.Duration(float64(ttl) / 2 / (1 + jit))
	require.NoError(t, lua.CheckKeepTiming(ttl, interval, jitter), "the probe uses the worst allowed setting")
	require.Error(t, lua.CheckKeepTiming(ttl, interval+time.Millisecond, jitter), "and nothing worse is allowed")

	type probe struct {
		k  *lua.Keeper
		ok chan struct{}
	}
	lost := make(chan error, leases*100)
	probes := make([]probe, leases)
	for i := range probes {
		lease, err := l.Claim(ctx, fmt.Sprintf("job-%d", i), "A", ttl, 0)
		require.NoError(t, err)
		p := probe{ok: make(chan struct{}, 100)}
		p.k, err = l.Keep(ctx, lease, &lua.KeepOptions{Interval: interval, Jitter: jitter, OnRenew: func(err error) {
			if err != nil {
				lost <- err
				return
			}
			p.ok <- struct{}{}
		}})
		require.NoError(t, err)
		probes[i] = p
		t.Cleanup(func() { _ = p.k.Stop() })
	}
	for i, p := range probes {
		for n := range renewals {
			select {
			case <-p.ok:
			case err := <-lost:
				t.Fatalf("lease %d lost before renewal %d: %v", i, n+1, err)
			case <-p.k.Context().Done():
				t.Fatalf("lease %d lost before renewal %d: %v", i, n+1, context.Cause(p.k.Context()))
			case <-time.After(guard):
				t.Fatalf("lease %d: no renewal %d within %v", i, n+1, guard)
			}
		}
	}
	for i, p := range probes {
		assert.NoError(t, p.k.Stop(), "lease %d", i)
	}
	assert.Empty(t, lost, "failed renewals")
}

func TestCheckKeepTiming(t *testing.T) {
	tests := []struct {
		name     string
		ttl      time.Duration
		interval time.Duration
		jitter   float64
		wantErr  string // empty: allowed
	}{
		{name: "Defaults", ttl: time.Second},
		{name: "DefaultsShortestLease", ttl: time.Millisecond},
		{name: "ExactlyHalf", ttl: 3 * time.Second, interval: 1200 * time.Millisecond, jitter: 0.25},
		{name: "JustOverHalf", ttl: 3 * time.Second, interval: 1200*time.Millisecond + 1, jitter: 0.25,
			wantErr: "KeepOptions.Interval 1.200000001s × (1 + Jitter 0.25) = 1.500000001s must be at most half the lease TTL 3s"},
		{name: "OldRuleAccepted", ttl: time.Second, interval: 950 * time.Millisecond, jitter: 0.1,
			wantErr: "use Interval <= 454.545454ms"},
		{name: "DefaultJitterApplied", ttl: time.Second, interval: 500 * time.Millisecond,
			wantErr: "Jitter 0.1"},
		{name: "IntervalLongerThanLease", ttl: time.Second, interval: 2 * time.Second, jitter: 0.1,
			wantErr: "half the lease TTL 1s"},
		{name: "NegativeInterval", ttl: time.Second, interval: -time.Second, wantErr: "KeepOptions.Interval -1s must be positive"},
		{name: "NegativeJitter", ttl: time.Second, jitter: -0.1, wantErr: "KeepOptions.Jitter -0.1 must be in [0, 0.5)"},
		{name: "JitterTooLarge", ttl: time.Second, jitter: 0.5, wantErr: "KeepOptions.Jitter 0.5"},
		{name: "JitterNaN", ttl: time.Second, jitter: math.NaN(), wantErr: "KeepOptions.Jitter NaN"},
		{name: "ZeroTTL", ttl: 0, wantErr: "lease TTL 0s is below 1ms"},
		{name: "NegativeTTL", ttl: -time.Second, interval: time.Millisecond, wantErr: "lease TTL -1s"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := lua.CheckKeepTiming(tt.ttl, tt.interval, tt.jitter)
			if tt.wantErr == "" {
				assert.NoError(t, err)
				return
			}
			assert.ErrorContains(t, err, tt.wantErr)
		})
	}
}
