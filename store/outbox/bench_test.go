package outbox_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store/outbox"
	"github.com/idemscrape/idemscrape/testutil"
)

// BenchmarkDispatch measures, against the real services:
//
//   - DispatchOnce: events/s through the dispatcher in batches of 500 (claim with SKIP
//     LOCKED, pipelined XADD, mark sent, commit); the inserts are outside the timer;
//   - RawXADD: events/s of the same 500 entries as one bare XADD pipeline, the ceiling;
//   - Lag/notify and Lag/poll-100ms: time from the commit of one outbox row to its entry
//     being readable in the stream, with the commit's NOTIFY vs polling every 100 ms
//     (commits at a random phase of the poll cycle), reported as p50-ms and p99-ms;
//     ns/op of the poll case includes that random wait.
func BenchmarkDispatch(b *testing.B) {
	const batch = 500
	ctx := context.Background()

	b.Run(fmt.Sprintf("DispatchOnce/batch=%d", batch), func(b *testing.B) {
		pool := testutil.PG(b)
		ns := testutil.Redis(b)
		d, err := outbox.NewDispatcher(pool, ns.Client, &outbox.DispatcherConfig{Prefix: ns.Prefix, BatchSize: batch, Logger: testLogger()})
		require.NoError(b, err)
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			b.StopTimer()
			insertEvents(b, pool, "bench", i*batch+1, batch)
			b.StartTimer()
			n, err := d.DispatchOnce(ctx)
			if err != nil || n != batch {
				b.Fatalf("DispatchOnce = %d, %v", n, err)
			}
		}
		b.ReportMetric(float64(b.N*batch)/b.Elapsed().Seconds(), "events/s")
	})

	b.Run(fmt.Sprintf("RawXADD/batch=%d", batch), func(b *testing.B) {
		ns := testutil.Redis(b)
		stream := outbox.StreamKey(ns.Prefix, "bench")
		created := time.Now().UTC().Format(time.RFC3339Nano)
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			_, err := ns.Client.Pipelined(ctx, func(p redis.Pipeliner) error {
				for j := 0; j < batch; j++ {
					n := i*batch + j + 1
					p.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []any{
						outbox.FieldEventKey, "ev:" + strconv.Itoa(n),
						outbox.FieldTopic, "bench",
						outbox.FieldPayload, `{"n": ` + strconv.Itoa(n) + `}`,
						outbox.FieldOutboxID, strconv.Itoa(n),
						outbox.FieldCreatedAt, created,
					}})
				}
				return nil
			})
			if err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(b.N*batch)/b.Elapsed().Seconds(), "events/s")
	})

	lag := func(b *testing.B, notify bool, poll time.Duration) {
		pool := testutil.PG(b)
		ns := testutil.Redis(b)
		d, err := outbox.NewDispatcher(pool, ns.Client, &outbox.DispatcherConfig{
			Prefix: ns.Prefix, PollInterval: poll, DisableNotify: !notify,
			Registerer: prometheus.NewRegistry(), Logger: testLogger(),
		})
		require.NoError(b, err)
		require.NoError(b, d.Start(ctx))
		defer d.Stop()
		stream := outbox.StreamKey(ns.Prefix, "bench")
		last := "0-0"
		lags := make([]time.Duration, 0, b.N)
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			if !notify {
				// Commit at a random phase of the poll cycle, as real commits do; right
				// after the previous dispatch every lag would be a full interval.
				time.Sleep(rand.N(poll))
			}
			tx, err := pool.Begin(ctx)
			require.NoError(b, err)
			_, err = tx.Exec(ctx, `INSERT INTO outbox (event_key, topic, payload) VALUES ($1, 'bench', '{}')`, "lag:"+strconv.Itoa(i))
			require.NoError(b, err)
			if notify {
				_, err = tx.Exec(ctx, `NOTIFY `+outbox.NotifyChannel)
				require.NoError(b, err)
			}
			require.NoError(b, tx.Commit(ctx))
			committed := time.Now()
			res, err := ns.Client.XRead(ctx, &redis.XReadArgs{Streams: []string{stream, last}, Count: 1, Block: 10 * time.Second}).Result()
			if err != nil {
				b.Fatalf("event %d not dispatched: %v", i, err)
			}
			lags = append(lags, time.Since(committed))
			last = res[0].Messages[0].ID
		}
		b.StopTimer()
		slices.Sort(lags)
		pct := func(p float64) float64 {
			return float64(lags[min(len(lags)-1, int(p*float64(len(lags))))]) / float64(time.Millisecond)
		}
		b.ReportMetric(pct(0.50), "p50-ms")
		b.ReportMetric(pct(0.99), "p99-ms")
	}
	b.Run("Lag/notify", func(b *testing.B) { lag(b, true, time.Hour) })
	b.Run("Lag/poll-100ms", func(b *testing.B) { lag(b, false, 100*time.Millisecond) })
}
