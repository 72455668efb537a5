// Command chaos runs idemscrape's real binaries under faults and checks that its promise
// held: every job taken exactly once in effect, whatever was killed, paused or wiped.
//
//	go run ./cmd/chaos            # the full mix (make chaos)
//	go run ./cmd/chaos -short     # the CI mix, a few minutes on a 2-core box (make chaos-short)
//
// It builds cmd/worker and cmd/scheduler with go build, then runs, as child processes, N
// workers (each with its outbox dispatcher) and the reconciler (cmd/scheduler
// -no-scheduler), plus in-process a stream consumer in inbox mode (outbox.Consumer.RunTx)
// whose side effect is one row per event in a table without a unique constraint. Everything
// runs against testutil's fake shop (StrictExit: a cookie and price token only work from the
// exit that got them) and fake residential proxy, on a throwaway redis-server of its own and
// a database of its own on the PostgreSQL server of $IDEMSCRAPE_TEST_PG (default
// postgres://postgres@127.0.0.1:5432/postgres), named idemscrape_chaos_<random>, marked with
// a comment and dropped at the end only if it carries that mark (-keep-db keeps it).
//
// A fault-free baseline runs first (-baseline jobs), then the same SKUs again with the proxy
// fault mix alone (-fault-mix-jobs), for bytes per completed job against the fault-free
// run of the same jobs; then the chaos phase enqueues -jobs jobs and injects, at points spread over its progress: random SIGKILLs of workers, kills
// at the worker's failpoints (after the fetch, after the commit before the ack, between
// its XADDs and moving its position; see cmd/worker), SIGSTOP pauses of 2.5 leases, a redis-server killed
// and restarted empty, pg_terminate_backend rounds on the workers' connections, and the
// proxy fault mix (10 % disconnects per request, ~5 % 429 with Retry-After, 2 % of jobs in
// a country the proxy has no exit in). Killed workers are restarted, as a process manager
// would. The proxy password is a canary searched for at the end in every log, a pg_dump,
// every Redis key and value, the stream and /metrics.
//
// A stale commit (-before-commit) stops a worker after its last lease check, just before
// its commit statement. The first one of a run, and every other one after it, is continued
// while another attempt holds its job running under a higher fence (that attempt held at
// its first request to the shop meanwhile, by a relay between the proxy and the shop), the
// case only the commit's fence predicate refuses; the others once the job was taken over
// or, with -stale-wait, once another worker finished it. Each commit then reaches
// PostgreSQL, and "PostgreSQL refused ≥ k stale commits" checks that every one was refused.
// Only a refusal counts as one: a stale commit that ended in error (a pg_terminate_backend
// round, or -cut-stale, cut its connection) reached no verdict, and another is armed in its
// place until one does.
//
// At the end it prints what it injected and, per invariant, what it observed, PASS or
// FAIL and the first offending job keys, and exits 1 if any invariant failed, 4 if the run
// is INCOMPLETE (it reached -timeout with jobs still open, or a targeted fault never fired:
// nothing was violated, but not everything was shown), 2 on a bad flag, 3 if the run itself
// could not be carried out.
//
// -build-tags chaos_nofence[,chaos_nounique] builds the workers without the commit's fence
// and state check (and with results that bypass the unique index), -build-tags
// chaos_nofencepred with the state check alone: the harness must fail naming "0 stale
// commits accepted" (and "0 duplicate results"); see TestChaosCatchesMissingFence.
//
// -break dup_result:P runs the workers as a deliberately broken build (a second result row
// per job with probability P) to show that the harness fails and names the invariant.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/idemscrape/idemscrape/testutil"
)

// Config is one chaos scenario. Every count is a number of injections.
type Config struct {
	// Jobs in the chaos phase. Defaults to nothing: required >= 1.
	Jobs int
	// Baseline jobs run first without faults, for bytes per job. 0: no baseline.
	Baseline int
	// FaultMixJobs run after the baseline with the proxy fault mix alone (no kill, pause,
	// wipe or dropped connection): the same SKUs as the baseline's first FaultMixJobs, so
	// that bytes per completed job compare the same jobs with and without the fault mix.
	// 0 (or no baseline, or ProxyFaults off): no such phase.
	FaultMixJobs int
	// Workers processes, each running Concurrency jobs at once.
	Workers, Concurrency int
	// Lease is every job's lease length (the workers' -lease-min/-max/-default) and the
	// reconciler's max_lease; pauses last 2.5 of it.
	Lease time.Duration
	// RandomKills are SIGKILLs of a random worker.
	RandomKills int
	// AfterFetch, AfterCommit and AfterXadd are how many kills of each failpoint are
	// wanted: a worker starts with a point enabled while fewer have fired.
	AfterFetch, AfterCommit, AfterXadd int
	// ArmAtStart arms every targeted failpoint kill before the chaos phase's workers start
	// (each worker starts with one point armed; a restart takes the next), instead of
	// spreading the arms over the run's progress: for runs so small that a spread arm could
	// come after the last job. Defaults to false.
	ArmAtStart bool
	// BeforeCommit are stale commits: a worker stops itself (SIGSTOP) after its last lease
	// check, just before its commit statement (cmd/worker's before_commit failpoint). The
	// harness continues the first one, and every other one after it, while another attempt
	// holds the job running under a higher fence (that attempt held at the shop until the
	// stale commit returned), and the others once the job was taken over (its fence
	// raised), so that the stale commit reaches PostgreSQL, whose fence must refuse it.
	BeforeCommit int
	// StaleWait keeps a worker stopped at before_commit, of the firings not continued
	// while another attempt runs the job, until another worker finished its job, for at
	// most this long, so that the stale commit comes after a newer one (the case that
	// writes a second result when the unique index is bypassed). asynq hands a stopped
	// worker's task to another only after its 30 s lease and a recoverer sweep, so this
	// takes one to two minutes. Defaults to 0: continued once taken over.
	StaleWait time.Duration
	// CutStale cuts the first CutStale stale commits on their way: the harness holds the
	// job's row lock when it continues the worker, and once the commit statement waits on
	// that lock it ends the statement's connection (pg_terminate_backend), as a
	// pg_terminate_backend round that meets a stale commit does. A stale commit that ended
	// in error reached no verdict: it counts as neither refused nor accepted, and the
	// harness arms another before_commit in its place (the same round), until one does.
	// Defaults to 0.
	CutStale int
	// BuildTags builds the workers as a deliberately broken build: "chaos_nofence" (the
	// commit checks neither the job's fence nor its state), "chaos_nofencepred" (the commit
	// checks the state alone), "chaos_nounique" (results bypass the unique index), or one
	// of the first two with the third, comma-separated. Defaults to none (the shipped
	// build).
	BuildTags string
	// Pauses are SIGSTOP/SIGCONT of a random worker for 2.5 × Lease.
	Pauses int
	// RedisWipes kill the redis-server and start it again without data.
	RedisWipes int
	// PGRounds of pg_terminate_backend on the workers' connections.
	PGRounds int
	// ProxyFaults turns the proxy and shop fault mix on.
	ProxyFaults bool
	// DisconnectProb is the probability that a request through the proxy is cut mid-response
	// when ProxyFaults is on. Defaults to 0.10 (per request: a three-request unit is cut
	// with probability 1 − 0.9³ ≈ 27 %; 0.0345 cuts 10 % of units).
	DisconnectProb float64
	// CutExitAlive is the fraction of those cuts that drop the connection only and leave
	// the session's exit alive under its session id (testutil.FakeProxyConfig.CutExitAlive);
	// the others lose the exit (the session id is dead). Defaults to 0: every cut loses
	// the exit, the model of the runs before resumes.
	CutExitAlive float64
	// ReplayFloor runs the fault-mix SKUs once more after the fault-mix phase, with the
	// same fault mix, on workers that never resume a unit on its session (-max-resumes -1):
	// every cut replays from the first step on another session. Its bytes at the wire are the
	// replay rule's floor, measured in the same run, that the fault mix's resumes are
	// compared with. Needs FaultMixJobs.
	ReplayFloor bool
	// Canary makes the proxy password a canary searched for at the end.
	Canary bool
	// Challenge puts the shop's bot challenge in front of its pages
	// (testutil.FakeSiteConfig.Challenge: a new exit's first request gets a challenge page
	// whose clearance cookie is bound to the exit): the workers' session pools (on by
	// default) then carry clearance between units, through the kills, pauses and cuts.
	// Defaults to off (the figures of earlier runs were taken without it).
	Challenge bool
	// StrictEvents fails the run when events that were in the stream, unconsumed, when
	// Redis lost its data never took effect. On by default; off, they are reported as GAP
	// without failing the run.
	StrictEvents bool
	// Break is a worker failpoint that breaks a guarantee, e.g. "dup_result:0.1".
	Break string
	// Seed of the fake shop, the fake proxy and the harness's choices.
	Seed int64
	// Timeout bounds the whole run once cmd/worker and cmd/scheduler are built. A run that
	// reaches it with jobs still open, or with a targeted fault that never fired, is
	// INCOMPLETE (exit 4), not a broken invariant.
	Timeout time.Duration
	// LogDir keeps the processes' logs there. Defaults to a temporary directory.
	LogDir string
	// KeepDB keeps the database after the run.
	KeepDB bool
	// Verbose prints progress.
	Verbose bool
}

// Validate reports the first invalid field.
func (c *Config) Validate() error {
	switch {
	case c.Jobs < 1:
		return fmt.Errorf("-jobs %d must be >= 1", c.Jobs)
	case c.Workers < 1 || c.Concurrency < 1:
		return fmt.Errorf("-workers %d and -concurrency %d must be >= 1", c.Workers, c.Concurrency)
	case c.Lease < time.Second:
		return fmt.Errorf("-lease %v must be >= 1s", c.Lease)
	case c.Baseline < 0 || c.FaultMixJobs < 0 || c.RandomKills < 0 || c.AfterFetch < 0 || c.AfterCommit < 0 || c.AfterXadd < 0 ||
		c.BeforeCommit < 0 || c.Pauses < 0 || c.RedisWipes < 0 || c.PGRounds < 0 || c.CutStale < 0:
		return errors.New("counts must not be negative")
	case c.StaleWait < 0:
		return fmt.Errorf("-stale-wait %v must not be negative", c.StaleWait)
	case c.DisconnectProb < 0 || c.DisconnectProb >= 1:
		return fmt.Errorf("-disconnect-prob %v must be in [0, 1)", c.DisconnectProb)
	case c.CutExitAlive < 0 || c.CutExitAlive > 1:
		return fmt.Errorf("-cut-exit-alive %v must be in [0, 1]", c.CutExitAlive)
	case c.Timeout <= 0:
		return fmt.Errorf("-timeout %v must be positive", c.Timeout)
	case c.Break != "" && !strings.HasPrefix(c.Break, fpDupResult+":"):
		return fmt.Errorf("-break %q: the only broken build is %s:<probability>", c.Break, fpDupResult)
	case c.CutStale > 0 && c.BeforeCommit == 0:
		return fmt.Errorf("-cut-stale %d needs -before-commit >= 1 (it cuts stale commits)", c.CutStale)
	case c.BeforeCommit > 0 && c.Workers < 2:
		return fmt.Errorf("-before-commit %d needs -workers >= 2 (another worker takes the stopped one's job over)", c.BeforeCommit)
	}
	if c.BuildTags != "" {
		tags := strings.Split(c.BuildTags, ",")
		for _, t := range tags {
			if t != tagNoFence && t != tagNoFencePred && t != tagNoUnique {
				return fmt.Errorf("-build-tags %q: %q is not a broken build (known: %s, %s, %s)", c.BuildTags, t, tagNoFence, tagNoFencePred, tagNoUnique)
			}
		}
		if slices.Contains(tags, tagNoFence) && slices.Contains(tags, tagNoFencePred) {
			return fmt.Errorf("-build-tags %q: %s and %s are two versions of the same commit: pick one", c.BuildTags, tagNoFence, tagNoFencePred)
		}
	}
	return nil
}

// exitIncomplete is the exit status of a run that violated nothing but did not finish
// what it set out to show (see Report.Incomplete).
const exitIncomplete = 4

// Full is the full mix of issue 13 (make chaos).
func Full() Config {
	return Config{Jobs: 10000, Baseline: 1000, FaultMixJobs: 1000, Workers: 3, Concurrency: 10, Lease: 3 * time.Second,
		RandomKills: 20, AfterFetch: 10, AfterCommit: 10, AfterXadd: 100, BeforeCommit: 5, StaleWait: 150 * time.Second, Pauses: 5, RedisWipes: 1, PGRounds: 30,
		ProxyFaults: true, DisconnectProb: 0.10, ReplayFloor: true, Canary: true, StrictEvents: true, Seed: 1, Timeout: 45 * time.Minute}
}

// Short is the CI mix (make chaos-short): every kind of fault, fewer of each, sized to
// finish on a loaded 2-core box (a few minutes idle); its bound is generous because a
// run that reaches it is INCOMPLETE, which fails CI as surely as a broken invariant.
func Short() Config {
	return Config{Jobs: 600, Baseline: 150, FaultMixJobs: 150, Workers: 3, Concurrency: 10, Lease: 3 * time.Second,
		RandomKills: 4, AfterFetch: 2, AfterCommit: 2, AfterXadd: 5, BeforeCommit: 2, Pauses: 2, RedisWipes: 1, PGRounds: 5,
		ProxyFaults: true, DisconnectProb: 0.10, ReplayFloor: true, Canary: true, StrictEvents: true, Seed: 1, Timeout: 15 * time.Minute}
}

func parseFlags(args []string, stderr io.Writer) (Config, error) {
	fs := flag.NewFlagSet("chaos", flag.ContinueOnError)
	fs.SetOutput(stderr)
	short := fs.Bool("short", false, "the CI mix (fewer jobs and faults) instead of the full one")
	var f Config
	fs.IntVar(&f.Jobs, "jobs", -1, "jobs in the chaos phase")
	fs.IntVar(&f.Baseline, "baseline", -1, "jobs of the fault-free baseline run first (0: none)")
	fs.IntVar(&f.FaultMixJobs, "fault-mix-jobs", -1, "jobs (the baseline's SKUs) run with the proxy fault mix alone, for bytes per job (0: none)")
	fs.IntVar(&f.Workers, "workers", -1, "worker processes")
	fs.IntVar(&f.Concurrency, "concurrency", -1, "jobs each worker runs at once")
	fs.DurationVar(&f.Lease, "lease", -1, "lease length of every job")
	fs.IntVar(&f.RandomKills, "kills", -1, "random SIGKILLs of workers")
	fs.IntVar(&f.AfterFetch, "after-fetch", -1, "kills at the after_fetch failpoint")
	fs.IntVar(&f.AfterCommit, "after-commit", -1, "kills at the after_commit failpoint (after the commit, before the ack)")
	fs.IntVar(&f.AfterXadd, "after-xadd", -1, "dispatcher kills between its XADDs and moving its position")
	fs.IntVar(&f.BeforeCommit, "before-commit", -1, "stale commits: a worker stopped just before its commit statement until another attempt runs its job (the 1st, 3rd, …) or it is taken over")
	fs.DurationVar(&f.StaleWait, "stale-wait", -1, "keep a worker stopped before its commit (the 2nd, 4th, …) until another finished the job, at most this long (0: until taken over)")
	fs.IntVar(&f.CutStale, "cut-stale", -1, "cut the first N stale commits on their way (pg_terminate_backend while they wait on the job's row lock); each is armed again")
	fs.StringVar(&f.BuildTags, "build-tags", "", "build the workers BROKEN: chaos_nofence or chaos_nofencepred, chaos_nounique (comma-separated)")
	fs.IntVar(&f.Pauses, "pauses", -1, "SIGSTOP pauses of 2.5 leases")
	fs.IntVar(&f.RedisWipes, "redis-wipes", -1, "redis-server kills and empty restarts")
	fs.IntVar(&f.PGRounds, "pg-terminate", -1, "pg_terminate_backend rounds on the workers' connections")
	proxy := fs.String("proxy-faults", "", "proxy and shop fault mix: true or false (default on)")
	fs.Float64Var(&f.DisconnectProb, "disconnect-prob", -1, "probability that a request through the proxy is cut mid-response, with the fault mix (default 0.10)")
	fs.Float64Var(&f.CutExitAlive, "cut-exit-alive", 0, "fraction of the cuts that drop the connection only, the session's exit alive (0: every cut loses the exit)")
	floor := fs.String("replay-floor", "", "after the fault mix, its SKUs again on workers that never resume (every cut replays): the replay rule's floor; true or false (default on)")
	canary := fs.String("canary", "", "canary proxy password search: true or false (default on)")
	challenge := fs.String("challenge", "", "the shop's bot challenge (a clearance cookie per exit; the workers' session pools carry it): true or false (default off)")
	fs.StringVar(&f.Break, "break", "", "run a deliberately broken build: dup_result:<probability>")
	fs.Int64Var(&f.Seed, "seed", -1, "seed of the fakes and of the harness's choices")
	fs.DurationVar(&f.Timeout, "timeout", -1, "bound of the whole run once the binaries are built")
	fs.StringVar(&f.LogDir, "log-dir", "", "keep the processes' logs in this directory")
	fs.BoolVar(&f.KeepDB, "keep-db", false, "keep the run's database")
	fs.BoolVar(&f.StrictEvents, "strict-events", true, "FAIL when events in the stream when Redis lost its data never took effect (-strict-events=false reports them as GAP instead)")
	fs.BoolVar(&f.Verbose, "v", false, "print progress")
	if err := fs.Parse(args); err != nil {
		return Config{}, err
	}
	if fs.NArg() > 0 {
		return Config{}, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	c := Full()
	if *short {
		c = Short()
	}
	setInt := func(dst *int, v int) {
		if v >= 0 {
			*dst = v
		}
	}
	setInt(&c.Jobs, f.Jobs)
	setInt(&c.Baseline, f.Baseline)
	setInt(&c.FaultMixJobs, f.FaultMixJobs)
	setInt(&c.Workers, f.Workers)
	setInt(&c.Concurrency, f.Concurrency)
	setInt(&c.RandomKills, f.RandomKills)
	setInt(&c.AfterFetch, f.AfterFetch)
	setInt(&c.AfterCommit, f.AfterCommit)
	setInt(&c.AfterXadd, f.AfterXadd)
	setInt(&c.BeforeCommit, f.BeforeCommit)
	setInt(&c.Pauses, f.Pauses)
	setInt(&c.RedisWipes, f.RedisWipes)
	setInt(&c.PGRounds, f.PGRounds)
	setInt(&c.CutStale, f.CutStale)
	if f.Lease >= 0 {
		c.Lease = f.Lease
	}
	if f.Timeout >= 0 {
		c.Timeout = f.Timeout
	}
	if f.StaleWait >= 0 {
		c.StaleWait = f.StaleWait
	}
	if f.DisconnectProb >= 0 {
		c.DisconnectProb = f.DisconnectProb
	}
	if f.Seed >= 0 {
		c.Seed = f.Seed
	}
	for _, b := range []struct {
		flag, s string
		dst     *bool
	}{{"proxy-faults", *proxy, &c.ProxyFaults}, {"canary", *canary, &c.Canary}, {"replay-floor", *floor, &c.ReplayFloor}, {"challenge", *challenge, &c.Challenge}} {
		switch b.s {
		case "":
		case "true", "on", "1":
			*b.dst = true
		case "false", "off", "0":
			*b.dst = false
		default:
			return Config{}, fmt.Errorf("-%s %q: want true or false", b.flag, b.s)
		}
	}
	c.CutExitAlive = f.CutExitAlive
	c.Break, c.BuildTags, c.LogDir, c.KeepDB, c.Verbose, c.StrictEvents = f.Break, f.BuildTags, f.LogDir, f.KeepDB, f.Verbose, f.StrictEvents
	return c, c.Validate()
}

func main() {
	cfg, err := parseFlags(os.Args[1:], os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	os.Exit(runMain(ctx, cfg, os.Stdout))
}

// runMain runs the harness with its own testing.TB adapter and returns the exit code.
func runMain(ctx context.Context, cfg Config, out io.Writer) (code int) {
	tb, err := testutil.NewProcessTB("chaos")
	if err != nil {
		fmt.Fprintln(out, "chaos:", err)
		return 3
	}
	defer tb.Close()
	defer func() {
		if r := recover(); r != nil {
			fe, ok := r.(testutil.FatalError)
			if !ok {
				panic(r)
			}
			fmt.Fprintln(out, "chaos:", fe.Msg)
			code = 3
		}
	}()
	rep, err := run(ctx, cfg, tb, out)
	if err != nil {
		fmt.Fprintln(out, "chaos: the run could not be carried out:", err)
		return 3
	}
	rep.Print(out)
	switch {
	case len(rep.Failed()) > 0:
		return 1
	case len(rep.Incomplete) > 0:
		return exitIncomplete
	}
	return 0
}
