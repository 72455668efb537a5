package store_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestGroupCommitNotifies: the commit statement no longer notifies (PostgreSQL serialises
// notifying commits), so the committer must: a commit that inserted its event is followed
// by a NOTIFY on OutboxNotifyChannel that a LISTENing connection receives, sent after the
// row is visible, and by the in-process OnEvents hook, called before Commit returns. A
// refused commit (no event) calls no hook.
func TestGroupCommitNotifies(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)
	var hooks atomic.Int64
	woken := make(chan struct{}, 1)
	g, err := s.NewGroupCommitterConfig(store.GroupConfig{OnEvents: func() {
		hooks.Add(1)
		select {
		case woken <- struct{}{}:
		default:
		}
	}})
	require.NoError(t, err)
	defer g.Close()

	listener, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer listener.Release()
	_, err = listener.Exec(ctx, "LISTEN "+store.OutboxNotifyChannel)
	require.NoError(t, err)

	startedJobs(t, s, "n1", "n2", "n3")
	// The three commits go in one statement, so the first NOTIFY follows all of them.
	queued, release := pauseGroup(g)
	var wg sync.WaitGroup
	for _, k := range []string{"n1", "n2", "n3"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := g.Commit(ctx, commitParams(k, 1))
			if err == nil && !res.EventInserted {
				t.Errorf("%s: event not inserted", k)
			}
			if err != nil {
				t.Error(err)
			}
		}()
	}
	for range 3 {
		recv(t, queued, "a commit queued")
	}
	release()
	wg.Wait()
	require.Equal(t, int64(1), hooks.Load(), "OnEvents runs once per statement, before Commit returns")
	recv(t, woken, "OnEvents")

	wctx, cancel := context.WithTimeout(ctx, failSafe)
	defer cancel()
	n, err := listener.Conn().WaitForNotification(wctx)
	require.NoError(t, err, notWithin("a committed event's NOTIFY"))
	require.Equal(t, store.OutboxNotifyChannel, n.Channel)
	require.Equal(t, 3, testutil.Count(t, pool, `SELECT count(*) FROM outbox_unsent WHERE event_key LIKE 'observed:n%'`),
		"the rows are visible once the NOTIFY arrives")

	// A refused commit (the job is complete) inserts no event: no hook.
	_, err = g.Commit(ctx, commitParams("n1", 1))
	require.ErrorIs(t, err, store.ErrJobComplete)
	require.Equal(t, int64(1), hooks.Load(), "a refused commit wakes nobody")

	g.Close()
	st := g.Stats()
	require.Equal(t, int64(1), st.Notifies+st.NotifiesRode, "one NOTIFY for the one statement that inserted events")
	require.Zero(t, st.NotifyFailures)
}

// TestGroupCommitTrailingNotify: a commit statement that inserted events without a NOTIFY
// of its own (one was sent less than NotifyInterval before) is still followed by one: by
// the committer's own NOTIFY once the interval is over, or at the latest by Close.
func TestGroupCommitTrailingNotify(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)
	listener, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer listener.Release()
	_, err = listener.Exec(ctx, "LISTEN "+store.OutboxNotifyChannel)
	require.NoError(t, err)
	wait := func(what string) {
		t.Helper()
		wctx, cancel := context.WithTimeout(ctx, failSafe)
		defer cancel()
		_, err := listener.Conn().WaitForNotification(wctx)
		require.NoError(t, err, notWithin(what))
	}
	startedJobs(t, s, "t1", "t2", "t3", "t5", "t6")

	t.Run("ByClose", func(t *testing.T) {
		// An interval no test outlives: the second commit can only be covered by Close.
		g, err := s.NewGroupCommitterConfig(store.GroupConfig{NotifyInterval: time.Hour})
		require.NoError(t, err)
		defer g.Close()
		_, err = g.Commit(ctx, commitParams("t1", 1))
		require.NoError(t, err)
		wait("the first commit notifies in its own statement")
		_, err = g.Commit(ctx, commitParams("t2", 1))
		require.NoError(t, err)
		g.Close()
		wait("Close sends the NOTIFY the second commit is owed")
		st := g.Stats()
		require.Equal(t, int64(1), st.NotifiesRode)
		require.Equal(t, int64(1), st.Notifies)
	})
	t.Run("RefusedRideDoesNotDelay", func(t *testing.T) {
		// The first statement is asked to notify but inserts no event (its commit is
		// refused: wrong token), so it sends no NOTIFY. The next commit can not ride (the
		// interval is long), and the NOTIFY it is owed must not wait 2 × interval after a
		// NOTIFY that never went out: the committer sends its own at once, before Close.
		g, err := s.NewGroupCommitterConfig(store.GroupConfig{NotifyInterval: time.Hour})
		require.NoError(t, err)
		defer g.Close()
		_, err = g.Commit(ctx, commitParams("t5", 2))
		require.Error(t, err, "a commit under another token is refused")
		_, err = g.Commit(ctx, commitParams("t6", 1))
		require.NoError(t, err)
		wait("the owed NOTIFY follows at once, not an hour after a ride that sent nothing")
		// The NOTIFY arrived before Close was called, so it is the loop's own; Close only
		// waits for the loop to count it (the listener can see a NOTIFY before the sender
		// has counted it).
		g.Close()
		st := g.Stats()
		require.Equal(t, int64(0), st.NotifiesRode)
		require.Equal(t, int64(1), st.Notifies)
	})
	t.Run("ByInterval", func(t *testing.T) {
		// An interval the second commit comes within, so it can not ride: its NOTIFY is the
		// committer's own, sent by the loop (not by Close) within 2 × interval.
		//
		// Whether a commit comes within the interval of the last NOTIFY is up to the box's
		// pace, so the test does not assume it: a commit that came later rode (as it
		// should; the test reads that from the stats when Commit returns) and the case is
		// tried again with the next job, right after that ride.
		const interval = 2 * time.Second
		g, err := s.NewGroupCommitterConfig(store.GroupConfig{NotifyInterval: interval})
		require.NoError(t, err)
		defer g.Close()
		_, err = g.Commit(ctx, commitParams("t3", 1))
		require.NoError(t, err)
		require.Equal(t, int64(1), g.Stats().NotifiesRode, "the first commit notifies in its own statement")
		wait("the first commit's NOTIFY")
		rode := int64(1)
		deadline := time.Now().Add(failSafe)
		for i := 0; ; i++ {
			if time.Now().After(deadline) {
				t.Fatal(notWithin(fmt.Sprintf("a commit within %s of the last NOTIFY (%d tries)", interval, i)))
			}
			key := fmt.Sprintf("t4-%d", i)
			startedJobs(t, s, key)
			_, err = g.Commit(ctx, commitParams(key, 1))
			require.NoError(t, err)
			if g.Stats().NotifiesRode == rode {
				break // it came within the interval and did not ride
			}
			rode++
			t.Logf("%s came %s or more after the last NOTIFY and rode; again (load %s)", key, interval, loadAvg())
			wait("the NOTIFY that rode")
		}
		wait("the commit that did not ride is followed by a NOTIFY while the committer runs")
		g.Close() // the NOTIFY already arrived: Close has nothing owed to send, it waits for the count
		st := g.Stats()
		require.Equal(t, rode, st.NotifiesRode, "only the NOTIFYs seen riding rode")
		require.Equal(t, int64(1), st.Notifies, "the last commit's NOTIFY is the committer's own, before Close")
	})
}
