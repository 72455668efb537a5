package outbox_test

import (
	"context"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store/outbox"
	"github.com/idemscrape/idemscrape/testutil"
)

// BenchmarkStreamMemory measures the Redis memory one outbox event takes in its stream, the
// figure behind DefaultMaxLen and the maxmemory advice in docs/OPERATIONS.md (Bounded
// Redis). OUTBOX_MEMORY_EVENTS events (100,000 by default; the documented figure used
// 1,000,000) are committed to the outbox table in one INSERT … SELECT with the payload the
// runner commits for an observation of examples/catalog (handlers' defaultEvent: data,
// job_key, kind, observation_key, parser_version; PostgreSQL stores it as jsonb), and
// published by a real Dispatcher into a throwaway redis-server of the benchmark's own (with
// Redis's default stream-node-max-bytes 4096 and stream-node-max-entries 100). Reported:
//
//   - stream-B/event: MEMORY USAGE of the stream key (SAMPLES 0: every node) / events;
//   - used_memory-B/event: the growth of INFO used_memory while publishing / events.
//
// Nothing is timed: ns/op is meaningless here.
func BenchmarkStreamMemory(b *testing.B) {
	events := 100_000
	if v := os.Getenv("OUTBOX_MEMORY_EVENTS"); v != "" {
		n, err := strconv.Atoi(v)
		require.NoError(b, err, "OUTBOX_MEMORY_EVENTS")
		events = n
	}
	const topic = "catalog"
	ctx := context.Background()
	pool := testutil.PG(b)
	srv := testutil.StartRedis(b)
	rdb := srv.Client()
	exec(b, pool, `INSERT INTO outbox (event_key, topic, payload)
SELECT 'observed:' || k.key, $1, jsonb_build_object(
	'data', jsonb_build_object('sku', k.sku, 'name', 'Sturdy Kettle ' || (100 + g % 900),
		'price', ((g % 50000) / 100.0 + 1)::numeric(10, 2)::text, 'currency', 'USD'),
	'job_key', k.key, 'kind', 'catalog', 'observation_key', k.key, 'parser_version', 3)
FROM generate_series(1, $2::int) AS g,
	LATERAL (SELECT 'sku-' || lpad(g::text, 7, '0') AS sku,
		'catalog:sku-' || lpad(g::text, 7, '0') || ':US:2026-04-23:v3' AS key) AS k`, topic, events)

	d, err := outbox.NewDispatcher(pool, rdb, &outbox.DispatcherConfig{Prefix: "idemscrape:", BatchSize: 2000,
		DisableNotify: true, Trim: outbox.TrimNever, Logger: testLogger()})
	require.NoError(b, err)
	usedMemory := func() int64 {
		info, err := rdb.Info(ctx, "memory").Result()
		require.NoError(b, err)
		for _, l := range strings.Split(info, "\r\n") {
			if v, ok := strings.CutPrefix(l, "used_memory:"); ok {
				n, err := strconv.ParseInt(v, 10, 64)
				require.NoError(b, err)
				return n
			}
		}
		b.Fatal("INFO memory has no used_memory")
		return 0
	}
	before := usedMemory()
	require.Equal(b, events, drain(b, d))
	used := usedMemory() - before
	stream := outbox.StreamKey("idemscrape:", topic)
	streamBytes, err := rdb.MemoryUsage(ctx, stream, 0).Result()
	require.NoError(b, err)
	sample, err := rdb.XRangeN(ctx, stream, "-", "+", 1).Result()
	require.NoError(b, err)
	b.Logf("%d events: stream %d bytes (MEMORY USAGE), used_memory +%d bytes; first entry %v", events, streamBytes, used, sample[0].Values)

	for b.Loop() {
	}
	b.ReportMetric(float64(streamBytes)/float64(events), "stream-B/event")
	b.ReportMetric(float64(used)/float64(events), "used_memory-B/event")
}
