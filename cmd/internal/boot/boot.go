// Package boot is what the worker and the scheduler binaries do the same way before they
// start and when they end: the flags' verdict, the logger, traces from the OTEL_*
// environment, PostgreSQL opened and migrated, and the exit status. One copy, so that the
// two start (and refuse a bad setting) alike.
package boot

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemscrape/idemscrape/cmd/internal/envflag"
	"github.com/idemscrape/idemscrape/cmd/internal/telemetry"
	"github.com/idemscrape/idemscrape/store"
)

// SettingError is a bad setting of the environment or the flags (the binaries exit 2, as
// for a bad flag), as opposed to a service that failed.
type SettingError struct{ Err error }

func (e *SettingError) Error() string { return e.Err.Error() }
func (e *SettingError) Unwrap() error { return e.Err }

// FlagsExit is what a binary does with the error of its flags' parse: none (exit false)
// starts it; -h (flag.ErrHelp, the usage is printed) exits 0; a bad flag or environment
// value is reported on stderr and exits 2 — as one JSON log line ("bad setting") when the
// command line or the environment asks for -log-format json (format, envflag.LogFormatOf),
// else as "<prog>: <err>" and where to find the flags.
func FlagsExit(prog string, err error, stderr io.Writer, format string) (code int, exit bool) {
	switch {
	case err == nil:
		return 0, false
	case errors.Is(err, flag.ErrHelp):
		return 0, true
	}
	if format == "json" {
		envflag.Log{Format: "json", Level: "info"}.Logger(stderr).Error("bad setting", "err", err.Error(), "help", prog+" -h lists the flags")
		return 2, true
	}
	fmt.Fprintf(stderr, "%s: %v\n(%s -h lists the flags)\n", prog, err, prog)
	return 2, true
}

// Logger is the binary's logger from its -log-format and -log-level flags, writing to w. It
// becomes slog's default, and go-redis's own lines go through it too, in the same format.
func Logger(l envflag.Log, w io.Writer) *slog.Logger {
	log := l.Logger(w)
	slog.SetDefault(log)
	envflag.RouteRedisLogs(log)
	return log
}

// RunExit is the exit status of a binary whose run returned err, logging why it ends: 0
// for nil; 2 for a *SettingError ("bad setting", as for a bad flag); 1 for any other error
// ("<prog> failed").
func RunExit(prog string, err error, log *slog.Logger) int {
	if err == nil {
		return 0
	}
	var bad *SettingError
	if errors.As(err, &bad) {
		log.Error("bad setting", "err", bad.Err)
		return 2
	}
	log.Error(prog+" failed", "err", err)
	return 1
}

// MigrateTimeout bounds the migrations at start.
const MigrateTimeout = 5 * time.Minute

// Tracing installs tracing as the environment asks (internal/telemetry) for service and
// returns the function that flushes it at exit (within 5 s: spans not exported by then are
// lost, shutdown is not held up) and whether it is on. A tracing setting this build can
// not honour (OTEL_EXPORTER_OTLP_PROTOCOL=grpc, another exporter) is logged as a warning
// and tracing stays off: traces are never a reason for a worker not to work (an
// environment set fleet-wide for other services must not stop it).
func Tracing(ctx context.Context, service string, log *slog.Logger) (flush func(), on bool) {
	shutdown, on, err := telemetry.Setup(ctx, service)
	if err != nil {
		log.Warn("tracing off: the OTEL_* environment asks for what this build can not do", "err", err)
		return func() {}, false
	}
	return func() {
		fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = shutdown(fctx)
	}, on
}

// OpenPG opens the PostgreSQL pool of the -pg flag's value (or $IDEMSCRAPE_PG and the
// password file variables, envflag.PGConfig) and applies the pending migrations, logging
// which. The caller closes the pool.
func OpenPG(ctx context.Context, value string, log *slog.Logger) (*pgxpool.Pool, error) {
	pcfg, err := envflag.PGConfig(value, "-pg ($IDEMSCRAPE_PG)", "IDEMSCRAPE_")
	if err != nil {
		return nil, &SettingError{err}
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("postgres: %w", err)
	}
	mctx, cancel := context.WithTimeout(ctx, MigrateTimeout)
	applied, err := store.Migrate(mctx, pool, nil)
	cancel()
	if err != nil {
		pool.Close()
		return nil, err
	}
	if len(applied) > 0 {
		log.Info("applied migrations", "versions", applied)
	}
	return pool, nil
}
