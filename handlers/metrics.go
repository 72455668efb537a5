package handlers

import (
	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the runner's Prometheus metrics. All are registered on the Registerer of
// the Config (a private registry by default, so tests and several runners in one process
// never collide).
type metrics struct {
	attempts          *prometheus.CounterVec   // kind, outcome, category
	attemptsPerJob    *prometheus.HistogramVec // kind
	afterRecovery     *prometheus.CounterVec   // kind
	duplicateResults  *prometheus.CounterVec   // kind
	jobBytes          *prometheus.HistogramVec // kind
	leaseLosses       *prometheus.CounterVec   // kind
	leaseBusy         *prometheus.CounterVec   // kind
	sessionRestarts   *prometheus.CounterVec   // kind, reason
	commitSeconds     prometheus.Histogram
	acknowledgedNoOps *prometheus.CounterVec // kind, state: deliveries of complete/failed jobs
	incidentOpen      prometheus.Gauge
	incidentTrips     *prometheus.CounterVec // category
	incidentDeferred  *prometheus.CounterVec // kind
	tasksDropped      *prometheus.CounterVec // kind, reason
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		attempts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_attempts_total",
			Help: "Attempts by job kind, outcome (complete, retryable, failed, superseded) and failure category.",
		}, []string{"kind", "outcome", "category"}),
		attemptsPerJob: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "idemscrape_attempts_per_completed_job",
			Help:    "Attempts a job took until it completed.",
			Buckets: []float64{1, 2, 3, 4, 5, 6, 8, 10, 15, 20},
		}, []string{"kind"}),
		afterRecovery: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_jobs_completed_after_lease_recovery_total",
			Help: "Jobs completed by an attempt that took the job over after another attempt's lease expired.",
		}, []string{"kind"}),
		duplicateResults: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_duplicate_results_total",
			Help: "Result writes rejected by the unique observation key.",
		}, []string{"kind"}),
		jobBytes: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "idemscrape_job_bytes",
			Help:    "Bytes moved through the proxy per logical job, all attempts, observed when the job completes or fails.",
			Buckets: prometheus.ExponentialBuckets(1024, 4, 10),
		}, []string{"kind"}),
		leaseLosses: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_lease_losses_total",
			Help: "Attempts that lost their lease while running.",
		}, []string{"kind"}),
		leaseBusy: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_lease_busy_total",
			Help: "Deliveries that found the job's lease held by another worker (not attempts; retried soon, not counted as failures).",
		}, []string{"kind"}),
		sessionRestarts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_session_restarts_total",
			Help: "Workflow units replayed on a new session, by the category of the loss.",
		}, []string{"kind", "reason"}),
		commitSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "idemscrape_commit_seconds",
			Help:    "Latency of the fenced commit (job + result + outbox + attempt).",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14),
		}),
		acknowledgedNoOps: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_deliveries_acknowledged_total",
			Help: "Deliveries of jobs already complete or failed, acknowledged without work.",
		}, []string{"kind", "state"}),
		incidentOpen: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "idemscrape_incident_open",
			Help: "1 while a proxy incident (407: credentials, username format, balance) stops this worker taking work.",
		}),
		incidentTrips: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_incidents_total",
			Help: "Proxy incidents that stopped this worker taking work, by category.",
		}, []string{"category"}),
		incidentDeferred: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_incident_deferred_deliveries_total",
			Help: "Deliveries handed back to asynq untouched while an incident was open.",
		}, []string{"kind"}),
		tasksDropped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_tasks_dropped_total",
			Help: "asynq tasks revoked or set aside without an attempt: reason no_job_row (revoked: PostgreSQL has no such job) or undecodable (retried late: a newer worker may read it).",
		}, []string{"kind", "reason"}),
	}
	for _, c := range []prometheus.Collector{m.incidentOpen, m.incidentTrips, m.incidentDeferred, m.tasksDropped, m.attempts, m.attemptsPerJob, m.afterRecovery, m.duplicateResults,
		m.jobBytes, m.leaseLosses, m.leaseBusy, m.sessionRestarts, m.commitSeconds, m.acknowledgedNoOps} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}
