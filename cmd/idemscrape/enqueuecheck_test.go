package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/cmd/internal/envflag"
	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// countJobs is the number of jobs rows in the test's database.
func countJobs(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM jobs`).Scan(&n))
	return n
}

// TestQueueNameValidated: a queue name outside [A-Za-z0-9._-]{1,128} — a newline, an ESC,
// braces, asynq's own key form, 100,000 bytes, a space — given by -queue or by
// IDEMSCRAPE_QUEUE is refused as a usage error naming the setting, before anything is
// stored: no jobs row, no asynq key. The library refuses it too (NewEnqueuer), so every
// entry point does.
func TestQueueNameValidated(t *testing.T) {
	pool := testutil.PG(t)
	ns := testutil.Redis(t)
	cliEnv(t, dsnOf(t, pool), ns.Addr)
	spec := []string{"-kind", catalog.Kind, "-source-id", "sku-q", "-country", "US", "-window", "2026-04-23", "-parser-version", "1"}
	bad := map[string]string{
		"newline": "q\nx", "esc": "q\x1b[31m", "braces": "{x}", "asynq key": "asynq:{x}",
		"long": strings.Repeat("q", 100_000), "space": " ", "colon": "a:b", "invalid UTF-8": "q\xffx",
	}
	// A byte is spelled as every CLI error spells one: its offset and Go's quoting.
	spelled := map[string]string{"esc": `byte 1 ("\x1b") not allowed`, "invalid UTF-8": `byte 1 ("\xff") not allowed`,
		"braces": `byte 0 ("{") not allowed`}
	for name, q := range bad {
		for _, via := range []string{"flag", "env"} {
			t.Run(name+"/"+via, func(t *testing.T) {
				args := append([]string{"enqueue"}, spec...)
				if via == "flag" {
					args = append(args, "-queue", q)
				} else {
					t.Setenv("IDEMSCRAPE_QUEUE", q)
				}
				var stderr bytes.Buffer
				_, code := runInProcess(nil, &stderr, args...)
				assert.Equal(t, 2, code, stderr.String())
				assert.Contains(t, stderr.String(), "-queue ($IDEMSCRAPE_QUEUE): queue name")
				assert.Contains(t, stderr.String(), "[A-Za-z0-9._-]{1,128}")
				assert.Less(t, len(stderr.String()), 10_000, "the message must not repeat a 100 kB name")
				if want, ok := spelled[name]; ok {
					assert.Contains(t, stderr.String(), want)
				}
			})
		}
	}
	assert.Zero(t, countJobs(t, pool), "a refused queue stores no job")
	for _, q := range bad {
		if len(q) < 200 {
			n, err := ns.Client.Exists(context.Background(), "asynq:{"+q+"}:pending").Result()
			require.NoError(t, err)
			assert.Zero(t, n, "no asynq key for queue %q", q)
		}
	}

	// Every other entry point: the library itself, and a good name is accepted.
	client := asynq.NewClient(ns.AsynqOpt())
	defer client.Close()
	for name, q := range bad {
		_, err := tasks.NewEnqueuer(client, store.New(pool), &tasks.EnqueuerConfig{Queue: q})
		assert.ErrorContains(t, err, "EnqueuerConfig.Queue", name)
	}
	for _, q := range []string{"default", "catalog", "critical-1", "a.b_c", strings.Repeat("q", 128)} {
		assert.NoError(t, tasks.CheckQueue(q), q)
	}
	assert.Error(t, tasks.CheckQueue(strings.Repeat("q", 129)))
}

// TestEnqueueWindowValidated: a window that is no real date in the kind's format
// (2026-13-45, yesterday, 2026-W60, 2026-02-30) is refused before anything is stored, from
// the flags and from a file (by line); a kind nobody knows (no job, no worker serving its
// queue, not built in) is refused unless -allow-unknown-kind; a kind whose stored jobs have
// free-form windows keeps them.
func TestEnqueueWindowValidated(t *testing.T) {
	pool := testutil.PG(t)
	ns := testutil.Redis(t)
	cliEnv(t, dsnOf(t, pool), ns.Addr)
	enqueue := func(kind, window string, extra ...string) (string, int) {
		args := append([]string{"enqueue", "-kind", kind, "-source-id", "sku-w", "-country", "US", "-window", window,
			"-parser-version", "1", "-queue", ns.Queue}, extra...)
		var stderr bytes.Buffer
		_, code := runInProcess(nil, &stderr, args...)
		return stderr.String(), code
	}
	for _, tc := range []struct{ window, want string }{
		{"2026-13-45", "no such date"},
		{"yesterday", "not a window of kind catalog"},
		{"2026-W60", "no such date or week"},
		{"2026-02-30", "no such date"},
		{"2026-04-23T25", "no such date"},
		{"2026-4-23", "not a window"},
	} {
		stderr, code := enqueue(catalog.Kind, tc.window)
		assert.Equal(t, 2, code, "%s: %s", tc.window, stderr)
		assert.Contains(t, stderr, "field -window: ", tc.window)
		assert.Contains(t, stderr, tc.want, tc.window)
	}
	assert.Zero(t, countJobs(t, pool), "nothing stored for a bad window")

	typo := ns.Queue + "x" // no job, no worker serves it
	stderr, code := enqueue(typo, "2026-04-23")
	assert.Equal(t, 2, code, stderr)
	assert.Contains(t, stderr, fmt.Sprintf("unknown kind %q", typo))
	assert.Contains(t, stderr, "-allow-unknown-kind")
	assert.Zero(t, countJobs(t, pool))

	// Every format of the scheduler's window rules, for the built-in kind.
	for _, w := range []string{"2026-04-23", "2026-04-23T14", "2026-11-01T01-04:00", "2026-W53", "2026-04", "2026-04-23T14:05", "2026-04-23T14:05:09"} {
		stderr, code := enqueue(catalog.Kind, w)
		assert.Equal(t, 0, code, "%s: %s", w, stderr)
	}
	// An unknown kind allowed: its windows have no known format.
	stderr, code = enqueue(ns.Queue, "batch-7", "-allow-unknown-kind")
	require.Equal(t, 0, code, stderr)
	// Now it has a job: known, and its windows free-form like the stored one.
	stderr, code = enqueue(ns.Queue, "batch-8")
	require.Equal(t, 0, code, stderr)

	// A file: bad windows and the unknown kind refused by line, the good line stored.
	file := filepath.Join(t.TempDir(), "specs.jsonl")
	lines := []string{
		`{"kind":"catalog","source_id":"f-1","country":"US","window":"2026-13-45","parser_version":1}`,
		fmt.Sprintf(`{"kind":%q,"source_id":"f-2","country":"US","window":"2026-04-23","parser_version":1}`, typo),
		`{"kind":"catalog","source_id":"f-3","country":"US","window":"2026-04-23","parser_version":1}`,
	}
	require.NoError(t, os.WriteFile(file, []byte(strings.Join(lines, "\n")+"\n"), 0o600))
	before := countJobs(t, pool)
	var errb bytes.Buffer
	_, code = runInProcess(nil, &errb, "enqueue", "-f", file, "-queue", ns.Queue)
	assert.Equal(t, 1, code, errb.String())
	assert.Contains(t, errb.String(), "line 1: field window: ")
	assert.Contains(t, errb.String(), fmt.Sprintf("line 2: field kind: unknown kind %q", typo))
	assert.Contains(t, errb.String(), "2 line(s) refused, 1 stored")
	assert.Equal(t, before+1, countJobs(t, pool))
}

// TestEnqueueRedisDownSaysStored: a single enqueue whose task can not be enqueued (Redis
// unreachable) after its jobs row was recorded exits 1 saying that the row is stored and
// what becomes of it, as -f does.
func TestEnqueueRedisDownSaysStored(t *testing.T) {
	pool := testutil.PG(t)
	cliEnv(t, dsnOf(t, pool), "127.0.0.1:1")
	spec := tasks.Spec{Kind: catalog.Kind, SourceID: "sku-down", Country: "US", Window: "2026-04-23", ParserVersion: 1}
	key, err := spec.Key()
	require.NoError(t, err)
	var stderr bytes.Buffer
	_, code := runInProcess(nil, &stderr, "enqueue", "-kind", spec.Kind, "-source-id", spec.SourceID, "-country", "US",
		"-window", spec.Window, "-parser-version", "1", "-queue", "q"+testutil.RandomID(4))
	require.Equal(t, 1, code, stderr.String())
	assert.Contains(t, stderr.String(), fmt.Sprintf("stored: the jobs row of %s (state pending); not enqueued: its task", key))
	assert.Contains(t, stderr.String(), "Run the same enqueue again")
	assert.Equal(t, 1, countJobs(t, pool))
}

// TestUnclearMessages: each message the issue found unclear, and the words it now has.
func TestUnclearMessages(t *testing.T) {
	t.Setenv("IDEMSCRAPE_PG", "postgres://postgres@127.0.0.1:1/nowhere?sslmode=disable&connect_timeout=2")
	flags := func(args ...string) string {
		var stderr bytes.Buffer
		_, code := runInProcess(nil, &stderr, append([]string{"key"}, args...)...)
		require.Equal(t, 2, code, stderr.String())
		return stderr.String()
	}
	line := func(l string) string {
		_, msg := parseSpecLine([]byte(l), tasks.StrictDestinationPolicy())
		return msg
	}
	good := `{"kind":"catalog","source_id":"a","country":"US","window":"2026-04-23","parser_version":1}`
	spec := func(kind, src string) []string {
		return []string{"-kind", kind, "-source-id", src, "-country", "US", "-window", "2026-04-23", "-parser-version", "1"}
	}
	long := strings.Repeat("k", 130_000)
	var unknown bytes.Buffer
	_, code := runInProcess(nil, &unknown, long)
	require.Equal(t, 2, code)
	for _, tc := range []struct {
		name      string
		msg       string
		want, not []string
	}{
		{"empty -source-id", flags("-kind", "catalog", "-source-id", "", "-country", "US", "-window", "2026-04-23", "-parser-version", "1"),
			[]string{"-url / -source-id", "exactly one of -url or -source-id is required"}, []string{"SourceID", "field -url:"}},
		{"missing -parser-version", flags("-kind", "catalog", "-source-id", "a", "-country", "US", "-window", "2026-04-23"),
			[]string{"field -parser-version: required"}, []string{"0 out of range"}},
		{"missing -country", flags("-kind", "catalog", "-source-id", "a", "-window", "2026-04-23", "-parser-version", "1"),
			[]string{"field -country: required", `no "any"`}, nil},
		{"array line", line(`["catalog","a"]`), []string{"a JSON array, not a spec", "one JSON object"}, []string{"field :", "struct"}},
		{"number field", line(`{"kind":"catalog","source_id":"a","country":"US","window":"2026-04-23","parser_version":"1"}`),
			[]string{"field parser_version: must be a JSON number"}, []string{"int"}},
		{"CR-only file", line(good + "\r" + good), []string{"carriage return (CR)", "LF or CRLF"}, nil},
		// One spelling for a byte in every error: its offset and Go's quoting ("\xff").
		{"bad byte in -kind", flags(spec("ca\xffx", "a")...), []string{`field -kind: byte 2 ("\xff") not allowed`}, []string{"ÿ"}},
		{"bad byte in a line's kind", line(`{"kind":"ca{x","source_id":"a","country":"US","window":"2026-04-23","parser_version":1}`),
			[]string{`field kind: byte 2 ("{") not allowed`}, nil},
		{"invalid UTF-8 in -source-id", flags(spec("catalog", "a\xffb")...), []string{`field -source-id: not valid UTF-8 at byte 1 ("\xff")`}, nil},
		{"control character in -source-id", flags(spec("catalog", "a\x1bb")...),
			[]string{`field -source-id: non-printable character at byte 1 ("\x1b")`}, []string{"U+001B"}},
		// Echoed input is cut at ~200 bytes, its length said.
		{"130 kB flag value", flags("-parser-version", long), []string{`invalid value "` + long[:200] + `"… (130000 bytes) for flag -parser-version`}, nil},
		{"130 kB unknown command", unknown.String(), []string{`unknown command "` + long[:200] + `"… (130000 bytes)`}, nil},
		{"plain connection to a TLS Redis",
			redisHint(fmt.Errorf("look up the workers: %w", io.EOF), envflag.RedisConfig{Addr: "127.0.0.1:6380"}).Error(),
			[]string{"EOF", "rediss://"}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Less(t, len(tc.msg), 20_000, "no 130 kB echo (a usage may follow)")
			for _, w := range tc.want {
				assert.Contains(t, tc.msg, w)
			}
			for _, w := range tc.not {
				assert.NotContains(t, tc.msg, w)
			}
		})
	}
}

// TestEnqueueAllowLoopback: a URL on loopback is refused (the strict destination policy)
// unless -allow-loopback, as the worker's flag of the same name allows it — for local
// development against a shop on this machine.
func TestEnqueueAllowLoopback(t *testing.T) {
	pool := testutil.PG(t)
	ns := testutil.Redis(t)
	cliEnv(t, dsnOf(t, pool), ns.Addr)
	args := []string{"enqueue", "-kind", catalog.Kind, "-url", "http://127.0.0.1:8080/product/sku-1", "-country", "US",
		"-window", "2026-04-23", "-parser-version", "1", "-queue", ns.Queue}
	var stderr bytes.Buffer
	_, code := runInProcess(nil, &stderr, args...)
	assert.Equal(t, 2, code, stderr.String())
	assert.Contains(t, stderr.String(), "loopback")
	assert.Zero(t, countJobs(t, pool))

	stderr.Reset()
	stdout, code := runInProcess(nil, &stderr, append(args, "-allow-loopback")...)
	require.Equal(t, 0, code, stderr.String())
	assert.Contains(t, stdout, "created catalog:")
	assert.Equal(t, 1, countJobs(t, pool))
}
