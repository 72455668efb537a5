package politeness_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/politeness"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/testutil"
)

// gatedRobotsSite answers /robots.txt only when the test opens the gate: each robots.txt
// request is counted and announced on arrived, then held until release is closed (or the
// client goes away). Every other path is a page.
type gatedRobotsSite struct {
	*httptest.Server
	robots  atomic.Int64
	arrived chan struct{}
	release chan struct{}
	once    sync.Once
}

func newGatedRobotsSite(t *testing.T) *gatedRobotsSite {
	t.Helper()
	s := &gatedRobotsSite{arrived: make(chan struct{}, 16), release: make(chan struct{})}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/robots.txt" {
			_, _ = fmt.Fprint(w, "<p>page</p>")
			return
		}
		s.robots.Add(1)
		s.arrived <- struct{}{}
		select {
		case <-s.release:
		case <-r.Context().Done():
			return
		}
		_, _ = fmt.Fprint(w, "User-agent: *\nDisallow: /private/\n")
	}))
	t.Cleanup(s.Close)
	t.Cleanup(s.open) // before Close (cleanups run last-in first-out): no handler stays held
	return s
}

// open lets every held and later robots.txt request answer.
func (s *gatedRobotsSite) open() { s.once.Do(func() { close(s.release) }) }

// waitArrived waits for the next robots.txt request to reach the site.
func (s *gatedRobotsSite) waitArrived(t *testing.T) {
	t.Helper()
	select {
	case <-s.arrived:
	case <-time.After(time.Minute): // a hang guard, not a timing
		t.Fatal("no robots.txt request reached the site")
	}
}

// lockWaitSignal is a Redis hook that closes waiting when a SET NX of key fails: the worker
// behind the client found the robots.txt lock taken and waits for the other's fetch.
type lockWaitSignal struct {
	key     string
	waiting chan struct{}
	once    sync.Once
}

func (h *lockWaitSignal) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *lockWaitSignal) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		args := cmd.Args()
		if bc, ok := cmd.(*redis.BoolCmd); ok && err == nil && !bc.Val() && len(args) > 1 &&
			strings.EqualFold(fmt.Sprint(args[0]), "set") && fmt.Sprint(args[1]) == h.key {
			h.once.Do(func() { close(h.waiting) })
		}
		return err
	}
}

func (h *lockWaitSignal) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// renewalSignal is a Redis hook that counts the renewals of the lock at key that held (a
// PEXPIRE of it that Redis carried out, in the holder's MULTI/EXEC) and announces each on
// renewed.
type renewalSignal struct {
	key     string
	n       atomic.Int64
	renewed chan struct{}
}

func (h *renewalSignal) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (h *renewalSignal) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }

func (h *renewalSignal) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		for _, cmd := range cmds {
			args := cmd.Args()
			if bc, ok := cmd.(*redis.BoolCmd); ok && bc.Err() == nil && bc.Val() && len(args) > 1 &&
				strings.EqualFold(fmt.Sprint(args[0]), "pexpire") && fmt.Sprint(args[1]) == h.key {
				h.n.Add(1)
				select {
				case h.renewed <- struct{}{}:
				default:
				}
			}
		}
		return err
	}
}

// lockWaits counts RobotsConfig.OnLockWait calls by outcome.
type lockWaits struct {
	mu sync.Mutex
	n  map[politeness.RobotsLockWait]int
}

func (w *lockWaits) add(_ string, outcome politeness.RobotsLockWait) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.n == nil {
		w.n = map[politeness.RobotsLockWait]int{}
	}
	w.n[outcome]++
}

func (w *lockWaits) counts() map[politeness.RobotsLockWait]int {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := map[politeness.RobotsLockWait]int{}
	for k, v := range w.n {
		out[k] = v
	}
	return out
}

// TestRobotsLock: the fleet-wide robots.txt fetch lock holds a random owner token, is a
// short lease its holder renews while the fetch runs, is given up only by its owner, and
// makes one of two concurrent workers fetch; a worker waits for another's fetch a quarter of
// its request's time at most.
func TestRobotsLock(t *testing.T) {
	// The collectors' RequestTimeout: the robots.txt fetch's own timeout, and the budget a
	// waiting request's wait is a quarter of (3 s); the lock's lease is half that (1.5 s).
	const requestTimeout = 12 * time.Second

	type bundle struct {
		e       *env
		ns      *testutil.RedisNS
		site    *gatedRobotsSite
		lockKey string
		fetches atomic.Int64 // OnFetch calls, every cache of the bundle
		waits   lockWaits    // OnLockWait calls, every cache of the bundle
	}
	setupLock := func(t *testing.T) *bundle {
		t.Helper()
		b := &bundle{e: newEnv(t, testutil.FakeSiteConfig{}), ns: testutil.Redis(t),
			site: newGatedRobotsSite(t)}
		keys, err := lua.NewKeys(b.ns.Prefix)
		require.NoError(t, err)
		b.lockKey = keys.RobotsLock(strings.ToLower(b.site.URL))
		return b
	}
	// newCache is one worker's cache on its own Redis client (hooks, if given, on it), with
	// RobotsConfig.LockWaitMax waitMax.
	newCache := func(t *testing.T, b *bundle, waitMax time.Duration, hooks ...redis.Hook) *politeness.RobotsCache {
		t.Helper()
		c := redis.NewClient(&redis.Options{Addr: b.ns.Addr})
		t.Cleanup(func() { _ = c.Close() })
		for _, h := range hooks {
			c.AddHook(h)
		}
		rc, err := politeness.NewRobotsCache(politeness.RobotsConfig{Redis: c, KeyPrefix: b.ns.Prefix, LockWaitMax: waitMax,
			OnFetch: func(string, int, int64) { b.fetches.Add(1) }, OnLockWait: b.waits.add})
		require.NoError(t, err)
		return rc
	}
	// get requests path on a new session with cache in the background; its error arrives
	// on the channel. Cancelling ctx cancels the request.
	get := func(t *testing.T, ctx context.Context, b *bundle, cache *politeness.RobotsCache, path string) <-chan error {
		t.Helper()
		s, err := b.e.provider.NewSession("US", 0, time.Now())
		require.NoError(t, err)
		col, err := sessions.NewCollector(ctx, s, &sessions.CollectorConfig{
			Guard: sessions.LoopbackGuard(), RequestTimeout: requestTimeout, Robots: cache})
		require.NoError(t, err)
		t.Cleanup(col.Close)
		done := make(chan error, 1)
		go func() {
			_, err := col.Get(b.site.URL + path)
			done <- err
		}()
		return done
	}
	wait := func(t *testing.T, done <-chan error) error {
		t.Helper()
		select {
		case err := <-done:
			return err
		case <-time.After(time.Minute): // a hang guard, not a timing
			t.Fatal("the request did not return")
			return nil
		}
	}

	// The lock is a lease far shorter than the fetch it guards, which its holder renews
	// while the fetch runs: it outlives several of its leases, and always has at most one
	// lease to live, so a holder that stops frees it within a lease.
	t.Run("LockIsARenewedLease", func(t *testing.T) {
		for _, tc := range []struct {
			name    string
			waitMax time.Duration // RobotsConfig.LockWaitMax
			lease   time.Duration // the lease in effect
		}{
			{"DefaultWaitMax", 0, requestTimeout / 4 / 2},               // a quarter of the timeout is below the default cap
			{"ConfiguredWaitMax", 2 * time.Second, 2 * time.Second / 2}, // the cap wins
		} {
			t.Run(tc.name, func(t *testing.T) {
				b := setupLock(t)
				renewals := &renewalSignal{key: b.lockKey, renewed: make(chan struct{}, 1)}
				done := get(t, context.Background(), b, newCache(t, b, tc.waitMax, renewals), "/page")
				b.site.waitArrived(t) // the fetch runs, holding the lock

				owner, err := b.ns.Client.Get(context.Background(), b.lockKey).Result()
				require.NoError(t, err, "the lock is held while the fetch runs")
				assert.GreaterOrEqual(t, len(owner), 16, "a random owner token, not a constant: %q", owner)
				// Renewed every third of the lease: four renewals are more than a lease after
				// the lock was taken, and the fetch still holds it.
				for renewals.n.Load() < 4 {
					select {
					case <-renewals.renewed:
					case err := <-done:
						t.Fatalf("the request ended while its robots.txt fetch was held: %v", err)
					case <-time.After(time.Minute): // a hang guard, not a timing
						t.Fatalf("the lock was renewed %d times, not 4", renewals.n.Load())
					}
				}
				got, err := b.ns.Client.Get(context.Background(), b.lockKey).Result()
				require.NoError(t, err, "the lock outlives its first lease while the fetch runs")
				assert.Equal(t, owner, got, "held by the same fetch")
				pttl, err := b.ns.Client.PTTL(context.Background(), b.lockKey).Result()
				require.NoError(t, err)
				assert.Greater(t, pttl, time.Duration(0))
				assert.LessOrEqual(t, pttl, tc.lease, "at most one lease to live, not the fetch's timeout")

				b.site.open()
				require.NoError(t, wait(t, done))
				assert.Zero(t, b.ns.Client.Exists(context.Background(), b.lockKey).Val(), "its owner gave the lock up")
				assert.EqualValues(t, 1, b.site.robots.Load())
				assert.Empty(t, b.waits.counts(), "nobody waited")
			})
		}
	})

	// A live holder whose fetch takes longer than a waiting request's wait: the waiting
	// request ends as network (retryable, not replayed on a new session) well within its
	// own time, instead of timing out; the holder's fetch goes on.
	t.Run("LiveHolderOutlastsTheWait", func(t *testing.T) {
		b := setupLock(t)
		waiting := &lockWaitSignal{key: b.lockKey, waiting: make(chan struct{})}
		doneFirst := get(t, context.Background(), b, newCache(t, b, 0), "/page")
		b.site.waitArrived(t) // the first worker holds the lock and fetches, renewing it

		// The second request's budget is its RequestTimeout, as a worker's request's is.
		ctx, cancel := context.WithTimeout(context.Background(), requestTimeout)
		defer cancel()
		err := wait(t, get(t, ctx, b, newCache(t, b, 0, waiting), "/page"))
		select {
		case <-waiting.waiting:
		default:
			t.Fatal("the second worker never found the lock taken")
		}
		require.NoError(t, ctx.Err(), "the wait ended before the request's time did: %v", err)
		assert.Equal(t, "network", string(sessions.CategoryOf(err)), "%v", err)
		assert.ErrorContains(t, err, "still holds the lock")
		assert.Equal(t, map[politeness.RobotsLockWait]int{politeness.RobotsLockWaitGaveUp: 1}, b.waits.counts())
		assert.EqualValues(t, 1, b.site.robots.Load(), "the second worker did not fetch while the lock was renewed")
		assert.Zero(t, b.fetches.Load(), "the first worker's fetch still runs")

		b.site.open()
		require.NoError(t, wait(t, doneFirst))
		assert.EqualValues(t, 1, b.site.robots.Load())
		assert.Zero(t, b.ns.Client.Exists(context.Background(), b.lockKey).Val())
	})

	// Our lock expired while our fetch ran and another worker took it: neither our success
	// nor our failure deletes the other's lock.
	t.Run("OthersLockNotReleased", func(t *testing.T) {
		for _, tc := range []struct {
			name   string
			finish func(b *bundle, cancel context.CancelFunc)
			ok     bool
		}{
			{"AfterSuccess", func(b *bundle, _ context.CancelFunc) { b.site.open() }, true},
			{"AfterFailure", func(_ *bundle, cancel context.CancelFunc) { cancel() }, false}, // nothing cached, lock given up
		} {
			t.Run(tc.name, func(t *testing.T) {
				b := setupLock(t)
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				done := get(t, ctx, b, newCache(t, b, 0), "/page")
				b.site.waitArrived(t)
				ours, err := b.ns.Client.Get(ctx, b.lockKey).Result()
				require.NoError(t, err)

				// What an expiry and another worker's SET NX leave behind.
				require.NoError(t, b.ns.Client.Del(ctx, b.lockKey).Err())
				ok, err := b.ns.Client.SetNX(ctx, b.lockKey, "other-worker", time.Minute).Result()
				require.NoError(t, err)
				require.True(t, ok)

				tc.finish(b, cancel)
				err = wait(t, done)
				if tc.ok {
					require.NoError(t, err)
				} else {
					require.Error(t, err)
				}
				bg := context.Background()
				got, err := b.ns.Client.Get(bg, b.lockKey).Result()
				require.NoError(t, err, "the other worker's lock is still there")
				assert.Equal(t, "other-worker", got)
				assert.NotEqual(t, ours, got)
				assert.Greater(t, b.ns.Client.PTTL(bg, b.lockKey).Val(), requestTimeout/4/2,
					"with its own expiry, which no renewal of ours shortened to our lease")
			})
		}
	})

	t.Run("ConcurrentFetchersFetchOnce", func(t *testing.T) {
		b := setupLock(t)
		waiting := &lockWaitSignal{key: b.lockKey, waiting: make(chan struct{})}
		first := newCache(t, b, 0)
		second := newCache(t, b, 0, waiting) // another worker: its own cache and client

		doneFirst := get(t, context.Background(), b, first, "/page")
		b.site.waitArrived(t) // the first worker holds the lock and fetches
		doneSecond := get(t, context.Background(), b, second, "/private/x")
		select {
		case <-waiting.waiting: // the second found the lock taken: it waits for the first
		case err := <-doneSecond:
			t.Fatalf("the second worker returned before the first's fetch ended: %v", err)
		case <-time.After(time.Minute): // a hang guard, not a timing
			t.Fatal("the second worker never tried the lock")
		}

		b.site.open()
		require.NoError(t, wait(t, doneFirst))
		err := wait(t, doneSecond)
		assert.Equal(t, "robots_disallowed", string(sessions.CategoryOf(err)),
			"the second worker used the first's robots.txt: %v", err)
		assert.EqualValues(t, 1, b.site.robots.Load(), "robots.txt fetched once for both workers")
		assert.EqualValues(t, 1, b.fetches.Load())
		assert.Zero(t, b.ns.Client.Exists(context.Background(), b.lockKey).Val())
		assert.Equal(t, map[politeness.RobotsLockWait]int{politeness.RobotsLockWaitEntry: 1}, b.waits.counts())
	})

	t.Run("ConfigErrors", func(t *testing.T) {
		ns := testutil.Redis(t)
		_, err := politeness.NewRobotsCache(politeness.RobotsConfig{Redis: ns.Client, LockWaitMax: -time.Second})
		require.ErrorContains(t, err, "LockWaitMax")
		_, err = politeness.NewRobotsCache(politeness.RobotsConfig{Redis: ns.Client, LockWaitMax: time.Microsecond})
		require.ErrorContains(t, err, "LockWaitMax")
	})
}
