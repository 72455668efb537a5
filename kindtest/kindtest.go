// Package kindtest runs a job kind's Workflow and Parse in a unit test as a worker runs them:
// on sticky sessions through a fake residential proxy, with the proxy's faults (exits that
// disconnect mid-unit, countries without exits), the unit replayed on a new session when its
// session is lost, and the staging of a lost session quarantined — without PostgreSQL or
// Redis. What it cannot show is what the database adds: the fenced commit, the outbox, the
// retries between deliveries (TestExample at the module root runs those).
//
//	env := kindtest.New(t, kindtest.Config{Proxy: testutil.FakeProxyConfig{DisconnectProb: 0.3}})
//	out := env.Run(t, myKind, idemscrape.Spec{Kind: "title", URL: site.URL + "/p/1", Country: "US", Window: "w1", ParserVersion: 1})
//	require.NoError(t, out.Err)
//	// out.Observation, out.Run.Restarts, out.Quarantined, env.Proxy.Bytes()
package kindtest

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/idemscrape/idemscrape"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/job"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/testutil"
)

// password is the fake proxy's account password: a test can check that it appears nowhere.
const password = "kindtest-proxy-password-7f3a"

// Password is the proxy password every Env uses, for tests that check it leaks nowhere
// (errors, staged values, observations, logs).
func Password() string { return password }

// Config configures an Env.
type Config struct {
	// Proxy configures the fake residential proxy and its faults (DisconnectProb,
	// CutExitAlive, UnavailableCountries, SessionLifetime…). Format, User and Password are
	// the kindtest's own and are overwritten.
	Proxy testutil.FakeProxyConfig
	// MaxSessionRestarts caps the replays on new sessions after lost sessions, as the
	// runner's handlers.Config.MaxSessionRestarts does. Defaults to the sessions default.
	MaxSessionRestarts int
	// RequestTimeout bounds each request. Defaults to 10 s.
	RequestTimeout time.Duration
}

// Env is a fake residential proxy and a provider for it, for one test.
type Env struct {
	// Proxy is the fake proxy: its counters (Bytes, Requests, RequestsFor) are the wire's.
	Proxy    *testutil.FakeProxy
	provider *sessions.Provider
	cfg      Config
}

// New starts the fake proxy; it is stopped when the test ends.
func New(t testing.TB, cfg Config) *Env {
	t.Helper()
	pc := cfg.Proxy
	pc.Format, pc.User, pc.Password = testutil.ProxyFormatGeneric, "kindtest", password
	proxy := testutil.NewFakeProxy(t, pc)
	p, err := sessions.NewProvider("kindtest", proxy.Addr, "{user}[-country-{country}]-session-{session}", "{pass}", "kindtest", password, 0)
	if err != nil {
		t.Fatalf("kindtest: provider: %v", err)
	}
	if cfg.RequestTimeout == 0 {
		cfg.RequestTimeout = 10 * time.Second
	}
	return &Env{Proxy: proxy, provider: p, cfg: cfg}
}

// Outcome is what one run of a kind gave.
type Outcome struct {
	// Observation is what Parse returned (zero when the workflow or Parse failed).
	Observation idemscrape.Observation
	// Err is the workflow's or Parse's error; nil on success.
	Err error
	// Category is Err's failure category, as the runner would record it ("" on success).
	Category job.Category
	// Run is the unit's run: sessions used, restarts and their reasons, bytes, exit.
	Run sessions.Result
	// Quarantined are the stagings of sessions lost mid-unit (and of a failed validation).
	Quarantined []sessions.Quarantined
}

// Run runs k for spec once, as one attempt of a worker runs it: the spec is normalised and
// keyed, Workflow builds the unit, the unit runs on a new session (replayed on another one
// when the session is lost), and Parse reads what it staged. A bad spec fails the test.
func (e *Env) Run(t testing.TB, k idemscrape.Kind, spec idemscrape.Spec) Outcome {
	t.Helper()
	if k.Workflow == nil || k.Parse == nil {
		t.Fatalf("kindtest: Kind.Workflow and Kind.Parse are required")
	}
	norm, err := spec.Normalize()
	if err != nil {
		t.Fatalf("kindtest: spec: %v", err)
	}
	key, err := norm.Key()
	if err != nil {
		t.Fatalf("kindtest: spec: %v", err)
	}
	payload := idemscrape.Job{Key: key, Spec: norm}
	var out Outcome
	unit, err := k.Workflow(payload)
	if err != nil {
		out.Err, out.Category = err, sessions.CategoryOf(err)
		return out
	}
	var mu sync.Mutex
	cfg := sessions.RunConfig{
		Provider:           e.provider,
		Country:            norm.Country,
		MaxSessionRestarts: e.cfg.MaxSessionRestarts,
		Collector:          sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), RequestTimeout: e.cfg.RequestTimeout},
		Quarantine: func(_ context.Context, q sessions.Quarantined) error {
			mu.Lock()
			defer mu.Unlock()
			out.Quarantined = append(out.Quarantined, q)
			return nil
		},
	}
	ctx := context.Background()
	if d, ok := t.(interface{ Context() context.Context }); ok {
		ctx = d.Context()
	}
	out.Run, err = unit.Run(ctx, cfg)
	if err != nil {
		out.Err, out.Category = err, sessions.CategoryOf(err)
		return out
	}
	out.Observation, err = parse(k, payload, out.Run.Staged)
	if err != nil {
		// As the runner records it: a job.Fail category kept, validation and schema drift
		// as validation, any other error a parse error.
		out.Err, out.Category = err, handlers.ParserFailure(err).Category
	}
	return out
}

// parse runs k.Parse, a panic in it an error of category panic as in the runner.
func parse(k idemscrape.Kind, payload idemscrape.Job, staged map[string]json.RawMessage) (obs idemscrape.Observation, err error) {
	defer func() {
		if rec := recover(); rec != nil {
			err = job.Fail(job.CategoryPanic, fmt.Errorf("kindtest: Parse panicked: %v", rec))
		}
	}()
	return k.Parse(payload, staged)
}
