package handlers

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemscrape/idemscrape/politeness"
	"github.com/idemscrape/idemscrape/sessions"
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
	proxyCost         *prometheus.CounterVec   // kind, provider, currency
	windowStops       *prometheus.CounterVec   // kind, action: failed, deferred, waited
	windowRestores    *prometheus.CounterVec   // kind
	windowTopUps      *prometheus.CounterVec   // kind, result: granted, refused, failed
	routeChanges      *prometheus.CounterVec   // kind, provider, reason
	resent            *prometheus.CounterVec   // kind
	leaseLosses       *prometheus.CounterVec   // kind
	leaseBusy         *prometheus.CounterVec   // kind
	unavailable       *prometheus.CounterVec   // kind
	sessionRestarts   *prometheus.CounterVec   // kind, reason
	sessionResumes    *prometheus.CounterVec   // kind, reason
	commitSeconds     prometheus.Histogram
	acknowledgedNoOps *prometheus.CounterVec // kind, state: deliveries of complete/failed jobs
	incidentOpen      prometheus.Gauge
	providerOpen      *prometheus.GaugeVec   // provider
	incidentTrips     *prometheus.CounterVec // category
	incidentDeferred  *prometheus.CounterVec // kind
	tasksDropped      *prometheus.CounterVec // kind, reason
	hostWait          *prometheus.HistogramVec
	hostThrottled     *prometheus.CounterVec // kind, reason
	hostsPaused       prometheus.GaugeFunc
	robotsFetches     *prometheus.CounterVec // status class
	robotsBytes       prometheus.Counter
	refusedBytes      *prometheus.CounterVec // kind, provider
	robotsLockWaits   *prometheus.CounterVec // outcome
	savedInputs       *prometheus.CounterVec // kind, result (saved, truncated, error)
	poolRetired       *prometheus.CounterVec // provider, reason
	sessionUnits      *prometheus.CounterVec // kind, session (warm, new), outcome
	pool              *poolCollector
}

// poolCollector reports the session pool's sessions per key and state (idle, busy).
type poolCollector struct {
	desc *prometheus.Desc
	pool func() *sessions.Pool
}

func (c *poolCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *poolCollector) Collect(ch chan<- prometheus.Metric) {
	p := c.pool()
	if p == nil {
		return
	}
	// Keys that differ only in their Client (profile or cookie policy) are one series.
	type labels struct{ provider, tier, country, host string }
	idle, busy := map[labels]int{}, map[labels]int{}
	var order []labels
	for _, st := range p.Stats() {
		l := labels{st.Key.Provider, st.Key.Tier, st.Key.Country, st.Key.Host}
		if _, ok := idle[l]; !ok {
			order = append(order, l)
		}
		idle[l] += st.Idle
		busy[l] += st.Busy
	}
	for _, l := range order {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(idle[l]), l.provider, l.tier, l.country, l.host, "idle")
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(busy[l]), l.provider, l.tier, l.country, l.host, "busy")
	}
}

// statusClass is "2xx" … "5xx", or "error" for a fetch without an answer.
func statusClass(status int) string {
	if status < 100 || status > 599 {
		return "error"
	}
	return fmt.Sprintf("%dxx", status/100)
}

func newMetrics(reg prometheus.Registerer, pausedHosts func() float64, pool func() *sessions.Pool) (*metrics, error) {
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
		proxyCost: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_proxy_cost_total",
			Help: "What the attempts' proxy traffic cost at the provider's configured price, in units of the currency (IDEMSCRAPE_PROXY_PRICE); every attempt, wasted ones included.",
		}, []string{"kind", "provider", "currency"}),
		windowStops: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_window_budget_stops_total",
			Help: "Deliveries a window's money budget (WithWindowBudget) kept from fetching: failed (spent, the job failed budget_exceeded), deferred (spent, retried after DeferFor) or waited (the rest of the budget reserved by attempts in flight; retried in seconds).",
		}, []string{"kind", "action"}),
		windowRestores: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_window_budget_restores_total",
			Help: "Times this worker found a window's spent amount missing in Redis (lost, flushed, or unused for a day) and restored it from PostgreSQL.",
		}, []string{"kind"}),
		windowTopUps: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_window_budget_topups_total",
			Help: "Top-ups of running attempts' window reservations (an attempt that reached the bytes its reservation buys): granted (it went on), refused (the window's budget is spent: the attempt stopped, budget_exceeded) or failed (Redis or the window's total unavailable: the attempt stopped, retried).",
		}, []string{"kind", "result"}),
		routeChanges: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_route_changes_total",
			Help: "Routes this worker taught the fleet: reason no_peers (the provider had no exit in the job's country: skipped there for a while) or blocked (the destination blocked the provider's exit tier: escalated to the next tier for a while).",
		}, []string{"kind", "provider", "reason"}),
		resent: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_throttle_resends_total",
			Help: "Requests sent again on their session after a 429/503 with a short Retry-After (sessions.CollectorConfig.ThrottleWaitMax) instead of ending the attempt.",
		}, []string{"kind"}),
		leaseLosses: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_lease_losses_total",
			Help: "Attempts that lost their lease while running.",
		}, []string{"kind"}),
		leaseBusy: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_lease_busy_total",
			Help: "Deliveries that found the job's lease held by another worker (not attempts; retried soon, not counted as failures).",
		}, []string{"kind"}),
		unavailable: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_not_started_unavailable_total",
			Help: "Deliveries that did not start because Redis or PostgreSQL did not answer (not attempts; retried after 0.5–1 s, doubling to at most 1 min).",
		}, []string{"kind"}),
		sessionRestarts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_session_restarts_total",
			Help: "Workflow units replayed on another session (a warm one of the pool, else new), by the category of the loss.",
		}, []string{"kind", "reason"}),
		sessionResumes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_session_resumes_total",
			Help: "Workflow steps run again on their own session instead of a replay, by reason: exit_header (after a cut, the exit to be proven unchanged), portable_state (after a cut, state portable across exits), throttled (a Retry-After waited out).",
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
			Help: "1 while a proxy incident (407: credentials, username format, balance) on every provider stops this worker taking work.",
		}),
		providerOpen: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "idemscrape_provider_incident_open",
			Help: "1 while a proxy incident (407) keeps this worker's deliveries off the provider; with several providers, the others carry the work.",
		}, []string{"provider"}),
		incidentTrips: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_incidents_total",
			Help: "Proxy incidents (a provider refusing the account) that moved this worker off a provider, or stopped it taking work when it was the last, by category.",
		}, []string{"category"}),
		incidentDeferred: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_incident_deferred_deliveries_total",
			Help: "Deliveries handed back to asynq untouched while an incident was open.",
		}, []string{"kind"}),
		tasksDropped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_tasks_dropped_total",
			Help: "asynq tasks revoked or set aside without an attempt: reason no_job_row (revoked: PostgreSQL has no such job) or undecodable (retried late: a newer worker may read it).",
		}, []string{"kind", "reason"}),
		hostWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "idemscrape_host_wait_seconds",
			Help:    "How long requests to a rate-limited destination host waited for the host's fleet-wide slot (0 = sent at once).",
			Buckets: []float64{0, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30},
		}, []string{"kind"}),
		hostThrottled: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_host_throttled_total",
			Help: "Host throttling: reason retry_after (a 429/503 Retry-After paused the host for every worker) or wait_too_long (the host's next slot was beyond HostWaitMax: the attempt ended throttled).",
		}, []string{"kind", "reason"}),
		hostsPaused: prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "idemscrape_hosts_paused",
			Help: "Destination hosts this worker paused fleet-wide after a Retry-After whose pause has not ended yet.",
		}, pausedHosts),
		robotsFetches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_robots_fetches_total",
			Help: "robots.txt fetches this worker made for the fleet-wide cache, by status class (2xx, 4xx, 5xx, error).",
		}, []string{"status"}),
		savedInputs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_saved_inputs_total",
			Help: "Saved inputs written by the runner (WithSavedInputs), by kind and result: saved, truncated (the size cap left something out), error.",
		}, []string{"kind", "result"}),
		robotsBytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "idemscrape_robots_bytes_total",
			Help: "Bytes robots.txt fetches moved through the proxy: the fleet's overhead, not counted against any job's budget.",
		}),
		refusedBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemscrape_proxy_refused_bytes_total",
			Help: "Bytes of the proxy's own refusals (407, 402 no balance, 502 no peers, …), by kind and provider: on the wire, but no exit's traffic, so in no job's bytes, budget or cost.",
		}, []string{"kind", "provider"}),
	}
	m.poolRetired = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "idemscrape_session_pool_retired_total",
		Help: "Warm sessions the worker's session pool retired, by provider and reason: max_units, age (too little sticky lifetime left), idle, blocked, exit (lost or changed), failed (its unit failed otherwise), closed.",
	}, []string{"provider", "reason"})
	m.sessionUnits = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "idemscrape_session_units_total",
		Help: "Units (attempts' workflow runs) by kind, the session they ended on, as their attempt rows record it (warm: from the session pool; new), and outcome (ok, blocked, failed): warm against new block rates.",
	}, []string{"kind", "session", "outcome"})
	m.pool = &poolCollector{pool: pool, desc: prometheus.NewDesc("idemscrape_session_pool_sessions",
		"Sessions in the worker's session pool per key (provider, tier, country, destination host) and state: idle (warm, waiting for a unit) or busy (held by a unit).",
		[]string{"provider", "tier", "country", "host", "state"}, nil)}
	m.robotsLockWaits = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "idemscrape_robots_lock_waits_total",
		Help: "Waits for another worker's robots.txt fetch, by how they ended: entry (its fetch arrived), took_over (its lock ended without one: its fetch failed, or the worker stopped and its lease lapsed; this worker fetched), gave_up (the lock was still held after a quarter of the request's time: the attempt ended as network).",
	}, []string{"outcome"})
	for _, o := range []politeness.RobotsLockWait{politeness.RobotsLockWaitEntry, politeness.RobotsLockWaitTookOver, politeness.RobotsLockWaitGaveUp} {
		m.robotsLockWaits.WithLabelValues(string(o)) // every outcome from the start, at 0
	}
	if err := reg.Register(m.robotsLockWaits); err != nil {
		return nil, err
	}
	for _, c := range []prometheus.Collector{m.poolRetired, m.sessionUnits, m.pool, m.savedInputs, m.hostWait, m.hostThrottled, m.hostsPaused, m.robotsFetches, m.robotsBytes, m.refusedBytes, m.incidentOpen, m.providerOpen, m.incidentTrips, m.incidentDeferred, m.tasksDropped, m.attempts, m.attemptsPerJob, m.afterRecovery, m.duplicateResults,
		m.jobBytes, m.proxyCost, m.windowStops, m.windowRestores, m.windowTopUps, m.routeChanges, m.resent, m.leaseLosses, m.leaseBusy, m.unavailable, m.sessionRestarts, m.sessionResumes, m.commitSeconds, m.acknowledgedNoOps} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}
