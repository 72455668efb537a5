package scheduler

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
)

// Scheduler defaults.
const (
	// DefaultTickBatch is how many specs one EnqueueMany (one jobs statement) carries.
	DefaultTickBatch = 500
	// DefaultQueryTimeout bounds every statement and Redis round trip of a tick batch or a
	// reconciler page.
	DefaultQueryTimeout = 30 * time.Second
	// DefaultRetryMin and DefaultRetryMax bound the backoff between tries of a failed tick
	// (doubling, jittered over the upper half of each step: see backoff).
	DefaultRetryMin = time.Second
	DefaultRetryMax = time.Minute
)

// Config wires a Scheduler to its services. (A Reconciler has its own ReconcilerConfig.)
type Config struct {
	// File is the validated configuration (LoadFile / ParseFile). Required.
	File *File
	// Client enqueues tasks. Required.
	Client *asynq.Client
	// Redis is the asynq Redis, read to skip specs whose task already exists (one
	// pipelined round trip per batch). Required.
	Redis redis.UniversalClient
	// Store records jobs rows (store.PG). Required.
	Store tasks.JobRecorder
	// Windows records every due window before its specs are enqueued (store.PG). Defaults
	// to Store when Store implements WindowRecorder; required otherwise.
	Windows WindowRecorder
	// RetryMin and RetryMax bound the backoff between tries of a failed tick. Default to
	// DefaultRetryMin and DefaultRetryMax.
	RetryMin, RetryMax time.Duration
	// Inspector lets the enqueuers repair an archived task of a runnable job. Optional.
	Inspector *asynq.Inspector
	// Destinations is the policy every source URL must pass (tasks.EnqueuerConfig).
	// Defaults to tasks' strict policy; tests pass tasks.LoopbackPolicy().
	Destinations *tasks.DestinationPolicy
	// Normalizer derives keys; it must be the workers' normalizer. Defaults to
	// tasks.DefaultNormalizer.
	Normalizer *tasks.Normalizer
	// TickBatch is the number of specs per EnqueueMany. Defaults to DefaultTickBatch.
	TickBatch int
	// QueryTimeout bounds each batch's statements and round trips. Defaults to
	// DefaultQueryTimeout.
	QueryTimeout time.Duration
	// Registerer receives the metrics. Defaults to a private registry (Gatherer).
	Registerer prometheus.Registerer
	// Logger. Defaults to slog.Default().
	Logger *slog.Logger
	// Now is the clock. Defaults to time.Now.
	Now func() time.Time
	// TestSignal, when set, receives the report of every tick (tests only; the loop blocks
	// until it is read or the scheduler stops).
	TestSignal chan<- TickReport
}

// Validate checks cfg and fills in defaults.
func (c *Config) Validate() error {
	switch {
	case c.File == nil:
		return errors.New("scheduler: Config.File is required")
	case c.Client == nil:
		return errors.New("scheduler: Config.Client is required")
	case c.Redis == nil:
		return errors.New("scheduler: Config.Redis is required")
	case c.Store == nil:
		return errors.New("scheduler: Config.Store is required")
	case c.TickBatch < 0:
		return fmt.Errorf("scheduler: Config.TickBatch %d is negative", c.TickBatch)
	case c.QueryTimeout < 0:
		return fmt.Errorf("scheduler: Config.QueryTimeout %v is negative", c.QueryTimeout)
	case c.RetryMin < 0 || c.RetryMax < 0 || (c.RetryMax > 0 && c.RetryMin > c.RetryMax):
		return fmt.Errorf("scheduler: Config.RetryMin %v and RetryMax %v must be positive, RetryMin <= RetryMax", c.RetryMin, c.RetryMax)
	}
	if c.Windows == nil {
		w, ok := c.Store.(WindowRecorder)
		if !ok {
			return errors.New("scheduler: Config.Windows is required (Store does not record windows)")
		}
		c.Windows = w
	}
	if c.RetryMin == 0 {
		c.RetryMin = DefaultRetryMin
		if c.RetryMax > 0 {
			c.RetryMin = min(DefaultRetryMin, c.RetryMax) // a RetryMax below the default bounds it
		}
	}
	if c.RetryMax == 0 {
		c.RetryMax = max(DefaultRetryMax, c.RetryMin)
	}
	if c.Normalizer == nil {
		c.Normalizer = tasks.DefaultNormalizer
	}
	if c.TickBatch == 0 {
		c.TickBatch = DefaultTickBatch
	}
	if c.QueryTimeout == 0 {
		c.QueryTimeout = DefaultQueryTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Destinations == nil {
		c.Destinations = tasks.StrictDestinationPolicy()
	}
	return nil
}

// TickReport is what one tick of a template did.
type TickReport struct {
	Template string
	At       time.Time // the scheduled instant
	Window   string
	CatchUp  bool // the start-up catch-up of a missed window
	Try      int  // 1 for a window's first tick, 2… for its retries after a failure
	GaveUp   bool // the tick failed and a retry would come after the window's deadline: a gap
	Specs    int  // sources × countries
	// Invalid counts the specs (source × country) that are not valid: a bad line of the
	// source file, a URL the destination policy refuses. They are logged and skipped.
	Invalid int
	// Outcomes counts specs per tasks.Outcome name; "already_queued" includes specs skipped
	// because their task already exists.
	Outcomes map[string]int
	Err      error
}

// Scheduler runs the templates' ticks: each tick expands template × sources × countries
// into specs whose Window is the tick's window and enqueues them, so a tick fired twice, by
// two instances or after a restart enqueues nothing new (the keys exist). Any number of
// Schedulers may run with the same configuration. It does not use asynq's Scheduler.
type Scheduler struct {
	cfg     Config
	enq     *enqueuers
	metrics *metrics
	gath    prometheus.Gatherer

	lostMu sync.Mutex
	lost   map[[2]string]*lostTries // template, window → tries PostgreSQL could not record

	refused refusedWindows // the windows refused for retention already warned about

	mu      sync.Mutex
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	running bool
}

// New validates cfg and returns a stopped Scheduler.
func New(cfg Config) (*Scheduler, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	s := &Scheduler{cfg: cfg, lost: map[[2]string]*lostTries{}}
	var err error
	if s.metrics, s.gath, err = newMetrics(cfg.Registerer); err != nil {
		return nil, err
	}
	s.enq = newEnqueuers(cfg)
	return s, nil
}

// Gatherer returns the private metrics registry, or nil when Config.Registerer was given.
func (s *Scheduler) Gatherer() prometheus.Gatherer { return s.gath }

// Start counts the window gaps (idemscrape_scheduler_window_gaps), then starts one loop
// per template: the catch-up tick first (catchup: last), then a tick at every scheduled
// time; a failed tick is tried again with backoff until its window's deadline
// (Template.RetryUntil). Calling Start on a started Scheduler does nothing.
func (s *Scheduler) Start(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.running {
		return nil
	}
	ctx, s.cancel = context.WithCancel(ctx)
	s.running = true
	// The gaps a stopped scheduler left are counted before anything else runs.
	s.refreshGaps(ctx)
	for i := range s.cfg.File.Templates {
		t := &s.cfg.File.Templates[i]
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.loop(ctx, t)
		}()
	}
	return nil
}

// Stop cancels the loops (a tick in progress ends at its next statement; what it enqueued
// stays, and the next start's catch-up completes the window) and waits for them. Calling
// Stop on a stopped Scheduler does nothing.
func (s *Scheduler) Stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.running {
		return
	}
	s.cancel()
	s.wg.Wait()
	s.running = false
}

// loop ticks t's fires in order, each at its time, and tries failed windows again
// (tryWindow) in between: a window retried past the next fire (retry_until longer than
// the period) does not hold the next windows back, and no window is skipped.
func (s *Scheduler) loop(ctx context.Context, t *Template) {
	now := s.cfg.Now()
	next := t.sched.nextFire(now, nil)
	var retries []*pendingTry // by time of the next try
	retry := func(p *pendingTry) {
		if p == nil {
			return
		}
		i := sort.Search(len(retries), func(i int) bool { return retries[i].at.After(p.at) })
		retries = slices.Insert(retries, i, p)
	}
	if t.CatchUp == CatchUpLast {
		if last := t.sched.lastFire(now); !last.IsZero() {
			retry(s.tryWindow(ctx, t, pendingTry{f: last, try: 1, until: s.deadline(t, last.At), catchUp: true}))
		}
	}
	for ctx.Err() == nil {
		if len(retries) > 0 && (next.IsZero() || retries[0].at.Before(next.At)) {
			p := retries[0]
			if !sleepUntil(ctx, p.at, s.cfg.Now) {
				return
			}
			retries = retries[1:]
			retry(s.tryWindow(ctx, t, *p))
			continue
		}
		if next.IsZero() || !sleepUntil(ctx, next.At, s.cfg.Now) {
			return
		}
		p := pendingTry{f: next, try: 1, until: s.deadline(t, next.At)}
		// A later fire of a window still being retried is its next try, with the later
		// deadline.
		if i := slices.IndexFunc(retries, func(r *pendingTry) bool { return r.f.Window == next.Window }); i >= 0 {
			p.try, p.catchUp = retries[i].try, retries[i].catchUp
			retries = slices.Delete(retries, i, i+1)
		}
		next = t.sched.following(next, s.cfg.Now())
		retry(s.tryWindow(ctx, t, p))
	}
}

// signal sends rep to Config.TestSignal, if set.
func (s *Scheduler) signal(ctx context.Context, rep TickReport) {
	if s.cfg.TestSignal != nil {
		select {
		case s.cfg.TestSignal <- rep:
		case <-ctx.Done():
		}
	}
}

// Tick runs one tick of the named template for the scheduled instant at, synchronously,
// and reports what it did: the window of the fire due at at (the first, when a DST gap
// makes several windows due at one instant: see wallclock.go), or the window of the
// instant at when nothing is scheduled then. The loop ticks each fire; tests and
// benchmarks call Tick directly. Sources that make no valid spec (a bad line in the source file) are logged and
// counted; the rest of the tick goes on.
func (s *Scheduler) Tick(ctx context.Context, name string, at time.Time) TickReport {
	t := s.template(name)
	rep := TickReport{Template: name, At: at, Outcomes: map[string]int{}}
	if t == nil {
		rep.Err = fmt.Errorf("scheduler: no template %q", name)
		return rep
	}
	return s.tickFire(ctx, t, t.sched.fireAt(at))
}

// tickFire runs one tick of the scheduled fire f of t.
func (s *Scheduler) tickFire(ctx context.Context, t *Template, f fire) TickReport {
	name, at := t.Name, f.At
	rep := TickReport{Template: name, At: at, Window: f.Window, Outcomes: map[string]int{}}
	begun := time.Now()
	log := s.cfg.Logger.With("template", name, "at", at)
	rep.Err = s.tick(ctx, t, f, &rep)
	s.metrics.tickSeconds.WithLabelValues(name).Observe(time.Since(begun).Seconds())
	for o, n := range rep.Outcomes {
		s.metrics.jobs.WithLabelValues(name, o).Add(float64(n))
	}
	if rep.Invalid > 0 {
		s.metrics.jobs.WithLabelValues(name, "invalid").Add(float64(rep.Invalid))
	}
	if errors.Is(rep.Err, store.ErrWindowExpired) {
		// Refused, not failed: the window's jobs may have been pruned. Its caller says so
		// (tryWindow: once per window; a fill: to the operator).
		s.metrics.ticks.WithLabelValues(name, "refused_retention").Inc()
		return rep
	}
	if rep.Err != nil {
		s.metrics.ticks.WithLabelValues(name, "error").Inc()
		if ctx.Err() == nil {
			log.ErrorContext(ctx, "tick failed", "window", rep.Window, "err", rep.Err)
		}
		return rep
	}
	s.metrics.ticks.WithLabelValues(name, "ok").Inc()
	s.metrics.lastTick.WithLabelValues(name).Set(float64(at.Unix()))
	log.InfoContext(ctx, "tick", "window", rep.Window, "specs", rep.Specs, "outcomes", rep.Outcomes, "invalid", rep.Invalid)
	return rep
}

func (s *Scheduler) template(name string) *Template {
	for i := range s.cfg.File.Templates {
		if s.cfg.File.Templates[i].Name == name {
			return &s.cfg.File.Templates[i]
		}
	}
	return nil
}

func (s *Scheduler) tick(ctx context.Context, t *Template, f fire, rep *TickReport) (err error) {
	win, at := f.Window, f.At
	if win == "" {
		return fmt.Errorf("scheduler: template %q: no window for %v", t.Name, at)
	}
	// The window is recorded before anything of it is enqueued: a tick that fails after
	// this leaves a row that says so, and one that fails before it leaves a due window
	// without a row; both are gaps until a tick succeeds.
	// Tries PostgreSQL could not record while it did not answer are kept in memory and
	// written first (the window's own before this try is counted).
	// A window whose jobs may have been pruned (first ticked longer ago than job_retention,
	// or due before the ledger's retention without a row) is refused unless forced: a tick
	// would create its jobs again.
	rc := s.cfg.File.Reconciler
	wp := store.WindowParams{Template: t.Name, Window: win, Kind: t.Kind, Due: at, JobHorizon: rc.JobRetention,
		NoNewRow: rc.WindowRetention > 0 && at.Before(s.cfg.Now().Add(-rc.WindowRetention)), Force: f.force}
	bctx, cancel := context.WithTimeout(ctx, s.cfg.QueryTimeout)
	s.flushLost(bctx)
	err = s.cfg.Windows.WindowBegin(bctx, wp)
	cancel()
	if err != nil {
		if ctx.Err() == nil && !errors.Is(err, store.ErrWindowExpired) {
			s.keepLost(wp, 1, err)
		}
		return err
	}
	defer func() {
		// Recorded even when the tick's context ended (a stopping scheduler), briefly.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.QueryTimeout)
		defer cancel()
		if err != nil {
			if rerr := s.cfg.Windows.WindowFailed(rctx, t.Name, win, err); rerr != nil {
				s.keepLost(wp, 0, err)
				s.cfg.Logger.WarnContext(ctx, "could not record the failed tick; kept until PostgreSQL answers", "template", t.Name, "window", win, "err", rerr)
			}
			return
		}
		n := 0
		for o, c := range rep.Outcomes {
			if o != "invalid" {
				n += c
			}
		}
		err = s.cfg.Windows.WindowEnqueued(rctx, t.Name, win, rep.Specs, n)
	}()
	srcs := make([]source, 0, len(t.Sources.URLs)+len(t.Sources.IDs))
	for _, u := range t.Sources.URLs {
		srcs = append(srcs, source{url: u})
	}
	for _, id := range t.Sources.IDs {
		srcs = append(srcs, source{id: id})
	}
	if t.filePath != "" {
		fromFile, err := readSourceFile(t.filePath)
		if err != nil {
			return fmt.Errorf("scheduler: template %q: sources.file: %w", t.Name, err)
		}
		srcs = append(srcs, fromFile...)
	}
	queue := s.cfg.File.QueueFor(t.Kind)
	enq, err := s.enq.get(queue)
	if err != nil {
		return err
	}
	batch := make([]keyedSpec, 0, s.cfg.TickBatch)
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		err := s.enqueueBatch(ctx, enq, queue, batch, rep)
		batch = batch[:0]
		return err
	}
	for _, src := range srcs {
		for _, c := range t.Countries {
			rep.Specs++
			spec := tasks.Spec{Kind: t.Kind, URL: src.url, SourceID: src.id, Country: c, Window: win,
				ParserVersion: t.ParserVersion, Scope: t.Scope}
			norm, err := s.cfg.Normalizer.Normalize(spec)
			var key string
			if err == nil {
				key, err = s.cfg.Normalizer.Key(norm)
			}
			if err == nil && norm.URL != "" {
				err = s.cfg.Destinations.CheckURL(norm.URL)
			}
			if err != nil {
				rep.Invalid++
				s.cfg.Logger.WarnContext(ctx, "invalid source skipped", "template", t.Name, "line", src.line, "err", err)
				continue
			}
			batch = append(batch, keyedSpec{key: key, spec: norm})
			if len(batch) == cap(batch) {
				if err := flush(); err != nil {
					return err
				}
			}
		}
	}
	return flush()
}

type keyedSpec struct {
	key  string
	spec tasks.Spec
}

// enqueueBatch enqueues the specs of one batch whose asynq task does not exist. The task
// check is a shortcut only (one pipelined round trip instead of a jobs statement plus a
// Redis call per spec in the steady state): a spec whose task exists would be reported
// AlreadyQueued by EnqueueMany anyway, and the task is created only after its jobs row.
func (s *Scheduler) enqueueBatch(ctx context.Context, enq *tasks.Enqueuer, queue string, batch []keyedSpec, rep *TickReport) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.QueryTimeout)
	defer cancel()
	exists, err := taskStates(ctx, s.cfg.Redis, queue, keysOf(batch))
	if err != nil {
		return err
	}
	var todo []tasks.Spec
	for i, ks := range batch {
		if exists[i] != "" && exists[i] != asynqArchived {
			rep.Outcomes[tasks.AlreadyQueued.String()]++
			continue
		}
		todo = append(todo, ks.spec)
	}
	if len(todo) == 0 {
		return nil
	}
	res, err := enq.EnqueueMany(ctx, todo)
	if err != nil {
		return fmt.Errorf("scheduler: enqueue: %w", err)
	}
	for _, r := range res {
		rep.Outcomes[outcomeLabel(r.Outcome)]++
	}
	return nil
}

// outcomeLabel names an enqueue outcome in reports and metric labels.
func outcomeLabel(o tasks.Outcome) string {
	if o == tasks.Repaired {
		return "repaired"
	}
	return o.String()
}

func keysOf(b []keyedSpec) []string {
	out := make([]string, len(b))
	for i, ks := range b {
		out[i] = ks.key
	}
	return out
}

// asynqArchived is the state asynq records for an archived task.
const asynqArchived = "archived"

// AsynqTaskKey is asynq's key of the task with id in queue (asynq v0.26
// internal/base.TaskKey): a HASH whose field "state" is pending, active, scheduled, retry,
// archived, completed or aggregating.
func AsynqTaskKey(queue, id string) string { return "asynq:{" + queue + "}:t:" + id }

// taskStates returns the asynq state of each task id in queue ("" when asynq holds none),
// in one pipelined round trip.
func taskStates(ctx context.Context, rdb redis.UniversalClient, queue string, ids []string) ([]string, error) {
	pipe := rdb.Pipeline()
	cmds := make([]*redis.StringCmd, len(ids))
	for i, id := range ids {
		cmds[i] = pipe.HGet(ctx, AsynqTaskKey(queue, id), "state")
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("scheduler: read asynq task states: %w", err)
	}
	out := make([]string, len(ids))
	for i, c := range cmds {
		v, err := c.Result()
		switch {
		case errors.Is(err, redis.Nil):
		case err != nil:
			return nil, fmt.Errorf("scheduler: read asynq task state: %w", err)
		default:
			out[i] = v
		}
	}
	return out, nil
}

// sleepUntil waits until the clock reaches at; false when ctx ended first. It re-reads the
// clock after each wake-up, so a clock that jumps is followed.
func sleepUntil(ctx context.Context, at time.Time, now func() time.Time) bool {
	for {
		d := at.Sub(now())
		if d <= 0 {
			return ctx.Err() == nil
		}
		timer := time.NewTimer(d)
		select {
		case <-ctx.Done():
			timer.Stop()
			return false
		case <-timer.C:
		}
	}
}

// enqueuers holds one tasks.Enqueuer per queue (asynq task ids are per queue).
type enqueuers struct {
	cfg Config
	mu  sync.Mutex
	m   map[string]*tasks.Enqueuer
}

func newEnqueuers(cfg Config) *enqueuers {
	return &enqueuers{cfg: cfg, m: map[string]*tasks.Enqueuer{}}
}

func (e *enqueuers) get(queue string) (*tasks.Enqueuer, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if enq, ok := e.m[queue]; ok {
		return enq, nil
	}
	enq, err := tasks.NewEnqueuer(e.cfg.Client, e.cfg.Store, &tasks.EnqueuerConfig{
		Queue: queue, Normalizer: e.cfg.Normalizer, Inspector: e.cfg.Inspector, Destinations: e.cfg.Destinations,
	})
	if err != nil {
		return nil, err
	}
	e.m[queue] = enq
	return enq, nil
}
