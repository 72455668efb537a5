package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// watchedStderr is the stderr of an in-process run: it signals each progress line.
type watchedStderr struct {
	mu       sync.Mutex
	buf      bytes.Buffer
	progress chan struct{}
}

func newWatchedStderr() *watchedStderr { return &watchedStderr{progress: make(chan struct{}, 1000)} }

func (w *watchedStderr) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for range bytes.Count(p, []byte("progress: ")) {
		w.progress <- struct{}{}
	}
	return w.buf.Write(p)
}

func (w *watchedStderr) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}

// cliEnv sets the environment of an in-process run: IDEMSCRAPE_PG and IDEMSCRAPE_REDIS,
// every other IDEMSCRAPE_ variable unset (restored when the test ends).
func cliEnv(t *testing.T, pgURL, redisAddr string) {
	t.Helper()
	for _, kv := range os.Environ() {
		if name, _, _ := strings.Cut(kv, "="); strings.HasPrefix(name, "IDEMSCRAPE_") && !strings.HasPrefix(name, "IDEMSCRAPE_TEST_") {
			t.Setenv(name, "")
			require.NoError(t, os.Unsetenv(name))
		}
	}
	t.Setenv("IDEMSCRAPE_PG", pgURL)
	t.Setenv("IDEMSCRAPE_REDIS", redisAddr)
}

// runInProcess runs the command line in this process (the environment as cliEnv set it).
func runInProcess(stdin io.Reader, stderr io.Writer, args ...string) (stdout string, code int) {
	var out bytes.Buffer
	code = run(context.Background(), args, stdin, &out, stderr)
	return out.String(), code
}

// specLines are n JSON spec lines of kind, source ids src-0..src-(n-1).
func specLines(kind string, from, n int) []string {
	lines := make([]string, n)
	for i := range lines {
		lines[i] = fmt.Sprintf(`{"kind":%q,"source_id":"src-%d","country":"US","window":"2026-04-23","parser_version":1}`, kind, from+i)
	}
	return lines
}

func keyOfSrc(t *testing.T, kind string, i int) string {
	t.Helper()
	k, err := tasks.Spec{Kind: kind, SourceID: fmt.Sprintf("src-%d", i), Country: "US", Window: "2026-04-23", ParserVersion: 1}.Key()
	require.NoError(t, err)
	return k
}

var progressRE = regexp.MustCompile(`(?m)^progress: (\d+) lines read, (\d+) stored, (\d+) duplicates, (\d+) refused$`)

// progressLines parses the progress lines of stderr: read, stored, duplicates, refused.
func progressLines(t *testing.T, stderr string) [][4]int {
	t.Helper()
	var out [][4]int
	for _, m := range progressRE.FindAllStringSubmatch(stderr, -1) {
		var p [4]int
		for i := range p {
			n, err := strconv.Atoi(m[i+1])
			require.NoError(t, err)
			p[i] = n
		}
		out = append(out, p)
	}
	return out
}

// outcomes decodes the -json stdout: the outcome of each line number.
func outcomes(t *testing.T, stdout string) map[int]enqueueResult {
	t.Helper()
	got := map[int]enqueueResult{}
	for l := range strings.Lines(stdout) {
		var r enqueueResult
		require.NoError(t, json.Unmarshal([]byte(l), &r), "stdout stays JSON lines: %q", l)
		_, dup := got[r.Line]
		require.False(t, dup, "line %d reported twice", r.Line)
		got[r.Line] = r
	}
	return got
}

// TestEnqueueFileBatches: a file of five batches (-batch 50: a comment, a refused line, a
// spec given again in a later batch, one given twice in one batch) is stored batch by batch with
// one progress line per batch on stderr (-progress 0), their counts growing to the file's
// totals, while stdout stays one JSON object per spec; every spec is one jobs row and one
// task. The same file again finds every spec stored and enqueues nothing.
func TestEnqueueFileBatches(t *testing.T) {
	pool := testutil.PG(t)
	ns := testutil.Redis(t)
	kind := ns.Queue
	cliEnv(t, dsnOf(t, pool), ns.Addr)

	lines := append([]string{"# five batches of 50 specs"}, specLines(kind, 0, 120)...)                                    // lines 2-121
	lines = append(lines, `{"kind":"`+kind+`","source_id":"bad","country":"US","window":"2026-04-23","parser_version":0}`) // line 122
	lines = append(lines, specLines(kind, 5, 1)...)                                                                        // line 123: src-5 again
	lines = append(lines, specLines(kind, 120, 127)...)                                                                    // lines 124-250
	lines = append(lines, specLines(kind, 240, 1)...)                                                                      // line 251: src-240 (line 244) again, same batch
	const unique, dups, specs = 247, 2, 249
	file := filepath.Join(t.TempDir(), "specs.jsonl")
	require.NoError(t, os.WriteFile(file, []byte(strings.Join(lines, "\n")+"\n"), 0o600))

	stderr := newWatchedStderr()
	stdout, code := runInProcess(nil, stderr, "enqueue", "-allow-unknown-kind", "-f", file, "-batch", "50", "-progress", "0", "-json")
	assert.Equal(t, 1, code, "a refused line: exit 1\n%s", stderr)
	assert.NotContains(t, stderr.String(), "line 122:", "-json: the refused line is on stdout")
	assert.Contains(t, stderr.String(), fmt.Sprintf(`1 line(s) refused, %d stored (on stdout, outcome "refused")`, specs))

	prog := progressLines(t, stderr.String())
	require.Len(t, prog, 5, "one progress line per batch of 50 specs (249 specs): %s", stderr)
	for i, p := range prog {
		if i > 0 {
			prev := prog[i-1]
			assert.Greater(t, p[0], prev[0], "lines read grow")
			want := 50
			if i == 4 {
				want = 49
			}
			assert.Equal(t, want, p[1]+p[2]-prev[1]-prev[2], "specs of batch %d: %v after %v", i+1, p, prev)
		}
	}
	assert.Equal(t, [4]int{251, unique, dups, 1}, prog[4], "the totals")

	got := outcomes(t, stdout)
	assert.Len(t, got, specs+1, "a JSON line per spec and per refused line")
	assert.Contains(t, got[122].Error, "field parser_version")
	for line, r := range got {
		want := "created"
		switch line {
		case 123, 251:
			want = "already_queued"
		case 122:
			want = "refused"
		}
		assert.Equal(t, want, r.Outcome, "line %d", line)
	}
	assert.Equal(t, unique, testutil.Count(t, pool, `SELECT count(*) FROM jobs`))
	assert.Equal(t, unique, ns.AsynqPending(t))

	// The same file again: every spec found in place, nothing written.
	stderr = newWatchedStderr()
	stdout, code = runInProcess(nil, stderr, "enqueue", "-allow-unknown-kind", "-f", file, "-batch", "50", "-progress", "0")
	assert.Equal(t, 1, code, stderr.String())
	assert.Equal(t, specs, strings.Count(stdout, ": already_queued "), stdout)
	prog = progressLines(t, stderr.String())
	require.Len(t, prog, 5)
	assert.Equal(t, [4]int{251, 0, specs, 1}, prog[4])
	assert.Equal(t, unique, testutil.Count(t, pool, `SELECT count(*) FROM jobs`))
	assert.Equal(t, unique, ns.AsynqPending(t))

	// One batch: no progress line. Flag rules.
	stderr = newWatchedStderr()
	_, code = runInProcess(strings.NewReader(strings.Join(specLines(kind, 0, 3), "\n")), stderr, "enqueue", "-allow-unknown-kind", "-f", "-", "-progress", "0")
	assert.Equal(t, 0, code, stderr.String())
	assert.NotContains(t, stderr.String(), "progress:")
	for args, want := range map[string]string{
		"-f - -batch 0":      `flag -batch: "0" must be a whole number from 1 to 100000`,
		"-f - -batch 100001": `flag -batch: "100001" must be a whole number from 1 to 100000`,
		"-f - -batch many":   `flag -batch: "many" must be a whole number`,
		"-f - -progress -1s": `flag -progress: "-1s" must be a duration of 0 or more`,
		"-kind k -batch 10":  "flag(s) -batch apply to -f FILE only",
		"-f - -kind k":       "-kind can not be combined",
	} {
		stderr = newWatchedStderr()
		_, code = runInProcess(strings.NewReader(""), stderr, append([]string{"enqueue", "-allow-unknown-kind"}, strings.Fields(args)...)...)
		assert.Equal(t, 2, code, "%s: %s", args, stderr)
		assert.Contains(t, stderr.String(), want, args)
	}
}

// TestEnqueueFileStopsMidway: Redis, or PostgreSQL, goes away (a proxy of the test's own
// refuses) after the second of four batches (-batch 50, lines 2-176 hold specs 0-174): the
// run stops with exit 1 and says which lines are in place — batches 1 and 2, and in batch 3
// the specs whose jobs were already complete (no task needed) — and which are not; the same
// file again, once the server is back, completes it: what was stored is found so, the rest
// is stored, one jobs row and at most one task per spec. The failure is placed by waiting
// for the second progress line before feeding the rest of the input, never on time.
func TestEnqueueFileStopsMidway(t *testing.T) {
	for _, down := range []string{"Redis", "PostgreSQL"} {
		t.Run(down+"GoesAway", func(t *testing.T) {
			ctx := context.Background()
			pool := testutil.PG(t)
			ns := testutil.Redis(t)
			kind := ns.Queue
			redisProxy := testutil.NewTCPProxy(t, ns.Addr)
			_, pgProxy := testutil.PoolVia(t, pool)
			u, err := url.Parse(dsnOf(t, pool))
			require.NoError(t, err)
			u.Host = pgProxy.Addr
			cliEnv(t, u.String(), redisProxy.Addr)
			proxy := map[string]*testutil.TCPProxy{"Redis": redisProxy, "PostgreSQL": pgProxy}[down]

			lines := append([]string{"# specs 0-174 on lines 2-176"}, specLines(kind, 0, 175)...)
			line := func(spec int) int { return spec + 2 }
			// Specs 104, 105 and 120 (batch 3) are complete jobs already: in place whatever
			// Redis does.
			complete := []string{keyOfSrc(t, kind, 104), keyOfSrc(t, kind, 105), keyOfSrc(t, kind, 120)}
			for _, i := range []int{104, 105, 120} {
				_, err := pool.Exec(ctx, `INSERT INTO jobs (key, kind, source_id, country, "window", parser_version, scope, queue, state, completed_at)
VALUES ($1, $2, $3, 'US', '2026-04-23', 1, '', $2, 'complete', now())`, keyOfSrc(t, kind, i), kind, fmt.Sprintf("src-%d", i))
				require.NoError(t, err)
			}

			in, feed := io.Pipe()
			stderr := newWatchedStderr()
			type result struct {
				stdout string
				code   int
			}
			done := make(chan result, 1)
			go func() {
				stdout, code := runInProcess(in, stderr, "enqueue", "-allow-unknown-kind", "-f", "-", "-batch", "50", "-progress", "0", "-json")
				_ = in.CloseWithError(io.ErrClosedPipe) // unblock the feeder if the run ended early
				done <- result{stdout, code}
			}()
			write := func(ls []string) {
				t.Helper()
				_, err := io.WriteString(feed, strings.Join(ls, "\n")+"\n")
				require.NoError(t, err, "the run ended early: %s", stderr)
			}
			write(lines[:line(99)]) // batches 1 and 2, up to line 101
			for i := range 2 {
				select {
				case <-stderr.progress:
				case r := <-done:
					t.Fatalf("the run ended before progress line %d: exit %d\n%s", i+1, r.code, stderr)
				}
			}
			proxy.Refuse() // before batch 3 is read: its statement or its tasks fail
			go func() {    // the run may stop before it has read all of it
				_, _ = io.WriteString(feed, strings.Join(lines[line(99):], "\n")+"\n")
				_ = feed.Close()
			}()
			r := <-done

			// What the report says: batches 1 and 2, and the complete jobs of batch 3, are in
			// place; the rest of batch 3 and the unread batch 4 are not.
			errOut := stderr.String()
			assert.Equal(t, 1, r.code, errOut)
			assert.Len(t, progressLines(t, errOut), 2, errOut)
			assert.Contains(t, errOut, fmt.Sprintf("idemscrape enqueue: stopped at line %d: ", line(100)))
			got := outcomes(t, r.stdout)
			switch down {
			case "Redis":
				assert.Contains(t, errOut, fmt.Sprintf("stored (jobs row and task in place, or the job already complete or failed): lines 2-%d, lines %d-%d, line %d\n",
					line(99), line(104), line(105), line(120)))
				assert.Contains(t, errOut, fmt.Sprintf("not enqueued: lines %d-%d, lines %d-%d, line %d onwards\n",
					line(100), line(103), line(106), line(119), line(121)))
				assert.Contains(t, errOut, fmt.Sprintf("the jobs rows of lines %d-%d are recorded", line(100), line(149)))
				assert.Len(t, got, 103, "stdout: the 100 specs stored and the 3 complete")
				for _, i := range []int{104, 105, 120} {
					assert.Equal(t, "already_complete", got[line(i)].Outcome)
				}
				assert.Equal(t, 150, testutil.Count(t, pool, `SELECT count(*) FROM jobs`), "batch 3's rows were recorded")
			case "PostgreSQL":
				assert.Contains(t, errOut, fmt.Sprintf("stored (jobs row and task in place, or the job already complete or failed): lines 2-%d\n", line(99)))
				assert.Contains(t, errOut, fmt.Sprintf("not enqueued: line %d onwards\n", line(100)))
				assert.NotContains(t, errOut, "are recorded")
				assert.Len(t, got, 100)
				assert.Equal(t, 103, testutil.Count(t, pool, `SELECT count(*) FROM jobs`), "batch 3 recorded nothing")
			}
			assert.Contains(t, errOut, "to resume, run the same file again")
			for i := range 100 {
				assert.Equal(t, "created", got[line(i)].Outcome, "line %d", line(i))
			}
			assert.Equal(t, 100, ns.AsynqPending(t), "the tasks of batches 1 and 2")

			// The server is back: the same file again completes the run.
			proxy.Accept()
			stderr = newWatchedStderr()
			stdout, code := runInProcess(strings.NewReader(strings.Join(lines, "\n")), stderr, "enqueue", "-allow-unknown-kind", "-f", "-", "-batch", "50", "-json")
			require.Equal(t, 0, code, stderr.String())
			got = outcomes(t, stdout)
			require.Len(t, got, 175)
			for i := range 175 {
				want := "created"
				switch {
				case i == 104 || i == 105 || i == 120:
					want = "already_complete"
				case i < 100:
					want = "already_queued"
				case i < 150 && down == "Redis":
					want = "requeued" // recorded in the failed run, its task not enqueued
				}
				assert.Equal(t, want, got[line(i)].Outcome, "line %d", line(i))
			}
			assert.Equal(t, 175, testutil.Count(t, pool, `SELECT count(*) FROM jobs`))
			pending, err := ns.Client.LRange(ctx, "asynq:{"+ns.Queue+"}:pending", 0, -1).Result()
			require.NoError(t, err)
			seen := map[string]bool{}
			for _, id := range pending {
				assert.False(t, seen[id], "task %s twice", id)
				seen[id] = true
			}
			assert.Len(t, seen, 172, "one task per job, none for the complete ones")
			for _, k := range complete {
				assert.False(t, seen[k])
			}
		})
	}
}

// TestEnqueueFileJSONRefused: with -json every line of stdout is a JSON object, a refused
// line's too ({"line":N,"outcome":"refused","error":…}, no key), in line order among the
// specs' results of its batch — whatever made it refused (a bad field, not JSON, not UTF-8,
// too long, an unknown kind, a batch of refused lines only) — and stderr no longer repeats
// them as text. Without -json they stay text lines on stderr.
func TestEnqueueFileJSONRefused(t *testing.T) {
	pool := testutil.PG(t)
	ns := testutil.Redis(t)
	kind := ns.Queue
	cliEnv(t, dsnOf(t, pool), ns.Addr)

	good := specLines(kind, 0, 5)
	lines := []string{
		good[0], // 1
		`{"kind":"` + kind + `","source_id":"x","country":"US","window":"2026-04-23","parser_version":0}`, // 2
		good[1],          // 3
		`not json`,       // 4
		"\xff\xfe",       // 5
		good[2], good[3], // 6, 7 (batch 2)
		strings.Repeat("x", maxSpecLine+1),                      // 8
		`{"kind":"` + kind + `","source_id":"x","country":"US"`, // 9: cut short
		`[1,2]`, // 10 (batch 3: refused only)
		good[4], // 11
		`{"kind":"nosuchkind-` + kind + `","source_id":"x","country":"US","window":"2026-04-23","parser_version":1}`, // 12
	}
	refused := map[int]string{2: "parser_version", 4: "", 5: "UTF-8", 8: "longer than", 9: "", 10: "", 12: "unknown kind"}
	file := filepath.Join(t.TempDir(), "specs.jsonl")
	require.NoError(t, os.WriteFile(file, []byte(strings.Join(lines, "\n")+"\n"), 0o600))

	// The kind check needs the first batch's kind known: a job of it stored.
	_, code := runInProcess(strings.NewReader(good[0]), io.Discard, "enqueue", "-allow-unknown-kind", "-f", "-")
	require.Equal(t, 0, code)

	stderr := newWatchedStderr()
	stdout, code := runInProcess(nil, stderr, "enqueue", "-f", file, "-batch", "2", "-json")
	assert.Equal(t, 1, code, stderr.String())
	var order []int
	for l := range strings.Lines(stdout) {
		var r enqueueResult
		require.NoError(t, json.Unmarshal([]byte(l), &r), "every stdout line is JSON: %q", l)
		order = append(order, r.Line)
		if want, ok := refused[r.Line]; ok {
			assert.Equal(t, "refused", r.Outcome, "line %d", r.Line)
			assert.Empty(t, r.Key, "line %d", r.Line)
			assert.Empty(t, r.State, "line %d", r.Line)
			assert.NotEmpty(t, r.Error, "line %d", r.Line)
			assert.Contains(t, r.Error, want, "line %d", r.Line)
			var raw map[string]any
			require.NoError(t, json.Unmarshal([]byte(l), &raw))
			assert.NotContains(t, raw, "key", "a refused line has no key: %s", l)
		} else {
			assert.Contains(t, []string{"created", "already_queued"}, r.Outcome, "line %d", r.Line)
			assert.NotEmpty(t, r.Key)
		}
	}
	assert.Equal(t, []int{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, order, "one JSON line per line, in line order:\n%s", stdout)
	assert.NotRegexp(t, `(?m)^line \d+:`, stderr.String(), "-json: refused lines are not repeated as text")
	assert.Contains(t, stderr.String(), `7 line(s) refused, 5 stored (on stdout, outcome "refused")`)

	// Without -json: text on stderr, as before.
	stderr = newWatchedStderr()
	stdout, code = runInProcess(nil, stderr, "enqueue", "-f", file, "-batch", "2")
	assert.Equal(t, 1, code)
	for line := range refused {
		assert.Contains(t, stderr.String(), fmt.Sprintf("line %d: ", line))
		assert.NotContains(t, stdout, fmt.Sprintf("line %d: ", line))
	}
	assert.Contains(t, stderr.String(), "7 line(s) refused, 5 stored\n")
}
