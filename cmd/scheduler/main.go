// Command scheduler runs idemscrape's periodic job templates and the reconciler.
//
//	scheduler -config scheduler.yaml [flags]
//
// It migrates PostgreSQL (safe from many processes), validates the YAML configuration
// (see examples/scheduler.yaml; an invalid one exits 2 with an error naming the template
// and field, before anything runs), then runs every template's ticks and, unless
// reconciler.disabled, the reconciler, until SIGTERM or SIGINT: the loops stop at their
// next statement (a half-done tick is completed by the next start's catch-up) and the
// process exits 0. Any number of schedulers may run with the same configuration.
//
// HTTP (-http): /metrics (Prometheus) and /healthz (PostgreSQL and Redis answer).
// Every flag is also read from the environment variable shown in -help (IDEMSCRAPE_*, the
// same names as cmd/worker and cmd/idemscrape: IDEMSCRAPE_PG, IDEMSCRAPE_REDIS, ...). A Redis
// Cluster is -redis-cluster host:port,host:port,… (IDEMSCRAPE_REDIS_CLUSTER) instead of
// -redis; see docs/CLUSTER.md.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/idemscrape/idemscrape/cmd/internal/boot"
	"github.com/idemscrape/idemscrape/cmd/internal/envflag"
	"github.com/idemscrape/idemscrape/scheduler"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/outbox"
	"github.com/idemscrape/idemscrape/tasks"
)

const envPrefix = "IDEMSCRAPE_"

type config struct {
	configPath    string
	pg            string
	redis         envflag.Redis
	redisCfg      envflag.RedisConfig // from redis, set by parseFlags
	httpAddr      string
	keyPrefix     string
	id            string
	allowLoopback bool
	noScheduler   bool
	noReconciler  bool
	log           envflag.Log
}

func parseFlags(args []string, stderr io.Writer) (config, error) {
	var c config
	s := envflag.New("scheduler", envPrefix, stderr)
	s.String(&c.configPath, "config", "SCHEDULER_CONFIG", "", "YAML configuration: templates, kinds, reconciler (required)")
	s.String(&c.pg, "pg", "PG", "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable", "PostgreSQL URL (libpq form)")
	c.redis.Define(s)
	s.String(&c.httpAddr, "http", "SCHEDULER_HTTP_ADDR", "127.0.0.1:8081", "HTTP listen address for /metrics and /healthz (empty: no HTTP)")
	s.String(&c.keyPrefix, "key-prefix", "KEY_PREFIX", "idemscrape:", "prefix of the lease keys in Redis (the workers' -key-prefix)")
	s.String(&c.id, "id", "SCHEDULER_ID", "", "this process's name in the reconciler's lease owner (default host/pid)")
	s.Bool(&c.allowLoopback, "allow-loopback", "ALLOW_LOOPBACK", "allow source URLs on 127.0.0.0/8 and ::1 (demos and tests only)")
	s.Bool(&c.noScheduler, "no-scheduler", "NO_SCHEDULER", "do not run the templates in this process")
	s.Bool(&c.noReconciler, "no-reconciler", "NO_RECONCILER", "do not run the reconciler in this process (also: reconciler.disabled)")
	c.log.Define(s)
	s.FS.Usage = func() {
		fmt.Fprint(s.FS.Output(), `usage: scheduler -config FILE [flags]

Runs periodic job templates (window-keyed jobs: a tick enqueues each window's jobs once,
however many schedulers run) and the reconciler (stranded running jobs, lost asynq tasks,
outbox lag and pruning) until SIGTERM or SIGINT.

Flags (each also read from the environment variable shown; the flag wins):
`)
		s.FS.PrintDefaults()
	}
	if err := s.Parse(args); err != nil {
		return c, err
	}
	if c.configPath == "" {
		return c, errors.New("-config ($IDEMSCRAPE_SCHEDULER_CONFIG) is required")
	}
	if c.httpAddr != "" {
		if err := envflag.CheckListenAddr("http", envPrefix+"SCHEDULER_HTTP_ADDR", c.httpAddr); err != nil {
			return c, err
		}
	}
	var err error
	if c.redisCfg, err = c.redis.Config(); err != nil {
		return c, err
	}
	return c, c.log.Validate()
}

func main() {
	c, err := parseFlags(os.Args[1:], os.Stderr)
	if code, exit := boot.FlagsExit("scheduler", err, os.Stderr, envflag.LogFormatOf(os.Args[1:], envPrefix)); exit {
		os.Exit(code)
	}
	log := boot.Logger(c.log, os.Stderr)
	file, err := scheduler.LoadFile(c.configPath)
	if err != nil {
		// Nothing has started: a bad configuration never half-runs.
		log.Error("invalid configuration", "err", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if code := boot.RunExit("scheduler", run(ctx, c, file, log), log); code != 0 {
		os.Exit(code)
	}
	log.Info("scheduler stopped")
}

func run(ctx context.Context, c config, file *scheduler.File, log *slog.Logger) error {
	// Traces, when the OTEL_* environment asks for them (cmd/internal/telemetry).
	flushTraces, tracing := boot.Tracing(ctx, "idemscrape-scheduler", log)
	defer flushTraces()
	log.Info("tracing", "on", tracing)
	pool, err := boot.OpenPG(ctx, c.pg, log)
	if err != nil {
		return err
	}
	defer pool.Close()
	rdb := c.redisCfg.NewClient()
	defer rdb.Close()
	connOpt := c.redisCfg.AsynqConnOpt()
	client := asynq.NewClient(connOpt)
	defer client.Close()
	insp := asynq.NewInspector(connOpt)
	defer insp.Close()

	dest := tasks.StrictDestinationPolicy()
	if c.allowLoopback {
		dest = tasks.LoopbackPolicy()
		log.Warn("loopback source URLs allowed (-allow-loopback): for demos and tests only")
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	st := store.New(pool)

	var sched *scheduler.Scheduler
	if !c.noScheduler && len(file.Templates) > 0 {
		sched, err = scheduler.New(scheduler.Config{
			File: file, Client: client, Redis: rdb, Store: st, Inspector: insp, Destinations: dest,
			Registerer: reg, Logger: log,
		})
		if err != nil {
			return err
		}
	}
	var rec *scheduler.Reconciler
	if !c.noReconciler && !file.Reconciler.Disabled {
		maint, err := outbox.NewMaintainer(pool)
		if err != nil {
			return err
		}
		rec, err = scheduler.NewReconciler(scheduler.ReconcilerConfig{
			File: file, Store: st, Outbox: maint, Redis: rdb, Client: client, Inspector: insp,
			KeyPrefix: c.keyPrefix, ID: c.id, Destinations: dest, Registerer: reg, Logger: log,
		})
		if err != nil {
			return err
		}
	}

	var srv *http.Server
	if c.httpAddr != "" {
		ln, err := net.Listen("tcp", c.httpAddr)
		if err != nil {
			return fmt.Errorf("http: %w", err)
		}
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
			hctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
			defer cancel()
			if err := pool.Ping(hctx); err != nil {
				http.Error(w, "postgres: unavailable", http.StatusServiceUnavailable)
				return
			}
			if err := rdb.Ping(hctx).Err(); err != nil {
				http.Error(w, "redis: unavailable", http.StatusServiceUnavailable)
				return
			}
			fmt.Fprintln(w, "ok")
		})
		srv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		go func() {
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				log.Error("http server failed", "err", err)
			}
		}()
		log.Info("http listening", "addr", ln.Addr().String())
	}

	if sched != nil {
		if err := sched.Start(ctx); err != nil {
			return err
		}
	}
	if rec != nil {
		if err := rec.Start(ctx); err != nil {
			return err
		}
	}
	log.Info("scheduler running", "templates", len(file.Templates), "scheduler", sched != nil, "reconciler", rec != nil, "redis", c.redisCfg.String())
	<-ctx.Done()
	log.Info("shutting down")
	if sched != nil {
		sched.Stop()
	}
	if rec != nil {
		rec.Stop()
	}
	if srv != nil {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}
	return nil
}
