package scheduler

import (
	"github.com/prometheus/client_golang/prometheus"
)

// The reconciler's Prometheus metrics.

type reconcilerMetrics struct {
	actions      *prometheus.CounterVec
	sweepSeconds prometheus.Histogram
	outboxUnsent prometheus.Gauge
	outboxOldest prometheus.Gauge
}

func newReconcilerMetrics(reg prometheus.Registerer) (*reconcilerMetrics, prometheus.Gatherer, error) {
	reg, gath := registryOrPrivate(reg)
	m := &reconcilerMetrics{
		actions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_reconciler_actions_total", Help: "Reconciler actions (rescued, rescue_refused, lease_held, requeued, archived_repaired, already_queued, outbox_pruned, inbox_pruned, saved_inputs_pruned, input_blobs_pruned, outbox_lag_reports, sweep_errors, key_mismatch, orphan_requeued, orphan_lease_held).",
		}, []string{"action"}),
		sweepSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "idemscrape_reconciler_sweep_seconds", Help: "Duration of one reconciler sweep.",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 10),
		}),
		outboxUnsent: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "idemscrape_reconciler_outbox_unsent", Help: "Unsent outbox rows older than the lag threshold, at the last sweep.",
		}),
		outboxOldest: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "idemscrape_reconciler_outbox_oldest_unsent_seconds", Help: "Age of the oldest unsent outbox row past the threshold (0: none).",
		}),
	}
	var err error
	m.actions = register(reg, m.actions, &err)
	m.sweepSeconds = register(reg, m.sweepSeconds, &err)
	m.outboxUnsent = register(reg, m.outboxUnsent, &err)
	m.outboxOldest = register(reg, m.outboxOldest, &err)
	return m, gath, err
}
