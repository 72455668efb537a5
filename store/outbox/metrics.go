package outbox

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// DispatcherMetrics are the collectors a Dispatcher updates. Dispatchers registered on the
// same Registerer share them.
type DispatcherMetrics struct {
	// Published counts XADDs that succeeded, per topic: every copy that reached a stream,
	// including copies whose batch rolled back afterwards. On a stream nobody trims it adds
	// up (over all dispatchers) to the stream's length.
	Published *prometheus.CounterVec
	// Republished counts rows, per topic, whose XADD succeeded in a batch that then rolled
	// back (failed mark or commit, AfterPublish failpoint, publish retries exhausted for
	// other rows of the batch): each is a copy that will be published again, i.e. a
	// duplicate in the stream. A commit whose outcome is unknown counts too, so it may
	// over-count by that batch.
	Republished *prometheus.CounterVec
	// Lag observes, per published copy, the time from the row's created_at (PostgreSQL
	// clock) to its XADD (this process's clock).
	Lag prometheus.Histogram
	// StreamsLost counts, per topic, recoveries of a stream that Redis lost the history of
	// (epoch marker gone, or fewer entries ever added than PostgreSQL recorded).
	StreamsLost *prometheus.CounterVec
	// Remarked counts, per topic, outbox rows put in front of the position again by those
	// recoveries:
	// events published again because their stream entries may have been lost.
	Remarked *prometheus.CounterVec
	// Capped counts, per topic, stream entries removed by the length cap
	// (DispatcherConfig.MaxLen), acknowledged by every group or not.
	Capped *prometheus.CounterVec
	// CapLost counts, per topic and consumer group, entries the length cap removed before
	// the group acknowledged them (never delivered to it, or delivered and pending): events
	// the group will never handle. An entry that was pending also surfaces in the group's
	// consumers as idemscrape_outbox_lost_total{group} when they reclaim it.
	CapLost *prometheus.CounterVec
	// Length is, per topic, the stream's length (XLEN), read with the stream's state (no
	// round trip of its own): before and after each batch's XADDs to it, after each trim,
	// and for every topic of the dispatcher's prefix by the epoch check the background
	// loop runs after its first batch and then at least once per PollInterval, idle or
	// busy. How far the stream is from MaxLen, and whether a consumer group holds the
	// pending-safe trim back.
	Length *prometheus.GaugeVec
	// MaxLength is, per topic, the length cap the dispatcher holds the stream at
	// (DispatcherConfig.MaxLen; absent without a cap).
	MaxLength *prometheus.GaugeVec
	// HeldByPrepared is, per database, the number of transactions prepared in it longer
	// than DispatcherConfig.PreparedAlertAge ago, as the background loop last read
	// pg_prepared_xacts: each holds every topic's dispatch back until it is committed or
	// rolled back (COMMIT PREPARED / ROLLBACK PREPARED).
	HeldByPrepared *prometheus.GaugeVec
}

// ConsumerMetrics are the collectors a Consumer updates, labelled by consumer group.
// Consumers registered on the same Registerer share them.
type ConsumerMetrics struct {
	// Deduplicated counts entries acknowledged without running the handler because the
	// event key was already handled by the group (ledger mark or inbox row).
	Deduplicated *prometheus.CounterVec
	// Claimed counts entries this group's consumers took over with XAUTOCLAIM (entries of
	// dead consumers, and entries whose handler failed).
	Claimed *prometheus.CounterVec
	// Lost counts pending entries that were deleted or trimmed from the stream before they
	// were acknowledged: events the group never handled.
	Lost *prometheus.CounterVec
	// Malformed counts entries that are not outbox events; they are acknowledged and logged.
	Malformed *prometheus.CounterVec
}

func newDispatcherMetrics(reg prometheus.Registerer) (*DispatcherMetrics, error) {
	m := &DispatcherMetrics{
		Published: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_outbox_published_total",
			Help: "Outbox events appended to a Redis stream (every copy, replays included).",
		}, []string{"topic"}),
		Republished: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_outbox_republished_total",
			Help: "Outbox events appended in a dispatch batch that then rolled back; each will be appended again.",
		}, []string{"topic"}),
		Lag: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "idemscrape_outbox_dispatch_lag_seconds",
			Help:    "Time from an outbox row's created_at to its XADD.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2.5, 14), // 1 ms … ~2.5 min
		}),
		StreamsLost: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_outbox_streams_lost_total",
			Help: "Streams found to have lost their history in Redis (epoch marker gone) and recovered by moving the topic's position back.",
		}, []string{"topic"}),
		Remarked: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_outbox_remarked_total",
			Help: "Outbox rows put in front of their topic's position again after Redis lost their stream; each is published again.",
		}, []string{"topic"}),
		Capped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_outbox_stream_capped_total",
			Help: "Stream entries removed by the stream length cap (MaxLen), acknowledged or not.",
		}, []string{"topic"}),
		CapLost: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_outbox_stream_cap_lost_total",
			Help: "Stream entries the length cap removed before the consumer group acknowledged them: events the group never handles.",
		}, []string{"topic", "group"}),
		Length: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "idemscrape_outbox_stream_length",
			Help: "Entries in the topic's stream (XLEN), read by the dispatcher with each batch and at least once per poll interval.",
		}, []string{"topic"}),
		MaxLength: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "idemscrape_outbox_stream_max_length",
			Help: "The length cap the dispatcher holds the topic's stream at (MaxLen).",
		}, []string{"topic"}),
		HeldByPrepared: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "idemscrape_outbox_horizon_held_by_prepared",
			Help: "Transactions prepared in the database longer than the alert age ago; each holds every topic's outbox dispatch back until COMMIT PREPARED or ROLLBACK PREPARED.",
		}, []string{"database"}),
	}
	var err error
	if m.Published, err = register(reg, m.Published); err != nil {
		return nil, err
	}
	if m.Republished, err = register(reg, m.Republished); err != nil {
		return nil, err
	}
	if m.Lag, err = register(reg, m.Lag); err != nil {
		return nil, err
	}
	if m.StreamsLost, err = register(reg, m.StreamsLost); err != nil {
		return nil, err
	}
	if m.Remarked, err = register(reg, m.Remarked); err != nil {
		return nil, err
	}
	if m.Capped, err = register(reg, m.Capped); err != nil {
		return nil, err
	}
	if m.CapLost, err = register(reg, m.CapLost); err != nil {
		return nil, err
	}
	if m.Length, err = register(reg, m.Length); err != nil {
		return nil, err
	}
	if m.MaxLength, err = register(reg, m.MaxLength); err != nil {
		return nil, err
	}
	if m.HeldByPrepared, err = register(reg, m.HeldByPrepared); err != nil {
		return nil, err
	}
	return m, nil
}

func newConsumerMetrics(reg prometheus.Registerer) (*ConsumerMetrics, error) {
	vec := func(name, help string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, []string{"group"})
	}
	m := &ConsumerMetrics{
		Deduplicated: vec("idemscrape_outbox_deduplicated_total", "Outbox events skipped by a consumer group because their event key was already handled."),
		Claimed:      vec("idemscrape_outbox_claimed_total", "Stream entries a consumer group reclaimed with XAUTOCLAIM."),
		Lost:         vec("idemscrape_outbox_lost_total", "Pending stream entries deleted or trimmed before the consumer group acknowledged them."),
		Malformed:    vec("idemscrape_outbox_malformed_total", "Stream entries that are not outbox events (acknowledged and logged)."),
	}
	for _, c := range []**prometheus.CounterVec{&m.Deduplicated, &m.Claimed, &m.Lost, &m.Malformed} {
		var err error
		if *c, err = register(reg, *c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// register registers c, or returns the equal collector registered before, so several
// components can share one Registerer.
func register[T prometheus.Collector](reg prometheus.Registerer, c T) (T, error) {
	err := reg.Register(c)
	if err == nil {
		return c, nil
	}
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		if existing, ok := are.ExistingCollector.(T); ok {
			return existing, nil
		}
	}
	var zero T
	return zero, fmt.Errorf("outbox: register metrics: %w", err)
}
