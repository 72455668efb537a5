// Package envflag binds command-line flags to environment variables the way idemscrape's
// binaries (cmd/worker, cmd/scheduler) document them: every flag also reads
// <Prefix><NAME>, the flag wins over the environment, an environment value that does not
// parse is an error naming the variable, and -log-format / -log-level build one slog
// logger. -redis / -redis-cluster (Redis) say where Redis is, one server or a Redis
// Cluster, and RedisConfig builds every Redis client of a binary from that: the go-redis
// client and asynq's connection option (docs/CLUSTER.md).
package envflag

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/idemscrape/idemscrape/cmd/internal/quote"
)

// Set defines flags on a flag.FlagSet with defaults from the environment.
type Set struct {
	FS     *flag.FlagSet
	Prefix string // e.g. "IDEMSCRAPE_"
	errs   []error
}

// New returns a Set on a new flag.FlagSet named name that writes usage to out and
// returns parse errors (flag.ContinueOnError).
func New(name, prefix string, out io.Writer) *Set {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(out)
	return &Set{FS: fs, Prefix: prefix}
}

// lookup returns the non-empty value of <Prefix><env>.
func (s *Set) lookup(env string) (string, bool) {
	v, ok := os.LookupEnv(s.Prefix + env)
	return v, ok && v != ""
}

func (s *Set) usage(usage, env string) string { return usage + " ($" + s.Prefix + env + ")" }

// parsed reads <Prefix><env> with parse; a value that does not parse is recorded as an error
// naming the variable and what it should be.
func parsed[T any](s *Set, env string, def T, what string, parse func(string) (T, error)) T {
	v, ok := s.lookup(env)
	if !ok {
		return def
	}
	x, err := parse(v)
	if err != nil {
		s.errs = append(s.errs, fmt.Errorf("$%s%s: %s is not %s", s.Prefix, env, quote.Input(v), what))
		return def
	}
	return x
}

// String defines a string flag.
func (s *Set) String(p *string, name, env, def, usage string) {
	if v, ok := s.lookup(env); ok {
		def = v
	}
	s.FS.StringVar(p, name, def, s.usage(usage, env))
}

// Bool defines a boolean flag (default false unless the environment says otherwise).
func (s *Set) Bool(p *bool, name, env, usage string) {
	s.FS.BoolVar(p, name, parsed(s, env, false, "a boolean", strconv.ParseBool), s.usage(usage, env))
}

// Int defines an integer flag.
func (s *Set) Int(p *int, name, env string, def int, usage string) {
	s.FS.IntVar(p, name, parsed(s, env, def, "an integer", strconv.Atoi), s.usage(usage, env))
}

// Float defines a float flag.
func (s *Set) Float(p *float64, name, env string, def float64, usage string) {
	f := func(v string) (float64, error) { return strconv.ParseFloat(v, 64) }
	s.FS.Float64Var(p, name, parsed(s, env, def, "a number", f), s.usage(usage, env))
}

// Duration defines a duration flag.
func (s *Set) Duration(p *time.Duration, name, env string, def time.Duration, usage string) {
	s.FS.DurationVar(p, name, parsed(s, env, def, "a duration (e.g. 30s)", time.ParseDuration), s.usage(usage, env))
}

// Parse parses args. Positional arguments are refused (every setting is a flag), and the
// environment's parse errors are returned together. flag.ErrHelp is returned for -h, after
// the usage is printed. A bad flag prints nothing here: the binary reports the returned
// error once, in its log format (boot.FlagsExit), where package flag would print it and
// the whole usage as plain text.
func (s *Set) Parse(args []string) error {
	out := s.FS.Output()
	s.FS.SetOutput(io.Discard)
	err := s.FS.Parse(args)
	s.FS.SetOutput(out)
	if errors.Is(err, flag.ErrHelp) {
		if s.FS.Usage != nil {
			s.FS.Usage()
		} else {
			s.FS.PrintDefaults()
		}
		return err
	}
	if err != nil {
		return err
	}
	if s.FS.NArg() > 0 {
		args := make([]string, s.FS.NArg())
		for i, a := range s.FS.Args() {
			args[i] = quote.Input(a)
		}
		return fmt.Errorf("unexpected arguments: %s (every setting is a flag)", strings.Join(args, " "))
	}
	return errors.Join(s.errs...)
}

// Log holds the -log-format and -log-level flags.
type Log struct {
	Format, Level string
}

// Define defines -log-format (text or json) and -log-level on s.
func (l *Log) Define(s *Set) {
	s.String(&l.Format, "log-format", "LOG_FORMAT", "text", "log format: text or json")
	s.String(&l.Level, "log-level", "LOG_LEVEL", "info", "least log level: debug, info, warn, error")
}

// Validate checks the two values, naming the flag that is wrong.
func (l Log) Validate() error {
	var lvl slog.Level
	switch {
	case l.Format != "text" && l.Format != "json":
		return fmt.Errorf("-log-format %s must be text or json", quote.Input(l.Format))
	case lvl.UnmarshalText([]byte(l.Level)) != nil:
		return fmt.Errorf("-log-level %s: want debug, info, warn or error", quote.Input(l.Level))
	}
	return nil
}

// Logger returns a slog logger writing to w in the format and from the level chosen (both
// validated first; invalid values fall back to text and info). In JSON a duration is a
// string ("1m30s"), as in text, not slog's integer of nanoseconds.
func (l Log) Logger(w io.Writer) *slog.Logger {
	var lvl slog.Level
	_ = lvl.UnmarshalText([]byte(l.Level))
	opts := &slog.HandlerOptions{Level: lvl}
	if l.Format == "json" {
		opts.ReplaceAttr = durationsAsText
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

// durationsAsText is a ReplaceAttr that writes a time.Duration as its String.
func durationsAsText(_ []string, a slog.Attr) slog.Attr {
	if a.Value.Kind() == slog.KindDuration {
		a.Value = slog.StringValue(a.Value.Duration().String())
	}
	return a
}

// LogFormatOf is the -log-format a command line asks for — the flag's last value in args
// (-log-format json, -log-format=json, with one or two dashes, before any "--"), else
// $<prefix>LOG_FORMAT — without parsing the other flags: a binary whose flags do not parse
// still reports that in the format asked for.
func LogFormatOf(args []string, prefix string) string {
	format, found := "", false
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			break
		}
		name, value, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if !strings.HasPrefix(a, "-") || name != "log-format" {
			continue
		}
		if !hasValue {
			if i+1 >= len(args) {
				break
			}
			i++
			value = args[i]
		}
		format, found = value, true
	}
	if found {
		return format
	}
	return os.Getenv(prefix + "LOG_FORMAT")
}

// CheckListenAddr checks an HTTP listen address of flag name (environment variable env)
// as net.Listen will need it, host:port with a port number (0: any free port), so that
// a typo is a bad setting at start rather than a failure after the database was migrated.
func CheckListenAddr(name, env, addr string) error {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		why := err.Error()
		var ae *net.AddrError
		if errors.As(err, &ae) {
			why = ae.Err // without the address again
		}
		return fmt.Errorf("-%s ($%s) %s: want host:port, e.g. 127.0.0.1:8080 (%s)", name, env, quote.Input(addr), why)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 0 || n > 65535 {
		return fmt.Errorf("-%s ($%s) %s: the port must be a number in 0..65535", name, env, quote.Input(addr))
	}
	return nil
}
