package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/cmd/internal/envflag"
	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/service"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/inputs"
	"github.com/idemscrape/idemscrape/store/outbox"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

const proxyPassword = "pw-never-logged-7f3a"

// buildWorker builds this command into a temporary directory.
func buildWorker(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "worker")
	cmd := exec.Command("go", "build", "-o", bin, ".")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "go build: %s", out)
	return bin
}

// dsnOf returns the URL of the test database behind pool.
func dsnOf(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	u, err := url.Parse(testutil.PGAdminDSN())
	require.NoError(t, err, "IDEMSCRAPE_TEST_PG must be a URL for this test")
	u.Path = "/" + pool.Config().ConnConfig.Database
	return u.String()
}

// gate is the shop as the worker sees it: it forwards to the fake site, but holds every
// price request until release is closed, and reports each held request on held.
type gate struct {
	srv     *httptest.Server
	held    chan string
	release chan struct{}
	once    sync.Once
}

func newGate(t *testing.T, site *testutil.FakeSite) *gate {
	target, err := url.Parse(site.URL)
	require.NoError(t, err)
	rp := httputil.NewSingleHostReverseProxy(target)
	g := &gate{held: make(chan string, 100), release: make(chan struct{})}
	g.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/api/price/") {
			g.held <- r.URL.Path
			select {
			case <-g.release:
			case <-r.Context().Done():
				return
			}
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(g.srv.Close)
	t.Cleanup(g.open) // runs before Close: no handler stays blocked
	return g
}

func (g *gate) open() { g.once.Do(func() { close(g.release) }) }

// waitHeld waits until n price requests are held.
func (g *gate) waitHeld(t *testing.T, n int) {
	t.Helper()
	timeout := time.After(60 * time.Second)
	for i := 0; i < n; i++ {
		select {
		case <-g.held:
		case <-timeout:
			t.Fatalf("only %d of %d jobs reached the price step", i, n)
		}
	}
}

// worker is a running worker subprocess.
type worker struct {
	cmd    *exec.Cmd
	mu     sync.Mutex
	stderr bytes.Buffer
	lines  chan string
	done   chan error
}

func startWorker(t *testing.T, bin string, args []string, env []string) *worker {
	t.Helper()
	w := &worker{cmd: exec.Command(bin, args...), lines: make(chan string, 1000), done: make(chan error, 1)}
	w.cmd.Env = append(os.Environ(), env...)
	pipe, err := w.cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, w.cmd.Start())
	go func() {
		sc := bufio.NewScanner(pipe)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			w.mu.Lock()
			w.stderr.WriteString(sc.Text() + "\n")
			w.mu.Unlock()
			select {
			case w.lines <- sc.Text():
			default:
			}
		}
		w.done <- w.cmd.Wait()
	}()
	t.Cleanup(func() {
		if w.cmd.ProcessState == nil {
			_ = w.cmd.Process.Kill() // our own child, by pid
			t.Logf("worker killed at cleanup: %v", <-w.done)
		}
		if t.Failed() {
			t.Logf("worker stderr:\n%s", w.log())
		}
	})
	return w
}

func (w *worker) log() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.stderr.String()
}

// waitLine waits for a log line containing s.
func (w *worker) waitLine(t *testing.T, s string) {
	t.Helper()
	timeout := time.After(60 * time.Second)
	for {
		select {
		case line := <-w.lines:
			if strings.Contains(line, s) {
				return
			}
		case err := <-w.done:
			w.done <- err
			t.Fatalf("worker exited (%v) before logging %q", err, s)
		case <-timeout:
			t.Fatalf("worker did not log %q", s)
		}
	}
}

// waitTerminal waits until the workers together logged n jobs ending: "job complete", or
// an attempt that failed without retry. Their lines are read as they come (a signal, not a
// poll); the 3 minutes only bound a hung run.
func waitTerminal(t *testing.T, n int, workers ...*worker) {
	t.Helper()
	ended := make(chan struct{}, n)
	stop := make(chan struct{})
	defer close(stop)
	for _, w := range workers {
		go func() {
			for {
				select {
				case line := <-w.lines:
					if strings.Contains(line, `"msg":"job complete"`) ||
						(strings.Contains(line, `"msg":"attempt failed"`) && strings.Contains(line, `"retry":false`)) {
						select {
						case ended <- struct{}{}:
						case <-stop:
							return
						}
					}
				case <-stop:
					return
				}
			}
		}()
	}
	timeout := time.After(3 * time.Minute)
	for i := range n {
		select {
		case <-ended:
		case <-timeout:
			t.Fatalf("%d of %d jobs ended", i, n)
		}
	}
}

// wait waits for the worker to exit and returns its exit code.
func (w *worker) wait(t *testing.T, within time.Duration) int {
	t.Helper()
	select {
	case err := <-w.done:
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return ee.ExitCode()
		}
		require.NoError(t, err)
		return 0
	case <-time.After(within):
		t.Fatalf("worker still running %v after SIGTERM", within)
		return -1
	}
}

type world struct {
	pool  *pgxpool.Pool
	st    *store.PG
	ns    *testutil.RedisNS
	gate  *gate
	proxy *testutil.FakeProxy
	keys  []string
}

func newWorld(t *testing.T, jobs int) *world { return newWorldOn(t, jobs, jobs, testutil.Redis(t)) }

// newWorldOn is newWorld on the given Redis namespace, with a shop of products products of
// which the first jobs are enqueued.
func newWorldOn(t *testing.T, jobs, products int, ns *testutil.RedisNS) *world {
	t.Helper()
	w := &world{pool: testutil.PG(t), ns: ns}
	w.st = store.New(w.pool)
	site := testutil.NewFakeSite(t, testutil.FakeSiteConfig{Seed: 3, Products: products})
	w.gate = newGate(t, site)
	w.proxy = testutil.NewFakeProxy(t, testutil.FakeProxyConfig{Seed: 3, Format: testutil.ProxyFormatOxylabs, User: "acct", Password: proxyPassword})
	w.enqueue(t, 1, jobs)
	return w
}

// enqueue enqueues the jobs of sku-<from> … sku-<to> in window 2026-04-23.
func (w *world) enqueue(t *testing.T, from, to int) {
	t.Helper()
	client := asynq.NewClient(w.ns.AsynqOpt())
	defer client.Close()
	enq, err := tasks.NewEnqueuer(client, w.st, &tasks.EnqueuerConfig{Queue: w.ns.Queue})
	require.NoError(t, err)
	for i := from; i <= to; i++ {
		res, err := enq.Enqueue(context.Background(), tasks.Spec{
			Kind: catalog.Kind, SourceID: fmt.Sprintf("sku-%d", i), Country: "US", Window: "2026-04-23", ParserVersion: 1,
		})
		require.NoError(t, err)
		w.keys = append(w.keys, res.Key)
	}
}

func (w *world) args(concurrency int, shutdown time.Duration) []string {
	return []string{
		"-queues", w.ns.Queue, "-key-prefix", w.ns.Prefix, "-stream-prefix", w.ns.Prefix,
		"-concurrency", fmt.Sprint(concurrency), "-shutdown-timeout", shutdown.String(),
		"-http", "127.0.0.1:0", "-catalog-base", w.gate.srv.URL, "-allow-loopback", "-log-format", "json",
		"-request-timeout", "2m",
	}
}

func (w *world) env(t *testing.T) []string {
	return []string{
		"IDEMSCRAPE_PG=" + dsnOf(t, w.pool), "IDEMSCRAPE_REDIS=" + w.ns.Addr,
		"IDEMSCRAPE_PROXY_PROVIDER=oxylabs", "IDEMSCRAPE_PROXY_USER=acct",
		"IDEMSCRAPE_PROXY_PASSWORD=" + proxyPassword, "IDEMSCRAPE_PROXY_GATEWAY=" + w.proxy.Addr,
		"IDEMSCRAPE_HTTP_USER=", "IDEMSCRAPE_HTTP_PASSWORD=", "IDEMSCRAPE_QUEUES=", "IDEMSCRAPE_HTTP_ADDR=",
	}
}

// states returns the state of every job.
func (w *world) states(t *testing.T) map[string]tasks.JobState {
	t.Helper()
	out := map[string]tasks.JobState{}
	for _, k := range w.keys {
		j, err := w.st.JobGet(context.Background(), k)
		require.NoError(t, err)
		out[k] = j.State
	}
	return out
}

// leaseKeys lists the lease keys left in the namespace.
func (w *world) leaseKeys(t *testing.T) []string {
	t.Helper()
	keys, err := w.ns.Client.Keys(context.Background(), w.ns.Prefix+"*:lease").Result()
	require.NoError(t, err)
	return keys
}

func TestWorkerSIGTERM(t *testing.T) {
	bin := buildWorker(t)

	t.Run("InFlightJobsFinish", func(t *testing.T) {
		// 5 jobs, 3 at a time: 3 are held at their last step when SIGTERM arrives and are
		// let through after the worker said it stopped taking work; they complete within
		// the shutdown timeout, the 2 others stay pending with their tasks.
		w := newWorld(t, 5)
		wk := startWorker(t, bin, w.args(3, 2*time.Minute), w.env(t))
		w.gate.waitHeld(t, 3)
		require.NoError(t, wk.cmd.Process.Signal(syscall.SIGTERM))
		wk.waitLine(t, "stopped taking work")
		w.gate.open()
		assert.Equal(t, 0, wk.wait(t, 90*time.Second))

		counts := map[tasks.JobState]int{}
		for k, s := range w.states(t) {
			counts[s]++
			if s != tasks.StateComplete {
				assert.Equal(t, tasks.StatePending, s, k)
				assert.True(t, w.ns.AsynqTaskExists(t, k), "job %s is %s without its asynq task", k, s)
			}
		}
		assert.Equal(t, map[tasks.JobState]int{tasks.StateComplete: 3, tasks.StatePending: 2}, counts)
		assert.Empty(t, w.leaseKeys(t))
		assert.Equal(t, 3, testutil.Count(t, w.pool, `SELECT count(*) FROM results`))
		assert.NotContains(t, wk.log(), proxyPassword)
	})

	t.Run("HeldJobsHandedBack", func(t *testing.T) {
		// The held jobs never finish: after the shutdown timeout asynq hands their tasks
		// back, the runner records the attempts and releases the leases, and the worker
		// exits 0 with every job runnable again.
		w := newWorld(t, 4)
		wk := startWorker(t, bin, w.args(3, time.Second), w.env(t))
		w.gate.waitHeld(t, 3)
		require.Equal(t, 3, testutil.Count(t, w.pool, `SELECT count(*) FROM jobs WHERE state = 'running'`))
		require.NoError(t, wk.cmd.Process.Signal(syscall.SIGTERM))
		assert.Equal(t, 0, wk.wait(t, 90*time.Second))

		for k, s := range w.states(t) {
			assert.Contains(t, []tasks.JobState{tasks.StatePending, tasks.StateRetryable}, s, k)
			assert.True(t, w.ns.AsynqTaskExists(t, k), "job %s is %s without its asynq task", k, s)
		}
		assert.Equal(t, 0, testutil.Count(t, w.pool, `SELECT count(*) FROM attempts WHERE outcome = 'running'`),
			"an attempt was left running")
		assert.Equal(t, 3, testutil.Count(t, w.pool, `SELECT count(*) FROM attempts WHERE outcome = 'retryable'`))
		assert.Empty(t, w.leaseKeys(t))
		assert.NotContains(t, wk.log(), proxyPassword)
	})
}

func TestFlags(t *testing.T) {
	for _, name := range []string{"IDEMSCRAPE_CATALOG_BASE", "IDEMSCRAPE_CONCURRENCY", "IDEMSCRAPE_QUEUES", "IDEMSCRAPE_LOG_FORMAT"} {
		t.Setenv(name, "")
	}
	t.Run("EnvIsTheDefaultFlagWins", func(t *testing.T) {
		t.Setenv("IDEMSCRAPE_CATALOG_BASE", "https://shop.example")
		t.Setenv("IDEMSCRAPE_CONCURRENCY", "7")
		c, err := parseFlags([]string{"-concurrency", "9"}, &bytes.Buffer{})
		require.NoError(t, err)
		assert.Equal(t, "https://shop.example", c.catalogBase)
		assert.Equal(t, 9, c.concurrency)
		assert.False(t, c.allowLoopback, "loopback must be off by default")
	})
	t.Run("Queues", func(t *testing.T) {
		q, err := parseQueues("a:3, b")
		require.NoError(t, err)
		assert.Equal(t, map[string]int{"a": 3, "b": 1}, q)
		_, err = parseQueues("a:0")
		assert.ErrorContains(t, err, "weight")
	})
	t.Run("Refused", func(t *testing.T) {
		for _, name := range []string{"IDEMSCRAPE_MAX_RESUMES", "IDEMSCRAPE_MAX_SESSION_RESTARTS", "IDEMSCRAPE_ALLOW_LOOPBACK", "IDEMSCRAPE_HTTP_ALLOWED_HOSTS"} {
			t.Setenv(name, "")
		}
		base := func(args ...string) []string { return append([]string{"-catalog-base", "https://s.example"}, args...) }
		metadata := func(url string) []string { return []string{"-catalog-base", url, "-allow-loopback"} }
		for name, tc := range map[string]struct {
			args []string
			want string // "" for any error
		}{
			"NoCatalogBase":    {args: []string{}},
			"StrayArgument":    {args: base("extra")},
			"BadLogFormat":     {args: base("-log-format", "xml")},
			"BadQueues":        {args: base("-queues", "a:x")},
			"QueueName":        {args: base("-queues", "asynq:{x}")},
			"BadHTTP":          {args: base("-http", "notanaddr")},
			"LeaseMinMax":      {args: base("-lease-min", "10m", "-lease-max", "1m")},
			"LeaseDefault":     {args: base("-lease-default", "100h")},
			"ConcurrencyHuge":  {base("-concurrency", "99999999999"), "-concurrency 99999999999 ($IDEMSCRAPE_CONCURRENCY) must be in 1..10000"},
			"ConcurrencyAbove": {base("-concurrency", "10001"), "must be in 1..10000"},
			"ConcurrencyZero":  {base("-concurrency", "0"), "must be in 1..10000"},
			"MaxResumes":       {base("-max-resumes", "-5"), "-max-resumes -5 ($IDEMSCRAPE_MAX_RESUMES) must be >= -1"},
			"MaxRestarts":      {base("-max-session-restarts", "-2"), "-max-session-restarts -2"},
			"MetadataIP":       {metadata("http://169.254.169.254"), `-catalog-base ($IDEMSCRAPE_CATALOG_BASE) "http://169.254.169.254"`},
			"MetadataDecimal":  {metadata("http://2852039166/"), "-catalog-base"},
			"MetadataMapped":   {metadata("http://[::ffff:169.254.169.254]"), "-catalog-base"},
			"LinkLocal":        {metadata("http://169.254.10.1:8080"), "-catalog-base"},
			"LinkLocalV6":      {metadata("http://[fe80::1]"), "-catalog-base"},
			"MetadataName":     {metadata("http://metadata.google.internal"), "cloud metadata"},
			"MetadataShort":    {metadata("http://Metadata."), "cloud metadata"},
			"MetadataGoog":     {metadata("https://metadata.goog"), "cloud metadata"},
			"AllowedHostsBad":  {base("-http-allowed-hosts", "jobs.internal,http://x/"), "-http-allowed-hosts ($IDEMSCRAPE_HTTP_ALLOWED_HOSTS)"},
			"AllowedHostsPort": {base("-http-allowed-hosts", "jobs.internal:0"), "-http-allowed-hosts"},
		} {
			t.Run(name, func(t *testing.T) {
				_, err := parseFlags(tc.args, &bytes.Buffer{})
				require.Error(t, err)
				assert.Contains(t, err.Error(), tc.want)
			})
		}
		// The limits themselves are accepted, and loopback with -allow-loopback.
		for _, args := range [][]string{base("-concurrency", "10000", "-max-resumes", "-1", "-max-session-restarts", "-1"),
			metadata("http://127.0.0.1:9"), metadata("http://localhost:9")} {
			_, err := parseFlags(args, &bytes.Buffer{})
			assert.NoError(t, err, "%q", args)
		}
		c, err := parseFlags(base("-http-allowed-hosts", " jobs.internal, 10.0.0.7:8080,,"), &bytes.Buffer{})
		require.NoError(t, err)
		assert.Equal(t, []string{"jobs.internal", "10.0.0.7:8080"}, c.allowedHosts)
	})
	t.Run("UnknownEnvWarned", func(t *testing.T) {
		// A misspelt variable is named with the closest known one, in a warning (its value
		// never); variables read by the worker's secrets, other binaries or the tests are not.
		t.Setenv("IDEMSCRAPE_CONCURENCY", "5")
		t.Setenv("IDEMSCRAPE_HTTP_ALLOWED_HOST", "x")
		for _, name := range []string{"IDEMSCRAPE_SCHEDULER_CONFIG", "IDEMSCRAPE_TEST_WHATEVER", "IDEMSCRAPE_PROXY_PASSWORD_2_FILE",
			"IDEMSCRAPE_HTTP_PASSWORD_FILE", "IDEMSCRAPE_PG_PASSWORD_FILE", "IDEMSCRAPE_REDIS_PASSWORD", "IDEMSCRAPE_FAILPOINTS",
			"IDEMSCRAPE_PROXY_EXIT_HEADER_3", "IDEMSCRAPE_DEMO_UI", "IDEMSCRAPE_PROMTOOL", "IDEMSCRAPE_PROVIDERS_FILE"} {
			t.Setenv(name, "")
		}
		c, err := parseFlags([]string{"-catalog-base", "https://s.example"}, &bytes.Buffer{})
		require.NoError(t, err)
		got := map[string]string{}
		for _, u := range c.unknownEnv {
			got[u.Name] = u.Closest
		}
		assert.Equal(t, "IDEMSCRAPE_CONCURRENCY", got["IDEMSCRAPE_CONCURENCY"])
		assert.Equal(t, "IDEMSCRAPE_HTTP_ALLOWED_HOSTS", got["IDEMSCRAPE_HTTP_ALLOWED_HOST"])
		for name := range got {
			assert.Contains(t, []string{"IDEMSCRAPE_CONCURENCY", "IDEMSCRAPE_HTTP_ALLOWED_HOST"}, name, "a known variable reported")
		}
		assert.Equal(t, service.DefaultConcurrency, c.concurrency, "the misspelt variable sets nothing")

		var logs bytes.Buffer
		warnUnknownEnv(c, slog.New(slog.NewTextHandler(&logs, nil)))
		assert.Contains(t, logs.String(), "level=WARN")
		assert.Contains(t, logs.String(), "variable=IDEMSCRAPE_CONCURENCY did_you_mean=IDEMSCRAPE_CONCURRENCY")
		assert.NotContains(t, logs.String(), "=5 ", "no value is logged")
	})
	t.Run("EveryFlagHasAVariable", func(t *testing.T) {
		// unknownEnv learns the worker's variables from the flags' usage: each must name one.
		var c config
		fs := defineFlags(&c, io.Discard).FS
		known := knownEnv(fs)
		fs.VisitAll(func(f *flag.Flag) {
			assert.Regexp(t, flagEnv, f.Usage, "-%s names no variable", f.Name)
		})
		assert.True(t, known["IDEMSCRAPE_HTTP_ALLOWED_HOSTS"])
		assert.True(t, known["IDEMSCRAPE_REDIS_TLS_CA"])
	})
	t.Run("SavedInputs", func(t *testing.T) {
		t.Setenv("IDEMSCRAPE_SAVED_INPUTS", "")
		c, err := parseFlags([]string{"-catalog-base", "https://s.example"}, &bytes.Buffer{})
		require.NoError(t, err)
		assert.Equal(t, inputs.Never, c.savedPolicy.Mode, "nothing is kept unless asked")
		c, err = parseFlags([]string{"-catalog-base", "https://s.example", "-saved-inputs", "sample(0.25)"}, &bytes.Buffer{})
		require.NoError(t, err)
		assert.Equal(t, inputs.Sample, c.savedPolicy.Mode)
		_, err = parseFlags([]string{"-catalog-base", "https://s.example", "-saved-inputs", "sometimes"}, &bytes.Buffer{})
		require.Error(t, err)
		assert.Contains(t, err.Error(), "-saved-inputs")
		assert.Contains(t, err.Error(), `"sometimes"`)
	})
	t.Run("RedisCluster", func(t *testing.T) {
		t.Setenv("IDEMSCRAPE_REDIS", "")
		t.Setenv("IDEMSCRAPE_REDIS_CLUSTER", "127.0.0.1:7000,127.0.0.1:7001")
		c, err := parseFlags([]string{"-catalog-base", "https://s.example"}, &bytes.Buffer{})
		require.NoError(t, err)
		assert.Equal(t, []string{"127.0.0.1:7000", "127.0.0.1:7001"}, c.redisCfg.Cluster)
		assert.Equal(t, envflag.ClusterConnOpt{Addrs: c.redisCfg.Cluster}, c.redisCfg.AsynqConnOpt())

		_, err = parseFlags([]string{"-catalog-base", "https://s.example", "-redis", "127.0.0.1:6379"}, &bytes.Buffer{})
		assert.ErrorContains(t, err, "-redis ($IDEMSCRAPE_REDIS) and -redis-cluster ($IDEMSCRAPE_REDIS_CLUSTER) are both set")
	})
	t.Run("RedisDefault", func(t *testing.T) {
		t.Setenv("IDEMSCRAPE_REDIS", "")
		t.Setenv("IDEMSCRAPE_REDIS_CLUSTER", "")
		c, err := parseFlags([]string{"-catalog-base", "https://s.example"}, &bytes.Buffer{})
		require.NoError(t, err)
		assert.Equal(t, envflag.RedisConfig{Addr: envflag.DefaultRedisAddr}, c.redisCfg)
		_, err = parseFlags([]string{"-catalog-base", "https://s.example", "-redis-cluster", "a:1,nope"}, &bytes.Buffer{})
		assert.ErrorContains(t, err, `-redis-cluster ($IDEMSCRAPE_REDIS_CLUSTER): entry 2 "nope"`)
	})
	t.Run("StreamTrim", func(t *testing.T) {
		for _, name := range []string{"IDEMSCRAPE_STREAM_TRIM", "IDEMSCRAPE_STREAM_TRIM_INTERVAL", "IDEMSCRAPE_STREAM_MAX_LEN"} {
			t.Setenv(name, "")
		}
		base := []string{"-catalog-base", "https://s.example", "-stream-prefix", "p:"}
		c, err := parseFlags(base, &bytes.Buffer{})
		require.NoError(t, err)
		assert.Equal(t, &outbox.DispatcherConfig{Prefix: "p:", Trim: outbox.TrimConsumed, TrimInterval: time.Minute, MaxLen: 1_000_000},
			c.dispatcherConfig(nil), "trimmed and capped by default")

		c, err = parseFlags(append(base, "-stream-max-len", "-1", "-stream-trim-interval", "10s"), &bytes.Buffer{})
		require.NoError(t, err)
		assert.Equal(t, &outbox.DispatcherConfig{Prefix: "p:", Trim: outbox.TrimConsumed, TrimInterval: 10 * time.Second, MaxLen: outbox.NoMaxLen},
			c.dispatcherConfig(nil))

		t.Setenv("IDEMSCRAPE_STREAM_TRIM", "never")
		t.Setenv("IDEMSCRAPE_STREAM_MAX_LEN", "5000")
		c, err = parseFlags(base, &bytes.Buffer{})
		require.NoError(t, err)
		assert.Equal(t, &outbox.DispatcherConfig{Prefix: "p:", Trim: outbox.TrimNever}, c.dispatcherConfig(nil), "never: the cap is ignored")
		require.NoError(t, c.dispatcherConfig(nil).Validate())
		c, err = parseFlags(append(base, "-stream-trim", "consumed"), &bytes.Buffer{})
		require.NoError(t, err, "the flag wins over the environment")
		assert.Equal(t, 5000, c.dispatcherConfig(nil).MaxLen)
		t.Setenv("IDEMSCRAPE_STREAM_TRIM", "")
		t.Setenv("IDEMSCRAPE_STREAM_MAX_LEN", "")

		for name, tc := range map[string]struct {
			args []string
			want string
		}{
			"UnknownPolicy": {[]string{"-stream-trim", "acked"}, `-stream-trim ($IDEMSCRAPE_STREAM_TRIM) "acked": want consumed or never`},
			"ZeroCap":       {[]string{"-stream-max-len", "0"}, "-stream-max-len ($IDEMSCRAPE_STREAM_MAX_LEN) 0"},
			"CapBelowBatch": {[]string{"-stream-max-len", "499"}, "at least 500"},
			"NegativeCap":   {[]string{"-stream-max-len", "-2"}, "-stream-max-len"},
			"ZeroInterval":  {[]string{"-stream-trim-interval", "0s"}, "-stream-trim-interval"},
		} {
			t.Run(name, func(t *testing.T) {
				_, err := parseFlags(append(base, tc.args...), &bytes.Buffer{})
				assert.ErrorContains(t, err, tc.want)
			})
		}
		t.Setenv("IDEMSCRAPE_STREAM_MAX_LEN", "lots")
		_, err = parseFlags(base, &bytes.Buffer{})
		assert.ErrorContains(t, err, "IDEMSCRAPE_STREAM_MAX_LEN")
	})
	t.Run("BadEnv", func(t *testing.T) {
		t.Setenv("IDEMSCRAPE_CONCURRENCY", "many")
		_, err := parseFlags([]string{"-catalog-base", "https://s.example"}, &bytes.Buffer{})
		assert.ErrorContains(t, err, "IDEMSCRAPE_CONCURRENCY")
	})
	t.Run("HelpDocumentsSecretsFromEnv", func(t *testing.T) {
		var out bytes.Buffer
		_, err := parseFlags([]string{"-h"}, &out)
		assert.ErrorIs(t, err, flag.ErrHelp)
		for _, s := range []string{"IDEMSCRAPE_PROXY_PASSWORD", "IDEMSCRAPE_HTTP_PASSWORD", "-shutdown-timeout", "-allow-loopback", "$IDEMSCRAPE_PG", "-redis-cluster", "$IDEMSCRAPE_REDIS_CLUSTER",
			"-stream-trim", "$IDEMSCRAPE_STREAM_TRIM", "-stream-trim-interval", "$IDEMSCRAPE_STREAM_TRIM_INTERVAL", "-stream-max-len", "$IDEMSCRAPE_STREAM_MAX_LEN", "(default 1000000)"} {
			assert.Contains(t, out.String(), s)
		}
	})
}

// TestWorkerFailover: the binary with two accounts (IDEMSCRAPE_PROXY_*_2). The first
// account is refused (407) from the start: its attempts are recorded as proxy_auth, every
// job completes on the second account's proxy at its price, none fails, and no password
// reaches the log.
func TestWorkerFailover(t *testing.T) {
	bin := buildWorker(t)
	w := newWorld(t, 4)
	w.gate.open()
	w.proxy.SetRefusing(true)
	backup := testutil.NewFakeProxy(t, testutil.FakeProxyConfig{Seed: 4, Format: testutil.ProxyFormatOxylabs, User: "acct2", Password: proxyPassword + "-2"})
	env := append(w.env(t), "IDEMSCRAPE_PROXY_PROVIDER_2=oxylabs", "IDEMSCRAPE_PROXY_USER_2=acct2",
		"IDEMSCRAPE_PROXY_PASSWORD_2="+proxyPassword+"-2", "IDEMSCRAPE_PROXY_GATEWAY_2="+backup.Addr,
		"IDEMSCRAPE_PROXY_NAME_2=oxylabs-backup", "IDEMSCRAPE_PROXY_PRICE_2=6 USD/GB")
	wk := startWorker(t, bin, w.args(2, 30*time.Second), env)
	wk.waitLine(t, "oxylabs-backup")
	for range w.keys {
		wk.waitLine(t, `"msg":"job complete"`)
	}
	require.NoError(t, wk.cmd.Process.Signal(syscall.SIGTERM))
	assert.Equal(t, 0, wk.wait(t, 90*time.Second))

	for k, s := range w.states(t) {
		assert.Equal(t, tasks.StateComplete, s, k)
	}
	assert.Positive(t, w.proxy.Refused(), "the first account was tried and refused")
	assert.Equal(t, testutil.Count(t, w.pool, `SELECT count(*) FROM attempts WHERE category = 'proxy_auth'`),
		testutil.Count(t, w.pool, `SELECT count(*) FROM attempts WHERE category = 'proxy_auth' AND proxy_endpoint = $1`, w.proxy.Addr))
	assert.Equal(t, len(w.keys), testutil.Count(t, w.pool,
		`SELECT count(*) FROM attempts WHERE outcome = 'complete' AND proxy_endpoint = $1 AND currency = 'USD' AND cost_micros > 0`, backup.Addr),
		"every job completed on the second account, at its price")
	log := wk.log()
	assert.NotContains(t, log, proxyPassword)
}

// TestWindowMoneyBudget: two worker processes share one window's money budget (0.02 USD at
// 1000 USD/GB: 20,000 bytes; a job's attempt may move 4 KiB). What the window's attempts
// cost ends at most one attempt's cap past the budget; every job completed or failed as
// budget_exceeded (-window-budget-action fail), those after the budget was spent without
// fetching; each worker says so in one line. Then Redis loses everything (FLUSHALL on a
// throwaway server): the window's spent amount is restored from PostgreSQL, and the new
// jobs of the window fail without moving a byte.
func TestWindowMoneyBudget(t *testing.T) {
	bin := buildWorker(t)
	srv := testutil.StartRedis(t)
	ns := &testutil.RedisNS{Client: srv.Client(), Addr: srv.Addr, Prefix: "wb:", Queue: "wbq"}
	w := newWorldOn(t, 30, 33, ns)
	w.gate.open()
	const budget, capBytes = 20_000, 4096
	args := append(w.args(4, 30*time.Second), "-job-byte-budget", fmt.Sprint(capBytes),
		"-window-budget", "0.02 USD", "-window-budget-action", "fail")
	env := append(w.env(t), "IDEMSCRAPE_PROXY_PRICE=1000 USD/GB")
	ctx := context.Background()
	workers := []*worker{startWorker(t, bin, args, env), startWorker(t, bin, args, env)}
	waitTerminal(t, 30, workers...)
	require.Equal(t, 30, testutil.Count(t, w.pool, `SELECT count(*) FROM jobs WHERE state IN ('complete', 'failed')`))
	// The worker's job pages show the window's spend against -window-budget.
	var failedKey string
	require.NoError(t, w.pool.QueryRow(ctx, `SELECT key FROM jobs WHERE state = 'failed' LIMIT 1`).Scan(&failedKey))
	page := get(t, "http://"+listenAddr(t, workers[0].log())+"/jobs/"+url.PathEscape(failedKey))
	assert.Regexp(t, `window budget spent \([0-9.]+ USD of 0\.020000 USD\)`, page, "the budget is on the job page")
	for _, wk := range workers {
		require.NoError(t, wk.cmd.Process.Signal(syscall.SIGTERM))
		assert.Equal(t, 0, wk.wait(t, 90*time.Second))
	}
	spent, err := w.st.WindowCost(ctx, catalog.Kind, "2026-04-23", "USD")
	require.NoError(t, err)
	complete := testutil.Count(t, w.pool, `SELECT count(*) FROM jobs WHERE state = 'complete'`)
	t.Logf("%d of 30 complete, %d micro-units spent", complete, spent)
	assert.LessOrEqual(t, spent, int64(budget+capBytes), "at most one attempt's cap past the budget")
	assert.GreaterOrEqual(t, spent, int64(budget-capBytes), "the budget was used")
	assert.Positive(t, complete)
	assert.Equal(t, 30-complete, testutil.Count(t, w.pool,
		`SELECT count(*) FROM jobs WHERE state = 'failed' AND last_category = 'budget_exceeded'`), "the rest failed budget_exceeded")
	unfetched := testutil.Count(t, w.pool, `SELECT count(*) FROM attempts WHERE category = 'budget_exceeded' AND bytes = 0
		AND error LIKE '%the money budget of window "2026-04-23" of kind catalog is spent%'`)
	assert.Positive(t, unfetched, "jobs of the spent window failed without fetching")
	for _, wk := range workers {
		assert.LessOrEqual(t, strings.Count(wk.log(), "window money budget spent"), 1, "one line per worker")
		assert.NotContains(t, wk.log(), proxyPassword)
	}

	// Redis loses its data; three more jobs of the window come.
	require.NoError(t, srv.Client().FlushAll(ctx).Err())
	w.enqueue(t, 31, 33)
	wk := startWorker(t, bin, args, env)
	waitTerminal(t, 3, wk)
	require.Equal(t, 33, testutil.Count(t, w.pool, `SELECT count(*) FROM jobs WHERE state IN ('complete', 'failed')`))
	require.NoError(t, wk.cmd.Process.Signal(syscall.SIGTERM))
	assert.Equal(t, 0, wk.wait(t, 90*time.Second))
	assert.Contains(t, wk.log(), "window money budget restored from PostgreSQL")
	for _, key := range w.keys[30:] {
		j, err := w.st.JobGet(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, tasks.StateFailed, j.State, key)
		assert.Equal(t, string(tasks.CategoryBudgetExceeded), j.LastCategory, key)
		assert.Zero(t, j.BytesTotal, "%s moved no byte", key)
	}
	after, err := w.st.WindowCost(ctx, catalog.Kind, "2026-04-23", "USD")
	require.NoError(t, err)
	assert.Equal(t, spent, after)
	wb, err := lua.NewWindowBudgets(srv.Client(), ns.Prefix)
	require.NoError(t, err)
	inRedis, reserved, ok, err := wb.Spent(ctx, catalog.Kind, "2026-04-23")
	require.NoError(t, err)
	require.True(t, ok, "restored")
	assert.Equal(t, spent, inRedis, "Redis holds PostgreSQL's figure again")
	assert.Zero(t, reserved)
}
