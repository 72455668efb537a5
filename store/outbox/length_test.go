package outbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store/outbox"
)

// lengthGauge returns idemscrape_outbox_stream_length{topic} as reg exposes it, and
// whether the series exists at all.
func lengthGauge(t testing.TB, reg prometheus.Gatherer, topic string) (float64, bool) {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != "idemscrape_outbox_stream_length" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if labelIs(m, "topic", topic) {
				return m.GetGauge().GetValue(), true
			}
		}
	}
	return 0, false
}

func labelIs(m *dto.Metric, name, value string) bool {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue() == value
		}
	}
	return false
}

// TestStreamLengthGaugeCurrent: idemscrape_outbox_stream_length follows the stream's XLEN
// without waiting for a trim: while the dispatcher publishes between two trims (the trim
// interval is an hour here), in a new process that has nothing to publish (a restart),
// and while another process appends to the stream.
func TestStreamLengthGaugeCurrent(t *testing.T) {
	const topic = "t"
	b := setup(t)
	ctx := context.Background()
	stream := outbox.StreamKey(b.prefix, topic)
	cfg := outbox.DispatcherConfig{BatchSize: 50, PollInterval: 20 * time.Millisecond, TrimInterval: time.Hour}
	// start runs a dispatcher of a process of its own (its own registry) in the background.
	start := func() (*outbox.Dispatcher, *prometheus.Registry) {
		reg := prometheus.NewRegistry()
		c := cfg
		c.Prefix, c.Registerer, c.Logger = b.prefix, reg, b.log
		d, err := outbox.NewDispatcher(b.pool, b.rdb, &c)
		require.NoError(t, err)
		t.Cleanup(d.Stop)
		require.NoError(t, d.Start(ctx))
		return d, reg
	}
	// follows waits until reg's gauge is the stream's XLEN, as Redis tells it, and that is n.
	follows := func(reg *prometheus.Registry, n int, what string) {
		t.Helper()
		waitFor(t, 60*time.Second, nil, what, func() bool {
			v, ok := lengthGauge(t, reg, topic)
			return ok && int(v) == xlen(t, b.rdb, stream) && int(v) == n
		}, func() string {
			v, ok := lengthGauge(t, reg, topic)
			return fmt.Sprintf("gauge %v (present %v), XLEN %d", v, ok, xlen(t, b.rdb, stream))
		})
	}
	unsent := func() bool { return count(t, b.pool, `SELECT count(*) FROM outbox_unsent`) == 0 }

	d1, reg1 := start()
	insertEvents(t, b.pool, topic, 1, 5)
	waitFor(t, 60*time.Second, nil, "the first events sent", unsent)
	follows(reg1, 5, "the gauge after the first batch (and its trim)")
	insertEvents(t, b.pool, topic, 6, 300) // several batches, no trim due
	waitFor(t, 60*time.Second, nil, "the next events sent", unsent)
	follows(reg1, 305, "the gauge between two trims")
	d1.Stop()

	// A restart: nothing to publish, the gauge is there anyway.
	_, reg2 := start()
	follows(reg2, 305, "the gauge of a new process with nothing to publish")

	// Something else appends to the stream (the test, here) while this process is idle.
	for i := range 40 {
		require.NoError(t, b.rdb.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []any{"n", i}}).Err())
	}
	follows(reg2, 345, "the gauge of an idle process after another one appended")
	// The cap beside it (the default MaxLen).
	mx, err := reg2.Gather()
	require.NoError(t, err)
	found := false
	for _, mf := range mx {
		if mf.GetName() == "idemscrape_outbox_stream_max_length" {
			found = true
			assert.Equal(t, float64(outbox.DefaultMaxLen), mf.GetMetric()[0].GetGauge().GetValue())
		}
	}
	assert.True(t, found, "the cap gauge beside the length")
}
