package handlers_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/politeness"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
)

// pooledWorkflow is the catalog workflow with its units' Site set to the shop's host.
func (r *rig) pooledWorkflow(t *testing.T) handlers.WorkflowFunc {
	t.Helper()
	site, err := url.Parse(r.site.URL)
	require.NoError(t, err)
	wf := catalog.Workflow(r.site.URL)
	return func(job tasks.Payload) (*sessions.Unit, error) {
		u, err := wf(job)
		if u != nil {
			u.Site = site.Host
		}
		return u, err
	}
}

// pooledRegistry is a registry on the rig with a session pool of the defaults (as
// cmd/worker's), closed at the test's end.
func (r *rig) pooledRegistry(t *testing.T) *handlers.Registry {
	t.Helper()
	reg, err := handlers.NewRegistry(handlers.Config{Store: r.st, Redis: r.ns.Client, Provider: r.prov, KeyPrefix: r.ns.Prefix,
		Collector:   sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), ThrottleWaitMax: -1},
		SessionPool: &sessions.PoolConfig{}})
	require.NoError(t, err)
	t.Cleanup(reg.Close)
	return reg
}

// attemptSessions returns the session id and session_units of each job's attempts, in
// the order of keys (one attempt each).
func attemptSessions(t *testing.T, r *rig, keys []string) (ids []string, units []int) {
	t.Helper()
	for _, k := range keys {
		var id string
		var n int
		require.NoError(t, r.st.Pool().QueryRow(context.Background(),
			`SELECT session_id, session_units FROM attempts WHERE job_key = $1`, k).Scan(&id, &n))
		ids, units = append(ids, id), append(units, n)
	}
	return ids, units
}

// labelledSum is the sum of the registry's samples of metric name (counters and gauges)
// whose labels include every pair of match.
func labelledSum(t *testing.T, reg *handlers.Registry, name string, match map[string]string) float64 {
	t.Helper()
	var sum float64
samples:
	for _, m := range metricFamily(t, reg.Gatherer(), name) {
		labels := map[string]string{}
		for _, l := range m.GetLabel() {
			labels[l.GetName()] = l.GetValue()
		}
		for k, v := range match {
			if labels[k] != v {
				continue samples
			}
		}
		sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
	}
	return sum
}

func unitsMetric(t *testing.T, reg *handlers.Registry, session, outcome string) float64 {
	t.Helper()
	return labelledSum(t, reg, "idemscrape_session_units_total", map[string]string{"kind": catalog.Kind, "session": session, "outcome": outcome})
}

// TestWarmSessionAcrossJobs: with Config.SessionPool, jobs of one shop run one after
// another on one warm session; each attempt records how many units its session had served;
// a parser's block verdict retires the session; the gauge shows the pool.
func TestWarmSessionAcrossJobs(t *testing.T) {
	r := newRig(t, rigOpts{})
	var blockNext bool
	parse := func(job tasks.Payload, staged map[string]json.RawMessage) (handlers.Observation, error) {
		if blockNext {
			blockNext = false
			return handlers.Observation{}, tasks.Fail(tasks.CategoryBlocked, errors.New("the page is a block page"))
		}
		return catalog.Parse(job, staged)
	}
	reg := r.pooledRegistry(t)
	require.NoError(t, reg.Register(catalog.Kind, r.pooledWorkflow(t), parse))
	ctx := context.Background()

	var keys []string
	for i := range 3 {
		key, task := r.job(t, fmt.Sprintf("sku-%d", i+1))
		require.NoError(t, reg.ProcessTask(ctx, task))
		keys = append(keys, key)
	}
	ids, units := attemptSessions(t, r, keys)
	require.Equal(t, []int{0, 1, 2}, units, "a new session, then warm on its 2nd and 3rd unit")
	require.Equal(t, []string{ids[0], ids[0], ids[0]}, ids, "one session for the three jobs")
	atts, err := r.st.AttemptList(ctx, keys[2])
	require.NoError(t, err)
	require.Equal(t, 2, atts[0].SessionUnits, "status and the job page read it")
	require.Equal(t, 1.0, unitsMetric(t, reg, "new", "ok"))
	require.Equal(t, 2.0, unitsMetric(t, reg, "warm", "ok"))
	st := reg.SessionPool().Stats()
	require.Len(t, st, 1)
	require.Equal(t, 1, st[0].Idle)
	require.Equal(t, map[string]float64{"idle": 1, "busy": 0}, poolGauge(t, reg), "the gauge shows the warm session")

	// A parser that finds a block page: the attempt fails blocked, the session is retired.
	blockNext = true
	key4, task4 := r.job(t, "sku-4")
	require.Error(t, reg.ProcessTask(ctx, task4))
	requireJob(t, r.st, key4, tasks.StateRetryable, tasks.CategoryBlocked)
	ids4, units4 := attemptSessions(t, r, []string{key4})
	require.Equal(t, ids[0], ids4[0], "it ran on the warm session")
	require.Equal(t, []int{3}, units4)
	require.Equal(t, 1.0, unitsMetric(t, reg, "warm", "blocked"))
	key5, task5 := r.job(t, "sku-5")
	require.NoError(t, reg.ProcessTask(ctx, task5))
	ids5, units5 := attemptSessions(t, r, []string{key5})
	require.NotEqual(t, ids[0], ids5[0], "the blocked session never serves again")
	require.Equal(t, []int{0}, units5)
	require.Equal(t, 1.0, retiredMetric(t, reg, sessions.PoolRetireBlocked))
}

// poolGauge is idemscrape_session_pool_sessions by state, summed over keys.
func poolGauge(t *testing.T, reg *handlers.Registry) map[string]float64 {
	t.Helper()
	return map[string]float64{
		"idle": labelledSum(t, reg, "idemscrape_session_pool_sessions", map[string]string{"state": "idle"}),
		"busy": labelledSum(t, reg, "idemscrape_session_pool_sessions", map[string]string{"state": "busy"}),
	}
}

func retiredMetric(t *testing.T, reg *handlers.Registry, reason string) float64 {
	t.Helper()
	return labelledSum(t, reg, "idemscrape_session_pool_retired_total", map[string]string{"reason": reason})
}

// TestKindOptsOutOfPool: a kind registered WithoutSessionPool starts every attempt on a
// new session even though the worker has a pool, and leaves nothing in it.
func TestKindOptsOutOfPool(t *testing.T) {
	r := newRig(t, rigOpts{})
	reg := r.pooledRegistry(t)
	require.NoError(t, reg.Register(catalog.Kind, r.pooledWorkflow(t), catalog.Parse, handlers.WithoutSessionPool()))
	var keys []string
	for i := range 3 {
		key, task := r.job(t, fmt.Sprintf("sku-%d", i+1))
		require.NoError(t, reg.ProcessTask(context.Background(), task))
		keys = append(keys, key)
	}
	ids, units := attemptSessions(t, r, keys)
	require.Equal(t, []int{0, 0, 0}, units)
	require.Len(t, map[string]bool{ids[0]: true, ids[1]: true, ids[2]: true}, 3, "three new sessions")
	require.Empty(t, reg.SessionPool().Stats(), "the kind put nothing in the pool")
	require.Equal(t, 3.0, unitsMetric(t, reg, "new", "ok"))
	require.Zero(t, unitsMetric(t, reg, "warm", "ok"))
}

// TestSessionPoolConfigRefused: a pool configuration that can not work is refused by
// NewRegistry, naming the field.
func TestSessionPoolConfigRefused(t *testing.T) {
	r := newRig(t, rigOpts{})
	_, err := handlers.NewRegistry(handlers.Config{Store: r.st, Redis: r.ns.Client, Provider: r.prov, KeyPrefix: r.ns.Prefix,
		SessionPool: &sessions.PoolConfig{MaxUnits: -1}})
	require.ErrorContains(t, err, "SessionPool")
	require.ErrorContains(t, err, "MaxUnits -1 is negative")
}

// TestKindsDoNotShareSessions: two kinds of one shop never take each other's warm sessions
// (one may log in, keep other cookies or another profile); kinds that name one scope do.
func TestKindsDoNotShareSessions(t *testing.T) {
	for _, shared := range []bool{false, true} {
		t.Run(fmt.Sprintf("shared scope %v", shared), func(t *testing.T) {
			r := newRig(t, rigOpts{})
			reg := r.pooledRegistry(t)
			var opts []handlers.KindOption
			if shared {
				opts = append(opts, handlers.WithPoolScope("shop"))
			}
			require.NoError(t, reg.Register(catalog.Kind, r.pooledWorkflow(t), catalog.Parse, opts...))
			require.NoError(t, reg.Register("catalog2", r.pooledWorkflow(t), catalog.Parse, opts...))
			ctx := context.Background()
			keyA, taskA := r.jobOf(t, catalog.Kind, "sku-1", "US", 1)
			require.NoError(t, reg.ProcessTask(ctx, taskA))
			keyB, taskB := r.jobOf(t, "catalog2", "sku-2", "US", 1)
			require.NoError(t, reg.ProcessTask(ctx, taskB))
			ids, units := attemptSessions(t, r, []string{keyA, keyB})
			if shared {
				require.Equal(t, []int{0, 1}, units, "one scope: the second kind takes the warm session")
				require.Equal(t, ids[0], ids[1])
			} else {
				require.Equal(t, []int{0, 0}, units, "the second kind opens its own session")
				require.NotEqual(t, ids[0], ids[1])
			}
		})
	}
}

// TestPoolSiteFromJobURL: a workflow whose unit names no Site is pooled by its job URL's
// host, on a copy: the workflow's own (shared) unit is never changed.
func TestPoolSiteFromJobURL(t *testing.T) {
	r := newRig(t, rigOpts{})
	shared, err := catalog.Unit(r.site.URL, "sku-1")
	require.NoError(t, err)
	shared.Site = ""
	reg := r.pooledRegistry(t)
	require.NoError(t, reg.Register(catalog.Kind, func(tasks.Payload) (*sessions.Unit, error) { return shared, nil }, catalog.Parse))
	var keys []string
	for i := range 2 {
		key, task := r.jobSpec(t, tasks.Spec{Kind: catalog.Kind, URL: r.site.URL + "/product/sku-1", Country: "US",
			Window: fmt.Sprintf("2026-04-2%d", i+1), ParserVersion: 1})
		require.NoError(t, reg.ProcessTask(context.Background(), task))
		keys = append(keys, key)
	}
	ids, units := attemptSessions(t, r, keys)
	require.Equal(t, []int{0, 1}, units, "the second job ran on the first one's session, pooled by the URL's host")
	require.Equal(t, ids[0], ids[1])
	require.Empty(t, shared.Site, "the workflow's unit was not changed")
}

// refusingSite is the shop through a reverse proxy that answers the next refuse product
// pages with status (and Retry-After: retryAfter, when set) instead of the page, counting
// what it refused.
func refusingSite(t *testing.T, site string, status int, retryAfter string, refuse *atomic.Int64) string {
	t.Helper()
	target, err := url.Parse(site)
	require.NoError(t, err)
	rp := httputil.NewSingleHostReverseProxy(target)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/product/") && refuse.Add(-1) >= 0 {
			if retryAfter != "" {
				w.Header().Set("Retry-After", retryAfter)
			}
			http.Error(w, "refused", status)
			return
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// TestBlockRetriesOnNewSession: with the session pool, a 403 on one session retires it,
// and the job's next attempt is due at once (no blocked backoff), on another session: it
// completes there. The attempt cap still counts such retries: a job refused on every
// session fails at its cap of 2. A 429 with Retry-After still waits for the host: its
// retry is due after the Retry-After, and the host is paused for the next job. On the old
// code the 403's retry waited the blocked category's backoff (minutes).
func TestBlockRetriesOnNewSession(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	var refuse atomic.Int64
	newReg := func(t *testing.T, base string) *handlers.Registry {
		t.Helper()
		site, err := url.Parse(base)
		require.NoError(t, err)
		reg, err := handlers.NewRegistry(handlers.Config{Store: r.st, Redis: r.ns.Client, Provider: r.prov, KeyPrefix: r.ns.Prefix,
			Collector:   sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), ThrottleWaitMax: -1},
			SessionPool: &sessions.PoolConfig{}, Rand: func() float64 { return 0.5 },
			// A generous limit that never makes a request wait: the host limiter holds the
			// destination's Retry-After for every worker.
			HostLimits: map[string]politeness.Limit{site.Host: {Rate: 10000, Burst: 1000}}})
		require.NoError(t, err)
		t.Cleanup(reg.Close)
		wf := catalog.Workflow(base)
		require.NoError(t, reg.Register(catalog.Kind, func(job tasks.Payload) (*sessions.Unit, error) {
			u, err := wf(job)
			if u != nil {
				u.Site = site.Host
			}
			return u, err
		}, catalog.Parse, handlers.WithRetry(handlers.RetryConfig{MaxAttempts: 2})))
		return reg
	}
	reg := newReg(t, refusingSite(t, r.site.URL, http.StatusForbidden, "", &refuse))

	// A warm session first: the block is on a session that served before.
	_, warm := r.job(t, "sku-1")
	require.NoError(t, reg.ProcessTask(ctx, warm))

	refuse.Store(1)
	key, task := r.job(t, "sku-2")
	d := decisionOf(reg.ProcessTask(ctx, task))
	require.True(t, d.Retry && d.Counted, "a counted retry: %+v", d)
	assert.Zero(t, d.Delay, "due at once: the next attempt runs on another session")
	job := requireJob(t, r.st, key, tasks.StateRetryable, tasks.CategoryBlocked)
	require.NotNil(t, job.NextAttemptAt)
	assert.False(t, job.NextAttemptAt.After(time.Now()), "the row is due now too")
	assert.Equal(t, 1.0, retiredMetric(t, reg, sessions.PoolRetireBlocked))
	require.NoError(t, reg.ProcessTask(ctx, task), "the retry completes")
	atts, err := r.st.AttemptList(ctx, key)
	require.NoError(t, err)
	require.Len(t, atts, 2)
	assert.Equal(t, store.OutcomeRetryable, atts[0].Outcome)
	assert.Equal(t, 403, atts[0].HTTPStatus)
	assert.Equal(t, store.OutcomeComplete, atts[1].Outcome)
	assert.NotEqual(t, atts[0].SessionID, atts[1].SessionID, "on another session")

	// Refused on every session: the cap of 2 counts the immediate retry.
	refuse.Store(2)
	key, task = r.job(t, "sku-3")
	d = decisionOf(reg.ProcessTask(ctx, task))
	require.True(t, d.Retry && d.Counted && d.Delay == 0, "%+v", d)
	d = decisionOf(reg.ProcessTask(ctx, task))
	assert.True(t, d.Skip, "the second refusal is the cap: %+v", d)
	job = requireJob(t, r.st, key, tasks.StateFailed, tasks.CategoryBudgetExceeded)
	assert.Equal(t, 2, job.Attempts)
	require.Zero(t, refuse.Load(), "both refusals were met")

	// A 429 with Retry-After: the session is retired too, but the retry waits for the host.
	var throttle atomic.Int64
	throttle.Store(1)
	reg429 := newReg(t, refusingSite(t, r.site.URL, http.StatusTooManyRequests, "120", &throttle))
	key, task = r.job(t, "sku-4")
	d = decisionOf(reg429.ProcessTask(ctx, task))
	require.True(t, d.Retry && d.Counted, "%+v", d)
	assert.Equal(t, 120*time.Second, d.Delay, "the host's Retry-After, not less")
	requireJob(t, r.st, key, tasks.StateRetryable, tasks.CategoryThrottled)
	_, other := r.job(t, "sku-5")
	d = decisionOf(reg429.ProcessTask(ctx, other))
	assert.True(t, d.Retry && !d.Counted, "the host stays paused for the next job, uncounted: %+v", d)
	assert.Greater(t, d.Delay, 60*time.Second, "it waits for the host's pause: %+v", d)
}
