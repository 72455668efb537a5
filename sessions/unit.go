package sessions

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"sync"
	"time"

	"github.com/gocolly/colly/v2"

	"github.com/idemscrape/idemscrape/sessions/profile"
	"github.com/idemscrape/idemscrape/tasks"
)

// Step is one request-level step of a workflow unit.
type Step struct {
	// Name identifies the step in errors, logs and quarantine rows.
	Name string
	// Safe declares the step read-only and repeatable. A unit in which an unsafe step ran
	// is never replayed: if it fails afterwards it ends as unsafe_step_incomplete.
	Safe bool
	// Run does the step's requests through sc and writes what it learns to sc.Staging.
	Run func(ctx context.Context, sc *StepContext) error
}

// StepContext is what a step works with: one session, its collector, and the staging
// area of this run of the unit.
type StepContext struct {
	Session *Session
	Staging *Staging
	bound   *Bound
}

// Fetch sends a request through the step's session (see Bound.Fetch).
func (sc *StepContext) Fetch(method, rawURL string, body io.Reader, hdr http.Header) (*colly.Response, error) {
	return sc.bound.Fetch(method, rawURL, body, hdr)
}

// Get sends a GET through the step's session.
func (sc *StepContext) Get(rawURL string) (*colly.Response, error) { return sc.bound.Get(rawURL) }

// Collector is the colly collector bound to the session, for callbacks (OnHTML) a step
// registers itself. Do not share it outside the step.
func (sc *StepContext) Collector() *colly.Collector { return sc.bound.Collector }

// Staging holds what the steps of one run of a unit found. Values are stored as JSON, so
// what is validated, quarantined and committed is exactly what a step put.
type Staging struct {
	mu     sync.Mutex
	values map[string]json.RawMessage
}

func newStaging() *Staging { return &Staging{values: map[string]json.RawMessage{}} }

// Put stores v (JSON-encoded) under key.
func (s *Staging) Put(key string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("sessions: staging %q: %w", key, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.values[key] = b
	return nil
}

// Get decodes the value under key into v and reports whether it was there.
func (s *Staging) Get(key string, v any) (bool, error) {
	s.mu.Lock()
	b, ok := s.values[key]
	s.mu.Unlock()
	if !ok {
		return false, nil
	}
	return true, json.Unmarshal(b, v)
}

// Snapshot returns a copy of everything staged.
func (s *Staging) Snapshot() map[string]json.RawMessage {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps.Clone(s.values)
}

// Quarantined is the staging of a run that did not finish, kept for review instead of
// being merged with anything else.
type Quarantined struct {
	SessionID string
	Step      string         // the step that failed, "" for a validation failure
	Reason    tasks.Category // why the run stopped
	Detail    string         // the error text (free of credentials)
	Staged    map[string]json.RawMessage
}

// Unit is an ordered list of steps that depend on shared state (cookies, tokens) and so
// must run on one session. A run that loses its session is replayed from the first step
// on another session (with RunConfig.Pool a warm one when one is idle, else a new one); the observation of a successful run comes from one session only. After
// a cut (a dropped connection) a safe step first runs again on the same session, and the
// unit continues there when the exit is proven unchanged or its state is portable (see
// resume.go); so a step may run more than once on its collector: a callback it registers
// on sc.Collector() must tolerate that (register once, or be idempotent).
type Unit struct {
	Name  string
	Steps []Step
	// PortableState declares that what the steps build up — cookies, tokens, staged
	// values — stays valid on another exit (the site does not bind it to the client's
	// address). After a cut such a unit runs the cut step again on its session without
	// proof that the exit is unchanged, instead of replaying from the first step. Leave it
	// false for a site that binds state to the exit: the unit then continues only on a
	// proven exit (Provider.WithExitHeader). Defaults to false.
	PortableState bool
	// Validate checks the complete staging before it is handed on. A failure is
	// quarantined and returned as category validation. Optional.
	Validate func(staged map[string]json.RawMessage) error
	// Site is the destination host the unit works on ("shop.example"; a port is ignored).
	// With RunConfig.Pool, the unit runs on a warm session of this site when the pool has
	// one, and hands a session that served it well back (pool.go). Empty: the unit always
	// opens a new session, as without a pool.
	Site string
}

// Unit run defaults.
const DefaultMaxSessionRestarts = 2

// RunConfig configures one run of a unit (one attempt of a job).
type RunConfig struct {
	// Provider issues the sessions. Required.
	Provider *Provider
	// Country requested for the exit ("" = any).
	Country string
	// SessionLifetime asked of the provider. Defaults to DefaultSessionLifetime.
	SessionLifetime time.Duration
	// MaxSessionRestarts is how many replays (each on another session: with a Pool a warm
	// one when one is idle, else a new one) one run may start after session loss.
	// Defaults to DefaultMaxSessionRestarts; -1 means none.
	MaxSessionRestarts int
	// MaxResumes is how many times one run may run a step again on its own session, after
	// a cut or a waited-out Retry-After, instead of replaying (resume.go). Defaults to
	// DefaultMaxResumes; -1 means none: every cut replays on another session.
	MaxResumes int
	// ThrottleResumeMax is the longest Retry-After (on a 429/503 the collector did not wait
	// out itself) that a safe step waits out on its session before running again, when the
	// session outlives the wait. Defaults to DefaultThrottleResumeMax; negative turns it
	// off (the attempt ends throttled, as before), and so does a negative
	// Collector.ThrottleWaitMax (no waiting on the session at all).
	ThrottleResumeMax time.Duration
	// MaxBytes is the run's bandwidth budget: once the bytes of all its sessions (counted
	// as Result.Bytes counts them) exceed it, the response being read is aborted and the
	// run stops with category budget_exceeded, without replay. Defaults to 0: unlimited.
	MaxBytes int64
	// BudgetNote names what MaxBytes stands for in the budget_exceeded error when it is not
	// the bandwidth budget itself, e.g. "the job's money budget: 2560 micro-units at
	// 10 USD/GB". Optional.
	BudgetNote string
	// MoreBytes, when set, is asked for a higher cap when the run's bytes pass MaxBytes (or
	// the cap it last returned) — a read one byte past it, or the read of an answer to a
	// request that was written past it — before the run fails with ErrBudgetExceeded: e.g.
	// a top-up of a money reservation. moved is what the run's sessions moved so far; it
	// returns the new cap, which must be above moved to go on (at most moved: stop, and
	// it is not asked again), and, unless "", what the cap now stands for (BudgetNote's
	// successor). Calls are serialised per run and end when Run returns; it is called from
	// the goroutine reading a connection (a fetch's or a render's), so it should
	// be quick. Optional.
	MoreBytes func(ctx context.Context, moved int64) (newMax int64, note string)
	// Profiles, when set, gives every session the run opens a client identity picked from
	// these options (sessions/profile): the same User-Agent, Accept, Accept-Language and
	// client hints on every colly request and rendered page of the session, for its whole
	// life — every unit it serves on a pool. nil: no profile (CollectorConfig.UserAgent).
	// For kinds that render, prefer ChromiumOnly: Chromium can not pass for Firefox.
	Profiles *profile.Options
	// Pool, when set, keeps sessions warm between units of the same Unit.Site (pool.go):
	// each session the run starts on — the first, and each replay's — is a warm one when
	// the pool has one idle, and every session the run opens is the pool's. A successful run hands its session to the caller as
	// Result.Lease, to Keep or Retire; a failed run retires it. Defaults to nil: a new
	// session per run, closed at its end.
	Pool *Pool
	// PoolScope names who may share pooled sessions: runs of another scope never take
	// each other's (handlers sets the kind's name, so two kinds of one site do not share
	// logins or cookies). "" is a scope too.
	PoolScope string
	// PoolCookies names the cookies that survive from one unit to the next on a warm
	// session; the others are dropped when the session is handed back. nil: every cookie
	// survives; empty (non-nil): none does.
	PoolCookies []string
	// Collector configures each session's collector.
	Collector CollectorConfig
	// Quarantine receives the staging of every run that did not finish. Required: the
	// runner writes it to the quarantine table.
	Quarantine func(ctx context.Context, q Quarantined) error
	// Now is the clock for session lifetimes. Defaults to time.Now.
	Now func() time.Time
	// Logger for session restarts. Defaults to slog.Default().
	Logger *slog.Logger
}

// Result is what a unit's run did. Run fills it on error too, except Staged: Session,
// Sessions, Restarts, Bytes and LastStatus are the evidence of a failed attempt.
type Result struct {
	Staged map[string]json.RawMessage // everything staged, all from Session (success only)
	// Session is the last session the run used: on success the one the observation came
	// from. nil only if no session could be started.
	Session  *Session
	Sessions []string // ids of every session this run used, in order
	Restarts int      // sessions restarted after loss
	// RestartReasons holds the category of each session loss that caused a restart.
	RestartReasons []tasks.Category
	// Resumes counts the steps run again on their own session (after a cut or a
	// Retry-After) instead of a replay; ResumeReasons holds why, one of the Resume*
	// constants each. A resume whose proof then failed is followed by a restart.
	Resumes       int
	ResumeReasons []string
	Bytes         int64 // bytes moved through the proxy for the job, all sessions (Bound.Bytes)
	// RefusedBytes are the bytes of the proxy's own refusals (407, 502 no peers, …), all
	// sessions: on the wire, but not billed by providers, so not in Bytes nor in the
	// attempt's cost (Bound.RefusedBytes).
	RefusedBytes int64
	// RobotsBytes are the bytes of the robots.txt fetches the run made for the fleet's
	// cache, all sessions: not the job's, not in Bytes nor in its cost (Bound.RobotsBytes).
	RobotsBytes int64
	// Resent counts requests sent again on their session after a short Retry-After
	// (CollectorConfig.ThrottleWaitMax), all sessions.
	Resent int64
	// LastStatus is the HTTP status of the last response the run received — the
	// destination's, or the proxy's own refusal (407, 502, …) — 0 if none arrived.
	LastStatus int
	// Exit is the exit address of the last session, as its responses named it in the
	// provider's exit header; "" when the provider names none (or no response came).
	Exit string
	// ExitVerified: every response of the last session was checked against its first
	// one's exit (the provider has an exit header). False means "exit not verified": a
	// silent re-assignment of the exit would have gone unnoticed.
	ExitVerified bool
	// Warm: the unit started on a session from RunConfig.Pool, warm from earlier units.
	// A replay after a session was lost runs on another warm session of the pool when
	// one is idle, else on a new one; Session is then that one. SessionUnits is how many
	// units Session — the last session, the one Result's evidence is about — had served
	// before this unit: 0 for a new one.
	Warm         bool
	SessionUnits int
	// Lease is the run's hold on its pooled session after a success (RunConfig.Pool): call
	// Keep once the session is known to be still welcome, or Retire. nil without a pool
	// and after a failure (the session was retired then).
	Lease *PoolLease
}

// ExitEvidence is a short text for an attempt's evidence: "exit 203.0.113.7 (verified)",
// or "exit not verified (provider has no exit header)".
func (r Result) ExitEvidence() string {
	switch {
	case !r.ExitVerified:
		return "exit not verified (provider has no exit header)"
	case r.Exit == "":
		return "exit not verified (no response named it)"
	}
	return "exit " + r.Exit + " (verified)"
}

// ErrSessionExpired: the session reached its lifetime before the unit finished.
var ErrSessionExpired = errors.New("sessions: session past its lifetime")

// quarantineFailed keeps the failure's category and says that its staging could not be
// kept either: the run stops (it would otherwise replay without its evidence).
func quarantineFailed(fe *FetchError, qerr error) *FetchError {
	return &FetchError{Category: fe.Category, Status: fe.Status, RetryAfter: fe.RetryAfter, Step: fe.Step,
		Err: fmt.Errorf("%v; and its staging could not be quarantined: %w", fe.Err, qerr)}
}

// replayable categories end a session but not the attempt: the unit restarts on another.
func replayable(c tasks.Category) bool {
	switch c {
	case tasks.CategorySessionLost, tasks.CategoryExitUnavailable, tasks.CategoryTimeout:
		return true
	}
	return false
}

// Run runs the unit: on a new session (or a warm one of RunConfig.Pool), every step in
// order, then validation. On session loss it quarantines the staging, takes another
// session (a warm one of the pool when one is idle, else a new one; never the lost one)
// and replays from the first step,
// up to MaxSessionRestarts times. Before that, a safe step cut (a dropped connection) or
// answered with a Retry-After runs again on the same session, up to MaxResumes times per
// run, and the unit continues there when the exit is proven unchanged (or its state is
// portable; resume.go). If an unsafe step ran in a run that then failed, it does not
// replay: the error has category unsafe_step_incomplete. A cancelled ctx ends the run
// with category interrupted (wrapping context.Cause), a passed deadline with timeout;
// neither replays. The returned error is a *FetchError; on error Result still carries
// Session, Sessions, Bytes (every session's) and LastStatus.
func (u *Unit) Run(ctx context.Context, cfg RunConfig) (Result, error) {
	if cfg.Provider == nil || cfg.Quarantine == nil {
		return Result{}, errors.New("sessions: RunConfig needs Provider and Quarantine")
	}
	if len(u.Steps) == 0 {
		return Result{}, fmt.Errorf("sessions: unit %q has no steps", u.Name)
	}
	now := cfg.Now
	if now == nil {
		now = time.Now
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	maxRestarts := cfg.MaxSessionRestarts
	switch {
	case maxRestarts == 0:
		maxRestarts = DefaultMaxSessionRestarts
	case maxRestarts < 0:
		maxRestarts = 0
	}
	collectorCfg := cfg.Collector
	if collectorCfg.Now == nil {
		collectorCfg.Now = now
	}
	rs := &resumer{max: cfg.MaxResumes, throttleMax: cfg.ThrottleResumeMax, portable: u.PortableState, now: now, cuts: cfg.Provider.cuts}
	switch {
	case rs.max == 0:
		rs.max = DefaultMaxResumes
	case rs.max < 0:
		rs.max = 0
	}
	switch {
	case collectorCfg.ThrottleWaitMax < 0:
		rs.throttleMax = -1 // no waiting on the session at all
	case rs.throttleMax == 0:
		rs.throttleMax = DefaultThrottleResumeMax
	}

	var res Result
	if cfg.MaxBytes > 0 {
		// One cap for every session of the run: a new session goes on from what the
		// earlier ones moved, and a raise (MoreBytes) holds for all of them.
		collectorCfg.run, collectorCfg.budgetSet = runOwner(ctx, cfg.MaxBytes, cfg.BudgetNote, cfg.MoreBytes), true
		defer collectorCfg.run.cap.end()
	}
	// With a pool, each session the run starts on (the first, and each replay's) is a warm
	// one of the unit's site when one is idle — never the session just lost, which is
	// retired — and each session it opens is the pool's: handed to the caller after a
	// success (Result.Lease), retired after anything else.
	var (
		pooled = cfg.Pool != nil && u.Site != ""
		key    PoolKey
		ps     *pooledSession
	)
	if pooled {
		key = PoolKey{Provider: cfg.Provider.Name(), Tier: string(cfg.Provider.Tier()), Country: toUpper(cfg.Country),
			Host: siteHost(u.Site), Client: clientKey(cfg.PoolScope, cfg.Profiles, cfg.PoolCookies, cfg.SessionLifetime)}
		defer func() {
			if ps != nil {
				cfg.Pool.giveBack(ps, false, PoolRetireFailed, now()) // an early return
			}
		}()
	}
	for {
		var sess *Session
		if pooled {
			ps = cfg.Pool.take(key, now())
		}
		if ps != nil {
			sess = ps.sess
			res.Warm = res.Warm || res.Restarts == 0 // the unit started warm
		} else {
			var err error
			if sess, err = cfg.Provider.NewSession(cfg.Country, cfg.SessionLifetime, now()); err != nil {
				return res, &FetchError{Category: tasks.CategoryInternal, Err: err}
			}
			if cfg.Profiles != nil {
				p, err := profile.Pick(nil, *cfg.Profiles)
				if err != nil {
					return res, &FetchError{Category: tasks.CategoryInternal, Err: fmt.Errorf("sessions: RunConfig.Profiles: %w", err)}
				}
				sess.Profile = &p
			}
			if pooled {
				ps = cfg.Pool.fresh(key, sess)
			}
		}
		res.Sessions = append(res.Sessions, sess.ID)
		res.Session, res.SessionUnits = sess, 0
		if ps != nil {
			res.SessionUnits = ps.units // 0 for a session this run opened
		}
		runCfg := collectorCfg
		if ps != nil {
			runCfg.jar, runCfg.knownExit = ps.jar, ps.exit
		}
		sctx, span := startSpan(ctx, "session")
		bytesBefore := res.Bytes
		staged, failure, unsafeRan := u.runOnce(sctx, sess, &runCfg, now, &res, rs, log)
		if span.IsRecording() {
			span.SetAttributes(attribute.String("idemscrape.session", sess.ID), attribute.String("idemscrape.unit", u.Name),
				attribute.Int64("idemscrape.bytes", res.Bytes-bytesBefore), attribute.String("idemscrape.exit", res.Exit),
				attribute.Bool("idemscrape.session.warm", ps != nil && ps.units > 0))
			endSpan(span, failure)
		}
		if ps != nil && res.Exit != "" {
			ps.exit = res.Exit
		}
		if failure == nil {
			if u.Validate != nil {
				if err := u.Validate(staged); err != nil {
					fe := &FetchError{Category: tasks.CategoryValidation, Err: scrub(err)}
					if qerr := cfg.Quarantine(ctx, Quarantined{SessionID: sess.ID, Reason: fe.Category, Detail: fe.Error(), Staged: staged}); qerr != nil {
						return res, quarantineFailed(fe, qerr)
					}
					return res, fe
				}
			}
			res.Staged = staged
			if ps != nil {
				ps.jar = keptCookies(ps.jar, u.Site, cfg.PoolCookies)
				res.Lease = &PoolLease{pool: cfg.Pool, ps: ps, now: now}
				ps = nil
			}
			return res, nil
		}
		if ps != nil {
			// A session whose unit failed is never handed out again.
			cfg.Pool.giveBack(ps, false, retireReason(failure), now())
			ps = nil
		}
		if len(staged) > 0 || replayable(failure.Category) {
			q := Quarantined{SessionID: sess.ID, Step: failure.Step, Reason: failure.Category, Detail: failure.Error(), Staged: staged}
			if err := cfg.Quarantine(ctx, q); err != nil {
				return res, quarantineFailed(failure, err)
			}
		}
		switch {
		case unsafeRan:
			return res, &FetchError{Category: tasks.CategoryUnsafeStepIncomplete, Step: failure.Step, Status: failure.Status, Err: failure}
		case !replayable(failure.Category) || ctx.Err() != nil:
			return res, failure
		case res.Restarts >= maxRestarts:
			return res, failure
		}
		res.Restarts++
		res.RestartReasons = append(res.RestartReasons, failure.Category)
		log.InfoContext(ctx, "session lost, replaying unit on another session",
			"unit", u.Name, "step", failure.Step, "category", string(failure.Category),
			"old_session", sess.ID, "endpoint", sess.Endpoint, "restart", res.Restarts, "warm", res.Warm)
	}
}

// runStep runs one step; a panic becomes an error of category panic, so that the unit's
// rules (quarantine, never replay after an unsafe step) still apply to it.
func runStep(ctx context.Context, step Step, sc *StepContext) (err error) {
	defer func() {
		if rec := recover(); rec != nil {
			err = &FetchError{Category: tasks.CategoryPanic, Err: fmt.Errorf("panic in step %s: %v", step.Name, rec)}
		}
	}()
	return step.Run(ctx, sc)
}

// runOnce runs every step on one session, a safe step again on it after a cut or a
// Retry-After when rs allows (resume.go). It returns the staging, the failure (nil on
// success) and whether an unsafe step started.
func (u *Unit) runOnce(ctx context.Context, sess *Session, cfg *CollectorConfig, now func() time.Time, res *Result,
	rs *resumer, log *slog.Logger) (map[string]json.RawMessage, *FetchError, bool) {
	bound, err := NewCollector(ctx, sess, cfg)
	if err != nil {
		return nil, &FetchError{Category: tasks.CategoryInternal, Err: err}, false
	}
	defer func() {
		// Closed first: closing the session's tunnels moves bytes too (TLS close_notify).
		bound.Close()
		res.Bytes += bound.Bytes()
		res.RefusedBytes += bound.RefusedBytes()
		res.RobotsBytes += bound.RobotsBytes()
		res.Resent += bound.Resent()
		if st := bound.LastStatus(); st != 0 {
			res.LastStatus = st
		}
		res.Exit, res.ExitVerified = bound.Exit(), bound.ExitVerified()
	}()
	staging := newStaging()
	sc := &StepContext{Session: sess, Staging: staging, bound: bound}
	unsafeRan := false
	var probe *cutProbe // the step being run again after a cut, until its outcome is known
	for i := 0; i < len(u.Steps); i++ {
		step := u.Steps[i]
		if sess.Expired(now()) {
			return staging.Snapshot(), &FetchError{Category: tasks.CategorySessionLost, Step: step.Name, Err: ErrSessionExpired}, unsafeRan
		}
		if fe := contextFailure(ctx); fe != nil {
			fe.Step = step.Name
			return staging.Snapshot(), fe, unsafeRan
		}
		if bound.overBudget() {
			return staging.Snapshot(), &FetchError{Category: tasks.CategoryBudgetExceeded, Step: step.Name, Err: bound.budgetError()}, unsafeRan
		}
		// An unsafe step counts as run from the moment it starts: a failure inside it may
		// already have had its effect.
		unsafeRan = unsafeRan || !step.Safe
		stepCtx, span := ctx, trace.SpanFromContext(ctx)
		if span.IsRecording() {
			stepCtx, span = startSpan(ctx, "step "+step.Name)
		}
		bound.stepCtx = stepCtx
		before := bound.Bytes()
		err := runStep(stepCtx, step, sc)
		probe = probe.settle(err, bound, rs.cuts)
		if span.IsRecording() && stepCtx != ctx {
			span.SetAttributes(attribute.String("idemscrape.step", step.Name), attribute.String("idemscrape.session", sess.ID),
				attribute.Bool("idemscrape.step.safe", step.Safe),
				attribute.Int64("idemscrape.bytes", bound.Bytes()-before)) // statuses are on its fetches
			if err != nil {
				endSpan(span, classify(err, bound.served.Load()))
			} else {
				span.End()
			}
		}
		if err != nil {
			fe := classify(err, bound.served.Load())
			if cf := contextFailure(ctx); cf != nil && fe.Status == 0 && transportCategory(fe.Category) {
				// The attempt's context ended while the step ran: whatever the transport
				// made of it (a reset, an EOF, "context canceled"), that is the reason.
				fe = cf
			}
			fe = &FetchError{Category: fe.Category, Status: fe.Status, RetryAfter: fe.RetryAfter, Step: step.Name, Err: fe.Err}
			if fe.Category == tasks.CategoryBlocked && fe.Status == http.StatusForbidden && !bound.ExitVerified() && sess.Expired(now()) {
				// The provider may have moved the session to another exit when its sticky
				// lifetime ended, and nothing can tell: the block is the new exit's (its
				// cookies and tokens belong to the old one), so the unit replays on a new
				// session at once instead of waiting out a block.
				fe = &FetchError{Category: tasks.CategorySessionLost, Status: fe.Status, Step: step.Name,
					Err: fmt.Errorf("%w: answered %d after it (exit not verifiable, so possibly another exit's answer)", ErrSessionExpired, fe.Status)}
			}
			reason, wait := rs.decide(ctx, step, fe, bound, before)
			if reason == "" {
				return staging.Snapshot(), fe, unsafeRan
			}
			if wait > 0 && !sleepCtx(ctx, wait) {
				return staging.Snapshot(), fe, unsafeRan
			}
			rs.max--
			res.Resumes++
			res.ResumeReasons = append(res.ResumeReasons, reason)
			if reason != ResumeThrottled {
				bound.afterCut(reason == ResumeExitHeader)
				probe = newCutProbe(bound)
			}
			log.InfoContext(ctx, "running the step again on its session", "unit", u.Name, "step", step.Name,
				"reason", reason, "category", string(fe.Category), "session", sess.ID, "endpoint", sess.Endpoint)
			i-- // the same step, on the same session
			continue
		}
	}
	return staging.Snapshot(), nil, unsafeRan
}

// contextFailure classifies an ended ctx: a cancellation (lease lost, shutdown) is
// interrupted and wraps context.Cause, so the error says why; a passed deadline is
// timeout. nil while ctx is live.
func contextFailure(ctx context.Context) *FetchError {
	err := ctx.Err()
	switch {
	case err == nil:
		return nil
	case errors.Is(err, context.DeadlineExceeded):
		return &FetchError{Category: tasks.CategoryTimeout, Err: scrub(context.Cause(ctx))}
	}
	return &FetchError{Category: tasks.CategoryInterrupted, Err: context.Cause(ctx)}
}

// transportCategory reports whether c is what a transport makes of a connection torn
// down under it, which an ended context explains better.
func transportCategory(c tasks.Category) bool {
	switch c {
	case tasks.CategoryInternal, tasks.CategoryTimeout, tasks.CategorySessionLost, tasks.CategoryNetwork,
		tasks.CategoryExitUnavailable, tasks.CategoryInterrupted:
		return true
	}
	return false
}
