package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
)

// runSpec is what the parent tells a child process to run (flags of the -child mode).
type runSpec struct {
	Mode      string // one of allModes
	Side      string // ours, peer (b5: ours = duplicate enqueue, peer = fresh enqueue)
	N         int
	Conc      int
	Robots    bool // ours honours robots.txt (idemscrape's default); the peer ignores -robots
	RedisAddr string
	DSN       string // database of this run
	Page      string
	ProxyAddr string
	ProxyUser string
	ProxyPass string // from the environment, never a flag
	Profile   string // if set, the CPU profile of the measured phase is written there
	PGConns   int    // pgx MaxConns (0: Conc + 10)
}

// runResult is what a child prints (one JSON line on stdout).
type runResult struct {
	Jobs        int     `json:"jobs"`
	Seconds     float64 `json:"seconds"`
	JobsPerSec  float64 `json:"jobs_per_s"`
	CPUPerJobUS float64 `json:"cpu_us_per_job"`     // this process's user+sys CPU
	RedisCmds   float64 `json:"redis_cmds_per_job"` // INFO commandstats delta
	RedisRT     float64 `json:"redis_rt_per_job"`   // go-redis hook: commands + pipelines
	RedisCPUUS  float64 `json:"redis_cpu_us_per_job"`
	PGRT        float64 `json:"pg_rt_per_job"` // pgx tracer: queries + batches + copies
	// PGCPUUS is PostgreSQL's CPU per job: the run's database's backends and the server's
	// WAL writer, background writer, checkpointer and autovacuum (postgresCPU; 0 when
	// PostgreSQL runs elsewhere).
	PGCPUUS float64 `json:"pg_cpu_us_per_job"`
	// Whole-box CPU per job (boxcpu.go): the sum, and its parts — this process, the
	// run's database's backends, the run's redis-server, the parent (proxy and site).
	BoxCPUUS       float64 `json:"box_cpu_us_per_job"`
	BoxWorkerUS    float64 `json:"box_worker_us_per_job"`
	BoxPGUS        float64 `json:"box_pg_us_per_job"`
	BoxRedisUS     float64 `json:"box_redis_us_per_job"`
	BoxProxySiteUS float64 `json:"box_proxy_site_us_per_job"`
	// Mode-specific measures.
	LagP50MS         float64 `json:"lag_p50_ms,omitempty"`          // b4: commit → stream
	LagP99MS         float64 `json:"lag_p99_ms,omitempty"`          // b4
	CommitsPerSec    float64 `json:"commits_per_s,omitempty"`       // b4: during the lag phase
	RedisBytesPerJob float64 `json:"redis_bytes_per_job,omitempty"` // b6: used_memory delta / N
	// Set by the parent from the fake site's counters (fetching modes): requests for the
	// page and for /robots.txt per job over the whole run, enqueue and shutdown included.
	SitePagePerJob   float64 `json:"-"`
	SiteRobotsPerJob float64 `json:"-"`
}

const benchQueue = "bench"

// runChild runs one measured run and returns its result.
func runChild(ctx context.Context, s runSpec) (runResult, error) {
	profileTo = s.Profile
	pgrt := &pgCounter{}
	pool, err := openChildPool(ctx, s, pgrt)
	if err != nil {
		return runResult{}, err
	}
	defer pool.Close()
	boxPool = pool
	st := store.New(pool)

	rrt := &redisCounter{}
	rdb := redis.NewClient(&redis.Options{Addr: s.RedisAddr, PoolSize: s.Conc + 20})
	defer rdb.Close()
	rdb.AddHook(rrt)

	switch s.Mode {
	case "b3", "b3g":
		return runB3(ctx, s, st, pool, rdb, rrt, pgrt)
	case "b2":
		return runB2(ctx, s, rdb, rrt, pgrt)
	case "b4":
		return runB4(ctx, s, st, pool, rdb, rrt, pgrt)
	case "b6":
		return runB6(ctx, s, st, rdb, rrt, pgrt)
	case "b7":
		return runB7(ctx, s, rdb, rrt, pgrt)
	}
	if isRiverMode(s.Mode) && s.Side == "peer" {
		return runRiver(ctx, s, pool, rdb, rrt, pgrt)
	}
	c := &childRun{s: s, pool: pool, rdb: rdb, rrt: rrt, pgrt: pgrt}
	if err := c.newEnqueuer(st); err != nil {
		return runResult{}, err
	}
	if s.Mode == "b5" {
		return c.runB5(ctx)
	}

	if err := c.enqueueAll(ctx); err != nil {
		return runResult{}, err
	}
	var h asynq.Handler
	if s.Side == "ours" {
		reg, err := newOurs(s, st, rdb)
		if err != nil {
			return runResult{}, err
		}
		defer reg.Close()
		h = reg
	} else if h, err = newPeer(s, pool); err != nil {
		return runResult{}, err
	}
	res, err := c.serve(ctx, h)
	if err != nil {
		return runResult{}, err
	}
	if err := c.checkStored(ctx); err != nil {
		return runResult{}, err
	}
	return res, nil
}

// openChildPool is runChild's first step: the PostgreSQL pool of the run, its round trips
// counted by pgrt.
func openChildPool(ctx context.Context, s runSpec, pgrt *pgCounter) (*pgxpool.Pool, error) {
	pcfg, err := pgxpool.ParseConfig(s.DSN)
	if err != nil {
		return nil, err
	}
	pcfg.MaxConns = int32(poolSize(s.PGConns, s.Conc))
	pcfg.ConnConfig.Tracer = pgrt
	return pgxpool.NewWithConfig(ctx, pcfg)
}

// childRun is one run of the enqueue-and-process modes (b1, b1robots, direct, proto, b5):
// its clients, counters and specs.
type childRun struct {
	s     runSpec
	pool  *pgxpool.Pool
	rdb   *redis.Client
	rrt   *redisCounter
	pgrt  *pgCounter
	enq   *tasks.Enqueuer
	specs []tasks.Spec
}

// newEnqueuer is the step that sets up the enqueuer and the run's N specs.
func (c *childRun) newEnqueuer(st *store.PG) error {
	client := asynq.NewClientFromRedisClient(c.rdb)
	enq, err := tasks.NewEnqueuer(client, st, &tasks.EnqueuerConfig{Queue: benchQueue, Redis: c.rdb})
	if err != nil {
		return err
	}
	c.enq = enq
	c.specs = make([]tasks.Spec, c.s.N)
	for i := range c.specs {
		c.specs[i] = tasks.Spec{Kind: "page", SourceID: fmt.Sprintf("p-%d", i), Country: "US", Window: "2026-04-23", ParserVersion: 1}
	}
	return nil
}

// enqueueAll enqueues the run's specs, 500 at a time.
func (c *childRun) enqueueAll(ctx context.Context) error {
	for rest := c.specs; len(rest) > 0; {
		batch := rest[:min(500, len(rest))]
		rest = rest[len(batch):]
		if _, err := c.enq.EnqueueMany(ctx, batch); err != nil {
			return err
		}
	}
	return nil
}

// runB5 is the b5 mode: it measures enqueueing the specs (ours: again, duplicates) and
// checks that N jobs were recorded.
func (c *childRun) runB5(ctx context.Context) (runResult, error) {
	if c.s.Side == "ours" { // duplicate: the same specs again
		if err := c.enqueueAll(ctx); err != nil {
			return runResult{}, err
		}
	}
	m := startMeasure(ctx, c.rdb, c.rrt, c.pgrt)
	if err := c.enqueueAll(ctx); err != nil {
		return runResult{}, err
	}
	res := m.stop(ctx, c.s.N)
	var pending int
	if err := c.pool.QueryRow(ctx, `SELECT count(*) FROM jobs`).Scan(&pending); err != nil {
		return runResult{}, err
	}
	if pending != c.s.N {
		return runResult{}, fmt.Errorf("b5: %d jobs recorded, want %d", pending, c.s.N)
	}
	return res, nil
}

// newPeer is the step that builds the peer's handler for s.Mode.
func newPeer(s runSpec, pool *pgxpool.Pool) (asynq.Handler, error) {
	// The peer's robots.txt handling does not follow -robots: b1 and direct use colly's
	// default (ignored), b1robots honours it per job.
	pc := peerConfig{pool: pool, page: s.Page, proxyAddr: s.ProxyAddr, proxyUser: s.ProxyUser, proxyPass: s.ProxyPass, conc: s.Conc}
	switch s.Mode {
	case "b1":
		return newPeerSession(pc, false), nil
	case "b1robots":
		return newPeerSession(pc, true), nil
	case "direct":
		return newPeerDirect(pc), nil
	case "proto":
		return newPeerNoFetch(pc), nil
	}
	return nil, fmt.Errorf("mode %q: unknown", s.Mode)
}

// serve is the measured step: an asynq server runs h until N jobs succeeded (at most 10
// minutes), and the clock stops at the N-th success.
func (c *childRun) serve(ctx context.Context, h asynq.Handler) (runResult, error) {
	var done atomic.Int64
	finished := make(chan struct{})
	var lastErr atomic.Value
	srv := asynq.NewServerFromRedisClient(c.rdb, (&handlers.Registry{}).ServerConfig(asynq.Config{
		Queues: map[string]int{benchQueue: 1}, Concurrency: c.s.Conc, LogLevel: asynq.FatalLevel,
	}))
	mux := asynq.NewServeMux()
	mux.HandleFunc("page", func(ctx context.Context, t *asynq.Task) error {
		err := h.ProcessTask(ctx, t)
		if err == nil {
			if done.Add(1) == int64(c.s.N) {
				close(finished)
			}
		} else {
			lastErr.Store(err.Error())
		}
		return err
	})
	m := startMeasure(ctx, c.rdb, c.rrt, c.pgrt)
	if err := srv.Start(mux); err != nil {
		return runResult{}, err
	}
	select {
	case <-finished:
	case <-time.After(10 * time.Minute):
		srv.Shutdown()
		return runResult{}, fmt.Errorf("only %d of %d jobs done (last error: %v)", done.Load(), c.s.N, lastErr.Load())
	case <-ctx.Done():
		srv.Shutdown()
		return runResult{}, ctx.Err()
	}
	end := time.Now()
	if closer, ok := h.(interface{ Close() }); ok {
		// Ours: the lease releases of the last jobs run in the background; their Redis
		// commands count (the clock stopped at the N-th success, for both sides).
		closer.Close()
	}
	res := m.stopAt(ctx, c.s.N, end)
	srv.Shutdown()
	return res, nil
}

// checkStored is the last step: it checks that every job's result was stored.
func (c *childRun) checkStored(ctx context.Context) error {
	q := `SELECT count(*) FROM results`
	if c.s.Side == "ours" {
		q = `SELECT count(*) FROM jobs WHERE state = 'complete'`
	}
	var n int
	if err := c.pool.QueryRow(ctx, q).Scan(&n); err != nil {
		return err
	}
	if n != c.s.N {
		return fmt.Errorf("%s/%s: %d of %d jobs stored", c.s.Mode, c.s.Side, n, c.s.N)
	}
	return nil
}

// newOurs builds the idemscrape runner on its public API, as a user would.
func newOurs(s runSpec, st *store.PG, rdb *redis.Client) (*handlers.Registry, error) {
	prov, err := sessions.NewProvider("generic", s.ProxyAddr, "{user}[-country-{country}]-session-{session}", "{pass}", s.ProxyUser, s.ProxyPass, 0)
	if err != nil {
		return nil, err
	}
	reg, err := handlers.NewRegistry(handlers.Config{
		Store: st, Redis: rdb, Provider: prov, KeyPrefix: "bench:",
		Collector: sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), IgnoreRobotsTxt: !s.Robots},
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		return nil, err
	}
	wf := fetchWorkflow(s.Page)
	if s.Mode == "proto" {
		wf = noFetchWorkflow
	}
	if err := reg.Register("page", wf, parseLen); err != nil {
		reg.Close()
		return nil, err
	}
	return reg, nil
}

func fetchWorkflow(page string) handlers.WorkflowFunc {
	return func(tasks.Payload) (*sessions.Unit, error) {
		return &sessions.Unit{Name: "page", Steps: []sessions.Step{{Name: "get", Safe: true,
			Run: func(_ context.Context, sc *sessions.StepContext) error {
				resp, err := sc.Get(page)
				if err != nil {
					return err
				}
				return sc.Staging.Put("page", len(resp.Body))
			}}}}, nil
	}
}

// noFetchWorkflow is the protocol-only workflow: one step that sends no request.
func noFetchWorkflow(tasks.Payload) (*sessions.Unit, error) {
	return &sessions.Unit{Name: "page", Steps: []sessions.Step{{Name: "none", Safe: true,
		Run: func(_ context.Context, sc *sessions.StepContext) error { return sc.Staging.Put("page", 0) }}}}, nil
}

func parseLen(_ tasks.Payload, staged map[string]json.RawMessage) (handlers.Observation, error) {
	var n int
	if err := json.Unmarshal(staged["page"], &n); err != nil {
		return handlers.Observation{}, err
	}
	return handlers.Observation{Data: map[string]int{"len": n}}, nil
}

// measure holds the counters at the start of the measured phase.
type measure struct {
	rdb       *redis.Client
	rrt       *redisCounter
	pgrt      *pgCounter
	start     time.Time
	cpu       time.Duration
	cmds      int64
	redisCPU  float64
	rrt0, pg0 int64
	pgCPU     map[int]time.Duration
	box       boxSnap
}

// profileTo is the child's -profile file ("" = none); startMeasure starts the profile and
// stop ends it.
var profileTo string

func startMeasure(ctx context.Context, rdb *redis.Client, rrt *redisCounter, pgrt *pgCounter) *measure {
	if profileTo != "" {
		if f, err := os.Create(profileTo); err == nil {
			if err := pprof.StartCPUProfile(f); err != nil {
				f.Close()
			} else {
				profileFile = f
			}
		}
	}
	cmds, rcpu := redisStats(ctx, rdb)
	return &measure{rdb: rdb, rrt: rrt, pgrt: pgrt, cmds: cmds, redisCPU: rcpu, rrt0: rrt.n.Load(), pg0: pgrt.n.Load(),
		pgCPU: postgresCPU(ctx), box: takeBoxSnap(ctx, rdb), cpu: processCPU(), start: time.Now()}
}

// profileFile is the open profile of the measured phase, if any.
var profileFile *os.File

func (m *measure) stop(ctx context.Context, n int) runResult { return m.stopAt(ctx, n, time.Now()) }

// stopAt is stop with the clock stopped at end (the counters are read now).
func (m *measure) stopAt(ctx context.Context, n int, end time.Time) runResult {
	elapsed := end.Sub(m.start)
	cpu := processCPU() - m.cpu
	pgCPU := pgCPUSince(m.pgCPU, postgresCPU(ctx))
	box := takeBoxSnap(ctx, m.rdb).since(m.box)
	if profileFile != nil {
		pprof.StopCPUProfile()
		profileFile.Close()
		profileFile = nil
	}
	rrt, pg := m.rrt.n.Load()-m.rrt0, m.pgrt.n.Load()-m.pg0
	cmds, rcpu := redisStats(ctx, m.rdb)
	f := float64(n)
	return runResult{
		Jobs: n, Seconds: elapsed.Seconds(), JobsPerSec: f / elapsed.Seconds(),
		CPUPerJobUS: float64(cpu.Microseconds()) / f,
		RedisCmds:   float64(cmds-m.cmds-1) / f, // minus the first INFO
		RedisRT:     float64(rrt) / f,
		RedisCPUUS:  (rcpu - m.redisCPU) * 1e6 / f,
		PGRT:        float64(pg) / f,
		PGCPUUS:     float64(pgCPU.Microseconds()) / f,

		BoxCPUUS:       float64((box.Worker + box.PG + box.Redis + box.ProxySite).Microseconds()) / f,
		BoxWorkerUS:    float64(box.Worker.Microseconds()) / f,
		BoxPGUS:        float64(box.PG.Microseconds()) / f,
		BoxRedisUS:     float64(box.Redis.Microseconds()) / f,
		BoxProxySiteUS: float64(box.ProxySite.Microseconds()) / f,
	}
}

// processCPU is this process's user + system CPU time so far.
func processCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// postgresCPU is the time on a CPU so far of each PostgreSQL process that works for a run:
// the backends of the run's database (backendPIDs) and the server's own processes whose
// work the run's writes cause (WAL writer, background writer, checkpointer, autovacuum
// launcher and workers — of every database: on an idle box only the run's), by pid, from
// /proc/<pid>/schedstat in nanoseconds. Backends of other databases are left out. A process that exits during the measured phase (an
// autovacuum worker) takes its CPU with it; one started during it counts whole. Before, this
// summed every postgres process in 10 ms ticks, so a backend that exited during the phase
// (another database's connection) made the figure negative.
func postgresCPU(ctx context.Context) map[int]time.Duration {
	cpu := map[int]time.Duration{}
	for _, pid := range backendPIDs(ctx) {
		if d, ok := readBackendCPU(pid); ok { // a backend gone before its read is left out
			cpu[pid] = d
		}
	}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return cpu
	}
	for _, e := range ents {
		if e.Name()[0] < '0' || e.Name()[0] > '9' {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err != nil || !pgServerProcess(string(b)) {
			continue
		}
		if pid, err := strconv.Atoi(e.Name()); err == nil {
			if d, ok := readBackendCPU(pid); ok {
				cpu[pid] = d
			}
		}
	}
	return cpu
}

// pgServerProcess tells whether a /proc/<pid>/cmdline is one of PostgreSQL's background
// processes that work for every database ("postgres: 15/main: walwriter ").
func pgServerProcess(cmdline string) bool {
	if !strings.HasPrefix(cmdline, "postgres: ") {
		return false
	}
	for _, name := range []string{": walwriter", ": background writer", ": checkpointer", ": autovacuum "} {
		if strings.Contains(cmdline, name) {
			return true
		}
	}
	return false
}

// pgCPUSince is the CPU the processes of now spent since then (a pid new in now counts
// whole; one whose reading went down — a pid reused — counts from 0).
func pgCPUSince(then, now map[int]time.Duration) time.Duration {
	var d time.Duration
	for pid, cpu := range now {
		if was := then[pid]; cpu >= was {
			d += cpu - was
		} else {
			d += cpu
		}
	}
	return d
}

// readBackendCPU is backendCPU that says whether the process could be read.
func readBackendCPU(pid int) (time.Duration, bool) {
	if _, err := os.Stat("/proc/" + strconv.Itoa(pid)); err != nil {
		return 0, false
	}
	d := backendCPU(pid)
	if _, err := os.Stat("/proc/" + strconv.Itoa(pid)); err != nil {
		return 0, false // gone while it was read: its figure may be a failed read's 0
	}
	return d, true
}

// redisStats returns the total calls of INFO commandstats and used_cpu_sys+user.
func redisStats(ctx context.Context, rdb *redis.Client) (calls int64, cpu float64) {
	info, err := rdb.Info(ctx, "commandstats", "cpu").Result()
	if err != nil {
		return 0, 0
	}
	sc := bufio.NewScanner(strings.NewReader(info))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case strings.HasPrefix(line, "cmdstat_"):
			_, rest, _ := strings.Cut(line, "calls=")
			v, _, _ := strings.Cut(rest, ",")
			n, _ := strconv.ParseInt(v, 10, 64)
			calls += n
		case strings.HasPrefix(line, "used_cpu_sys:"), strings.HasPrefix(line, "used_cpu_user:"):
			_, v, _ := strings.Cut(line, ":")
			f, _ := strconv.ParseFloat(v, 64)
			cpu += f
		}
	}
	return calls, cpu
}

// redisCounter counts round trips of one go-redis client: each command sent alone and
// each pipeline (or MULTI/EXEC) counts one.
type redisCounter struct{ n atomic.Int64 }

func (c *redisCounter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (c *redisCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error { c.n.Add(1); return next(ctx, cmd) }
}
func (c *redisCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error { c.n.Add(1); return next(ctx, cmds) }
}

var _ redis.Hook = (*redisCounter)(nil)

// pgCounter counts PostgreSQL round trips: each query, each batch (one round trip however
// many statements it pipelines) and each COPY.
type pgCounter struct{ n atomic.Int64 }

func (c *pgCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}
func (c *pgCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (c *pgCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	c.n.Add(1)
	return ctx
}
func (c *pgCounter) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (c *pgCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}
func (c *pgCounter) TraceCopyFromStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceCopyFromStartData) context.Context {
	c.n.Add(1)
	return ctx
}
func (c *pgCounter) TraceCopyFromEnd(context.Context, *pgx.Conn, pgx.TraceCopyFromEndData) {}

var (
	_ pgx.QueryTracer    = (*pgCounter)(nil)
	_ pgx.BatchTracer    = (*pgCounter)(nil)
	_ pgx.CopyFromTracer = (*pgCounter)(nil)
)

// freePort returns a free loopback TCP port.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
