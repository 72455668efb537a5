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
	"os"
	"strconv"
	"time"
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
		s.errs = append(s.errs, fmt.Errorf("$%s%s: %q is not %s", s.Prefix, env, v, what))
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
// environment's parse errors are returned together. flag.ErrHelp is returned for -h.
func (s *Set) Parse(args []string) error {
	if err := s.FS.Parse(args); err != nil {
		return err
	}
	if s.FS.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %q (every setting is a flag)", s.FS.Args())
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
		return fmt.Errorf("-log-format %q must be text or json", l.Format)
	case lvl.UnmarshalText([]byte(l.Level)) != nil:
		return fmt.Errorf("-log-level %q: want debug, info, warn or error", l.Level)
	}
	return nil
}

// Logger returns a slog logger writing to w in the format and from the level chosen (both
// validated first; invalid values fall back to text and info).
func (l Log) Logger(w io.Writer) *slog.Logger {
	var lvl slog.Level
	_ = lvl.UnmarshalText([]byte(l.Level))
	opts := &slog.HandlerOptions{Level: lvl}
	if l.Format == "json" {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}
