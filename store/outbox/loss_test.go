package outbox_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	ptu "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store/outbox"
	"github.com/idemscrape/idemscrape/testutil"
)

// drain runs DispatchOnce until a batch comes back empty and returns the rows it marked
// sent.
func drain(t testing.TB, d *outbox.Dispatcher) int {
	t.Helper()
	total := 0
	for {
		n, err := d.DispatchOnce(context.Background())
		require.NoError(t, err)
		if n == 0 {
			return total
		}
		total += n
	}
}

// lossBundle is a bundle on a throwaway redis-server of the test's own (it is wiped).
func lossBundle(t *testing.T) (*bundle, *testutil.RedisServer) {
	t.Helper()
	srv := testutil.StartRedis(t)
	b := setup(t)
	b.rdb = srv.Client()
	return b, srv
}

// TestRedisLossRepublished: events dispatched but not yet consumed when Redis loses its
// data are published again, and an inbox consumer takes each event exactly once in
// effect. The consumer keeps running through the loss (held inside its OnBatch while the
// data is wiped and the stream refilled) and starts at "$": it reads the republished
// entries only if it recreates its vanished group at the beginning of the new stream.
func TestRedisLossRepublished(t *testing.T) {
	const (
		topic  = "t"
		group  = "effects"
		before = 200 // dispatched before the loss; the consumer handles its first batch only
		after  = 20  // committed after the loss
	)
	for _, tc := range []struct {
		name string
		// wipe loses Redis's data; freshDispatcher: the dispatcher after the loss is a new
		// process (it never saw the marker: the loss is told by PostgreSQL's epoch row),
		// started only once the consumer has recreated its group and the stream (MKSTREAM,
		// empty).
		wipe            func(srv *testutil.RedisServer, rdb redis.UniversalClient)
		freshDispatcher bool
	}{
		{"FlushAllRunningDispatcher", func(_ *testutil.RedisServer, rdb redis.UniversalClient) {
			require.NoError(t, rdb.FlushAll(context.Background()).Err()) // the test's own server
		}, false},
		{"RestartFreshDispatcherAfterGroupRecreated", func(srv *testutil.RedisServer, _ redis.UniversalClient) {
			srv.Restart()
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, srv := lossBundle(t)
			ctx := context.Background()
			exec(t, b.pool, `CREATE TABLE side_effects (id bigserial PRIMARY KEY, event_key text NOT NULL)`)
			stream := outbox.StreamKey(b.prefix, topic)

			d := b.dispatcher(t, outbox.DispatcherConfig{BatchSize: 64})
			gate := make(chan struct{})
			held := make(chan outbox.BatchReport, 1)
			var once sync.Once
			c := b.consumer(t, outbox.ConsumerConfig{Topic: topic, Group: group, StartID: "$", BatchSize: 50,
				Block: 50 * time.Millisecond, MinIdle: time.Hour, RetryBackoff: 10 * time.Millisecond, RetryBackoffMax: 50 * time.Millisecond,
				OnBatch: func(r outbox.BatchReport) {
					once.Do(func() { held <- r; <-gate }) // hold the consumer after its first batch
				}})
			runConsumer(t, func(ctx context.Context) error {
				return c.RunTx(ctx, b.pool, func(ctx context.Context, tx pgx.Tx, ev outbox.Event) error {
					_, err := tx.Exec(ctx, `INSERT INTO side_effects (event_key) VALUES ($1)`, ev.EventKey)
					return err
				})
			})
			// The group exists (at "$") before anything is published.
			waitFor(t, 30*time.Second, nil, "consumer group created", func() bool {
				groups, err := b.rdb.XInfoGroups(ctx, stream).Result()
				return err == nil && len(groups) == 1
			})
			var releaseOnce sync.Once
			release := func() { releaseOnce.Do(func() { close(gate) }) }
			t.Cleanup(release) // before the consumer's stop (cleanups run last first)
			insertEvents(t, b.pool, topic, 1, before)
			require.Equal(t, before, drain(t, d))
			first := recv(t, held, "the consumer's first batch")
			consumed := first.Handled // 1 … 50: the rest is still unconsumed in the stream
			require.Positive(t, consumed)
			require.Equal(t, consumed, count(t, b.pool, `SELECT count(*) FROM side_effects`))

			tc.wipe(srv, b.rdb)
			insertEvents(t, b.pool, topic, before+1, after)
			if tc.freshDispatcher {
				release() // the consumer finds its group gone and recreates it and the stream
				waitFor(t, 30*time.Second, nil, "group recreated on an empty stream", func() bool {
					groups, err := b.rdb.XInfoGroups(ctx, stream).Result()
					return err == nil && len(groups) == 1
				})
				require.Zero(t, xlen(t, b.rdb, stream))
				d = b.dispatcher(t, outbox.DispatcherConfig{BatchSize: 64}) // never saw the marker
			}
			require.Equal(t, before+after, drain(t, d), "every event sent before the loss republished, and the new ones")
			if !tc.freshDispatcher {
				release() // the stream is full again before the consumer looks
			}

			waitFor(t, 60*time.Second, nil, "every event took effect", func() bool {
				return count(t, b.pool, `SELECT count(DISTINCT event_key) FROM side_effects`) == before+after
			}, func() string {
				return fmt.Sprintf("%d distinct effects, stream length %d", count(t, b.pool, `SELECT count(DISTINCT event_key) FROM side_effects`), xlen(t, b.rdb, stream))
			})
			waitFor(t, 30*time.Second, nil, "all acknowledged", func() bool { return groupDone(t, b.rdb, stream, group) })
			assert.Equal(t, before+after, count(t, b.pool, `SELECT count(*) FROM side_effects`), "exactly once in effect")
			assert.Equal(t, consumed, count(t, b.pool, `SELECT COALESCE(sum(replays), 0)::int FROM outbox_inbox WHERE consumer_group = $1`, group),
				"the events consumed before the loss were recognised as replays")
			assert.Equal(t, float64(before), ptu.ToFloat64(d.Metrics().Remarked.WithLabelValues(topic)))
			assert.Equal(t, 1.0, ptu.ToFloat64(d.Metrics().StreamsLost.WithLabelValues(topic)))
			assert.Equal(t, before+after, added(t, b.rdb, stream), "each event once in the new stream")
		})
	}
}

// TestNoRecoveryWithoutLoss: nothing is re-marked unless Redis lost data: not on a stream
// trimmed empty, not when more dispatchers (new processes, which never saw the marker)
// start, not on a stream without a marker whose history is intact (an upgrade from a
// version without markers), not on a group created on an empty stream before anything
// was published.
func TestNoRecoveryWithoutLoss(t *testing.T) {
	const (
		topic = "t"
		group = "g"
	)
	b := setup(t)
	ctx := context.Background()
	stream := outbox.StreamKey(b.prefix, topic)
	// A consumer creates the group and the (empty) stream before anything is published.
	c := b.consumer(t, outbox.ConsumerConfig{Topic: topic, Group: group, Block: 20 * time.Millisecond,
		MinIdle: time.Hour})
	runConsumer(t, func(ctx context.Context) error {
		return c.Run(ctx, func(context.Context, outbox.Event) error { return nil })
	})
	waitFor(t, 30*time.Second, nil, "group created", func() bool { return groupDone(t, b.rdb, stream, group) })

	var dispatchers []*outbox.Dispatcher
	published := 0
	round := func(what string, n int) {
		t.Helper()
		insertEvents(t, b.pool, topic, published+1, n)
		// TrimNever: the Trimmer below trims by hand, and must find everything consumed.
		d := b.dispatcher(t, outbox.DispatcherConfig{BatchSize: 7, Trim: outbox.TrimNever})
		dispatchers = append(dispatchers, d)
		got := 0
		for _, d := range dispatchers { // every dispatcher so far takes part
			got += drain(t, d)
			recovered, err := d.CheckStreams(ctx)
			require.NoError(t, err)
			require.Empty(t, recovered, "%s: nothing to recover", what)
		}
		published += n
		require.Equal(t, n, got, "%s: only the new rows sent", what)
		waitFor(t, 30*time.Second, nil, what+": consumed", func() bool { return groupDone(t, b.rdb, stream, group) })
	}

	round("first dispatcher, group created on an empty stream", 20)
	round("second dispatcher starting", 15)

	tr, err := outbox.NewTrimmer(b.rdb, &outbox.TrimmerConfig{Prefix: b.prefix})
	require.NoError(t, err)
	trimmed, err := tr.Trim(ctx, topic)
	require.NoError(t, err)
	require.EqualValues(t, 35, trimmed)
	require.Zero(t, xlen(t, b.rdb, stream), "trimmed empty")
	round("stream trimmed empty", 10)

	// No epoch in PostgreSQL and no marker, as after an upgrade from a version without
	// epochs, found by new processes. (A marker gone while PostgreSQL holds the epoch is a
	// loss, by design: see TestRedisLossRepublished.)
	m := dispatchers[0].Metrics() // the registry is shared: totals of every dispatcher
	exec(t, b.pool, `DELETE FROM outbox_epochs`)
	require.NoError(t, b.rdb.Del(ctx, outbox.EpochKey(b.prefix, topic)).Err())
	dispatchers = nil
	round("no epoch anywhere (upgrade), new dispatcher", 5)
	round("and another one", 5)

	require.Zero(t, ptu.ToFloat64(m.Remarked.WithLabelValues(topic)))
	require.Zero(t, ptu.ToFloat64(m.StreamsLost.WithLabelValues(topic)))
	require.Equal(t, published, count(t, b.pool, `SELECT count(*) FROM outbox_sent`))
	info, err := b.rdb.XInfoStream(ctx, stream).Result()
	require.NoError(t, err)
	require.EqualValues(t, published, info.EntriesAdded, "each event appended once")
	marker := b.rdb.Get(ctx, outbox.EpochKey(b.prefix, topic)).Val()
	require.NotEmpty(t, marker, "marker created again")
	require.Equal(t, marker, pgEpoch(t, b, topic), "PostgreSQL holds the marker's epoch")
}

// pgEpoch is the epoch PostgreSQL holds for topic under the bundle's prefix ("" none).
func pgEpoch(t testing.TB, b *bundle, topic string) string {
	t.Helper()
	var epoch string
	err := b.pool.QueryRow(context.Background(), `SELECT COALESCE(max(epoch), '') FROM outbox_epochs WHERE prefix = $1 AND topic = $2`,
		b.prefix, topic).Scan(&epoch)
	require.NoError(t, err)
	return epoch
}

// TestUpgradeRemarksNothing: the first dispatcher of this version finds rows sent by the
// previous one (to streams under the old key names) and an empty stream under the new key,
// with no epoch in PostgreSQL nor in Redis. It publishes only the new event and re-marks
// nothing. Also when a marker exists without PostgreSQL's row (a first start that crashed
// between the two): the marker is adopted.
func TestUpgradeRemarksNothing(t *testing.T) {
	for _, tc := range []struct {
		name   string
		marker string // present before the first start; "" none
	}{
		{"NoEpochAnywhere", ""},
		{"MarkerWithoutRow", "left-by-a-crashed-first-start"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, _ := lossBundle(t)
			ctx := context.Background()
			const topic = "t"
			insertEvents(t, b.pool, topic, 1, 10)
			markAllSent(t, b.pool) // sent by the previous run
			if tc.marker != "" {
				require.NoError(t, b.rdb.Set(ctx, outbox.EpochKey(b.prefix, topic), tc.marker, 0).Err())
			}
			insertEvents(t, b.pool, topic, 11, 1)

			d := b.dispatcher(t, outbox.DispatcherConfig{})
			require.Equal(t, 1, drain(t, d), "only the new event")
			recovered, err := d.CheckStreams(ctx)
			require.NoError(t, err)
			require.Empty(t, recovered)
			require.Zero(t, ptu.ToFloat64(d.Metrics().Remarked.WithLabelValues(topic)))
			require.Zero(t, ptu.ToFloat64(d.Metrics().StreamsLost.WithLabelValues(topic)))
			require.Equal(t, 1, xlen(t, b.rdb, outbox.StreamKey(b.prefix, topic)))
			require.Equal(t, 11, count(t, b.pool, `SELECT count(*) FROM outbox_sent`))
			marker := b.rdb.Get(ctx, outbox.EpochKey(b.prefix, topic)).Val()
			require.Equal(t, marker, pgEpoch(t, b, topic))
			if tc.marker != "" {
				require.Equal(t, tc.marker, marker, "the marker adopted")
			}
		})
	}
}

// TestStaleMarkerIsLoss: a marker holding an epoch other than PostgreSQL's (Redis came back
// from a snapshot older than the last recovery) is a loss; so is a marker deleted by hand
// under a dispatcher that never saw it (a new process).
func TestStaleMarkerIsLoss(t *testing.T) {
	for _, tc := range []struct {
		name   string
		tamper func(rdb redis.UniversalClient, key string) error
	}{
		{"OlderEpoch", func(rdb redis.UniversalClient, key string) error {
			return rdb.Set(context.Background(), key, "an-older-epoch", 0).Err()
		}},
		{"Deleted", func(rdb redis.UniversalClient, key string) error {
			return rdb.Del(context.Background(), key).Err()
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, _ := lossBundle(t)
			ctx := context.Background()
			const topic = "t"
			insertEvents(t, b.pool, topic, 1, 10)
			require.Equal(t, 10, drain(t, b.dispatcher(t, outbox.DispatcherConfig{})))
			before := pgEpoch(t, b, topic)
			require.NoError(t, tc.tamper(b.rdb, outbox.EpochKey(b.prefix, topic)))

			d := b.dispatcher(t, outbox.DispatcherConfig{}) // a new process
			recovered, err := d.CheckStreams(ctx)
			require.NoError(t, err)
			require.Equal(t, []string{topic}, recovered)
			require.Equal(t, 10, drain(t, d), "republished")
			require.Equal(t, 10.0, ptu.ToFloat64(d.Metrics().Remarked.WithLabelValues(topic)))
			after := pgEpoch(t, b, topic)
			require.NotEqual(t, before, after, "a new epoch")
			require.Equal(t, after, b.rdb.Get(ctx, outbox.EpochKey(b.prefix, topic)).Val())
			recovered, err = d.CheckStreams(ctx)
			require.NoError(t, err)
			require.Empty(t, recovered, "settled")
		})
	}
}

// TestConcurrentSettle: two dispatchers that both find a topic unsettled at once (their
// batches rolled back, both about to settle) settle it once: on a fresh topic neither
// takes the other's first epoch for a loss; after a wipe exactly one recovers.
func TestConcurrentSettle(t *testing.T) {
	const topic = "t"
	for _, wipe := range []bool{false, true} {
		t.Run(fmt.Sprintf("wipe=%v", wipe), func(t *testing.T) {
			b, _ := lossBundle(t)
			ctx := context.Background()
			const before, after = 30, 20
			if wipe {
				insertEvents(t, b.pool, topic, 1, before)
				require.Equal(t, before, drain(t, b.dispatcher(t, outbox.DispatcherConfig{})))
				require.NoError(t, b.rdb.FlushAll(ctx).Err()) // the test's own server
			}
			insertEvents(t, b.pool, topic, before+1, after)

			// Both dispatchers wait for each other between their rolled-back batch and
			// their settlement, so both settle the same unsettled topic. The dispatchers of
			// a topic take turns on its position: the second starts once the first's batch
			// rolled back (it waits in its hook), so it finds the topic free and unsettled.
			var arrived sync.WaitGroup
			arrived.Add(2)
			var hooked [2]int
			first := make(chan struct{})
			ds := make([]*outbox.Dispatcher, 2)
			for i := range ds {
				ds[i] = b.dispatcher(t, outbox.DispatcherConfig{BatchSize: 5})
				outbox.SetBeforeSettle(ds[i], func(topics []string) {
					assert.Equal(t, []string{topic}, topics)
					hooked[i]++
					if hooked[i] == 1 {
						if i == 0 {
							close(first)
						}
						arrived.Done()
						arrived.Wait()
					}
				})
			}
			sent := make([]int, 2)
			var wg sync.WaitGroup
			for i, d := range ds {
				wg.Add(1)
				go func() {
					defer wg.Done()
					n, err := d.DispatchOnce(ctx)
					assert.NoError(t, err)
					sent[i] = n
				}()
				if i == 0 {
					recv(t, first, "the first dispatcher's batch rolled back, about to settle")
				}
			}
			wg.Wait()
			require.Equal(t, [2]int{1, 1}, hooked, "both found the topic unsettled and settled it")
			total := sent[0] + sent[1]
			for _, d := range ds {
				total += drain(t, d)
			}

			m := ds[0].Metrics() // shared registry
			want := after
			if wipe {
				want = before + after
				require.Equal(t, 1.0, ptu.ToFloat64(m.StreamsLost.WithLabelValues(topic)), "one recovery")
				require.Equal(t, float64(before), ptu.ToFloat64(m.Remarked.WithLabelValues(topic)), "each row re-marked once")
			} else {
				require.Zero(t, ptu.ToFloat64(m.StreamsLost.WithLabelValues(topic)))
				require.Zero(t, ptu.ToFloat64(m.Remarked.WithLabelValues(topic)))
			}
			require.Equal(t, want, total)
			require.Equal(t, want, xlen(t, b.rdb, outbox.StreamKey(b.prefix, topic)), "each event once in the stream")
			require.Equal(t, 1, count(t, b.pool, `SELECT count(*) FROM outbox_epochs`))
			require.Equal(t, pgEpoch(t, b, topic), b.rdb.Get(ctx, outbox.EpochKey(b.prefix, topic)).Val())
		})
	}
}

// TestKeysShareSlot: a topic's stream, its epoch marker and every consumer's ledger marks
// carry one hash tag (one Redis Cluster slot); ledger marks of two groups never collide.
func TestKeysShareSlot(t *testing.T) {
	tag := func(key string) string { // Redis Cluster's rule
		if i := strings.IndexByte(key, '{'); i >= 0 {
			if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
				return key[i+1 : i+1+j]
			}
		}
		return key
	}
	for _, topic := range []string{"catalog", "a:b", "", "x{y}", "}"} {
		stream := outbox.StreamKey("p:", topic)
		want := tag(stream)
		require.NotEqual(t, stream, want, "topic %q: the stream key has a hash tag", topic)
		require.Equal(t, want, tag(outbox.EpochKey("p:", topic)), "topic %q: epoch marker", topic)
		require.Equal(t, want, tag(outbox.LedgerKey("p:", stream, "g", "ev:1")), "topic %q: ledger", topic)
		require.Equal(t, want, tag(outbox.LedgerKey("p:", stream, "g}{", "ev:{1}")), "topic %q: ledger, braces in group and key", topic)
	}
	require.Equal(t, "p:stream:{catalog}", outbox.StreamKey("p:", "catalog"))
	require.Equal(t, "p:epoch:{catalog}", outbox.EpochKey("p:", "catalog"))
	require.Equal(t, "p:ledger:{catalog}:g:ev:1", outbox.LedgerKey("p:", "p:stream:{catalog}", "g", "ev:1"))
	// A stream given by a key without a tag: the ledger still has one tag of its own.
	require.Equal(t, "{plain}", "{"+tag(outbox.LedgerKey("p:", "plain", "g", "k"))+"}")
	require.NotEqual(t, outbox.LedgerKey("p:", "s", "a", "b:c"), outbox.LedgerKey("p:", "s", "a:b", "c"), "group boundary is unambiguous")
}

// TestPartialRedisLossRepublished: Redis comes back with an older copy of a stream (an RDB
// restored, a failover to a replica that lagged): the epoch marker is the one PostgreSQL
// holds, but the newest entries are gone. The dispatchers tell by the stream's
// entries-added, which is below what PostgreSQL recorded: the dispatcher that was running
// when its next batch comes, a new one by its idle check. The events are published again
// and an inbox consumer takes each once in effect; the ones it had consumed before are
// recognised as replays.
func TestPartialRedisLossRepublished(t *testing.T) {
	const (
		topic = "t"
		group = "effects"
		old   = 100 // in the stream when the snapshot was taken, consumed
		lost  = 30  // published after the snapshot, not consumed: lost with the restore
		later = 10  // committed after the restore
	)
	for _, tc := range []struct {
		name string
		// freshDispatcher: the loss is found by a new dispatcher's check (no batch to
		// dispatch), else by the running dispatcher's next batch.
		freshDispatcher bool
	}{
		{"RunningDispatcherNextBatch", false},
		{"FreshDispatcherIdleCheck", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, srv := lossBundle(t)
			ctx := context.Background()
			exec(t, b.pool, `CREATE TABLE side_effects (id bigserial PRIMARY KEY, event_key text NOT NULL)`)
			stream := outbox.StreamKey(b.prefix, topic)
			d := b.dispatcher(t, outbox.DispatcherConfig{BatchSize: 16, Trim: outbox.TrimNever})
			c := b.consumer(t, outbox.ConsumerConfig{Topic: topic, Group: group, StartID: "0", BatchSize: 50,
				Block: 20 * time.Millisecond, MinIdle: time.Hour})
			effect := func(ctx context.Context, tx pgx.Tx, ev outbox.Event) error {
				_, err := tx.Exec(ctx, `INSERT INTO side_effects (event_key) VALUES ($1)`, ev.EventKey)
				return err
			}
			effects := func() int { return count(t, b.pool, `SELECT count(*) FROM side_effects`) }

			insertEvents(t, b.pool, topic, 1, old)
			require.Equal(t, old, drain(t, d))
			stop := runConsumer(t, func(ctx context.Context) error { return c.RunTx(ctx, b.pool, effect) })
			waitFor(t, 60*time.Second, nil, "the first events took effect", func() bool { return effects() == old })
			waitFor(t, 30*time.Second, nil, "all acknowledged", func() bool { return groupDone(t, b.rdb, stream, group) })
			stop()
			snap := srv.Snapshot("before")

			insertEvents(t, b.pool, topic, old+1, lost)
			require.Equal(t, lost, drain(t, d))
			require.Equal(t, old+lost, added(t, b.rdb, stream))

			srv.RestoreSnapshot(snap)
			require.Equal(t, old, added(t, b.rdb, stream), "the restored stream lacks the newest entries")
			require.Equal(t, pgEpoch(t, b, topic), b.rdb.Get(ctx, outbox.EpochKey(b.prefix, topic)).Val(),
				"the marker survived: only the count tells")

			if tc.freshDispatcher {
				d = b.dispatcher(t, outbox.DispatcherConfig{BatchSize: 16, Trim: outbox.TrimNever})
				recovered, err := d.CheckStreams(ctx)
				require.NoError(t, err)
				require.Equal(t, []string{topic}, recovered)
				insertEvents(t, b.pool, topic, old+lost+1, later)
			} else {
				insertEvents(t, b.pool, topic, old+lost+1, later)
			}
			require.Equal(t, old+lost+later, drain(t, d), "every event sent within the recover window published again, and the new ones")
			recovered, err := d.CheckStreams(ctx)
			require.NoError(t, err)
			require.Empty(t, recovered, "recovered once")
			require.Equal(t, old+old+lost+later, added(t, b.rdb, stream))

			runConsumer(t, func(ctx context.Context) error { return c.RunTx(ctx, b.pool, effect) })
			waitFor(t, 60*time.Second, nil, "every event took effect", func() bool {
				return count(t, b.pool, `SELECT count(DISTINCT event_key) FROM side_effects`) == old+lost+later
			}, func() string {
				return fmt.Sprintf("%d distinct effects, %d stream entries", count(t, b.pool, `SELECT count(DISTINCT event_key) FROM side_effects`), xlen(t, b.rdb, stream))
			})
			waitFor(t, 30*time.Second, nil, "all acknowledged", func() bool { return groupDone(t, b.rdb, stream, group) })
			assert.Equal(t, old+lost+later, effects(), "exactly once in effect")
			assert.Equal(t, old, count(t, b.pool, `SELECT COALESCE(sum(replays), 0)::int FROM outbox_inbox WHERE consumer_group = $1`, group),
				"the events consumed before the restore were recognised as replays")
			assert.Equal(t, 1.0, ptu.ToFloat64(d.Metrics().StreamsLost.WithLabelValues(topic)))
			assert.Equal(t, float64(old+lost), ptu.ToFloat64(d.Metrics().Remarked.WithLabelValues(topic)))
		})
	}
}

// TestConcurrentDispatchersNoFalseLoss: dispatchers publishing to the same streams at once
// record what each stream has had added without ever finding a stream short: PostgreSQL's
// count is read before Redis's, and each batch's record is a count the stream had.
func TestConcurrentDispatchersNoFalseLoss(t *testing.T) {
	const (
		perTopic    = 600
		dispatchers = 4
		batch       = 5
	)
	topics := []string{"a", "b", "c"}
	b := setup(t)
	ctx := context.Background()
	// The topics interleaved in id order, so that batches span them.
	exec(t, b.pool, `INSERT INTO outbox (event_key, topic, payload)
		SELECT 'ev:' || g, ($1::text[])[g % 3 + 1], jsonb_build_object('n', g) FROM generate_series(1, $2::int) AS g`,
		topics, perTopic*len(topics))
	var ds []*outbox.Dispatcher
	for range dispatchers {
		ds = append(ds, b.dispatcher(t, outbox.DispatcherConfig{BatchSize: batch, Trim: outbox.TrimNever}))
	}
	var wg sync.WaitGroup
	sent := make([]int, dispatchers)
	errs := make([]error, dispatchers)
	for i, d := range ds {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				n, err := d.DispatchOnce(ctx)
				if err != nil {
					errs[i] = err
					return
				}
				if n == 0 {
					return
				}
				sent[i] += n
				if _, err := d.CheckStreams(ctx); err != nil {
					errs[i] = err
					return
				}
			}
		}()
	}
	wg.Wait()
	total := 0
	for i := range ds {
		require.NoError(t, errs[i])
		total += sent[i]
	}
	require.Equal(t, perTopic*len(topics), total)
	m := ds[0].Metrics() // one registry: every dispatcher's totals
	for _, topic := range topics {
		assert.Zero(t, ptu.ToFloat64(m.StreamsLost.WithLabelValues(topic)), topic)
		assert.Zero(t, ptu.ToFloat64(m.Remarked.WithLabelValues(topic)), topic)
		assert.Equal(t, perTopic, added(t, b.rdb, outbox.StreamKey(b.prefix, topic)), "each event once: %s", topic)
		var rec int
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT entries_added FROM outbox_epochs WHERE prefix = $1 AND topic = $2`, b.prefix, topic).Scan(&rec))
		// Each batch records the count it read right after its own XADDs: the batch that
		// appended last read the stream's whole count.
		assert.Equal(t, perTopic, rec, "PostgreSQL's count is the stream's: %s", topic)
	}
}

// TestPartialLossOverlappingDispatchers: several dispatchers of one topic (as one
// dispatcher per worker run under load) publish batches, taking turns on the topic's
// position (batches of one topic no longer overlap: a dispatcher that finds the position
// held takes nothing); Redis snapshots the stream after all but the last one's
// XADDs and comes back from that snapshot once every batch committed. The copy holds the
// other batches' entries, so it is longer than any single batch's view of the stream,
// but lacks the last batch's: the loss is found (by the running dispatchers' next batch,
// or by a new dispatcher's idle check), every event marked sent is in the stream again,
// and an inbox consumer takes each effect once.
func TestPartialLossOverlappingDispatchers(t *testing.T) {
	const (
		topic = "t"
		group = "effects"
		old   = 20 // published and consumed before the overlapping batches
		batch = 10
		later = 5 // committed after the restore
	)
	for _, tc := range []struct {
		name        string
		dispatchers int
		// freshDispatcher: the loss is found by a new dispatcher's check, else by the
		// running dispatchers' next batch.
		freshDispatcher bool
	}{
		{"TwoDispatchersNextBatch", 2, false},
		{"ThreeDispatchersFreshIdleCheck", 3, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, srv := lossBundle(t)
			ctx := context.Background()
			exec(t, b.pool, `CREATE TABLE side_effects (id bigserial PRIMARY KEY, event_key text NOT NULL)`)
			stream := outbox.StreamKey(b.prefix, topic)
			cfg := outbox.DispatcherConfig{BatchSize: batch, Trim: outbox.TrimNever}
			c := b.consumer(t, outbox.ConsumerConfig{Topic: topic, Group: group, StartID: "0", BatchSize: 50,
				Block: 20 * time.Millisecond, MinIdle: time.Hour})
			effect := func(ctx context.Context, tx pgx.Tx, ev outbox.Event) error {
				_, err := tx.Exec(ctx, `INSERT INTO side_effects (event_key) VALUES ($1)`, ev.EventKey)
				return err
			}

			ds := make([]*outbox.Dispatcher, tc.dispatchers)
			for i := range ds {
				ds[i] = b.dispatcher(t, cfg)
			}
			insertEvents(t, b.pool, topic, 1, old)
			require.Equal(t, old, drain(t, ds[0]))
			stop := runConsumer(t, func(ctx context.Context) error { return c.RunTx(ctx, b.pool, effect) })
			waitFor(t, 60*time.Second, nil, "the first events took effect", func() bool {
				return count(t, b.pool, `SELECT count(*) FROM side_effects`) == old
			})
			waitFor(t, 30*time.Second, nil, "all acknowledged", func() bool { return groupDone(t, b.rdb, stream, group) })
			stop()
			// Every dispatcher has seen the stream and its epoch.
			for _, d := range ds[1:] {
				recovered, err := d.CheckStreams(ctx)
				require.NoError(t, err)
				require.Empty(t, recovered)
			}

			// One batch per dispatcher. The dispatchers of one topic take turns (its position
			// is held from a batch's read to its commit), so the batches come one after the
			// other; while one is held before publishing, the others find nothing to take.
			insertEvents(t, b.pool, topic, old+1, tc.dispatchers*batch)
			type result struct {
				n   int
				err error
			}
			before := added(t, b.rdb, stream)
			require.Equal(t, old, before)
			var snap string
			for i, d := range ds {
				ready, proceed, done := make(chan struct{}), make(chan struct{}), make(chan result, 1)
				var once sync.Once
				outbox.SetBeforePublish(d, func([]string) {
					once.Do(func() { close(ready); <-proceed })
				})
				go func() {
					n, err := d.DispatchOnce(ctx)
					done <- result{n, err}
				}()
				recv(t, ready, fmt.Sprintf("dispatcher %d's batch checked its stream", i))
				for j, other := range ds {
					if j != i {
						n, err := other.DispatchOnce(ctx)
						require.NoError(t, err)
						require.Zero(t, n, "dispatcher %d takes its turn: the topic's position is held", j)
					}
				}
				if i == len(ds)-1 {
					// Every batch but the last published and committed.
					require.Equal(t, old+i*batch, added(t, b.rdb, stream))
					snap = srv.Snapshot("overlap")
				}
				close(proceed)
				r := recv(t, done, fmt.Sprintf("dispatcher %d's batch", i))
				require.NoError(t, r.err)
				require.Equal(t, batch, r.n)
				outbox.SetBeforePublish(d, nil)
			}
			require.Equal(t, old+tc.dispatchers*batch, count(t, b.pool, `SELECT count(*) FROM outbox_sent`))

			srv.RestoreSnapshot(snap)
			require.Equal(t, old+(tc.dispatchers-1)*batch, added(t, b.rdb, stream),
				"the restored stream lacks the last batch's entries")
			require.Equal(t, pgEpoch(t, b, topic), b.rdb.Get(ctx, outbox.EpochKey(b.prefix, topic)).Val(),
				"the marker survived: only the count tells")

			total := old + tc.dispatchers*batch + later
			var m *outbox.DispatcherMetrics
			if tc.freshDispatcher {
				d := b.dispatcher(t, cfg)
				recovered, err := d.CheckStreams(ctx)
				require.NoError(t, err)
				require.Equal(t, []string{topic}, recovered)
				insertEvents(t, b.pool, topic, old+tc.dispatchers*batch+1, later)
				require.Equal(t, total, drain(t, d), "every event sent within the recover window published again, and the new ones")
				m = d.Metrics()
			} else {
				insertEvents(t, b.pool, topic, old+tc.dispatchers*batch+1, later)
				sent := 0
				for _, d := range ds {
					sent += drain(t, d)
				}
				require.Equal(t, total, sent, "every event sent within the recover window published again, and the new ones")
				m = ds[0].Metrics()
			}

			// Every event marked sent is in the stream (TrimNever: nothing removed it).
			entries, err := b.rdb.XRange(ctx, stream, "-", "+").Result()
			require.NoError(t, err)
			inStream := make(map[string]bool, len(entries))
			for _, e := range entries {
				id, _ := e.Values[outbox.FieldOutboxID].(string)
				inStream[id] = true
			}
			rows, err := b.pool.Query(ctx, `SELECT id::text FROM outbox_sent ORDER BY id`)
			require.NoError(t, err)
			sentIDs, err := pgx.CollectRows(rows, pgx.RowTo[string])
			require.NoError(t, err)
			require.Len(t, sentIDs, total)
			var missing []string
			for _, id := range sentIDs {
				if !inStream[id] {
					missing = append(missing, id)
				}
			}
			require.Empty(t, missing, "outbox rows marked sent whose event is not in the stream")

			runConsumer(t, func(ctx context.Context) error { return c.RunTx(ctx, b.pool, effect) })
			waitFor(t, 60*time.Second, nil, "every event took effect", func() bool {
				return count(t, b.pool, `SELECT count(DISTINCT event_key) FROM side_effects`) == total
			}, func() string {
				return fmt.Sprintf("%d distinct effects, %d stream entries", count(t, b.pool, `SELECT count(DISTINCT event_key) FROM side_effects`), xlen(t, b.rdb, stream))
			})
			waitFor(t, 30*time.Second, nil, "all acknowledged", func() bool { return groupDone(t, b.rdb, stream, group) })
			assert.Equal(t, total, count(t, b.pool, `SELECT count(*) FROM side_effects`), "exactly once in effect")
			assert.Equal(t, 1.0, ptu.ToFloat64(m.StreamsLost.WithLabelValues(topic)))
			assert.Equal(t, float64(old+tc.dispatchers*batch), ptu.ToFloat64(m.Remarked.WithLabelValues(topic)))
		})
	}
}

// TestAfterPublishReadFails: when the read of a stream's entries-added that follows a
// batch's XADDs (in their pipeline) fails — here a NOSCRIPT, as after a Redis restart
// between the batch's check and its XADDs — the batch rolls back rather than record a
// count read elsewhere: its rows stay unsent and go again with the next batch, which
// records the stream's whole count.
func TestAfterPublishReadFails(t *testing.T) {
	const topic = "t"
	b, _ := lossBundle(t)
	ctx := context.Background()
	stream := outbox.StreamKey(b.prefix, topic)
	d := b.dispatcher(t, outbox.DispatcherConfig{BatchSize: 10, PublishAttempts: 1, Trim: outbox.TrimNever})
	insertEvents(t, b.pool, topic, 1, 3)
	require.Equal(t, 3, drain(t, d)) // the epoch exists

	insertEvents(t, b.pool, topic, 4, 5)
	flushed := 0
	outbox.SetBeforePublish(d, func([]string) {
		if flushed == 0 {
			require.NoError(t, b.rdb.ScriptFlush(ctx).Err()) // the test's own server
		}
		flushed++
	})
	_, err := d.DispatchOnce(ctx)
	require.ErrorContains(t, err, "after publishing")
	require.ErrorContains(t, err, "NOSCRIPT")
	require.Equal(t, 5, count(t, b.pool, `SELECT count(*) FROM outbox_unsent`), "rolled back: nothing marked sent")
	require.Equal(t, 8, xlen(t, b.rdb, stream), "the batch's entries were appended")
	require.Equal(t, 5.0, ptu.ToFloat64(d.Metrics().Republished.WithLabelValues(topic)), "counted as republished")

	require.Equal(t, 5, drain(t, d), "published again")
	require.Equal(t, 2, flushed)
	require.Equal(t, 13, xlen(t, b.rdb, stream))
	var rec int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT entries_added FROM outbox_epochs WHERE prefix = $1 AND topic = $2`, b.prefix, topic).Scan(&rec))
	require.Equal(t, 13, rec, "the count read after the second batch's XADDs")
	recovered, err := d.CheckStreams(ctx)
	require.NoError(t, err)
	require.Empty(t, recovered, "no loss")
}
