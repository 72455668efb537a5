package clustertest

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
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

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/cmd/internal/envflag"
	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/scheduler"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/outbox"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

const (
	proxyUser     = "clusteracct"
	proxyPassword = "cluster-pw-never-logged-5d1e"
	consumerGroup = "clustertest-effects"
	// window of every job of these tests (part of the job key).
	window = "2026-12-03"
)

// world is one test's fleet environment: Redis (a cluster or one server), a PostgreSQL
// database of its own, the fake shop and residential proxy, and the names (key prefix,
// queue) its processes share.
type world struct {
	t       testing.TB
	redis   envflag.RedisConfig // what the processes are configured with
	rdb     redis.UniversalClient
	connOpt asynq.RedisConnOpt
	pool    *pgxpool.Pool
	st      *store.PG
	dsn     string
	site    *testutil.FakeSite
	proxy   *testutil.FakeProxy
	prefix  string
	queue   string
	logs    string // directory of the processes' logs
}

// newWorld returns a world on the Redis of rc with a fresh database, a shop of products
// products and a proxy without faults. The test's own Redis clients are built from rc the
// way the binaries build theirs (envflag.RedisConfig).
func newWorld(t testing.TB, rc envflag.RedisConfig, products int) *world {
	t.Helper()
	// Build the binaries before anything runs: a build while the workers run would let
	// them finish the jobs before the reconciler starts.
	binary(t, "worker")
	binary(t, "scheduler")
	id := testutil.RandomID(4)
	w := &world{
		t: t, redis: rc, rdb: rc.NewClient(), connOpt: rc.AsynqConnOpt(),
		pool: testutil.PG(t), prefix: "ct" + id + ":", queue: "ct" + id, logs: t.TempDir(),
	}
	t.Cleanup(func() { _ = w.rdb.Close() })
	w.st = store.New(w.pool)
	u, err := url.Parse(testutil.PGAdminDSN())
	require.NoError(t, err, "IDEMSCRAPE_TEST_PG must be a URL for this test")
	u.Path = "/" + w.pool.Config().ConnConfig.Database
	w.dsn = u.String()
	w.site = testutil.NewFakeSite(t, testutil.FakeSiteConfig{Seed: 14, Products: products})
	w.proxy = testutil.NewFakeProxy(t, testutil.FakeProxyConfig{Seed: 14, Format: testutil.ProxyFormatOxylabs,
		User: proxyUser, Password: proxyPassword})
	return w
}

// stream is the outbox stream of the catalog kind's events.
func (w *world) stream() string { return outbox.StreamKey(w.prefix, catalog.Kind) }

// env is a process's environment: the parent's without any IDEMSCRAPE_ variable (a
// developer's own settings must not leak in), then the world's.
func (w *world) env(extra ...string) []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "IDEMSCRAPE_") {
			env = append(env, kv)
		}
	}
	if w.redis.IsCluster() {
		env = append(env, "IDEMSCRAPE_REDIS_CLUSTER="+strings.Join(w.redis.Cluster, ","))
	} else {
		env = append(env, "IDEMSCRAPE_REDIS="+w.redis.Addr)
	}
	env = append(env, "IDEMSCRAPE_PG="+w.dsn,
		"IDEMSCRAPE_PROXY_PROVIDER=oxylabs", "IDEMSCRAPE_PROXY_USER="+proxyUser,
		"IDEMSCRAPE_PROXY_PASSWORD="+proxyPassword, "IDEMSCRAPE_PROXY_GATEWAY="+w.proxy.Addr)
	return append(env, extra...)
}

// workerOpts are the settings of one worker process.
type workerOpts struct {
	id           string
	concurrency  int
	noDispatcher bool
	lease        time.Duration // 0: the worker's measured default
	http         string        // listen address; "": a free port nobody needs to know
	env          []string
}

// startWorker runs the cmd/worker binary for the world's queue, prefixes, shop and proxy.
func (w *world) startWorker(o workerOpts) *proc {
	w.t.Helper()
	if o.http == "" {
		o.http = "127.0.0.1:0"
	}
	args := []string{
		"-queues", w.queue, "-key-prefix", w.prefix, "-stream-prefix", w.prefix,
		"-concurrency", fmt.Sprint(o.concurrency), "-worker-id", o.id,
		"-http", o.http, "-catalog-base", w.site.URL, "-allow-loopback",
		"-log-format", "json", "-log-level", "warn",
		"-shutdown-timeout", "2s", "-drain-timeout", "10s",
	}
	if o.noDispatcher {
		args = append(args, "-no-dispatcher")
	}
	if o.lease > 0 {
		args = append(args, "-lease-default", o.lease.String(), "-lease-min", o.lease.String(), "-lease-max", o.lease.String())
	}
	return startProc(w.t, o.id, binary(w.t, "worker"), args, w.env(o.env...), w.logs)
}

// startReconciler runs the cmd/scheduler binary as the reconciler alone, sweeping every
// interval, for jobs whose lease is at most maxLease.
func (w *world) startReconciler(id string, interval, maxLease time.Duration) *proc {
	w.t.Helper()
	cfg := fmt.Sprintf("kinds:\n  %s:\n    queue: %s\n    max_lease: %s\nreconciler:\n  interval: %s\n",
		catalog.Kind, w.queue, maxLease, interval)
	path := filepath.Join(w.logs, id+".yaml")
	require.NoError(w.t, os.WriteFile(path, []byte(cfg), 0o600))
	args := []string{"-config", path, "-no-scheduler", "-http", "", "-key-prefix", w.prefix,
		"-id", id, "-allow-loopback", "-log-format", "json", "-log-level", "info"}
	return startProc(w.t, id, binary(w.t, "scheduler"), args, w.env(), w.logs)
}

// enqueue records and enqueues n catalog jobs (sku-1 … sku-n) of the test window and
// returns their keys.
func (w *world) enqueue(ctx context.Context, n int, country string) []string {
	return w.enqueueWindow(ctx, n, country, window)
}

// enqueueWindow is enqueue for another window (new jobs for the same products).
func (w *world) enqueueWindow(ctx context.Context, n int, country, window string) []string {
	w.t.Helper()
	client := asynq.NewClient(w.connOpt)
	defer client.Close()
	enq, err := tasks.NewEnqueuer(client, w.st, &tasks.EnqueuerConfig{Queue: w.queue})
	require.NoError(w.t, err)
	var keys []string
	for from := 1; from <= n; from += 500 {
		var specs []tasks.Spec
		for i := from; i < from+500 && i <= n; i++ {
			specs = append(specs, tasks.Spec{Kind: catalog.Kind, SourceID: fmt.Sprintf("sku-%d", i),
				Country: country, Window: window, ParserVersion: 1})
		}
		res, err := enq.EnqueueMany(ctx, specs)
		require.NoError(w.t, err)
		for _, r := range res {
			require.Equal(w.t, tasks.Created, r.Outcome, "job %s", r.Key)
			keys = append(keys, r.Key)
		}
	}
	return keys
}

// count runs a count query on the world's database.
func (w *world) count(query string, args ...any) int {
	w.t.Helper()
	return testutil.Count(w.t, w.pool, query, args...)
}

// waitCount waits until query counts want, checking every 50 ms; it fails the test after
// within (a bound against hanging, not a speed assertion) with what it saw and the
// processes' logs.
func (w *world) waitCount(what string, want int, within time.Duration, query string, args ...any) {
	w.t.Helper()
	w.waitFor(fmt.Sprintf("%s (want %d)", what, want), within, func() (int64, bool) {
		got := w.count(query, args...)
		return int64(got), got >= want
	})
}

// waitFor polls check every 50 ms until it reports done; after within (a bound against
// hanging) it fails the test with what and the last value check saw.
func (w *world) waitFor(what string, within time.Duration, check func() (seen int64, done bool)) {
	w.t.Helper()
	deadline := time.Now().Add(within)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		seen, done := check()
		if done {
			return
		}
		if time.Now().After(deadline) {
			w.t.Fatalf("%s: %d after %v", what, seen, within)
		}
		<-tick.C
	}
}

// waitTookEffect waits until the event of each job of keys has been marked
// sent by a dispatcher and taken effect in the consumers' group. It counts those jobs'
// events only: a job that completes later (one waiting on asynq) must not make up for one
// of keys still in flight. The dispatcher marks a row sent after the stream has it, so a
// consumer may take an event before its row says sent: both are waited for.
func (w *world) waitTookEffect(within time.Duration, keys []string) {
	w.t.Helper()
	w.waitCount("events sent and taken effect", len(keys), within, `SELECT count(*) FROM outbox o JOIN outbox_inbox i USING (event_key)
		WHERE i.consumer_group = $2 AND o.payload->>'job_key' = ANY($1) AND EXISTS (SELECT 1 FROM outbox_sent s WHERE s.id = o.id)`, keys, consumerGroup)
}

// checkNotLost checks that job key, runnable in PostgreSQL when the run settled, is not
// lost: asynq still holds its task where it will run again — active and in the lease set
// its recoverer sweeps, a retry in the retry set, pending or scheduled — or the job has
// completed since. The task may move between two reads (a retry falls due, a worker
// finishes it), so a miss is read again; the task's hash is read before the job's row:
// asynq deletes it only after the handler returned, which is after the job's commit, so
// a missing hash with the job not complete after it is a lost job.
func (w *world) checkNotLost(ctx context.Context, key string) {
	w.t.Helper()
	sets := map[string]string{"active": "asynq:{" + w.queue + "}:lease", "retry": "asynq:{" + w.queue + "}:retry"}
	var st string
	for range 3 {
		var err error
		st, err = w.rdb.HGet(ctx, scheduler.AsynqTaskKey(w.queue, key), "state").Result()
		if errors.Is(err, redis.Nil) {
			st = ""
			break
		}
		require.NoError(w.t, err, "job %s: read its asynq task", key)
		set, inSet := sets[st]
		if !inSet {
			if st == "pending" || st == "scheduled" {
				return
			}
			break
		}
		_, err = w.rdb.ZScore(ctx, set, key).Result()
		if err == nil {
			return
		}
		require.ErrorIs(w.t, err, redis.Nil, "job %s: read %s", key, set)
	}
	var state string
	require.NoError(w.t, w.pool.QueryRow(ctx, `SELECT state FROM jobs WHERE key = $1`, key).Scan(&state))
	assert.Equal(w.t, "complete", state, "job %s: asynq holds its task as %q (none: deleted) outside the set that would run it, and the job is not complete", key, st)
}

// waitSettled waits until no job of keys is running and every one is either complete or
// waiting on asynq: not started in PostgreSQL (pending or retryable) while asynq holds its
// task as active (handed out before a failover, no worker runs it: asynq's recoverer will
// retry it) or as a retry (asynq will run it when due). That must hold on two polls in a
// row, so a task a worker dequeued a moment ago is not taken for one waiting. It returns
// the complete jobs and the waiting ones with their asynq state; it checks every 50 ms and
// fails the test after within (a job lost — runnable without a live task — never settles).
func (w *world) waitSettled(ctx context.Context, keys []string, within time.Duration) (complete []string, waiting map[string]string) {
	w.t.Helper()
	deadline := time.Now().Add(within)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	stable := 0
	for {
		complete, waiting = nil, map[string]string{}
		rows, err := w.pool.Query(ctx, `SELECT key, state FROM jobs WHERE key = ANY($1)`, keys)
		require.NoError(w.t, err)
		var runnable, other []string
		for rows.Next() {
			var k, state string
			require.NoError(w.t, rows.Scan(&k, &state))
			switch state {
			case "complete":
				complete = append(complete, k)
			case "pending", "retryable":
				runnable = append(runnable, k)
			default:
				other = append(other, k)
			}
		}
		require.NoError(w.t, rows.Err())
		settled := len(other) == 0 && len(complete)+len(runnable) == len(keys)
		if settled && len(runnable) > 0 {
			pipe := w.rdb.Pipeline()
			states := make([]*redis.StringCmd, len(runnable))
			for i, k := range runnable {
				states[i] = pipe.HGet(ctx, scheduler.AsynqTaskKey(w.queue, k), "state")
			}
			_, _ = pipe.Exec(ctx)
			for i, c := range states {
				st := c.Val()
				settled = settled && (st == "active" || st == "retry")
				waiting[runnable[i]] = st
			}
		}
		if settled {
			if stable++; stable == 2 {
				return complete, waiting
			}
		} else {
			stable = 0
		}
		if time.Now().After(deadline) {
			w.t.Fatalf("not settled after %v: %d complete, %d runnable %v, %d in other states", within,
				len(complete), len(runnable), waiting, len(other))
		}
		<-tick.C
	}
}

// consumers runs n inbox consumers (outbox.Consumer.RunTx) of the catalog stream in one
// group; each event's side effect is a row in side_effects written in the inbox's
// transaction. side_effects has no unique key: an effect taking place twice shows as two
// rows. The consumers stop when the test ends.
func (w *world) consumers(n int) {
	w.t.Helper()
	ctx := context.Background()
	_, err := w.pool.Exec(ctx, `CREATE TABLE side_effects (
		id bigserial PRIMARY KEY, event_key text NOT NULL, job_key text NOT NULL, stream_id text NOT NULL)`)
	require.NoError(w.t, err)
	logf, err := os.Create(filepath.Join(w.logs, "consumers.log"))
	require.NoError(w.t, err)
	log := slog.New(slog.NewJSONHandler(logf, &slog.HandlerOptions{Level: slog.LevelWarn}))
	cctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for i := range n {
		cons, err := outbox.NewConsumer(w.rdb, &outbox.ConsumerConfig{
			Prefix: w.prefix, Topic: catalog.Kind, Group: consumerGroup, Consumer: fmt.Sprintf("c%d", i+1),
			Block: 200 * time.Millisecond, MinIdle: 3 * time.Second, ReclaimInterval: time.Second,
			RetryBackoffMax: 500 * time.Millisecond, Logger: log,
		})
		require.NoError(w.t, err)
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = cons.RunTx(cctx, w.pool, func(ctx context.Context, tx pgx.Tx, ev outbox.Event) error {
				var p struct {
					JobKey string `json:"job_key"`
				}
				if err := json.Unmarshal(ev.Payload, &p); err != nil {
					return err
				}
				_, err := tx.Exec(ctx, `INSERT INTO side_effects (event_key, job_key, stream_id) VALUES ($1, $2, $3)`,
					ev.EventKey, p.JobKey, ev.StreamID)
				return err
			})
		}()
	}
	w.t.Cleanup(func() {
		cancel()
		wg.Wait()
		_ = logf.Close()
		if w.t.Failed() {
			w.t.Logf("consumers log:\n%s", tail(filepath.Join(w.logs, "consumers.log"), 30))
		}
	})
}

// checkExactlyOnce asserts the invariants of a finished run of keys: every job complete
// with exactly one result and one outbox event, every event sent, and every event's side
// effect taken exactly once (one side_effects row and one inbox row per event).
func (w *world) checkExactlyOnce(keys []string) {
	w.t.Helper()
	n := len(keys)
	q := func(query string) int { return w.count(query, keys) }
	require.Equal(w.t, n, q(`SELECT count(*) FROM jobs WHERE key = ANY($1) AND state = 'complete'`), "jobs complete")
	require.Equal(w.t, n, q(`SELECT count(*) FROM results WHERE job_key = ANY($1)`), "results (one per job)")
	require.Equal(w.t, n, q(`SELECT count(DISTINCT job_key) FROM results WHERE job_key = ANY($1)`), "jobs with a result")
	require.Equal(w.t, n, q(`SELECT count(*) FROM outbox WHERE payload->>'job_key' = ANY($1)`), "outbox events (one per job)")
	require.Equal(w.t, n, q(`SELECT count(DISTINCT payload->>'job_key') FROM outbox WHERE payload->>'job_key' = ANY($1)`), "jobs with an event")
	require.Equal(w.t, 0, q(`SELECT count(*) FROM outbox_unsent WHERE payload->>'job_key' = ANY($1)`), "unsent events")
	require.Equal(w.t, n, q(`SELECT count(*) FROM side_effects WHERE job_key = ANY($1)`), "side effects (one per event)")
	require.Equal(w.t, n, q(`SELECT count(DISTINCT event_key) FROM side_effects WHERE job_key = ANY($1)`), "events that took effect")
	require.Equal(w.t, n, w.count(`SELECT count(*) FROM outbox_inbox i JOIN outbox o USING (event_key)
		WHERE i.consumer_group = $2 AND o.payload->>'job_key' = ANY($1)`, keys, consumerGroup), "inbox rows")
}

// proc is a child process of the test (a worker or the reconciler), logging to a file.
type proc struct {
	name string
	cmd  *exec.Cmd
	log  string
	done chan struct{}
	err  error
}

func startProc(t testing.TB, name, bin string, args, env []string, logDir string) *proc {
	t.Helper()
	p := &proc{name: name, cmd: exec.Command(bin, args...), log: filepath.Join(logDir, name+".log"), done: make(chan struct{})}
	p.cmd.Env = env
	f, err := os.Create(p.log)
	require.NoError(t, err)
	p.cmd.Stdout, p.cmd.Stderr = f, f
	require.NoError(t, p.cmd.Start(), "start %s", name)
	go func() {
		p.err = p.cmd.Wait()
		_ = f.Close()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.stop(15 * time.Second)
		if t.Failed() {
			t.Logf("%s log (last lines):\n%s", name, tail(p.log, 40))
		}
	})
	return p
}

// stop sends SIGTERM to the process (our own child, by pid) and waits up to grace for a
// clean exit, then kills it.
func (p *proc) stop(grace time.Duration) {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// exited reports whether the process ended (and how), without waiting.
func (p *proc) exited() (bool, error) {
	select {
	case <-p.done:
		return true, p.err
	default:
		return false, nil
	}
}

// tail returns the last n lines of file.
func tail(file string, n int) string {
	f, err := os.Open(file)
	if err != nil {
		return err.Error()
	}
	defer f.Close()
	var lines []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if len(lines) > n {
			lines = lines[1:]
		}
	}
	return strings.Join(lines, "\n")
}

// messages counts the process's WARN and ERROR log lines by level and message (its logs are
// JSON lines), for the test log: what the fleet noticed.
func (p *proc) messages() map[string]int {
	out := map[string]int{}
	f, err := os.Open(p.log)
	if err != nil {
		return map[string]int{"open log: " + err.Error(): 1}
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var l struct{ Level, Msg string }
		if json.Unmarshal(sc.Bytes(), &l) != nil {
			if s := strings.TrimSpace(sc.Text()); s != "" {
				out["(not JSON) "+firstN(s, 100)]++
			}
			continue
		}
		if l.Level == "WARN" || l.Level == "ERROR" {
			// One entry per kind of message, not per task.
			if i := strings.Index(l.Msg, " id="); i > 0 {
				l.Msg = l.Msg[:i] + " id=…"
			}
			out[l.Level+" "+firstN(l.Msg, 90)]++
		}
	}
	return out
}

func firstN(s string, n int) string {
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}

// freeAddr returns a loopback address with a port that was free a moment ago.
func freeAddr(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().String()
}

// httpGet returns the status and body of GET url.
func httpGet(t testing.TB, url string) (int, string) {
	t.Helper()
	c := http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get(url)
	require.NoError(t, err, "GET %s", url)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b)
}
