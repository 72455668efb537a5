package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	ptu "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store/outbox"
	"github.com/idemscrape/idemscrape/testutil"
)

// capturingLogs makes b's components log (info and up) into the returned buffer.
func (b *bundle) capturingLogs() *testutil.SyncBuffer {
	buf := &testutil.SyncBuffer{}
	b.log = slog.New(slog.NewTextHandler(buf, nil))
	return buf
}

// lossLines returns the log lines about events the length cap took from groups.
func lossLines(buf *testutil.SyncBuffer) []string {
	var out []string
	for _, l := range strings.Split(buf.String(), "\n") {
		if strings.Contains(l, "LOST events: the stream length cap") {
			out = append(out, l)
		}
	}
	return out
}

// eventNo returns n of the event key "ev:<n>" of a stream entry (insertEvents' keys).
func eventNo(t testing.TB, m redis.XMessage) int {
	t.Helper()
	k, _ := m.Values[outbox.FieldEventKey].(string)
	n, err := strconv.Atoi(strings.TrimPrefix(k, "ev:"))
	require.NoError(t, err, "event key %q of entry %s", k, m.ID)
	return n
}

// capLost returns idemscrape_outbox_stream_cap_lost_total{topic,group}.
func capLost(d *outbox.Dispatcher, topic, group string) int {
	return int(ptu.ToFloat64(d.Metrics().CapLost.WithLabelValues(topic, group)))
}

// TestStreamsBounded: the default trim policy holds every stream the dispatcher publishes
// to at MaxLen while a consumer group is dead, without taking anything from a group that
// keeps up within the cap, and counts and logs (once) what the dead group lost.
func TestStreamsBounded(t *testing.T) {
	// 200,000 events through the running dispatcher (its background loop, batches of 500,
	// a trim after every batch) with a cap of 20,000. The slow group reads only when it is
	// more than 10,000 events behind, so it always lags by 10,000–15,500 entries, inside the
	// cap; the producer waits for it (in OnBatch) when it is more than 15,000 behind, so the
	// test does not depend on which of the two is faster on the box. The dead group never
	// reads. XLEN is sampled at every batch.
	t.Run("SlowAndDeadGroups", func(t *testing.T) {
		const (
			events = 200_000
			maxLen = 20_000
			batch  = 500
			lagMin = 10_000 // the slow group reads only when further behind than this
			lagMax = 15_000 // the producer waits when the slow group is further behind than this
			topic  = "observed"
		)
		b := setup(t)
		logs := b.capturingLogs()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		stream := outbox.StreamKey(b.prefix, topic)
		require.NoError(t, b.rdb.XGroupCreateMkStream(ctx, stream, "slow", "0").Err())
		require.NoError(t, b.rdb.XGroupCreate(ctx, stream, "dead", "0").Err())
		insertEvents(t, b.pool, topic, 1, events)

		var (
			sent, read atomic.Int64 // rows marked sent; entries delivered to the slow group
			failed     atomic.Int64 // batches that failed
			lensMu     sync.Mutex
			lens       []int64                  // XLEN after each batch
			produced   = make(chan struct{}, 1) // a batch ran
			consumed   = make(chan struct{}, 1) // the slow group acknowledged what it read
		)
		d := b.dispatcher(t, outbox.DispatcherConfig{BatchSize: batch, MaxLen: maxLen, TrimInterval: time.Nanosecond,
			DisableNotify: true,
			OnBatch: func(n int, err error) {
				if err != nil {
					failed.Add(1)
				}
				total := sent.Add(int64(n))
				if l, err := b.rdb.XLen(ctx, stream).Result(); err == nil {
					lensMu.Lock()
					lens = append(lens, l)
					lensMu.Unlock()
				}
				signal(produced)
				for total-read.Load() > lagMax && ctx.Err() == nil {
					select {
					case <-consumed:
					case <-ctx.Done():
					}
				}
			}})

		seen := make([]bool, events+1)
		slowDone := make(chan error, 1)
		go func() {
			slowDone <- func() error {
				for {
					s := sent.Load()
					if s < events && s-read.Load() <= lagMin {
						select {
						case <-produced:
							continue
						case <-ctx.Done():
							return ctx.Err()
						}
					}
					res, err := b.rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "slow", Consumer: "c",
						Streams: []string{stream, ">"}, Count: 250, Block: -1}).Result()
					if errors.Is(err, redis.Nil) {
						if s == events {
							return nil // everything published, and nothing left to read
						}
						select {
						case <-produced:
							continue
						case <-ctx.Done():
							return ctx.Err()
						}
					}
					if err != nil {
						return err
					}
					ids := make([]string, 0, len(res[0].Messages))
					for _, m := range res[0].Messages {
						n := eventNo(t, m)
						if n < 1 || n > events || seen[n] {
							return fmt.Errorf("entry %s: event %d unknown or delivered twice", m.ID, n)
						}
						seen[n] = true
						ids = append(ids, m.ID)
					}
					if err := b.rdb.XAck(ctx, stream, "slow", ids...).Err(); err != nil {
						return err
					}
					read.Add(int64(len(ids)))
					signal(consumed)
				}
			}()
		}()

		require.NoError(t, d.Start(ctx))
		select { // bounded by ctx: the slow reader returns its error when ctx ends
		case err := <-slowDone:
			require.NoError(t, err, "slow group after %d of %d events sent, %d read", sent.Load(), events, read.Load())
		case <-time.After(3 * time.Minute):
			t.Fatal("the slow group's reader did not return")
		}
		d.Stop()

		require.Zero(t, failed.Load(), "failed batches")
		require.EqualValues(t, events, sent.Load())
		lensMu.Lock()
		defer lensMu.Unlock()
		require.GreaterOrEqual(t, len(lens), events/batch, "XLEN sampled at every batch")
		for i, l := range lens {
			require.LessOrEqual(t, l, int64(maxLen), "XLEN after batch %d", i+1)
		}
		assert.Equal(t, int64(maxLen), lens[len(lens)-1], "the dead group keeps the stream at the cap")

		// The slow group lost nothing: it got every event once, and has nothing left.
		assert.EqualValues(t, events, read.Load())
		missing := 0
		for n := 1; n <= events; n++ {
			if !seen[n] {
				missing++
			}
		}
		assert.Zero(t, missing, "events the slow group never received")
		assert.True(t, groupDone(t, b.rdb, stream, "slow"), "slow group: nothing pending, no lag")
		assert.Zero(t, capLost(d, topic, "slow"))

		// The dead group lost every entry the cap removed, and only those.
		info, err := b.rdb.XInfoStream(ctx, stream).Result()
		require.NoError(t, err)
		require.EqualValues(t, events, info.EntriesAdded)
		removed := events - int(info.Length)
		assert.Equal(t, events-maxLen, removed)
		assert.Equal(t, removed, int(ptu.ToFloat64(d.Metrics().Capped.WithLabelValues(topic))), "capped")
		assert.Equal(t, removed, capLost(d, topic, "dead"), "the dead group lost exactly what was removed")

		lines := lossLines(logs)
		require.Len(t, lines, 1, "one log line for the loss, not one per batch; logs:\n%s", logs.String())
		assert.Contains(t, lines[0], "level=ERROR")
		assert.Contains(t, lines[0], "topic="+topic)
		assert.Contains(t, lines[0], "groups=[dead]")
		assert.Contains(t, lines[0], "lost.dead=")
		assert.NotContains(t, lines[0], "slow")
		assert.NotContains(t, lines[0], "ev:", "no event keys or payloads in the log")
	})

	// A deterministic run (DispatchOnce, groups read in lockstep between batches) where
	// groups do fall behind the cap: the slow group reads 40 entries per batch of 100 and
	// leaves 10 of them pending for ever; the two late groups start at "$" (Redis knows no
	// lag for them) and never read; the dead group never reads; the fast group reads and
	// acknowledges everything. Each group's count must equal what the cap removed before
	// the group acknowledged it, computed here from what the test's readers did.
	t.Run("GroupsBehindTheCap", func(t *testing.T) {
		const (
			events = 20_000
			maxLen = 1_000
			batch  = 100
			topic  = "t"
			lateAt = 5 * batch // events published when the late group is created
			late2  = 18_500    // … and the second late group, which the cap passes only partly
		)
		b := setup(t)
		logs := b.capturingLogs()
		ctx := context.Background()
		stream := outbox.StreamKey(b.prefix, topic)
		for _, g := range []string{"fast", "slow", "dead"} {
			require.NoError(t, b.rdb.XGroupCreateMkStream(ctx, stream, g, "0").Err())
		}
		insertEvents(t, b.pool, topic, 1, events)
		d := b.dispatcher(t, outbox.DispatcherConfig{BatchSize: batch, MaxLen: maxLen, TrimInterval: time.Nanosecond})

		acked := map[string]map[int]bool{"fast": {}, "slow": {}}
		read := func(group string, count, ack int) {
			t.Helper()
			res, err := b.rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: group, Consumer: "c",
				Streams: []string{stream, ">"}, Count: int64(count), Block: -1}).Result()
			require.NoError(t, err)
			msgs := res[0].Messages
			for _, m := range msgs[:min(ack, len(msgs))] {
				require.NoError(t, b.rdb.XAck(ctx, stream, group, m.ID).Err())
				acked[group][eventNo(t, m)] = true
			}
		}
		published := 0
		for {
			n, err := d.DispatchOnce(ctx)
			require.NoError(t, err)
			if n == 0 {
				break
			}
			published += n
			require.LessOrEqual(t, xlen(t, b.rdb, stream), maxLen, "XLEN after %d events", published)
			switch published {
			case lateAt:
				require.NoError(t, b.rdb.XGroupCreate(ctx, stream, "late", "$").Err())
			case late2:
				require.NoError(t, b.rdb.XGroupCreate(ctx, stream, "late2", "$").Err())
			}
			read("fast", batch, batch)
			read("slow", 40, 30)
		}
		require.Equal(t, events, published)
		require.Equal(t, maxLen, xlen(t, b.rdb, stream))

		// One dispatcher publishes in outbox id order: the cap removed events 1…removed.
		removed := events - maxLen
		ackedRemoved := 0
		for n := range acked["slow"] {
			if n <= removed {
				ackedRemoved++
			}
		}
		want := map[string]int{"fast": 0, "slow": removed - ackedRemoved, "dead": removed, "late": removed - lateAt, "late2": removed - late2}
		for g, w := range want {
			assert.Equal(t, w, capLost(d, topic, g), "events group %s lost", g)
		}
		assert.Equal(t, removed, int(ptu.ToFloat64(d.Metrics().Capped.WithLabelValues(topic))), "capped")

		// Redis's own lag stays the number of entries a group has not read (the script
		// corrects entries-read for groups it trimmed past): here, for every group.
		groups, err := b.rdb.XInfoGroups(ctx, stream).Result()
		require.NoError(t, err)
		for _, g := range groups {
			after, err := b.rdb.XRange(ctx, stream, "("+g.LastDeliveredID, "+").Result()
			require.NoError(t, err)
			assert.EqualValues(t, len(after), g.Lag, "lag of group %s", g.Name)
		}

		// One line per newly losing group within the log window, none for the fast group.
		lines := lossLines(logs)
		require.NotEmpty(t, lines)
		require.LessOrEqual(t, len(lines), 4, "logs:\n%s", logs.String())
		all := strings.Join(lines, "\n")
		for _, g := range []string{"dead", "late", "late2", "slow"} {
			assert.Contains(t, all, "lost."+g+"=")
		}
		assert.NotContains(t, all, "fast")
	})
}

// TestStreamCap covers the cap's configuration and its paths besides the steady state:
// the policy off, the cap off, a cold script cache, a long stream caught up in steps, and
// the log window.
func TestStreamCap(t *testing.T) {
	ctx := context.Background()

	t.Run("Config", func(t *testing.T) {
		var zero outbox.DispatcherConfig
		require.Equal(t, outbox.TrimConsumed, zero.Trim, "trimming is the zero value's policy")
		for _, p := range []outbox.TrimPolicy{outbox.TrimConsumed, outbox.TrimNever} {
			got, err := outbox.ParseTrimPolicy(p.String())
			require.NoError(t, err)
			require.Equal(t, p, got)
		}
		_, err := outbox.ParseTrimPolicy("acked")
		require.ErrorContains(t, err, "want consumed or never")

		tests := []struct {
			name string
			cfg  outbox.DispatcherConfig
			want string // "" for valid
		}{
			{"Default", outbox.DispatcherConfig{}, ""},
			{"NoCap", outbox.DispatcherConfig{MaxLen: outbox.NoMaxLen}, ""},
			{"NeverWithoutCap", outbox.DispatcherConfig{Trim: outbox.TrimNever}, ""},
			{"CapAtBatch", outbox.DispatcherConfig{MaxLen: 50, BatchSize: 50}, ""},
			{"BelowNoMaxLen", outbox.DispatcherConfig{MaxLen: -2}, "DispatcherConfig.MaxLen -2"},
			{"CapUnderNever", outbox.DispatcherConfig{Trim: outbox.TrimNever, MaxLen: 10_000}, "DispatcherConfig.MaxLen 10000 is set but Trim is never"},
			{"CapBelowDefaultBatch", outbox.DispatcherConfig{MaxLen: 100}, "DispatcherConfig.MaxLen 100 is below the batch size 500"},
			{"CapBelowBatch", outbox.DispatcherConfig{MaxLen: 10, BatchSize: 11}, "below the batch size 11"},
			{"NegativeLogInterval", outbox.DispatcherConfig{LossLogInterval: -time.Second}, "DispatcherConfig.LossLogInterval"},
			{"NegativeTrimInterval", outbox.DispatcherConfig{TrimInterval: -time.Second}, "DispatcherConfig.TrimInterval"},
		}
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				err := tt.cfg.Validate()
				if tt.want == "" {
					require.NoError(t, err)
					return
				}
				require.ErrorContains(t, err, tt.want)
			})
		}
	})

	// deadStream creates the topic's stream with a group that never reads.
	deadStream := func(t *testing.T, b *bundle, topic string) string {
		t.Helper()
		stream := outbox.StreamKey(b.prefix, topic)
		require.NoError(t, b.rdb.XGroupCreateMkStream(ctx, stream, "dead", "0").Err())
		return stream
	}

	t.Run("TrimNeverTrimsNothing", func(t *testing.T) {
		b := setup(t)
		stream := outbox.StreamKey(b.prefix, "t")
		require.NoError(t, b.rdb.XGroupCreateMkStream(ctx, stream, "g", "0").Err())
		d := b.dispatcher(t, outbox.DispatcherConfig{Trim: outbox.TrimNever, BatchSize: 10, TrimInterval: time.Nanosecond})
		insertEvents(t, b.pool, "t", 1, 10)
		require.Equal(t, 10, drain(t, d))
		res, err := b.rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "c", Streams: []string{stream, ">"}, Count: 10, Block: -1}).Result()
		require.NoError(t, err)
		for _, m := range res[0].Messages {
			require.NoError(t, b.rdb.XAck(ctx, stream, "g", m.ID).Err())
		}
		insertEvents(t, b.pool, "t", 11, 10)
		require.Equal(t, 10, drain(t, d))
		require.Equal(t, 20, xlen(t, b.rdb, stream), "acknowledged entries kept")

		// The default policy trims them.
		insertEvents(t, b.pool, "t", 21, 1)
		require.Equal(t, 1, drain(t, b.dispatcher(t, outbox.DispatcherConfig{})))
		require.Equal(t, 11, xlen(t, b.rdb, stream), "the 10 acknowledged entries trimmed")
	})

	t.Run("NoMaxLen", func(t *testing.T) {
		b := setup(t)
		stream := deadStream(t, b, "t")
		d := b.dispatcher(t, outbox.DispatcherConfig{MaxLen: outbox.NoMaxLen, BatchSize: 10, TrimInterval: time.Nanosecond})
		insertEvents(t, b.pool, "t", 1, 50)
		require.Equal(t, 50, drain(t, d))
		require.Equal(t, 50, xlen(t, b.rdb, stream), "no cap")
		require.Zero(t, ptu.ToFloat64(d.Metrics().Capped.WithLabelValues("t")))
		require.Equal(t, 50, int(ptu.ToFloat64(d.Metrics().Length.WithLabelValues("t"))), "the length gauge after the trims")
		require.Zero(t, ptu.CollectAndCount(d.Metrics().MaxLength), "no cap, no cap gauge")
	})

	t.Run("ColdScriptCache", func(t *testing.T) {
		b, _ := lossBundle(t) // its own redis-server: the test flushes its script cache
		stream := deadStream(t, b, "t")
		d := b.dispatcher(t, outbox.DispatcherConfig{MaxLen: 10, BatchSize: 10, TrimInterval: time.Nanosecond})
		for i := range 3 {
			require.NoError(t, b.rdb.ScriptFlush(ctx).Err())
			insertEvents(t, b.pool, "t", 10*i+1, 10)
			n, err := d.DispatchOnce(ctx)
			require.NoError(t, err)
			require.Equal(t, 10, n)
			require.Equal(t, 10, xlen(t, b.rdb, stream), "after batch %d: capped although the pipelined EVALSHA met NOSCRIPT", i+1)
		}
		require.Equal(t, 20, capLost(d, "t", "dead"))
		require.Equal(t, 10, int(ptu.ToFloat64(d.Metrics().Length.WithLabelValues("t"))), "the length gauge: at the cap")
		require.Equal(t, 10, int(ptu.ToFloat64(d.Metrics().MaxLength.WithLabelValues("t"))))
	})

	t.Run("CatchesUpInSteps", func(t *testing.T) {
		b := setup(t)
		stream := deadStream(t, b, "t")
		// A stream that grew without a cap, as under an older version.
		insertEvents(t, b.pool, "t", 1, 95)
		require.Equal(t, 95, drain(t, b.dispatcher(t, outbox.DispatcherConfig{Trim: outbox.TrimNever})))
		d := b.dispatcher(t, outbox.DispatcherConfig{MaxLen: 10, BatchSize: 5})
		outbox.SetCapStep(d, 7)
		insertEvents(t, b.pool, "t", 96, 5)
		require.Equal(t, 5, drain(t, d))
		require.Equal(t, 10, xlen(t, b.rdb, stream), "brought down to the cap right after the batch, 7 entries per call")
		require.Equal(t, 90, int(ptu.ToFloat64(d.Metrics().Capped.WithLabelValues("t"))))
		require.Equal(t, 90, capLost(d, "t", "dead"))
	})

	t.Run("LogWindow", func(t *testing.T) {
		for _, tc := range []struct {
			name     string
			interval time.Duration
			lines    []string // what each loss line says was lost
		}{
			{"Default", 0, []string{"lost.dead=10 capped=10"}},
			{"EveryLoss", time.Nanosecond, []string{"lost.dead=10 capped=10", "lost.dead=10 capped=10"}},
		} {
			t.Run(tc.name, func(t *testing.T) {
				b := setup(t)
				logs := b.capturingLogs()
				deadStream(t, b, "t")
				d := b.dispatcher(t, outbox.DispatcherConfig{MaxLen: 10, BatchSize: 10, TrimInterval: time.Nanosecond, LossLogInterval: tc.interval})
				insertEvents(t, b.pool, "t", 1, 30)
				require.Equal(t, 30, drain(t, d))
				require.Equal(t, 20, capLost(d, "t", "dead"), "counted whether logged or not")
				lines := lossLines(logs)
				require.Len(t, lines, len(tc.lines), "logs:\n%s", logs.String())
				for i, want := range tc.lines {
					assert.Contains(t, lines[i], want)
				}
			})
		}
	})
}
