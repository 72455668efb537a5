package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/outbox"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// Names shared with the worker binary (cmd/worker/failpoints.go).
const (
	envFailpoints  = "IDEMSCRAPE_FAILPOINTS"
	envRetryScale  = "IDEMSCRAPE_CHAOS_RETRY_SCALE"
	failpointLine  = "FAILPOINT"
	fpAfterFetch   = "after_fetch"
	fpAfterCommit  = "after_commit"
	fpAfterXadd    = "after_xadd"
	fpBeforeCommit = "before_commit"
	fpDupResult    = "dup_result"
	tagNoFence     = "chaos_nofence"     // store/commit_nofence.go: neither fence nor state checked
	tagNoFencePred = "chaos_nofencepred" // store/commit_nofencepred.go: state checked, fence not
	tagNoUnique    = "chaos_nounique"    // store/commit_nounique.go
	// takeoverWait bounds how long a worker stopped at before_commit stays stopped when
	// nobody takes its job over (the reconciler rescues it within about two leases).
	takeoverWait = 60 * time.Second
	// extraRounds bounds the rounds of extra jobs enqueued when the chaos phase's jobs
	// were all done before every targeted failpoint fired; each round is Workers ×
	// Concurrency jobs.
	extraRounds = 5
	// staleRearms bounds the before_commit firings armed again, beyond the -cut-stale
	// ones, in place of stale commits that ended in error (see staleSent).
	staleRearms    = 3
	dbMarker       = "idemscrape-chaos-harness"
	sideEffectsDDL = `CREATE TABLE chaos_side_effects (
	id         bigserial   PRIMARY KEY,
	event_key  text        NOT NULL, -- deliberately NOT unique: duplicates must be countable
	job_key    text        NOT NULL,
	stream_id  text        NOT NULL,
	outbox_id  bigint      NOT NULL,
	applied_at timestamptz NOT NULL DEFAULT now()
)`
	consumerGroup  = "chaos-side-effects"
	proxyUser      = "chaosacct"
	unavailableCC  = "DE"
	windowBaseline = "2026-12-01"
	windowFaultMix = "2026-12-01-faultmix"
	windowFloor    = "2026-12-01-replayfloor"
	windowChaos    = "2026-12-02"
)

// slot is one worker position: a worker process, restarted after every death until the
// harness stops.
type slot struct {
	h    *harness
	i    int
	port int

	mu          sync.Mutex
	gen         int
	cmd         *exec.Cmd
	id          string // worker id of the current generation
	alive       bool
	paused      bool
	harnessKill bool   // the harness SIGKILLed the current generation
	armed       string // the failpoint this generation runs with at probability 1, or ""
	fired       bool   // this generation wrote a FAILPOINT line
	armDone     bool   // the arm fired without ending the process (before_commit): no longer counted in armedNow
	staleSent   bool   // armed with before_commit and the worker reported its stale commit's outcome
	done        chan struct{}
}

// killable reports whether a random kill or pause may pick the slot: it runs, is not
// stopped, and is not armed with before_commit short of having reported its stale commit
// (stopped at the failpoint, continued and committing, or about to stop: a kill there
// loses the one stale commit the run is to judge).
func (s *slot) killable() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.alive && !s.paused && !(s.armed == fpBeforeCommit && !s.staleSent)
}

// harness is one chaos run.
type harness struct {
	cfg  Config
	tb   testing.TB
	out  io.Writer
	bins string
	logs string

	redis *testutil.RedisServer
	site  *testutil.FakeSite
	front *siteFront // between the proxy and the shop in the chaos phase (holds a stale job's SKU)
	proxy *testutil.FakeProxy

	dbName   string
	dsn      string
	pool     *pgxpool.Pool
	st       *store.PG
	password string

	phase    atomic.Value // string: "setup" or a phase (phaseBaseline, phaseFaultMix, phaseChaos)
	stopping atomic.Bool
	slots    []*slot
	wg       sync.WaitGroup

	mu           sync.Mutex
	fpKills      map[string]int      // failpoint firings seen, by name
	pendingArms  map[string]int      // failpoint kills scheduled, not yet armed in a worker
	armedNow     int                 // worker generations running with an armed failpoint
	fpKeys       map[string][]string // job keys / outbox ids of the firings
	randomKills  int
	execKills    int // random kills that held at least one running attempt
	pauses       int
	pausesHeld   int
	pausedAtt    []pausedAttempt // running attempts of the paused workers, at SIGSTOP
	stale        []*staleCommit  // before_commit firings
	staleRounds  int             // firings whose round staleRunningRound chose
	staleRedo    []bool          // rounds (WhileRunning) of stale commits that ended in error, for the firings armed in their place
	staleArmed   int             // before_commit firings armed again in place of one that ended in error
	staleCut     int             // stale commits the harness cut (Config.CutStale)
	staleWG      sync.WaitGroup  // resumeStale goroutines
	runCtx       context.Context
	extraJobs    int // jobs enqueued beyond cfg.Jobs so that every targeted failpoint fired
	redisWipes   int
	lastWipe     time.Time // PostgreSQL's clock
	pgRounds     int
	pgTerminated int
	throttled    int
	restarts     int
	metricsText  []string
	phaseMetrics map[string][]string // phase → the /metrics pages scraped at its end
	rng          *rand.Rand
	rngMu        sync.Mutex
	log          *slog.Logger
	logFile      *os.File
	enqueued     map[string][]string // window → keys
	baselineJobs int
	baseBytes    int64 // sum of bytes_total of the baseline's complete jobs
	baseProxy    int64 // proxy bytes of the baseline
	mixJobs      int   // jobs of the fault-mix phase
	mixProxy     int64 // proxy bytes of the fault-mix phase
	baseWire     int64 // bytes the proxy exchanged with its clients in the baseline (ClientBytes, both ways)
	mixWire      int64 // the same in the fault-mix phase
	floorJobs    int   // jobs of the replay-floor phase
	floorWire    int64 // the same in the replay-floor phase
	floorProxy   int64 // proxy bytes of the replay-floor phase
	chaosProxy0  int64 // proxy bytes when the chaos phase began
	chaosProxy   int64
	timedOut     bool
	wall         time.Duration
}

func (h *harness) logf(format string, args ...any) {
	if h.cfg.Verbose {
		fmt.Fprintf(h.out, "chaos: "+format+"\n", args...)
	}
	h.log.Info(fmt.Sprintf(format, args...))
}

func (h *harness) intn(n int) int {
	h.rngMu.Lock()
	defer h.rngMu.Unlock()
	return h.rng.IntN(n)
}

// build compiles the worker and scheduler commands into a temporary directory.
func (h *harness) build(ctx context.Context) error {
	gomod, err := exec.CommandContext(ctx, "go", "env", "GOMOD").Output()
	if err != nil {
		return fmt.Errorf("go env GOMOD: %w", err)
	}
	root := filepath.Dir(strings.TrimSpace(string(gomod)))
	for _, name := range []string{"worker", "scheduler"} {
		args := []string{"build", "-o", filepath.Join(h.bins, name)}
		if h.cfg.BuildTags != "" {
			args = append(args, "-tags", h.cfg.BuildTags)
		}
		cmd := exec.CommandContext(ctx, "go", append(args, "./cmd/"+name)...)
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("go build ./cmd/%s: %w: %s", name, err, out)
		}
	}
	return nil
}

// createDB creates the harness's own database on the shared server, marked as the
// harness's with a comment, and migrates it.
func (h *harness) createDB(ctx context.Context) error {
	admin, err := pgx.Connect(ctx, testutil.PGAdminDSN())
	if err != nil {
		return fmt.Errorf("postgres: %w", err)
	}
	defer admin.Close(ctx)
	h.dbName = "idemscrape_chaos_" + testutil.RandomID(6)
	if _, err := admin.Exec(ctx, `CREATE DATABASE `+pgx.Identifier{h.dbName}.Sanitize()); err != nil {
		return fmt.Errorf("create database %s: %w", h.dbName, err)
	}
	if _, err := admin.Exec(ctx, `COMMENT ON DATABASE `+pgx.Identifier{h.dbName}.Sanitize()+` IS '`+dbMarker+`'`); err != nil {
		return fmt.Errorf("mark database %s: %w", h.dbName, err)
	}
	h.tb.Cleanup(func() { h.dropDB() })
	u, err := url.Parse(testutil.PGAdminDSN())
	if err != nil {
		return fmt.Errorf("admin DSN: %w", err)
	}
	u.Path = "/" + h.dbName
	h.dsn = u.String()
	h.pool, err = pgxpool.New(ctx, h.withApp("chaos-harness"))
	if err != nil {
		return err
	}
	h.tb.Cleanup(h.pool.Close)
	if _, err := store.Migrate(ctx, h.pool, nil); err != nil {
		return err
	}
	if _, err := h.pool.Exec(ctx, sideEffectsDDL); err != nil {
		return fmt.Errorf("side-effect table: %w", err)
	}
	h.st = store.New(h.pool)
	return nil
}

// withApp returns the database URL with an application_name, by which
// pg_terminate_backend rounds pick the workers' connections.
func (h *harness) withApp(app string) string {
	u, _ := url.Parse(h.dsn)
	q := u.Query()
	q.Set("application_name", app)
	u.RawQuery = q.Encode()
	return u.String()
}

// dropDB drops the database only if it carries the harness's marker.
func (h *harness) dropDB() {
	if h.cfg.KeepDB || h.dbName == "" {
		if h.dbName != "" {
			fmt.Fprintf(h.out, "chaos: kept database %s\n", h.dbName)
		}
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	admin, err := pgx.Connect(ctx, testutil.PGAdminDSN())
	if err != nil {
		return
	}
	defer admin.Close(ctx)
	var marker *string
	if err := admin.QueryRow(ctx, `SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = $1`, h.dbName).Scan(&marker); err != nil || marker == nil || *marker != dbMarker {
		fmt.Fprintf(h.out, "chaos: database %s does not carry the harness's marker; not dropped\n", h.dbName)
		return
	}
	if _, err := admin.Exec(ctx, `DROP DATABASE `+pgx.Identifier{h.dbName}.Sanitize()+` WITH (FORCE)`); err != nil {
		fmt.Fprintf(h.out, "chaos: drop database %s: %v\n", h.dbName, err)
	}
}

// workerEnv is the environment of a worker process: the parent's without any IDEMSCRAPE_
// variable, then the harness's own.
func (h *harness) workerEnv(fp string) []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "IDEMSCRAPE_") {
			env = append(env, kv)
		}
	}
	env = append(env,
		"IDEMSCRAPE_PG="+h.withApp("chaos-worker"), "IDEMSCRAPE_REDIS="+h.redis.Addr,
		"IDEMSCRAPE_PROXY_PROVIDER=oxylabs", "IDEMSCRAPE_PROXY_USER="+proxyUser,
		"IDEMSCRAPE_PROXY_PASSWORD="+h.password, "IDEMSCRAPE_PROXY_GATEWAY="+h.proxy.Addr,
		// The shop names the exit it saw on every response (the provider's exit header, as
		// far as the workers can tell): exit integrity, and the proof that lets a unit
		// continue on its session after a cut.
		"IDEMSCRAPE_PROXY_EXIT_HEADER=X-Exit",
		envRetryScale+"=0.02",
	)
	if fp != "" {
		env = append(env, envFailpoints+"="+fp)
	}
	return env
}

// takeArm returns the failpoint a worker starting now is armed with (at probability 1,
// so that it fires on the first job, batch or commit that reaches it and the process dies),
// or "" when no targeted kill is pending.
func (h *harness) takeArm() string {
	if h.phase.Load() != phaseChaos {
		return ""
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	best := ""
	for _, name := range []string{fpAfterFetch, fpAfterCommit, fpAfterXadd, fpBeforeCommit} {
		if h.pendingArms[name] > 0 && (best == "" || h.pendingArms[name] > h.pendingArms[best]) {
			best = name
		}
	}
	if best != "" {
		h.pendingArms[best]--
		h.armedNow++
	}
	return best
}

// arm schedules one targeted failpoint kill. If no worker is armed, one worker is stopped
// gracefully (SIGTERM) so that its restart takes the arm; an armed worker that dies takes
// the next pending arm on its own restart.
func (h *harness) arm(ctx context.Context, name string) {
	h.mu.Lock()
	h.pendingArms[name]++
	idle := h.armedNow == 0
	h.mu.Unlock()
	if !idle {
		return
	}
	if s := h.pick(ctx); s != nil {
		s.mu.Lock()
		if s.alive && s.cmd != nil {
			_ = s.cmd.Process.Signal(syscall.SIGTERM)
		}
		s.mu.Unlock()
	}
}

// failpointsFor is the IDEMSCRAPE_FAILPOINTS value of a worker armed with armed.
func (h *harness) failpointsFor(armed string) string {
	var parts []string
	if armed != "" {
		parts = append(parts, armed+":1")
	}
	if h.cfg.Break != "" && h.phase.Load() == phaseChaos {
		parts = append(parts, h.cfg.Break)
	}
	return strings.Join(parts, ",")
}

// start starts the slot's next generation.
func (s *slot) start() error {
	h := s.h
	s.mu.Lock()
	defer s.mu.Unlock()
	s.gen++
	s.id = fmt.Sprintf("chaos-w%d.g%d", s.i, s.gen)
	base := h.site.URL
	if h.phase.Load() == phaseChaos {
		base = h.front.URL
	}
	args := []string{
		"-http", fmt.Sprintf("127.0.0.1:%d", s.port), "-catalog-base", base, "-allow-loopback",
		"-concurrency", strconv.Itoa(h.cfg.Concurrency), "-worker-id", s.id, "-log-format", "json",
		"-lease-default", h.cfg.Lease.String(), "-lease-min", h.cfg.Lease.String(), "-lease-max", h.cfg.Lease.String(),
		"-shutdown-timeout", "3s", "-drain-timeout", "10s", "-request-timeout", "10s",
	}
	if h.phase.Load() == phaseFloor {
		args = append(args, "-max-resumes", "-1") // every cut replays: the replay rule alone
	}
	armed := h.takeArm()
	cmd := exec.Command(filepath.Join(h.bins, "worker"), args...)
	cmd.Env = h.workerEnv(h.failpointsFor(armed))
	// Named by phase too: every phase starts its slots again, and its logs are kept.
	ph, _ := h.phase.Load().(string)
	logf, err := os.Create(filepath.Join(h.logs, fmt.Sprintf("worker-%s-%d-g%d.log", ph, s.i, s.gen)))
	if err != nil {
		return err
	}
	pipe, err := cmd.StderrPipe()
	if err != nil {
		logf.Close()
		return err
	}
	cmd.Stdout = logf
	if err := cmd.Start(); err != nil {
		logf.Close()
		return err
	}
	s.cmd, s.alive, s.paused, s.harnessKill, s.armed, s.fired, s.armDone, s.staleSent = cmd, true, false, false, armed, false, false, false
	done := make(chan struct{})
	s.done = done
	id := s.id
	go func() {
		sc := bufio.NewScanner(pipe)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			fmt.Fprintln(logf, line)
			if strings.HasPrefix(line, failpointLine+" ") {
				switch fl := h.recordFailpoint(line); fl.name {
				case fpBeforeCommit:
					// The worker stopped itself just before its commit statement.
					s.mu.Lock()
					s.fired, s.paused = true, true
					if s.armed == fpBeforeCommit && !s.armDone {
						s.armDone = true
						h.mu.Lock()
						h.armedNow--
						h.mu.Unlock()
					}
					s.mu.Unlock()
					h.staleWG.Add(1)
					go h.resumeStale(s, cmd.Process, done, fl)
				case fpBeforeCommit + "_sent":
					nudge := h.staleSent(fl)
					s.mu.Lock()
					s.staleSent = true
					s.mu.Unlock()
					if nudge {
						// No worker is armed to take the before_commit armed again: this
						// one (done with its own) restarts and takes it.
						s.signal(syscall.SIGTERM)
					}
				default:
					s.mu.Lock()
					s.fired = true
					s.mu.Unlock()
				}
			}
		}
		_ = cmd.Wait()
		logf.Close()
		s.mu.Lock()
		s.alive = false
		fired, byHarness, armDone := s.fired, s.harnessKill, s.armDone
		s.mu.Unlock()
		if armed != "" && !armDone {
			h.mu.Lock()
			h.armedNow--
			if !fired {
				h.pendingArms[armed]++ // killed or stopped before it fired: arm again
			}
			h.mu.Unlock()
		}
		h.log.Info("worker exited", "worker", id, "state", cmd.ProcessState.String(), "harness_sigkill", byHarness, "failpoint", fired)
		close(done)
	}()
	return nil
}

// failpointFields are the fields of one "FAILPOINT name=… …" line.
type failpointFields struct {
	name, detail, outcome string
	token                 int64
	err                   string // the err= field's text (the rest of the line), if any
	diag                  string // the before_commit_sent line's took= field
}

// recordFailpoint counts one "FAILPOINT name=… …" line of a worker and returns its fields.
func (h *harness) recordFailpoint(line string) failpointFields {
	var fl failpointFields
	for _, f := range strings.Fields(line)[1:] {
		k, v, ok := strings.Cut(f, "=")
		if !ok {
			continue
		}
		if k == "err" {
			// The rest is the error's text, which may hold anything.
			_, fl.err, _ = strings.Cut(line, " err=")
			break
		}
		switch k {
		case "name":
			fl.name = v
		case "key", "outbox_ids":
			fl.detail = v
		case "token":
			fl.token, _ = strconv.ParseInt(v, 10, 64)
		case "outcome":
			fl.outcome = v
		case "took": // how long the statement took
			fl.diag = strings.TrimSpace(fl.diag + " " + f)
		}
	}
	if strings.HasSuffix(fl.name, "_sent") {
		return fl
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.fpKills[fl.name]++
	if len(h.fpKeys[fl.name]) < 5 {
		h.fpKeys[fl.name] = append(h.fpKeys[fl.name], fl.detail)
	}
	return fl
}

// staleCommit is one before_commit firing: a worker stopped just before committing Key
// under Token.
type staleCommit struct {
	Key      string
	Token    int64
	TookOver bool // the job's fence was above Token when the worker was continued
	Finished bool // … and the job was complete or failed: another worker finished it
	// Outcome is what the worker said PostgreSQL did with the commit: refused, accepted,
	// error; "" if it never said. Only refused and accepted are verdicts (hasVerdict): an
	// error (its connection cut on the way, by a pg_terminate_backend round or by
	// Config.CutStale) says nothing of the fence.
	Outcome string
	Err     string // the worker's error text for a refused or failed commit
	// WhileRunning: this firing's worker is to be continued while another attempt holds
	// the job running under a higher fence (every other firing, from the first; see
	// resumeStale), the one moment at which only the commit's fence predicate can refuse it.
	WhileRunning bool
	// RunningFence is the fence of the attempt that held the job running when the worker
	// was continued (0: it was not continued so).
	RunningFence int64
	// MetRunning: the job's fence was still RunningFence, and the job running or complete,
	// once the stale commit returned (read before the other attempt was let go): the
	// stale commit reached PostgreSQL while that attempt held the job running.
	MetRunning bool
	// Held is how many of the other attempts' requests the front held meanwhile.
	Held int
	// Cut: the harness cut the commit on its way (Config.CutStale).
	Cut bool
	// Rearmed: it ended in error and another before_commit was armed in its place.
	Rearmed bool
	// Redo: this firing was armed in place of one that ended in error (its round).
	Redo bool
	sent chan struct{} // closed when the worker reported the commit's outcome
}

// staleRunningRound says which before_commit firings are continued while another attempt
// holds their job running: the first, then every other one (the rest keep the release at
// a takeover, or with Config.StaleWait after another worker finished the job). A firing
// armed in place of a stale commit that ended in error takes that one's round instead.
func staleRunningRound(firing int) bool { return firing%2 == 0 }

// hasVerdict reports whether a stale commit's outcome, as the worker reported it, is
// PostgreSQL's verdict on it (refused or accepted) rather than an error on the way.
func hasVerdict(outcome string) bool { return outcome == "refused" || outcome == "accepted" }

// resumeStale continues a worker stopped at before_commit. It waits on the job's row:
//
//   - on a firing of the running round (staleRunningRound; the first of every run), until
//     another attempt holds the job running under a higher fence. That attempt is held
//     meanwhile at its first request to the shop (siteFront), so it cannot commit before the
//     stale commit is sent; the stale commit then reaches a running job whose fence is not
//     its token, which only the fence predicate refuses (a build with the state check alone
//     accepts it: result fence < job fence). The hold is let go once the worker reported
//     its commit's outcome and the job's row was read again.
//   - otherwise, until the job was taken over (its fence raised: the reconciler rescued it)
//     and, with Config.StaleWait, until another worker finished it or StaleWait passed.
//
// Either way it continues the worker when the run's phase ends, or when nobody took the
// job over within takeoverWait.
func (h *harness) resumeStale(s *slot, proc *os.Process, exited <-chan struct{}, fl failpointFields) {
	defer h.staleWG.Done()
	sc := &staleCommit{Key: fl.detail, Token: fl.token, sent: make(chan struct{})}
	h.mu.Lock()
	if len(h.staleRedo) > 0 {
		sc.WhileRunning, sc.Redo, h.staleRedo = h.staleRedo[0], true, h.staleRedo[1:]
	} else {
		sc.WhileRunning = staleRunningRound(h.staleRounds)
		h.staleRounds++
	}
	cut := h.staleCut < h.cfg.CutStale
	if cut {
		h.staleCut++
	}
	h.stale = append(h.stale, sc)
	ctx := h.runCtx
	h.mu.Unlock()
	release, held := func() {}, func() int { return 0 }
	if sc.WhileRunning {
		// The hold is set before the job's fence moves past the token (the job's lease has
		// to run out first), so every later attempt meets it; if the fence already moved, it
		// may come too late, and MetRunning says whether the commit met a running job.
		var sku string
		qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := h.pool.QueryRow(qctx, `SELECT source_id FROM jobs WHERE key = $1`, sc.Key).Scan(&sku)
		cancel()
		if err != nil {
			h.logf("stale commit of %s: the job's SKU not read (%v); continued at a takeover instead", sc.Key, err)
			h.mu.Lock()
			sc.WhileRunning = false
			h.mu.Unlock()
		} else {
			release, held = h.front.Hold(sku)
		}
	}
	defer release()
	how := "once the job is taken over"
	if sc.WhileRunning {
		how = "while another attempt holds the job running"
	}
	h.logf("worker stopped before committing %s under token %d; continued %s", sc.Key, sc.Token, how)
	began := time.Now()
	for {
		var fence int64
		var state string
		qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := h.pool.QueryRow(qctx, `SELECT fence, state FROM jobs WHERE key = $1`, sc.Key).Scan(&fence, &state)
		cancel()
		took := err == nil && fence > sc.Token
		fin := took && (state == string(tasks.StateComplete) || state == string(tasks.StateFailed))
		running := took && state == string(tasks.StateRunning)
		if err == nil {
			h.mu.Lock()
			sc.TookOver, sc.Finished = took, fin
			if sc.WhileRunning && running {
				sc.RunningFence = fence
			}
			h.mu.Unlock()
		}
		waited := time.Since(began)
		var cont bool
		switch {
		case ctx.Err() != nil || (!took && waited > takeoverWait):
			cont = true
		case sc.WhileRunning:
			// No bound but the phase's: the job can only end through another attempt,
			// which runs (held) before it can end.
			cont = running || fin
		default:
			cont = fin || (took && waited >= h.cfg.StaleWait)
		}
		if cont {
			break
		}
		select {
		case <-ctx.Done():
		case <-time.After(200 * time.Millisecond):
		}
	}
	var lock *pgxpool.Conn
	if cut {
		if lock = h.lockJobRow(ctx, sc.Key); lock == nil {
			h.mu.Lock()
			h.staleCut-- // not cut: the next one is
			h.mu.Unlock()
		}
	}
	_ = proc.Signal(syscall.SIGCONT)
	s.mu.Lock()
	if s.cmd != nil && s.cmd.Process == proc {
		s.paused = false
	}
	s.mu.Unlock()
	if lock != nil {
		h.cutStale(ctx, lock, sc, exited)
	}
	h.mu.Lock()
	sc2 := *sc
	h.mu.Unlock()
	h.logf("worker continued before committing %s (taken over: %v, finished by another: %v, running under fence %d, after %v)",
		sc.Key, sc2.TookOver, sc2.Finished, sc2.RunningFence, time.Since(began).Round(time.Second))
	if sc2.RunningFence == 0 {
		return
	}
	// The other attempt stays held until the stale commit returned and the row was read.
	select {
	case <-sc.sent:
	case <-exited:
	case <-time.After(takeoverWait):
	}
	var fence int64
	var state string
	qctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	err := h.pool.QueryRow(qctx, `SELECT fence, state FROM jobs WHERE key = $1`, sc.Key).Scan(&fence, &state)
	cancel()
	h.mu.Lock()
	sc.Held = held()
	sc.MetRunning = err == nil && hasVerdict(sc.Outcome) && fence == sc.RunningFence &&
		(state == string(tasks.StateRunning) || state == string(tasks.StateComplete))
	met, n := sc.MetRunning, sc.Held
	h.mu.Unlock()
	h.logf("stale commit of %s under token %d met the job running under fence %d: %v (job now %s, fence %d; %d requests of that attempt held)",
		sc.Key, sc.Token, sc2.RunningFence, met, state, fence, n)
}

// waitStaleSent waits until every worker stopped at before_commit was continued and
// reported its commit's outcome, for at most takeoverWait (a worker killed meanwhile never
// reports).
func (h *harness) waitStaleSent(ctx context.Context) {
	deadline := time.Now().Add(takeoverWait)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		h.mu.Lock()
		n := 0
		for _, sc := range h.stale {
			if sc.Outcome == "" {
				n++
			}
		}
		h.mu.Unlock()
		if n == 0 {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	h.logf("a stale commit was not reported within %v%s", takeoverWait, loadAvg())
}

// staleSent records what became of a stale commit, as the worker reported it. A stale
// commit that ended in error reached no verdict (hasVerdict): while the phase runs, another
// before_commit is armed in its place, in its round (at most CutStale + staleRearms such),
// before its hold on the other attempt is let go, so that the phase does not end before
// it fired (runPhase enqueues more jobs while an arm has not fired). It reports whether no
// worker is armed to take that arm, so that the caller restarts one.
func (h *harness) staleSent(fl failpointFields) (nudge bool) {
	if fl.err != "" {
		h.logf("stale commit of %s under token %d: %s: %s", fl.detail, fl.token, fl.outcome, fl.err)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, sc := range h.stale {
		if sc.Key == fl.detail && sc.Token == fl.token && sc.Outcome == "" {
			sc.Outcome, sc.Err = fl.outcome, fl.err
			if fl.diag != "" {
				sc.Err = strings.TrimSpace(fl.err + " (" + fl.diag + ")")
			}
			if !hasVerdict(sc.Outcome) && h.runCtx != nil && h.runCtx.Err() == nil && h.staleArmed < h.cfg.CutStale+staleRearms {
				sc.Rearmed = true
				h.staleArmed++
				h.staleRedo = append(h.staleRedo, sc.WhileRunning)
				h.pendingArms[fpBeforeCommit]++
				nudge = nudge || h.armedNow == 0
				h.logf("stale commit of %s under token %d ended in error, no verdict: another before_commit armed in its place", sc.Key, sc.Token)
			}
			if sc.sent != nil {
				close(sc.sent)
			}
		}
	}
	return nudge
}

// lockJobRow holds the job's row lock (SELECT … FOR UPDATE in a transaction left open
// on the returned connection), or returns nil if it could not.
func (h *harness) lockJobRow(ctx context.Context, key string) *pgxpool.Conn {
	qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	conn, err := h.pool.Acquire(qctx)
	if err != nil {
		h.logf("cut of the stale commit of %s: no connection (%v); not cut", key, err)
		return nil
	}
	if _, err := conn.Exec(qctx, `BEGIN`); err == nil {
		if _, err = conn.Exec(qctx, `SELECT 1 FROM jobs WHERE key = $1 FOR UPDATE`, key); err == nil {
			return conn
		}
		h.logf("cut of the stale commit of %s: row not locked (%v); not cut", key, err)
	}
	conn.Release()
	return nil
}

// cutStale ends the connection of the stale commit sc (pg_terminate_backend) once its
// statement waits on the job's row lock that lock holds, then lets the lock go. It gives
// up when the worker reported the commit or exited, or after takeoverWait.
func (h *harness) cutStale(ctx context.Context, lock *pgxpool.Conn, sc *staleCommit, exited <-chan struct{}) {
	defer func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		_, err := lock.Exec(rctx, `ROLLBACK`)
		if err != nil {
			_ = lock.Conn().Close(rctx) // the connection is dropped either way
		}
		lock.Release()
	}()
	var holder int32
	qctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	err := lock.QueryRow(qctx, `SELECT pg_backend_pid()`).Scan(&holder)
	cancel()
	if err != nil {
		h.logf("cut of the stale commit of %s: %v; not cut", sc.Key, err)
		return
	}
	// The lone commit statement of a worker (store's commitSQL, found by its input's
	// columns within the first 1 KB that pg_stat_activity shows; a lone one locks with FOR
	// UPDATE, the group committer's with SKIP LOCKED, which never waits), waiting on the
	// lock this connection holds: the stale commit.
	const q = `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE datname = $1 AND application_name = 'chaos-worker' AND $2::int = ANY(pg_blocking_pids(pid))
	AND query LIKE '%AS t(key, token, obs_key,%' AND query NOT LIKE '%SKIP LOCKED%'`
	deadline := time.Now().Add(takeoverWait)
	for {
		var n int
		qctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		err := h.pool.QueryRow(qctx, q, h.dbName, holder).Scan(&n)
		cancel()
		switch {
		case err == nil && n > 0:
			h.mu.Lock()
			sc.Cut = true
			h.mu.Unlock()
			h.logf("stale commit of %s under token %d cut on its way (pg_terminate_backend while it waited on the job's row lock)", sc.Key, sc.Token)
			return
		case err != nil:
			h.logf("cut of the stale commit of %s: %v", sc.Key, err)
		}
		select {
		case <-sc.sent:
			h.logf("stale commit of %s returned before it was cut", sc.Key)
			return
		case <-exited:
			return
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			h.logf("stale commit of %s: not seen waiting on the job's row lock within %v%s; not cut", sc.Key, takeoverWait, loadAvg())
			return
		}
	}
}

// supervise keeps the slot's worker running until the harness stops.
func (s *slot) supervise() {
	defer s.h.wg.Done()
	for {
		s.mu.Lock()
		done := s.done
		s.mu.Unlock()
		<-done
		if s.h.stopping.Load() {
			return
		}
		s.h.mu.Lock()
		s.h.restarts++
		s.h.mu.Unlock()
		time.Sleep(100 * time.Millisecond) // a process manager's restart delay
		if err := s.start(); err != nil {
			s.h.logf("restart of worker %d failed: %v", s.i, err)
			return
		}
	}
}

// signal sends sig to the slot's current process if it runs; it reports whether it did.
func (s *slot) signal(sig syscall.Signal) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.alive || s.cmd == nil || s.cmd.Process == nil {
		return false
	}
	if sig == syscall.SIGKILL {
		s.harnessKill = true
	}
	return s.cmd.Process.Signal(sig) == nil
}

func (s *slot) current() (id string, alive, paused bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.id, s.alive, s.paused
}

// stopWorkers stops every slot: SIGCONT (in case), SIGTERM, SIGKILL after 30 s.
func (h *harness) stopWorkers() {
	h.stopping.Store(true)
	for _, s := range h.slots {
		s.mu.Lock()
		if s.alive && s.cmd != nil {
			_ = s.cmd.Process.Signal(syscall.SIGCONT)
			_ = s.cmd.Process.Signal(syscall.SIGTERM)
		}
		done := s.done
		s.mu.Unlock()
		if done == nil {
			continue
		}
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			s.signal(syscall.SIGKILL)
			<-done
		}
	}
	h.wg.Wait()
	h.slots = nil
	h.stopping.Store(false)
}

// startWorkers starts cfg.Workers slots.
func (h *harness) startWorkers() error {
	for i := 1; i <= h.cfg.Workers; i++ {
		port, err := freePort()
		if err != nil {
			return err
		}
		s := &slot{h: h, i: i, port: port}
		if err := s.start(); err != nil {
			return err
		}
		h.slots = append(h.slots, s)
		h.wg.Add(1)
		go s.supervise()
	}
	return nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// startScheduler runs cmd/scheduler as the reconciler alone (-no-scheduler), with short
// intervals, until ctx ends.
func (h *harness) startScheduler(ctx context.Context) (stop func(), err error) {
	yaml := fmt.Sprintf(`kinds:
  %s:
    max_lease: %s
reconciler:
  interval: 1s
`, catalog.Kind, h.cfg.Lease)
	path := filepath.Join(h.logs, "scheduler.yaml")
	if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
		return nil, err
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	logf, err := os.Create(filepath.Join(h.logs, "scheduler.log"))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(filepath.Join(h.bins, "scheduler"), "-config", path, "-no-scheduler", "-http", addr,
		"-allow-loopback", "-id", "chaos-reconciler", "-log-format", "json")
	cmd.Env = append(h.workerEnv(""), "IDEMSCRAPE_PG="+h.withApp("chaos-reconciler"))
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, err
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); logf.Close(); close(done) }()
	return func() {
		h.scrapeMetrics("scheduler", addr)
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	}, nil
}

// scrapeMetrics keeps the /metrics text of addr for the canary search.
func (h *harness) scrapeMetrics(name, addr string) {
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get("http://" + addr + "/metrics")
	if err != nil {
		h.logf("scrape %s /metrics: %v", name, err)
		return
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	h.mu.Lock()
	h.metricsText = append(h.metricsText, string(b))
	if ph, _ := h.phase.Load().(string); ph != "" {
		h.phaseMetrics[ph] = append(h.phaseMetrics[ph], string(b))
	}
	h.mu.Unlock()
}

// enqueue records and enqueues n catalog jobs of window, sku-1 … sku-n; with the proxy
// fault mix, 2 % ask for the country the proxy has no exit in.
func (h *harness) enqueue(ctx context.Context, window string, n int, faultMix bool) error {
	return h.enqueueFrom(ctx, window, 1, n, faultMix)
}

// enqueueFrom enqueues n jobs of window for the SKUs from, from+1, …, adding their keys to
// the window's.
func (h *harness) enqueueFrom(ctx context.Context, window string, from, n int, faultMix bool) error {
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: h.redis.Addr})
	defer client.Close()
	enq, err := tasks.NewEnqueuer(client, h.st, nil)
	if err != nil {
		return err
	}
	var specs []tasks.Spec
	for i := from; i < from+n; i++ {
		cc := "US"
		if faultMix && i%50 == 25 {
			cc = unavailableCC
		}
		specs = append(specs, tasks.Spec{Kind: catalog.Kind, SourceID: fmt.Sprintf("sku-%d", i), Country: cc, Window: window, ParserVersion: 1})
	}
	var keys []string
	for len(specs) > 0 {
		b := specs[:min(500, len(specs))]
		specs = specs[len(b):]
		res, err := enq.EnqueueMany(ctx, b)
		if err != nil {
			return fmt.Errorf("enqueue: %w", err)
		}
		for _, r := range res {
			keys = append(keys, r.Key)
		}
	}
	h.mu.Lock()
	h.enqueued[window] = append(h.enqueued[window], keys...)
	h.mu.Unlock()
	return nil
}

// progress returns terminal and total jobs of window.
func (h *harness) progress(ctx context.Context, window string) (done, total int, err error) {
	err = h.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE state IN ('complete', 'failed')), count(*) FROM jobs WHERE "window" = $1`, window).Scan(&done, &total)
	return done, total, err
}

// waitTerminal waits until every job of window is complete or failed, or deadline.
func (h *harness) waitTerminal(ctx context.Context, window string, deadline time.Time, onProgress func(frac float64)) error {
	last := -1
	for {
		done, total, err := h.progress(ctx, window)
		if err == nil {
			if done != last {
				h.logf("%s: %d/%d jobs terminal", window, done, total)
				last = done
			}
			if onProgress != nil && total > 0 {
				onProgress(float64(done) / float64(total))
			}
			if total > 0 && done == total {
				return nil
			}
		}
		if time.Now().After(deadline) {
			h.mu.Lock()
			h.timedOut = true
			h.mu.Unlock()
			return fmt.Errorf("%s: did not finish in %v: %d of %d jobs terminal at the deadline%s", window, h.cfg.Timeout, done, total, loadAvg())
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// runConsumer is the downstream service: it consumes the catalog topic in inbox mode
// (outbox.Consumer.RunTx) and writes one side-effect row per event it takes effect for,
// in the inbox's transaction.
func (h *harness) runConsumer(ctx context.Context) (stop func(), err error) {
	cons, err := outbox.NewConsumer(h.redis.Client(), &outbox.ConsumerConfig{
		Topic: catalog.Kind, Group: consumerGroup, Consumer: "chaos-consumer",
		Block: 500 * time.Millisecond, MinIdle: 2 * time.Second, Logger: h.log.With("component", "consumer"),
	})
	if err != nil {
		return nil, err
	}
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		err := cons.RunTx(cctx, h.pool, func(ctx context.Context, tx pgx.Tx, ev outbox.Event) error {
			var p struct {
				JobKey string `json:"job_key"`
			}
			_ = json.Unmarshal(ev.Payload, &p)
			_, err := tx.Exec(ctx, `INSERT INTO chaos_side_effects (event_key, job_key, stream_id, outbox_id) VALUES ($1, $2, $3, $4)`,
				ev.EventKey, p.JobKey, ev.StreamID, ev.OutboxID)
			return err
		})
		if err != nil && !errors.Is(err, context.Canceled) {
			h.logf("consumer stopped: %v", err)
		}
	}()
	return func() { cancel(); <-done }, nil
}

// waitDrained waits until no outbox row is unsent and the consumer group has nothing
// pending or undelivered, or deadline.
func (h *harness) waitDrained(ctx context.Context, deadline time.Time) {
	rdb := h.redis.Client()
	stream := outbox.StreamKey(outbox.DefaultPrefix, catalog.Kind)
	for time.Now().Before(deadline) {
		var unsent int
		qerr := h.pool.QueryRow(ctx, `SELECT count(*) FROM outbox_unsent`).Scan(&unsent)
		groups, err := rdb.XInfoGroups(ctx, stream).Result()
		drained := unsent == 0 && qerr == nil && err == nil // a count not read is not drained
		for _, g := range groups {
			if g.Name == consumerGroup && (g.Pending > 0 || g.Lag > 0) {
				drained = false
			}
		}
		if drained && len(groups) > 0 {
			return
		}
		time.Sleep(250 * time.Millisecond)
	}
	h.logf("outbox or consumer not drained at the deadline")
}

// pausedAttempt is one running attempt of a worker when it was paused.
type pausedAttempt struct {
	Key       string
	AttemptNo int
}

// runningAttempts lists the running attempts of worker id (from the jobs rows: an attempt
// has no attempts row until it ends).
func (h *harness) runningAttempts(ctx context.Context, id string) []pausedAttempt {
	rows, err := h.pool.Query(ctx, `SELECT key, attempts FROM jobs WHERE state = 'running' AND attempt_worker = $1`, id)
	if err != nil {
		return nil
	}
	defer rows.Close()
	var out []pausedAttempt
	for rows.Next() {
		var a pausedAttempt
		if rows.Scan(&a.Key, &a.AttemptNo) == nil {
			out = append(out, a)
		}
	}
	return out
}

// runningHeld counts the running attempts of worker id.
func (h *harness) runningHeld(ctx context.Context, id string) int {
	var n int
	_ = h.pool.QueryRow(ctx, `SELECT count(*) FROM jobs WHERE state = 'running' AND attempt_worker = $1`, id).Scan(&n)
	return n
}

// pick returns a random killable slot (see slot.killable), preferring those that hold running
// attempts (a fault that hits an idle worker proves little), or nil.
func (h *harness) pick(ctx context.Context) *slot {
	var cands, busy []*slot
	for _, s := range h.slots {
		if id, _, _ := s.current(); s.killable() {
			cands = append(cands, s)
			if h.runningHeld(ctx, id) > 0 {
				busy = append(busy, s)
			}
		}
	}
	if len(busy) > 0 {
		return busy[h.intn(len(busy))]
	}
	if len(cands) == 0 {
		return nil
	}
	return cands[h.intn(len(cands))]
}

// randomKill SIGKILLs a random worker (the supervisor restarts it). A worker that is
// restarting at that moment is skipped for another (up to 50 tries, 100 ms apart).
func (h *harness) randomKill(ctx context.Context) {
	for try := 0; try < 50 && ctx.Err() == nil; try++ {
		if try > 0 {
			time.Sleep(100 * time.Millisecond)
		}
		if h.killOne(ctx) {
			return
		}
	}
	h.logf("kill: no running worker to kill")
}

// killOne SIGKILLs a random running worker and reports whether there was one.
func (h *harness) killOne(ctx context.Context) bool {
	s := h.pick(ctx)
	if s == nil {
		return false
	}
	id, _, _ := s.current()
	held := h.runningHeld(ctx, id)
	if !s.signal(syscall.SIGKILL) {
		return false
	}
	h.mu.Lock()
	h.randomKills++
	if held > 0 {
		h.execKills++
	}
	h.mu.Unlock()
	h.logf("SIGKILL %s (%d running attempts)", id, held)
	return true
}

// pause SIGSTOPs a random worker for 2.5 leases, then SIGCONTs it. A worker that is
// restarting at that moment is skipped for another (up to 50 tries, 100 ms apart).
func (h *harness) pause(ctx context.Context) {
	var (
		s    *slot
		proc *os.Process
		id   string
	)
	for try := 0; proc == nil; try++ {
		if try == 50 || ctx.Err() != nil {
			h.logf("pause: no running worker to pause")
			return
		}
		if try > 0 {
			time.Sleep(100 * time.Millisecond)
		}
		if s = h.pick(ctx); s == nil {
			continue
		}
		s.mu.Lock()
		// pick chose a killable slot (never one armed with before_commit that has not
		// reported: a pause's SIGCONT could continue its stale commit before the takeover).
		if s.alive && !s.paused && s.cmd != nil && s.cmd.Process.Signal(syscall.SIGSTOP) == nil {
			s.paused = true
			proc, id = s.cmd.Process, s.id
		}
		s.mu.Unlock()
	}
	att := h.runningAttempts(ctx, id)
	held := len(att)
	h.logf("SIGSTOP %s for %v (%d running attempts)", id, h.cfg.Lease*5/2, held)
	time.Sleep(h.cfg.Lease * 5 / 2)
	_ = proc.Signal(syscall.SIGCONT)
	s.mu.Lock()
	s.paused = false
	s.mu.Unlock()
	h.mu.Lock()
	h.pauses++
	if held > 0 {
		h.pausesHeld++
	}
	h.pausedAtt = append(h.pausedAtt, att...)
	h.mu.Unlock()
}

// wipeRedis kills the throwaway redis-server and starts it again empty.
func (h *harness) wipeRedis(ctx context.Context) {
	h.redis.Restart()
	var now time.Time
	if err := h.pool.QueryRow(ctx, `SELECT now()`).Scan(&now); err != nil {
		// The wipe's time bounds the events the wipe check looks at: never leave it zero
		// (no wipe) because PostgreSQL did not answer; this machine's clock is its clock.
		now = time.Now()
		h.logf("redis wipe: PostgreSQL's clock not read (%v); using this process's", err)
	}
	h.mu.Lock()
	h.redisWipes++
	h.lastWipe = now
	h.mu.Unlock()
	h.logf("redis-server killed and restarted empty")
}

// terminateBackends runs one pg_terminate_backend round on the workers' connections.
func (h *harness) terminateBackends(ctx context.Context) {
	var n int
	err := h.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE datname = $1 AND application_name = 'chaos-worker' AND pid <> pg_backend_pid()`, h.dbName).Scan(&n)
	if err != nil {
		h.logf("pg_terminate_backend round: %v", err)
		return
	}
	h.mu.Lock()
	h.pgRounds++
	h.pgTerminated += n
	h.mu.Unlock()
	h.logf("pg_terminate_backend: %d worker connections", n)
}

// event is a fault scheduled at a progress fraction of the chaos phase.
type event struct {
	at   float64
	name string
	run  func(ctx context.Context)
}

// schedule spreads count events of one kind over [from, to] of the progress.
func schedule(evs []event, count int, from, to float64, name string, run func(context.Context)) []event {
	for i := 0; i < count; i++ {
		at := from
		if count > 1 {
			at = from + (to-from)*float64(i)/float64(count-1)
		}
		evs = append(evs, event{at: at, name: name, run: run})
	}
	return evs
}

// throttleLoop makes about 5 % of the shop's requests answer 429 with Retry-After: 1 s.
func (h *harness) throttleLoop(ctx context.Context) {
	last := h.site.TotalHits()
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now := h.site.TotalHits()
		n := (now - last) / 20
		last = now
		if n > 0 {
			h.site.Throttle(n, time.Second)
			h.mu.Lock()
			h.throttled += n
			h.mu.Unlock()
		}
	}
}

// Phases of a run.
const (
	phaseBaseline = "baseline" // no fault
	phaseFaultMix = "faultmix" // the proxy and shop fault mix alone
	phaseFloor    = "floor"    // the fault mix again, on workers that never resume (the replay floor)
	phaseChaos    = "chaos"    // every fault
)

// runPhase starts the workers and waits until every job of window is terminal. In the
// chaos phase the faults are injected at their progress points meanwhile; in the fault-mix
// phase only the proxy and shop fault mix runs.
func (h *harness) runPhase(ctx context.Context, window string, deadline time.Time, phase string) error {
	chaos := phase == phaseChaos
	armAtStart := map[string]int{fpAfterFetch: h.cfg.AfterFetch, fpAfterCommit: h.cfg.AfterCommit, fpAfterXadd: h.cfg.AfterXadd,
		fpBeforeCommit: h.cfg.BeforeCommit}
	if chaos && h.cfg.ArmAtStart {
		h.mu.Lock()
		for name, n := range armAtStart {
			h.pendingArms[name] += n // the workers about to start take them
		}
		h.mu.Unlock()
	}
	pctx, pcancel := context.WithCancel(ctx)
	h.mu.Lock()
	h.runCtx = pctx
	h.mu.Unlock()
	if err := h.startWorkers(); err != nil {
		pcancel()
		return err
	}
	defer func() {
		// A worker stopped at before_commit is continued now, whatever its job's state, and
		// its commit must reach PostgreSQL before the workers are stopped (a commit racing
		// the shutdown could be cut off and never tested).
		pcancel()
		h.waitStaleSent(ctx)
		for _, s := range h.slots {
			h.scrapeMetrics(fmt.Sprintf("worker %d", s.i), fmt.Sprintf("127.0.0.1:%d", s.port))
		}
		h.stopWorkers()
		h.staleWG.Wait()
	}()
	if phase == phaseFaultMix || phase == phaseFloor {
		h.proxy.ResetCutDraws()
		fctx, cancel := context.WithCancel(ctx)
		defer cancel()
		h.proxy.SetDisconnectProb(h.cfg.DisconnectProb)
		defer h.proxy.SetDisconnectProb(0)
		go h.throttleLoop(fctx)
		return h.waitTerminal(ctx, window, deadline, nil)
	}
	if !chaos {
		return h.waitTerminal(ctx, window, deadline, nil)
	}
	c := h.cfg
	var evs []event
	evs = schedule(evs, c.RandomKills, 0.02, 0.7, "kill", h.randomKill)
	if !c.ArmAtStart {
		for name, n := range armAtStart {
			evs = schedule(evs, n, 0.01, 0.6, name, func(ctx context.Context) { h.arm(ctx, name) })
		}
	}
	var pausing sync.WaitGroup
	defer pausing.Wait() // runs before the workers stop: every paused worker is continued first
	evs = schedule(evs, c.Pauses, 0.05, 0.6, "pause", func(ctx context.Context) {
		pausing.Add(1)
		go func() { defer pausing.Done(); h.pause(ctx) }()
	})
	evs = schedule(evs, c.RedisWipes, 0.35, 0.5, "redis", h.wipeRedis)
	evs = schedule(evs, c.PGRounds, 0.02, 0.8, "pg", h.terminateBackends)
	sort.SliceStable(evs, func(i, j int) bool { return evs[i].at < evs[j].at })
	fctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if c.ProxyFaults {
		h.proxy.SetDisconnectProb(h.cfg.DisconnectProb)
		go h.throttleLoop(fctx)
		defer h.proxy.SetDisconnectProb(0)
	}
	next := 0
	err := h.waitTerminal(ctx, window, deadline, func(frac float64) {
		for next < len(evs) && evs[next].at <= frac {
			evs[next].run(fctx)
			next++
		}
	})
	// Every job done before every targeted failpoint fired (a small run on a busy box, or
	// an armed worker that never got the job that reaches its point): more jobs, so that
	// the run shows what it set out to show instead of passing without it.
	from := c.Jobs + 1
	for round := 0; err == nil && round < extraRounds && h.unfiredArms() > 0; round++ {
		n := c.Workers * c.Concurrency
		h.logf("chaos: %d targeted failpoints not fired yet; %d more jobs", h.unfiredArms(), n)
		if err := h.enqueueFrom(ctx, window, from, n, c.ProxyFaults); err != nil {
			return err
		}
		from += n
		h.mu.Lock()
		h.extraJobs += n
		h.mu.Unlock()
		err = h.waitTerminal(ctx, window, deadline, nil)
	}
	return err
}

// unfiredArms counts the targeted failpoints scheduled or armed that have not fired.
func (h *harness) unfiredArms() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := h.armedNow
	for _, v := range h.pendingArms {
		n += v
	}
	return n
}

// run is the whole chaos run: setup, baseline, chaos, checks. It returns the report;
// err is for a run that could not be carried out (not for a broken invariant).
func run(ctx context.Context, cfg Config, tb testing.TB, out io.Writer) (rep *Report, err error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	began := time.Now()
	h := &harness{cfg: cfg, tb: tb, out: out, fpKills: map[string]int{}, fpKeys: map[string][]string{}, pendingArms: map[string]int{},
		enqueued: map[string][]string{}, phaseMetrics: map[string][]string{}, rng: rand.New(rand.NewPCG(uint64(cfg.Seed), 7))}
	h.phase.Store("setup")
	h.bins, h.logs = tb.TempDir(), tb.TempDir()
	if cfg.LogDir != "" {
		h.logs = cfg.LogDir
		if err := os.MkdirAll(h.logs, 0o755); err != nil {
			return nil, err
		}
	}
	h.logFile, err = os.Create(filepath.Join(h.logs, "harness.log"))
	if err != nil {
		return nil, err
	}
	defer h.logFile.Close()
	h.log = slog.New(slog.NewJSONHandler(h.logFile, nil))

	h.logf("building cmd/worker and cmd/scheduler")
	if err := h.build(ctx); err != nil {
		return nil, err
	}
	// The run's bound starts once the binaries are built: on a busy box a build (a broken
	// build's tags miss the cache) can take minutes that no phase of the run had.
	built := time.Now()
	h.password = "pw-" + testutil.RandomID(8)
	if cfg.Canary {
		h.password = "canary-" + testutil.RandomID(12)
	}
	h.redis = testutil.StartRedis(tb)
	h.site = testutil.NewFakeSite(tb, testutil.FakeSiteConfig{Seed: cfg.Seed, Products: max(cfg.Jobs+extraRounds*cfg.Workers*cfg.Concurrency, cfg.Baseline), StrictExit: true,
		Challenge: cfg.Challenge})
	if h.front, err = newSiteFront(tb, h.site.URL); err != nil {
		return nil, err
	}
	h.proxy = testutil.NewFakeProxy(tb, testutil.FakeProxyConfig{Seed: cfg.Seed, Format: testutil.ProxyFormatOxylabs,
		User: proxyUser, Password: h.password, UnavailableCountries: []string{unavailableCC}, CutExitAlive: cfg.CutExitAlive,
		// The fault mix and the replay floor send the same requests: drawn per URL, their
		// cuts are the same where their requests are, and their bytes compare like for like.
		CutDrawsByURL: true})
	if err := h.createDB(ctx); err != nil {
		return nil, err
	}
	h.logf("database %s, redis %s, shop %s, proxy %s, logs in %s", h.dbName, h.redis.Addr, h.site.URL, h.proxy.Addr, h.logs)
	stopSched, err := h.startScheduler(ctx)
	if err != nil {
		return nil, err
	}
	stopSched = sync.OnceFunc(stopSched)
	tb.Cleanup(stopSched) // an early return still stops the reconciler
	stopCons, err := h.runConsumer(ctx)
	if err != nil {
		return nil, err
	}
	stopCons = sync.OnceFunc(stopCons)
	tb.Cleanup(stopCons)
	deadline := built.Add(cfg.Timeout)

	if cfg.Baseline > 0 {
		h.phase.Store(phaseBaseline)
		h.logf("baseline: %d jobs, no faults", cfg.Baseline)
		p0, w0 := h.proxy.Bytes(), h.wire()
		if err := h.enqueue(ctx, windowBaseline, cfg.Baseline, false); err != nil {
			return nil, err
		}
		if err := h.runPhase(ctx, windowBaseline, deadline, phaseBaseline); err != nil {
			h.logf("baseline: %v", err)
		}
		h.baseProxy, h.baseWire = h.proxy.Bytes()-p0, h.wire()-w0
		if err := h.pool.QueryRow(ctx, `SELECT count(*), COALESCE(sum(bytes_total), 0) FROM jobs WHERE "window" = $1 AND state = 'complete'`,
			windowBaseline).Scan(&h.baselineJobs, &h.baseBytes); err != nil {
			return nil, fmt.Errorf("baseline bytes: %w", err)
		}
	}
	if n := min(cfg.FaultMixJobs, cfg.Baseline); n > 0 && cfg.ProxyFaults {
		// The baseline's SKUs again, with the proxy fault mix alone: bytes per completed job
		// against the fault-free run of the same jobs, without kills (a killed attempt never
		// reports its bytes) or the re-executions of pauses and wipes.
		h.phase.Store(phaseFaultMix)
		h.logf("fault mix: %d jobs (the baseline's SKUs), proxy faults only", n)
		p0, w0 := h.proxy.Bytes(), h.wire()
		if err := h.enqueue(ctx, windowFaultMix, n, true); err != nil {
			return nil, err
		}
		if err := h.runPhase(ctx, windowFaultMix, deadline, phaseFaultMix); err != nil {
			h.logf("fault mix: %v", err)
		}
		h.mixJobs, h.mixProxy, h.mixWire = n, h.proxy.Bytes()-p0, h.wire()-w0
		if cfg.ReplayFloor {
			// The same SKUs and fault mix once more on workers that never resume: what the
			// replay rule alone costs under this run's cuts.
			h.phase.Store(phaseFloor)
			h.logf("replay floor: %d jobs (the baseline's SKUs), proxy faults only, no resumes", n)
			p0, w0 := h.proxy.Bytes(), h.wire()
			if err := h.enqueue(ctx, windowFloor, n, true); err != nil {
				return nil, err
			}
			if err := h.runPhase(ctx, windowFloor, deadline, phaseFloor); err != nil {
				h.logf("replay floor: %v", err)
			}
			h.floorJobs, h.floorProxy, h.floorWire = n, h.proxy.Bytes()-p0, h.wire()-w0
		}
	}

	h.phase.Store(phaseChaos)
	h.logf("chaos: %d jobs, %d workers", cfg.Jobs, cfg.Workers)
	h.chaosProxy0 = h.proxy.Bytes()
	if err := h.enqueue(ctx, windowChaos, cfg.Jobs, cfg.ProxyFaults); err != nil {
		return nil, err
	}
	if err := h.runPhase(ctx, windowChaos, deadline, phaseChaos); err != nil {
		h.logf("chaos: %v", err)
	}
	h.chaosProxy = h.proxy.Bytes() - h.chaosProxy0
	h.waitDrained(ctx, time.Now().Add(60*time.Second))
	stopCons()
	stopSched()
	h.wall = time.Since(began)
	return h.check(ctx)
}

// wire is what the proxy exchanged with its clients so far, both ways (FakeProxy.ClientBytes):
// the bytes a provider bills, refusals, CONNECT exchanges and tunnelled TLS included. It
// waits (5 s at most) for the clients' connections to close first, so that their last
// bytes are in.
func (h *harness) wire() int64 {
	for end := time.Now().Add(5 * time.Second); h.proxy.OpenClients() > 0 && time.Now().Before(end); {
		time.Sleep(20 * time.Millisecond)
	}
	from, to := h.proxy.ClientBytes()
	return from + to
}
