package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/cmd/internal/envflag"
	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// The worker, the scheduler and this CLI, built once for the tests that run all three
// (one `go build` for the three; removed by TestMain).
var (
	binsOnce sync.Once
	binsDir  string
	binsErr  error
)

// builtBinaries returns the directory holding worker, scheduler and idemscrape.
func builtBinaries(t *testing.T) string {
	t.Helper()
	binsOnce.Do(func() {
		if binsDir, binsErr = os.MkdirTemp("", "idemscrape-bins-"); binsErr != nil {
			return
		}
		out, err := exec.Command("go", "build", "-o", binsDir+string(filepath.Separator), "../worker", "../scheduler", ".").CombinedOutput()
		if err != nil {
			binsErr = fmt.Errorf("go build: %w: %s", err, out)
		}
	})
	require.NoError(t, binsErr)
	return binsDir
}

// binEnv is the environment of a binary run: this process's without its IDEMSCRAPE_ and
// USER variables (the test's own settings must not leak in), plus env.
func binEnv(env []string) []string {
	var out []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "IDEMSCRAPE_") && !strings.HasPrefix(kv, "USER=") {
			out = append(out, kv)
		}
	}
	return append(out, env...)
}

// runBinary runs bin to its end (within 2 minutes) and returns its exit status and stderr.
func runBinary(t *testing.T, bin string, env []string, args ...string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = binEnv(env)
	var stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = io.Discard, &stderr
	err := cmd.Run()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode(), stderr.String()
	}
	require.NoError(t, err, stderr.String())
	return 0, stderr.String()
}

// daemon is a worker or scheduler started by a test, its stderr read line by line.
type daemon struct {
	cmd   *exec.Cmd
	lines chan string
	mu    sync.Mutex
	log   strings.Builder
	done  chan int
}

func startDaemon(t *testing.T, bin string, env []string, args ...string) *daemon {
	t.Helper()
	d := &daemon{cmd: exec.Command(bin, args...), lines: make(chan string, 10_000), done: make(chan int, 1)}
	d.cmd.Env = binEnv(env)
	pipe, err := d.cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, d.cmd.Start())
	go func() {
		sc := bufio.NewScanner(pipe)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			d.mu.Lock()
			d.log.WriteString(sc.Text() + "\n")
			d.mu.Unlock()
			select {
			case d.lines <- sc.Text():
			default:
			}
		}
		err := d.cmd.Wait()
		code := 0
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code = ee.ExitCode()
		}
		d.done <- code
	}()
	t.Cleanup(func() {
		if d.cmd.ProcessState == nil {
			_ = d.cmd.Process.Kill()
		}
	})
	return d
}

func (d *daemon) stderr() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.log.String()
}

// waitLine waits for a log line containing s and returns it.
func (d *daemon) waitLine(t *testing.T, s string) string {
	t.Helper()
	timeout := time.After(90 * time.Second)
	for {
		select {
		case l := <-d.lines:
			if strings.Contains(l, s) {
				return l
			}
		case code := <-d.done:
			d.done <- code
			t.Fatalf("exited %d before logging %q:\n%s", code, s, d.stderr())
		case <-timeout:
			t.Fatalf("no line %q within 90s:\n%s", s, d.stderr())
		}
	}
}

// stop sends SIGTERM and returns the exit status.
func (d *daemon) stop(t *testing.T) int {
	t.Helper()
	require.NoError(t, d.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case code := <-d.done:
		return code
	case <-time.After(90 * time.Second):
		t.Fatalf("still running 90s after SIGTERM:\n%s", d.stderr())
		return -1
	}
}

// readmeExitTable reads the README's exit-status table: per status, the cell of the
// worker and scheduler (0) and of idemscrape (1).
func readmeExitTable(t *testing.T) map[int][2]string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "README.md"))
	require.NoError(t, err)
	table := map[int][2]string{}
	in := false
	for _, l := range strings.Split(string(b), "\n") {
		switch {
		case strings.HasPrefix(l, "| exit status |"):
			in = true
			require.Contains(t, l, "`cmd/worker`, `cmd/scheduler` | `idemscrape` |", "the table's columns")
			continue
		case !in:
			continue
		case !strings.HasPrefix(l, "|"):
			in = false
			continue
		case strings.HasPrefix(l, "|---"):
			continue
		}
		cells := strings.Split(strings.Trim(l, "|"), "|")
		require.Len(t, cells, 3, "a row of the exit-status table: %q", l)
		code, err := strconv.Atoi(strings.TrimSpace(cells[0]))
		require.NoError(t, err, "row %q", l)
		table[code] = [2]string{strings.TrimSpace(cells[1]), strings.TrimSpace(cells[2])}
	}
	require.NotEmpty(t, table, "no exit-status table in README.md")
	return table
}

// workerProxyEnv is a proxy account that parses (the worker never reaches it here).
var workerProxyEnv = []string{"IDEMSCRAPE_PROXY_PROVIDER=oxylabs", "IDEMSCRAPE_PROXY_USER=acct",
	"IDEMSCRAPE_PROXY_PASSWORD=pw-exit-codes", "IDEMSCRAPE_PROXY_GATEWAY=127.0.0.1:1"}

const deadPG = "postgres://postgres@127.0.0.1:1/nowhere?sslmode=disable&connect_timeout=2"

// exitCase is one claim of the README's table, run against a binary.
type exitCase struct {
	name   string
	bin    string // worker, scheduler or idemscrape
	code   int    // the row
	phrase string // the words of the row's cell this case checks
	// args and env of the run; for a daemon, the line that says it runs, then SIGTERM:
	// it must exit 0 (staysUp: with /readyz answering 503 first).
	args, env []string
	daemon    string
	staysUp   bool
	want      string // in stderr, when set
}

// TestReadmeExitCodes parses the README's exit-status table and runs every row against the
// built binaries: each cell (row × column) has at least one case, each case names the words
// of its cell it checks, and each binary exits with the row's status (a daemon: runs until
// SIGTERM, then 0; Redis unreachable at start: the worker stays up with /readyz 503).
func TestReadmeExitCodes(t *testing.T) {
	table := readmeExitTable(t)
	dir := builtBinaries(t)
	ctx := context.Background()

	pool := testutil.PG(t)
	ns := testutil.Redis(t)
	dsn := dsnOf(t, pool)
	tmp := t.TempDir()
	writeFile := func(name, text string) string {
		p := filepath.Join(tmp, name)
		require.NoError(t, os.WriteFile(p, []byte(text), 0o600))
		return p
	}
	quietCfg := writeFile("quiet.yaml", "reconciler:\n  disabled: true\n")
	badCfg := writeFile("bad.yaml", "templates:\n  - name: x\n    cron: \"not a cron\"\n")
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = busy.Close() }) // after the parallel subtests, unlike a defer
	workerArgs := func(extra ...string) []string {
		return append([]string{"-catalog-base", "http://127.0.0.1:1", "-allow-loopback", "-log-format", "json",
			"-queues", ns.Queue, "-key-prefix", ns.Prefix, "-stream-prefix", ns.Prefix, "-no-dispatcher",
			"-shutdown-timeout", "5s", "-drain-timeout", "5s"}, extra...)
	}
	workerEnv := func(extra ...string) []string {
		return append(append([]string{"IDEMSCRAPE_PG=" + dsn, "IDEMSCRAPE_REDIS=" + ns.Addr}, workerProxyEnv...), extra...)
	}
	schedEnv := func(extra ...string) []string {
		return append([]string{"IDEMSCRAPE_PG=" + dsn, "IDEMSCRAPE_REDIS=" + ns.Addr, "IDEMSCRAPE_KEY_PREFIX=" + ns.Prefix}, extra...)
	}
	cliEnv := func(extra ...string) []string {
		return append([]string{"IDEMSCRAPE_PG=" + dsn, "IDEMSCRAPE_REDIS=" + ns.Addr}, extra...)
	}

	// audit: a broken invariant (a result of a job that is not complete), in a database of
	// its own; windows -gaps: a template whose last window was 4 days ago.
	auditPool := testutil.PG(t)
	spec := tasks.Spec{Kind: catalog.Kind, SourceID: "sku-x", Country: "US", Window: "2026-04-23", ParserVersion: 1}
	key, err := spec.Key()
	require.NoError(t, err)
	_, err = store.New(auditPool).JobsRecord(ctx, []tasks.JobRecord{{Key: key, Spec: spec, Queue: ns.Queue}})
	require.NoError(t, err)
	_, err = auditPool.Exec(ctx, `INSERT INTO results (observation_key, job_key, parser_version, data, fence) VALUES ('orphan', $1, 1, '{}', 1)`, key)
	require.NoError(t, err)
	gapsCfg := writeFile("gaps.yaml", `templates:
  - name: daily
    cron: "@daily"
    window: daily
    kind: catalog
    catchup: none
    sources: {ids: [sku-1]}
    countries: [US]
    parser_version: 1
kinds:
  catalog: {queue: `+ns.Queue+`}
`)
	day := time.Now().UTC().Truncate(24*time.Hour).AddDate(0, 0, -4)
	_, err = pool.Exec(ctx, `INSERT INTO schedule_windows (template, "window", kind, due_at, state, enqueued_at)
VALUES ('daily', $1, 'catalog', $2, 'enqueued', $2)`, day.Format("2006-01-02"), day)
	require.NoError(t, err)

	keyArgs := []string{"key", "-kind", "catalog", "-source-id", "a", "-country", "US", "-window", "2026-04-23", "-parser-version", "1"}
	enqArgs := []string{"enqueue", "-kind", "catalog", "-source-id", "b", "-country", "US", "-window", "2026-04-23", "-parser-version", "1", "-queue", ns.Queue}
	cases := []exitCase{
		// 0
		{name: "worker SIGTERM", bin: "worker", code: 0, phrase: "clean shutdown after SIGTERM", args: workerArgs("-http", "127.0.0.1:0"), env: workerEnv(), daemon: "service started"},
		{name: "scheduler SIGTERM", bin: "scheduler", code: 0, phrase: "clean shutdown after SIGTERM", args: []string{"-config", quietCfg, "-http", "127.0.0.1:0", "-log-format", "json"}, env: schedEnv(), daemon: "scheduler running"},
		{name: "worker -h", bin: "worker", code: 0, phrase: "`-h`", args: []string{"-h"}},
		{name: "scheduler -h", bin: "scheduler", code: 0, phrase: "`-h`", args: []string{"-h"}},
		{name: "cli key", bin: "idemscrape", code: 0, phrase: "the command did what it says", args: keyArgs},
		{name: "cli -h", bin: "idemscrape", code: 0, phrase: "`-h`", args: []string{"-h"}},
		{name: "cli status -h", bin: "idemscrape", code: 0, phrase: "`-h`", args: []string{"status", "-h"}},
		// 1
		{name: "worker PG unreachable", bin: "worker", code: 1, phrase: "PostgreSQL unreachable at start", args: workerArgs(), env: append(workerEnv(), "IDEMSCRAPE_PG="+deadPG)},
		{name: "scheduler PG unreachable", bin: "scheduler", code: 1, phrase: "PostgreSQL unreachable at start", args: []string{"-config", quietCfg}, env: schedEnv("IDEMSCRAPE_PG=" + deadPG)},
		{name: "worker HTTP port taken", bin: "worker", code: 1, phrase: "the HTTP port taken", args: workerArgs("-http", busy.Addr().String()), env: workerEnv()},
		{name: "scheduler HTTP port taken", bin: "scheduler", code: 1, phrase: "the HTTP port taken", args: []string{"-config", quietCfg, "-http", busy.Addr().String()}, env: schedEnv()},
		{name: "worker Redis unreachable", bin: "worker", code: 1, phrase: "Redis unreachable is none: the worker stays up, `/readyz` 503", args: workerArgs("-http", "127.0.0.1:0", "-redis", "127.0.0.1:1"), env: workerEnv(), daemon: "service started", staysUp: true},
		{name: "cli audit broken", bin: "idemscrape", code: 1, phrase: "`audit`: a broken invariant", args: []string{"audit"}, env: []string{"IDEMSCRAPE_PG=" + dsnOf(t, auditPool), "IDEMSCRAPE_REDIS=" + ns.Addr, "IDEMSCRAPE_QUEUE=" + ns.Queue}, want: "result_has_complete_job"},
		{name: "cli windows gap", bin: "idemscrape", code: 1, phrase: "`windows -gaps`: a gap", args: []string{"windows", "-config", gapsCfg, "-gaps"}, env: cliEnv()},
		{name: "cli PG unreachable", bin: "idemscrape", code: 1, phrase: "PostgreSQL or Redis unreachable", args: []string{"status", key}, env: []string{"IDEMSCRAPE_PG=" + deadPG}},
		{name: "cli Redis unreachable", bin: "idemscrape", code: 1, phrase: "PostgreSQL or Redis unreachable", args: enqArgs, env: cliEnv("IDEMSCRAPE_REDIS=127.0.0.1:1"), want: "stored: the jobs row"},
		// 2
		{name: "worker bad flag", bin: "worker", code: 2, phrase: "a flag", args: []string{"-bogus"}},
		{name: "worker -http", bin: "worker", code: 2, phrase: "a flag", args: workerArgs("-http", "notanaddr"), env: workerEnv(), want: "-http"},
		{name: "worker leases", bin: "worker", code: 2, phrase: "a flag", args: workerArgs("-lease-min", "10m", "-lease-max", "1m"), env: workerEnv(), want: "-lease-min"},
		{name: "worker queues", bin: "worker", code: 2, phrase: "a flag", args: workerArgs("-queues", "asynq:{x}"), env: workerEnv(), want: "-queues"},
		{name: "scheduler bad flag", bin: "scheduler", code: 2, phrase: "a flag", args: []string{"-config", quietCfg, "-http", "notanaddr"}},
		{name: "worker bad env", bin: "worker", code: 2, phrase: "an environment variable", args: workerArgs(), env: workerEnv("IDEMSCRAPE_CONCURRENCY=many")},
		{name: "worker bad PG URL", bin: "worker", code: 2, phrase: "an environment variable", args: workerArgs(), env: workerEnv("IDEMSCRAPE_PG=postgres://%zz")},
		{name: "scheduler bad Redis", bin: "scheduler", code: 2, phrase: "an environment variable", args: []string{"-config", quietCfg}, env: schedEnv("IDEMSCRAPE_REDIS=redis://host:notaport")},
		{name: "worker PG secret file", bin: "worker", code: 2, phrase: "a secret file", args: workerArgs(), env: workerEnv("IDEMSCRAPE_PG_PASSWORD_FILE=/nonexistent/pg-pw")},
		{name: "worker proxy secret file", bin: "worker", code: 2, phrase: "a secret file", args: workerArgs(), env: []string{"IDEMSCRAPE_PROXY_PROVIDER=oxylabs", "IDEMSCRAPE_PROXY_USER=acct", "IDEMSCRAPE_PROXY_PASSWORD_FILE=/nonexistent/proxy-pw", "IDEMSCRAPE_PROXY_GATEWAY=127.0.0.1:1"}},
		{name: "scheduler bad config", bin: "scheduler", code: 2, phrase: "the configuration file", args: []string{"-config", badCfg}, env: schedEnv()},
		{name: "scheduler missing config", bin: "scheduler", code: 2, phrase: "the configuration file", args: []string{"-config", filepath.Join(tmp, "none.yaml")}, env: schedEnv()},
		{name: "cli unknown command", bin: "idemscrape", code: 2, phrase: "unknown command or flag", args: []string{"bogus"}},
		{name: "cli unknown flag", bin: "idemscrape", code: 2, phrase: "unknown command or flag", args: []string{"status", "-bogus", key}},
		{name: "cli stray argument", bin: "idemscrape", code: 2, phrase: "stray argument", args: append(keyArgs, "extra")},
		{name: "cli bad IDEMSCRAPE_PG", bin: "idemscrape", code: 2, phrase: "`IDEMSCRAPE_PG`", args: []string{"status", key}, env: []string{"IDEMSCRAPE_PG=postgres://%zz"}},
		{name: "cli PG password file", bin: "idemscrape", code: 2, phrase: "their password files", args: []string{"status", key}, env: cliEnv("IDEMSCRAPE_PG_PASSWORD_FILE=/nonexistent/pg-pw")},
		{name: "cli bad IDEMSCRAPE_REDIS", bin: "idemscrape", code: 2, phrase: "`IDEMSCRAPE_REDIS`", args: enqArgs, env: cliEnv("IDEMSCRAPE_REDIS=redis://host:notaport")},
		{name: "cli Redis password file", bin: "idemscrape", code: 2, phrase: "their password files", args: enqArgs, env: cliEnv("IDEMSCRAPE_REDIS_PASSWORD_FILE=/nonexistent/redis-pw")},
	}

	// Every cell has a case, and every case checks words its cell says.
	covered := map[[2]int]bool{}
	for _, c := range cases {
		col := 0
		if c.bin == "idemscrape" {
			col = 1
		}
		row, ok := table[c.code]
		require.True(t, ok, "%s: README has no row for exit status %d", c.name, c.code)
		require.Contains(t, row[col], c.phrase, "%s: the README's cell for %s, exit %d, must say it", c.name, c.bin, c.code)
		covered[[2]int{c.code, col}] = true
	}
	for code := range table {
		for col, what := range []string{"worker/scheduler", "idemscrape"} {
			assert.True(t, covered[[2]int{code, col}], "README exit %d for %s: no case runs it", code, what)
		}
	}

	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			bin := filepath.Join(dir, c.bin)
			if c.daemon == "" {
				code, stderr := runBinary(t, bin, c.env, c.args...)
				assert.Equal(t, c.code, code, "README says %d (%s); stderr:\n%s", c.code, c.phrase, stderr)
				if c.want != "" {
					assert.Contains(t, stderr, c.want)
				}
				return
			}
			d := startDaemon(t, bin, c.env, c.args...)
			line := d.waitLine(t, c.daemon)
			if c.staysUp {
				var v struct{ HTTP string }
				require.NoError(t, json.Unmarshal([]byte(line), &v), line)
				resp, err := http.Get("http://" + v.HTTP + "/readyz")
				require.NoError(t, err)
				_ = resp.Body.Close()
				assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
			}
			assert.Equal(t, 0, d.stop(t), "after SIGTERM; stderr:\n%s", d.stderr())
		})
	}
}

// TestBadSettingsLogJSON: under -log-format json (or IDEMSCRAPE_LOG_FORMAT=json) every
// line the worker, the scheduler and the CLI write for a bad setting is a JSON object with
// a level and a message — the flags' own errors included —, exit 2; the CLI's go-redis
// lines are JSON too; and a duration in a JSON log line is a string, not nanoseconds.
func TestBadSettingsLogJSON(t *testing.T) {
	dir := builtBinaries(t)
	tmp := t.TempDir()
	badCfg := filepath.Join(tmp, "bad.yaml")
	require.NoError(t, os.WriteFile(badCfg, []byte("templates:\n  - name: x\n    cron: \"not a cron\"\n"), 0o600))
	goodCfg := filepath.Join(tmp, "good.yaml")
	require.NoError(t, os.WriteFile(goodCfg, []byte("reconciler:\n  disabled: true\n"), 0o600))
	base := []string{"-catalog-base", "http://127.0.0.1:1", "-pg", deadPG}
	worker := map[string]struct{ args, env []string }{
		"no catalog base":      {[]string{"-pg", deadPG}, nil},
		"catalog base scheme":  {[]string{"-catalog-base", "ftp://x"}, nil},
		"concurrency":          {append(base, "-concurrency", "0"), nil},
		"shutdown timeout":     {append(base, "-shutdown-timeout", "0s"), nil},
		"lease margin":         {append(base, "-lease-margin", "0.5"), nil},
		"queue weight":         {append(base, "-queues", "a:0"), nil},
		"queue name":           {append(base, "-queues", "a{b}"), nil},
		"http":                 {append(base, "-http", "notanaddr"), nil},
		"lease min max":        {append(base, "-lease-min", "10m", "-lease-max", "1m"), nil},
		"lease default":        {append(base, "-lease-default", "100h"), nil},
		"job byte budget":      {append(base, "-job-byte-budget", "0"), nil},
		"window action":        {append(base, "-window-budget-action", "shrug"), nil},
		"window defer":         {append(base, "-window-defer-for", "0s"), nil},
		"window budget":        {append(base, "-window-budget", "lots"), nil},
		"window budget price":  {append(base, "-window-budget", "5 USD"), nil},
		"saved inputs":         {append(base, "-saved-inputs", "sometimes"), nil},
		"pool max units":       {append(base, "-session-pool-max-units", "0"), nil},
		"pool min remaining":   {append(base, "-session-pool-min-remaining", "0s"), nil},
		"header profiles":      {append(base, "-header-profiles", "chrome,opera"), nil},
		"redis url":            {append(base, "-redis", "redis://x:notaport"), nil},
		"redis twice":          {append(base, "-redis", "127.0.0.1:1", "-redis-cluster", "127.0.0.1:2"), nil},
		"redis tls ca":         {append(base, "-redis", "rediss://127.0.0.1:1", "-redis-tls-ca", "/nonexistent/ca.pem"), nil},
		"stream trim":          {append(base, "-stream-trim", "sometimes"), nil},
		"stream max len":       {append(base, "-stream-max-len", "5"), nil},
		"log level":            {append(base, "-log-level", "loud"), nil},
		"unknown flag":         {append(base, "-bogus"), nil},
		"flag value":           {append(base, "-concurrency", "many"), nil},
		"positional":           {append(base, "stray"), nil},
		"env value":            {base, []string{"IDEMSCRAPE_CONCURRENCY=many"}},
		"no proxy":             {base, []string{"IDEMSCRAPE_PROXY_PROVIDER="}},
		"proxy secret file":    {base, []string{"IDEMSCRAPE_PROXY_PASSWORD=", "IDEMSCRAPE_PROXY_PASSWORD_FILE=/nonexistent/pw"}},
		"pg secret file":       {base, []string{"IDEMSCRAPE_PG_PASSWORD_FILE=/nonexistent/pw"}},
		"pg url":               {[]string{"-catalog-base", "http://127.0.0.1:1", "-pg", "postgres://%zz"}, nil},
		"failpoints":           {base, []string{"IDEMSCRAPE_FAILPOINTS=bogus"}},
		"retry scale":          {base, []string{"IDEMSCRAPE_CHAOS_RETRY_SCALE=5"}},
		"exposed http":         {append(base, "-http", "0.0.0.0:0"), nil},
		"basic auth half":      {base, []string{"IDEMSCRAPE_HTTP_USER=ops"}},
		"proxy price":          {base, []string{"IDEMSCRAPE_PROXY_PRICE=cheap"}},
		"redis password twice": {append(base, "-redis", "redis://:pw@127.0.0.1:1"), []string{"IDEMSCRAPE_REDIS_PASSWORD=pw2"}},
	}
	scheduler := map[string]struct{ args, env []string }{
		"no config":       {nil, nil},
		"missing config":  {[]string{"-config", filepath.Join(tmp, "none.yaml")}, nil},
		"bad config":      {[]string{"-config", badCfg}, nil},
		"http":            {[]string{"-config", goodCfg, "-http", "notanaddr"}, nil},
		"unknown flag":    {[]string{"-config", goodCfg, "-bogus"}, nil},
		"positional":      {[]string{"-config", goodCfg, "stray"}, nil},
		"redis":           {[]string{"-config", goodCfg}, []string{"IDEMSCRAPE_REDIS=redis://x:notaport"}},
		"env value":       {[]string{"-config", goodCfg}, []string{"IDEMSCRAPE_NO_SCHEDULER=perhaps"}},
		"log level":       {[]string{"-config", goodCfg, "-log-level", "loud"}, nil},
		"pg url":          {[]string{"-config", goodCfg, "-pg", "postgres://%zz"}, nil},
		"pg secret file":  {[]string{"-config", goodCfg, "-pg", deadPG}, []string{"IDEMSCRAPE_PG_PASSWORD_FILE=/nonexistent/pw"}},
		"redis tls files": {[]string{"-config", goodCfg, "-redis-tls-ca", "/nonexistent/ca.pem"}, nil},
	}
	enq := []string{"enqueue", "-kind", "catalog", "-source-id", "a", "-country", "US", "-window", "2026-04-23", "-parser-version", "1"}
	cli := map[string]struct{ args, env []string }{
		"unknown command": {[]string{"bogus"}, nil},
		"no command":      {nil, nil},
		"unknown flag":    {[]string{"status", "-bogus", "k"}, nil},
		"stray argument":  {[]string{"status", "a", "b"}, nil},
		"bad queue":       {append(enq, "-queue", "{x}"), nil},
		"bad spec":        {[]string{"enqueue", "-kind", "catalog"}, nil},
		"pg url":          {[]string{"status", "k"}, []string{"IDEMSCRAPE_PG=postgres://%zz"}},
		"pg secret file":  {[]string{"status", "k"}, []string{"IDEMSCRAPE_PG_PASSWORD_FILE=/nonexistent/pw"}},
		"redis url":       {enq, []string{"IDEMSCRAPE_REDIS=redis://x:notaport"}},
	}
	type run struct {
		bin, name string
		args, env []string
		code      int
	}
	var runs []run
	i := 0
	for name, c := range worker {
		// Half ask with the flag, half with the environment.
		args, env := c.args, append(append([]string{}, workerProxyEnv...), c.env...)
		if i++; i%2 == 0 {
			args = append(append([]string{}, args...), "-log-format", "json")
		} else {
			env = append(env, "IDEMSCRAPE_LOG_FORMAT=json")
		}
		if name == "positional" { // the flag must come before the stray argument
			args = append([]string{"-log-format=json"}, c.args...)
		}
		runs = append(runs, run{"worker", name, args, env, 2})
	}
	for name, c := range scheduler {
		args := append([]string{"-log-format", "json"}, c.args...)
		runs = append(runs, run{"scheduler", name, args, append([]string{"IDEMSCRAPE_PG=" + deadPG}, c.env...), 2})
	}
	for name, c := range cli {
		runs = append(runs, run{"idemscrape", name, c.args, append([]string{"IDEMSCRAPE_LOG_FORMAT=json", "IDEMSCRAPE_PG=" + deadPG}, c.env...), 2})
	}
	// Not a bad setting: Redis unreachable after the row is stored — go-redis's own lines.
	pool := testutil.PG(t)
	runs = append(runs, run{"idemscrape", "redis down", append(enq, "-queue", "q"+testutil.RandomID(4)),
		[]string{"IDEMSCRAPE_LOG_FORMAT=json", "IDEMSCRAPE_PG=" + dsnOf(t, pool), "IDEMSCRAPE_REDIS=127.0.0.1:1"}, 1})

	for _, r := range runs {
		t.Run(r.bin+"/"+r.name, func(t *testing.T) {
			t.Parallel()
			code, stderr := runBinary(t, filepath.Join(dir, r.bin), r.env, r.args...)
			assert.Equal(t, r.code, code, stderr)
			require.NotEmpty(t, strings.TrimSpace(stderr), "it says why")
			for _, l := range strings.Split(strings.TrimRight(stderr, "\n"), "\n") {
				var rec map[string]any
				if assert.NoError(t, json.Unmarshal([]byte(l), &rec), "not a JSON line: %q", l) {
					assert.Contains(t, rec, "level", l)
					assert.Contains(t, rec, "msg", l)
				}
			}
		})
	}

	t.Run("durations are strings", func(t *testing.T) {
		var buf bytes.Buffer
		envflag.Log{Format: "json", Level: "info"}.Logger(&buf).Info("x", "lease", 90*time.Second)
		assert.Contains(t, buf.String(), `"lease":"1m30s"`)
	})
}
