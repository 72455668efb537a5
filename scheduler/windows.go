package scheduler

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/idemscrape/idemscrape/internal/retry"
	"github.com/idemscrape/idemscrape/store"
)

// WindowRecorder records the scheduler's windows (store.PG): a window's row is written
// before its specs are enqueued and marked enqueued after, so that a due window that was
// never enqueued can be found and filled. Tries it could not record (PostgreSQL did not
// answer) are kept in memory and written with WindowTriesLost once it answers again.
type WindowRecorder interface {
	WindowBegin(ctx context.Context, p store.WindowParams) error
	WindowEnqueued(ctx context.Context, template, window string, specs, enqueued int) error
	WindowFailed(ctx context.Context, template, window string, cause error) error
	WindowTriesLost(ctx context.Context, p store.WindowParams, tries int, lastErr string) error
	WindowsFirstDue(ctx context.Context) (map[string]time.Time, error)
	WindowsEnqueued(ctx context.Context, template string, windows []string) (map[string]bool, error)
}

var _ WindowRecorder = (*store.PG)(nil)

// maxGapScan bounds the scheduled fires one template's gap search checks (it walks them
// all and keeps the latest maxGapScan; a secondly template has 86,400 a day).
const maxGapScan = 100_000

// pendingTry is a window whose tick failed, waiting for its next try.
type pendingTry struct {
	f       fire
	try     int       // the try it will be
	at      time.Time // when
	until   time.Time // its retry deadline
	catchUp bool
}

// tryWindow runs try p.try of p.f's window. A failed try is tried again with backoff (at
// most at the deadline: the last try is at the deadline itself), and given up only once a
// try at or after the deadline failed: then the window is a gap, counted and logged once.
// It returns the next try, or nil when the window is done (or the scheduler is stopping).
func (s *Scheduler) tryWindow(ctx context.Context, t *Template, p pendingTry) *pendingTry {
	rep := s.tickFire(ctx, t, p.f)
	rep.CatchUp, rep.Try = p.catchUp, p.try
	if ctx.Err() != nil && rep.Err != nil {
		return nil // stopping: the next start's catch-up (or a fill) completes the window
	}
	if p.try > 1 {
		result := "ok"
		if rep.Err != nil {
			result = "error"
		}
		s.metrics.retries.WithLabelValues(t.Name, result).Inc()
	}
	now := s.cfg.Now()
	if errors.Is(rep.Err, store.ErrWindowExpired) {
		// Not a failure to retry: ticking it again would create its jobs again. Every fire
		// of the window is refused the same way: one warning per window.
		if s.refused.first(t.Name, rep.Window) {
			s.cfg.Logger.WarnContext(ctx, "window not ticked: older than its retention, its jobs may have been pruned (idemscrape windows -fill -force creates them anew); its later fires are refused silently",
				"template", t.Name, "window", rep.Window, "due", p.f.At, "err", rep.Err)
		}
		s.signal(ctx, rep)
		return nil
	}
	if rep.Err != nil && !now.Before(p.until) {
		rep.GaveUp = true
		s.metrics.retries.WithLabelValues(t.Name, "given_up").Inc()
		s.cfg.Logger.ErrorContext(ctx, "window given up: a gap until filled (idemscrape windows -fill)",
			"template", t.Name, "window", rep.Window, "due", p.f.At, "tries", p.try, "err", rep.Err)
	}
	s.signal(ctx, rep)
	if rep.Err == nil || rep.GaveUp {
		s.refreshGaps(ctx)
		return nil
	}
	next := p
	next.try++
	next.at = now.Add(s.backoff(p.try))
	if next.at.After(p.until) {
		next.at = p.until
	}
	s.cfg.Logger.WarnContext(ctx, "tick failed; trying again", "template", t.Name, "window", rep.Window, "try", p.try, "at", next.at)
	return &next
}

// deadline is when a window due at stops being retried: RetryUntil after it, or the
// template's next scheduled instant.
func (s *Scheduler) deadline(t *Template, at time.Time) time.Time {
	if t.RetryUntil > 0 {
		return at.Add(t.RetryUntil)
	}
	if next := t.sched.nextFire(at, nil); !next.IsZero() {
		return next.At
	}
	return at.Add(24 * time.Hour)
}

// backoff is the wait before try+1: doubling from RetryMin, at most RetryMax, full
// jitter over its upper half (never less than half, so retries do not bunch up at zero).
func (s *Scheduler) backoff(try int) time.Duration {
	return retry.Equal(s.cfg.RetryMin, s.cfg.RetryMax, try)
}

// Gap is a due window that was never enqueued and is no longer being retried.
type Gap struct {
	Template string    `json:"template"`
	Kind     string    `json:"kind"`
	Window   string    `json:"window"`
	Due      time.Time `json:"due"`
}

// Gaps returns every gap of every template: the windows of the scheduled fires from the
// template's first recorded window up to now (at most the latest maxGapScan fires), whose
// latest fire is past its retry deadline, not recorded enqueued. Each window is listed
// once, due at its latest fire. A template that never recorded a window has none.
func (s *Scheduler) Gaps(ctx context.Context) ([]Gap, error) {
	first, err := s.cfg.Windows.WindowsFirstDue(ctx)
	if err != nil {
		return nil, err
	}
	now := s.cfg.Now()
	var out []Gap
	for i := range s.cfg.File.Templates {
		t := &s.cfg.File.Templates[i]
		from, ok := first[t.Name]
		if !ok {
			continue
		}
		var fires []fire
		for f := t.sched.nextFire(from.Add(-time.Nanosecond), nil); !f.IsZero() && !f.At.After(now); f = t.sched.nextFire(f.At, &f) {
			fires = append(fires, f)
			if len(fires) > maxGapScan {
				fires = fires[1:]
			}
		}
		latest := map[string]int{} // window → index of its latest fire
		var wins []string
		for j, f := range fires {
			if _, seen := latest[f.Window]; !seen {
				wins = append(wins, f.Window)
			}
			latest[f.Window] = j
		}
		if len(wins) == 0 {
			continue
		}
		done, err := s.cfg.Windows.WindowsEnqueued(ctx, t.Name, wins)
		if err != nil {
			return nil, err
		}
		for j, f := range fires {
			if latest[f.Window] != j || done[f.Window] || s.deadline(t, f.At).After(now) {
				continue
			}
			out = append(out, Gap{Template: t.Name, Kind: t.Kind, Window: f.Window, Due: f.At})
		}
	}
	return out, nil
}

// refreshGaps sets idemscrape_scheduler_window_gaps from Gaps (logged, not fatal, when
// PostgreSQL can not say).
func (s *Scheduler) refreshGaps(ctx context.Context) {
	qctx, cancel := context.WithTimeout(ctx, s.cfg.QueryTimeout)
	defer cancel()
	s.flushLost(qctx) // a window given up while PostgreSQL was down gets its tries now
	gaps, err := s.Gaps(qctx)
	if err != nil {
		if ctx.Err() == nil {
			s.cfg.Logger.WarnContext(ctx, "could not count window gaps", "err", err)
		}
		return
	}
	n := map[string]int{}
	for _, g := range gaps {
		n[g.Template]++
	}
	for i := range s.cfg.File.Templates {
		name := s.cfg.File.Templates[i].Name
		s.metrics.gaps.WithLabelValues(name).Set(float64(n[name]))
	}
}

// ErrNoSuchWindow: the template has no scheduled fire at or before now whose window is
// the one asked for.
var ErrNoSuchWindow = errors.New("scheduler: no such window")

// Fill ticks the template's window now, whatever its state: jobs that exist are found,
// not enqueued again, so a fill of an enqueued window, or two fills (or a fill and a
// scheduler) at once, produce each job once. The window must have been due: its latest
// fire at or before now is computed from the window (not searched for by walking the
// schedule, so a template firing every second fills as fast as a daily one). A window
// whose jobs may have been pruned (first ticked longer ago than job_retention, or due
// longer ago than window_retention without a record) is refused (store.ErrWindowExpired):
// ForceFill ticks it anyway.
func (s *Scheduler) Fill(ctx context.Context, template, window string) (TickReport, error) {
	return s.fill(ctx, template, window, false)
}

// ForceFill is Fill that also ticks a window whose jobs may have been pruned: the jobs
// that no longer exist are created again as new jobs, fetched, committed and published
// again under the same event keys (consumers' inboxes may no longer know them).
func (s *Scheduler) ForceFill(ctx context.Context, template, window string) (TickReport, error) {
	return s.fill(ctx, template, window, true)
}

func (s *Scheduler) fill(ctx context.Context, template, window string, force bool) (TickReport, error) {
	t := s.template(template)
	if t == nil {
		return TickReport{}, fmt.Errorf("scheduler: no template %q in the configuration", template)
	}
	now := s.cfg.Now()
	f, ok := t.sched.fireOfWindow(window, now)
	if !ok {
		return TickReport{}, fmt.Errorf("%w: template %q has no due window %q (windows look like %q)", ErrNoSuchWindow, template, window, exampleWindow(t, now))
	}
	f.force = force
	rep := s.tickFire(ctx, t, f)
	if errors.Is(rep.Err, store.ErrWindowExpired) {
		rep.Err = fmt.Errorf("%w; refused: a fill would create its pruned jobs again as new jobs, fetched, committed and published again under the same event keys, which consumers' inboxes may no longer recognise (fill with -force to do that on purpose)", rep.Err)
	}
	if rep.Err == nil {
		s.refreshGaps(ctx)
	}
	return rep, rep.Err
}

func exampleWindow(t *Template, now time.Time) string {
	return t.sched.lastFire(now).Window
}

// lostTries are the tries of one window the scheduler could not record while PostgreSQL
// did not answer.
type lostTries struct {
	p       store.WindowParams
	tries   int    // tries WindowBegin could not record
	lastErr string // the last try's error, if WindowFailed could not record it
}

// keepLost remembers tries more tries of p's window (and cause as its last error) that
// PostgreSQL could not record. One entry per window: memory is bounded by the windows due
// during an outage.
func (s *Scheduler) keepLost(p store.WindowParams, tries int, cause error) {
	s.lostMu.Lock()
	defer s.lostMu.Unlock()
	k := [2]string{p.Template, p.Window}
	l := s.lost[k]
	if l == nil {
		l = &lostTries{p: p}
		s.lost[k] = l
	}
	l.tries += tries
	if cause != nil {
		l.lastErr = cause.Error()
	}
}

// flushLost writes the tries kept in memory (keepLost). What PostgreSQL still refuses is
// kept for the next call (every tick and gap count makes one).
func (s *Scheduler) flushLost(ctx context.Context) {
	s.lostMu.Lock()
	var todo []*lostTries
	for k, l := range s.lost {
		todo = append(todo, l)
		delete(s.lost, k)
	}
	s.lostMu.Unlock()
	for i, l := range todo {
		if err := s.cfg.Windows.WindowTriesLost(ctx, l.p, l.tries, l.lastErr); err != nil {
			for _, back := range todo[i:] {
				s.keepLost(back.p, back.tries, nil)
				if back.lastErr != "" {
					s.keepLost(back.p, 0, errors.New(back.lastErr))
				}
			}
			return
		}
	}
}

// maxRefusedWindows bounds the windows refusedWindows remembers; past it the oldest is
// forgotten (a window refused again after that is warned about again).
const maxRefusedWindows = 1024

// refusedWindows remembers, in the order first seen, the (template, window) pairs whose
// tick was refused for retention and warned about. Safe for concurrent use (one loop per
// template).
type refusedWindows struct {
	mu    sync.Mutex
	seen  map[[2]string]bool
	order [][2]string
}

// first reports whether the window is refused for the first time (remembering it).
func (w *refusedWindows) first(template, window string) bool {
	k := [2]string{template, window}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.seen[k] {
		return false
	}
	if w.seen == nil {
		w.seen = map[[2]string]bool{}
	}
	if len(w.order) >= maxRefusedWindows {
		delete(w.seen, w.order[0])
		w.order = w.order[1:]
	}
	w.seen[k] = true
	w.order = append(w.order, k)
	return true
}
