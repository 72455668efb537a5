package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

var update = flag.Bool("update", false, "rewrite the golden files under testdata/")

// dsnOf is the libpq URL of the database behind a testutil pool.
func dsnOf(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	u, err := url.Parse(testutil.PGAdminDSN())
	require.NoError(t, err, "IDEMSCRAPE_TEST_PG must be a URL")
	u.Path = "/" + pool.Config().ConnConfig.Database
	return u.String()
}

// buildCLI builds this command into dir.
func buildCLI(t *testing.T, dir string) string {
	t.Helper()
	bin := filepath.Join(dir, "idemscrape")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, "go build: %s", out)
	return bin
}

// cliFixture builds the binary for a test and gives it its own database and Redis
// namespace, with the store on that database.
func cliFixture(t *testing.T) (bin string, pool *pgxpool.Pool, ns *testutil.RedisNS, st *store.PG) {
	t.Helper()
	bin = buildCLI(t, t.TempDir())
	pool = testutil.PG(t)
	ns = testutil.Redis(t)
	return bin, pool, ns, store.New(pool)
}

// queueKind is a job kind whose queue (tasks.QueueFor) is ns's, cleaned up with it.
func queueKind(t *testing.T, ns *testutil.RedisNS) string {
	t.Helper()
	kind := ns.Queue
	require.Equal(t, ns.Queue, tasks.QueueFor(kind))
	return kind
}

// recordFailedJob records the job key of spec and fails its first attempt, run by worker,
// on parsing (say, a parser bug since fixed).
func recordFailedJob(ctx context.Context, t *testing.T, st *store.PG, key string, spec tasks.Spec, worker string) {
	t.Helper()
	_, err := st.JobsRecord(ctx, []tasks.JobRecord{{Key: key, Spec: spec}})
	require.NoError(t, err)
	_, err = st.JobStart(ctx, store.AttemptStartParams{Key: key, Token: 1, Worker: worker})
	require.NoError(t, err)
	require.NoError(t, st.JobFail(ctx, store.AttemptFinishParams{Key: key, Token: 1, Category: "parse_error", Error: "bug"}))
}

type cliRun struct {
	stdout, stderr string
	code           int
}

// runCLI runs the built binary with env (added to the process's environment without its
// IDEMSCRAPE_ and USER variables), stdin and args, and returns what it printed and its
// exit status.
func runCLI(t *testing.T, bin string, env []string, stdin string, args ...string) cliRun {
	t.Helper()
	cmd := exec.Command(bin, args...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "IDEMSCRAPE_") && !strings.HasPrefix(kv, "USER=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, env...)
	cmd.Stdin = strings.NewReader(stdin)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	r := cliRun{stdout: out.String(), stderr: errb.String()}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		r.code = ee.ExitCode()
	} else {
		require.NoError(t, err)
	}
	return r
}

// golden compares got with testdata/name (or rewrites it under -update).
func golden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if *update {
		require.NoError(t, os.MkdirAll("testdata", 0o755))
		require.NoError(t, os.WriteFile(path, []byte(got), 0o644))
	}
	want, err := os.ReadFile(path)
	require.NoError(t, err, "missing golden file: run go test -run TestCLI -update ./cmd/idemscrape/")
	assert.Equal(t, string(want), got, "golden %s (rewrite with -update)", name)
}

var (
	timeRE     = regexp.MustCompile(`\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z`)
	durationRE = regexp.MustCompile(`(^|\s)(\d+(\.\d+)?(ns|µs|ms|s|m|h))+(\s|$)`)
	spacesRE   = regexp.MustCompile(` {2,}`)
)

// normalise makes a table reproducible: times, durations and the test's random kind are
// replaced, and column padding (which follows their widths) is collapsed.
func normalise(s, kind string) string {
	s = strings.ReplaceAll(s, kind, "KIND")
	s = timeRE.ReplaceAllString(s, "<time>")
	lines := strings.Split(s, "\n")
	for i, l := range lines {
		l = durationRE.ReplaceAllString(l, "$1<dur>$5")
		lines[i] = strings.TrimRight(spacesRE.ReplaceAllString(l, "  "), " ")
	}
	return strings.Join(lines, "\n")
}

// TestCLI runs the built binary against its own database and Redis namespace over a
// scripted run: enqueue from JSON lines (one bad line), attempts driven through the store
// (a takeover, a timeout retry then a parse failure, a duplicate result write), an outbox
// replay, a requeue; then status and stats against golden files, audit passing and then
// failing on a deliberately broken fixture, and the command-line rules.
func TestCLI(t *testing.T) {
	ctx := context.Background()
	bin, pool, ns, st := cliFixture(t)
	kind := queueKind(t, ns)
	require.Equal(t, "observed:x", handlers.EventKey("x"), "ops.DefaultEventKeyPrefix follows handlers.EventKey")

	dsn := dsnOf(t, pool)
	runIn := func(t *testing.T, dsn, stdin string, args ...string) cliRun {
		t.Helper()
		return runCLI(t, bin, []string{"IDEMSCRAPE_PG=" + dsn, "IDEMSCRAPE_REDIS=" + ns.Addr, "USER=tester"}, stdin, args...)
	}
	run := func(t *testing.T, stdin string, args ...string) cliRun {
		t.Helper()
		return runIn(t, dsn, stdin, args...)
	}
	jobs := func(t *testing.T) int { return testutil.Count(t, pool, `SELECT count(*) FROM jobs`) }
	keyOf := func(src string) string {
		k, err := tasks.Spec{Kind: kind, SourceID: src, Country: "US", Window: "2026-04-23", ParserVersion: 3}.Key()
		require.NoError(t, err)
		return k
	}
	k1, k2, k3, k4 := keyOf("sku-1"), keyOf("sku-2"), keyOf("sku-3"), keyOf("sku-4")

	t.Run("Help", func(t *testing.T) {
		r := run(t, "", "-h")
		assert.Equal(t, 0, r.code)
		assert.Contains(t, r.stdout, "usage: idemscrape COMMAND")
		for _, c := range commands {
			for _, h := range []string{"-h", "--help"} {
				r := run(t, "", c.name, h)
				assert.Equal(t, 0, r.code, "%s %s: %s", c.name, h, r.stderr)
				assert.Contains(t, r.stdout, "usage: idemscrape "+c.name, "%s %s shows its own usage", c.name, h)
			}
		}
		r = run(t, "", "help", "audit")
		assert.Equal(t, 0, r.code)
		assert.Contains(t, r.stdout, "-lease-max")
		r = run(t, "", "frobnicate")
		assert.Equal(t, 2, r.code)
		assert.Contains(t, r.stderr, `unknown command "frobnicate"`)
	})

	t.Run("RedisSettingsConflict", func(t *testing.T) {
		// IDEMSCRAPE_REDIS and IDEMSCRAPE_REDIS_CLUSTER are mutually exclusive: a usage error
		// naming both, and nothing enqueued.
		before := jobs(t)
		r := runCLI(t, bin, []string{"IDEMSCRAPE_PG=" + dsn, "IDEMSCRAPE_REDIS=" + ns.Addr, "IDEMSCRAPE_REDIS_CLUSTER=127.0.0.1:1,127.0.0.1:2"}, "",
			"enqueue", "-allow-unknown-kind", "-kind", kind, "-source-id", "sku-conflict", "-country", "US", "-window", "2026-04-23", "-parser-version", "3")
		assert.Equal(t, 2, r.code, "stderr: %s", r.stderr)
		assert.Contains(t, r.stderr, "IDEMSCRAPE_REDIS_CLUSTER")
		assert.Contains(t, r.stderr, "IDEMSCRAPE_REDIS")
		assert.Equal(t, before, jobs(t), "a refused command stores nothing")
	})

	t.Run("StrayArgumentsRefused", func(t *testing.T) {
		spec := []string{"-kind", kind, "-source-id", "sku-x", "-country", "US", "-window", "2026-04-23", "-parser-version", "3"}
		for _, tc := range []struct {
			name  string
			args  []string
			stray string
		}{
			{"EnqueueTrailing", append(append([]string{"enqueue", "-allow-unknown-kind"}, spec...), "extra", "words"), `"extra" "words"`},
			{"EnqueueBeforeFlags", append([]string{"enqueue", "stray"}, spec...), `"stray"`},
			{"StatusTwoKeys", []string{"status", k1, "other"}, `"other"`},
			{"Stats", []string{"stats", "now"}, `"now"`},
			{"Audit", []string{"audit", "-json", "all"}, `"all"`},
			{"Requeue", []string{"requeue", k2, "-by", "x", "again"}, `"again"`},
			{"Migrate", []string{"migrate", "up"}, `"up"`},
		} {
			t.Run(tc.name, func(t *testing.T) {
				r := run(t, "", tc.args...)
				assert.Equal(t, 2, r.code, r.stderr)
				assert.Contains(t, r.stderr, "unexpected argument(s): "+tc.stray)
				assert.Contains(t, r.stderr, "usage: idemscrape "+tc.args[0])
			})
		}
		r := run(t, "", "status")
		assert.Equal(t, 2, r.code)
		assert.Contains(t, r.stderr, "missing KEY")
		assert.Zero(t, jobs(t), "nothing stored")
	})

	t.Run("OneSpecErrorNamesTheFlag", func(t *testing.T) {
		r := run(t, "", "enqueue", "-allow-unknown-kind", "-kind", kind, "-source-id", "s", "-country", "US", "-window", "2026-04-23", "-parser-version", "0")
		assert.Equal(t, 2, r.code)
		assert.Contains(t, r.stderr, "field -parser-version")
		assert.NotContains(t, r.stderr, "spec 0")
		r = run(t, "", "enqueue", "-allow-unknown-kind", "-f", "-", "-kind", kind)
		assert.Equal(t, 2, r.code)
		assert.Contains(t, r.stderr, "-kind can not be combined")
		assert.Zero(t, jobs(t))
	})

	t.Run("EnqueueFileWithBadLine", func(t *testing.T) {
		line := func(src string) string {
			return `{"kind":"` + kind + `","source_id":"` + src + `","country":"US","window":"2026-04-23","parser_version":3}`
		}
		input := strings.Join([]string{
			line("sku-1"),
			line("sku-2"),
			`{"kind":"` + kind + `","source_id":"sku-bad","country":"US","window":"2026-04-23","parser_version":0}`,
			"# a comment",
			line("sku-3"),
			`{"kind":"` + kind + `","source_id":"sku-5","country":"US","window":"2026-04-23","parser_version":"3"}`,
			`{"kind":"` + kind + `","sourceid":"sku-6"}`,
			line("sku-4"),
		}, "\n")
		r := run(t, input, "enqueue", "-allow-unknown-kind", "-f", "-")
		assert.Equal(t, 1, r.code, r.stderr)
		assert.Contains(t, r.stderr, "line 3: field parser_version")
		assert.Contains(t, r.stderr, "line 6: field parser_version: must be a JSON number")
		assert.Contains(t, r.stderr, `line 7: unknown field "sourceid"`)
		assert.Contains(t, r.stderr, "3 line(s) refused, 4 stored")
		assert.NotContains(t, r.stderr, "line 1:")
		for i, k := range []string{k1, k2, k3, k4} {
			assert.Contains(t, r.stdout, "created "+k, "good line %d stored", i)
			assert.True(t, ns.AsynqTaskExists(t, k), "task of %s in the kind's queue", k)
		}
		assert.Equal(t, 4, jobs(t), "good lines stored, bad ones not")

		// The same file again: nothing new, every line reported.
		f := filepath.Join(t.TempDir(), "specs.jsonl")
		require.NoError(t, os.WriteFile(f, []byte(line("sku-1")+"\n"), 0o644))
		r = run(t, "", "enqueue", "-allow-unknown-kind", "-f", f)
		assert.Equal(t, 0, r.code, r.stderr)
		assert.Equal(t, "line 1: already_queued "+k1+" (state pending)\n", r.stdout)
	})

	// The scripted run, through the store as workers would drive it. The two workers use
	// two accounts (and tiers) on one gateway: stats and status tell them apart.
	start := func(key string, token int64, worker string) {
		t.Helper()
		provider, tier := "acct-a", "residential"
		if worker == "w2" {
			provider, tier = "acct-b", "datacenter"
		}
		_, err := st.JobStart(ctx, store.AttemptStartParams{Key: key, Token: token, Worker: worker, SessionID: "sess000" + worker[1:],
			Country: "US", ProxyEndpoint: "gw.example:7777", Provider: provider, Tier: tier})
		require.NoError(t, err)
	}
	commit := func(key string, token int64, obsKey string) store.CommitResult {
		t.Helper()
		payload, err := json.Marshal(map[string]string{"job_key": key, "observation_key": obsKey})
		require.NoError(t, err)
		res, err := st.Commit(ctx, store.CommitParams{Key: key, Token: token, ObservationKey: obsKey, ParserVersion: 3,
			Data: []byte(`{"price":"19.99"}`), Fingerprint: "sha256:f00d", EventKey: handlers.EventKey(key), Topic: kind,
			EventPayload: payload, HTTPStatus: 200, Bytes: 2048, SessionID: "sess0002",
			Cost: store.Cost{Micros: 17_203, Currency: "USD"}}) // 2,048 bytes at 8.40 USD/GB
		require.NoError(t, err)
		return res
	}
	start(k1, 1, "w1")
	start(k1, 2, "w2") // takeover: attempt 1 superseded
	commit(k1, 2, k1)
	start(k2, 1, "w1")
	require.NoError(t, st.JobMarkRetryable(ctx, store.AttemptFinishParams{Key: k2, Token: 1, NextAttemptAt: time.Now(),
		Category: "timeout", Error: "GET /p/2: context deadline exceeded", Bytes: 500, HTTPStatus: 0,
		Cost: store.Cost{Micros: 4_200, Currency: "USD"}}))
	start(k2, 2, "w2")
	require.NoError(t, st.JobFail(ctx, store.AttemptFinishParams{Key: k2, Token: 2, Category: "parse_error",
		Error: "price: selector .price matched nothing", Bytes: 300, HTTPStatus: 200}))
	start(k3, 1, "w1")
	require.False(t, commit(k3, 1, k1).ResultInserted, "k3 observed what k1 stored: a duplicate result write")
	start(k4, 1, "w3") // left running, its task still queued
	// A consumer's inbox recognised two replays of k1's event (store/outbox Consumer.RunTx
	// records them so; TestStatsSixMeasures drives the real consumer).
	_, err := pool.Exec(ctx, `INSERT INTO outbox_positions (topic, xid, id)
SELECT DISTINCT ON (topic) topic, xid, id FROM outbox ORDER BY topic, xid DESC, id DESC
ON CONFLICT (topic) DO UPDATE SET xid = excluded.xid, id = excluded.id`) // dispatched
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO outbox_inbox (consumer_group, event_key, replays) VALUES ('g', $1, 2), ('g', $2, 0)`,
		handlers.EventKey(k1), handlers.EventKey(k3))
	require.NoError(t, err)
	require.NoError(t, st.CountersAdd(ctx, map[string]int64{"jobs_rescued": 1}))
	// k2's task ended the way the runner ends a failed job's: archived by asynq.
	insp := asynq.NewInspector(ns.AsynqOpt())
	t.Cleanup(func() { _ = insp.Close() })
	require.NoError(t, insp.ArchiveTask(ns.Queue, k2))

	t.Run("Requeue", func(t *testing.T) {
		r := run(t, "", "requeue", k1)
		assert.Equal(t, 1, r.code)
		assert.Contains(t, r.stderr, "refused: ops: JobRequeue \""+k1+"\": the job is complete: only a failed job can be re-queued")
		r = run(t, "", "requeue", "nope")
		assert.Equal(t, 1, r.code)
		assert.Contains(t, r.stderr, `no job with key "nope"`)

		r = run(t, "", "requeue", "-by", "alice", "-note", "parser v3 fixed", k2)
		require.Equal(t, 0, r.code, r.stderr)
		assert.Equal(t, "requeued "+k2+" by alice: state pending, task repaired: archived task deleted and enqueued again\n", r.stdout)
		info, err := insp.GetTaskInfo(ns.Queue, k2)
		require.NoError(t, err)
		assert.Equal(t, asynq.TaskStatePending, info.State)
		job, err := st.JobGet(ctx, k2)
		require.NoError(t, err)
		assert.Equal(t, tasks.StatePending, job.State)
		assert.Equal(t, 2, job.Attempts, "attempts are evidence: kept")
		assert.Equal(t, 1, testutil.Count(t, pool, `SELECT count(*) FROM jobs WHERE key = $1 AND budget_attempts = 2 AND budget_bytes = 800 AND budget_since IS NOT NULL`, k2))

		r = run(t, "", "requeue", k2)
		assert.Equal(t, 1, r.code)
		assert.Contains(t, r.stderr, "the job is pending: only a failed job can be re-queued")
	})

	t.Run("Status", func(t *testing.T) {
		r := run(t, "", "status", k1)
		require.Equal(t, 0, r.code, r.stderr)
		golden(t, "status_complete.golden", normalise(r.stdout, kind))
		r = run(t, "", "status", k2, "-json") // flags after the key are flags
		require.Equal(t, 0, r.code, r.stderr)
		var st map[string]any
		require.NoError(t, json.Unmarshal([]byte(r.stdout), &st))
		job := st["job"].(map[string]any)
		assert.Equal(t, k2, job["key"])
		assert.Equal(t, "pending", job["state"])
		assert.EqualValues(t, 3, job["parser_version"])
		attempts := st["attempts"].([]any)
		require.Len(t, attempts, 2)
		a := attempts[0].(map[string]any)
		assert.EqualValues(t, 1, a["attempt_no"])
		assert.Equal(t, "timeout", a["category"])
		assert.Equal(t, "gw.example:7777", a["proxy_endpoint"])
		assert.Equal(t, "acct-a", a["provider"])
		assert.Equal(t, "residential", a["tier"])
		assert.Contains(t, a, "duration_ms")
		notes := st["notes"].([]any)
		require.Len(t, notes, 1)
		assert.Equal(t, "alice", notes[0].(map[string]any)["by"])
		assert.NotRegexp(t, `"[A-Z][A-Za-z]*":`, r.stdout, "snake_case fields only")
		r = run(t, "", "status", k2)
		require.Equal(t, 0, r.code, r.stderr)
		golden(t, "status_requeued.golden", normalise(r.stdout, kind))
		r = run(t, "", "status", "nope")
		assert.Equal(t, 1, r.code)
		assert.Contains(t, r.stderr, `no job with key "nope"`)
	})

	t.Run("Stats", func(t *testing.T) {
		r := run(t, "", "stats")
		require.Equal(t, 0, r.code, r.stderr)
		// The storage section (sizes vary with PostgreSQL's pages) is checked apart.
		measures, sto, ok := strings.Cut(r.stdout, "\nTABLE ")
		require.True(t, ok, "a storage section: %s", r.stdout)
		golden(t, "stats.golden", normalise(measures, kind))
		assert.Contains(t, normalise(measures, kind), "total  0.038606 USD over 3 charged attempts")
		assert.Contains(t, normalise(measures, kind), "charged attempts are those with a cost: 3 of the 5 recorded (CHARGED and ATTEMPTS by provider below); the other 2 cost nothing")
		assert.Regexp(t, `(?m)^jobs +\d+ +\d+(\.\d)? (B|kB|MB)$`, sto)
		assert.Regexp(t, `(?m)^quarantine +\d+`, sto)
		assert.Contains(t, sto, "retention deletes next: 0 terminal jobs with all their rows (job_retention 90d), 0 quarantine rows (quarantine_retention 7d), 0 schedule windows")
		r = run(t, "", "stats", "-json")
		require.Equal(t, 0, r.code, r.stderr)
		var st map[string]any
		require.NoError(t, json.Unmarshal([]byte(r.stdout), &st))
		for _, m := range []string{"attempts_per_completed_job", "jobs_completed_after_lease_recovery",
			"duplicate_result_writes_rejected", "outbox_events_deduplicated_downstream", "bytes_per_logical_job"} {
			assert.NotZero(t, st[m], m)
		}
		assert.NotEmpty(t, st["retries_caused_by_category"])
		costs := st["costs"].([]any)
		require.Len(t, costs, 1)
		usd := costs[0].(map[string]any)
		assert.EqualValues(t, 2*17_203+4_200, usd["total_micros"], "k1's and k3's commits, k2's timeout")
		assert.EqualValues(t, 17_203, usd["useful_micros"])
		assert.Equal(t, map[string]any{"duplicate": 17_203.0, "retryable/timeout": 4_200.0}, usd["waste_micros"])
		// The cost section and the provider table count the same attempts: the cost counts
		// the charged ones (with a cost), the table all of them and, apart, the charged
		// ones. Two cost nothing here: k1's superseded first attempt, k2's parse failure.
		var recorded, charged, chargedUSD float64
		for _, p := range st["by_provider"].([]any) {
			p := p.(map[string]any)
			recorded += p["attempts"].(float64)
			charged += p["charged"].(float64)
			for _, c := range p["costs"].([]any) {
				chargedUSD += c.(map[string]any)["attempts"].(float64)
			}
		}
		assert.EqualValues(t, 3, usd["attempts"], "k1's and k3's commits, k2's timeout")
		assert.Equal(t, usd["attempts"], charged, "the providers' charged attempts are the cost's")
		assert.Equal(t, usd["attempts"], chargedUSD)
		assert.EqualValues(t, 5, recorded, "every recorded attempt (k4's running one is not recorded yet)")
		assert.NotEmpty(t, st["diagnosis"])
		require.Contains(t, st, "storage")
		assert.Len(t, st["storage"].(map[string]any)["tables"], 11)
		assert.NotRegexp(t, `"[A-Z][A-Za-z]*":`, r.stdout, "snake_case fields only")
	})

	auditArgs := []string{"audit", "-lease-max", "1ms", "-outbox-lag", "1m"}
	t.Run("AuditPasses", func(t *testing.T) {
		// k4 runs past -lease-max 1ms, but its task is queued: that is fine.
		r := run(t, "", auditArgs...)
		require.Equal(t, 0, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
		assert.Contains(t, r.stdout, "all invariants hold")
		assert.Equal(t, 6, strings.Count(r.stdout, "PASS"))
		assert.Regexp(t, `PASS\s+running_past_lease_has_live_task\s+1\s+0`, r.stdout, "k4 was checked against the queue")
	})

	t.Run("AuditFailsOnBrokenFixture", func(t *testing.T) {
		exec := func(q string, args ...any) {
			t.Helper()
			_, err := pool.Exec(ctx, q, args...)
			require.NoError(t, err)
		}
		exec(`DELETE FROM outbox WHERE event_key = $1`, handlers.EventKey(k1))                                                    // complete job without event
		exec(`INSERT INTO results (observation_key, job_key, parser_version, data, fence) VALUES ('orphan', $1, 3, '{}', 1)`, k2) // result of a pending job
		require.NoError(t, ns.Client.Del(ctx, "asynq:{"+ns.Queue+"}:t:"+k4).Err())                                                // running job's task lost
		exec(`UPDATE outbox SET created_at = now() - interval '1 hour' WHERE event_key = $1`, handlers.EventKey(k3))
		exec(`UPDATE outbox_positions p SET xid = o.xid, id = o.id - 1 FROM outbox o WHERE o.event_key = $1 AND p.topic = o.topic`, handlers.EventKey(k3)) // not dispatched
		exec(`UPDATE attempts SET fence = 5 WHERE job_key = $1 AND attempt_no = 1`, k1)                                                                    // fences 5, 2
		exec(`DELETE FROM attempts WHERE job_key = $1`, k3)                                                                                                // a complete job whose start left no row
		r := run(t, "", auditArgs...)
		assert.Equal(t, 1, r.code, r.stderr)
		for inv, key := range map[string]string{
			"complete_job_has_one_result_and_one_event":  k1,
			"result_has_complete_job":                    k2,
			"running_past_lease_has_live_task":           k4,
			"outbox_lag_within_threshold":                k3,
			"attempt_fences_strictly_increasing":         k1,
			"terminal_job_has_one_attempt_row_per_start": k3,
		} {
			assert.Regexp(t, `BROKEN `+inv+`: 1 violation\(s\), e\.g\. `+regexp.QuoteMeta(key), r.stderr)
			assert.Regexp(t, `FAIL\s+`+inv+`\s+\d+\s+1\s+`+regexp.QuoteMeta(key), r.stdout)
		}
		r = run(t, "", append(auditArgs, "-json")...)
		assert.Equal(t, 1, r.code)
		var rep struct {
			OK         bool `json:"ok"`
			Invariants []struct {
				Name       string   `json:"name"`
				Violations int      `json:"violations"`
				Examples   []string `json:"examples"`
			} `json:"invariants"`
		}
		require.NoError(t, json.Unmarshal([]byte(r.stdout), &rep))
		assert.False(t, rep.OK)
		require.Len(t, rep.Invariants, 6)
	})

	t.Run("UnmigratedDatabase", func(t *testing.T) {
		other := testutil.PG(t)
		_, err := other.Exec(ctx, `DELETE FROM goose_db_version WHERE version_id = (SELECT max(version_id) FROM goose_db_version)`)
		require.NoError(t, err)
		for _, args := range [][]string{{"stats"}, {"status", k1}, {"audit"}, {"requeue", k1},
			{"enqueue", "-allow-unknown-kind", "-kind", kind, "-source-id", "s", "-country", "US", "-window", "w", "-parser-version", "1"}} {
			r := runIn(t, dsnOf(t, other), "", args...)
			assert.Equal(t, 1, r.code, "%v", args)
			assert.Contains(t, r.stderr, "run `idemscrape migrate`", "%v", args)
		}
	})

	// windows: the recorded windows, the gaps found from the scheduler's configuration
	// (exit 1 while there is one), a fill that enqueues a gap's jobs once, and the usage
	// rules. Its own database: the fixture above is left as the audit found it.
	t.Run("Windows", func(t *testing.T) {
		wpool := testutil.PG(t)
		wdsn := dsnOf(t, wpool)
		dir := t.TempDir()
		cfg := filepath.Join(dir, "scheduler.yaml")
		require.NoError(t, os.WriteFile(cfg, []byte(`templates:
  - name: daily-prices
    cron: "@daily"
    window: daily
    kind: `+kind+`
    catchup: none
    sources: {ids: [sku-1, sku-2]}
    countries: [US]
    parser_version: 1
kinds:
  `+kind+`: {queue: `+ns.Queue+`}
`), 0o600))
		// The scheduler ran 4 days ago and then was down: 3 windows due since are gaps
		// (today's is not yet past its deadline, the next tick).
		day := time.Now().UTC().Truncate(24 * time.Hour)
		_, err := wpool.Exec(ctx, `INSERT INTO schedule_windows (template, "window", kind, due_at, state, enqueued_at)
VALUES ('daily-prices', $1, $2, $3, 'enqueued', $3)`, day.AddDate(0, 0, -4).Format("2006-01-02"), kind, day.AddDate(0, 0, -4))
		require.NoError(t, err)
		r := runIn(t, wdsn, "", "windows")
		require.Equal(t, 0, r.code, r.stderr)
		assert.Regexp(t, `daily-prices\s+`+day.AddDate(0, 0, -4).Format("2006-01-02")+`\s+\S+\s+enqueued`, r.stdout)

		r = runIn(t, wdsn, "", "windows", "-config", cfg, "-gaps")
		assert.Equal(t, 1, r.code, "exit 1 while there is a gap: %s", r.stderr)
		assert.Contains(t, r.stdout, "3 gap(s)")
		gap := day.AddDate(0, 0, -2).Format("2006-01-02")
		assert.Contains(t, r.stdout, gap)

		for range 2 { // a second fill finds the jobs and enqueues nothing new
			r = runIn(t, wdsn, "", "windows", "-config", cfg, "-fill", "daily-prices", gap)
			require.Equal(t, 0, r.code, r.stderr)
			assert.Contains(t, r.stdout, "filled daily-prices/"+gap)
		}
		assert.Equal(t, 2, testutil.Count(t, wpool, `SELECT count(*) FROM jobs WHERE "window" = '`+gap+`'`), "each job of the window once")
		r = runIn(t, wdsn, "", "windows", "-config", cfg, "-gaps", "-json")
		assert.Equal(t, 1, r.code)
		var gaps []map[string]any
		require.NoError(t, json.Unmarshal([]byte(r.stdout), &gaps))
		assert.Len(t, gaps, 2, "the filled window is no gap any more")
		for _, g := range gaps {
			assert.Contains(t, g, "window")
			assert.NotEqual(t, gap, g["window"])
		}

		// A window first ticked longer ago than job_retention (its jobs may have been pruned)
		// is filled only with -force, the refusal saying what -force does.
		first := day.AddDate(0, 0, -4).Format("2006-01-02")
		_, err = wpool.Exec(ctx, `UPDATE schedule_windows SET started_at = now() - interval '100 days' WHERE "window" = $1`, first)
		require.NoError(t, err)
		r = runIn(t, wdsn, "", "windows", "-config", cfg, "-fill", "daily-prices", first)
		assert.Equal(t, 1, r.code, r.stdout)
		assert.Contains(t, r.stderr, "-force")
		assert.Contains(t, r.stderr, "same event keys")
		assert.Zero(t, testutil.Count(t, wpool, `SELECT count(*) FROM jobs WHERE "window" = '`+first+`'`))
		r = runIn(t, wdsn, "", "windows", "-config", cfg, "-fill", "-force", "daily-prices", first)
		require.Equal(t, 0, r.code, r.stderr)
		assert.Equal(t, 2, testutil.Count(t, wpool, `SELECT count(*) FROM jobs WHERE "window" = '`+first+`'`))

		for _, args := range [][]string{{"windows", "-gaps"}, {"windows", "-fill", "a"}, {"windows", "-gaps", "-fill", "a", "b"},
			{"windows", "extra"}, {"windows", "-limit", "0"}, {"windows", "-force"}} {
			r = runIn(t, wdsn, "", args...)
			assert.Equal(t, 2, r.code, "%v: %s", args, r.stderr)
		}
		r = runIn(t, wdsn, "", "windows", "-config", cfg, "-fill", "nope", gap)
		assert.Equal(t, 1, r.code)
		assert.Contains(t, r.stderr, "nope")
	})
}

// TestEnqueueFileBadLines: `enqueue -f` refuses, each alone and by line number, a line of
// invalid UTF-8 (not stored as U+FFFD), a line that gives a field twice (encoding/json
// would keep the last, even for kind), a line over the size limit (the file is read on);
// a UTF-8 byte order mark is accepted; the good lines are stored and their outcome
// printed, the refused ones leave nothing behind; a queue no worker serves is warned
// about. A KEY argument of invalid UTF-8 is a usage error, not SQLSTATE 22021.
func TestEnqueueFileBadLines(t *testing.T) {
	bin := buildCLI(t, t.TempDir())
	pool := testutil.PG(t)
	ns := testutil.Redis(t)
	kind := ns.Queue
	line := func(src string) string {
		return `{"kind":"` + kind + `","source_id":"` + src + `","country":"US","window":"2026-04-23","parser_version":1}`
	}
	input := "\xef\xbb\xbf" + line("sku-1") + "\n" +
		`{"kind":"` + kind + `","source_id":"sku-` + "\xff\xfe" + `","country":"US","window":"2026-04-23","parser_version":1}` + "\n" +
		`{"kind":"other","kind":"` + kind + `","source_id":"sku-3","country":"US","window":"2026-04-23","parser_version":1}` + "\n" +
		`{"kind":"` + kind + `","source_id":"` + strings.Repeat("x", 2<<20) + `"}` + "\n" +
		line("sku-5") + "\n" +
		`{"kind":"` + kind + `","KIND":"other","source_id":"sku-6","country":"US","window":"2026-04-23","parser_version":1}` + "\n" +
		`{"\u212aind":"other","source_id":"sku-7","country":"US","window":"2026-04-23","parser_version":1}` + "\n" +
		`{"kind":"` + kind + `","source_id":"sku-\ud800","country":"US","window":"2026-04-23","parser_version":1}` + "\n"
	run := func(stdin string, args ...string) cliRun {
		t.Helper()
		return runCLI(t, bin, []string{"IDEMSCRAPE_PG=" + dsnOf(t, pool), "IDEMSCRAPE_REDIS=" + ns.Addr}, stdin, args...)
	}
	r := run(input, "enqueue", "-allow-unknown-kind", "-f", "-")
	assert.Equal(t, 1, r.code, r.stderr)
	assert.Contains(t, r.stderr, `line 2: not valid UTF-8 at byte `+strconv.Itoa(28+len(kind))+` ("\xff"): specs are UTF-8 text`)
	assert.Contains(t, r.stderr, "line 3: field kind is given twice")
	assert.Contains(t, r.stderr, "line 4: longer than 1048576 bytes")
	assert.Contains(t, r.stderr, `line 6: unknown field "KIND"`, "a key in another case is not the field")
	assert.Contains(t, r.stderr, "line 7: unknown field \"\u212aind\"", "nor one that folds to it (a Kelvin sign K)")
	assert.Contains(t, r.stderr, "line 8: field source_id: an escape of half a surrogate pair")
	assert.Contains(t, r.stderr, "6 line(s) refused, 2 stored")
	assert.NotContains(t, r.stderr, "line 1:", "the byte order mark is not part of the first line")
	assert.NotContains(t, r.stderr, "line 5:")
	assert.Contains(t, r.stdout, "line 1: created "+kind+":sku-1:US:2026-04-23:v1")
	assert.Contains(t, r.stdout, "line 5: created "+kind+":sku-5:US:2026-04-23:v1")
	assert.Contains(t, r.stderr, `warning: no worker serves queue "`+kind+`"`)
	assert.Equal(t, 2, testutil.Count(t, pool, `SELECT count(*) FROM jobs`), "the refused lines stored nothing")
	assert.Zero(t, testutil.Count(t, pool, `SELECT count(*) FROM jobs WHERE key LIKE '%'||chr(65533)||'%'`), "no U+FFFD stored")

	for _, cmd := range []string{"status", "requeue"} {
		r = run("", cmd, kind+":sku-\xff:US:2026-04-23:v1")
		assert.Equal(t, 2, r.code, "%s: %s", cmd, r.stderr)
		assert.Contains(t, r.stderr, `argument 1 (KEY`, cmd)
		assert.Contains(t, r.stderr, `: not valid UTF-8 at byte `+strconv.Itoa(len(kind)+5)+` ("\xff"); keys and names are UTF-8 text`, cmd)
		assert.NotContains(t, r.stderr, "SQLSTATE", cmd)
	}
	// A 130 kB key is echoed cut, with its length.
	long := strings.Repeat("k", 130_000)
	for _, args := range [][]string{{"status", long}, {"requeue", "-by", "x", long}} {
		r = run("", args...)
		assert.Equal(t, 1, r.code, "%s: %.300s", args[0], r.stderr)
		assert.Contains(t, r.stderr, `no job with key "`+long[:200]+`"… (130000 bytes)`, args[0])
		assert.Less(t, len(r.stderr), 1_000, args[0])
	}
	// audit's flag errors name the flag, not a Go struct field.
	for flagArgs, want := range map[string]string{"-batch 0": "-batch 0 must be >= 1", "-examples -1": "-examples -1 must be >= 1",
		"-lease-max -1s": "-lease-max -1s must be positive"} {
		r = run("", append([]string{"audit"}, strings.Fields(flagArgs)...)...)
		assert.Equal(t, 2, r.code, "%s: %s", flagArgs, r.stderr)
		assert.Contains(t, r.stderr, want)
		assert.NotContains(t, r.stderr, "AuditConfig")
	}
}

// TestCLIOverRedisTLS: the CLI reaches a Redis that needs TLS and an ACL user, its
// password from a file; a wrong CA fails with the TLS error and no password.
func TestCLIOverRedisTLS(t *testing.T) {
	const password = "cli-app-pw-77d2"
	bin := buildCLI(t, t.TempDir())
	pool := testutil.PG(t)
	srv := testutil.StartRedisWith(t, testutil.RedisOptions{Password: "cli-default-pw", ACL: []string{"app on >" + password + " ~* &* +@all -@admin"}, TLS: true})
	pw := filepath.Join(t.TempDir(), "redis-pw")
	require.NoError(t, os.WriteFile(pw, []byte(password+"\n"), 0o600))
	env := func(ca string) []string {
		return []string{"IDEMSCRAPE_PG=" + dsnOf(t, pool), "IDEMSCRAPE_REDIS=rediss://app@" + srv.Addr,
			"IDEMSCRAPE_REDIS_PASSWORD_FILE=" + pw, "IDEMSCRAPE_REDIS_TLS_CA=" + ca}
	}
	args := []string{"enqueue", "-allow-unknown-kind", "-kind", "tlskind", "-source-id", "sku-1", "-country", "US", "-window", "2026-04-23", "-parser-version", "1"}
	r := runCLI(t, bin, env(srv.TLS.CAFile), "", args...)
	require.Equal(t, 0, r.code, r.stderr)
	assert.Contains(t, r.stdout, "created tlskind:sku-1:US:2026-04-23:v1")
	n, err := srv.Client().Exists(context.Background(), "asynq:{tlskind}:t:tlskind:sku-1:US:2026-04-23:v1").Result()
	require.NoError(t, err)
	assert.EqualValues(t, 1, n, "the task is in the TLS Redis")

	r = runCLI(t, bin, env(srv.TLS.OtherCAFile), "", append(args[:5:5], "sku-2", "-country", "US", "-window", "2026-04-23", "-parser-version", "1")...)
	assert.Equal(t, 1, r.code, r.stderr)
	assert.Contains(t, r.stderr, "certificate signed by unknown authority")
	assert.NotContains(t, r.stderr+r.stdout, password)

	// A plain connection to the TLS server: the error says what was stored and hints rediss://.
	plain := []string{"IDEMSCRAPE_PG=" + dsnOf(t, pool), "IDEMSCRAPE_REDIS=redis://app@" + srv.Addr, "IDEMSCRAPE_REDIS_PASSWORD_FILE=" + pw}
	r = runCLI(t, bin, plain, "", append(args[:5:5], "sku-3", "-country", "US", "-window", "2026-04-23", "-parser-version", "1")...)
	assert.Equal(t, 1, r.code, r.stderr)
	assert.Contains(t, r.stderr, "rediss://")
	assert.Contains(t, r.stderr, "stored: the jobs row of tlskind:sku-3:US:2026-04-23:v1")
	assert.NotContains(t, r.stderr+r.stdout, password)
}
