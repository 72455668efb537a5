package sessions

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/idemscrape/idemscrape/tasks"
)

// Resuming a unit on its own session.
//
// A cut (the connection to the gateway dropped mid-response) often leaves the residential
// exit alive under the same sticky session id. Replaying the unit from its first step on a
// new session then re-fetches everything the earlier steps fetched; so after a cut the unit
// first runs the cut step again on the same session, and continues only when it can show
// that nothing of the session's state moved to another exit:
//
//   - the provider names the exit on every response (Provider.WithExitHeader), the session
//     learned it before the cut, and the first response after the cut names the same exit
//     (proveExit); a response from another exit, or one that names none, ends the session
//     as session_lost and the unit replays on another session, as before; or
//   - the unit declares its state portable across exits (Unit.PortableState): the step runs
//     again on the session, whatever exit now serves it.
//
// Otherwise (no exit signal, the cut came before any response named the exit) the unit
// replays as before. Only a safe step is run again: a cut during an unsafe step leaves its
// effect unknown, so that run ends as unsafe_step_incomplete, as before. An unsafe step
// that completed before the cut is not sent again by a resume, so a cut after it no longer
// ends the run when the resume proves the exit.
//
// A safe step answered 429/503 with a Retry-After the collector did not wait out itself
// (longer than CollectorConfig.ThrottleWaitMax, or after its ThrottleRetries) runs again on
// the same session once the wait has passed, when the wait is at most
// RunConfig.ThrottleResumeMax and the session outlives it (and the attempt's deadline
// allows it), instead of ending the attempt as throttled.

// Resume defaults.
const (
	// DefaultMaxResumes is how many times one run may run a step again on its session.
	DefaultMaxResumes = 3
	// DefaultThrottleResumeMax is the longest Retry-After a unit waits out on its session.
	DefaultThrottleResumeMax = 10 * time.Second
)

// Reasons a step ran again on its session (Result.ResumeReasons, and the reason label of
// idemscrape_session_resumes_total).
const (
	// ResumeExitHeader: after a cut, with the exit header to prove the exit unchanged on the
	// first response after it (a resume whose proof fails is followed by a restart).
	ResumeExitHeader = "exit_header"
	// ResumePortable: after a cut, in a unit whose state is portable across exits.
	ResumePortable = "portable_state"
	// ResumeThrottled: after a 429/503 Retry-After waited out on the session.
	ResumeThrottled = "throttled"
)

// ErrExitUnproven: after a cut, the first response on the session did not name its exit,
// so the step cannot show that it still runs on the exit the session's state belongs to.
// Category session_lost: the unit replays on another session.
var ErrExitUnproven = errors.New("sessions: after a cut, the session's exit could not be proven unchanged")

// proveExit checks the first response after a cut against the exit the session had before
// it; b.exitMu is held.
func (b *Bound) proveExit(got string) error {
	b.proving = false
	switch got {
	case b.exit:
		return nil
	case "":
		return &FetchError{Category: tasks.CategorySessionLost,
			Err: fmt.Errorf("%w: no %s on the response", ErrExitUnproven, b.Session.exitHeader)}
	}
	return &FetchError{Category: tasks.CategorySessionLost,
		Err: fmt.Errorf("%w: before the cut exit %s, after it %s (%s)", ErrExitChanged, b.exit, got, b.Session.exitHeader)}
}

// exitKnown reports whether a response of the session named its exit.
func (b *Bound) exitKnown() bool {
	b.exitMu.Lock()
	defer b.exitMu.Unlock()
	return b.Session.exitHeader != "" && b.exit != ""
}

// afterCut prepares the collector for running a step again after a cut: with prove, the
// next response must name the exit the session had; without (portable state), the next
// response's exit becomes the session's.
func (b *Bound) afterCut(prove bool) {
	b.exitMu.Lock()
	defer b.exitMu.Unlock()
	if prove {
		b.proving = true
		return
	}
	b.exit = ""
}

// isCut reports whether fe is a dropped connection: the transport's EOF or reset, with no
// answer from the proxy. A proxy's own "session gone" (502), a changed or unproven exit and
// an expired session are not cuts: the exit is known to be gone.
func isCut(fe *FetchError) bool {
	return fe.Category == tasks.CategorySessionLost && fe.Status == 0 &&
		!errors.Is(fe, ErrExitChanged) && !errors.Is(fe, ErrExitUnproven) && !errors.Is(fe, ErrSessionExpired)
}

// resumer decides, for one run of a unit, whether a failed step runs again on its session.
type resumer struct {
	max         int           // resumes left in the run (shared by every session of it)
	throttleMax time.Duration // RunConfig.ThrottleResumeMax; <= 0: never waits
	portable    bool          // Unit.PortableState
	now         func() time.Time
	cuts        *cutStats // the provider's (nil: no learning, always try)
}

// decide returns the reason to run step again on the session after fe, "" to end this
// session's run as before; wait is how long to wait first (a throttle's Retry-After).
// saved is what the session moved for the job before the step began: what a replay would
// fetch again.
func (r *resumer) decide(ctx context.Context, step Step, fe *FetchError, b *Bound, saved int64) (reason string, wait time.Duration) {
	if r.max <= 0 || !step.Safe || ctx.Err() != nil || b.overBudget() {
		return "", 0
	}
	switch {
	case isCut(fe):
		switch {
		case b.exitKnown():
			reason = ResumeExitHeader
		case r.portable:
			reason = ResumePortable
		default:
			return "", 0 // nothing could prove the exit, nothing declares the state portable
		}
		if !r.cuts.worthTrying(saved) {
			return "", 0
		}
		return reason, 0
	case fe.Category == tasks.CategoryThrottled && fe.RetryAfter > 0 && fe.RetryAfter <= r.throttleMax:
		until := r.now().Add(fe.RetryAfter)
		if b.Session.Expired(until) {
			return "", 0 // the session would not outlive the wait
		}
		if d, ok := ctx.Deadline(); ok && !until.Before(d) {
			return "", 0
		}
		return ResumeThrottled, fe.RetryAfter
	}
	return "", 0
}

// sleepCtx waits d or until ctx ends; false if ctx ended.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// Whether to try the session again after a cut is a bet: when the exit survived, the try
// saves what a replay would fetch again (the bytes of the steps before the cut one); when
// it did not, the try is wasted (the proxy's refusal, or a response from another exit). A
// cut in a unit's first step saves nothing, so it always replays. Otherwise the unit tries
// when rate × saved > (1 − rate) × cost, where rate is the provider's share of tries that
// found the exit alive and cost what a failed try moved, both learned from this process's
// tries (recent ones weigh most), from 1/2 and 512 B at the start. A provider whose cuts
// always lose the exit soon stops being tried, so the tries cost a fault mix of lost exits
// a few of them, not one per cut; one in cutExplore of the cuts not worth a try is tried
// anyway, so that the rate follows a provider whose exits start surviving again.

// cutStats is what a provider's tries after cuts found. Safe for concurrent use.
type cutStats struct {
	mu     sync.Mutex
	alive  float64 // decayed count of tries that found the exit alive
	lost   float64 // decayed count of tries that did not
	cost   float64 // moving mean of a failed try's bytes at the wire; 0 until one failed
	failed bool
	passed int // cuts not tried in a row (cutExplore)
}

const (
	cutStatsDecay   = 0.97 // per recorded try: the last ~30 tries weigh most
	cutProbeCostMin = 512  // bytes assumed for a failed try until one is measured
	// cutExplore: of the cuts the rule would not try, every cutExplore-th is tried anyway,
	// so that a rate learned low (exits lost for a while) is measured again and recovers.
	cutExplore = 8
)

// worthTrying reports whether a try after a cut is expected to save more than it risks.
// A nil s always tries (when saved > 0).
func (s *cutStats) worthTrying(saved int64) bool {
	if saved <= 0 {
		return false
	}
	if s == nil {
		return true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	rate := (s.alive + 1) / (s.alive + s.lost + 2)
	cost := float64(cutProbeCostMin)
	if s.failed {
		cost = s.cost
	}
	if rate*float64(saved) > (1-rate)*cost {
		s.passed = 0
		return true
	}
	s.passed++
	if s.passed >= cutExplore {
		s.passed = 0
		return true
	}
	return false
}

func (s *cutStats) record(alive bool, cost int64) {
	if s == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.alive *= cutStatsDecay
	s.lost *= cutStatsDecay
	if alive {
		s.alive++
		return
	}
	s.lost++
	if !s.failed {
		s.cost, s.failed = float64(cost), true
		return
	}
	s.cost = 0.8*s.cost + 0.2*float64(cost)
}

// cutProbe is a step run again after a cut, until it shows whether the exit survived.
type cutProbe struct {
	start int64 // the collector's bytes at the wire (the job's and refusals) when it began
}

func newCutProbe(b *Bound) *cutProbe { return &cutProbe{start: b.Bytes() + b.RefusedBytes()} }

// settle records the outcome of the try: lost when it ended the session other than by
// another cut (the proxy's refusal, another exit or none named), alive otherwise. It returns nil: a probe is settled once.
func (p *cutProbe) settle(err error, b *Bound, s *cutStats) *cutProbe {
	if p == nil {
		return nil
	}
	if err != nil {
		if fe := classify(err, true); fe.Category == tasks.CategorySessionLost && !isCut(fe) {
			s.record(false, b.Bytes()+b.RefusedBytes()-p.start)
			return nil
		}
	}
	s.record(true, 0)
	return nil
}
