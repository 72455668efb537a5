package handlers

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

func recordJob(t *testing.T, st *store.PG, key string) {
	t.Helper()
	_, err := st.JobsRecord(context.Background(), []tasks.JobRecord{{
		Key: key, Spec: tasks.Spec{Kind: "catalog", SourceID: key, Country: "US", Window: "2026-04-23", ParserVersion: 1},
	}})
	require.NoError(t, err)
}

// leaseFixture is a store and a Redis namespace of the test's own, with the leases on it.
func leaseFixture(t *testing.T) (*store.PG, *testutil.RedisNS, *lua.Leases) {
	t.Helper()
	st := store.New(testutil.PG(t))
	ns := testutil.Redis(t)
	leases, err := lua.NewLeases(ns.Client, ns.Prefix)
	require.NoError(t, err)
	return st, ns, leases
}

func params(key, owner string, ttl time.Duration) acquireParams {
	return acquireParams{Key: key, Owner: owner, TTL: ttl, Start: store.AttemptStartParams{Worker: owner, Country: "US"}}
}

// TestStaleWorkerRefused is Kleppmann's scenario: a worker pauses past its lease, another
// takes the job over, and the first wakes up and tries to complete.
func TestStaleWorkerRefused(t *testing.T) {
	ctx := context.Background()
	st, _, leases := leaseFixture(t)
	const key = "catalog:sku-42:US:2026-04-23:v1"
	recordJob(t, st, key)

	a, err := acquire(ctx, leases, st, params(key, "worker-A", 300*time.Millisecond))
	require.NoError(t, err)

	// B cannot take the job while A's lease runs…
	_, err = acquire(ctx, leases, st, params(key, "worker-B", time.Minute))
	require.ErrorIs(t, err, lua.ErrLeaseHeld)

	// …A pauses (GC, VM migration, stalled proxy) and does not renew; once the lease has
	// expired on the Redis server, B claims and starts its attempt.
	var b acquired
	WaitUntil(t, "A's lease expiring", 10*time.Millisecond, func() bool {
		b, err = acquire(ctx, leases, st, params(key, "worker-B", time.Minute))
		return !errors.Is(err, lua.ErrLeaseHeld)
	})
	require.NoError(t, err)
	require.Greater(t, b.Lease.Token, a.Lease.Token)

	// A wakes up and tries to complete: refused, nothing written.
	jobsBefore := testutil.TableSnapshot(t, st.Pool(), "jobs")
	err = st.JobComplete(ctx, store.AttemptFinishParams{Key: key, Token: a.Lease.Token, Bytes: 512})
	require.ErrorIs(t, err, store.ErrStaleFence)
	require.Equal(t, jobsBefore, testutil.TableSnapshot(t, st.Pool(), "jobs"))
	require.ErrorIs(t, leases.Release(ctx, a.Lease), lua.ErrNotOwner, "A no longer holds the lease")

	// B completes.
	require.NoError(t, st.JobComplete(ctx, store.AttemptFinishParams{Key: key, Token: b.Lease.Token, Bytes: 1024}))
	require.NoError(t, leases.Release(ctx, b.Lease))

	job, err := st.JobGet(ctx, key)
	require.NoError(t, err)
	require.Equal(t, tasks.StateComplete, job.State)
	require.Equal(t, b.Lease.Token, job.Fence)
	atts, err := st.AttemptList(ctx, key)
	require.NoError(t, err)
	type row struct {
		Worker  string
		Fence   int64
		Outcome string
	}
	var got []row
	for _, at := range atts {
		got = append(got, row{at.Worker, at.Fence, at.Outcome})
	}
	want := []row{
		{"worker-A", a.Lease.Token, store.OutcomeLost}, // written by B's start; A reported nothing
		{"worker-B", b.Lease.Token, store.OutcomeComplete},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("attempts (-want +got):\n%s", diff)
	}
}

// TestTokensSurviveRedisFlush: Redis loses every key (FLUSHALL, restart without
// persistence) between claims; every token is still higher than the last (PostgreSQL issues
// them: nothing Redis forgets can repeat one), one per attempt.
func TestTokensSurviveRedisFlush(t *testing.T) {
	ctx := context.Background()
	st := store.New(testutil.PG(t))
	srv := testutil.StartRedis(t) // throwaway: this test flushes and restarts it
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer c.Close()
	leases, err := lua.NewLeases(c, "idemscrape:")
	require.NoError(t, err)
	const key = "catalog:flush:US:2026-04-23:v1"
	recordJob(t, st, key)

	var last int64
	for i := 0; i < 40; i++ {
		switch {
		case i == 20:
			srv.Restart()
		case i%4 == 3:
			require.NoError(t, c.FlushAll(ctx).Err())
		}
		got, err := acquire(ctx, leases, st, params(key, fmt.Sprintf("worker-%d", i%3), time.Minute))
		require.NoError(t, err, "round %d", i)
		require.Equal(t, last+1, got.Lease.Token, "round %d: the next token", i)
		require.Equal(t, got.Attempt.Fence, got.Lease.Token)
		last = got.Lease.Token
		require.NoError(t, st.JobMarkRetryable(ctx, store.AttemptFinishParams{
			Key: key, Token: got.Lease.Token, NextAttemptAt: time.Now(), Category: "timeout",
		}))
		require.NoError(t, leases.Release(ctx, got.Lease))
	}
	job, err := st.JobGet(ctx, key)
	require.NoError(t, err)
	require.Equal(t, last, job.Fence)
	require.Equal(t, 40, job.Attempts)
}

func TestAcquireRefusals(t *testing.T) {
	ctx := context.Background()
	st, ns, leases := leaseFixture(t)

	t.Run("CompleteJobReleasesLease", func(t *testing.T) {
		recordJob(t, st, "done")
		got, err := acquire(ctx, leases, st, params("done", "w", time.Minute))
		require.NoError(t, err)
		require.NoError(t, st.JobComplete(ctx, store.AttemptFinishParams{Key: "done", Token: got.Lease.Token}))
		require.NoError(t, leases.Release(ctx, got.Lease))

		_, err = acquire(ctx, leases, st, params("done", "w2", time.Minute))
		require.ErrorIs(t, err, store.ErrJobComplete)
		require.Zero(t, ns.Client.Exists(ctx, leases.Keys().Lease("done")).Val(), "a refused start gives the lease back")
	})
	t.Run("UnknownJob", func(t *testing.T) {
		_, err := acquire(ctx, leases, st, params("nope", "w", time.Minute))
		require.ErrorIs(t, err, store.ErrJobNotFound)
		require.Zero(t, ns.Client.Exists(ctx, leases.Keys().Lease("nope")).Val())
	})
}

func TestLeaseLengths(t *testing.T) {
	l, err := NewLeaseLengths(&LeaseLengthConfig{Default: time.Minute, Min: 5 * time.Second, Max: 10 * time.Minute, MinSamples: 10, Window: 100})
	require.NoError(t, err)
	require.Equal(t, time.Minute, l.For("catalog"), "default before data")
	for i := 1; i <= 9; i++ {
		l.Observe("catalog", 10*time.Second)
	}
	require.Equal(t, time.Minute, l.For("catalog"), "still the default below MinSamples")
	// 100 durations of 1..100 s: p95 = 95 s, × margin 2 = 190 s.
	for i := 1; i <= 100; i++ {
		l.Observe("catalog", time.Duration(i)*time.Second)
	}
	require.Equal(t, 190*time.Second, l.For("catalog"))
	// The window keeps only the last 100: 100 fast ones push the slow ones out, clamped at Min.
	for i := 0; i < 100; i++ {
		l.Observe("catalog", 100*time.Millisecond)
	}
	require.Equal(t, 5*time.Second, l.For("catalog"))
	for i := 0; i < 100; i++ {
		l.Observe("slow", time.Hour)
	}
	require.Equal(t, 10*time.Minute, l.For("slow"), "clamped at Max")
	require.Equal(t, time.Minute, l.For("other"), "kinds are separate")

	_, err = NewLeaseLengths(&LeaseLengthConfig{Min: time.Minute, Max: time.Second})
	require.ErrorContains(t, err, "Min")
	_, err = NewLeaseLengths(&LeaseLengthConfig{Margin: 0.5})
	require.ErrorContains(t, err, "Margin")
	_, err = NewLeaseLengths(&LeaseLengthConfig{Percentile: 1.5})
	require.ErrorContains(t, err, "Percentile")
}

func TestBeforeDeadline(t *testing.T) {
	// A tenth of the time left, at most 5 s (exact: no wall clock involved).
	require.Equal(t, 2*time.Second, deadlineMargin(20*time.Second))
	require.Equal(t, 100*time.Millisecond, deadlineMargin(time.Second))
	require.Equal(t, 5*time.Second, deadlineMargin(time.Hour))

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	d, _ := ctx.Deadline()
	inner, cancelInner := beforeDeadline(ctx)
	defer cancelInner()
	di, ok := inner.Deadline()
	require.True(t, ok)
	require.True(t, di.Before(d), "the runner stops before asynq's deadline")

	long, cancelLong := context.WithTimeout(context.Background(), time.Hour)
	defer cancelLong()
	dl, _ := long.Deadline()
	inner, cancelInner2 := beforeDeadline(long)
	defer cancelInner2()
	di, _ = inner.Deadline()
	require.Equal(t, 5*time.Second, dl.Sub(di), "the margin is capped at 5 s")

	inner, cancelInner3 := beforeDeadline(context.Background())
	defer cancelInner3()
	_, ok = inner.Deadline()
	require.False(t, ok, "no deadline, none added")
}
