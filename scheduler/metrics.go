package scheduler

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	ticks       *prometheus.CounterVec
	jobs        *prometheus.CounterVec
	tickSeconds *prometheus.HistogramVec
	lastTick    *prometheus.GaugeVec
	gaps        *prometheus.GaugeVec
	retries     *prometheus.CounterVec
}

// newMetrics registers the scheduler's metrics on reg, or on a new private registry
// (returned as the Gatherer) when reg is nil. Registering twice on one registry reuses the
// collectors already there.
func newMetrics(reg prometheus.Registerer) (*metrics, prometheus.Gatherer, error) {
	reg, gath := registryOrPrivate(reg)
	m := &metrics{
		ticks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_scheduler_ticks_total", Help: "Template ticks run, by result (ok, error, refused_retention: the window is older than its retention).",
		}, []string{"template", "result"}),
		jobs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_scheduler_jobs_total", Help: "Specs of template ticks by enqueue outcome (created, already_queued, requeued, already_complete, already_failed, invalid).",
		}, []string{"template", "outcome"}),
		tickSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "idemscrape_scheduler_tick_seconds", Help: "Duration of one template tick.",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 10),
		}, []string{"template"}),
		lastTick: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "idemscrape_scheduler_last_tick_timestamp_seconds", Help: "Scheduled time of the last successful tick.",
		}, []string{"template"}),
		gaps: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "idemscrape_scheduler_window_gaps", Help: "Due windows past their retry deadline that were never enqueued (idemscrape windows -gaps; fill with idemscrape windows -fill).",
		}, []string{"template"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_scheduler_tick_retries_total", Help: "Failed ticks tried again, by outcome of the retry (ok, error, given_up: past the window's deadline).",
		}, []string{"template", "result"}),
	}
	var err error
	m.gaps = register(reg, m.gaps, &err)
	m.retries = register(reg, m.retries, &err)
	m.ticks = register(reg, m.ticks, &err)
	m.jobs = register(reg, m.jobs, &err)
	m.tickSeconds = register(reg, m.tickSeconds, &err)
	m.lastTick = register(reg, m.lastTick, &err)
	return m, gath, err
}

// registryOrPrivate returns reg and a nil Gatherer, or, when reg is nil, a new private
// registry as both. newMetrics and newReconcilerMetrics use it.
func registryOrPrivate(reg prometheus.Registerer) (prometheus.Registerer, prometheus.Gatherer) {
	if reg != nil {
		return reg, nil
	}
	r := prometheus.NewRegistry()
	return r, r
}

// register registers c on reg and returns it, or the equal collector already registered.
func register[C prometheus.Collector](reg prometheus.Registerer, c C, errp *error) C {
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(C); ok {
				return existing
			}
		}
		if *errp == nil {
			*errp = err
		}
	}
	return c
}
