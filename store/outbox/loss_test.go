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
		// process (it never saw the marker: the loss is told by entries-added), started
		// only once the consumer has recreated its group and the stream (MKSTREAM, empty).
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
			assert.Equal(t, before+after, xlen(t, b.rdb, stream), "each event once in the new stream")
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
		d := b.dispatcher(t, outbox.DispatcherConfig{BatchSize: 7})
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

	// A stream whose marker is missing but whose history is intact, found by new processes
	// only, as after an upgrade from a version without markers. (A running dispatcher that
	// saw the marker vanish treats it as a loss, by design.)
	m := dispatchers[0].Metrics() // the registry is shared: totals of every dispatcher
	require.NoError(t, b.rdb.Del(ctx, outbox.EpochKey(b.prefix, topic)).Err())
	dispatchers = nil
	round("no marker, intact stream (upgrade), new dispatcher", 5)
	round("and another one", 5)

	require.Zero(t, ptu.ToFloat64(m.Remarked.WithLabelValues(topic)))
	require.Zero(t, ptu.ToFloat64(m.StreamsLost.WithLabelValues(topic)))
	require.Equal(t, published, count(t, b.pool, `SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL`))
	info, err := b.rdb.XInfoStream(ctx, stream).Result()
	require.NoError(t, err)
	require.EqualValues(t, published, info.EntriesAdded, "each event appended once")
	require.NotEmpty(t, b.rdb.Get(ctx, outbox.EpochKey(b.prefix, topic)).Val(), "marker created again")
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
