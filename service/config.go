package service

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"regexp"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/internal/secretenv"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/outbox"
	"github.com/idemscrape/idemscrape/tasks"
)

// currencyCode is an ISO 4217 code, as the attempts table stores it.
var currencyCode = regexp.MustCompile(`^[A-Z]{3}$`)

// Config defaults.
const (
	// DefaultConcurrency is how many jobs the asynq server runs at once.
	DefaultConcurrency = 10
	// DefaultShutdownTimeout is how long in-flight jobs may keep running after Shutdown
	// began, before asynq hands their tasks back to the queue (asynq's ShutdownTimeout).
	DefaultShutdownTimeout = 25 * time.Second
	// DefaultDrainTimeout is how long Shutdown waits, after asynq handed tasks back, for
	// the handlers of those tasks to record their attempt and release their lease. It is
	// above the runner's 15 s bound on those writes.
	DefaultDrainTimeout = 20 * time.Second
	// DefaultHTTPAddr is the address of the HTTP server: loopback only, so that asynqmon
	// is not exposed by accident.
	DefaultHTTPAddr = "127.0.0.1:8080"
	// DefaultReadyTimeout bounds each readiness check of /readyz.
	DefaultReadyTimeout = 2 * time.Second
	// DefaultMonitoringPath is where asynqmon is mounted.
	DefaultMonitoringPath = "/monitoring"
	// DefaultJobListLimit is how many jobs /jobs lists.
	DefaultJobListLimit = 100
	// EnvBasicAuthUser and EnvBasicAuthPassword hold the HTTP basic-auth credentials that
	// BasicAuthFromEnv reads. The password is never logged.
	EnvBasicAuthUser     = "IDEMSCRAPE_HTTP_USER"
	EnvBasicAuthPassword = "IDEMSCRAPE_HTTP_PASSWORD"
)

// ReadyCheck is one extra readiness check of /readyz: Check returns nil when the
// dependency it names is healthy. It must honour ctx (the service bounds it with
// Config.ReadyTimeout).
type ReadyCheck struct {
	// Name appears in /readyz's answer, e.g. "proxy".
	Name string
	// Check returns nil when healthy; its error text is shown on /readyz, so it must not
	// contain secrets.
	Check func(ctx context.Context) error
}

// BasicAuth holds the credentials that protect asynqmon and the job pages. They are
// compared in constant time and never logged (String and LogValue hide the password).
type BasicAuth struct {
	User     string
	Password string
}

// String implements fmt.Stringer without the password.
func (b BasicAuth) String() string {
	return fmt.Sprintf("BasicAuth{User: %q, Password: <redacted>}", b.User)
}

// GoString implements fmt.GoStringer without the password.
func (b BasicAuth) GoString() string { return b.String() }

// LogValue implements slog.LogValuer without the password.
func (b BasicAuth) LogValue() slog.Value { return slog.StringValue(b.String()) }

// BasicAuthFromEnv reads EnvBasicAuthUser and EnvBasicAuthPassword (or a file named by
// EnvBasicAuthPassword + "_FILE"). Both unset means no authentication (nil, nil); only
// one of them set is an error naming the missing variable (never a value).
func BasicAuthFromEnv() (*BasicAuth, error) {
	user := os.Getenv(EnvBasicAuthUser)
	pass, _, err := secretenv.Lookup(EnvBasicAuthPassword)
	if err != nil {
		return nil, fmt.Errorf("service: %w", err)
	}
	switch {
	case user == "" && pass == "":
		return nil, nil
	case user == "":
		return nil, fmt.Errorf("service: %s is set but %s is empty", EnvBasicAuthPassword, EnvBasicAuthUser)
	case pass == "":
		return nil, fmt.Errorf("service: %s is set but %s is empty", EnvBasicAuthUser, EnvBasicAuthPassword)
	}
	return &BasicAuth{User: user, Password: pass}, nil
}

// CheckExposure refuses an HTTP address that is not loopback when there is no basic auth,
// unless insecure says something in front authenticates: anyone who reaches the port
// would read the job pages and asynqmon.
func CheckExposure(addr string, auth *BasicAuth, insecure bool) error {
	if auth != nil || insecure || loopbackAddr(addr) {
		return nil
	}
	return fmt.Errorf("service: HTTP address %s is not loopback and no basic auth is set: anyone who reaches it reads the job pages and asynqmon. Set IDEMSCRAPE_HTTP_USER and IDEMSCRAPE_HTTP_PASSWORD[_FILE] (Config.BasicAuth), listen on 127.0.0.1, or say -http-insecure (Config.HTTPInsecure) if something in front authenticates", addr)
}

// Config configures a Service.
type Config struct {
	// Registry runs the jobs: its kinds must be registered before New. The service never
	// closes it; close it after Shutdown (or Run) returned. Required.
	Registry *handlers.Registry
	// Store is the system of record: the dispatcher, /readyz and the job pages read it.
	// Required.
	Store *store.PG
	// Redis is written to by /readyz (a SET of <Dispatcher.Prefix>ready-probe:<this
	// process> with a 5 s expiry: a Redis that answers but refuses writes is not ready) and
	// used by the outbox dispatcher: a *redis.Client, or a
	// *redis.ClusterClient on Redis Cluster (docs/CLUSTER.md: it should reload its slot map
	// when a node fails, as cmd/worker's does). Required.
	Redis redis.UniversalClient
	// RedisConnOpt connects the asynq server and asynqmon (each opens its own
	// connections): the same server or cluster as Redis. Defaults to Redis's own options
	// (a *redis.Client's or *redis.ClusterClient's: address or nodes, credentials, TLS,
	// database), so the server is named once; required only with another kind of client.
	RedisConnOpt asynq.RedisConnOpt
	// Queues are the asynq queues served, with their priority weights. Defaults to one
	// queue per registered kind, tasks.QueueFor(kind) (the kind's name), weight 1: where the
	// enqueuer, the scheduler and the CLI send a kind's tasks by default.
	Queues map[string]int
	// StrictPriority makes asynq drain higher-weight queues first. Defaults to false.
	StrictPriority bool
	// Concurrency is how many jobs run at once. Defaults to DefaultConcurrency.
	Concurrency int
	// ShutdownTimeout is how long in-flight jobs may run on after Shutdown began; then
	// asynq puts their tasks back to pending and cancels their context, and the runner
	// records the attempt as retryable and releases its lease. Defaults to
	// DefaultShutdownTimeout.
	ShutdownTimeout time.Duration
	// DrainTimeout bounds the wait, after asynq handed tasks back, for their handlers to
	// return. Defaults to DefaultDrainTimeout.
	DrainTimeout time.Duration

	// NoDispatcher turns the outbox dispatcher off (run it elsewhere). Defaults to false.
	NoDispatcher bool
	// Dispatcher configures the outbox dispatcher. Its Registerer and Logger default to the
	// service's. Defaults to outbox's defaults, under which the streams it publishes to are
	// bounded: entries every consumer group acknowledged are trimmed and each stream is
	// capped at outbox.DefaultMaxLen entries (outbox.TrimConsumed; a group further behind
	// loses the oldest events, counted and logged). Set Trim to outbox.TrimNever, or MaxLen
	// to outbox.NoMaxLen, to turn that off (docs/OPERATIONS.md, Bounded Redis).
	Dispatcher *outbox.DispatcherConfig

	// HTTPAddr is the listen address of the HTTP server (/metrics, /healthz, /readyz,
	// asynqmon, job pages). "127.0.0.1:0" picks a free port (see Service.HTTPAddr).
	// Defaults to DefaultHTTPAddr.
	HTTPAddr string
	// MonitoringWritable lets asynqmon change tasks and queues (delete, archive, run,
	// pause). Defaults to false: asynqmon is read-only, its API refuses every request but
	// GET. Writable or not, a state-changing request from another origin (a page on
	// another site, with the operator's credentials) is refused (http.CrossOriginProtection).
	MonitoringWritable bool
	// MonitoringReadOnly forces asynqmon read-only even with MonitoringWritable.
	//
	// Deprecated: read-only is the default; set MonitoringWritable to allow writes.
	MonitoringReadOnly bool
	// HTTPInsecure lets the HTTP server listen on an address other than loopback without
	// BasicAuth (behind a proxy that authenticates, say). Defaults to false: such an
	// address without BasicAuth is refused by New (Validate), since anyone who reaches the port
	// would read the job pages and asynqmon.
	HTTPInsecure bool
	// AllowedHosts are the names (or IPs) besides the listen address and loopback under
	// which asynqmon and the job pages answer: a request whose Host header is not the
	// listen address (as listened, the port picked for ":0"; also without the port),
	// localhost, a 127.0.0.0/8 or [::1] address (any port) or one of
	// these entries gets 421 Misdirected Request and is counted in
	// idemscrape_http_host_refused_total: a page of another site whose name was made to
	// resolve to this server (DNS rebinding) is refused, credentials or not. An entry is a
	// host name or IP ("jobs.internal", "10.0.3.7"), any port, or host:port for that port
	// only; no wildcards. /metrics, /healthz and /readyz are not checked: orchestrators'
	// probes and Prometheus reach them by the pod's IP, and they are unauthenticated
	// anyway. Listening on every interface (0.0.0.0, ::) accepts no interface IP by
	// itself: name each name or IP the operators use here. Defaults to none.
	AllowedHosts []string
	// BasicAuth, when set, protects asynqmon and the job pages (not /metrics, /healthz,
	// /readyz, which probes and scrapers reach). See BasicAuthFromEnv. Defaults to nil: no
	// authentication.
	BasicAuth *BasicAuth
	// ReadyTimeout bounds each readiness check. Defaults to DefaultReadyTimeout.
	ReadyTimeout time.Duration
	// ReadyChecks are extra readiness checks, besides Redis, PostgreSQL, the asynq server
	// and Registry.Ready. Defaults to none.
	ReadyChecks []ReadyCheck
	// JobListLimit is how many jobs /jobs lists. Defaults to DefaultJobListLimit.
	JobListLimit int
	// WindowBudgets are the kinds' money budgets per collection window, as given to
	// handlers.WithWindowBudget (Money in micro-units, in the providers' currency), by kind:
	// /windows shows each window's spend against its budget, a job page says when its job
	// is deferred (or failed) because its window's budget is spent, and /jobs?deferred=1
	// lists those jobs. PostgreSQL records what attempts cost, not the budgets. Defaults to
	// none: the pages show the spend alone.
	WindowBudgets map[string]store.Cost

	// Gatherer is served on /metrics besides the registry's own gatherer (give the
	// registry's Registerer here if you set handlers.Config.Registerer) and the service's
	// (dispatcher, Go runtime, process). Defaults to nil.
	Gatherer prometheus.Gatherer
	// Logger receives the service's and asynq's logs. Defaults to slog.Default().
	Logger *slog.Logger
	// AsynqLogLevel is the least level of asynq's own logs. Defaults to asynq.InfoLevel.
	AsynqLogLevel asynq.LogLevel
}

// Validate reports the first invalid field. Zero values of optional fields are valid
// (they mean the default).
func (c *Config) Validate() error {
	switch {
	case c.Registry == nil:
		return errors.New("service: Config.Registry is required")
	case c.Store == nil:
		return errors.New("service: Config.Store is required")
	case c.Redis == nil:
		return errors.New("service: Config.Redis is required")
	case c.RedisConnOpt == nil && !derivesConnOpt(c.Redis):
		_, err := connOptOf(c.Redis)
		return err
	case c.Concurrency < 0:
		return fmt.Errorf("service: Config.Concurrency %d is negative", c.Concurrency)
	case c.ShutdownTimeout < 0:
		return fmt.Errorf("service: Config.ShutdownTimeout %v is negative", c.ShutdownTimeout)
	case c.DrainTimeout < 0:
		return fmt.Errorf("service: Config.DrainTimeout %v is negative", c.DrainTimeout)
	case c.ReadyTimeout < 0:
		return fmt.Errorf("service: Config.ReadyTimeout %v is negative", c.ReadyTimeout)
	case c.HTTPAddr != "" && CheckExposure(c.HTTPAddr, c.BasicAuth, c.HTTPInsecure) != nil:
		return CheckExposure(c.HTTPAddr, c.BasicAuth, c.HTTPInsecure)
	case CheckAllowedHosts(c.AllowedHosts) != nil:
		return CheckAllowedHosts(c.AllowedHosts)
	case c.JobListLimit < 0:
		return fmt.Errorf("service: Config.JobListLimit %d is negative", c.JobListLimit)
	case c.BasicAuth != nil && (c.BasicAuth.User == "" || c.BasicAuth.Password == ""):
		return errors.New("service: Config.BasicAuth needs a User and a Password")
	case c.BasicAuth != nil && strings.Contains(c.BasicAuth.User, ":"):
		return errors.New("service: Config.BasicAuth.User may not contain ':'")
	}
	for k, b := range c.WindowBudgets {
		if k == "" || b.Micros <= 0 || !currencyCode.MatchString(b.Currency) {
			return fmt.Errorf("service: Config.WindowBudgets[%q] = %d micro-units %q: want a kind, an amount > 0 and an ISO 4217 currency", k, b.Micros, b.Currency)
		}
	}
	for q, w := range c.Queues {
		if q == "" || strings.ContainsAny(q, "{}") {
			return fmt.Errorf("service: Config.Queues: queue name %q must be non-empty without braces", q)
		}
		if w < 1 {
			return fmt.Errorf("service: Config.Queues: queue %q has weight %d, must be >= 1", q, w)
		}
	}
	if len(c.Queues) == 0 && len(c.Registry.Kinds()) == 0 {
		return errors.New("service: Config.Queues is empty and no kind is registered")
	}
	for i, rc := range c.ReadyChecks {
		if rc.Name == "" || rc.Check == nil {
			return fmt.Errorf("service: Config.ReadyChecks[%d] needs a Name and a Check", i)
		}
	}
	if c.Dispatcher != nil {
		if err := c.Dispatcher.Validate(); err != nil {
			return fmt.Errorf("service: Config.Dispatcher: %w", err)
		}
	}
	return nil
}

// withDefaults returns a copy of c with every default filled in. c must be valid.
func (c *Config) withDefaults() Config {
	o := *c
	if o.RedisConnOpt == nil {
		o.RedisConnOpt, _ = connOptOf(o.Redis) // Validate checked it can
	}
	if len(o.Queues) == 0 {
		o.Queues = map[string]int{}
		for _, k := range o.Registry.Kinds() {
			o.Queues[tasks.QueueFor(k)] = 1
		}
	}
	if o.Concurrency == 0 {
		o.Concurrency = DefaultConcurrency
	}
	if o.ShutdownTimeout == 0 {
		o.ShutdownTimeout = DefaultShutdownTimeout
	}
	if o.DrainTimeout == 0 {
		o.DrainTimeout = DefaultDrainTimeout
	}
	if o.HTTPAddr == "" {
		o.HTTPAddr = DefaultHTTPAddr
	}
	if o.ReadyTimeout == 0 {
		o.ReadyTimeout = DefaultReadyTimeout
	}
	if o.JobListLimit == 0 {
		o.JobListLimit = DefaultJobListLimit
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.AsynqLogLevel == 0 {
		o.AsynqLogLevel = asynq.InfoLevel
	}
	return o
}
