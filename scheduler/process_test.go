package scheduler_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var (
	buildOnce sync.Once
	buildDir  string // removed by TestMain
	buildErr  error
)

// buildBinary builds a command of this module once per test binary run.
func buildBinary(t *testing.T, pkg, name string) string {
	t.Helper()
	buildOnce.Do(func() { buildDir, buildErr = os.MkdirTemp("", "idemscrape-scheduler-test-") })
	require.NoError(t, buildErr)
	bin := filepath.Join(buildDir, name)
	if _, err := os.Stat(bin); err == nil {
		return bin
	}
	out, err := exec.Command("go", "build", "-o", bin, pkg).CombinedOutput()
	require.NoError(t, err, "go build %s: %s", pkg, out)
	return bin
}

// dsnOf returns a libpq URL for the database of pool (testutil.PG's own database).
func dsnOf(pool *pgxpool.Pool) string {
	cc := pool.Config().ConnConfig
	u := url.URL{Scheme: "postgres", User: url.User(cc.User), Host: fmt.Sprintf("%s:%d", cc.Host, cc.Port), Path: "/" + cc.Database,
		RawQuery: "sslmode=disable"}
	return u.String()
}

// logLine is one JSON log line of the scheduler binary.
type logLine struct {
	Msg      string         `json:"msg"`
	Template string         `json:"template"`
	Window   string         `json:"window"`
	Outcomes map[string]int `json:"outcomes"`
	Addr     string         `json:"addr"`
}

// proc is a scheduler process whose JSON log lines arrive on lines.
type proc struct {
	cmd   *exec.Cmd
	lines chan logLine
	addr  chan string // the HTTP address, once listening
	done  chan struct{}
	err   error
}

func startProc(t *testing.T, bin string, env []string, args ...string) *proc {
	t.Helper()
	p := &proc{cmd: exec.Command(bin, args...), lines: make(chan logLine, 1024), addr: make(chan string, 1), done: make(chan struct{})}
	p.cmd.Env = append(os.Environ(), env...)
	stderr, err := p.cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, p.cmd.Start())
	go func() {
		defer close(p.done)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			var l logLine
			if json.Unmarshal(sc.Bytes(), &l) == nil {
				if l.Msg == "http listening" {
					p.addr <- l.Addr
					continue
				}
				select {
				case p.lines <- l:
				default: // nobody reads any more
				}
			} else {
				t.Logf("scheduler: %s", sc.Text())
			}
		}
		p.err = p.cmd.Wait()
	}()
	t.Cleanup(func() {
		// Only this test's own process, by pid.
		_ = p.cmd.Process.Kill()
		<-p.done
	})
	return p
}

func TestTwoSchedulersNoDuplicates(t *testing.T) {
	b := setup(t)
	bin := buildBinary(t, "github.com/idemscrape/idemscrape/cmd/scheduler", "scheduler")
	dir := t.TempDir()
	cfg := filepath.Join(dir, "scheduler.yaml")
	const sources, countries = 5, 2
	require.NoError(t, writeFile(cfg, `
templates:
  - name: every-second
    cron: "* * * * * *"
    window: secondly
    kind: catalog
    sources: {ids: [sku-1, sku-2, sku-3, sku-4, sku-5]}
    countries: [US, DE]
    parser_version: 1
kinds:
  catalog: {queue: `+b.ns.Queue+`}
reconciler: {disabled: true}
`))
	env := []string{"IDEMSCRAPE_PG=" + dsnOf(b.st.Pool()), "IDEMSCRAPE_REDIS=" + b.ns.Addr,
		"IDEMSCRAPE_LOG_FORMAT=json", "IDEMSCRAPE_SCHEDULER_HTTP_ADDR=127.0.0.1:0"}
	procs := []*proc{startProc(t, bin, env, "-config", cfg), startProc(t, bin, env, "-config", cfg)}

	// Collect ticks until each process has ticked at least 3 windows that the other one
	// ticked too (both contend for the same windows).
	ticks, byWindow, stopReaders := collectCommonTicks(t, procs, 3)

	t.Run("MetricsAndHealthz", func(t *testing.T) {
		addr := <-procs[0].addr
		resp, err := http.Get("http://" + addr + "/healthz")
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, http.StatusOK, resp.StatusCode)
		resp, err = http.Get("http://" + addr + "/metrics")
		require.NoError(t, err)
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.NoError(t, err)
		assert.Contains(t, string(body), `idemscrape_scheduler_ticks_total{result="ok",template="every-second"}`)
		// Which outcomes this process saw depends on the race with the other one (created,
		// requeued when the other inserted the row first, already_queued).
		assert.Contains(t, string(body), `idemscrape_scheduler_jobs_total{outcome=`)
	})

	// SIGTERM ends both cleanly, possibly mid-tick.
	for _, p := range procs {
		require.NoError(t, p.cmd.Process.Signal(syscall.SIGTERM))
	}
	for i, p := range procs {
		select {
		case <-p.done:
			require.NoError(t, p.err, "scheduler %d exit status after SIGTERM", i)
		case <-time.After(60 * time.Second):
			t.Fatalf("scheduler %d did not exit after SIGTERM", i)
		}
	}
	stopReaders()

	windows := b.windows(t)
	created := map[string]int{}
	for _, tk := range ticks {
		created[tk.window] += tk.outcomes["created"]
	}
	for w, ps := range byWindow {
		if len(ps) < 2 {
			continue
		}
		assert.Equal(t, sources*countries, windows[w], "jobs of window %s", w)
		assert.Equal(t, sources*countries, created[w], "window %s: every job created by exactly one of the two schedulers", w)
	}
	for _, n := range windows {
		assert.LessOrEqual(t, n, sources*countries)
	}
	assertTasksOnce(t, b, byWindow)
}

// procTick is one "tick" log line of the scheduler process procs[proc].
type procTick struct {
	proc     int
	window   string
	outcomes map[string]int
}

// collectCommonTicks reads the tick lines of both processes until at least n windows were
// ticked by both, and returns every tick read, the processes that ticked each window, and
// a function that stops the readers (once the processes are done).
func collectCommonTicks(t *testing.T, procs []*proc, n int) ([]procTick, map[string]map[int]bool, func()) {
	t.Helper()
	var ticks []procTick
	byWindow := map[string]map[int]bool{}
	common := func() int {
		c := 0
		for _, ps := range byWindow {
			if len(ps) == 2 {
				c++
			}
		}
		return c
	}
	timeout := time.After(90 * time.Second) // a guard against a hung test, not a timing assert
	merged := make(chan procTick)
	stopReaders := make(chan struct{})
	for i, p := range procs {
		go func() {
			for {
				select {
				case l := <-p.lines:
					if l.Msg == "tick" {
						select {
						case merged <- procTick{proc: i, window: l.Window, outcomes: l.Outcomes}:
						case <-stopReaders:
							return
						}
					}
				case <-p.done:
					return
				case <-stopReaders:
					return
				}
			}
		}()
	}
	for common() < n {
		select {
		case tk := <-merged:
			ticks = append(ticks, tk)
			if byWindow[tk.window] == nil {
				byWindow[tk.window] = map[int]bool{}
			}
			byWindow[tk.window][tk.proc] = true
		case <-procs[0].done:
			t.Fatalf("scheduler 0 exited: %v", procs[0].err)
		case <-procs[1].done:
			t.Fatalf("scheduler 1 exited: %v", procs[1].err)
		case <-timeout:
			t.Fatalf("fewer than %d windows ticked by both schedulers; ticks: %+v", n, ticks)
		}
	}
	return ticks, byWindow, func() { close(stopReaders) }
}

// assertTasksOnce checks that every job of a window some scheduler finished ticking
// (byWindow) has its task, and that no task is duplicated.
func assertTasksOnce(t *testing.T, b *bundle, byWindow map[string]map[int]bool) {
	t.Helper()
	// Every job of a window some scheduler finished ticking has its task. (A tick cut by
	// SIGTERM may leave rows whose task the next start's catch-up or the reconciler adds.)
	rows, err := b.st.Pool().Query(context.Background(), `SELECT key, "window" FROM jobs`)
	require.NoError(t, err)
	defer rows.Close()
	jobs := map[string]bool{}
	for rows.Next() {
		var key, w string
		require.NoError(t, rows.Scan(&key, &w))
		jobs[key] = true
		if byWindow[w] != nil {
			assert.True(t, b.ns.AsynqTaskExists(t, key), "task of %s", key)
		}
	}
	require.NoError(t, rows.Err())
	// No duplicate task: the pending list holds each task once, and each is a job's.
	var taskKeys []string
	iter := b.ns.Client.Scan(context.Background(), 0, "asynq:{"+b.ns.Queue+"}:t:*", 1000).Iterator()
	for iter.Next(context.Background()) {
		taskKeys = append(taskKeys, iter.Val())
	}
	require.NoError(t, iter.Err())
	assert.Equal(t, len(taskKeys), b.ns.AsynqPending(t), "one pending entry per task")
	for _, k := range taskKeys {
		assert.True(t, jobs[strings.TrimPrefix(k, "asynq:{"+b.ns.Queue+"}:t:")], "task %s has a jobs row", k)
	}
}

func TestSchedulerBinaryRefusesBadConfig(t *testing.T) {
	bin := buildBinary(t, "github.com/idemscrape/idemscrape/cmd/scheduler", "scheduler")
	cfg := filepath.Join(t.TempDir(), "bad.yaml")
	require.NoError(t, writeFile(cfg, `
templates:
  - name: nightly
    cron: "0 3 * * *"
    window: daily
    kind: catalog
    sources: {ids: [a]}
    countries: [US]
    parser_version: 0
`))
	// No PostgreSQL or Redis is reachable at these addresses: the binary must fail on the
	// configuration before it tries either.
	cmd := exec.Command(bin, "-config", cfg, "-pg", "postgres://nobody@127.0.0.1:1/x", "-redis", "127.0.0.1:1")
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	require.True(t, errors.As(err, &ee), "want a non-zero exit, got %v: %s", err, out)
	assert.Equal(t, 2, ee.ExitCode())
	assert.Contains(t, string(out), `template \"nightly\": field parser_version`)
}
