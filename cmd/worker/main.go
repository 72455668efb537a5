// Command worker is idemscrape's reference worker: it migrates the database, registers the
// example job kind (examples/catalog) and runs the service entry point (package service):
// the asynq server with the runner, the outbox dispatcher, and one HTTP server with
// /metrics, /healthz, /readyz, asynqmon at /monitoring and the job pages at /jobs.
//
// Every setting is a flag, and every flag has an environment variable (the flag wins):
//
//	worker -catalog-base https://shop.example            (see worker -h for the rest)
//
// An IDEMSCRAPE_* variable that neither the worker nor another binary of the repository
// reads (a misspelt name, IDEMSCRAPE_CONCURENCY) is warned about at start, naming the
// closest known one; it sets nothing.
//
// Redis is one server (-redis host:port, IDEMSCRAPE_REDIS; default 127.0.0.1:6379) or a
// Redis Cluster (-redis-cluster host:port,host:port,…, IDEMSCRAPE_REDIS_CLUSTER: some of its
// nodes, the client finds the rest); the two are mutually exclusive. Leases, host limits,
// robots.txt cache, outbox streams and asynq's queues all run on either (docs/CLUSTER.md).
//
// Proxy credentials come only from the environment (IDEMSCRAPE_PROXY_PROVIDER, _USER,
// _PASSWORD, _ZONE, _GATEWAY, the price IDEMSCRAPE_PROXY_PRICE, and _EXIT_HEADER, the
// response header that names the exit, which lets a unit continue on its session after a
// dropped connection once the exit is proven unchanged; more accounts, used in
// order when one refuses the account, with the suffixes _2, _3 …; see
// sessions.ProvidersFromEnv) or from a providers file (-providers FILE,
// IDEMSCRAPE_PROVIDERS_FILE: the accounts in YAML, each password named there by variable or
// file, never written in it; see envflag.Providers), and so do the HTTP basic-auth
// credentials (IDEMSCRAPE_HTTP_USER, IDEMSCRAPE_HTTP_PASSWORD): none of them is ever
// logged. SIGTERM or SIGINT shut the worker down gracefully (see service.Service.Shutdown);
// it exits 0 after a clean shutdown, 1 on an error, 2 on a bad configuration.
//
// # Failpoints (chaos runs only)
//
// cmd/chaos injects crashes at the dangerous moments through two environment variables that
// a production worker never sets; with neither set the worker behaves exactly as without
// this code:
//
//	IDEMSCRAPE_FAILPOINTS=after_fetch:0.01,after_commit:0.01,after_xadd:0.05
//	IDEMSCRAPE_CHAOS_RETRY_SCALE=0.02
//
// Each failpoint fires with its probability every time it is reached; a firing point
// writes one line "FAILPOINT name=<point> pid=<pid> key=<job key>|outbox_ids=[…]" to
// stderr and SIGKILLs the process itself (no deferred cleanup, no lease release, no ack;
// before_commit stops it instead):
//
//	after_fetch   after every step of the catalog unit fetched and staged, before
//	              validation and the commit (an extra last safe step of the unit)
//	before_commit SIGSTOPs the process just before the fenced commit is sent (once per
//	              process; cmd/chaos continues it after the job was taken over, and the
//	              fence must refuse the commit); a second line reports its outcome
//	after_commit  after the fenced commit returned success, before the lease release and
//	              asynq's acknowledgement (a wrapper around the group committer)
//	after_xadd    in the outbox dispatcher, after a batch's XADDs and before the rows are
//	              marked sent (outbox.DispatcherConfig.AfterPublish)
//	dup_result    a deliberately broken build, not a crash: after a successful commit it
//	              inserts a second results row for the job under another observation key,
//	              so the chaos harness can show that it detects a duplicate result
//
// IDEMSCRAPE_CHAOS_RETRY_SCALE multiplies every retry backoff of handlers.DefaultPolicies
// by a factor in (0, 1], so that a chaos run's retries take seconds instead of minutes.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/cmd/internal/boot"
	"github.com/idemscrape/idemscrape/cmd/internal/envflag"
	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/service"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/sessions/profile"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/inputs"
	"github.com/idemscrape/idemscrape/store/outbox"
	"github.com/idemscrape/idemscrape/tasks"
)

// config is everything the worker reads from flags and the environment.
type config struct {
	pg                string
	redis             envflag.Redis
	redisCfg          envflag.RedisConfig // from redis, set by validate
	httpAddr          string
	httpAllowedHosts  string   // -http-allowed-hosts
	allowedHosts      []string // from httpAllowedHosts, set by validate
	concurrency       int
	queues            string
	keyPrefix         string
	streamPrefix      string
	workerID          string
	leaseDefault      time.Duration
	leaseMin          time.Duration
	leaseMax          time.Duration
	leaseMargin       float64
	shutdownTimeout   time.Duration
	drainTimeout      time.Duration
	requestTimeout    time.Duration
	readOnly          bool // deprecated: read-only is the default
	writable          bool // -monitoring-writable
	httpInsecure      bool
	noDispatcher      bool
	allowLoopback     bool
	ignoreRobots      bool
	log               envflag.Log
	catalogBase       string
	savedInputs       string
	savedPolicy       inputs.Policy
	maxSessionRestart int
	maxResumes        int
	noSessionPool     bool
	headerProfiles    string
	profileOpts       *profile.Options
	poolMaxUnits      int
	poolMinRemaining  time.Duration
	streamTrim        string
	streamTrimPolicy  outbox.TrimPolicy // from streamTrim, set by validate
	streamTrimEvery   time.Duration
	streamMaxLen      int
	// The example kind's budgets.
	jobByteBudget  int
	windowBudget   string
	windowMoney    int64  // from windowBudget, set by validate
	windowCurrency string // from windowBudget, set by validate
	windowAction   string
	windowOnSpent  handlers.WindowAction // from windowAction, set by validate
	windowDeferFor time.Duration
	// providersFile is -providers: the proxy accounts from a file instead of the
	// IDEMSCRAPE_PROXY_* variables (envflag.Providers).
	providersFile string
	// unknownEnv are the IDEMSCRAPE_* variables of the environment that nothing reads
	// (a misspelt name), warned about at start.
	unknownEnv []unknownEnvVar
}

// maxConcurrency is the most jobs -concurrency lets one worker run at once.
const maxConcurrency = 10000

// envPrefix is the prefix of every environment variable of the worker.
const envPrefix = "IDEMSCRAPE_"

func parseFlags(args []string, stderr io.Writer) (config, error) {
	var c config
	s := defineFlags(&c, stderr)
	if err := s.Parse(args); err != nil {
		return c, err
	}
	c.unknownEnv = unknownEnv(os.Environ(), s.FS)
	err := c.validate()
	return c, err
}

// defineFlags defines every flag of the worker on a new set, into c.
func defineFlags(c *config, stderr io.Writer) *envflag.Set {
	s := envflag.New("worker", envPrefix, stderr)
	s.String(&c.pg, "pg", "PG", "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable", "PostgreSQL URL (libpq form)")
	c.redis.Define(s)
	s.String(&c.httpAddr, "http", "HTTP_ADDR", service.DefaultHTTPAddr, "HTTP listen address for /metrics, /healthz, /readyz, /monitoring, /jobs")
	s.String(&c.httpAllowedHosts, "http-allowed-hosts", "HTTP_ALLOWED_HOSTS", "", "host names or IPs (host or host:port, comma-separated) under which /monitoring and /jobs answer besides the -http address and loopback names; any other Host header gets 421 (DNS rebinding); /metrics, /healthz and /readyz take any")
	s.Int(&c.concurrency, "concurrency", "CONCURRENCY", service.DefaultConcurrency, "jobs run at once (1.."+strconv.Itoa(maxConcurrency)+")")
	s.String(&c.queues, "queues", "QUEUES", "", "asynq queues and weights, name:weight,… (default: one queue per registered kind, named like the kind, weight 1)")
	s.String(&c.keyPrefix, "key-prefix", "KEY_PREFIX", handlers.DefaultKeyPrefix, "prefix of the lease keys in Redis")
	s.String(&c.streamPrefix, "stream-prefix", "STREAM_PREFIX", outbox.DefaultPrefix, "prefix of the outbox stream keys (<prefix>stream:{<topic>})")
	s.String(&c.streamTrim, "stream-trim", "STREAM_TRIM", outbox.TrimConsumed.String(), "how the dispatcher trims the outbox streams it publishes to: consumed (entries every consumer group acknowledged, and the -stream-max-len cap) or never (streams grow until Redis is full)")
	s.Duration(&c.streamTrimEvery, "stream-trim-interval", "STREAM_TRIM_INTERVAL", outbox.DefaultTrimInterval, "least time between two trims of one stream by this worker (a stream may exceed -stream-max-len by what is published in between)")
	s.Int(&c.streamMaxLen, "stream-max-len", "STREAM_MAX_LEN", outbox.DefaultMaxLen, "most entries a trim leaves in each outbox stream, acknowledged or not: a consumer group further behind loses the oldest events (counted in idemscrape_outbox_stream_cap_lost_total, logged); -1: no cap (a group that stops reading grows the stream without bound); ignored with -stream-trim never")
	s.String(&c.workerID, "worker-id", "WORKER_ID", "", "this worker's name in attempts rows (default host/pid)")
	s.Duration(&c.leaseDefault, "lease-default", "LEASE_DEFAULT", handlers.DefaultLeaseLength, "lease length of a kind until enough durations were measured")
	s.Duration(&c.leaseMin, "lease-min", "LEASE_MIN", handlers.DefaultLeaseMin, "shortest lease")
	s.Duration(&c.leaseMax, "lease-max", "LEASE_MAX", handlers.DefaultLeaseMax, "longest lease")
	s.Float(&c.leaseMargin, "lease-margin", "LEASE_MARGIN", handlers.DefaultLeaseMargin, "measured lease = p95 of job durations × this margin (>= 1)")
	s.Duration(&c.shutdownTimeout, "shutdown-timeout", "SHUTDOWN_TIMEOUT", service.DefaultShutdownTimeout, "on SIGTERM, how long in-flight jobs may finish before they are handed back to the queue")
	s.Duration(&c.drainTimeout, "drain-timeout", "DRAIN_TIMEOUT", service.DefaultDrainTimeout, "after that, how long to wait for handed-back jobs to record their attempt and release their lease")
	s.Duration(&c.requestTimeout, "request-timeout", "REQUEST_TIMEOUT", sessions.DefaultRequestTimeout, "bound of each destination request")
	s.Int(&c.maxSessionRestart, "max-session-restarts", "MAX_SESSION_RESTARTS", 0, "session replays per attempt (0: the runner's default; -1: none)")
	s.Int(&c.maxResumes, "max-resumes", "MAX_RESUMES", 0, "steps run again on their own session after a cut (exit proven unchanged) or a Retry-After, per attempt, instead of a replay (0: the runner's default; -1: none, every cut replays)")
	s.Bool(&c.noSessionPool, "no-session-pool", "NO_SESSION_POOL", "start every attempt on a new sticky session; by default a session whose unit went well serves the next unit of the same provider, tier, country and host (its exit and cookies warm)")
	s.Int(&c.poolMaxUnits, "session-pool-max-units", "SESSION_POOL_MAX_UNITS", sessions.DefaultPoolMaxUnits, "units one pooled session serves before it is retired")
	s.Duration(&c.poolMinRemaining, "session-pool-min-remaining", "SESSION_POOL_MIN_REMAINING", sessions.DefaultPoolMinRemaining, "sticky lifetime a pooled session must have left to start a unit (keep it above a unit's longest run; at most half the session's lifetime is asked)")
	s.String(&c.headerProfiles, "header-profiles", "HEADER_PROFILES", "none", "browsers whose realistic header profiles (User-Agent, Accept-Language, client hints) the example kind's sessions present, one per session for its whole life, comma-separated: chrome, edge, firefox, safari; none: the honest idemscrape User-Agent")
	s.Bool(&c.writable, "monitoring-writable", "MONITORING_WRITABLE", "let asynqmon change tasks and queues (delete, archive, run); default read-only; writes from another origin are refused either way")
	s.Bool(&c.readOnly, "read-only", "MONITORING_READ_ONLY", "deprecated: asynqmon is read-only by default; forces read-only even with -monitoring-writable")
	s.Bool(&c.httpInsecure, "http-insecure", "HTTP_INSECURE", "allow -http on a non-loopback address without basic auth (something in front authenticates)")
	s.Bool(&c.noDispatcher, "no-dispatcher", "NO_DISPATCHER", "do not run the outbox dispatcher in this process")
	s.Bool(&c.allowLoopback, "allow-loopback", "ALLOW_LOOPBACK", "allow destinations on 127.0.0.0/8 and ::1 (demos and tests only; never in production)")
	s.Bool(&c.ignoreRobots, "ignore-robots", "IGNORE_ROBOTS", "do not fetch or respect robots.txt")
	c.log.Define(s)
	s.String(&c.savedInputs, "saved-inputs", "SAVED_INPUTS", "never", "what the example kind keeps of each attempt for idemscrape reparse: never, always, on_failure or sample(RATE), optionally \",max=BYTES\" (docs/PARSERS.md)")
	s.Int(&c.jobByteBudget, "job-byte-budget", "JOB_BYTE_BUDGET", handlers.DefaultBandwidthBudget, "bytes all attempts of one job of the example kind may move through the proxy")
	s.String(&c.windowBudget, "window-budget", "WINDOW_BUDGET", "", "money the example kind may spend per collection window, fleet-wide, e.g. \"25.50 USD\" (in the proxies' currency; needs $IDEMSCRAPE_PROXY_PRICE); default none")
	s.String(&c.windowAction, "window-budget-action", "WINDOW_BUDGET_ACTION", handlers.WindowFail.String(), "what happens to a window's remaining jobs once its budget is spent: fail (budget_exceeded) or defer (handed back for -window-defer-for)")
	s.Duration(&c.windowDeferFor, "window-defer-for", "WINDOW_DEFER_FOR", handlers.DefaultWindowDeferFor, "with -window-budget-action defer: how long a delivery of a spent window waits")
	s.String(&c.providersFile, "providers", "PROVIDERS_FILE", "", "read the proxy accounts from this YAML `FILE` (examples/providers.yaml) instead of $IDEMSCRAPE_PROXY_*; the two together are refused")
	s.String(&c.catalogBase, "catalog-base", "CATALOG_BASE", "", "base URL (scheme://host[:port]) of the shop the example kind \"catalog\" scrapes for -source-id jobs; a -url job fetches its own URL (required; a private, link-local or cloud metadata address is refused, even with -allow-loopback)")

	s.FS.Usage = func() {
		fmt.Fprintf(s.FS.Output(), `usage: worker [flags]

Runs idemscrape's reference worker: migrates PostgreSQL, registers the example kind
%q, and serves it until SIGTERM or SIGINT (graceful: in-flight jobs finish or are handed
back, leases are released, exit 0).

Secrets come only from the environment and are never logged:
  $%s, $%s, $%s, $%s, $%s
      the residential proxy account (brightdata | oxylabs | decodo | iproyal | soax)
  $%s ("8.40 USD/GB"), $%s ("DE=9.10,BR=12")
      what its traffic costs: each attempt's cost, idemscrape stats, money budgets
  $%s (datacenter | residential | mobile; default residential)
      the exits it sells: jobs start on the cheapest tier their shop has not blocked
  the same variables ending in _2, _3 … (and $%s_2 … to tell accounts apart)
      more accounts, used in order when one refuses the account (407); a shop that
      blocks a tier (403) moves to the next tier for an hour, a country without peers
      on one account to the next account for 10 minutes, fleet-wide
  or -providers FILE ($IDEMSCRAPE_PROVIDERS_FILE): the accounts in one YAML file, their
      passwords named there by variable (password_env) or file (password_file), never
      written in it (examples/providers.yaml, docs/DEPLOY.md)
  $%s, $%s
      HTTP basic auth for /monitoring and /jobs (both set: required; both unset: none)

Flags (each also read from the environment variable shown; the flag wins):
`, catalog.Kind, sessions.EnvProvider, sessions.EnvUser, sessions.EnvPassword, sessions.EnvZone, sessions.EnvGateway,
			sessions.EnvPrice, sessions.EnvPriceCountries, sessions.EnvTier, sessions.EnvName,
			service.EnvBasicAuthUser, service.EnvBasicAuthPassword)
		s.FS.PrintDefaults()
	}
	return s
}

func (c *config) validate() error {
	switch {
	case c.catalogBase == "":
		return errors.New("-catalog-base ($IDEMSCRAPE_CATALOG_BASE) is required: the shop the example kind scrapes")
	case !strings.HasPrefix(c.catalogBase, "http://") && !strings.HasPrefix(c.catalogBase, "https://"):
		return fmt.Errorf("-catalog-base %q must start with http:// or https://", c.catalogBase)
	case c.concurrency < 1 || c.concurrency > maxConcurrency:
		return fmt.Errorf("-concurrency %d ($IDEMSCRAPE_CONCURRENCY) must be in 1..%d", c.concurrency, maxConcurrency)
	case c.maxResumes < -1:
		return fmt.Errorf("-max-resumes %d ($IDEMSCRAPE_MAX_RESUMES) must be >= -1 (0: the runner's default; -1: none)", c.maxResumes)
	case c.maxSessionRestart < -1:
		return fmt.Errorf("-max-session-restarts %d ($IDEMSCRAPE_MAX_SESSION_RESTARTS) must be >= -1 (0: the runner's default; -1: none)", c.maxSessionRestart)
	case c.shutdownTimeout <= 0 || c.drainTimeout <= 0:
		return errors.New("-shutdown-timeout and -drain-timeout must be positive")
	case c.leaseMargin < 1:
		return fmt.Errorf("-lease-margin %v must be >= 1", c.leaseMargin)
	case c.poolMaxUnits < 1:
		return fmt.Errorf("-session-pool-max-units %d ($IDEMSCRAPE_SESSION_POOL_MAX_UNITS) must be >= 1", c.poolMaxUnits)
	case c.poolMinRemaining <= 0:
		return fmt.Errorf("-session-pool-min-remaining %v ($IDEMSCRAPE_SESSION_POOL_MIN_REMAINING) must be positive", c.poolMinRemaining)
	}
	// What the fetch guard refuses whatever -allow-loopback says (link-local and cloud
	// metadata addresses and names in any spelling, private addresses, ports outside the
	// policy's) is refused here; loopback is left to the guard, which refuses it unless
	// -allow-loopback.
	if err := tasks.LoopbackPolicy().CheckURL(c.catalogBase); err != nil {
		return fmt.Errorf("-catalog-base ($IDEMSCRAPE_CATALOG_BASE) %q: %w (-allow-loopback relaxes loopback only)", c.catalogBase, err)
	}
	if _, err := parseQueues(c.queues); err != nil {
		return err
	}
	if err := envflag.CheckListenAddr("http", envPrefix+"HTTP_ADDR", c.httpAddr); err != nil {
		return err
	}
	c.allowedHosts = nil
	for h := range strings.SplitSeq(c.httpAllowedHosts, ",") {
		if h = strings.TrimSpace(h); h != "" {
			c.allowedHosts = append(c.allowedHosts, h)
		}
	}
	if err := service.CheckAllowedHosts(c.allowedHosts); err != nil {
		return fmt.Errorf("-http-allowed-hosts ($IDEMSCRAPE_HTTP_ALLOWED_HOSTS): %w", err)
	}
	if err := c.validateLeases(); err != nil {
		return err
	}
	if err := c.validateBudgets(); err != nil {
		return err
	}
	var err error
	if c.savedPolicy, err = inputs.ParsePolicy(c.savedInputs); err != nil {
		return fmt.Errorf("-saved-inputs ($IDEMSCRAPE_SAVED_INPUTS): %w", err)
	}
	if c.redisCfg, err = c.redis.Config(); err != nil {
		return err
	}
	if err := c.validateStreams(); err != nil {
		return err
	}
	if hp := strings.TrimSpace(c.headerProfiles); !strings.EqualFold(hp, "none") && hp != "" {
		o := profile.Options{}
		for b := range strings.SplitSeq(hp, ",") {
			o.Browsers = append(o.Browsers, strings.TrimSpace(b))
		}
		if err := o.Validate(); err != nil {
			return fmt.Errorf("-header-profiles ($IDEMSCRAPE_HEADER_PROFILES) %q: %w", c.headerProfiles, err)
		}
		c.profileOpts = &o
	}
	return c.log.Validate()
}

// validateLeases checks the lease flags as the registry will (handlers.LeaseLengthConfig),
// naming the flags, so that a bad pair is a bad setting before anything is opened.
func (c *config) validateLeases() error {
	lc := handlers.LeaseLengthConfig{Default: c.leaseDefault, Min: c.leaseMin, Max: c.leaseMax, Margin: c.leaseMargin}
	err := lc.Validate() // fills in the defaults of zero values
	switch {
	case err == nil:
		return nil
	case lc.Min <= 0 || lc.Max < lc.Min:
		return fmt.Errorf("-lease-min %v ($IDEMSCRAPE_LEASE_MIN) must be above 0 and at most -lease-max %v ($IDEMSCRAPE_LEASE_MAX)", lc.Min, lc.Max)
	case lc.Default < lc.Min || lc.Default > lc.Max:
		return fmt.Errorf("-lease-default %v ($IDEMSCRAPE_LEASE_DEFAULT) must be between -lease-min %v and -lease-max %v", lc.Default, lc.Min, lc.Max)
	}
	return fmt.Errorf("-lease-default, -lease-min, -lease-max, -lease-margin: %w", err)
}

// validateBudgets checks the example kind's budget flags, naming the flag that is wrong.
func (c *config) validateBudgets() error {
	if c.jobByteBudget < 1 {
		return fmt.Errorf("-job-byte-budget ($IDEMSCRAPE_JOB_BYTE_BUDGET) %d must be >= 1 byte", c.jobByteBudget)
	}
	switch c.windowAction {
	case handlers.WindowFail.String():
		c.windowOnSpent = handlers.WindowFail
	case handlers.WindowDefer.String():
		c.windowOnSpent = handlers.WindowDefer
	default:
		return fmt.Errorf("-window-budget-action ($IDEMSCRAPE_WINDOW_BUDGET_ACTION) %q: want fail or defer", c.windowAction)
	}
	if c.windowDeferFor <= 0 {
		return fmt.Errorf("-window-defer-for ($IDEMSCRAPE_WINDOW_DEFER_FOR) %v must be positive", c.windowDeferFor)
	}
	if c.windowBudget == "" {
		return nil
	}
	var err error
	if c.windowMoney, c.windowCurrency, err = sessions.ParseAmount(c.windowBudget); err != nil {
		return fmt.Errorf("-window-budget ($IDEMSCRAPE_WINDOW_BUDGET): %w", err)
	}
	if c.windowMoney <= 0 {
		return fmt.Errorf("-window-budget ($IDEMSCRAPE_WINDOW_BUDGET) %q must be above 0", c.windowBudget)
	}
	return nil
}

// kindOptions are the example kind's options from the flags: budgets, retry policies.
func (c *config) kindOptions(providers []*sessions.Provider, policies map[tasks.Category]handlers.Policy) ([]handlers.KindOption, error) {
	opts := []handlers.KindOption{handlers.WithSavedInputs(c.savedPolicy),
		handlers.WithRetry(handlers.RetryConfig{Policies: policies, BandwidthBudget: int64(c.jobByteBudget)})}
	if c.profileOpts != nil {
		opts = append(opts, handlers.WithHeaderProfiles(*c.profileOpts))
	}
	if c.windowMoney == 0 {
		return opts, nil
	}
	if cur := providers[0].Price().Currency; cur != c.windowCurrency {
		have := "no price ($IDEMSCRAPE_PROXY_PRICE unset)"
		if c.providersFile != "" {
			have = "no price (no price in -providers " + c.providersFile + ")"
		}
		if cur != "" {
			have = "a price in " + cur
		}
		return nil, fmt.Errorf("-window-budget ($IDEMSCRAPE_WINDOW_BUDGET) %q is in %s, but the proxy account %s has %s",
			c.windowBudget, c.windowCurrency, providers[0].Name(), have)
	}
	return append(opts, handlers.WithWindowBudget(handlers.WindowBudget{
		Money: c.windowMoney, OnSpent: c.windowOnSpent, DeferFor: c.windowDeferFor,
		Concurrency: c.concurrency})), nil // warned at the first reservation when the budget can not cover it
}

// validateStreams checks the -stream-trim flags, naming the flag that is wrong.
func (c *config) validateStreams() error {
	var err error
	if c.streamTrimPolicy, err = outbox.ParseTrimPolicy(c.streamTrim); err != nil {
		return fmt.Errorf("-stream-trim ($IDEMSCRAPE_STREAM_TRIM) %q: want consumed or never", c.streamTrim)
	}
	if c.streamTrimPolicy == outbox.TrimNever {
		return nil
	}
	switch {
	case c.streamTrimEvery <= 0:
		return fmt.Errorf("-stream-trim-interval ($IDEMSCRAPE_STREAM_TRIM_INTERVAL) %v must be positive", c.streamTrimEvery)
	case c.streamMaxLen != outbox.NoMaxLen && c.streamMaxLen < outbox.DefaultDispatchBatchSize:
		return fmt.Errorf("-stream-max-len ($IDEMSCRAPE_STREAM_MAX_LEN) %d: want a number of entries of at least %d (the dispatcher's batch), or -1 for no cap",
			c.streamMaxLen, outbox.DefaultDispatchBatchSize)
	}
	return c.dispatcherConfig(nil).Validate()
}

// streamMaxLenText is -stream-max-len as the start-up log line shows it.
func streamMaxLenText(c config) string {
	if c.streamTrimPolicy == outbox.TrimNever || c.streamMaxLen == outbox.NoMaxLen {
		return "none"
	}
	return strconv.Itoa(c.streamMaxLen)
}

// dispatcherConfig is the outbox dispatcher's configuration from the flags.
func (c *config) dispatcherConfig(afterPublish func([]int64) error) *outbox.DispatcherConfig {
	dc := &outbox.DispatcherConfig{Prefix: c.streamPrefix, AfterPublish: afterPublish, Trim: c.streamTrimPolicy}
	if c.streamTrimPolicy == outbox.TrimConsumed {
		dc.TrimInterval, dc.MaxLen = c.streamTrimEvery, c.streamMaxLen
	}
	return dc
}

// parseQueues reads "name:weight,name2:weight2" ("name" alone means weight 1); "" is nil.
func parseQueues(s string) (map[string]int, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	out := map[string]int{}
	for _, part := range strings.Split(s, ",") {
		name, weight, hasWeight := strings.Cut(strings.TrimSpace(part), ":")
		w := 1
		if hasWeight {
			var err error
			if w, err = strconv.Atoi(weight); err != nil || w < 1 {
				return nil, fmt.Errorf("-queues: %q: weight must be an integer >= 1", part)
			}
		}
		if name == "" {
			return nil, fmt.Errorf("-queues: %q: empty queue name", part)
		}
		if err := tasks.CheckQueue(name); err != nil {
			return nil, fmt.Errorf("-queues ($IDEMSCRAPE_QUEUES): %q: %w", part, err)
		}
		out[name] = w
	}
	return out, nil
}

func main() {
	c, err := parseFlags(os.Args[1:], os.Stderr)
	if code, exit := boot.FlagsExit("worker", err, os.Stderr, envflag.LogFormatOf(os.Args[1:], envPrefix)); exit {
		os.Exit(code)
	}
	log := boot.Logger(c.log, os.Stderr)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	go func() {
		// After the first signal, a second one kills the process the default way.
		<-ctx.Done()
		stop()
	}()
	if code := boot.RunExit("worker", run(ctx, c, log), log); code != 0 {
		os.Exit(code)
	}
}

func run(ctx context.Context, c config, log *slog.Logger) error {
	// Traces, when the OTEL_* environment asks for them (cmd/internal/telemetry).
	flushTraces, tracing := boot.Tracing(ctx, "idemscrape-worker", log)
	defer flushTraces()
	set, err := readSettings(c, log)
	if err != nil {
		return err
	}

	pool, err := boot.OpenPG(ctx, c.pg, log)
	if err != nil {
		return err
	}
	defer pool.Close()
	rdb := c.redisCfg.NewClient()
	defer rdb.Close()

	collector := c.collectorConfig(log)
	var committer handlers.Committer
	if fc := set.fp.committer(store.New(pool), pool); fc != nil {
		defer fc.Close() // deferred before reg.Close, so it runs after it
		committer = fc
	}
	reg, err := newRegistry(c, set, collector, committer, pool, rdb, log)
	if err != nil {
		return err
	}
	defer reg.Close()
	kinds := []string{catalog.Kind}
	if err := reg.Register(catalog.Kind, set.fp.workflow(catalog.Workflow(c.catalogBase)), catalog.Parse, set.kindOpts...); err != nil {
		return &boot.SettingError{Err: err}
	}

	queues := queuesOf(c, kinds)
	svc, err := newService(c, set, queues, reg, pool, rdb, log)
	if err != nil {
		return err
	}
	logStart(log, c, set, tracing, kinds, queues)
	return svc.Run(ctx)
}

// settings are what run reads from the environment before it opens anything: the proxy
// accounts, the failpoints, the example kind's options and the HTTP basic auth.
type settings struct {
	providers []*sessions.Provider
	fp        failpoints
	kindOpts  []handlers.KindOption
	auth      *service.BasicAuth
}

// readSettings is run's first step: it warns about IDEMSCRAPE_* variables nothing reads,
// reads and checks the settings from the environment (a bad one is a *boot.SettingError)
// and warns when chaos settings are on.
func readSettings(c config, log *slog.Logger) (settings, error) {
	warnUnknownEnv(c, log)
	var s settings
	var err error
	if s.providers, err = envflag.Providers(c.providersFile); err != nil {
		return s, &boot.SettingError{Err: err}
	}
	if s.fp, err = parseFailpoints(os.Getenv(EnvFailpoints)); err != nil {
		return s, &boot.SettingError{Err: err}
	}
	policies, err := retryPolicies(os.Getenv(EnvChaosRetryScale))
	if err != nil {
		return s, &boot.SettingError{Err: err}
	}
	if s.kindOpts, err = c.kindOptions(s.providers, policies); err != nil {
		return s, &boot.SettingError{Err: err}
	}
	if len(s.fp) > 0 || policies != nil {
		log.Warn("chaos settings on: for chaos runs only", "failpoints", os.Getenv(EnvFailpoints), "retry_scale", os.Getenv(EnvChaosRetryScale))
	}
	if s.auth, err = service.BasicAuthFromEnv(); err != nil {
		return s, &boot.SettingError{Err: err}
	}
	if err := service.CheckExposure(c.httpAddr, s.auth, c.httpInsecure); err != nil {
		return s, &boot.SettingError{Err: err}
	}
	return s, nil
}

// warnUnknownEnv logs one warning per IDEMSCRAPE_* variable nothing reads (a misspelt
// name is otherwise silently ignored), naming the closest known one. Only names are
// logged, never values. A warning, not a refusal: a -providers file may name variables
// of its own, and other binaries may read variables this list does not know yet.
func warnUnknownEnv(c config, log *slog.Logger) {
	for _, u := range c.unknownEnv {
		attrs := []any{"variable", u.Name, "did_you_mean", u.Closest}
		if c.providersFile != "" {
			attrs = append(attrs, "unless", "the -providers file names it")
		}
		log.Warn("environment variable not read by the worker: ignored", attrs...)
	}
}

// collectorConfig is the step that sets up the sessions' collector from the flags,
// warning when loopback destinations are allowed.
func (c *config) collectorConfig(log *slog.Logger) sessions.CollectorConfig {
	collector := sessions.CollectorConfig{RequestTimeout: c.requestTimeout, IgnoreRobotsTxt: c.ignoreRobots}
	if c.allowLoopback {
		collector.Guard = sessions.LoopbackGuard()
		log.Warn("loopback destinations allowed (-allow-loopback): for demos and tests only")
	}
	return collector
}

// sessionPool is the runner's session pool configuration: nil with -no-session-pool.
func (c config) sessionPool() *sessions.PoolConfig {
	if c.noSessionPool {
		return nil
	}
	return &sessions.PoolConfig{MaxUnits: c.poolMaxUnits, MinRemaining: c.poolMinRemaining}
}

// newRegistry is the step that builds the runner's registry on the opened services.
func newRegistry(c config, set settings, collector sessions.CollectorConfig, committer handlers.Committer,
	pool *pgxpool.Pool, rdb redis.UniversalClient, log *slog.Logger) (*handlers.Registry, error) {
	return handlers.NewRegistry(handlers.Config{
		Store: store.New(pool), Redis: rdb, Providers: set.providers, Committer: committer,
		KeyPrefix: c.keyPrefix, WorkerID: c.workerID, Collector: collector,
		MaxSessionRestarts: c.maxSessionRestart,
		MaxResumes:         c.maxResumes,
		SessionPool:        c.sessionPool(),
		LeaseLengths: &handlers.LeaseLengthConfig{
			Default: c.leaseDefault, Min: c.leaseMin, Max: c.leaseMax, Margin: c.leaseMargin,
		},
		Logger: log,
	})
}

// queuesOf is the step that picks the asynq queues: -queues, or one per kind, weight 1.
func queuesOf(c config, kinds []string) map[string]int {
	queues, _ := parseQueues(c.queues)
	if queues == nil {
		queues = map[string]int{}
		for _, k := range kinds {
			queues[k] = 1
		}
	}
	return queues
}

// newService is the step that builds the service (asynq server, dispatcher, HTTP server)
// around the registry.
func newService(c config, set settings, queues map[string]int, reg *handlers.Registry,
	pool *pgxpool.Pool, rdb redis.UniversalClient, log *slog.Logger) (*service.Service, error) {
	return service.New(service.Config{
		Registry:           reg,
		Store:              store.New(pool),
		Redis:              rdb,
		RedisConnOpt:       c.redisCfg.AsynqConnOpt(),
		Queues:             queues,
		Concurrency:        c.concurrency,
		ShutdownTimeout:    c.shutdownTimeout,
		DrainTimeout:       c.drainTimeout,
		NoDispatcher:       c.noDispatcher,
		Dispatcher:         c.dispatcherConfig(set.fp.afterPublish()),
		HTTPAddr:           c.httpAddr,
		AllowedHosts:       c.allowedHosts,
		MonitoringReadOnly: c.readOnly, //nolint:staticcheck // the deprecated -read-only flag keeps working
		MonitoringWritable: c.writable,
		HTTPInsecure:       c.httpInsecure,
		BasicAuth:          set.auth,
		WindowBudgets:      c.windowBudgets(),
		Logger:             log,
	})
}

// windowBudgets is the example kind's money budget per window (-window-budget), for the
// job pages and /windows (spend against budget, deferred jobs).
func (c config) windowBudgets() map[string]store.Cost {
	if c.windowMoney == 0 {
		return nil
	}
	return map[string]store.Cost{catalog.Kind: {Micros: c.windowMoney, Currency: c.windowCurrency}}
}

// logStart is the step that logs the start-up line: what the worker serves and with what.
func logStart(log *slog.Logger, c config, set settings, tracing bool, kinds []string, queues map[string]int) {
	names := make([]string, 0, len(queues))
	for q := range queues {
		names = append(names, q)
	}
	sort.Strings(names)
	var proxies []string
	for _, p := range set.providers {
		proxies = append(proxies, p.Name()+" "+p.Gateway()+" ("+string(p.Tier())+", "+p.Price().String()+")")
	}
	proxiesFrom := "environment"
	if c.providersFile != "" {
		proxiesFrom = c.providersFile
	}
	log.Info("worker starting", "tracing", tracing, "kinds", kinds, "queues", names, "redis", c.redisCfg.String(), "proxies", proxies, "proxies_from", proxiesFrom,
		"stream_trim", c.streamTrimPolicy, "stream_max_len", streamMaxLenText(c), "window_budget", windowBudgetText(c))
}

// windowBudgetText is -window-budget as the start-up log line shows it.
func windowBudgetText(c config) string {
	if c.windowMoney == 0 {
		return "none"
	}
	return c.windowBudget + " per window, then " + c.windowAction
}
