package handlers

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"regexp"
	"slices"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemscrape/idemscrape/internal/retry"
	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/parse"
	"github.com/idemscrape/idemscrape/politeness"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/sessions/profile"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/inputs"
	"github.com/idemscrape/idemscrape/tasks"
)

// WorkflowFunc builds the workflow unit that fetches one job: its steps and validation.
// It is called once per attempt.
type WorkflowFunc func(job tasks.Payload) (*sessions.Unit, error)

// Observation is what a parser makes of a unit's staged data.
type Observation struct {
	// Data is the normalised record; it is stored JSON-encoded in results.data.
	Data any
	// ObservationKey identifies the observation behind the results table's unique index.
	// Defaults to the job key (one expected observation per job).
	ObservationKey string
	// Event is the outbox event's payload. Defaults to {job_key, observation_key, kind,
	// parser_version, data}.
	Event any
	// Schema is the parse's schema fingerprint (parse.Extractor.Fingerprint), optional.
	// When set, the runner compares it with the fingerprints recorded for the kind and
	// parser version (parse.Drift) before committing: a surprising change is a
	// *parse.DriftError, category validation, and the staging is quarantined. A parser
	// that fails validation should still return its Schema with the error, so that the
	// attempt's error names the drift. A committed parse's fingerprint that widens the
	// history is kept (the last 32 per version; see WithRecordedFingerprints) and written
	// to schema_fingerprints, from which every worker of the fleet loads the history.
	Schema *parse.Fingerprint
}

// ParserFunc turns a unit's staged data into the observation. It must be deterministic:
// the same staged data and parser version give the same record (reparse relies on it).
// An error is a parse error (terminal) unless it is a *parse.ValidationError or
// *parse.DriftError (category validation: the staging is quarantined, nothing is
// committed), or carries another category (tasks.Fail, *sessions.FetchError).
type ParserFunc func(job tasks.Payload, staged map[string]json.RawMessage) (Observation, error)

// KindOption configures one registered kind.
type KindOption func(*kind)

// WithTopic sets the outbox topic of the kind's events. Defaults to the kind's name.
func WithTopic(topic string) KindOption { return func(k *kind) { k.topic = topic } }

// WithRetry sets the kind's retry policy and budgets (defaults: Config.Retry).
func WithRetry(cfg RetryConfig) KindOption { return func(k *kind) { k.retry = cfg } }

// WithSessionLifetime sets the sticky-session lifetime the kind asks for.
func WithSessionLifetime(d time.Duration) KindOption {
	return func(k *kind) { k.sessionLifetime = d }
}

// WithoutSessionPool keeps the kind's units off the worker's session pool
// (Config.SessionPool): each attempt starts on a new session, with an empty cookie jar —
// for units that must start clean, e.g. each logs in as another account.
func WithoutSessionPool() KindOption { return func(k *kind) { k.noPool = true } }

// WithPoolScope lets kinds share pooled sessions (Config.SessionPool): kinds registered with
// the same scope name take each other's warm sessions of a site. By default each kind is its
// own scope: two kinds of one site never share a session (its logins, its cookies).
func WithPoolScope(name string) KindOption { return func(k *kind) { k.scope = name } }

// WithPoolCookies names the cookies of the kind's sessions that go on to the next unit on
// a warm session (Config.SessionPool); the others are dropped between units. Without it
// every cookie goes on; with no names, none does (the exit and client identity still do).
func WithPoolCookies(names ...string) KindOption {
	return func(k *kind) { k.poolCookies = append([]string{}, names...) }
}

// WithHeaderProfiles gives each session of the kind a realistic client identity picked
// from o when the session opens (sessions/profile): one User-Agent, Accept,
// Accept-Language and set of client hints on every request of the session, colly's and
// rendered pages' alike, for every unit it serves (Config.SessionPool). Without it the
// kind's requests carry the collector's UserAgent (sessions.DefaultUserAgent: an honest
// bot name). A kind that renders should pick Chromium-family browsers only.
func WithHeaderProfiles(o profile.Options) KindOption {
	return func(k *kind) { k.profiles = &o }
}

type kind struct {
	name            string
	workflow        WorkflowFunc
	parser          ParserFunc
	topic           string
	retry           RetryConfig
	sessionLifetime time.Duration
	// version is WithParserVersion's (0: parser serves every version); parsers holds the
	// registered versions (nil when version is 0). Never mutated once registered: AddParser
	// replaces the kind.
	version     int
	parsers     map[int]ParserFunc
	saved       inputs.Policy       // WithSavedInputs
	schemas     *schemaSet          // recorded schema fingerprints, shared by the kind's copies
	hostLimit   *politeness.Limit   // WithHostLimit
	limiter     *politeness.Limiter // paces the kind's requests
	window      *WindowBudget       // WithWindowBudget
	noPool      bool                // WithoutSessionPool
	poolCookies []string            // WithPoolCookies (nil: all)
	profiles    *profile.Options    // WithHeaderProfiles
	scope       string              // WithPoolScope ("": the kind's name)
}

// Config defaults.
const (
	DefaultKeyPrefix = "idemscrape:"
)

// Config configures a Registry (the runner of every registered kind).
type Config struct {
	// Store is the system of record. Required.
	Store *store.PG
	// Committer runs the fenced commits. Defaults to a store.GroupCommitter owned by the
	// registry (closed by Close), which batches concurrent handlers' commits — and their
	// attempt starts — into one statement per kind: whatever queued while the previous
	// statement ran (it never waits for company). Set NoGroupCommit for one statement per
	// job.
	Committer Committer
	// NoGroupCommit makes the default Committer Store itself. Defaults to false.
	NoGroupCommit bool
	// Redis holds the leases. Required.
	Redis redis.UniversalClient
	// Provider issues sticky proxy sessions. Required unless Providers is set.
	Provider *sessions.Provider
	// Providers are several accounts, in the order they are used: every delivery runs on
	// the first whose incident breaker is closed (see incident.go), so a provider that
	// refuses the account (407) hands its work to the next until a probe finds it
	// working again. Names must differ. When set, Provider must be nil or Providers[0].
	Providers []*sessions.Provider
	// KeyPrefix of the lease keys. Defaults to DefaultKeyPrefix.
	KeyPrefix string
	// Collector configures each session's collector (size cap, timeouts, robots, guard).
	// Unless IgnoreRobotsTxt is set or Robots is given, the registry sets Robots to a
	// politeness.RobotsCache in Redis under KeyPrefix shared by the fleet; unless Limiter is
	// given, each kind's requests go through its politeness.Limiter (see HostLimits).
	Collector sessions.CollectorConfig
	// Browsers renders the pages of steps that call StepContext.Render (pages that need
	// JavaScript), on the unit's session. The registry owns it: Close closes it, so no
	// Chromium process outlives the registry. Defaults to nil: a step that renders fails
	// (internal, sessions.ErrNoBrowsers).
	Browsers *sessions.BrowserPool
	// HostLimits are fleet-wide request rates per destination host — the URL's host,
	// lower case, with its port unless it is the scheme's default ("shop.example",
	// "127.0.0.1:8080": politeness.HostKey). They win over a kind's WithHostLimit and
	// DefaultHostLimit. Defaults to none. (politeness.LimitsConfig.HostLimits)
	HostLimits map[string]politeness.Limit
	// DefaultHostLimit is the rate of every other host, for kinds without WithHostLimit.
	// Defaults to nil: such hosts are not paced and cost no Redis round trip.
	DefaultHostLimit *politeness.Limit
	// HostWaitMax is the longest a request waits for its host's slot; a slot further away
	// ends the attempt as throttled with that distance as its Retry-After, so the job frees
	// its lease instead of holding it idle. Defaults to politeness.DefaultHostWaitMax.
	HostWaitMax time.Duration
	// MaxSessionRestarts per attempt. Defaults to sessions.DefaultMaxSessionRestarts.
	MaxSessionRestarts int
	// MaxResumes per attempt: steps run again on their own session after a cut or a
	// Retry-After instead of a replay (sessions.RunConfig.MaxResumes). Defaults to
	// sessions.DefaultMaxResumes; -1: every cut replays.
	MaxResumes int
	// SessionPool keeps healthy sticky sessions warm between units of the same destination
	// host (sessions.Pool): a unit whose session ended well hands it — its exit, its cookie
	// jar — to the next unit for the same provider, tier, country and host, so a site's
	// checks (a bot challenge, a consent page) are passed once per session instead of once
	// per unit. A unit's workflow names its host in sessions.Unit.Site (or the job's URL
	// does); a kind opts out with WithoutSessionPool. nil: off, a new session per attempt.
	SessionPool *sessions.PoolConfig
	// LeaseLengths chooses lease lengths per kind from their measured durations. Defaults
	// to NewLeaseLengths(nil).
	LeaseLengths *LeaseLengthConfig
	// LeaseLength, when set, is the one lease length of every kind: shorthand for
	// LeaseLengths{Default, Min and Max all LeaseLength}. Set one of the two. Defaults to 0
	// (measured lengths).
	LeaseLength time.Duration
	// KeepOptions tunes lease renewal. Defaults to lua's defaults.
	KeepOptions *lua.KeepOptions
	// Retry is the retry policy of kinds registered without WithRetry.
	Retry RetryConfig
	// Normalizer checks task payloads' keys. Defaults to tasks.DefaultNormalizer; it must
	// be the enqueuers' normalizer.
	Normalizer *tasks.Normalizer
	// WorkerID names this worker in attempts rows. Defaults to hostname/pid.
	WorkerID string
	// Registerer receives the metrics. Defaults to a new private registry (see Gatherer).
	Registerer prometheus.Registerer
	// TracerProvider receives a span per delivery ("idemscrape.attempt") with children for
	// the lease, the start, each session, step, fetch and render, the parse, the commit and
	// the release (trace.go). Defaults to OpenTelemetry's global provider, a no-op unless
	// the program installed one (cmd/worker does from the OTEL_* environment).
	TracerProvider trace.TracerProvider
	// Logger. Defaults to slog.Default().
	Logger *slog.Logger
	// Now is the clock for delays and budgets. Defaults to time.Now.
	Now func() time.Time
	// Rand returns uniform [0,1) for backoff jitter. Defaults to math/rand/v2.
	Rand func() float64
	// IncidentProbeInterval is how long the worker takes no work after a proxy incident
	// (407) before one delivery probes the proxy again; it doubles while the incident lasts.
	// Defaults to DefaultIncidentProbeInterval.
	IncidentProbeInterval time.Duration
	// IncidentProbeMax caps the probe interval. Defaults to DefaultIncidentProbeMax.
	IncidentProbeMax time.Duration
	// Routing tunes how a worker with several Providers routes jobs between them, learned
	// by the fleet in Redis: a provider without exits in a country is skipped there, a
	// destination that blocks an exit tier goes to the next tier (see routing.go).
	Routing RoutingConfig
	// UndecodableMaxAge bounds how long a task whose payload this worker can not read is
	// retried (late, uncounted, for a newer worker): once its job is older than this
	// (from the jobs row's created_at, or its last requeue), the job fails as internal
	// and the task is archived. Defaults to DefaultUndecodableMaxAge.
	UndecodableMaxAge time.Duration
}

// ErrIncident: the worker takes no work because of a proxy incident (see Registry.Ready).
var ErrIncident = errors.New("handlers: proxy incident, not taking work")

// Committer makes an attempt's observation take effect (store.PG, store.GroupCommitter).
type Committer interface {
	Commit(ctx context.Context, p store.CommitParams) (store.CommitResult, error)
}

var (
	_ Committer = (*store.PG)(nil)
	_ Committer = (*store.GroupCommitter)(nil)
)

// Registry is where a service registers its job kinds; it runs every task of those kinds
// through the runner (lease → attempt → workflow → parse → commit → release). It
// implements asynq.Handler; run the asynq server with ServerConfig so its retry delays and
// failure counting follow the runner's decisions.
type Registry struct {
	cfg     Config
	pool    *sessions.Pool // Config.SessionPool's, nil when off
	starter starter
	owned   *store.GroupCommitter // the default committer, closed by Close
	leases  *lua.Leases
	lengths *LeaseLengths
	// windows: the fleet's window money budgets (WithWindowBudget); windowLogged: the
	// spent windows this process logged.
	windows      *lua.WindowBudgets
	windowLogged onceSet
	router       *router         // routing between providers (nil with one provider)
	providers    []*providerSlot // Config.Providers with their breakers, in order
	gaugeMu      sync.Mutex      // openProviders
	metrics      *metrics
	// politeness: the fleet-wide host limits and the hosts this worker paused.
	hostLimits *politeness.Limits
	gatherer   prometheus.Gatherer
	tracer     trace.Tracer
	log        *slog.Logger
	inputs     *inputs.Store // saved inputs (WithSavedInputs)

	mu    sync.RWMutex
	kinds map[string]*kind

	// unsure: the start owners of deliveries whose attempt start's outcome stayed unknown.
	unsure unsureStarts

	// releasing: job key -> chan closed when the background release of its committed
	// lease ended (releaseDone); releases counts them for Close. Once closed (under
	// relMu), a release runs in the delivery itself: Close may already be waiting.
	// toRelease queues the releases for the one flusher goroutine (flushing: it runs).
	releasing sync.Map
	releases  sync.WaitGroup
	relMu     sync.Mutex
	closed    bool
	toRelease []pendingRelease
	flushing  bool

	// beforeWindowRestore, set by tests only, runs between a window restore's read of
	// PostgreSQL and its write to Redis (restoreWindow).
	beforeWindowRestore func()
}

var kindName = regexp.MustCompile(`^[a-z][a-z0-9_.-]{0,63}$`)

// NewRegistry validates cfg and returns an empty registry.
func NewRegistry(cfg Config) (*Registry, error) {
	if cfg.Store == nil || cfg.Redis == nil || (cfg.Provider == nil && len(cfg.Providers) == 0) {
		return nil, errors.New("handlers: Config needs Store, Redis and Provider (or Providers)")
	}
	if len(cfg.Providers) == 0 {
		cfg.Providers = []*sessions.Provider{cfg.Provider}
	}
	names := map[string]bool{}
	for i, p := range cfg.Providers {
		switch {
		case p == nil:
			return nil, fmt.Errorf("handlers: Config.Providers[%d] is nil", i)
		case names[p.Name()]:
			return nil, fmt.Errorf("handlers: Config.Providers: provider %s twice (names must differ: they label metrics and attempts)", p.Name())
		}
		names[p.Name()] = true
	}
	if cfg.Provider != nil && cfg.Provider != cfg.Providers[0] {
		return nil, errors.New("handlers: Config.Provider and Config.Providers both set: set Providers alone")
	}
	cfg.Provider = cfg.Providers[0]
	if cfg.KeyPrefix == "" {
		cfg.KeyPrefix = DefaultKeyPrefix
	}
	if cfg.Committer == nil && cfg.NoGroupCommit {
		cfg.Committer = cfg.Store
	}
	if cfg.Normalizer == nil {
		cfg.Normalizer = tasks.DefaultNormalizer
	}
	if cfg.WorkerID == "" {
		host, _ := os.Hostname()
		cfg.WorkerID = fmt.Sprintf("%s/%d", host, os.Getpid())
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Rand == nil {
		cfg.Rand = defaultRand
	}
	if cfg.IncidentProbeInterval == 0 {
		cfg.IncidentProbeInterval = DefaultIncidentProbeInterval
	}
	if cfg.IncidentProbeMax == 0 {
		cfg.IncidentProbeMax = max(DefaultIncidentProbeMax, cfg.IncidentProbeInterval)
	}
	if cfg.IncidentProbeInterval < 0 || cfg.IncidentProbeMax < cfg.IncidentProbeInterval {
		return nil, fmt.Errorf("handlers: Config: IncidentProbeInterval %v must be > 0 and <= IncidentProbeMax %v",
			cfg.IncidentProbeInterval, cfg.IncidentProbeMax)
	}
	if cfg.UndecodableMaxAge == 0 {
		cfg.UndecodableMaxAge = DefaultUndecodableMaxAge
	}
	if cfg.UndecodableMaxAge < 0 {
		return nil, fmt.Errorf("handlers: Config.UndecodableMaxAge %v must be positive", cfg.UndecodableMaxAge)
	}
	var err error
	if cfg.Retry, err = cfg.Retry.withDefaults(); err != nil {
		return nil, err
	}
	leases, err := lua.NewLeases(cfg.Redis, cfg.KeyPrefix)
	if err != nil {
		return nil, err
	}
	windows, err := lua.NewWindowBudgets(cfg.Redis, cfg.KeyPrefix)
	if err != nil {
		return nil, err
	}
	if cfg.LeaseLength != 0 {
		if cfg.LeaseLengths != nil {
			return nil, errors.New("handlers: Config: set LeaseLength or LeaseLengths, not both")
		}
		if cfg.LeaseLength < 0 {
			return nil, fmt.Errorf("handlers: Config.LeaseLength %v must be positive", cfg.LeaseLength)
		}
		cfg.LeaseLengths = &LeaseLengthConfig{Default: cfg.LeaseLength, Min: cfg.LeaseLength, Max: cfg.LeaseLength}
	}
	lengths, err := NewLeaseLengths(cfg.LeaseLengths)
	if err != nil {
		return nil, err
	}
	// Measured lease lengths shrink down to Min; a fixed renewal interval must keep the
	// shortest lease it may be used with (lua's one rule), or Keep would refuse attempts once
	// leases shrink — or, worse, jitter would let healthy leases expire.
	if cfg.KeepOptions != nil && cfg.KeepOptions.Interval != 0 {
		if err := lua.CheckKeepTiming(lengths.cfg.Min, cfg.KeepOptions.Interval, cfg.KeepOptions.Jitter); err != nil {
			return nil, fmt.Errorf("handlers: Config.KeepOptions against the shortest lease (LeaseLengths.Min %v): %w", lengths.cfg.Min, err)
		}
	}
	r := &Registry{cfg: cfg, leases: leases, windows: windows, lengths: lengths, log: cfg.Logger, kinds: map[string]*kind{},
		inputs: inputs.New(cfg.Store.Pool())}
	if err := r.newLimits(); err != nil {
		return nil, err
	}
	for _, p := range cfg.Providers {
		s := &providerSlot{prov: p}
		s.breaker.interval, s.breaker.max = cfg.IncidentProbeInterval, cfg.IncidentProbeMax
		r.providers = append(r.providers, s)
	}
	if len(r.providers) > 1 {
		keys, _ := lua.NewKeys(cfg.KeyPrefix) // checked by NewLeases
		r.router = newRouter(cfg.Routing, keys, cfg.Redis, r.providers)
	}
	tp := cfg.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	r.tracer = tp.Tracer(tasks.TracerName)
	if cfg.Registerer == nil {
		reg := prometheus.NewRegistry()
		cfg.Registerer, r.gatherer = reg, reg
		r.cfg.Registerer = reg
	}
	if cfg.SessionPool != nil {
		pc := *cfg.SessionPool
		user := pc.OnRetire
		pc.OnRetire = func(key sessions.PoolKey, reason string) {
			r.metrics.poolRetired.WithLabelValues(key.Provider, reason).Inc()
			if user != nil {
				user(key, reason)
			}
		}
		if r.pool, err = sessions.NewPool(pc); err != nil {
			return nil, fmt.Errorf("handlers: Config.SessionPool: %w", err)
		}
	}
	if r.metrics, err = newMetrics(cfg.Registerer, func() float64 { return float64(r.hostLimits.Paused(r.cfg.Now())) },
		func() *sessions.Pool { return r.pool }); err != nil {
		return nil, fmt.Errorf("handlers: register metrics: %w", err)
	}
	if r.cfg.Browsers != nil {
		r.cfg.Collector.Browsers = r.cfg.Browsers
	}
	if err := r.newRobots(); err != nil {
		return nil, err
	}
	// Last, so that no error above leaves its goroutine behind.
	if r.cfg.Committer == nil {
		r.owned = cfg.Store.NewGroupCommitter(0, 0)
		r.cfg.Committer = r.owned
	}
	r.starter = cfg.Store
	if s, ok := r.cfg.Committer.(starter); ok {
		r.starter = s
	}
	return r, nil
}

// Register adds a job kind: tasks of type kindName run workflow, then parser, then commit.
func (r *Registry) Register(kindName string, workflow WorkflowFunc, parser ParserFunc, opts ...KindOption) error {
	if !kindNameOK(kindName) {
		return fmt.Errorf("handlers: kind %q must match [a-z][a-z0-9_.-]{0,63}", kindName)
	}
	if workflow == nil || parser == nil {
		return fmt.Errorf("handlers: kind %q needs a workflow and a parser", kindName)
	}
	k := &kind{name: kindName, workflow: workflow, parser: parser, topic: kindName, retry: r.cfg.Retry, schemas: &schemaSet{}}
	for _, o := range opts {
		o(k)
	}
	switch {
	case k.version < 0:
		return fmt.Errorf("handlers: kind %q: WithParserVersion(%d): the version must be >= 1", kindName, k.version)
	case k.version > 0:
		k.parsers = map[int]ParserFunc{k.version: parser}
	}
	if err := k.saved.Validate(); err != nil {
		return fmt.Errorf("handlers: kind %q: WithSavedInputs: %w", kindName, err)
	}
	if k.profiles != nil {
		if err := k.profiles.Validate(); err != nil {
			return fmt.Errorf("handlers: kind %q: WithHeaderProfiles: %w", kindName, err)
		}
	}
	if k.hostLimit != nil {
		if err := k.hostLimit.Validate(); err != nil {
			return fmt.Errorf("handlers: kind %q: WithHostLimit: %w", kindName, err)
		}
	}
	var err error
	if k.retry, err = k.retry.withDefaults(); err != nil {
		return fmt.Errorf("handlers: kind %q: %w", kindName, err)
	}
	if k.window != nil {
		if err := k.window.validate(); err != nil {
			return fmt.Errorf("handlers: kind %q: %w", kindName, err)
		}
	}
	if err := r.checkPrices(k); err != nil {
		return fmt.Errorf("handlers: kind %q: %w", kindName, err)
	}
	k.limiter = r.hostLimits.Limiter(k.name, k.hostLimit)
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, dup := r.kinds[kindName]; dup {
		return fmt.Errorf("handlers: kind %q registered twice", kindName)
	}
	r.kinds[kindName] = k
	return nil
}

func kindNameOK(s string) bool { return kindName.MatchString(s) }

// checkPrices: a money budget (the job's or the window's) needs a price above 0 on every
// provider, all in one currency.
func (r *Registry) checkPrices(k *kind) error {
	var what string
	switch {
	case k.window != nil:
		what = fmt.Sprintf("a window money budget of %d micro-units", k.window.Money)
	case k.retry.MoneyBudget > 0:
		what = fmt.Sprintf("a money budget of %d micro-units", k.retry.MoneyBudget)
	default:
		return nil
	}
	first := r.cfg.Providers[0].Price()
	for _, p := range r.cfg.Providers {
		switch price := p.Price(); {
		case price.IsZero() || price.MicrosPerGB <= 0:
			return fmt.Errorf("%s needs a price above 0 on provider %s (sessions.Provider.WithPrice, IDEMSCRAPE_PROXY_PRICE)", what, p.Name())
		case price.Currency != first.Currency:
			return fmt.Errorf("%s needs one currency, but provider %s bills in %s and %s in %s",
				what, r.cfg.Providers[0].Name(), first.Currency, p.Name(), price.Currency)
		}
	}
	return nil
}

// Close waits for the lease releases of committed jobs still in flight, then stops the
// registry's own group committer, if it made one. Call it after the asynq server has shut
// down.
func (r *Registry) Close() {
	r.relMu.Lock()
	r.closed = true
	r.relMu.Unlock()
	r.releases.Wait()
	if r.owned != nil {
		r.owned.Close()
	}
	if r.cfg.Browsers != nil {
		r.cfg.Browsers.Close()
	}
	if r.pool != nil {
		r.pool.Close()
	}
}

// poolScope is the kind's session pool scope: WithPoolScope's, else its name.
func (k *kind) poolScope() string {
	if k.scope != "" {
		return k.scope
	}
	return k.name
}

// SessionPool is the worker's session pool (Config.SessionPool), nil when off.
func (r *Registry) SessionPool() *sessions.Pool { return r.pool }

// RetryBudget returns the retry policy and budgets of a registered kind (defaults
// applied): what the job pages show as the budget a job has left. ok is false for a kind
// not registered here.
func (r *Registry) RetryBudget(kindName string) (cfg RetryConfig, ok bool) {
	r.mu.RLock()
	k, ok := r.kinds[kindName]
	r.mu.RUnlock()
	if !ok {
		return RetryConfig{}, false
	}
	cfg, err := k.retry.withDefaults()
	return cfg, err == nil
}

// Kinds returns the names of the registered kinds, sorted. Their queues default to
// tasks.QueueFor(kind).
func (r *Registry) Kinds() []string {
	r.mu.RLock()
	defer r.mu.RUnlock()
	names := make([]string, 0, len(r.kinds))
	for name := range r.kinds {
		names = append(names, name)
	}
	slices.Sort(names)
	return names
}

// Ready returns nil when the registry takes work, and an error wrapping ErrIncident that
// says which incident (category, since when, next probe) when a proxy incident has stopped
// it. It touches no network: serve it on /readyz together with Redis and PostgreSQL checks.
func (r *Registry) Ready() error { return r.incidentState() }

// Gatherer returns the private metrics registry, or nil when Config.Registerer was given.
func (r *Registry) Gatherer() prometheus.Gatherer { return r.gatherer }

// Handler returns the registry as an asynq.Handler.
func (r *Registry) Handler() asynq.Handler { return r }

// ServerConfig returns base with the runner's retry delay and failure counting: a retry
// waits the delay the runner recorded as next_attempt_at, and a delivery that found the
// lease busy (or an open incident) is retried without counting against MaxRetry. It wraps,
// never replaces, base's own RetryDelayFunc and IsFailure: the service's own task types
// (served next to the runner, see Middleware) keep them.
func (r *Registry) ServerConfig(base asynq.Config) asynq.Config {
	hostDelay, hostFailure := base.RetryDelayFunc, base.IsFailure
	base.RetryDelayFunc = func(n int, err error, t *asynq.Task) time.Duration {
		var re *retryError
		if errors.As(err, &re) || hostDelay == nil {
			return RetryDelay(n, err, t)
		}
		if errors.Is(err, asynq.ErrLeaseExpired) && t != nil {
			r.mu.RLock()
			_, ours := r.kinds[t.Type()]
			r.mu.RUnlock()
			if ours {
				return RetryDelay(n, err, t)
			}
		}
		return hostDelay(n, err, t)
	}
	base.IsFailure = func(err error) bool {
		var re *retryError
		if errors.As(err, &re) || hostFailure == nil {
			return IsFailure(err)
		}
		return hostFailure(err)
	}
	return base
}

// Middleware runs the tasks of the registered kinds through the runner and hands every
// other task to next: a service with task types of its own wraps its handler (or
// asynq.ServeMux) with it — srv.Run(reg.Middleware(mux)). Alternatively register the
// registry for each kind on a ServeMux: mux.Handle(kind, reg).
func (r *Registry) Middleware(next asynq.Handler) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		r.mu.RLock()
		_, ours := r.kinds[t.Type()]
		r.mu.RUnlock()
		if ours {
			return r.ProcessTask(ctx, t)
		}
		return next.ProcessTask(ctx, t)
	})
}

// LeaseExpiredRetryDelay is how soon asynq offers again a task whose worker died with it
// (asynq's recoverer: asynq.ErrLeaseExpired). The runner decided nothing for that delivery;
// the next one takes the job over (or meets the dead worker's lease and retries when it
// expires), so it must not wait asynq's default backoff, which after a few retries is
// tens of minutes (n⁴ seconds) while the job's row says it is due.
const LeaseExpiredRetryDelay = 5 * time.Second

// Bounds of the wait of a delivery that could not start because Redis or PostgreSQL did
// not answer (a failover, a restart, a network cut).
const (
	unavailableRetryBase = time.Second
	// UnavailableRetryMaxDelay caps it. asynq's default backoff (n⁴ + 15 + up to
	// 30·(n+1) seconds) left a job that met a 30-minute outage waiting another 10 to 24
	// minutes after it ended, more if it had failed before (n counts all its retries):
	// often past the end of its window. The cap makes that at most a minute.
	UnavailableRetryMaxDelay = time.Minute
)

// RetryDelay is an asynq.RetryDelayFunc that follows the runner's decision; retries a task
// its worker died with after LeaseExpiredRetryDelay; and one that could not start because
// Redis or PostgreSQL did not answer after 1 s doubling with its retry count n up to
// UnavailableRetryMaxDelay, with equal jitter (half the step fixed, half random: 0.5–1 s
// first) so that a fleet's backlog spreads out when the server is back. asynq moves a due
// retry to its queue every DelayedTaskCheckInterval (5 s by default) on top of that.
func RetryDelay(n int, err error, t *asynq.Task) time.Duration {
	var re *retryError
	if errors.As(err, &re) {
		if re.unavailable {
			return retry.Equal(unavailableRetryBase, UnavailableRetryMaxDelay, n+1)
		}
		return re.delay
	}
	if errors.Is(err, asynq.ErrLeaseExpired) {
		return LeaseExpiredRetryDelay
	}
	return asynq.DefaultRetryDelayFunc(n, err, t)
}

// IsFailure is an asynq IsFailure func: a busy lease is not a failure.
func IsFailure(err error) bool {
	var re *retryError
	return !errors.As(err, &re) || re.counted
}

// retryError asks asynq to retry the task after delay.
type retryError struct {
	delay       time.Duration
	unavailable bool // Redis or PostgreSQL did not answer: RetryDelay decides, not delay
	counted     bool // false: not a failure (lease busy)
	err         error
}

func (e *retryError) Error() string {
	if e.unavailable {
		return fmt.Sprintf("retry with backoff up to %v: %v", UnavailableRetryMaxDelay, e.err)
	}
	return fmt.Sprintf("retry in %v: %v", e.delay.Round(time.Millisecond), e.err)
}

func (e *retryError) Unwrap() error { return e.err }
