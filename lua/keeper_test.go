package lua_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/testutil"
)

func TestKeeperCancelsOnLoss(t *testing.T) {
	ctx := context.Background()

	t.Run("LeaseDeleted", func(t *testing.T) {
		l, ns := realLeases(t)
		lease, err := l.Claim(ctx, "job", "A", 900*time.Millisecond, 0)
		require.NoError(t, err)
		renewed := make(chan error, 100)
		const interval = 300 * time.Millisecond
		k, err := l.Keep(ctx, lease, &lua.KeepOptions{Interval: interval, OnRenew: func(err error) { renewed <- err }})
		require.NoError(t, err)
		// Renewals go through.
		require.NoError(t, <-renewed)
		require.NoError(t, <-renewed)
		require.NoError(t, k.Context().Err())

		require.NoError(t, ns.Client.Del(ctx, l.Keys().Lease("job")).Err())
		deleted := time.Now()
		select {
		case <-k.Context().Done():
		case <-time.After(5 * time.Second):
			t.Fatal("keeper did not cancel the job context after the lease was deleted")
		}
		// Within one renewal interval (plus jitter and scheduling slack).
		require.Less(t, time.Since(deleted), interval*11/10+300*time.Millisecond)
		require.ErrorIs(t, context.Cause(k.Context()), lua.ErrLeaseLost)
		require.ErrorIs(t, k.Stop(), lua.ErrLeaseLost)
		require.ErrorIs(t, k.Stop(), lua.ErrLeaseLost, "Stop twice")
	})

	t.Run("LeaseTakenOver", func(t *testing.T) {
		l, ns := realLeases(t)
		lease, err := l.Claim(ctx, "job", "A", time.Second, 0)
		require.NoError(t, err)
		k, err := l.Keep(ctx, lease, &lua.KeepOptions{Interval: 50 * time.Millisecond})
		require.NoError(t, err)
		// Someone else's claim after an expiry we fake by deleting the lease.
		require.NoError(t, ns.Client.Del(ctx, l.Keys().Lease("job")).Err())
		_, err = l.Claim(ctx, "job", "B", time.Minute, 0)
		require.NoError(t, err)
		<-k.Context().Done()
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
		lease, err := l.Claim(ctx, "job", "A", ttl, 0)
		require.NoError(t, err)
		claimed := time.Now()
		k, err := l.Keep(ctx, lease, nil)
		require.NoError(t, err)
		srv.Stop()
		<-k.Context().Done()
		// The keeper gives up no later than the lease would expire; the worker must not
		// keep writing past the point where another may hold the job.
		require.Less(t, time.Since(claimed), ttl+300*time.Millisecond)
		require.ErrorIs(t, k.Stop(), lua.ErrLeaseLost)
	})

	t.Run("StopWhileHeld", func(t *testing.T) {
		l, ns := realLeases(t)
		lease, err := l.Claim(ctx, "job", "A", time.Minute, 0)
		require.NoError(t, err)
		k, err := l.Keep(ctx, lease, nil)
		require.NoError(t, err)
		require.NoError(t, k.Stop())
		require.Error(t, k.Context().Err(), "the job context ends with the keeper")
		require.Equal(t, int64(1), ns.Client.Exists(ctx, l.Keys().Lease("job")).Val(), "Stop does not release")
	})

	t.Run("ParentCancelled", func(t *testing.T) {
		l, _ := realLeases(t)
		lease, err := l.Claim(ctx, "job", "A", time.Minute, 0)
		require.NoError(t, err)
		parent, cancel := context.WithCancel(ctx)
		k, err := l.Keep(parent, lease, nil)
		require.NoError(t, err)
		cancel()
		<-k.Context().Done()
		require.NoError(t, k.Stop(), "a cancelled parent is not a lost lease")
	})

	t.Run("BadOptions", func(t *testing.T) {
		l, _ := realLeases(t)
		lease := lua.Lease{Key: "job", Owner: "A", Token: 1, TTL: time.Second}
		_, err := l.Keep(ctx, lease, &lua.KeepOptions{Interval: 2 * time.Second})
		require.ErrorContains(t, err, "shorter than the lease")
		_, err = l.Keep(ctx, lease, &lua.KeepOptions{Jitter: 0.7})
		require.ErrorContains(t, err, "jitter")
	})
}

// TestKeeperCountsFromClaim: the keeper's safety deadline starts when the claim was sent,
// not when Keep was called: time spent between claim and Keep (a slow attempt start) is
// already gone from the lease.
func TestKeeperCountsFromClaim(t *testing.T) {
	ctx := context.Background()
	srv := testutil.StartRedis(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr, MaxRetries: -1, DialTimeout: 50 * time.Millisecond})
	defer c.Close()
	l, err := lua.NewLeases(c, "x:")
	require.NoError(t, err)
	lease, err := l.Claim(ctx, "job", "A", 2*time.Second, 0)
	require.NoError(t, err)
	require.False(t, lease.Claimed.IsZero())
	lease.Claimed = lease.Claimed.Add(-1800 * time.Millisecond) // as if the start took 1.8 s
	srv.Stop()
	k, err := l.Keep(ctx, lease, &lua.KeepOptions{Interval: 500 * time.Millisecond})
	require.NoError(t, err)
	started := time.Now()
	<-k.Context().Done()
	require.Less(t, time.Since(started), time.Second, "gave up at claim + TTL, not Keep + TTL")
	require.ErrorIs(t, k.Stop(), lua.ErrLeaseLost)
}
