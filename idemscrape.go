// Package idemscrape is the front door of the framework: one Config, one Client, and through
// it everything a service needs to register job kinds, enqueue jobs, run the worker and
// consume the events of committed results.
//
//	idemscrape.Migrate(ctx, pg)                          // the schema, once per deploy
//	c, err := idemscrape.New(idemscrape.Config{PG: pg, Redis: rdb})
//	c.Register("title", idemscrape.Kind{Workflow: wf, Parse: parse})
//	c.Enqueue(ctx, idemscrape.Spec{Kind: "title", URL: u, Country: "US", ParserVersion: 1})
//	go c.Run(ctx)                                        // worker + reconciler until ctx is done
//	cons, err := c.Consumer("title", "mailer")           // the kind's events, once each
//
// Every setting that several parts must agree on is given once in Config and handed to each
// part that needs it: the lease key prefix (runner), the URL normaliser and destination
// policy (enqueuer, runner, fetch guard), the stream prefix (dispatcher, consumers), the
// queue of each kind (enqueuer, asynq server), each kind's window budget (runner, job pages).
//
// One job's path: Enqueue records the jobs row in PostgreSQL and an asynq task whose TaskID is
// the job key (package tasks). A worker's Run takes the task and the runner (package
// handlers) claims the key's lease in Redis with a fencing token (package lua), records the
// attempt's start on the jobs row, runs the kind's Workflow on a sticky proxy session
// (package sessions), parses what the steps staged, and commits job, result, attempt row and
// outbox event in one fenced statement (package store); the dispatcher publishes the event to
// the kind's Redis Stream, where a Consumer hands it to your code once per event key.
//
// The packages below stay public for teams that need one part alone (their own asynq mux:
// Client.Handler or Client.Middleware; their own dispatcher or CLI). See the README for the
// whole walk-through and docs/ for each topic.
package idemscrape

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/scheduler"
	"github.com/idemscrape/idemscrape/service"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/inputs"
	"github.com/idemscrape/idemscrape/store/outbox"
	"github.com/idemscrape/idemscrape/tasks"
)

// The job vocabulary, named here so that a kind's code needs one import.
type (
	// Spec names one logical job: the fields its key is derived from (tasks.Spec).
	Spec = tasks.Spec
	// Job is what a kind's Workflow and Parse receive: the spec, its key and trace context.
	Job = tasks.Payload
	// EnqueueResult is what Enqueue did with one spec (enqueued, already queued, complete…).
	EnqueueResult = tasks.Result
	// Unit is a workflow: ordered steps on one sticky session, replayed whole on a new
	// session when the session is lost (sessions.Unit).
	Unit = sessions.Unit
	// Step is one step of a Unit.
	Step = sessions.Step
	// StepContext is what a step fetches with (Get, Fetch, Render) and stages into.
	StepContext = sessions.StepContext
	// Observation is what Parse makes of the staged values: the result to commit.
	Observation = handlers.Observation
	// Event is one outbox event as a Consumer hands it over; EventKey is stable per event.
	Event = outbox.Event
	// RetryConfig is a kind's retry policy and budgets (handlers.RetryConfig).
	RetryConfig = handlers.RetryConfig
	// WindowBudget is a kind's money budget per collection window (handlers.WindowBudget).
	WindowBudget = handlers.WindowBudget
)

// Kind is one job kind: how to collect (Workflow), how to read what was collected (Parse),
// and its policies. Only Workflow and Parse are required.
type Kind struct {
	// Workflow builds the unit that collects one job. Required.
	Workflow func(job Job) (*Unit, error)
	// Parse turns the unit's staged values into the observation to commit. It must be
	// deterministic for a given parser version. Required.
	Parse func(job Job, staged map[string]json.RawMessage) (Observation, error)
	// Topic is the outbox topic (Redis Stream) of the kind's events. Defaults to the kind's
	// name.
	Topic string
	// Retry is the kind's retry policy and budgets. Defaults to handlers.DefaultPolicies and
	// the default attempt, time and bandwidth budgets.
	Retry *RetryConfig
	// ParserVersion, when set, is the one parser version Parse implements: a job naming
	// another version is refused, retryably, until a worker that runs it takes the job.
	// Defaults to 0: Parse serves every version.
	ParserVersion int
	// SavedInputs is the kind's saved-input policy (what is kept for reparse). Defaults to
	// the runner's default policy.
	SavedInputs *inputs.Policy
	// WindowBudget is the kind's money budget per collection window, shared by the fleet;
	// the job pages show each window's spend against it. Defaults to none.
	WindowBudget *WindowBudget
	// Options are further runner options (handlers.With…), applied after the fields above.
	Options []handlers.KindOption
}

// Config configures a Client. PG and Redis are required; every other field has a default.
type Config struct {
	// PG is the system of record. Required. Run Migrate on it first.
	PG *pgxpool.Pool
	// Redis holds the queues, leases and streams: a *redis.Client, or a
	// *redis.ClusterClient on Redis Cluster (docs/CLUSTER.md). Required.
	Redis redis.UniversalClient
	// Providers are the residential proxy providers sessions are opened with. Defaults to
	// sessions.ProvidersFromEnv(): IDEMSCRAPE_PROXY_PROVIDER, _USER, _PASSWORD[_FILE],
	// _ZONE, _GATEWAY (README, "Proxy providers").
	Providers []*sessions.Provider
	// KeyPrefix prefixes the runner's keys in Redis (leases, host limits, window budgets).
	// Defaults to handlers.DefaultKeyPrefix.
	KeyPrefix string
	// StreamPrefix prefixes the outbox streams, for the dispatcher and for Consumer.
	// Defaults to outbox.DefaultPrefix.
	StreamPrefix string
	// Normalizer derives job keys from URLs; every process that enqueues or runs the same
	// kinds must use the same one. Defaults to tasks.DefaultNormalizer.
	Normalizer *tasks.Normalizer
	// Destinations is the policy every job URL passes at Enqueue and every request,
	// redirect and robots.txt fetch passes at the worker. Defaults to the strict policy:
	// public addresses on ports 80, 443, 8080 and 8443.
	Destinations *tasks.DestinationPolicy
	// AllowLoopback lets jobs fetch loopback addresses and localhost (tests, the demo, a
	// shop on the same machine); ignored when Destinations is set. Defaults to false.
	AllowLoopback bool
	// Concurrency is how many jobs this process runs at once. Defaults to
	// service.DefaultConcurrency.
	Concurrency int
	// HTTPAddr is the listen address of /metrics, /healthz, /readyz, asynqmon at
	// /monitoring and the job pages at /jobs. Defaults to service.DefaultHTTPAddr
	// (loopback); another address needs basic auth (IDEMSCRAPE_HTTP_USER and
	// IDEMSCRAPE_HTTP_PASSWORD, read by New).
	HTTPAddr string
	// HTTPInsecure lets HTTPAddr be an address other than loopback without basic auth,
	// when something in front authenticates. Defaults to false: such an address without
	// IDEMSCRAPE_HTTP_USER and IDEMSCRAPE_HTTP_PASSWORD is refused by New.
	HTTPInsecure bool
	// NoReconciler leaves the reconciler out of Run (run cmd/scheduler, or another
	// process's Run, instead). Defaults to false: Run also runs the reconciler, which puts
	// back jobs whose lease expired while their row says running and tasks lost or archived
	// in Redis (a Redis restart that lost its data), and prunes by retention. Any number of
	// processes may run it.
	NoReconciler bool
	// Reconcile sets the reconciler's intervals, thresholds and retentions, as the
	// `reconciler:` section of cmd/scheduler's file does. Defaults to that section's
	// defaults (docs/SCHEDULER.md).
	Reconcile *scheduler.ReconcilerFile
	// NoSessionPool turns the warm-session pool off: every unit opens a new session.
	// Defaults to false: sessions of a site are kept warm and reused (docs/PERFORMANCE.md).
	NoSessionPool bool
	// WorkerID names this process in attempt rows and logs. Defaults to host and pid.
	WorkerID string
	// Logger receives every part's logs. Defaults to slog.Default().
	Logger *slog.Logger

	// Runner, when set, adjusts the runner's configuration after New filled in the shared
	// settings (collector timeouts, host limits, lease lengths, tracing...). The shared
	// settings are put back after it (Store, Redis, KeyPrefix, Normalizer, the fetch
	// guard): they are set above, once. Defaults to nil.
	Runner func(*handlers.Config)
	// Service, when set, adjusts the worker service's configuration in Run after the shared
	// settings were filled in (readiness checks, shutdown bounds, AllowedHosts...). The
	// shared settings are put back after it (Registry, Store, Redis, the dispatcher's
	// stream prefix, window budgets). Defaults to nil.
	Service func(*service.Config)
}

// Client is the front door: it registers kinds, enqueues jobs, runs the worker and opens
// consumers, all with one Config. Close it after Run returned.
type Client struct {
	cfg   Config
	st    *store.PG
	reg   *handlers.Registry
	auth  *service.BasicAuth
	dests *tasks.DestinationPolicy

	mu      sync.Mutex
	budgets map[string]store.Cost
	enq     *tasks.Enqueuer
	running bool
	runDone chan struct{} // closed when Run returns
	closed  bool
}

// Migrate brings the PostgreSQL schema up to date (embedded migrations, under an advisory
// lock, so several processes may run it at once).
func Migrate(ctx context.Context, pg *pgxpool.Pool) error {
	if pg == nil {
		return errors.New("idemscrape: Migrate: the pool is nil")
	}
	_, err := store.Migrate(ctx, pg, nil)
	return err
}

// New checks cfg and builds a Client. It does no I/O but reading the proxy and basic-auth
// environment variables when cfg leaves them out.
func New(cfg Config) (*Client, error) {
	if cfg.PG == nil {
		return nil, errors.New("idemscrape: Config.PG is required")
	}
	if cfg.Redis == nil {
		return nil, errors.New("idemscrape: Config.Redis is required")
	}
	if cfg.Concurrency < 0 {
		return nil, fmt.Errorf("idemscrape: Config.Concurrency %d is negative", cfg.Concurrency)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.StreamPrefix == "" {
		cfg.StreamPrefix = outbox.DefaultPrefix
	}
	if len(cfg.Providers) == 0 {
		ps, err := sessions.ProvidersFromEnv()
		if err != nil {
			return nil, fmt.Errorf("idemscrape: Config.Providers is empty, and the provider from the environment: %w", err)
		}
		cfg.Providers = ps
	}
	dests := cfg.Destinations
	if dests == nil {
		dests = tasks.StrictDestinationPolicy()
		if cfg.AllowLoopback {
			dests = tasks.LoopbackPolicy()
		}
	}
	if err := dests.Validate(); err != nil {
		return nil, fmt.Errorf("idemscrape: Config.Destinations: %w", err)
	}
	auth, err := service.BasicAuthFromEnv()
	if err != nil {
		return nil, fmt.Errorf("idemscrape: %w", err)
	}
	httpAddr := cfg.HTTPAddr
	if httpAddr == "" {
		httpAddr = service.DefaultHTTPAddr
	}
	if auth == nil && !cfg.HTTPInsecure && service.CheckExposure(httpAddr, nil, false) != nil {
		return nil, fmt.Errorf("idemscrape: Config.HTTPAddr %s is not loopback and no basic auth is set: anyone who reaches it reads the job pages and asynqmon. Set IDEMSCRAPE_HTTP_USER and IDEMSCRAPE_HTTP_PASSWORD[_FILE], listen on 127.0.0.1, or set Config.HTTPInsecure if something in front authenticates", httpAddr)
	}
	if cfg.AllowLoopback && cfg.Destinations == nil {
		cfg.Logger.Warn("loopback destinations allowed (Config.AllowLoopback): for demos and tests only")
	}

	st := store.New(cfg.PG)
	hc := handlers.Config{
		Store:      st,
		Redis:      cfg.Redis,
		Providers:  cfg.Providers,
		KeyPrefix:  cfg.KeyPrefix,
		Normalizer: cfg.Normalizer,
		Collector:  sessions.CollectorConfig{Guard: sessions.NewGuard(dests)},
		WorkerID:   cfg.WorkerID,
		Logger:     cfg.Logger,
	}
	if !cfg.NoSessionPool {
		hc.SessionPool = &sessions.PoolConfig{}
	}
	if cfg.Runner != nil {
		guard := hc.Collector.Guard
		cfg.Runner(&hc)
		// The shared settings stay as given once: the enqueuer and the reconciler use them too.
		hc.Store, hc.Redis, hc.KeyPrefix, hc.Normalizer, hc.Collector.Guard = st, cfg.Redis, cfg.KeyPrefix, cfg.Normalizer, guard
	}
	reg, err := handlers.NewRegistry(hc)
	if err != nil {
		return nil, fmt.Errorf("idemscrape: %w", err)
	}
	return &Client{cfg: cfg, st: st, reg: reg, auth: auth, dests: dests, budgets: map[string]store.Cost{}}, nil
}

// Register adds a job kind. The kind's name is its queue and, unless Kind.Topic says
// otherwise, its events' topic. Register every kind before Run.
func (c *Client) Register(name string, k Kind) error {
	if k.Workflow == nil || k.Parse == nil {
		return fmt.Errorf("idemscrape: Register(%q): Kind.Workflow and Kind.Parse are required", name)
	}
	var opts []handlers.KindOption
	if k.Topic != "" {
		opts = append(opts, handlers.WithTopic(k.Topic))
	}
	if k.Retry != nil {
		opts = append(opts, handlers.WithRetry(*k.Retry))
	}
	if k.ParserVersion != 0 {
		opts = append(opts, handlers.WithParserVersion(k.ParserVersion))
	}
	if k.SavedInputs != nil {
		opts = append(opts, handlers.WithSavedInputs(*k.SavedInputs))
	}
	var budget *store.Cost
	if k.WindowBudget != nil {
		cur, err := c.currency()
		if err != nil {
			return fmt.Errorf("idemscrape: Register(%q): Kind.WindowBudget: %w", name, err)
		}
		budget = &store.Cost{Micros: k.WindowBudget.Money, Currency: cur}
		opts = append(opts, handlers.WithWindowBudget(*k.WindowBudget))
	}
	opts = append(opts, k.Options...)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.running {
		return fmt.Errorf("idemscrape: Register(%q) after Run", name)
	}
	if err := c.reg.Register(name, k.Workflow, k.Parse, opts...); err != nil {
		return fmt.Errorf("idemscrape: %w", err)
	}
	if budget != nil {
		c.budgets[name] = *budget
	}
	return nil
}

// currency is the one currency the providers are priced in, for window budgets.
func (c *Client) currency() (string, error) {
	var cur string
	for _, p := range c.cfg.Providers {
		pc := p.Price().Currency
		switch {
		case pc == "":
			return "", fmt.Errorf("provider %s has no price (IDEMSCRAPE_PROXY_PRICE)", p.Name())
		case cur != "" && pc != cur:
			return "", fmt.Errorf("providers are priced in %s and %s: a window budget needs one currency", cur, pc)
		}
		cur = pc
	}
	return cur, nil
}

// Enqueue records one job and hands it to its kind's queue, unless it is already queued,
// complete or failed (EnqueueResult says which). An invalid spec returns an error naming the
// field (errors.Is tasks.ErrInvalidSpec) and stores nothing. A task asynq archived is
// repaired: deleted and enqueued again.
func (c *Client) Enqueue(ctx context.Context, spec Spec) (EnqueueResult, error) {
	e, err := c.enqueuer()
	if err != nil {
		return EnqueueResult{}, err
	}
	return e.Enqueue(ctx, spec)
}

// EnqueueMany is Enqueue for a batch: one PostgreSQL statement for the rows, then the tasks
// (see tasks.Enqueuer.EnqueueMany for its partial-failure report, *tasks.BatchError).
func (c *Client) EnqueueMany(ctx context.Context, specs []Spec) ([]EnqueueResult, error) {
	e, err := c.enqueuer()
	if err != nil {
		return nil, err
	}
	return e.EnqueueMany(ctx, specs)
}

func (c *Client) enqueuer() (*tasks.Enqueuer, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, errors.New("idemscrape: Enqueue after Close")
	}
	if c.enq != nil {
		return c.enq, nil
	}
	e, err := tasks.NewEnqueuer(asynq.NewClientFromRedisClient(c.cfg.Redis), c.st, &tasks.EnqueuerConfig{
		Normalizer:   c.cfg.Normalizer,
		Inspector:    asynq.NewInspectorFromRedisClient(c.cfg.Redis), // archived tasks are repaired, always
		Redis:        c.cfg.Redis,
		Destinations: c.dests,
		Concurrency:  16,
	})
	if err != nil {
		return nil, fmt.Errorf("idemscrape: %w", err)
	}
	c.enq = e
	return e, nil
}

// Run runs the worker until ctx is done: the asynq server (every registered kind's queue,
// weight 1), the outbox dispatcher, the reconciler (unless Config.NoReconciler) and the HTTP
// server (Config.HTTPAddr). Then it shuts down gracefully (in-flight jobs finish or are
// handed back with their attempt recorded) and returns nil. Run may be called once; Close
// waits for it.
func (c *Client) Run(ctx context.Context) error {
	c.mu.Lock()
	switch {
	case c.closed:
		c.mu.Unlock()
		return errors.New("idemscrape: Run after Close")
	case c.running:
		c.mu.Unlock()
		return errors.New("idemscrape: Run called twice")
	}
	c.running = true
	done := make(chan struct{})
	c.runDone = done
	defer close(done)
	budgets := maps.Clone(c.budgets)
	c.mu.Unlock()

	var rec *scheduler.Reconciler
	if !c.cfg.NoReconciler {
		var err error
		if rec, err = c.reconciler(); err != nil {
			return err
		}
	}
	dispatcher := &outbox.DispatcherConfig{}
	sc := service.Config{Concurrency: c.cfg.Concurrency, HTTPAddr: c.cfg.HTTPAddr, HTTPInsecure: c.cfg.HTTPInsecure,
		BasicAuth: c.auth, Logger: c.cfg.Logger}
	if c.cfg.Service != nil {
		c.cfg.Service(&sc)
		if sc.Dispatcher != nil {
			dispatcher = sc.Dispatcher
		}
	}
	// The shared settings, as given once.
	dispatcher.Prefix = c.cfg.StreamPrefix
	sc.Registry, sc.Store, sc.Redis, sc.Dispatcher, sc.WindowBudgets = c.reg, c.st, c.cfg.Redis, dispatcher, budgets
	if rec != nil {
		gathered := prometheus.Gatherers{rec.Gatherer()}
		if sc.Gatherer != nil {
			gathered = append(gathered, sc.Gatherer)
		}
		sc.Gatherer = gathered
	}
	svc, err := service.New(sc)
	if err != nil {
		return fmt.Errorf("idemscrape: %w", err)
	}
	if rec != nil {
		if err := rec.Start(context.WithoutCancel(ctx)); err != nil {
			return fmt.Errorf("idemscrape: start the reconciler: %w", err)
		}
		defer rec.Stop()
	}
	return svc.Run(ctx)
}

// reconciler builds Run's reconciler from the shared settings.
func (c *Client) reconciler() (*scheduler.Reconciler, error) {
	f := &scheduler.File{}
	if c.cfg.Reconcile != nil {
		f.Reconciler = *c.cfg.Reconcile
	}
	if f.Reconciler.Disabled {
		return nil, nil
	}
	f.Kinds = map[string]scheduler.KindConfig{}
	for _, k := range c.reg.Kinds() {
		f.Kinds[k] = scheduler.KindConfig{Queue: tasks.QueueFor(k)} // whose dead workers' tasks it gives back
	}
	if err := f.Validate(c.cfg.Normalizer); err != nil {
		return nil, fmt.Errorf("idemscrape: Config.Reconcile: %w", err)
	}
	maint, err := outbox.NewMaintainer(c.cfg.PG)
	if err != nil {
		return nil, fmt.Errorf("idemscrape: %w", err)
	}
	rec, err := scheduler.NewReconciler(scheduler.ReconcilerConfig{
		File: f, Store: c.st, Outbox: maint, Redis: c.cfg.Redis,
		Client: asynq.NewClientFromRedisClient(c.cfg.Redis), Inspector: asynq.NewInspectorFromRedisClient(c.cfg.Redis),
		KeyPrefix: c.cfg.KeyPrefix, ID: c.cfg.WorkerID, Normalizer: c.cfg.Normalizer, Destinations: c.dests,
		Logger: c.cfg.Logger,
	})
	if err != nil {
		return nil, fmt.Errorf("idemscrape: %w", err)
	}
	return rec, nil
}

// Consumer returns a consumer of topic's events in consumer group group (created when
// missing, from the stream's start). Run it with a handler: it acknowledges an event after
// the handler returned nil, reclaims what dead consumers left pending, and skips an event
// whose EventKey it has seen (Consumer.Run; RunTx commits your side effect and the "seen"
// mark in one PostgreSQL transaction).
func (c *Client) Consumer(topic, group string) (*outbox.Consumer, error) {
	cons, err := outbox.NewConsumer(c.cfg.Redis, &outbox.ConsumerConfig{
		Prefix: c.cfg.StreamPrefix, Topic: topic, Group: group, Logger: c.cfg.Logger,
	})
	if err != nil {
		return nil, fmt.Errorf("idemscrape: %w", err)
	}
	return cons, nil
}

// Handler is the runner as an asynq handler, for a team's own asynq server: serve each
// kind's queue (its name) and build the server's config with ServerConfig.
func (c *Client) Handler() asynq.Handler { return c.reg.Handler() }

// Middleware wraps next so that tasks of registered kinds go through the runner and others
// reach next, for a team's own asynq mux.
func (c *Client) Middleware(next asynq.Handler) asynq.Handler { return c.reg.Middleware(next) }

// ServerConfig returns base with what the runner needs of asynq's server (its retry delay
// and error handling), for Handler and Middleware on a team's own asynq server.
func (c *Client) ServerConfig(base asynq.Config) asynq.Config { return c.reg.ServerConfig(base) }

// Kinds lists the registered kinds.
func (c *Client) Kinds() []string { return slices.Clone(c.reg.Kinds()) }

// Close releases the client: the runner's pooled sessions and its background lease
// releases (it waits for them). A Run still going is waited for: cancel its context first.
// Config.PG and Config.Redis stay open (they are the caller's). Closing twice is a no-op.
func (c *Client) Close() {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return
	}
	c.closed = true
	done := c.runDone
	c.mu.Unlock()
	if done != nil {
		<-done
	}
	c.reg.Close() // the enqueuer's asynq client and inspector share Config.Redis: nothing to close
}
