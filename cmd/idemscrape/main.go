// Command idemscrape is the operator's CLI.
//
//	idemscrape migrate                  apply pending migrations
//	idemscrape enqueue -kind K ...      record one job and enqueue its task
//	idemscrape enqueue -f FILE|-        the same for JSON lines, one spec a line
//	idemscrape key -kind K ...          print the job key without storing anything
//	idemscrape status [-json] KEY       the job, its attempt timeline, result and outbox event
//	idemscrape stats [-json]            the six duplicate-work measures, maintenance, diagnosis
//	idemscrape audit [-json] ...        check the invariants; exit 1 naming each broken one
//	idemscrape jobs [-kind K ...]       list jobs with /jobs' filters (table or -json)
//	idemscrape requeue [-by WHO] KEY    a failed job back to pending with a fresh retry budget
//	idemscrape requeue -window W ...    the same for every failed job selectors match (-dry-run)
//	idemscrape reparse [-dry-run] ...   run a parser version over saved inputs, no network
//	idemscrape windows [-gaps|-fill T W] the scheduler's collection windows: gaps, refills
//
// Every command takes -h. Connections: IDEMSCRAPE_PG (libpq URL, default
// postgres://postgres@127.0.0.1:5432/postgres) and IDEMSCRAPE_REDIS (host:port, default
// 127.0.0.1:6379) or IDEMSCRAPE_REDIS_CLUSTER (cluster seed nodes, host:port,host:port,...); IDEMSCRAPE_QUEUE overrides the asynq queue (default: the kind's,
// tasks.QueueFor, where cmd/worker listens).
//
// Exit status: 0 success, 1 failure (or a broken invariant for audit), 2 a usage error
// (a bad IDEMSCRAPE_* setting included). IDEMSCRAPE_LOG_FORMAT=json makes every line the
// command writes on stderr a JSON object (stdout is the command's output, -json for JSON).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemscrape/idemscrape/cmd/internal/envflag"
	"github.com/idemscrape/idemscrape/cmd/internal/quote"
	"github.com/idemscrape/idemscrape/cmd/internal/telemetry"
	"github.com/idemscrape/idemscrape/store/ops"
	"github.com/idemscrape/idemscrape/tasks"
)

// command is one subcommand.
type command struct {
	name     string
	args     string // positional arguments in the usage line, e.g. "KEY"
	summary  string
	setFlags func(fs *flag.FlagSet) func(ctx context.Context, c *cli, pos []string) error
	npos     int // exact number of positional arguments; -1: any (the command checks them)
}

var commands = []command{migrateCmd, enqueueCmd, keyCmd, statusCmd, jobsCmd, statsCmd, auditCmd, requeueCmd, reparseCmd, windowsCmd}

// cli is what every command gets: its output streams, and the database on demand (db).
type cli struct {
	stdout, stderr io.Writer
	stdin          io.Reader
	pool           *pgxpool.Pool // opened by db
}

// db opens the database (IDEMSCRAPE_PG) on a command's first call and checks that it is
// migrated. Commands call it once their flags and arguments are checked, so a mistake in
// the command line is reported as one (exit 2, with the usage) even when the database is
// down or unreachable. An error here exits 1, as a database that can not be used.
func (c *cli) db(ctx context.Context) (*pgxpool.Pool, error) {
	if c.pool != nil {
		return c.pool, nil
	}
	pool, err := connect(ctx)
	var ue usageError
	if errors.As(err, &ue) {
		return nil, err // IDEMSCRAPE_PG or its password setting is bad: exit 2, as for IDEMSCRAPE_REDIS
	}
	if err != nil {
		return nil, dbError{err}
	}
	if err := ops.New(pool).CheckMigrated(ctx); err != nil {
		pool.Close()
		// The first connection is made here (the pool connects lazily): name the setting.
		return nil, dbError{fmt.Errorf("postgres (IDEMSCRAPE_PG): %w", err)}
	}
	c.pool = pool
	return pool, nil
}

// close closes the database if a command opened it.
func (c *cli) close() {
	if c.pool != nil {
		c.pool.Close()
	}
}

// dbError is a database that could not be opened or is not migrated: exit 1, never a
// usage error. A bad IDEMSCRAPE_PG (it does not parse, its password file is missing) is
// no dbError but a usageError (exit 2), as a bad IDEMSCRAPE_REDIS is.
type dbError struct{ err error }

func (e dbError) Error() string { return e.err.Error() }

// usageError is a mistake in the command line: exit 2, with the command's usage.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

// exitError ends the command with a status and no further message (the command printed
// what went wrong).
type exitError struct{ code int }

func (e exitError) Error() string { return fmt.Sprintf("exit %d", e.code) }

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	// IDEMSCRAPE_LOG_FORMAT, as the worker and the scheduler read it: json makes every line
	// on stderr a JSON object, go-redis's own lines included.
	var stderr io.Writer = os.Stderr
	var format string
	switch format = os.Getenv("IDEMSCRAPE_LOG_FORMAT"); format {
	case "", "text":
		envflag.RouteRedisLogs(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{ReplaceAttr: dropTime})))
	case "json":
		jl := newJSONLines(os.Stderr)
		defer jl.Flush()
		stderr, jsonStderr = jl, true
		envflag.RouteRedisLogs(jl.log)
	default:
		fmt.Fprintf(os.Stderr, "idemscrape: $IDEMSCRAPE_LOG_FORMAT %s: want text or json\n", quote.Input(format))
		os.Exit(2)
	}
	// Traces, when the OTEL_* environment asks for them: an enqueue's span is the root of
	// its jobs' traces (cmd/internal/telemetry).
	flushTraces, _, err := telemetry.Setup(ctx, "idemscrape-cli")
	if err != nil {
		// Traces never stop a command: say why there are none and go on.
		fmt.Fprintln(stderr, "idemscrape: tracing off:", err)
	}
	code := run(ctx, os.Args[1:], os.Stdin, os.Stdout, stderr)
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	_ = flushTraces(fctx)
	cancel()
	stop()
	if jl, ok := stderr.(*jsonLines); ok {
		jl.Flush() // os.Exit skips the deferred one
	}
	os.Exit(code)
}

// jsonStderr: stderr is JSON lines (IDEMSCRAPE_LOG_FORMAT=json); usage errors then say
// where the usage is instead of printing it.
var jsonStderr bool

// dropTime is a ReplaceAttr that leaves out the time of a text log line (the CLI's lines
// are read as they come).
func dropTime(groups []string, a slog.Attr) slog.Attr {
	if len(groups) == 0 && a.Key == slog.TimeKey {
		return slog.Attr{}
	}
	return a
}

func mainUsage(w io.Writer) {
	fmt.Fprintln(w, "usage: idemscrape COMMAND [flags] [args]")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "commands:")
	for _, c := range commands {
		fmt.Fprintf(w, "  %-8s %s\n", c.name, c.summary)
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "`idemscrape COMMAND -h` shows a command's flags.")
	fmt.Fprintln(w, "environment: IDEMSCRAPE_PG (PostgreSQL URL), IDEMSCRAPE_PG_PASSWORD[_FILE], IDEMSCRAPE_REDIS (host:port or redis[s]://[user@]host:port[/db]) or IDEMSCRAPE_REDIS_CLUSTER (host:port,host:port,... or a URL), IDEMSCRAPE_REDIS_PASSWORD[_FILE], IDEMSCRAPE_REDIS_TLS_CA/_CERT/_KEY/_SERVER_NAME, IDEMSCRAPE_QUEUE (asynq queue override), IDEMSCRAPE_LOG_FORMAT (json: every line on stderr is a JSON object)")
}

// run executes one command line and returns the exit status.
func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		if jsonStderr {
			fmt.Fprintln(stderr, "idemscrape: no command; usage: idemscrape -h")
			return 2
		}
		mainUsage(stderr)
		return 2
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		if len(args) > 1 && args[0] == "help" {
			return run(ctx, []string{args[1], "-h"}, stdin, stdout, stderr)
		}
		mainUsage(stdout)
		return 0
	}
	var cmd *command
	for i := range commands {
		if commands[i].name == args[0] {
			cmd = &commands[i]
		}
	}
	if cmd == nil {
		fmt.Fprintf(stderr, "idemscrape: unknown command %s\n", quote.Input(args[0]))
		if jsonStderr {
			fmt.Fprintln(stderr, "usage: idemscrape -h")
		} else {
			fmt.Fprintln(stderr)
			mainUsage(stderr)
		}
		return 2
	}
	fs := flag.NewFlagSet(cmd.name, flag.ContinueOnError)
	fs.SetOutput(io.Discard) // errors and usage are printed below, to the right stream
	exec := cmd.setFlags(fs)
	pos, err := parseArgs(fs, args[1:], cmd.npos, cmd.args)
	if errors.Is(err, flag.ErrHelp) {
		cmdUsage(stdout, cmd, fs)
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "idemscrape %s: %v\n", cmd.name, err)
		usageAfterError(stderr, cmd, fs)
		return 2
	}

	ctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	c := &cli{stdout: stdout, stderr: stderr, stdin: stdin}
	defer c.close()
	err = exec(ctx, c, pos)
	var ue usageError
	var ee exitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ee):
		return ee.code
	case errors.As(err, &ue):
		fmt.Fprintf(stderr, "idemscrape %s: %v\n", cmd.name, err)
		usageAfterError(stderr, cmd, fs)
		return 2
	default:
		fmt.Fprintf(stderr, "idemscrape %s: %v\n", cmd.name, err)
		return 1
	}
}

// usageAfterError prints the usage after a usage error, or with JSON lines on stderr,
// where to read it.
func usageAfterError(w io.Writer, cmd *command, fs *flag.FlagSet) {
	if jsonStderr {
		fmt.Fprintf(w, "usage: idemscrape %s -h\n", cmd.name)
		return
	}
	cmdUsage(w, cmd, fs)
}

func cmdUsage(w io.Writer, cmd *command, fs *flag.FlagSet) {
	line := "usage: idemscrape " + cmd.name
	hasFlags := false
	fs.VisitAll(func(*flag.Flag) { hasFlags = true })
	if hasFlags {
		line += " [flags]"
	}
	if cmd.args != "" {
		line += " " + cmd.args
	}
	fmt.Fprintln(w, line)
	fmt.Fprintln(w)
	fmt.Fprintln(w, cmd.summary)
	if hasFlags {
		fmt.Fprintln(w)
		fmt.Fprintln(w, "flags:")
		fs.SetOutput(w)
		fs.PrintDefaults()
		fs.SetOutput(io.Discard)
	}
}

// parseArgs parses flags and positional arguments in any order (`status KEY -json` and
// `status -json KEY` alike; after `--` everything is positional) and requires exactly n
// positional arguments: extra ones are refused by name, never ignored.
func parseArgs(fs *flag.FlagSet, args []string, n int, names string) ([]string, error) {
	var pos []string
	for {
		before := len(args)
		if err := fs.Parse(args); err != nil {
			return nil, flagError(err)
		}
		rest := fs.Args()
		if len(rest) == 0 {
			break
		}
		// flag stops at the first non-flag, or after "--" (which it consumes).
		if len(rest) < before && args[before-len(rest)-1] == "--" {
			pos = append(pos, rest...)
			break
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
	for i, a := range pos {
		if why := quote.CheckUTF8(a); why != "" {
			// PostgreSQL would refuse it with SQLSTATE 22021; no key is ever stored so.
			return nil, fmt.Errorf("argument %d (%s) %s: %s; keys and names are UTF-8 text", i+1, names, quote.Input(a), why)
		}
	}
	switch {
	case n < 0:
	case len(pos) > n:
		extra := pos[n:]
		quoted := make([]string, len(extra))
		for i, a := range extra {
			quoted[i] = quote.Input(a)
		}
		return nil, fmt.Errorf("unexpected argument(s): %s", strings.Join(quoted, " "))
	case len(pos) < n:
		return nil, fmt.Errorf("missing %s", names)
	}
	return pos, nil
}

// flagError re-renders the flag package's errors, which quote a value or a flag name in
// full, with quote.Input: `invalid value "…" for flag -limit: parse error` shows at most
// quote.MaxInput bytes of a 130 kB value.
func flagError(err error) error {
	msg := err.Error()
	for _, p := range []string{"flag provided but not defined: ", "bad flag syntax: "} {
		if rest, ok := strings.CutPrefix(msg, p); ok && len(rest) > quote.MaxInput {
			return errors.New(p + quote.Input(rest))
		}
	}
	rest, ok := strings.CutPrefix(msg, "invalid value ")
	if !ok {
		return err
	}
	q, err2 := strconv.QuotedPrefix(rest)
	if err2 != nil {
		return err
	}
	v, err2 := strconv.Unquote(q)
	if err2 != nil {
		return err
	}
	return errors.New("invalid value " + quote.Input(v) + rest[len(q):])
}

func env(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func connect(ctx context.Context) (*pgxpool.Pool, error) {
	pcfg, err := envflag.PGConfig(env("IDEMSCRAPE_PG", "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"), "$IDEMSCRAPE_PG", "IDEMSCRAPE_")
	if err != nil {
		return nil, usageError{err.Error()}
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("postgres (IDEMSCRAPE_PG): %w", err)
	}
	return pool, nil
}

// redisConfig reads IDEMSCRAPE_REDIS (one server, host:port) or IDEMSCRAPE_REDIS_CLUSTER
// (cluster seed nodes, host:port,host:port,...); both set, or a bad address, is a usage error
// naming the variable.
func redisConfig() (envflag.RedisConfig, error) {
	rc, err := envflag.RedisFromEnv("IDEMSCRAPE_")
	if err != nil {
		return envflag.RedisConfig{}, usageError{err.Error()}
	}
	return rc, nil
}

// redisHint adds to err, a Redis command's failure, what an operator most likely got
// wrong: a server that closes a plain connection at once (EOF, reset) is usually a TLS
// server, which wants a rediss:// URL.
func redisHint(err error, rc envflag.RedisConfig) error {
	if err == nil || rc.TLS != nil {
		return err
	}
	msg := err.Error()
	if errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) || strings.HasSuffix(msg, "EOF") || strings.Contains(msg, "connection reset by peer") {
		return fmt.Errorf("%w (the Redis server closed the connection at once: if it expects TLS, "+
			"write IDEMSCRAPE_REDIS as a rediss:// URL, e.g. rediss://host:6380, with IDEMSCRAPE_REDIS_TLS_CA for a private CA)", err)
	}
	return err
}

// sortedKeys returns m's keys in order.
func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// quoteAll quotes each of vs with quote.Input, separated by spaces.
func quoteAll(vs []string) string {
	q := make([]string, len(vs))
	for i, v := range vs {
		q[i] = quote.Input(v)
	}
	return strings.Join(q, " ")
}

// checkText refuses a value PostgreSQL's text columns can not hold, as ops.CheckText
// does, in the CLI's spelling: `-window "a\xff": not valid UTF-8 at byte 1 ("\xff")`,
// `-kind "cat\x00": byte 3 ("\x00") not allowed (PostgreSQL text holds no NUL)`.
func checkText(name, v string) error {
	if why := quote.CheckUTF8(v); why != "" {
		return fmt.Errorf("%s %s: %s", name, quote.Input(v), why)
	}
	if i := strings.IndexByte(v, 0); i >= 0 {
		return fmt.Errorf("%s %s: %s not allowed (PostgreSQL text holds no NUL)", name, quote.Input(v), quote.Byte(v, i))
	}
	return ops.CheckText(name, v) // the store's own rule, should it grow
}

// checkQueue is tasks.CheckQueue in the CLI's spelling of a byte: the first byte a queue
// name can not hold is named `byte 1 ("\x1b")`, never as a Go character literal.
func checkQueue(name string) error {
	err := tasks.CheckQueue(name)
	if err == nil || name == "" || len(name) > tasks.MaxQueueLen {
		return err
	}
	for i := 0; i < len(name); i++ {
		if tasks.CheckQueue(name[i:i+1]) != nil {
			return fmt.Errorf("queue name: %s not allowed, want [A-Za-z0-9._-]{1,%d}", quote.Byte(name, i), tasks.MaxQueueLen)
		}
	}
	return err
}
