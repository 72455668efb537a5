package main

import (
	"context"
	"fmt"
	"io"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// redisCounts is what a Redis server has processed: calls per command (INFO commandstats,
// which counts the commands a script runs as well as the script call) and the reads of
// client input it processed (INFO stats total_reads_processed: about one per round trip).
type redisCounts struct {
	calls map[string]int
	reads int
}

// total is the calls of every command but INFO (the counting itself).
func (c redisCounts) total() int {
	n := 0
	for cmd, k := range c.calls {
		if cmd != "info" {
			n += k
		}
	}
	return n
}

func (c redisCounts) String() string {
	var parts []string
	for _, cmd := range sortedKeys(c.calls) {
		parts = append(parts, fmt.Sprintf("%s=%d", cmd, c.calls[cmd]))
	}
	return fmt.Sprintf("reads=%d %s", c.reads, strings.Join(parts, " "))
}

// readRedisCounts reads the counts of the server rdb talks to.
func readRedisCounts(tb testing.TB, rdb *redis.Client) redisCounts {
	tb.Helper()
	c := redisCounts{calls: map[string]int{}}
	for _, section := range []string{"commandstats", "stats"} {
		info, err := rdb.Info(context.Background(), section).Result()
		if err != nil {
			tb.Fatalf("INFO %s: %v", section, err)
		}
		for l := range strings.Lines(info) {
			l = strings.TrimSpace(l)
			if name, rest, ok := strings.Cut(l, ":"); ok && strings.HasPrefix(name, "cmdstat_") {
				calls, _, _ := strings.Cut(strings.TrimPrefix(rest, "calls="), ",")
				n, err := strconv.Atoi(calls)
				if err != nil {
					tb.Fatalf("INFO commandstats: %q", l)
				}
				c.calls[strings.TrimPrefix(name, "cmdstat_")] = n
			} else if ok && name == "total_reads_processed" {
				if c.reads, err = strconv.Atoi(rest); err != nil {
					tb.Fatalf("INFO stats: %q", l)
				}
			}
		}
	}
	return c
}

// sub is c - before.
func (c redisCounts) sub(before redisCounts) redisCounts {
	d := redisCounts{calls: map[string]int{}, reads: c.reads - before.reads}
	for cmd, n := range c.calls {
		if n -= before.calls[cmd]; n != 0 {
			d.calls[cmd] = n
		}
	}
	return d
}

// rerunOverhead bounds the Redis commands of one `enqueue -f` run that do not depend on
// its lines: connection handshakes (HELLO, CLIENT SETINFO) of each client's connections and
// the warning about unserved queues (asynq's server list).
const rerunOverhead = 60

// TestEnqueueFileRerunCommands: the same `enqueue -f` file run a second time, every line
// already queued, costs one Redis command per line (the read of its task's state) and one
// round trip per batch — not asynq's enqueue script, its id conflict and an inspection of the
// task per line (6 commands and 3 round trips a line before). Counted on a throwaway
// redis-server of its own (INFO commandstats and total_reads_processed), never timed. The
// fast path keeps exactly-once: a job whose task Redis lost gets it again (requeued), an
// archived task is repaired, a complete or failed job gets none.
func TestEnqueueFileRerunCommands(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	srv := testutil.StartRedis(t)
	cliEnv(t, dsnOf(t, pool), srv.Addr)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { _ = rdb.Close() })

	const kind, n, batch = "rerun", 1000, 250
	file := filepath.Join(t.TempDir(), "specs.jsonl")
	require.NoError(t, os.WriteFile(file, []byte(strings.Join(specLines(kind, 0, n), "\n")+"\n"), 0o600))
	args := []string{"enqueue", "-allow-unknown-kind", "-f", file, "-batch", strconv.Itoa(batch), "-json"}
	runCounted := func() (map[int]enqueueResult, redisCounts) {
		t.Helper()
		before := readRedisCounts(t, rdb)
		stderr := newWatchedStderr()
		stdout, code := runInProcess(nil, stderr, args...)
		require.Equal(t, 0, code, stderr.String())
		return outcomes(t, stdout), readRedisCounts(t, rdb).sub(before)
	}

	got, first := runCounted()
	require.Len(t, got, n)
	t.Logf("first run, %d lines: %d commands (%.2f a line), %d reads: %s", n, first.total(), float64(first.total())/n, first.reads, first)

	got, rerun := runCounted()
	require.Len(t, got, n)
	for line, r := range got {
		require.Equal(t, "already_queued", r.Outcome, "line %d", line)
	}
	t.Logf("rerun, %d lines: %d commands (%.2f a line), %d reads: %s", n, rerun.total(), float64(rerun.total())/n, rerun.reads, rerun)
	assert.Equal(t, n, rerun.calls["hget"], "one read of its task's state per line: %s", rerun)
	// asynq's server list (the unserved-queue warning) is the run's only script.
	assert.LessOrEqual(t, rerun.calls["evalsha"]+rerun.calls["eval"], 4, "no asynq script for a line already queued: %s", rerun)
	assert.Zero(t, rerun.calls["exists"]+rerun.calls["sismember"]+rerun.calls["hmget"], "no enqueue script, no inspection: %s", rerun)
	assert.LessOrEqual(t, rerun.total(), n+rerunOverhead, "one command per line already queued: %s", rerun)
	assert.Less(t, rerun.reads, n/10, "a round trip per batch, not per line: %s", rerun)
	assert.Equal(t, n, testutil.Count(t, pool, `SELECT count(*) FROM jobs`))

	// Exactly-once around the fast path. Redis loses two tasks; one task is archived;
	// two jobs complete and two fail (their tasks gone, as a worker leaves them).
	key := func(i int) string { return keyOfSrc(t, kind, i) }
	pendingKey := "asynq:{" + kind + "}:pending"
	drop := func(i int) {
		t.Helper()
		require.NoError(t, rdb.Del(ctx, tasks.AsynqTaskKey(kind, key(i))).Err())
		require.NoError(t, rdb.LRem(ctx, pendingKey, 0, key(i)).Err())
	}
	lost, complete, failed, archived := []int{3, 700}, []int{10, 11}, []int{20, 21}, 30
	for _, i := range lost {
		drop(i)
	}
	for _, i := range append(append([]int{}, complete...), failed...) {
		drop(i)
	}
	for _, i := range complete {
		_, err := pool.Exec(ctx, `UPDATE jobs SET state = 'complete', completed_at = now() WHERE key = $1`, key(i))
		require.NoError(t, err)
	}
	for _, i := range failed {
		_, err := pool.Exec(ctx, `UPDATE jobs SET state = 'failed' WHERE key = $1`, key(i))
		require.NoError(t, err)
	}
	insp := asynq.NewInspector(asynq.RedisClientOpt{Addr: srv.Addr})
	t.Cleanup(func() { _ = insp.Close() })
	require.NoError(t, insp.ArchiveTask(kind, key(archived)))

	got, again := runCounted()
	t.Logf("rerun after losses, %d lines: %d commands, %d reads: %s", n, again.total(), again.reads, again)
	require.Len(t, got, n)
	want := map[int]string{archived: "repaired: archived task deleted and enqueued again"}
	for _, i := range lost {
		want[i] = "requeued"
	}
	for _, i := range complete {
		want[i] = "already_complete"
	}
	for _, i := range failed {
		want[i] = "already_failed"
	}
	for i := range n {
		w := want[i]
		if w == "" {
			w = "already_queued"
		}
		assert.Equal(t, w, got[i+1].Outcome, "line %d", i+1)
	}
	ids, err := rdb.LRange(ctx, pendingKey, 0, -1).Result()
	require.NoError(t, err)
	seen := map[string]int{}
	for _, id := range ids {
		seen[id]++
	}
	assert.Len(t, ids, n-len(complete)-len(failed), "one task per runnable job")
	for i := range n {
		switch w := want[i]; w {
		case "already_complete", "already_failed":
			assert.Zero(t, seen[key(i)], "line %d (%s): no task", i+1, w)
		default:
			assert.Equal(t, 1, seen[key(i)], "line %d: one task", i+1)
		}
	}
}

// BenchmarkEnqueueFileRerun20k: `idemscrape enqueue -f` of a file of 20,000 specs, in
// process, on a throwaway redis-server and the test PostgreSQL (default flags): First is
// the file's first run (every spec created; each iteration a file of its own window),
// Rerun the same file again (every spec already queued). Reports specs/s, the Redis
// commands a line costs (INFO commandstats, script calls and the commands they run) and
// the round trips (total_reads_processed) a batch of 500 costs.
func BenchmarkEnqueueFileRerun20k(b *testing.B) {
	const n = 20_000
	pool := testutil.PG(b)
	srv := testutil.StartRedis(b)
	u, err := url.Parse(testutil.PGAdminDSN())
	if err != nil {
		b.Fatal(err)
	}
	u.Path = "/" + pool.Config().ConnConfig.Database
	for _, kv := range os.Environ() {
		if name, _, _ := strings.Cut(kv, "="); strings.HasPrefix(name, "IDEMSCRAPE_") && !strings.HasPrefix(name, "IDEMSCRAPE_TEST_") {
			b.Setenv(name, "")
			_ = os.Unsetenv(name)
		}
	}
	b.Setenv("IDEMSCRAPE_PG", u.String())
	b.Setenv("IDEMSCRAPE_REDIS", srv.Addr)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	b.Cleanup(func() { _ = rdb.Close() })
	dir := b.TempDir()
	files := 0
	writeFile := func() string {
		b.Helper()
		var sb strings.Builder
		for j := range n {
			fmt.Fprintf(&sb, `{"kind":"bench","source_id":"src-%d","country":"US","window":"w%d","parser_version":1}`+"\n", j, files)
		}
		file := filepath.Join(dir, fmt.Sprintf("specs-%d.jsonl", files))
		files++
		if err := os.WriteFile(file, []byte(sb.String()), 0o600); err != nil {
			b.Fatal(err)
		}
		return file
	}
	enqueue := func(file string) {
		b.Helper()
		if code := run(context.Background(), []string{"enqueue", "-allow-unknown-kind", "-f", file}, nil, io.Discard, io.Discard); code != 0 {
			b.Fatalf("enqueue -f: exit %d", code)
		}
	}
	measure := func(b *testing.B, prepare func() string) {
		var cmds, reads int
		for b.Loop() {
			b.StopTimer()
			file := prepare()
			before := readRedisCounts(b, rdb)
			b.StartTimer()
			enqueue(file)
			b.StopTimer()
			d := readRedisCounts(b, rdb).sub(before)
			cmds, reads = cmds+d.total(), reads+d.reads
			b.StartTimer()
		}
		b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds(), "specs/s")
		b.ReportMetric(float64(cmds)/float64(n*b.N), "redis-cmds/line")
		b.ReportMetric(float64(reads)/float64(b.N)/(n/defaultBatch), "round-trips/batch")
	}
	b.Run("First", func(b *testing.B) { measure(b, writeFile) })
	stored := writeFile()
	enqueue(stored)
	b.Run("Rerun", func(b *testing.B) { measure(b, func() string { return stored }) })
}
