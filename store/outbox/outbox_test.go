package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	ptu "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/outbox"
	"github.com/idemscrape/idemscrape/testutil"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// go-redis probes a server that refused dials from a goroutine that sleeps 1 s
		// between probes and ends by itself once a dial succeeds or the pool is closed;
		// TestDispatcherRedisDown leaves one behind for up to that second.
		goleak.IgnoreAnyFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).tryDial"))
}

// bundle is what most tests start from: an isolated database and Redis prefix, and one
// registry that every component of the test shares.
type bundle struct {
	pool   *pgxpool.Pool
	rdb    *redis.Client
	prefix string
	reg    *prometheus.Registry
	log    *slog.Logger
}

func setup(t *testing.T) *bundle {
	t.Helper()
	ns := testutil.Redis(t)
	return &bundle{pool: testutil.PG(t), rdb: ns.Client, prefix: ns.Prefix, reg: prometheus.NewRegistry(), log: testLogger()}
}

// testLogger discards logs unless OUTBOX_TEST_LOG is set: the fault tests log an error
// per injected fault by design.
func testLogger() *slog.Logger {
	if os.Getenv("OUTBOX_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

func exec(t testing.TB, pool *pgxpool.Pool, sql string, args ...any) {
	t.Helper()
	_, err := pool.Exec(context.Background(), sql, args...)
	require.NoError(t, err, sql)
}

// insertEvents commits n outbox rows ev:<from>…ev:<from+n-1> on topic in one statement,
// as the runner's commit would (without NOTIFY).
func insertEvents(t testing.TB, pool *pgxpool.Pool, topic string, from, n int) {
	t.Helper()
	exec(t, pool, `INSERT INTO outbox (event_key, topic, payload)
		SELECT 'ev:' || g, $1, jsonb_build_object('n', g) FROM generate_series($2::int, $3::int) AS g`,
		topic, from, from+n-1)
}

func (b *bundle) dispatcher(t testing.TB, cfg outbox.DispatcherConfig) *outbox.Dispatcher {
	t.Helper()
	cfg.Prefix, cfg.Registerer, cfg.Logger = b.prefix, b.reg, b.log
	d, err := outbox.NewDispatcher(b.pool, b.rdb, &cfg)
	require.NoError(t, err)
	t.Cleanup(d.Stop)
	return d
}

func (b *bundle) consumer(t testing.TB, cfg outbox.ConsumerConfig) *outbox.Consumer {
	t.Helper()
	cfg.Prefix, cfg.Registerer, cfg.Logger = b.prefix, b.reg, b.log
	c, err := outbox.NewConsumer(b.rdb, &cfg)
	require.NoError(t, err)
	return c
}

// runConsumer runs fn (c.Run or c.RunTx) in a goroutine; the returned stop cancels it and
// waits for it to return.
func runConsumer(t testing.TB, fn func(ctx context.Context) error) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- fn(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			require.NoError(t, <-done)
		})
	}
	t.Cleanup(stop)
	return stop
}

func count(t testing.TB, pool *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	return testutil.Count(t, pool, sql, args...)
}

func xlen(t testing.TB, rdb redis.UniversalClient, stream string) int {
	t.Helper()
	n, err := rdb.XLen(context.Background(), stream).Result()
	require.NoError(t, err)
	return int(n)
}

// added returns how many entries were ever appended to stream (XINFO STREAM entries-added):
// every published copy, whatever the dispatcher's trims have removed since.
func added(t testing.TB, rdb redis.UniversalClient, stream string) int {
	t.Helper()
	info, err := rdb.XInfoStream(context.Background(), stream).Result()
	require.NoError(t, err)
	return int(info.EntriesAdded)
}

// groupDone reports whether group has read every entry of stream and acknowledged all.
func groupDone(t testing.TB, rdb redis.UniversalClient, stream, group string) bool {
	t.Helper()
	groups, err := rdb.XInfoGroups(context.Background(), stream).Result()
	if err != nil {
		return false
	}
	for _, g := range groups {
		if g.Name == group {
			return g.Pending == 0 && g.Lag == 0
		}
	}
	return false
}

// waitFor waits until cond holds, re-checking whenever progress signals (and at least
// every 500 ms, for state changed by components that do not signal), or fails after
// timeout.
func waitFor(t testing.TB, timeout time.Duration, progress <-chan struct{}, what string, cond func() bool, describe ...func() string) {
	t.Helper()
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-progress:
		case <-tick.C:
		case <-deadline.C:
			for _, d := range describe {
				what += "; " + d()
			}
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
	}
}

func signal(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

var errInjected = errors.New("injected fault")

func TestNotifyChannelMatchesStore(t *testing.T) {
	// The committer (store.Commit) and the dispatcher must agree on the channel.
	require.Equal(t, store.OutboxNotifyChannel, outbox.NotifyChannel)
}

// TestDispatchExactlyOnceEffect is the end-to-end proof: 10,000 committed events, three
// dispatchers at once, the AfterPublish failpoint rolling back 100 published batches,
// three RunTx consumers that are killed twice each between their side effects and their
// XACK and replaced by new consumers that must reclaim the dead ones' entries. Every
// event must take effect exactly once.
func TestDispatchExactlyOnceEffect(t *testing.T) {
	const (
		events      = 10000
		dispatchers = 3
		slots       = 3 // consumers running at once
		kills       = 2 // per slot
		failpoints  = 100
		batch       = 200
		topic       = "observed"
		group       = "effects"
	)
	b := setup(t)
	ctx := context.Background()
	exec(t, b.pool, `CREATE TABLE side_effects (event_key text PRIMARY KEY)`)
	insertEvents(t, b.pool, topic, 1, events)
	stream := outbox.StreamKey(b.prefix, topic)

	progress := make(chan struct{}, 1)

	// The failpoint fires on three of every four batches until it fired 100 times, so it
	// hits batches of all three dispatchers while most rows are still unsent.
	var (
		fpMu      sync.Mutex
		fpCalls   int
		fired     int
		firedRows int
	)
	afterPublish := func(ids []int64) error {
		fpMu.Lock()
		defer fpMu.Unlock()
		fpCalls++
		if fired < failpoints && fpCalls%4 != 0 {
			fired++
			firedRows += len(ids)
			return errInjected
		}
		return nil
	}
	for i := 0; i < dispatchers; i++ {
		d := b.dispatcher(t, outbox.DispatcherConfig{
			BatchSize:    batch,
			PollInterval: 50 * time.Millisecond,
			RetryBackoff: time.Millisecond, RetryBackoffMax: 5 * time.Millisecond,
			AfterPublish: afterPublish,
			OnBatch:      func(int, error) { signal(progress) },
		})
		require.NoError(t, d.Start(ctx))
	}

	var (
		duplicates  sync.Map // event keys whose side effect was already there
		killsDone   int
		killsMu     sync.Mutex
		wg          sync.WaitGroup
		runCtx, end = context.WithCancel(ctx)
	)
	defer end()
	for slot := 0; slot < slots; slot++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for gen := 0; runCtx.Err() == nil; gen++ {
				cctx, kill := context.WithCancel(runCtx)
				var killed bool // only this generation's goroutine touches it
				killAt := 0
				if gen < kills {
					killAt = 150 + 37*slot + 11*gen // mid-batch: batches are 100 entries
				}
				handled := 0
				c, err := outbox.NewConsumer(b.rdb, &outbox.ConsumerConfig{
					Prefix: b.prefix, Topic: topic, Group: group,
					Consumer:  fmt.Sprintf("slot%d-gen%d", slot, gen),
					BatchSize: 100, Block: 100 * time.Millisecond,
					MinIdle: 500 * time.Millisecond, ReclaimInterval: 100 * time.Millisecond,
					// A killed consumer never acknowledges what it did before it died.
					BeforeAck: func([]string) error {
						if killed {
							return errInjected
						}
						return nil
					},
					OnBatch:    func(outbox.BatchReport) { signal(progress) },
					Registerer: b.reg, Logger: b.log,
				})
				if err != nil {
					kill()
					t.Error(err)
					return
				}
				err = c.RunTx(cctx, b.pool, func(ctx context.Context, tx pgx.Tx, ev outbox.Event) error {
					tag, err := tx.Exec(ctx, `INSERT INTO side_effects (event_key) VALUES ($1) ON CONFLICT DO NOTHING`, ev.EventKey)
					if err != nil {
						return err
					}
					if tag.RowsAffected() == 0 {
						duplicates.Store(ev.EventKey, true)
					}
					handled++
					if handled == killAt {
						killed = true
						kill() // dies with this transaction uncommitted and the batch unacknowledged
					}
					return nil
				})
				kill()
				if err != nil {
					t.Error(err)
					return
				}
				if !killed {
					return // the test is over
				}
				killsMu.Lock()
				killsDone++
				killsMu.Unlock()
			}
		}()
	}

	waitFor(t, 3*time.Minute, progress, "every event handled and acknowledged", func() bool {
		return count(t, b.pool, `SELECT count(*) FROM outbox_unsent`) == 0 &&
			count(t, b.pool, `SELECT count(*) FROM side_effects`) == events &&
			groupDone(t, b.rdb, stream, group)
	}, func() string {
		groups, err := b.rdb.XInfoGroups(ctx, stream).Result()
		return fmt.Sprintf("unsent %d, side effects %d, inbox %d, groups %+v (%v)",
			count(t, b.pool, `SELECT count(*) FROM outbox_unsent`),
			count(t, b.pool, `SELECT count(*) FROM side_effects`),
			count(t, b.pool, `SELECT count(*) FROM outbox_inbox`), groups, err)
	})
	end()
	wg.Wait()

	var dups []string
	duplicates.Range(func(k, _ any) bool { dups = append(dups, k.(string)); return true })
	require.Empty(t, dups, "side effects that ran twice")
	require.Equal(t, failpoints, fired, "failpoint firings")
	require.Equal(t, slots*kills, killsDone, "consumers killed")

	n := added(t, b.rdb, stream) // the dispatchers trim what the group acknowledged
	require.GreaterOrEqual(t, n, events)
	require.Equal(t, events+firedRows, n, "stream = every event once + every copy of a rolled-back batch")
	require.Equal(t, events, count(t, b.pool, `SELECT count(*) FROM outbox_inbox WHERE consumer_group = $1`, group))
	require.Equal(t, events, count(t, b.pool, `SELECT count(*) FROM side_effects`))
	require.Equal(t, events, count(t, b.pool, `SELECT count(*) FROM outbox_sent`))

	var m *outbox.DispatcherMetrics
	{
		d, err := outbox.NewDispatcher(b.pool, b.rdb, &outbox.DispatcherConfig{Registerer: b.reg})
		require.NoError(t, err)
		m = d.Metrics() // the shared collectors
	}
	require.Equal(t, float64(n), ptu.ToFloat64(m.Published.WithLabelValues(topic)))
	require.Equal(t, float64(firedRows), ptu.ToFloat64(m.Republished.WithLabelValues(topic)))
	cm := b.consumer(t, outbox.ConsumerConfig{Topic: topic, Group: group}).Metrics()
	require.Positive(t, ptu.ToFloat64(cm.Claimed.WithLabelValues(group)), "the replacements reclaimed the dead consumers' entries")
	require.GreaterOrEqual(t, ptu.ToFloat64(cm.Deduplicated.WithLabelValues(group)), float64(n-events),
		"every extra copy was recognised as a replay")
	require.Zero(t, ptu.ToFloat64(cm.Lost.WithLabelValues(group)))
	t.Logf("stream entries %d (%d republished), reclaimed %v, deduplicated %v",
		n, firedRows, ptu.ToFloat64(cm.Claimed.WithLabelValues(group)), ptu.ToFloat64(cm.Deduplicated.WithLabelValues(group)))
}

func TestDispatcher(t *testing.T) {
	ctx := context.Background()

	t.Run("HappyPath", func(t *testing.T) {
		b := setup(t)
		exec(t, b.pool, `INSERT INTO outbox (event_key, topic, payload) VALUES
			('a:1', 'alerts', '{"sku": "42", "price": 9.5}'), ('i:1', 'index', '[1, 2]'), ('a:2', 'alerts', '{}')`)
		d := b.dispatcher(t, outbox.DispatcherConfig{})
		// One batch per topic: its position is the batch's unit.
		n, err := d.DispatchOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 2, n, "alerts")
		n, err = d.DispatchOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n, "index")
		n, err = d.DispatchOnce(ctx)
		require.NoError(t, err)
		require.Zero(t, n, "nothing left")

		type entry struct{ EventKey, Topic, Payload, OutboxID, CreatedAt string }
		dbRows, err := b.pool.Query(ctx, `SELECT event_key, topic, payload::text, id::text, created_at FROM outbox ORDER BY id`)
		require.NoError(t, err)
		want := map[string][]entry{}
		for dbRows.Next() {
			var e entry
			var created time.Time
			require.NoError(t, dbRows.Scan(&e.EventKey, &e.Topic, &e.Payload, &e.OutboxID, &created))
			e.CreatedAt = created.UTC().Format(time.RFC3339Nano)
			want[e.Topic] = append(want[e.Topic], e)
		}
		require.NoError(t, dbRows.Err())
		got := map[string][]entry{}
		for _, topic := range []string{"alerts", "index"} {
			msgs, err := b.rdb.XRange(ctx, outbox.StreamKey(b.prefix, topic), "-", "+").Result()
			require.NoError(t, err)
			for _, m := range msgs {
				require.Len(t, m.Values, 5, "fields of %v", m.Values)
				got[topic] = append(got[topic], entry{
					EventKey: m.Values[outbox.FieldEventKey].(string), Topic: m.Values[outbox.FieldTopic].(string),
					Payload: m.Values[outbox.FieldPayload].(string), OutboxID: m.Values[outbox.FieldOutboxID].(string),
					CreatedAt: m.Values[outbox.FieldCreatedAt].(string),
				})
			}
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("stream entries (-want +got):\n%s", diff)
		}
		require.Zero(t, count(t, b.pool, `SELECT count(*) FROM outbox_unsent`))
		require.Equal(t, 2.0, ptu.ToFloat64(d.Metrics().Published.WithLabelValues("alerts")))
		require.Equal(t, 1.0, ptu.ToFloat64(d.Metrics().Published.WithLabelValues("index")))
		require.Equal(t, 1, ptu.CollectAndCount(d.Metrics().Lag), "one histogram")
		require.Zero(t, ptu.ToFloat64(d.Metrics().Republished.WithLabelValues("alerts")))
	})

	t.Run("FailpointRollsBack", func(t *testing.T) {
		b := setup(t)
		insertEvents(t, b.pool, "t", 1, 30)
		var fail bool
		var gotIDs []int64
		d := b.dispatcher(t, outbox.DispatcherConfig{BatchSize: 20, AfterPublish: func(ids []int64) error {
			gotIDs = ids
			if fail {
				return errInjected
			}
			return nil
		}})
		fail = true
		n, err := d.DispatchOnce(ctx)
		require.ErrorIs(t, err, errInjected)
		require.Zero(t, n)
		require.Len(t, gotIDs, 20, "the failpoint sees the batch's ids")
		require.Zero(t, count(t, b.pool, `SELECT count(*) FROM outbox_sent`), "rolled back: nothing marked sent")
		stream := outbox.StreamKey(b.prefix, "t")
		require.Equal(t, 20, xlen(t, b.rdb, stream), "published before the failpoint")
		require.Equal(t, 20.0, ptu.ToFloat64(d.Metrics().Republished.WithLabelValues("t")))

		fail = false
		n, err = d.DispatchOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 20, n)
		require.Equal(t, gotIDs, firstIDs(t, b.pool, 20), "the same rows, oldest first")
		n, err = d.DispatchOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 10, n)
		require.Zero(t, count(t, b.pool, `SELECT count(*) FROM outbox_unsent`))
		require.Equal(t, 50, xlen(t, b.rdb, stream), "30 events + 20 republished copies")
		require.Equal(t, 50.0, ptu.ToFloat64(d.Metrics().Published.WithLabelValues("t")))
		require.Equal(t, 20.0, ptu.ToFloat64(d.Metrics().Republished.WithLabelValues("t")))
	})

	t.Run("SkipsHeldTopics", func(t *testing.T) {
		b := setup(t)
		insertEvents(t, b.pool, "t", 1, 10)
		insertEvents(t, b.pool, "u", 11, 2)
		exec(t, b.pool, `INSERT INTO outbox_positions (topic) VALUES ('t'), ('u')`)
		// Another dispatcher's open transaction holds topic t's position.
		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck // test cleanup
		_, err = tx.Exec(ctx, `SELECT 1 FROM outbox_positions WHERE topic = 't' FOR UPDATE`)
		require.NoError(t, err)

		d := b.dispatcher(t, outbox.DispatcherConfig{})
		n, err := d.DispatchOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 2, n, "the held topic is skipped, not waited for: u's rows go")
		n, err = d.DispatchOnce(ctx)
		require.NoError(t, err)
		require.Zero(t, n)
		require.NoError(t, tx.Rollback(ctx))
		n, err = d.DispatchOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 10, n)
	})

	t.Run("StartStopRepeatedly", func(t *testing.T) {
		b := setup(t)
		batches := make(chan int, 100)
		d := b.dispatcher(t, outbox.DispatcherConfig{BatchSize: 4, PollInterval: time.Hour, DisableNotify: true,
			OnBatch: func(n int, err error) {
				if err != nil {
					n = -1
				}
				batches <- n
			}})
		d.Stop() // never started
		insertEvents(t, b.pool, "t", 1, 10)
		require.NoError(t, d.Start(ctx))
		require.NoError(t, d.Start(ctx), "second Start is a no-op")
		// Full batches run back to back until a short one.
		require.Equal(t, []int{4, 4, 2}, []int{recv(t, batches, "batch"), recv(t, batches, "batch"), recv(t, batches, "batch")})
		d.Stop()
		d.Stop()
		insertEvents(t, b.pool, "t", 11, 1)
		require.NoError(t, d.Start(ctx), "restart after Stop")
		require.Equal(t, 1, recv(t, batches, "batch after restart"))
		d.Stop()
		require.Equal(t, 11, xlen(t, b.rdb, outbox.StreamKey(b.prefix, "t")))
	})

	t.Run("StopsWithItsContext", func(t *testing.T) {
		b := setup(t)
		batches := make(chan int, 100)
		d := b.dispatcher(t, outbox.DispatcherConfig{PollInterval: 10 * time.Millisecond, OnBatch: func(n int, _ error) { batches <- n }})
		cctx, cancel := context.WithCancel(ctx)
		require.NoError(t, d.Start(cctx))
		recv(t, batches, "first batch")
		cancel()
		d.Stop() // returns: the loop and the listener ended with the context
		insertEvents(t, b.pool, "t", 1, 1)
		require.NoError(t, d.Start(ctx), "a dispatcher whose context ended can start again")
		waitFor(t, 30*time.Second, nil, "the row sent", func() bool {
			return count(t, b.pool, `SELECT count(*) FROM outbox_unsent`) == 0
		})
	})

	t.Run("InvalidConfig", func(t *testing.T) {
		tests := []struct {
			name string
			cfg  outbox.DispatcherConfig
			want string
		}{
			{"NegativeBatch", outbox.DispatcherConfig{BatchSize: -1}, "BatchSize"},
			{"NegativePoll", outbox.DispatcherConfig{PollInterval: -time.Second}, "PollInterval"},
			{"BackoffAboveMax", outbox.DispatcherConfig{RetryBackoff: time.Second, RetryBackoffMax: time.Millisecond}, "RetryBackoff"},
			{"UnknownTrim", outbox.DispatcherConfig{Trim: 7}, "Trim"},
		}
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				require.ErrorContains(t, tt.cfg.Validate(), tt.want)
			})
		}
		require.NoError(t, (&outbox.DispatcherConfig{}).Validate(), "the zero value is valid")
	})
}

func firstIDs(t testing.TB, pool *pgxpool.Pool, n int) []int64 {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT id FROM outbox ORDER BY id LIMIT $1`, n)
	require.NoError(t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	require.NoError(t, err)
	return ids
}

// TestDispatcherRedisDown stops Redis under a running dispatcher: its batches must fail
// and roll back (the loop retries with backoff), so nothing is marked sent; when Redis is back
// (empty: Restart loses data), it catches up, and the one event it had published before
// Redis went down (lost with Redis's data) is found and published again.
func TestDispatcherRedisDown(t *testing.T) {
	ctx := context.Background()
	srv := testutil.StartRedis(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, MaxRetries: -1, DialTimeout: 100 * time.Millisecond, DialerRetries: 1})
	defer rdb.Close()
	b := setup(t)
	b.rdb = rdb
	const events = 120
	type result struct {
		n   int
		err error
	}
	results := make(chan result, 1000)
	d := b.dispatcher(t, outbox.DispatcherConfig{
		BatchSize: 50, PollInterval: 20 * time.Millisecond, PublishAttempts: 3,
		RetryBackoff: time.Millisecond, RetryBackoffMax: 20 * time.Millisecond,
		OnBatch: func(n int, err error) { results <- result{n, err} },
	})
	// One event published while Redis is up: the dispatcher knows the stream's epoch.
	insertEvents(t, b.pool, "t", 1, 1)
	n, err := d.DispatchOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	insertEvents(t, b.pool, "t", 2, events-1)
	srv.Stop()

	require.NoError(t, d.Start(ctx))
	for i := 0; i < 3; i++ {
		r := recv(t, results, "failed batch")
		require.Error(t, r.err, "batch %d with Redis down", i)
		require.ErrorContains(t, r.err, "epoch marker", "the batch fails at its first Redis round trip, before publishing")
		require.Zero(t, r.n)
	}
	require.Equal(t, 1, count(t, b.pool, `SELECT count(*) FROM outbox_sent`), "nothing marked sent while Redis is down")

	srv.Start()
	sent := 0
	for sent < events {
		r := recv(t, results, "batch after Redis is back")
		if r.err == nil {
			sent += r.n
		}
	}
	d.Stop()
	require.Equal(t, events, sent, "the 119 new events and the lost one, published again")
	require.Zero(t, count(t, b.pool, `SELECT count(*) FROM outbox_unsent`))
	require.Equal(t, events, xlen(t, rdb, outbox.StreamKey(b.prefix, "t")), "every event in the (new, empty) Redis, once")
	require.Equal(t, 1.0, ptu.ToFloat64(d.Metrics().Remarked.WithLabelValues("t")))
	require.Equal(t, 1.0, ptu.ToFloat64(d.Metrics().StreamsLost.WithLabelValues("t")))
}

// TestNotifyWakesDispatcher: with polling effectively off, only the NOTIFY of the commit
// can make the dispatcher publish the new row.
func TestNotifyWakesDispatcher(t *testing.T) {
	ctx := context.Background()
	b := setup(t)
	batches := make(chan int, 100)
	d := b.dispatcher(t, outbox.DispatcherConfig{PollInterval: time.Hour, OnBatch: func(n int, _ error) { batches <- n }})
	require.NoError(t, d.Start(ctx))
	require.Zero(t, recv(t, batches, "first batch"), "the first, empty batch")

	stream := outbox.StreamKey(b.prefix, "t")
	last := "0-0"
	for i := 1; i <= 3; i++ {
		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		_, err = tx.Exec(ctx, `INSERT INTO outbox (event_key, topic, payload) VALUES ($1, 't', '{}')`, fmt.Sprintf("ev:%d", i))
		require.NoError(t, err)
		_, err = tx.Exec(ctx, `NOTIFY `+outbox.NotifyChannel)
		require.NoError(t, err)
		require.NoError(t, tx.Commit(ctx))

		res, err := b.rdb.XRead(ctx, &redis.XReadArgs{Streams: []string{stream, last}, Count: 100, Block: 30 * time.Second}).Result()
		require.NoError(t, err, "event %d not dispatched within 30s of its NOTIFY (hang guard)", i)
		require.Len(t, res, 1)
		require.Len(t, res[0].Messages, 1)
		require.Equal(t, fmt.Sprintf("ev:%d", i), res[0].Messages[0].Values[outbox.FieldEventKey])
		last = res[0].Messages[0].ID

		if i == 2 {
			// Kill the listening connection: the dispatcher reconnects, runs a batch for
			// what it may have missed meanwhile, and hears the next NOTIFY.
			for len(batches) > 0 {
				<-batches
			}
			var killed bool
			require.NoError(t, b.pool.QueryRow(ctx, `SELECT bool_or(pg_terminate_backend(pid)) FROM pg_stat_activity
				WHERE datname = current_database() AND query ILIKE 'LISTEN%'`).Scan(&killed))
			require.True(t, killed, "a LISTEN connection to kill")
			recv(t, batches, "the batch after the listener reconnected")
		}
	}
}

// publish commits n events ev:<from>… on topic and dispatches them.
func (b *bundle) publish(t testing.TB, topic string, from, n int) {
	t.Helper()
	insertEvents(t, b.pool, topic, from, n)
	d, err := outbox.NewDispatcher(b.pool, b.rdb, &outbox.DispatcherConfig{Prefix: b.prefix, Registerer: b.reg, Logger: b.log})
	require.NoError(t, err)
	sent, err := d.DispatchOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, n, sent)
}

// TestPendingReclaimed: a consumer reads entries and dies without acknowledging them;
// another consumer of the group reclaims them after MinIdle and handles them.
func TestPendingReclaimed(t *testing.T) {
	const (
		topic  = "t"
		group  = "g"
		events = 20
	)
	b := setup(t)
	b.publish(t, topic, 1, events)

	// A reads the whole batch; its first handler call "crashes" the consumer.
	dead := b.consumer(t, outbox.ConsumerConfig{Topic: topic, Group: group, Consumer: "A", MinIdle: time.Hour})
	var aCalls atomic.Int32
	aCalled := make(chan struct{}, events)
	stopA := runConsumer(t, func(ctx context.Context) error {
		ctx, die := context.WithCancel(ctx)
		defer die()
		return dead.Run(ctx, func(context.Context, outbox.Event) error {
			aCalls.Add(1)
			die()
			aCalled <- struct{}{}
			return errInjected
		})
	})
	stream := outbox.StreamKey(b.prefix, topic)
	// Wait for the handler call itself: XREADGROUP hands A every entry before its handler
	// runs, so "A holds every entry" alone can be seen with no call made yet.
	recv(t, aCalled, "A's handler call")
	stopA()
	require.Equal(t, int32(1), aCalls.Load(), "A stops after its first (failed) call")
	p, err := b.rdb.XPending(context.Background(), stream, group).Result()
	require.NoError(t, err)
	require.Equal(t, int64(events), p.Consumers["A"], "A died holding every entry")

	got := make(chan outbox.Event, events)
	heir := b.consumer(t, outbox.ConsumerConfig{Topic: topic, Group: group, Consumer: "B",
		MinIdle: 200 * time.Millisecond, ReclaimInterval: 50 * time.Millisecond, Block: 50 * time.Millisecond})
	stopB := runConsumer(t, func(ctx context.Context) error {
		return heir.Run(ctx, func(_ context.Context, ev outbox.Event) error {
			got <- ev
			return nil
		})
	})
	seen := map[string]int{}
	for len(seen) < events {
		ev := recv(t, got, "a reclaimed event")
		seen[ev.EventKey]++
		require.Equal(t, 2, ev.Delivery, "delivered to A, then claimed by B: %+v", ev)
	}
	waitFor(t, 30*time.Second, nil, "B acknowledged everything", func() bool { return groupDone(t, b.rdb, stream, group) })
	stopB()
	for k, n := range seen {
		require.Equal(t, 1, n, k)
	}
	require.Equal(t, float64(events), ptu.ToFloat64(heir.Metrics().Claimed.WithLabelValues(group)))
	require.Zero(t, ptu.ToFloat64(heir.Metrics().Deduplicated.WithLabelValues(group)))
}

// TestConsumerLedgerMarksAfterSuccess: in Run mode a failed handler is not marked, so its
// event is redelivered and handled; an event handled successfully and then republished is
// skipped and counted as deduplicated.
func TestConsumerLedgerMarksAfterSuccess(t *testing.T) {
	ctx := context.Background()
	const (
		topic = "t"
		group = "g"
	)
	b := setup(t)
	b.publish(t, topic, 1, 5)

	type call struct {
		key      string
		delivery int
		err      bool
	}
	calls := make(chan call, 100)
	batches := make(chan outbox.BatchReport, 100)
	failed := map[string]bool{}
	c := b.consumer(t, outbox.ConsumerConfig{Topic: topic, Group: group,
		MinIdle: 200 * time.Millisecond, ReclaimInterval: 50 * time.Millisecond, Block: 50 * time.Millisecond,
		OnBatch: func(r outbox.BatchReport) { batches <- r }})
	stop := runConsumer(t, func(ctx context.Context) error {
		return c.Run(ctx, func(_ context.Context, ev outbox.Event) error {
			if ev.EventKey == "ev:2" && !failed[ev.EventKey] {
				failed[ev.EventKey] = true
				calls <- call{ev.EventKey, ev.Delivery, true}
				return errInjected
			}
			calls <- call{ev.EventKey, ev.Delivery, false}
			return nil
		})
	})

	var got []call
	for len(got) < 6 {
		got = append(got, recv(t, calls, "handler call"))
	}
	want := []call{{"ev:1", 1, false}, {"ev:2", 1, true}, {"ev:3", 1, false}, {"ev:4", 1, false}, {"ev:5", 1, false},
		{"ev:2", 2, false}} // redelivered by the reclaim, and handled
	if diff := cmp.Diff(want, got, cmp.AllowUnexported(call{})); diff != "" {
		t.Fatalf("handler calls (-want +got):\n%s", diff)
	}
	stream := outbox.StreamKey(b.prefix, topic)
	waitFor(t, 30*time.Second, nil, "all acknowledged", func() bool { return groupDone(t, b.rdb, stream, group) })
	for i := 1; i <= 5; i++ {
		key := outbox.LedgerKey(b.prefix, stream, group, fmt.Sprintf("ev:%d", i))
		ttl, err := b.rdb.TTL(ctx, key).Result()
		require.NoError(t, err)
		require.Greater(t, ttl, outbox.DefaultLedgerTTL-time.Minute, "ledger mark %s with its TTL", key)
	}
	require.Zero(t, ptu.ToFloat64(c.Metrics().Deduplicated.WithLabelValues(group)))

	// Replay ev:4 and ev:5 as a dispatcher whose position update failed would.
	rewindBefore(t, b.pool, "ev:4")
	for len(batches) > 0 {
		<-batches
	}
	d := b.dispatcher(t, outbox.DispatcherConfig{})
	n, err := d.DispatchOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, n)
	dedup := 0
	for dedup < 2 {
		r := recv(t, batches, "the replays' batch")
		dedup += r.Deduplicated
		require.Zero(t, r.Handled, "a replay must not reach the handler")
		require.Equal(t, r.Entries, r.Acked)
	}
	stop()
	require.Empty(t, calls, "no handler call for the replays")
	require.Equal(t, 2.0, ptu.ToFloat64(c.Metrics().Deduplicated.WithLabelValues(group)))
	require.Equal(t, 7, added(t, b.rdb, stream), "5 events and 2 replays appended")
}

// TestConsumerRunTx covers the inbox mode's failure path: a handler error rolls the inbox
// mark back together with the side effect, so the redelivery runs the handler again.
func TestConsumerRunTx(t *testing.T) {
	const (
		topic = "t"
		group = "g"
	)
	b := setup(t)
	exec(t, b.pool, `CREATE TABLE side_effects (event_key text PRIMARY KEY)`)
	b.publish(t, topic, 1, 3)
	var calls []string
	handled := make(chan struct{}, 100)
	c := b.consumer(t, outbox.ConsumerConfig{Topic: topic, Group: group,
		MinIdle: 200 * time.Millisecond, ReclaimInterval: 50 * time.Millisecond, Block: 50 * time.Millisecond})
	stop := runConsumer(t, func(ctx context.Context) error {
		return c.RunTx(ctx, b.pool, func(ctx context.Context, tx pgx.Tx, ev outbox.Event) error {
			calls = append(calls, ev.EventKey)
			if _, err := tx.Exec(ctx, `INSERT INTO side_effects VALUES ($1)`, ev.EventKey); err != nil {
				return err
			}
			if ev.EventKey == "ev:2" && ev.Delivery == 1 {
				return errInjected // after the side effect: both must roll back
			}
			handled <- struct{}{}
			return nil
		})
	})
	for i := 0; i < 3; i++ {
		recv(t, handled, "handled event")
	}
	stream := outbox.StreamKey(b.prefix, topic)
	waitFor(t, 30*time.Second, nil, "all acknowledged", func() bool { return groupDone(t, b.rdb, stream, group) })
	stop()
	require.Equal(t, []string{"ev:1", "ev:2", "ev:3", "ev:2"}, calls)
	require.Equal(t, []string{"(ev:1)", "(ev:2)", "(ev:3)"}, testutil.TableSnapshot(t, b.pool, "side_effects"))
	require.Equal(t, 3, count(t, b.pool, `SELECT count(*) FROM outbox_inbox WHERE consumer_group = $1 AND stream_id IS NOT NULL`, group))
}

// TestTrimKeepsPending: the Trimmer trims the topic's stream (its key under the prefix)
// with lua.TrimStream: only entries every group delivered and acknowledged go. The
// script's cases (no group, undelivered entries, the slowest group, a group that read
// nothing, the floor it reports) are lua.TestTrimStream's; here one stream with a pending
// entry shows the wiring.
func TestTrimKeepsPending(t *testing.T) {
	ctx := context.Background()
	t.Run("OldestPendingIsTheFloor", func(t *testing.T) {
		ns := testutil.Redis(t)
		stream := outbox.StreamKey(ns.Prefix, "t")
		ids := make([]string, 10)
		for i := range ids {
			id, err := ns.Client.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []any{"i", i}}).Result()
			require.NoError(t, err)
			ids[i] = id
		}
		require.NoError(t, ns.Client.XGroupCreate(ctx, stream, "g", "0").Err())
		require.NoError(t, ns.Client.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "c",
			Streams: []string{stream, ">"}, Count: 10, Block: -1}).Err())
		require.NoError(t, ns.Client.XAck(ctx, stream, "g", ids[0], ids[1], ids[2], ids[5], ids[8]).Err())

		tr, err := outbox.NewTrimmer(ns.Client, &outbox.TrimmerConfig{Prefix: ns.Prefix})
		require.NoError(t, err)
		n, err := tr.Trim(ctx, "t")
		require.NoError(t, err)
		require.Equal(t, int64(3), n, "entries 0–2: the oldest pending (3) is the floor")
		msgs, err := ns.Client.XRange(ctx, stream, "-", "+").Result()
		require.NoError(t, err)
		require.Len(t, msgs, 7)
		require.Equal(t, ids[3], msgs[0].ID)
	})

	t.Run("NoStream", func(t *testing.T) {
		ns := testutil.Redis(t)
		tr, err := outbox.NewTrimmer(ns.Client, &outbox.TrimmerConfig{Prefix: ns.Prefix})
		require.NoError(t, err)
		n, err := tr.Trim(ctx, "missing")
		require.NoError(t, err)
		require.Zero(t, n)
	})

	t.Run("DispatcherTrimConsumed", func(t *testing.T) {
		b := setup(t)
		d := b.dispatcher(t, outbox.DispatcherConfig{Trim: outbox.TrimConsumed, TrimInterval: time.Nanosecond})
		stream := outbox.StreamKey(b.prefix, "t")
		require.NoError(t, b.rdb.XGroupCreateMkStream(ctx, stream, "g", "0").Err())
		insertEvents(t, b.pool, "t", 1, 5)
		_, err := d.DispatchOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 5, xlen(t, b.rdb, stream), "nothing delivered yet: nothing trimmed")
		res, err := b.rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "c", Streams: []string{stream, ">"}, Count: 5, Block: -1}).Result()
		require.NoError(t, err)
		msgs := res[0].Messages
		require.NoError(t, b.rdb.XAck(ctx, stream, "g", msgs[0].ID, msgs[1].ID, msgs[3].ID).Err())
		insertEvents(t, b.pool, "t", 6, 1)
		_, err = d.DispatchOnce(ctx)
		require.NoError(t, err)
		// Kept: entry 2 (pending) and everything after it, including 3 (acked but above the floor).
		require.Equal(t, 4, xlen(t, b.rdb, stream))
	})

	t.Run("LostWhilePending", func(t *testing.T) {
		b := setup(t)
		const group = "g"
		b.publish(t, "t", 1, 3)
		stream := outbox.StreamKey(b.prefix, "t")
		require.NoError(t, b.rdb.XGroupCreate(ctx, stream, group, "0").Err())
		res, err := b.rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: group, Consumer: "dead", Streams: []string{stream, ">"}, Count: 3, Block: -1}).Result()
		require.NoError(t, err)
		msgs := res[0].Messages
		require.NoError(t, b.rdb.XDel(ctx, stream, msgs[1].ID).Err(), "deleted while pending")

		lost := make(chan []string, 10)
		handled := make(chan string, 10)
		c := b.consumer(t, outbox.ConsumerConfig{Topic: "t", Group: group,
			MinIdle: 100 * time.Millisecond, ReclaimInterval: 50 * time.Millisecond, Block: 50 * time.Millisecond,
			OnLost: func(ids []string) { lost <- ids }})
		stop := runConsumer(t, func(ctx context.Context) error {
			return c.Run(ctx, func(_ context.Context, ev outbox.Event) error {
				handled <- ev.EventKey
				return nil
			})
		})
		require.Equal(t, []string{msgs[1].ID}, recv(t, lost, "OnLost"))
		require.ElementsMatch(t, []string{"ev:1", "ev:3"}, []string{recv(t, handled, "event"), recv(t, handled, "event")})
		waitFor(t, 30*time.Second, nil, "nothing pending", func() bool {
			p, err := b.rdb.XPending(ctx, stream, group).Result()
			return err == nil && p.Count == 0
		})
		stop()
		require.Equal(t, 1.0, ptu.ToFloat64(c.Metrics().Lost.WithLabelValues(group)))
		require.Equal(t, 2.0, ptu.ToFloat64(c.Metrics().Claimed.WithLabelValues(group)))
	})
}

func TestConsumerConfig(t *testing.T) {
	tests := []struct {
		name string
		cfg  outbox.ConsumerConfig
		want string
	}{
		{"NoGroup", outbox.ConsumerConfig{Topic: "t"}, "Group"},
		{"NoStream", outbox.ConsumerConfig{Group: "g"}, "Topic or Stream"},
		{"NegativeBatch", outbox.ConsumerConfig{Topic: "t", Group: "g", BatchSize: -1}, "BatchSize"},
		{"NegativeMinIdle", outbox.ConsumerConfig{Topic: "t", Group: "g", MinIdle: -1}, "MinIdle"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			require.ErrorContains(t, tt.cfg.Validate(), tt.want)
		})
	}
	ns := testutil.Redis(t)
	c, err := outbox.NewConsumer(ns.Client, &outbox.ConsumerConfig{Topic: "t", Group: "g"})
	require.NoError(t, err)
	require.Equal(t, outbox.DefaultPrefix+"stream:{t}", c.Stream())
	require.NotEmpty(t, c.Name(), "a generated consumer name")
	require.Error(t, c.Run(context.Background(), nil))
}

// recv receives from ch, or fails the test after 30 s (a hang guard, not a timing check).
func recv[T any](t testing.TB, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(30 * time.Second):
		t.Fatalf("timed out after 30s waiting for %s", what)
		panic("unreachable")
	}
}

func TestInboxPrune(t *testing.T) {
	ctx := context.Background()
	b := setup(t)
	exec(t, b.pool, `INSERT INTO outbox_inbox (consumer_group, event_key, seen_at)
		SELECT 'g', 'old:' || g, now() - interval '8 days' FROM generate_series(1, 5) AS g`)
	exec(t, b.pool, `INSERT INTO outbox_inbox (consumer_group, event_key) VALUES ('g', 'new:1')`)
	n, err := outbox.InboxPrune(ctx, b.pool, 7*24*time.Hour, 3)
	require.NoError(t, err)
	require.Equal(t, int64(3), n, "bounded by limit")
	n, err = outbox.InboxPrune(ctx, b.pool, 7*24*time.Hour, 3)
	require.NoError(t, err)
	require.Equal(t, int64(2), n)
	var keys []string
	rows, err := b.pool.Query(ctx, `SELECT event_key FROM outbox_inbox`)
	require.NoError(t, err)
	keys, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"new:1"}, keys, "recent marks stay")
}

// TestStopFinishesInFlightBatch: stopping the dispatcher mid-batch (a worker's SIGTERM)
// lets the batch finish: its rows, already on the stream, are marked sent, not rolled back
// and published a second time.
func TestStopFinishesInFlightBatch(t *testing.T) {
	b := setup(t)
	insertEvents(t, b.pool, "stop", 1, 5)
	inBatch, proceed := make(chan struct{}), make(chan struct{})
	var once sync.Once
	d := b.dispatcher(t, outbox.DispatcherConfig{DisableNotify: true, AfterPublish: func([]int64) error {
		once.Do(func() { close(inBatch) })
		<-proceed
		return nil
	}})
	ctx, cancel := context.WithCancel(context.Background())
	require.NoError(t, d.Start(ctx))
	<-inBatch // the batch is on the stream, not yet marked sent
	cancel()  // shutdown: the loop's context ends mid-batch
	close(proceed)
	d.Stop()
	require.Equal(t, 5, count(t, b.pool, `SELECT count(*)::int FROM outbox_sent`), "the in-flight batch was marked sent")
	require.Equal(t, 5, xlen(t, b.rdb, outbox.StreamKey(b.prefix, "stop")), "published once")
	require.Zero(t, ptu.ToFloat64(d.Metrics().Republished.WithLabelValues("stop")))
}

// markAllSent moves every topic's position past its last row, as dispatchers of an earlier
// run that published them all would have left it.
func markAllSent(t testing.TB, pool *pgxpool.Pool) {
	t.Helper()
	exec(t, pool, `INSERT INTO outbox_positions (topic, xid, id)
		SELECT DISTINCT ON (topic) topic, xid, id FROM outbox ORDER BY topic, xid DESC, id DESC
		ON CONFLICT (topic) DO UPDATE SET xid = excluded.xid, id = excluded.id`)
}

// rewindBefore moves the position of key's topic back to just before key's row, as a
// dispatcher whose batch rolled back after publishing would have left it, and returns a
// function that puts the position back where it was.
func rewindBefore(t testing.TB, pool *pgxpool.Pool, key string) (restore func()) {
	t.Helper()
	var topic, xid string
	var id int64
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT p.topic, p.xid::text, p.id FROM outbox_positions p
		JOIN outbox o ON o.topic = p.topic WHERE o.event_key = $1`, key).Scan(&topic, &xid, &id))
	exec(t, pool, `UPDATE outbox_positions p SET xid = o.xid, id = o.id - 1 FROM outbox o
		WHERE o.event_key = $1 AND p.topic = o.topic`, key)
	return func() {
		t.Helper()
		exec(t, pool, `UPDATE outbox_positions SET xid = $2::xid8, id = $3 WHERE topic = $1`, topic, xid, id)
	}
}

// replayRow publishes key's row once more (a batch of one after its position was moved
// back, then the position is put back): a replay of that event alone.
func replayRow(t testing.TB, b *bundle, key string) {
	t.Helper()
	restore := rewindBefore(t, b.pool, key)
	d, err := outbox.NewDispatcher(b.pool, b.rdb, &outbox.DispatcherConfig{Prefix: b.prefix, BatchSize: 1, Registerer: b.reg, Logger: b.log})
	require.NoError(t, err)
	n, err := d.DispatchOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1, n)
	restore()
}
