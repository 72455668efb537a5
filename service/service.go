// Package service is the entry point a team deploys: after registering its job kinds on a
// handlers.Registry, a service's main builds a Service and runs it. One Service runs
//
//   - the asynq server, every task through the registry's runner;
//   - the outbox dispatcher (store/outbox), unless turned off;
//   - one HTTP server: /metrics (the registry's and the dispatcher's metrics, Go runtime,
//     process), /healthz (the process is up), /readyz (Redis takes a write, PostgreSQL
//     answers, the asynq server runs, the registry is not paused), asynqmon at /monitoring (read-only
//     unless MonitoringWritable), the job pages /jobs and /jobs/{key} and /windows — all
//     but /metrics, /healthz and /readyz behind optional HTTP basic auth, and answered
//     only under the listen address, loopback names and Config.AllowedHosts.
//
// Shutdown stops taking work, lets in-flight jobs finish for Config.ShutdownTimeout, then
// asynq puts the tasks of the jobs still running back to pending and cancels their
// context: the runner records their attempt as retryable and releases their lease, and
// Shutdown waits for that (Config.DrainTimeout). Every job is then complete or runnable
// again; once reg.Close has returned (it waits for the lease releases of committed jobs,
// which run in the background) no lease is held. The dispatcher stops after its in-flight
// batch.
//
//	reg, _ := handlers.NewRegistry(handlers.Config{...})
//	_ = reg.Register("catalog", workflow, parser)
//	svc, err := service.New(service.Config{Registry: reg, Store: st, Redis: rdb,
//		Queues: map[string]int{"catalog": 1}})
//	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
//	defer stop()
//	err = svc.Run(ctx) // returns nil after a clean shutdown
//	reg.Close()
package service

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/hibiken/asynqmon"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/store/outbox"
)

// Service runs the asynq server, the outbox dispatcher and the HTTP server of one worker
// process. Start and Shutdown may each be called once; Run does both.
type Service struct {
	cfg     Config
	log     *slog.Logger
	srv     *asynq.Server
	disp    *outbox.Dispatcher
	mon     *asynqmon.HTTPHandler
	http    *http.Server
	metrics *prometheus.Registry
	hosts   *hostGuard
	// readyKey is the key /readyz's Redis check writes (readyProbeKey).
	readyKey string

	inflight sync.WaitGroup // handlers still running, counted by track
	running  atomic.Bool    // asynq server started and not shutting down

	mu        sync.Mutex
	started   bool
	shutdown  bool
	listener  net.Listener
	serveErr  chan error // the HTTP server's Serve result
	shutOnce  sync.Once
	shutErr   error
	closeMons sync.Once
	// asynqRedis is a client of asynq's own connection option (RedisConnOpt), for
	// /readyz's asynq check: the asynq server can be cut off from Redis while Config.Redis
	// is not (another address, other credentials).
	asynqRedis redis.UniversalClient
}

// New validates cfg and builds the service. It does no I/O beyond what asynqmon's and
// asynq's constructors do (they create Redis clients without connecting).
func New(cfg Config) (*Service, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	c := cfg.withDefaults()
	s := &Service{cfg: c, log: c.Logger.With("component", "service"), metrics: prometheus.NewRegistry()}

	if err := s.metrics.Register(collectors.NewGoCollector()); err != nil {
		return nil, fmt.Errorf("service: register Go collector: %w", err)
	}
	if err := s.metrics.Register(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})); err != nil {
		return nil, fmt.Errorf("service: register process collector: %w", err)
	}

	prefix := outbox.DefaultPrefix
	if c.Dispatcher != nil && c.Dispatcher.Prefix != "" {
		prefix = c.Dispatcher.Prefix
	}
	s.readyKey = readyProbeKey(prefix)
	hosts, err := newHostGuard(c)
	if err != nil {
		return nil, err
	}
	s.hosts = hosts
	if err := s.metrics.Register(hosts.refused); err != nil {
		return nil, fmt.Errorf("service: register Host counter: %w", err)
	}

	if !c.NoDispatcher {
		dc := outbox.DispatcherConfig{}
		if c.Dispatcher != nil {
			dc = *c.Dispatcher
		}
		if dc.Registerer == nil {
			dc.Registerer = s.metrics
		}
		if dc.Logger == nil {
			dc.Logger = c.Logger
		}
		d, err := outbox.NewDispatcher(c.Store.Pool(), c.Redis, &dc)
		if err != nil {
			return nil, fmt.Errorf("service: %w", err)
		}
		s.disp = d
	}

	if rc, ok := c.RedisConnOpt.MakeRedisClient().(redis.UniversalClient); ok {
		s.asynqRedis = rc
	}
	s.srv = asynq.NewServer(c.RedisConnOpt, c.Registry.ServerConfig(asynq.Config{
		Concurrency:     c.Concurrency,
		Queues:          c.Queues,
		StrictPriority:  c.StrictPriority,
		ShutdownTimeout: c.ShutdownTimeout,
		Logger:          asynqLogger{c.Logger.With("component", "asynq")},
		LogLevel:        c.AsynqLogLevel,
	}))
	s.mon = asynqmon.New(asynqmon.Options{
		RootPath:     DefaultMonitoringPath,
		RedisConnOpt: c.RedisConnOpt,
		ReadOnly:     c.MonitoringReadOnly || !c.MonitoringWritable,
	})
	s.http = &http.Server{
		Handler:           s.routes(),
		ReadHeaderTimeout: 10 * time.Second,
		ErrorLog:          slog.NewLogLogger(c.Logger.Handler(), slog.LevelWarn),
	}
	return s, nil
}

// Handler returns the HTTP handler of the service (every route), for tests and for
// services that serve it on a server of their own (then the Host check knows
// Config.HTTPAddr, not that server's address: name it in Config.AllowedHosts).
func (s *Service) Handler() http.Handler { return s.http.Handler }

// HTTPAddr returns the address the HTTP server listens on (after Start), e.g. the port
// picked for "127.0.0.1:0"; "" before Start.
func (s *Service) HTTPAddr() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.listener == nil {
		return ""
	}
	return s.listener.Addr().String()
}

// Start listens on Config.HTTPAddr, starts the outbox dispatcher and the asynq server, and
// returns; everything runs until Shutdown (ctx only carries values for logging: cancelling
// it stops nothing). It fails if the address is taken or asynq can not start; then nothing
// keeps running.
func (s *Service) Start(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.started {
		return errors.New("service: Start called twice")
	}
	if s.shutdown {
		return errors.New("service: Start after Shutdown")
	}
	ln, err := net.Listen("tcp", s.cfg.HTTPAddr)
	if err != nil {
		return fmt.Errorf("service: listen on %s: %w", s.cfg.HTTPAddr, err)
	}
	if s.disp != nil {
		if err := s.disp.Start(context.WithoutCancel(ctx)); err != nil {
			_ = ln.Close()
			return fmt.Errorf("service: start dispatcher: %w", err)
		}
	}
	if err := s.srv.Start(asynq.HandlerFunc(s.track)); err != nil {
		if s.disp != nil {
			s.disp.Stop()
		}
		_ = ln.Close()
		return fmt.Errorf("service: start asynq server: %w", err)
	}
	s.running.Store(true)
	s.listener = ln
	s.hosts.listening(ln.Addr())
	s.serveErr = make(chan error, 1)
	go func() { s.serveErr <- s.http.Serve(ln) }()
	s.started = true
	s.log.InfoContext(ctx, "service started", "http", ln.Addr().String(), "queues", s.cfg.Queues,
		"concurrency", s.cfg.Concurrency, "dispatcher", s.disp != nil,
		"monitoring_writable", s.cfg.MonitoringWritable && !s.cfg.MonitoringReadOnly, "basic_auth", s.cfg.BasicAuth != nil)
	return nil
}

// track runs one task through the registry and counts it in flight, so that Shutdown can
// wait for handlers asynq stopped waiting for.
func (s *Service) track(ctx context.Context, t *asynq.Task) error {
	s.inflight.Add(1)
	defer s.inflight.Done()
	return s.cfg.Registry.ProcessTask(ctx, t)
}

// Run starts the service and blocks until ctx is done, then shuts it down and returns nil
// after a clean shutdown. Wire signals into ctx (signal.NotifyContext). It returns early
// with an error if the HTTP server fails.
func (s *Service) Run(ctx context.Context) error {
	if err := s.Start(ctx); err != nil {
		_ = s.Shutdown(context.WithoutCancel(ctx)) // closes asynqmon's connections
		return err
	}
	var serveErr error
	select {
	case <-ctx.Done():
	case serveErr = <-s.serveErr:
		s.log.Error("HTTP server failed; shutting down", "err", serveErr)
	}
	// The shutdown has its own bounds (ShutdownTimeout + DrainTimeout); ctx is done.
	err := s.Shutdown(context.WithoutCancel(ctx))
	if serveErr != nil {
		return errors.Join(fmt.Errorf("service: HTTP server: %w", serveErr), err)
	}
	return err
}

// Shutdown stops the service in this order: /readyz turns 503; the asynq server stops
// taking tasks, lets in-flight jobs run for ShutdownTimeout, then hands their tasks back;
// Shutdown waits (up to DrainTimeout) for those handlers to record their attempts and
// release their leases; the dispatcher stops after its in-flight batch; the HTTP server
// closes. ctx bounds only the HTTP server's graceful close. Calling it more than once
// returns the first result.
func (s *Service) Shutdown(ctx context.Context) error {
	s.shutOnce.Do(func() { s.shutErr = s.doShutdown(ctx) })
	return s.shutErr
}

func (s *Service) doShutdown(ctx context.Context) error {
	s.mu.Lock()
	s.shutdown = true
	started := s.started
	s.mu.Unlock()
	defer s.closeMonitoring()
	if !started {
		return nil
	}
	s.log.InfoContext(ctx, "shutting down")
	s.running.Store(false)
	began := time.Now()
	// Stop returns once the processor fetches no more tasks; Shutdown then waits for the
	// in-flight ones up to ShutdownTimeout and hands the rest back.
	s.srv.Stop()
	s.log.InfoContext(ctx, "stopped taking work; in-flight jobs may finish", "shutdown_timeout", s.cfg.ShutdownTimeout)
	s.srv.Shutdown()

	var errs []error
	drained := make(chan struct{})
	go func() {
		s.inflight.Wait()
		close(drained)
	}()
	t := time.NewTimer(s.cfg.DrainTimeout)
	select {
	case <-drained:
		t.Stop()
	case <-t.C:
		errs = append(errs, fmt.Errorf("service: handlers still running %v after the asynq server stopped; their leases expire on their own", s.cfg.DrainTimeout))
	}
	if s.disp != nil {
		s.disp.Stop()
	}
	hctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := s.http.Shutdown(hctx); err != nil {
		errs = append(errs, fmt.Errorf("service: HTTP shutdown: %w", err))
	}
	if err := <-s.serveErr; err != nil && !errors.Is(err, http.ErrServerClosed) {
		errs = append(errs, fmt.Errorf("service: HTTP server: %w", err))
	}
	s.log.InfoContext(ctx, "shutdown complete", "took", time.Since(began).Round(time.Millisecond), "errors", len(errs))
	return errors.Join(errs...)
}

func (s *Service) closeMonitoring() {
	s.closeMons.Do(func() {
		if err := s.mon.Close(); err != nil {
			s.log.Warn("closing asynqmon", "err", err)
		}
		if s.asynqRedis != nil {
			_ = s.asynqRedis.Close()
		}
	})
}

// routes builds the HTTP mux.
func (s *Service) routes() http.Handler {
	mux := http.NewServeMux()
	gatherers := prometheus.Gatherers{s.metrics}
	if g := s.cfg.Registry.Gatherer(); g != nil {
		gatherers = append(gatherers, g)
	}
	if s.cfg.Gatherer != nil {
		gatherers = append(gatherers, s.cfg.Gatherer)
	}
	mux.Handle("GET /metrics", promhttp.HandlerFor(gatherers, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", s.serveReady)

	// The Host must be one this server answers to (the listen address, loopback,
	// Config.AllowedHosts): a same-origin request of a DNS-rebinding page is refused.
	// Then basic auth when configured; and for every method but GET, HEAD and OPTIONS the
	// request must come from the same origin (Sec-Fetch-Site, else Origin against Host):
	// a browser sends basic auth credentials with any site's form POST.
	sameOrigin := http.NewCrossOriginProtection()
	protect := func(h http.Handler) http.Handler { return s.hosts.handler(sameOrigin.Handler(h)) }
	if s.cfg.BasicAuth != nil {
		protect = func(h http.Handler) http.Handler {
			return s.hosts.handler(basicAuth(*s.cfg.BasicAuth, sameOrigin.Handler(h)))
		}
	}
	mux.Handle(DefaultMonitoringPath, protect(s.mon))
	mux.Handle(DefaultMonitoringPath+"/", protect(s.mon))
	mux.Handle("GET /jobs", protect(http.HandlerFunc(s.serveJobList)))
	mux.Handle("GET /jobs/{key...}", protect(http.HandlerFunc(s.serveJob)))
	mux.Handle("GET /windows", protect(http.HandlerFunc(s.serveWindows)))
	mux.Handle("GET /{$}", s.hosts.handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "/jobs", http.StatusFound)
	})))
	return mux
}

// loopbackAddr reports whether a listen address (host:port) is on loopback only:
// 127.0.0.0/8, ::1 or localhost. "" and ":port" (every interface) are not.
func loopbackAddr(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil || host == "" {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
