package handlers_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

const canary = "CANARY-pw-7f3a9c"

type rig struct {
	st    *store.PG
	ns    *testutil.RedisNS
	proxy *testutil.FakeProxy
	site  *testutil.FakeSite
	prov  *sessions.Provider
}

type rigOpts struct {
	proxy testutil.FakeProxyConfig
	site  testutil.FakeSiteConfig
}

func newRig(t *testing.T, o rigOpts) *rig {
	t.Helper()
	if o.proxy.Format == "" {
		o.proxy.Format, o.proxy.User, o.proxy.Password = testutil.ProxyFormatGeneric, "acct", canary
	}
	r := &rig{st: store.New(testutil.PG(t)), ns: testutil.Redis(t), proxy: testutil.NewFakeProxy(t, o.proxy), site: testutil.NewFakeSite(t, o.site)}
	r.prov = newProvider(t, "generic", r.proxy.Addr)
	return r
}

// newProvider returns provider name on gateway with the rig's account (acct, canary) and
// its sticky username template.
func newProvider(tb testing.TB, name, gateway string) *sessions.Provider {
	tb.Helper()
	p, err := sessions.NewProvider(name, gateway, "{user}[-country-{country}]-session-{session}", "{pass}", "acct", canary, 0)
	require.NoError(tb, err)
	return p
}

// registry returns a runner on the rig. mutate may change the config before it is built.
func (r *rig) registry(t *testing.T, mutate func(*handlers.Config), opts ...handlers.KindOption) *handlers.Registry {
	t.Helper()
	cfg := handlers.Config{
		Store: r.st, Redis: r.ns.Client, Provider: r.prov, KeyPrefix: r.ns.Prefix,
		// A 429 with Retry-After 1 s ends the attempt, as the failure tests expect (the
		// re-send on the same session is TestThrottleResend's).
		Collector: sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), RequestTimeout: 5 * time.Second, ThrottleWaitMax: -1},
		Logger:    slog.New(slog.NewTextHandler(testWriter{t}, nil)),
		Rand:      func() float64 { return 0.5 },
	}
	if mutate != nil {
		mutate(&cfg)
	}
	reg, err := handlers.NewRegistry(cfg)
	require.NoError(t, err)
	t.Cleanup(reg.Close)
	require.NoError(t, reg.Register(catalog.Kind, catalog.Workflow(r.site.URL), catalog.Parse, opts...))
	return reg
}

// registryKind returns a runner on the rig with the catalog kind built from workflow and
// parser (for tests that replace one of them).
func (r *rig) registryKind(t *testing.T, workflow handlers.WorkflowFunc, parser handlers.ParserFunc) *handlers.Registry {
	t.Helper()
	reg, err := handlers.NewRegistry(handlers.Config{Store: r.st, Redis: r.ns.Client, Provider: r.prov, KeyPrefix: r.ns.Prefix,
		Collector: sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), ThrottleWaitMax: -1}})
	require.NoError(t, err)
	t.Cleanup(reg.Close)
	require.NoError(t, reg.Register(catalog.Kind, workflow, parser))
	return reg
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) { w.t.Log(string(p)); return len(p), nil }

// job records a catalog job for sku (exit country US) and returns its key and the asynq
// task that carries it.
func (r *rig) job(t *testing.T, sku string) (string, *asynq.Task) {
	t.Helper()
	return r.jobIn(t, sku, "US")
}

// jobIn is job with the exit country.
func (r *rig) jobIn(t *testing.T, sku, country string) (string, *asynq.Task) {
	t.Helper()
	return r.jobOf(t, catalog.Kind, sku, country, 1)
}

// jobOf records a job of kind for id (exit country, window 2026-04-23, parser version v)
// and returns its key and the asynq task that carries it.
func (r *rig) jobOf(t *testing.T, kind, id, country string, v int) (string, *asynq.Task) {
	t.Helper()
	return r.jobSpec(t, tasks.Spec{Kind: kind, SourceID: id, Country: country, Window: "2026-04-23", ParserVersion: v})
}

// jobSpec records the job of spec (normalized first) and returns its key and the asynq
// task that carries it.
func (r *rig) jobSpec(t *testing.T, spec tasks.Spec) (string, *asynq.Task) {
	t.Helper()
	spec, err := spec.Normalize()
	require.NoError(t, err)
	key, err := spec.Key()
	require.NoError(t, err)
	_, err = r.st.JobsRecord(context.Background(), []tasks.JobRecord{{Key: key, Spec: spec}})
	require.NoError(t, err)
	payload, err := json.Marshal(tasks.Payload{Key: key, Spec: spec})
	require.NoError(t, err)
	return key, asynq.NewTask(spec.Kind, payload)
}

// requireState requires key's job to be in state, and returns the job for further checks.
func requireState(t *testing.T, st *store.PG, key string, state tasks.JobState, msgAndArgs ...any) store.Job {
	t.Helper()
	job, err := st.JobGet(context.Background(), key)
	require.NoError(t, err)
	require.Equal(t, state, job.State, msgAndArgs...)
	return job
}

// requireJob is requireState that also requires the job's last category.
func requireJob(t *testing.T, st *store.PG, key string, state tasks.JobState, category tasks.Category, msgAndArgs ...any) store.Job {
	t.Helper()
	job := requireState(t, st, key, state, msgAndArgs...)
	require.Equal(t, string(category), job.LastCategory, msgAndArgs...)
	return job
}

type asynqDecision struct {
	Ack      bool          // nil error: done
	Skip     bool          // SkipRetry: archived, no retry
	Retry    bool          // retried after Delay
	Delay    time.Duration // what asynq's RetryDelayFunc will use
	Counted  bool          // counts against MaxRetry
	ErrorMsg string
}

func decisionOf(err error) asynqDecision {
	switch {
	case err == nil:
		return asynqDecision{Ack: true}
	case errors.Is(err, asynq.SkipRetry):
		return asynqDecision{Skip: true, Counted: true, ErrorMsg: err.Error()}
	}
	return asynqDecision{Retry: true, Delay: handlers.RetryDelay(1, err, nil), Counted: handlers.IsFailure(err), ErrorMsg: err.Error()}
}

func TestExactlyOneResultUnderDuplicateDelivery(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{site: testutil.FakeSiteConfig{StrictExit: true}})
	runners := make([]*handlers.Registry, 4)
	for i := range runners {
		runners[i] = r.registry(t, func(c *handlers.Config) { c.WorkerID = fmt.Sprintf("runner-%d", i) })
	}
	key, task := r.job(t, "sku-9")

	const deliveries = 20
	var wg sync.WaitGroup
	errs := make(chan error, deliveries)
	for d := 0; d < deliveries; d++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// A delivery that finds the lease busy is retried by asynq; do the same here.
			for {
				err := runners[d%len(runners)].ProcessTask(ctx, task)
				if dec := decisionOf(err); dec.Retry && !dec.Counted {
					time.Sleep(dec.Delay / 50)
					continue
				}
				errs <- err
				return
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err, "every delivery ends acknowledged")
	}
	requireState(t, r.st, key, tasks.StateComplete)
	require.Equal(t, 1, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM results`))
	require.Equal(t, 1, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM outbox`))
	require.GreaterOrEqual(t, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM attempts`), 1)
	require.Equal(t, 1, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM attempts WHERE outcome = 'complete'`))
	var rec catalog.Record
	var data []byte
	require.NoError(t, r.st.Pool().QueryRow(ctx, `SELECT data FROM results`).Scan(&data))
	require.NoError(t, json.Unmarshal(data, &rec))
	want, _ := r.site.Product("sku-9")
	require.Equal(t, catalog.Record{SKU: "sku-9", Name: want.Name, Price: want.Price, Currency: want.Currency}, rec)
}

func TestFailureCategories(t *testing.T) {
	ctx := context.Background()
	type want struct {
		state        tasks.JobState
		category     tasks.Category
		outcome      string
		decision     asynqDecision // Ack/Skip/Retry/Counted compared; Delay checked by bounds
		minD, maxD   time.Duration
		noAttemptRow bool
	}
	// check judges one delivery; start is a time before it began.
	check := func(t *testing.T, r *rig, key string, start time.Time, err error, w want) {
		t.Helper()
		dec := decisionOf(err)
		require.Equal(t, w.decision.Ack, dec.Ack, "ack: %v", err)
		require.Equal(t, w.decision.Skip, dec.Skip, "skip: %v", err)
		require.Equal(t, w.decision.Retry, dec.Retry, "retry: %v", err)
		if dec.Retry {
			require.Equal(t, w.decision.Counted, dec.Counted, "counted: %v", err)
			require.GreaterOrEqual(t, dec.Delay, w.minD)
			require.LessOrEqual(t, dec.Delay, w.maxD)
		}
		job, gerr := r.st.JobGet(ctx, key)
		require.NoError(t, gerr)
		require.Equal(t, w.state, job.State)
		if w.category != "" {
			require.Equal(t, string(w.category), job.LastCategory)
		}
		atts, aerr := r.st.AttemptList(ctx, key)
		require.NoError(t, aerr)
		if w.noAttemptRow {
			require.Empty(t, atts)
			return
		}
		require.NotEmpty(t, atts)
		last := atts[len(atts)-1]
		require.Equal(t, w.outcome, last.Outcome)
		if w.category != "" {
			require.Equal(t, string(w.category), last.Category)
		}
		if w.state == tasks.StateRetryable {
			// PostgreSQL mirrors asynq: next_attempt_at = the runner's now + the delay asynq
			// will wait, its now taken during the delivery: between start and this check,
			// however long the delivery took (PostgreSQL keeps microseconds).
			require.NotNil(t, job.NextAttemptAt)
			lo, hi := start.Add(dec.Delay).Truncate(time.Microsecond), time.Now().Add(dec.Delay)
			require.False(t, job.NextAttemptAt.Before(lo) || job.NextAttemptAt.After(hi),
				"next_attempt_at %v is not the delivery's now + %v: outside [%v, %v]", *job.NextAttemptAt, dec.Delay, lo, hi)
		}
	}
	// deliver runs one delivery of task on reg and judges it.
	deliver := func(t *testing.T, r *rig, reg *handlers.Registry, key string, task *asynq.Task, w want) {
		t.Helper()
		start := time.Now()
		check(t, r, key, start, reg.ProcessTask(ctx, task), w)
	}

	t.Run("ProxyAuth", func(t *testing.T) {
		r := newRig(t, rigOpts{proxy: testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: "acct", Password: "rotated"}})
		key, task := r.job(t, "sku-1")
		reg := r.registry(t, nil)
		// An incident, not the job's failure: retryable, uncounted, after the probe interval.
		deliver(t, r, reg, key, task, want{state: tasks.StateRetryable, category: tasks.CategoryProxyAuth, outcome: store.OutcomeRetryable,
			decision: asynqDecision{Retry: true}, minD: handlers.DefaultIncidentProbeInterval, maxD: 2*handlers.DefaultIncidentProbeInterval + time.Second})
		require.ErrorIs(t, reg.Ready(), handlers.ErrIncident)
		// While it is open the next delivery is handed back untouched.
		attempts := testutil.Count(t, r.st.Pool(), `SELECT count(*)::int FROM attempts`)
		dec := decisionOf(reg.ProcessTask(ctx, task))
		require.True(t, dec.Retry && !dec.Counted)
		require.Equal(t, attempts, testutil.Count(t, r.st.Pool(), `SELECT count(*)::int FROM attempts`))
	})
	t.Run("ExitUnavailable", func(t *testing.T) {
		r := newRig(t, rigOpts{proxy: testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: "acct", Password: canary, UnavailableCountries: []string{"US"}}})
		key, task := r.job(t, "sku-1")
		// attempt 1, base 30 s, full jitter at 0.5 ⇒ 15 s
		deliver(t, r, r.registry(t, nil), key, task, want{state: tasks.StateRetryable, category: tasks.CategoryExitUnavailable, outcome: store.OutcomeRetryable,
			decision: asynqDecision{Retry: true, Counted: true}, minD: 15 * time.Second, maxD: 15 * time.Second})
		require.Equal(t, 3, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM quarantine WHERE job_key = $1`, key),
			"the first session and its two replacements were quarantined")
	})
	t.Run("Throttled", func(t *testing.T) {
		r := newRig(t, rigOpts{})
		key, task := r.job(t, "sku-1")
		r.site.Throttle(1, 90*time.Second)
		deliver(t, r, r.registry(t, nil), key, task, want{state: tasks.StateRetryable, category: tasks.CategoryThrottled, outcome: store.OutcomeRetryable,
			decision: asynqDecision{Retry: true, Counted: true}, minD: 90 * time.Second, maxD: 90 * time.Second})
	})
	t.Run("Timeout", func(t *testing.T) {
		r := newRig(t, rigOpts{})
		key, task := r.job(t, "sku-1")
		// The site answers only after the fail-safe wait (or when the client goes away), so
		// the request timeout ends the request however late a loaded box fires it; were
		// there no timeout, the attempt would complete instead, not hang the suite.
		r.site.SetSlow(handlers.WaitTimeout)
		reg := r.registry(t, func(c *handlers.Config) {
			c.Collector.RequestTimeout = 100 * time.Millisecond
			c.MaxSessionRestarts = -1
		})
		deliver(t, r, reg, key, task, want{state: tasks.StateRetryable, category: tasks.CategoryTimeout, outcome: store.OutcomeRetryable,
			decision: asynqDecision{Retry: true, Counted: true}, minD: 5 * time.Second, maxD: 5 * time.Second})
	})
	t.Run("SessionLost", func(t *testing.T) {
		r := newRig(t, rigOpts{proxy: testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: "acct", Password: canary, DisconnectProb: 1}})
		key, task := r.job(t, "sku-1")
		deliver(t, r, r.registry(t, nil), key, task, want{state: tasks.StateRetryable, category: tasks.CategorySessionLost, outcome: store.OutcomeRetryable,
			decision: asynqDecision{Retry: true, Counted: true}, minD: 2500 * time.Millisecond, maxD: 2500 * time.Millisecond})
	})
	t.Run("ParseError", func(t *testing.T) {
		r := newRig(t, rigOpts{})
		key, task := r.job(t, "sku-1")
		reg := r.registryKind(t, catalog.Workflow(r.site.URL),
			func(tasks.Payload, map[string]json.RawMessage) (handlers.Observation, error) {
				return handlers.Observation{}, errors.New("price format 1.234,56 not understood")
			})
		deliver(t, r, reg, key, task, want{state: tasks.StateFailed, category: tasks.CategoryParseError, outcome: store.OutcomeFailed, decision: asynqDecision{Skip: true}})
	})
	t.Run("Validation", func(t *testing.T) {
		r := newRig(t, rigOpts{})
		key, task := r.job(t, "sku-1")
		r.site.SetSchemaChange(true)
		deliver(t, r, r.registry(t, nil), key, task, want{state: tasks.StateFailed, category: tasks.CategoryValidation, outcome: store.OutcomeFailed, decision: asynqDecision{Skip: true}})
		require.Equal(t, 1, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM quarantine WHERE reason LIKE 'validation%'`))
		require.Zero(t, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM results`))
	})
	t.Run("LeaseBusy", func(t *testing.T) {
		// Another worker holds the lease: one of this version (a STRING lease, claimed
		// through lua), or one of the version before (a HASH lease, during a rolling deploy).
		for _, holder := range []string{"ThisVersion", "PreviousVersionHash"} {
			t.Run(holder, func(t *testing.T) {
				r := newRig(t, rigOpts{})
				key, task := r.job(t, "sku-1")
				reg := r.registry(t, nil)
				const lease, jitter = 20 * time.Second, 500 * time.Millisecond
				start := time.Now()
				if holder == "ThisVersion" {
					leases, err := lua.NewLeases(r.ns.Client, r.ns.Prefix)
					require.NoError(t, err)
					_, err = leases.Claim(ctx, key, "other-worker", lease, 0)
					require.NoError(t, err)
				} else {
					_, err := r.ns.Client.HSet(ctx, r.ns.Prefix+"{"+key+"}:lease", "owner", "other-worker", "token", "1").Result()
					require.NoError(t, err)
					start = time.Now()
					require.NoError(t, r.ns.Client.PExpire(ctx, r.ns.Prefix+"{"+key+"}:lease", lease).Err())
				}
				err := reg.ProcessTask(ctx, task)
				// Retried when the holder's lease runs out (what was left of its 20 s when
				// the claim met it, to the millisecond) plus the jitter (Rand 0.5 of 1 s): no
				// later than 20.5 s, no earlier than that less the time since the lease was set.
				check(t, r, key, start, err, want{state: tasks.StatePending, outcome: "", decision: asynqDecision{Retry: true, Counted: false},
					minD: lease + jitter - time.Since(start) - time.Millisecond, maxD: lease + jitter, noAttemptRow: true})
			})
		}
	})
	t.Run("Superseded", func(t *testing.T) {
		r := newRig(t, rigOpts{})
		key, task := r.job(t, "sku-1")
		// While the attempt's workflow runs, its lease expires and another worker takes
		// the job over (we fake both: a higher-token start straight in PostgreSQL). The
		// workflow's first step waits for the takeover, so it happens mid-workflow however
		// slow the box is.
		running, takenOver := make(chan struct{}), make(chan struct{})
		hold := sync.OnceFunc(func() { close(running); <-takenOver })
		reg := r.registryKind(t, func(job tasks.Payload) (*sessions.Unit, error) {
			u, err := catalog.Workflow(r.site.URL)(job)
			if err != nil {
				return nil, err
			}
			orig := u.Steps[0].Run
			u.Steps[0].Run = func(ctx context.Context, sc *sessions.StepContext) error {
				hold()
				return orig(ctx, sc)
			}
			return u, nil
		}, catalog.Parse)
		takeOver := sync.OnceFunc(func() { close(takenOver) })
		t.Cleanup(takeOver) // a failed test does not leave the delivery (and Close) waiting
		done := make(chan error, 1)
		go func() { done <- reg.ProcessTask(ctx, task) }()
		recv(t, running, "the workflow's first step")
		require.Equal(t, 1, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM jobs WHERE state = 'running'`))
		require.Zero(t, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM attempts`), "the running attempt has no row until it ends")
		_, err := r.st.JobStart(ctx, store.AttemptStartParams{Key: key, Token: 1000, Worker: "other"})
		require.NoError(t, err)
		takeOver()
		err = recv(t, done, "the superseded delivery's end")
		require.NoError(t, err, "a superseded delivery is acknowledged: the newer attempt owns the job")
		require.Zero(t, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM results`))
		require.Zero(t, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM outbox`))
		require.Equal(t, 1, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM attempts WHERE outcome = 'superseded'`))
	})
	t.Run("BudgetExceeded", func(t *testing.T) {
		r := newRig(t, rigOpts{})
		key, task := r.job(t, "sku-1")
		reg := r.registry(t, nil, handlers.WithRetry(handlers.RetryConfig{MaxAttempts: 2}))
		r.site.Throttle(1, time.Second)
		require.Equal(t, asynqDecision{Retry: true, Counted: true}, keep(decisionOf(reg.ProcessTask(ctx, task))))
		r.site.Throttle(1, time.Second)
		deliver(t, r, reg, key, task, want{state: tasks.StateFailed, category: tasks.CategoryBudgetExceeded, outcome: store.OutcomeFailed, decision: asynqDecision{Skip: true}})
		atts, _ := r.st.AttemptList(ctx, key)
		require.Contains(t, atts[1].Error, "2 attempts")
		require.Contains(t, atts[1].Error, "throttled")
	})
	t.Run("UnsafeStepIncomplete", func(t *testing.T) {
		r := newRig(t, rigOpts{})
		key, task := r.job(t, "sku-1")
		reg := r.registryKind(t, func(job tasks.Payload) (*sessions.Unit, error) {
			u, err := catalog.Workflow(r.site.URL)(job)
			if err != nil {
				return nil, err
			}
			u.Steps[1].Safe = false // e.g. "add to cart"
			orig := u.Steps[2].Run
			u.Steps[2].Run = func(ctx context.Context, sc *sessions.StepContext) error {
				r.proxy.SetDisconnectProb(1)
				defer r.proxy.SetDisconnectProb(0)
				return orig(ctx, sc)
			}
			return u, nil
		}, catalog.Parse)
		deliver(t, r, reg, key, task, want{state: tasks.StateFailed, category: tasks.CategoryUnsafeStepIncomplete, outcome: store.OutcomeFailed, decision: asynqDecision{Skip: true}})
	})
	t.Run("CompleteJobAcknowledgedWithoutWork", func(t *testing.T) {
		r := newRig(t, rigOpts{})
		key, task := r.job(t, "sku-1")
		reg := r.registry(t, nil)
		require.NoError(t, reg.ProcessTask(ctx, task))
		hits := r.site.TotalHits()
		require.NoError(t, reg.ProcessTask(ctx, task))
		require.Equal(t, hits, r.site.TotalHits(), "no request for a complete job")
		atts, _ := r.st.AttemptList(ctx, key)
		require.Len(t, atts, 1)
	})
}

// keep strips what decisionOf fills for information only.
func keep(d asynqDecision) asynqDecision {
	return asynqDecision{Ack: d.Ack, Skip: d.Skip, Retry: d.Retry, Counted: d.Counted}
}

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
