package handlers_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/ops"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// timedSite is a destination that records when each request arrived (the fake site keeps
// counts only), for rate assertions measured at the site.
type timedSite struct {
	*httptest.Server
	host string // host:port, as the limiter keys it

	mu          sync.Mutex
	arrivals    []arrival
	robots      int // status of /robots.txt
	throttleAt  int // the n-th /item request answers 429 Retry-After: 2 (0 = never)
	items       int // /item requests so far
	throttledAt []time.Time
}

type arrival struct {
	path string
	at   time.Time
}

func newTimedSite(t *testing.T) *timedSite {
	t.Helper()
	s := &timedSite{robots: http.StatusOK}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		now := time.Now()
		host, _, _ := net.SplitHostPort(r.RemoteAddr)
		w.Header().Set("X-Exit", host)
		s.mu.Lock()
		s.arrivals = append(s.arrivals, arrival{r.URL.Path, now})
		robots := s.robots
		throttle := false
		if strings.HasPrefix(r.URL.Path, "/item/") {
			s.items++
			if s.items == s.throttleAt {
				throttle = true
				s.throttledAt = append(s.throttledAt, now)
			}
		}
		s.mu.Unlock()
		switch {
		case r.URL.Path == "/robots.txt":
			w.WriteHeader(robots)
			_, _ = fmt.Fprint(w, "User-agent: *\nDisallow: /private/\n")
		case throttle:
			w.Header().Set("Retry-After", "2")
			w.WriteHeader(http.StatusTooManyRequests)
		default:
			_ = json.NewEncoder(w).Encode(map[string]string{"path": r.URL.Path, "exit": host})
		}
	}))
	t.Cleanup(s.Close)
	s.host = strings.TrimPrefix(s.URL, "http://")
	return s
}

func (s *timedSite) times(pathPrefix string) []time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	var ts []time.Time
	for _, a := range s.arrivals {
		if strings.HasPrefix(a.path, pathPrefix) {
			ts = append(ts, a.at)
		}
	}
	slices.SortFunc(ts, func(a, b time.Time) int { return a.Compare(b) })
	return ts
}

// itemKind fetches <base>/item/<source id> in one step.
func itemWorkflow(base string) handlers.WorkflowFunc {
	return func(job tasks.Payload) (*sessions.Unit, error) {
		return &sessions.Unit{Name: "item", Steps: []sessions.Step{{Name: "item", Safe: true,
			Run: func(ctx context.Context, sc *sessions.StepContext) error {
				resp, err := sc.Get(base + "/item/" + job.Spec.SourceID)
				if err != nil {
					return err
				}
				return sc.Staging.Put("item", json.RawMessage(resp.Body))
			}}}}, nil
	}
}

func itemParse(_ tasks.Payload, staged map[string]json.RawMessage) (handlers.Observation, error) {
	return handlers.Observation{Data: staged["item"]}, nil
}

// kindJob records a job of kind for id and returns its key and task.
func (r *rig) kindJob(t *testing.T, kind, id string) (string, *asynq.Task) {
	t.Helper()
	spec, err := tasks.Spec{Kind: kind, SourceID: id, Country: "US", Window: "2026-04-23", ParserVersion: 1}.Normalize()
	require.NoError(t, err)
	key, err := spec.Key()
	require.NoError(t, err)
	_, err = r.st.JobsRecord(context.Background(), []tasks.JobRecord{{Key: key, Spec: spec}})
	require.NoError(t, err)
	payload, err := json.Marshal(tasks.Payload{Key: key, Spec: spec})
	require.NoError(t, err)
	return key, asynq.NewTask(kind, payload)
}

// runFleet delivers every task once, spread over the registries with perReg goroutines
// each, as len(regs) worker processes would, and returns each task's error by index.
func runFleet(regs []*handlers.Registry, perReg int, ts []*asynq.Task) []error {
	errs := make([]error, len(ts))
	next := make(chan int, len(ts))
	for i := range ts {
		next <- i
	}
	close(next)
	var wg sync.WaitGroup
	for _, reg := range regs {
		for range perReg {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range next {
					errs[i] = reg.ProcessTask(context.Background(), ts[i])
				}
			}()
		}
	}
	wg.Wait()
	return errs
}

func metricFamily(t *testing.T, g prometheus.Gatherer, name string) []*dto.Metric {
	t.Helper()
	mfs, err := g.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()
		}
	}
	return nil
}

func labelled(m *dto.Metric, name, value string) bool {
	for _, l := range m.GetLabel() {
		if l.GetName() == name && l.GetValue() == value {
			return true
		}
	}
	return false
}

// fleetCounter sums a counter over every registry, for metrics whose labels match.
func fleetCounter(t *testing.T, regs []*handlers.Registry, name, label, value string) float64 {
	t.Helper()
	var v float64
	for _, reg := range regs {
		for _, m := range metricFamily(t, reg.Gatherer(), name) {
			if label == "" || labelled(m, label, value) {
				v += m.GetCounter().GetValue()
			}
		}
	}
	return v
}

func TestRobotsFetchedOncePerHost(t *testing.T) {
	ctx := context.Background()

	t.Run("FiftyJobsFourWorkers", func(t *testing.T) {
		r := newRig(t, rigOpts{})
		regs := make([]*handlers.Registry, 4)
		for i := range regs {
			regs[i] = r.registry(t, func(c *handlers.Config) { c.WorkerID = fmt.Sprintf("worker-%d", i) })
		}
		var ts []*asynq.Task
		for i := 1; i <= 50; i++ {
			_, task := r.job(t, fmt.Sprintf("sku-%d", i))
			ts = append(ts, task)
		}
		for i, err := range runFleet(regs, 4, ts) {
			require.NoError(t, err, "job %d", i)
		}
		assert.Equal(t, 50, testutil.Count(t, r.st.Pool(), `SELECT count(*)::int FROM jobs WHERE state = 'complete'`))
		assert.Equal(t, 1, r.site.RobotsHits(), "one robots.txt fetch for 50 jobs on 4 workers")
		assert.Equal(t, 1.0, fleetCounter(t, regs, "idemscrape_robots_fetches_total", "status", "2xx"))
		var robotsBytes float64
		for _, reg := range regs {
			for _, m := range metricFamily(t, reg.Gatherer(), "idemscrape_robots_bytes_total") {
				robotsBytes += m.GetCounter().GetValue()
			}
		}
		assert.Positive(t, robotsBytes, "the fetch's bytes are the fleet's")
		// Zero config: no host is limited, so the limiter never touched Redis.
		tat, err := r.ns.Client.Keys(ctx, r.ns.Prefix+"*:tat").Result()
		require.NoError(t, err)
		assert.Empty(t, tat)
		for _, reg := range regs {
			assert.Empty(t, metricFamily(t, reg.Gatherer(), "idemscrape_host_wait_seconds"))
		}
	})
	t.Run("DisallowedPathIsTerminal", func(t *testing.T) {
		r := newRig(t, rigOpts{})
		reg := r.registryKind(t, func(tasks.Payload) (*sessions.Unit, error) {
			return &sessions.Unit{Name: "private", Steps: []sessions.Step{{Name: "private", Safe: true,
				Run: func(ctx context.Context, sc *sessions.StepContext) error {
					_, err := sc.Get(r.site.URL + "/private/report")
					return err
				}}}}, nil
		}, catalog.Parse)
		key, task := r.job(t, "sku-1")
		d := decisionOf(reg.ProcessTask(ctx, task))
		require.True(t, d.Skip, "terminal: %s", d.ErrorMsg)
		job, err := r.st.JobGet(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, tasks.StateFailed, job.State)
		assert.Equal(t, string(tasks.CategoryRobotsDisallowed), job.LastCategory)
		atts, err := r.st.AttemptList(ctx, key)
		require.NoError(t, err)
		require.Len(t, atts, 1)
		assert.Contains(t, atts[0].Error, "robots.txt of "+r.site.URL+" disallows /private/report")
		assert.Zero(t, r.site.Hits("/private/report"))
	})
	t.Run("ServerErrorRobotsJobsWait", func(t *testing.T) {
		r := newRig(t, rigOpts{})
		site := newTimedSite(t)
		site.mu.Lock()
		site.robots = http.StatusServiceUnavailable
		site.mu.Unlock()
		reg := r.registryKind(t, itemWorkflow(site.URL), itemParse)
		var keys []string
		var ts []*asynq.Task
		for i := range 5 {
			key, task := r.job(t, fmt.Sprintf("sku-%d", i+1))
			keys, ts = append(keys, key), append(ts, task)
		}
		for _, err := range runFleet([]*handlers.Registry{reg}, 2, ts) {
			d := decisionOf(err)
			require.True(t, d.Retry, "jobs wait, they do not fail: %s", d.ErrorMsg)
			assert.True(t, d.Counted)
		}
		for _, key := range keys {
			job, err := r.st.JobGet(ctx, key)
			require.NoError(t, err)
			assert.Equal(t, tasks.StateRetryable, job.State)
			assert.Equal(t, string(tasks.CategoryDestinationError), job.LastCategory)
			atts, err := r.st.AttemptList(ctx, key)
			require.NoError(t, err)
			assert.Contains(t, atts[0].Error, "robots.txt of "+site.URL+" answered 503")
		}
		assert.Len(t, site.times("/robots.txt"), 1, "the 5xx is shared for a while, not fetched per job")
		assert.Empty(t, site.times("/item/"))
	})
}

func TestHostRateLimitFleetWide(t *testing.T) {
	const (
		rate   = 20
		burst  = 5
		jitter = 2 // requests a 1 s window at the site may gain from network jitter
		jobsA  = 110
		jobsB  = 110
	)
	r := newRig(t, rigOpts{})
	siteA, siteB := newTimedSite(t), newTimedSite(t)
	regs := make([]*handlers.Registry, 3)
	for i := range regs {
		reg, err := handlers.NewRegistry(handlers.Config{Store: r.st, Redis: r.ns.Client, Provider: r.prov, KeyPrefix: r.ns.Prefix,
			WorkerID:  fmt.Sprintf("worker-%d", i),
			Collector: sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), RequestTimeout: 5 * time.Second},
			HostLimits: map[string]lua.Limit{
				siteA.host: {Rate: rate, Burst: burst},
				siteB.host: {Rate: 10000, Burst: 1000}, // generous: never makes anyone wait here
			},
		})
		require.NoError(t, err)
		t.Cleanup(reg.Close)
		require.NoError(t, reg.Register("polite.a", itemWorkflow(siteA.URL), itemParse))
		require.NoError(t, reg.Register("polite.b", itemWorkflow(siteB.URL), itemParse))
		regs[i] = reg
	}
	var ts []*asynq.Task
	for i := range max(jobsA, jobsB) {
		if i < jobsA {
			_, task := r.kindJob(t, "polite.a", fmt.Sprintf("a-%d", i))
			ts = append(ts, task)
		}
		if i < jobsB {
			_, task := r.kindJob(t, "polite.b", fmt.Sprintf("b-%d", i))
			ts = append(ts, task)
		}
	}
	for i, err := range runFleet(regs, 6, ts) {
		require.NoError(t, err, "job %d", i)
	}

	// Measured at the site: every 1 s window holds at most rate + burst requests (robots.txt
	// included: it is paced too).
	arrivals := siteA.times("/")
	require.Len(t, arrivals, jobsA+1)
	most := 0
	for i, t0 := range arrivals {
		n := 0
		for _, t1 := range arrivals[i:] {
			if t1.Sub(t0) >= time.Second {
				break
			}
			n++
		}
		most = max(most, n)
	}
	if !assert.LessOrEqual(t, most, rate+burst+jitter, "busiest 1 s window at the site") {
		for _, a := range arrivals {
			t.Log(a.Sub(arrivals[0]))
		}
	}
	span := arrivals[len(arrivals)-1].Sub(arrivals[0])
	assert.GreaterOrEqual(t, span, time.Duration(len(arrivals)-burst)*time.Second/rate-200*time.Millisecond,
		"%d requests at %d/s after a burst of %d take at least this long", len(arrivals), rate, burst)

	// The other host was never held back: every request to it was sent at once.
	var waitsB, zeroB uint64
	for _, reg := range regs {
		for _, m := range metricFamily(t, reg.Gatherer(), "idemscrape_host_wait_seconds") {
			if !labelled(m, "kind", "polite.b") {
				continue
			}
			h := m.GetHistogram()
			waitsB += h.GetSampleCount()
			zeroB += h.GetBucket()[0].GetCumulativeCount() // le=0
		}
	}
	assert.Equal(t, uint64(jobsB+1), waitsB, "every request to B (and its robots.txt) asked the limiter")
	assert.Equal(t, waitsB, zeroB, "and none of them waited")
}

func TestRetryAfterSlowsHost(t *testing.T) {
	const (
		rate  = 5
		jobs  = 15
		pause = 2 * time.Second // the site's Retry-After
	)
	r := newRig(t, rigOpts{})
	site := newTimedSite(t)
	site.mu.Lock()
	site.throttleAt = 5
	site.mu.Unlock()
	regs := make([]*handlers.Registry, 3)
	for i := range regs {
		reg, err := handlers.NewRegistry(handlers.Config{Store: r.st, Redis: r.ns.Client, Provider: r.prov, KeyPrefix: r.ns.Prefix,
			WorkerID:   fmt.Sprintf("worker-%d", i),
			Collector:  sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), RequestTimeout: 5 * time.Second},
			HostLimits: map[string]lua.Limit{site.host: {Rate: rate, Burst: 1}},
		})
		require.NoError(t, err)
		t.Cleanup(reg.Close)
		require.NoError(t, reg.Register("polite.a", itemWorkflow(site.URL), itemParse))
		regs[i] = reg
	}
	var ts []*asynq.Task
	for i := range jobs {
		_, task := r.kindJob(t, "polite.a", fmt.Sprintf("a-%d", i))
		ts = append(ts, task)
	}
	var throttled []asynqDecision
	for i, err := range runFleet(regs, 2, ts) {
		d := decisionOf(err)
		if !d.Ack {
			throttled = append(throttled, d)
			continue
		}
		require.NoError(t, err, "job %d", i)
	}
	require.Len(t, throttled, 1, "only the job that got the 429 did not complete")
	assert.True(t, throttled[0].Retry)
	assert.GreaterOrEqual(t, throttled[0].Delay, pause, "it waits at least the Retry-After")
	assert.Contains(t, throttled[0].ErrorMsg, string(tasks.CategoryThrottled))

	site.mu.Lock()
	throttledAt := slices.Clone(site.throttledAt)
	site.mu.Unlock()
	require.Len(t, throttledAt, 1)
	t429 := throttledAt[0]
	var during, after int
	var offsets []time.Duration
	for _, at := range site.times("/item/") {
		offsets = append(offsets, at.Sub(t429).Round(time.Millisecond))
		switch {
		case at.After(t429) && at.Before(t429.Add(pause)):
			during++
		case !at.Before(t429.Add(pause)):
			after++
		}
	}
	assert.Zero(t, during, "no worker sent anything to the host during its Retry-After; arrivals relative to the 429: %v", offsets)
	assert.Positive(t, after, "the other workers' jobs went on after the pause")
	assert.Equal(t, 1.0, fleetCounter(t, regs, "idemscrape_host_throttled_total", "reason", "retry_after"))
}

func TestSilentExitChangeIsSessionLoss(t *testing.T) {
	ctx := context.Background()
	clock := testutil.NewClock(time.Date(2026, 4, 23, 15, 0, 0, 0, time.UTC))
	// The fake proxy re-assigns a session's exit, without any error, once a minute of its
	// (stub) clock has passed; the site is not strict, so only the exit check can notice.
	r := newRig(t, rigOpts{proxy: testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: "acct", Password: canary,
		SessionLifetime: time.Minute, Now: clock.Now}})
	var err error
	r.prov, err = r.prov.WithExitHeader("X-Exit") // the fake site names the exit it saw
	require.NoError(t, err)

	var moved atomic.Bool
	workflow := func(job tasks.Payload) (*sessions.Unit, error) {
		u, err := catalog.Workflow(r.site.URL)(job)
		if err != nil {
			return nil, err
		}
		orig := u.Steps[0].Run
		u.Steps[0].Run = func(ctx context.Context, sc *sessions.StepContext) error {
			err := orig(ctx, sc)
			if moved.CompareAndSwap(false, true) {
				clock.Advance(2 * time.Minute) // mid-unit, after step 1 of the first session
			}
			return err
		}
		return u, nil
	}
	// The record keeps the exit each step saw, so the test can tell where it came from.
	parse := func(job tasks.Payload, staged map[string]json.RawMessage) (handlers.Observation, error) {
		obs, err := catalog.Parse(job, staged)
		if err != nil {
			return obs, err
		}
		var steps [3]struct{ Exit string }
		for i, k := range []string{"search", "product", "price"} {
			if err := json.Unmarshal(staged[k], &steps[i]); err != nil {
				return obs, err
			}
		}
		obs.Data = map[string]any{"record": obs.Data, "exits": []string{steps[0].Exit, steps[1].Exit, steps[2].Exit}}
		return obs, nil
	}
	reg := r.registryKind(t, workflow, parse)
	key, task := r.job(t, "sku-4")
	require.NoError(t, reg.ProcessTask(ctx, task))

	var data struct{ Exits []string }
	var raw []byte
	require.NoError(t, r.st.Pool().QueryRow(ctx, `SELECT data FROM results WHERE job_key = $1`, key).Scan(&raw))
	require.NoError(t, json.Unmarshal(raw, &data))
	require.Len(t, data.Exits, 3)
	assert.Equal(t, []string{data.Exits[0], data.Exits[0], data.Exits[0]}, data.Exits, "the committed result comes from one exit")

	atts, err := r.st.AttemptList(ctx, key)
	require.NoError(t, err)
	require.Len(t, atts, 1)
	assert.Equal(t, store.OutcomeComplete, atts[0].Outcome)
	assert.Equal(t, data.Exits[0], r.proxy.ExitOf(atts[0].SessionID), "on the restarted session's exit")
	assert.Equal(t, 1, testutil.Count(t, r.st.Pool(),
		`SELECT count(*)::int FROM quarantine WHERE job_key = $1 AND attempt_no = 1 AND reason LIKE 'session_lost%exit changed%'`, key),
		"the lost session's half is quarantined with the reason")
	assert.Equal(t, 1.0, fleetCounter(t, []*handlers.Registry{reg}, "idemscrape_session_restarts_total", "reason", string(tasks.CategorySessionLost)))
}

func TestHostWaitRespectsTheJob(t *testing.T) {
	ctx := context.Background()
	setup := func(t *testing.T, waitMax time.Duration, onRenew func(error)) (*rig, *timedSite, *handlers.Registry) {
		r := newRig(t, rigOpts{})
		site := newTimedSite(t)
		reg, err := handlers.NewRegistry(handlers.Config{Store: r.st, Redis: r.ns.Client, Provider: r.prov, KeyPrefix: r.ns.Prefix,
			Collector:   sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), RequestTimeout: 5 * time.Second, IgnoreRobotsTxt: true},
			HostLimits:  map[string]lua.Limit{site.host: {Rate: 100, Burst: 10}},
			HostWaitMax: waitMax,
			KeepOptions: &lua.KeepOptions{Interval: 50 * time.Millisecond, OnRenew: onRenew},
		})
		require.NoError(t, err)
		t.Cleanup(reg.Close)
		require.NoError(t, reg.Register("polite.a", itemWorkflow(site.URL), itemParse))
		// Another worker got a 429 with a long Retry-After from this host.
		hl, err := lua.NewHostLimits(r.ns.Client, r.ns.Prefix)
		require.NoError(t, err)
		_, err = hl.Pause(ctx, site.host, time.Minute)
		require.NoError(t, err)
		return r, site, reg
	}

	t.Run("TooLongAWaitEndsTheAttemptThrottled", func(t *testing.T) {
		r, site, reg := setup(t, 0, nil) // HostWaitMax: the default, 10 s
		key, task := r.kindJob(t, "polite.a", "a-1")
		d := decisionOf(reg.ProcessTask(ctx, task))
		require.True(t, d.Retry, d.ErrorMsg)
		assert.Greater(t, d.Delay, 50*time.Second, "retried once the host's pause is over")
		job, err := r.st.JobGet(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, string(tasks.CategoryThrottled), job.LastCategory)
		assert.Empty(t, site.times("/"))
		assert.Equal(t, 1.0, fleetCounter(t, []*handlers.Registry{reg}, "idemscrape_host_throttled_total", "reason", "wait_too_long"))
	})
	t.Run("KeeperRenewsWhileWaitingAndLeaseLossEndsTheWait", func(t *testing.T) {
		renewed := make(chan error, 100)
		r, site, reg := setup(t, 5*time.Minute, func(err error) {
			select {
			case renewed <- err:
			default:
			}
		})
		key, task := r.kindJob(t, "polite.a", "a-1")
		done := make(chan error, 1)
		go func() { done <- reg.ProcessTask(ctx, task) }()
		// The job waits for the host (a minute away) while its lease is renewed...
		for range 3 {
			require.NoError(t, <-renewed)
		}
		// ...until the lease is lost: the wait ends at once, not when the pause does.
		keys, err := lua.NewKeys(r.ns.Prefix)
		require.NoError(t, err)
		require.NoError(t, r.ns.Client.Del(ctx, keys.Lease(key)).Err())
		d := decisionOf(<-done)
		require.True(t, d.Retry, d.ErrorMsg)
		job, err := r.st.JobGet(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, string(tasks.CategoryLeaseLost), job.LastCategory)
		assert.Empty(t, site.times("/"), "nothing was sent")
	})
	t.Run("ShutdownEndsTheWait", func(t *testing.T) {
		renewed := make(chan error, 100)
		r, site, reg := setup(t, 5*time.Minute, func(err error) {
			select {
			case renewed <- err:
			default:
			}
		})
		key, task := r.kindJob(t, "polite.a", "a-1")
		dctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- reg.ProcessTask(dctx, task) }()
		require.NoError(t, <-renewed)
		cancel()
		d := decisionOf(<-done)
		require.True(t, d.Retry, d.ErrorMsg)
		job, err := r.st.JobGet(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, string(tasks.CategoryInterrupted), job.LastCategory)
		assert.Empty(t, site.times("/"))
	})
}

func TestPolitenessConfig(t *testing.T) {
	r := newRig(t, rigOpts{})
	build := func(mutate func(*handlers.Config)) error {
		cfg := handlers.Config{Store: r.st, Redis: r.ns.Client, Provider: r.prov, KeyPrefix: r.ns.Prefix, NoGroupCommit: true}
		mutate(&cfg)
		reg, err := handlers.NewRegistry(cfg)
		if err == nil {
			reg.Close()
		}
		return err
	}
	t.Run("BadHostLimit", func(t *testing.T) {
		err := build(func(c *handlers.Config) { c.HostLimits = map[string]lua.Limit{"shop.example": {Rate: -1}} })
		require.ErrorContains(t, err, `Config.HostLimits["shop.example"]`)
		require.ErrorContains(t, err, "Limit.Rate")
	})
	t.Run("BadDefaultHostLimit", func(t *testing.T) {
		err := build(func(c *handlers.Config) { c.DefaultHostLimit = &lua.Limit{Rate: 1, Burst: -2} })
		require.ErrorContains(t, err, "Config.DefaultHostLimit")
	})
	t.Run("NegativeHostWaitMax", func(t *testing.T) {
		require.ErrorContains(t, build(func(c *handlers.Config) { c.HostWaitMax = -time.Second }), "Config.HostWaitMax")
	})
	t.Run("BadKindLimit", func(t *testing.T) {
		reg, err := handlers.NewRegistry(handlers.Config{Store: r.st, Redis: r.ns.Client, Provider: r.prov, KeyPrefix: r.ns.Prefix, NoGroupCommit: true})
		require.NoError(t, err)
		defer reg.Close()
		err = reg.Register("polite.a", itemWorkflow("http://127.0.0.1:1"), itemParse, handlers.WithHostLimit(lua.Limit{Rate: -3}))
		require.ErrorContains(t, err, "WithHostLimit")
	})
}

// TestHostPauseCapped: a Retry-After of two hours pauses the host for the fleet at most
// MaxHostPause; the job that received it still waits the whole Retry-After.
func TestHostPauseCapped(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	reg := r.registry(t, func(c *handlers.Config) { c.DefaultHostLimit = &lua.Limit{Rate: 100, Burst: 10} })
	key, task := r.job(t, "sku-13")
	r.site.Throttle(1, 2*time.Hour)
	dec := decisionOf(reg.ProcessTask(ctx, task))
	require.True(t, dec.Retry, "%+v", dec)
	require.GreaterOrEqual(t, dec.Delay, 2*time.Hour-time.Minute, "the job waits its whole Retry-After")
	keys, err := r.ns.Client.Keys(ctx, r.ns.Prefix+"{host:*}:notbefore").Result()
	require.NoError(t, err)
	require.Len(t, keys, 1, "the host was paused for the fleet")
	ttl, err := r.ns.Client.PTTL(ctx, keys[0]).Result()
	require.NoError(t, err)
	require.LessOrEqual(t, ttl, handlers.MaxHostPause, "but at most MaxHostPause")
	job, err := r.st.JobGet(ctx, key)
	require.NoError(t, err)
	require.Equal(t, string(tasks.CategoryThrottled), job.LastCategory)
}

// TestFleetPauseNotChargedToBudget: a job that meets a host paused fleet-wide by another
// job's Retry-After (nothing sent) is retried once the pause is over, uncounted and out of
// its budgets — not failed as budget_exceeded although the pause is longer than what is
// left of its total time budget, and although this is its last attempt under the cap. The
// job that receives a Retry-After itself is still charged for it.
func TestFleetPauseNotChargedToBudget(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	site := newTimedSite(t)
	reg, err := handlers.NewRegistry(handlers.Config{Store: r.st, Redis: r.ns.Client, Provider: r.prov, KeyPrefix: r.ns.Prefix,
		Collector:  sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), RequestTimeout: 5 * time.Second, IgnoreRobotsTxt: true},
		HostLimits: map[string]lua.Limit{site.host: {Rate: 100, Burst: 10}},
		Rand:       func() float64 { return 0.5 },
	})
	require.NoError(t, err)
	t.Cleanup(reg.Close)
	tight := handlers.WithRetry(handlers.RetryConfig{MaxAttempts: 1, TotalBudget: 30 * time.Second})
	require.NoError(t, reg.Register("polite.a", itemWorkflow(site.URL), itemParse, tight))

	t.Run("FleetPause", func(t *testing.T) {
		hl, err := lua.NewHostLimits(r.ns.Client, r.ns.Prefix)
		require.NoError(t, err)
		_, err = hl.Pause(ctx, site.host, time.Minute) // another worker's 429
		require.NoError(t, err)
		key, task := r.kindJob(t, "polite.a", "a-1")
		d := decisionOf(reg.ProcessTask(ctx, task))
		require.True(t, d.Retry, d.ErrorMsg)
		assert.False(t, d.Counted, "the fleet's wait is not the job's failure")
		assert.Greater(t, d.Delay, 50*time.Second, "retried once the host's pause is over")
		job, err := r.st.JobGet(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, tasks.StateRetryable, job.State)
		assert.Equal(t, string(tasks.CategoryThrottled), job.LastCategory)
		budget, err := ops.New(r.st.Pool()).BudgetGet(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, 1, budget.Attempts, "the attempt is out of the job's attempt cap")
		assert.Empty(t, site.times("/"), "nothing was sent")
	})
	t.Run("OwnRetryAfterStillCharged", func(t *testing.T) {
		site2 := newTimedSite(t)
		site2.throttleAt = 1 // the first /item answers 429 Retry-After: 2
		require.NoError(t, reg.Register("polite.b", itemWorkflow(site2.URL), itemParse,
			handlers.WithRetry(handlers.RetryConfig{MaxAttempts: 1, TotalBudget: 30 * time.Second})))
		key, task := r.kindJob(t, "polite.b", "b-1")
		d := decisionOf(reg.ProcessTask(ctx, task))
		require.True(t, d.Skip, d.ErrorMsg)
		job, err := r.st.JobGet(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, tasks.StateFailed, job.State)
		assert.Equal(t, string(tasks.CategoryBudgetExceeded), job.LastCategory, "the destination answered this job: its own failure")
	})
}
