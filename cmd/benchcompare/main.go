// Command benchcompare measures the idemscrape runner against a hand-written asynq + colly
// worker doing the same work (issue 11, item 3), alternating the two, each run in its own
// process with its own PostgreSQL database and its own throwaway redis-server.
//
// Modes (-modes):
//
//   - b1: end to end through the same local forward proxy (testutil.FakeProxy) with a new
//     sticky session and a new collector per job, fetching one 8 KiB page of
//     testutil.FakeSite; ours is a handlers.Registry as a user runs it by default (robots.txt
//     honoured through its shared Redis cache; -robots=false turns that off), the peer a
//     bare asynq handler with a new colly collector per job on colly's defaults (robots.txt
//     ignored: one request per job) and one INSERT … ON CONFLICT DO NOTHING.
//   - b1robots (extra, not in the default set): b1 with a peer that honours robots.txt
//     (colly IgnoreRobotsTxt = false), i.e. fetches it through the session on every job.
//   - direct: ours as in b1 against the peer with one shared keep-alive collector and no
//     proxy — what per-job sessions cost.
//   - proto: protocol only — ours with a workflow that sends no request, the peer with
//     only the INSERT.
//   - b3, b3g: commits alone from -concurrency goroutines: the runner's fenced commit (job +
//     result + outbox + attempt; b3 one statement per job, b3g through a
//     store.GroupCommitter) against one INSERT … ON CONFLICT DO NOTHING per job.
//   - b5: enqueue of N specs with EnqueueMany when every job already exists ("ours" column:
//     duplicate) against N fresh ones ("peer" column: fresh).
//   - b2: the lease alone: Take + ReleaseCommitted (the runner's) against SET NX PX + DEL.
//   - b4: dispatch: outbox.Dispatcher.DispatchOnce of N committed rows against raw
//     pipelined XADDs of the same entries; then the lag from a grouped commit's return to
//     its stream entry (p50, p99) with a listening dispatcher, printed below the table.
//   - b6: Redis bytes per pending job (INFO memory used_memory delta): EnqueueMany against
//     a bare asynq Enqueue of the same spec; printed below the table.
//   - b7: the fetch alone through the proxy, new session per fetch: NewSession +
//     NewCollector + Get against a new colly collector per fetch (robots.txt off on both).
//
// Usage:
//
//	go run ./cmd/benchcompare -n 2000 -pairs 5 -concurrency 20,50 -modes b1,direct,proto,b5
//
// -peer-cmd PROGRAM checks the peer against a separately written one: the table's "ours"
// column is then this tool's peer and its "peer" column PROGRAM, run in the peer's place
// (same flags, same environment, same harness) and alternated with it.
//
// The table shows, per mode and concurrency, the medians over the pairs, the ratio of
// the medians (ours / peer) and the min–max of the per-pair ratios.
package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/testutil"
)

// proxyPassEnv carries the fake proxy's password to child processes (never a flag, so it
// is not in the process list).
const proxyPassEnv = "BENCHCOMPARE_PROXY_PASS"

// dbComment marks the databases this tool creates; it drops only databases carrying it.
const dbComment = "idemscrape benchcompare scratch database"

// allModes are the modes in table order.
var allModes = []string{"b1", "b1robots", "direct", "proto", "river", "riverfast", "b2", "b3", "b3g", "b4", "b5", "b6", "b7"}

// defaultModes are the modes run without -modes: all but the extra b1robots.
var defaultModes = slices.DeleteFunc(slices.Clone(allModes), func(m string) bool { return m == "b1robots" })

// fetchModes fetch from the fake site; the parent reports their site requests per job.
var fetchModes = []string{"b1", "b1robots", "direct", "river", "riverfast", "b7"}

// boxModes run jobs end to end; the parent prints their whole-box CPU per job.
var boxModes = []string{"b1", "b1robots", "direct", "proto", "river", "riverfast"}

// isRiverMode reports whether mode's peer is River (river: River's defaults; riverfast:
// its fastest documented poll); ours runs as in b1.
func isRiverMode(mode string) bool { return mode == "river" || mode == "riverfast" }

// peerCmdModes are the modes whose peer -peer-cmd can replace (an asynq handler's).
var peerCmdModes = []string{"b1", "b1robots", "direct", "proto"}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "benchcompare:", err)
		os.Exit(1)
	}
}

// options are the parent's flags.
type options struct {
	n       int
	pairs   int
	conc    []int
	modes   []string
	robots  bool
	pgDSN   string
	verbose bool
	runID   string // names this run's databases: idemscrape_bc_<runID>_*
	profDir string // if set, every child writes a CPU profile of its measured phase here
	peerCmd string // if set, the columns are this tool's peer ("ours") and this program ("peer")
	// siteDelay, if positive, makes the site answer every page request after it (the
	// residential-latency mode, e.g. 300ms with -concurrency 200).
	siteDelay time.Duration
	// pgConns is the pgx pool size of every run, both sides (0: the run's concurrency + 10).
	pgConns int
}

func run(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("benchcompare", flag.ContinueOnError)
	var o options
	var concList, modeList string
	fs.IntVar(&o.n, "n", 1000, "jobs per run")
	fs.IntVar(&o.pairs, "pairs", 5, "alternating (ours, peer) pairs per mode and concurrency")
	fs.StringVar(&concList, "concurrency", "20,50", "comma-separated asynq concurrencies")
	fs.StringVar(&modeList, "modes", strings.Join(defaultModes, ","), "comma-separated modes: "+strings.Join(allModes, ", "))
	fs.BoolVar(&o.robots, "robots", true, "ours honours robots.txt (idemscrape's default); the peer ignores it in b1/direct (colly's default) and honours it in b1robots")
	fs.StringVar(&o.peerCmd, "peer-cmd", "", "program run in the peer's place, with the peer's flags and environment, to check the peer against a separately written one; the columns become ours = this tool's peer, peer = the program (modes "+strings.Join(peerCmdModes, ", ")+")")
	fs.StringVar(&o.pgDSN, "pg", testutil.PGAdminDSN(), "PostgreSQL DSN of a role that may CREATE DATABASE")
	fs.DurationVar(&o.siteDelay, "site-delay", 0, "the site answers every page request after this long (residential latency, e.g. -site-delay 300ms -concurrency 200); 0: at once")
	fs.IntVar(&o.pgConns, "pg-conns", 0, "PostgreSQL pool size (pgx MaxConns) of every run, both sides; 0: concurrency + 10. At -concurrency 200 the default exceeds PostgreSQL's default max_connections (100)")
	fs.BoolVar(&o.verbose, "v", false, "print every run")
	fs.StringVar(&o.profDir, "cpuprofile", "", "directory: every run writes the CPU profile of its measured phase there (<mode>-<side>-c<c>-<run>.pprof)")
	fs.StringVar(&o.runID, "runid", randomHex(4), "names this run's databases idemscrape_bc_<runid>_* ([a-z0-9])")
	// -child runs one measured run in this process (the parent re-executes itself).
	child := fs.String("child", "", "internal: run one measurement (mode/side)")
	var cs runSpec
	fs.IntVar(&cs.Conc, "c", 20, "internal: concurrency of a child run")
	fs.StringVar(&cs.RedisAddr, "redis", "", "internal: redis address of a child run")
	fs.StringVar(&cs.DSN, "dsn", "", "internal: database DSN of a child run")
	fs.StringVar(&cs.Page, "page", "", "internal: page URL of a child run")
	fs.StringVar(&cs.ProxyAddr, "proxy", "", "internal: proxy address of a child run")
	fs.StringVar(&cs.ProxyUser, "proxyuser", "", "internal: proxy account of a child run")
	fs.StringVar(&cs.Profile, "profile", "", "internal: CPU profile file of a child run")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *child != "" {
		cs.Mode, cs.Side, _ = strings.Cut(*child, "/")
		cs.N, cs.Robots, cs.ProxyPass, cs.PGConns = o.n, o.robots, os.Getenv(proxyPassEnv), o.pgConns
		res, err := runChild(ctx, cs)
		if err != nil {
			return err
		}
		return json.NewEncoder(out).Encode(res)
	}
	for _, s := range strings.Split(concList, ",") {
		c, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || c < 1 {
			return fmt.Errorf("-concurrency: %q is not a positive integer", s)
		}
		o.conc = append(o.conc, c)
	}
	for _, m := range strings.Split(modeList, ",") {
		m = strings.TrimSpace(m)
		if !slices.Contains(allModes, m) {
			return fmt.Errorf("-modes: %q is not one of %s", m, strings.Join(allModes, ", "))
		}
		o.modes = append(o.modes, m)
	}
	for _, r := range o.runID {
		if (r < 'a' || r > 'z') && (r < '0' || r > '9') {
			return fmt.Errorf("-runid: %q has characters outside [a-z0-9]", o.runID)
		}
	}
	if o.profDir != "" {
		if err := os.MkdirAll(o.profDir, 0o755); err != nil {
			return fmt.Errorf("-cpuprofile: %w", err)
		}
	}
	if o.peerCmd != "" {
		for _, m := range o.modes {
			if !slices.Contains(peerCmdModes, m) {
				return fmt.Errorf("-peer-cmd: mode %q has no replaceable peer (only %s)", m, strings.Join(peerCmdModes, ", "))
			}
		}
	}
	if o.pgConns < 0 {
		return fmt.Errorf("-pg-conns: %d is negative", o.pgConns)
	}
	if o.siteDelay < 0 {
		return fmt.Errorf("-site-delay: %s is negative", o.siteDelay)
	}
	if o.n < 1 || o.pairs < 1 {
		return fmt.Errorf("-n and -pairs must be at least 1 (got %d, %d)", o.n, o.pairs)
	}
	return parent(ctx, o, out)
}

// parent starts the fake site and proxy, runs every (mode, concurrency) pair set and
// prints the table. The fakes live in this process, so a child's CPU is the worker's only.
func parent(ctx context.Context, o options, out io.Writer) (err error) {
	if err := checkConnections(ctx, o); err != nil {
		return err
	}
	tb, err := testutil.NewProcessTB("benchcompare")
	if err != nil {
		return err
	}
	defer tb.Close()
	defer testutil.RecoverFatal(&err)
	self, err := os.Executable()
	if err != nil {
		return err
	}
	pass := "bc" + randomHex(8)
	site := testutil.NewFakeSite(tb, testutil.FakeSiteConfig{BigSize: 8 << 10})
	site.SetSlow(o.siteDelay) // robots.txt answers at once
	proxy := testutil.NewFakeProxy(tb, testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: "acct", Password: pass})
	runID := o.runID
	tpl, err := createTemplate(ctx, o.pgDSN, "idemscrape_bc_"+runID+"_tpl")
	if err != nil {
		return err
	}
	defer dropMarked(context.WithoutCancel(ctx), o.pgDSN, tpl)

	started := time.Now()
	var rows []tableRow
	seq := 0
	for _, mode := range o.modes {
		concs := o.conc
		if mode == "b5" || mode == "b6" {
			concs = []int{0} // enqueue has no worker concurrency
		}
		for _, c := range concs {
			row := tableRow{mode: mode, conc: c}
			for p := 0; p < o.pairs; p++ {
				columns := []string{"ours", "peer"} // the table's two columns
				if o.peerCmd != "" {
					columns = []string{"peer", "ext"}
				}
				sides := columns
				if p%2 == 1 { // alternate which side goes first
					sides = []string{columns[1], columns[0]}
				}
				var pair [2]runResult
				for _, side := range sides {
					seq++
					page0, robots0 := site.Hits("/big"), site.RobotsHits()
					res, err := oneRun(ctx, self, o, tpl, fmt.Sprintf("idemscrape_bc_%s_%d", runID, seq), runSpec{
						Mode: mode, Side: side, Conc: max(c, 1), Page: site.URL + "/big", ProxyAddr: proxy.Addr, ProxyUser: "acct", ProxyPass: pass,
					})
					if err != nil {
						return fmt.Errorf("%s c=%d pair %d %s: %w", mode, c, p+1, side, err)
					}
					pageHits, robotsHits := site.Hits("/big")-page0, site.RobotsHits()-robots0
					if err := checkRobots(mode, side, o.n, robotsHits); err != nil {
						return fmt.Errorf("%s c=%d pair %d: %w", mode, c, p+1, err)
					}
					res.SitePagePerJob, res.SiteRobotsPerJob = float64(pageHits)/float64(res.Jobs), float64(robotsHits)/float64(res.Jobs)
					if o.verbose {
						fmt.Fprintf(os.Stderr, "%-9s c=%-3d pair %d %-4s %8.0f jobs/s %7.0f µs CPU/job %6d page + %5d robots.txt requests\n", mode, c, p+1, side, res.JobsPerSec, res.CPUPerJobUS, pageHits, robotsHits)
					}
					pair[slices.Index(columns, side)] = res
				}
				row.ours = append(row.ours, pair[0])
				row.peer = append(row.peer, pair[1])
			}
			rows = append(rows, row)
		}
	}
	host, _ := os.Hostname()
	fmt.Fprintf(out, "benchcompare: N=%d, %d pairs, ours robots=%v, site delay %s, %d CPUs, %s, %s\n", o.n, o.pairs, o.robots, o.siteDelay, numCPU(), host, time.Since(started).Round(time.Second))
	if o.peerCmd != "" {
		fmt.Fprintf(out, "columns: ours = this tool's peer, peer = -peer-cmd %s\n", filepath.Base(o.peerCmd))
	}
	printTable(out, rows)
	printBoxTable(out, rows)
	printExtras(out, rows)
	return nil
}

// checkConnections fails before the first run when a run's pool could never get its
// connections from the server (more than max_connections less the superuser reserve): a
// run would see "too many clients" and its jobs retry, which measures the server's limit
// rather than the worker. It does not count the connections open now: on a shared box
// that figure moves, and a pool opens its connections only as the run needs them.
func checkConnections(ctx context.Context, o options) error {
	conn, err := pgx.Connect(ctx, o.pgDSN)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var maxConns, reserved int
	if err := conn.QueryRow(ctx, `SELECT current_setting('max_connections')::int, current_setting('superuser_reserved_connections')::int`).Scan(&maxConns, &reserved); err != nil {
		return err
	}
	for _, c := range o.conc {
		if need := poolSize(o.pgConns, c); need > maxConns-reserved {
			return fmt.Errorf("-concurrency %d: a run's pool of %d connections exceeds PostgreSQL's max_connections (%d, %d of them reserved); pass a smaller -pg-conns (both sides get it)", c, need, maxConns, reserved)
		}
	}
	return nil
}

// poolSize is a run's pgx MaxConns: -pg-conns, or the concurrency + 10.
func poolSize(pgConns, conc int) int {
	if pgConns > 0 {
		return pgConns
	}
	return conc + 10
}

// checkRobots fails a run whose peer did not do with robots.txt what its mode says: the
// b1 and direct peers (and a -peer-cmd program in their place) use colly's default and
// never fetch it; the b1robots peer fetches it on every job.
func checkRobots(mode, side string, n, robotsHits int) error {
	if side == "ours" {
		return nil
	}
	switch {
	case (mode == "b1" || mode == "direct" || mode == "b7" || isRiverMode(mode)) && robotsHits != 0:
		return fmt.Errorf("%s fetched robots.txt %d times; this peer ignores it (colly's default)", side, robotsHits)
	case mode == "b1robots" && robotsHits < n:
		return fmt.Errorf("%s fetched robots.txt %d times for %d jobs; this peer fetches it per job", side, robotsHits, n)
	}
	return nil
}

// oneRun creates the run's database and redis-server, runs the child process and removes
// both.
func oneRun(ctx context.Context, self string, o options, tpl, db string, s runSpec) (runResult, error) {
	if err := createFromTemplate(ctx, o.pgDSN, db, tpl); err != nil {
		return runResult{}, err
	}
	defer dropMarked(context.WithoutCancel(ctx), o.pgDSN, db)
	rs, err := startRedisServer(ctx)
	if err != nil {
		return runResult{}, err
	}
	defer rs.stop()
	cfg, err := pgx.ParseConfig(o.pgDSN)
	if err != nil {
		return runResult{}, err
	}
	dsn := dsnWithDatabase(o.pgDSN, cfg.Database, db)
	args := []string{"-child", s.Mode + "/" + s.Side, "-n", strconv.Itoa(o.n), "-c", strconv.Itoa(s.Conc),
		"-robots=" + strconv.FormatBool(o.robots), "-redis", rs.addr, "-dsn", dsn, "-page", s.Page,
		"-proxy", s.ProxyAddr, "-proxyuser", s.ProxyUser}
	if o.pgConns > 0 {
		args = append(args, "-pg-conns", strconv.Itoa(o.pgConns))
	}
	if o.profDir != "" {
		args = append(args, "-profile", filepath.Join(o.profDir, fmt.Sprintf("%s-%s-c%d-%s.pprof", s.Mode, s.Side, s.Conc, db)))
	}
	if s.Side == "ext" { // -peer-cmd in the peer's place, with the peer's flags
		args[1] = s.Mode + "/peer"
		self = o.peerCmd
	}
	cmd := exec.CommandContext(ctx, self, args...)
	cmd.Env = append(os.Environ(), proxyPassEnv+"="+s.ProxyPass)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return runResult{}, fmt.Errorf("child: %w: %s", err, strings.TrimSpace(stderr.String()))
	}
	var res runResult
	if err := json.Unmarshal(stdout.Bytes(), &res); err != nil {
		return runResult{}, fmt.Errorf("child output %q: %w", stdout.String(), err)
	}
	return res, nil
}

// dsnWithDatabase returns dsn pointing at database db. It handles URL DSNs and key=value
// DSNs.
func dsnWithDatabase(dsn, current, db string) string {
	if strings.Contains(dsn, "://") {
		i := strings.Index(dsn, "://")
		rest := dsn[i+3:]
		q := ""
		if j := strings.IndexByte(rest, '?'); j >= 0 {
			rest, q = rest[:j], rest[j:]
		}
		if j := strings.IndexByte(rest, '/'); j >= 0 {
			rest = rest[:j]
		}
		return dsn[:i+3] + rest + "/" + db + q
	}
	return dsn + " dbname=" + db
}

func createTemplate(ctx context.Context, adminDSN, name string) (string, error) {
	if err := createDB(ctx, adminDSN, name, ""); err != nil {
		return "", err
	}
	cfg, err := pgx.ParseConfig(adminDSN)
	if err != nil {
		return "", err
	}
	pool, err := pgxpool.New(ctx, dsnWithDatabase(adminDSN, cfg.Database, name))
	if err == nil {
		_, err = store.Migrate(ctx, pool, nil)
		pool.Close()
	}
	if err != nil {
		dropMarked(context.WithoutCancel(ctx), adminDSN, name)
		return "", fmt.Errorf("migrate %s: %w", name, err)
	}
	return name, nil
}

func createFromTemplate(ctx context.Context, adminDSN, name, tpl string) error {
	return createDB(ctx, adminDSN, name, tpl)
}

// createDB creates a database and marks it with dbComment.
func createDB(ctx context.Context, adminDSN, name, tpl string) error {
	conn, err := pgx.Connect(ctx, adminDSN)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	q := "CREATE DATABASE " + pgx.Identifier{name}.Sanitize()
	if tpl != "" {
		q += " TEMPLATE " + pgx.Identifier{tpl}.Sanitize()
	}
	if _, err := conn.Exec(ctx, q); err != nil {
		return fmt.Errorf("create database %s: %w", name, err)
	}
	if _, err := conn.Exec(ctx, fmt.Sprintf("COMMENT ON DATABASE %s IS '%s'", pgx.Identifier{name}.Sanitize(), dbComment)); err != nil {
		return fmt.Errorf("comment on database %s: %w", name, err)
	}
	return nil
}

// dropMarked drops database name if, and only if, it carries dbComment.
func dropMarked(ctx context.Context, adminDSN, name string) {
	conn, err := pgx.Connect(ctx, adminDSN)
	if err != nil {
		fmt.Fprintf(os.Stderr, "benchcompare: drop %s: %v\n", name, err)
		return
	}
	defer conn.Close(ctx)
	var comment *string
	err = conn.QueryRow(ctx, `SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = $1`, name).Scan(&comment)
	if err != nil || comment == nil || *comment != dbComment {
		fmt.Fprintf(os.Stderr, "benchcompare: not dropping %s: not marked as ours (%v)\n", name, err)
		return
	}
	if _, err := conn.Exec(ctx, "DROP DATABASE "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
		fmt.Fprintf(os.Stderr, "benchcompare: drop %s: %v\n", name, err)
	}
}

// redisServer is a throwaway redis-server this tool started.
type redisServer struct {
	addr string
	dir  string
	cmd  *exec.Cmd
}

func startRedisServer(ctx context.Context) (*redisServer, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "benchcompare-redis")
	if err != nil {
		return nil, err
	}
	rs := &redisServer{addr: "127.0.0.1:" + strconv.Itoa(port), dir: dir}
	rs.cmd = exec.Command("redis-server", "--bind", "127.0.0.1", "--port", strconv.Itoa(port),
		"--save", "", "--appendonly", "no", "--dir", dir, "--logfile", filepath.Join(dir, "redis.log"))
	if err := rs.cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("start redis-server: %w", err)
	}
	c := redis.NewClient(&redis.Options{Addr: rs.addr})
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for c.Ping(ctx).Err() != nil {
		if time.Now().After(deadline) || ctx.Err() != nil {
			rs.stop()
			return nil, fmt.Errorf("redis-server on %s did not answer within 10s", rs.addr)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return rs, nil
}

// stop kills the server this tool started (by its pid) and removes its directory.
func (rs *redisServer) stop() {
	if rs.cmd != nil && rs.cmd.Process != nil {
		_ = rs.cmd.Process.Kill()
		_ = rs.cmd.Wait()
	}
	os.RemoveAll(rs.dir)
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
