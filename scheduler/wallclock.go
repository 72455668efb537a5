package scheduler

import (
	"fmt"
	"strings"
	"time"

	"github.com/robfig/cron/v3"
)

// What a template's schedule means when the wall clock jumps (issue 36).
//
// A cron expression matches wall times of the template's zone ("02:30 every day"); a
// daylight-saving change makes some wall times not exist (spring forward) and others occur
// twice (fall back). robfig/cron v3's SpecSchedule.Next walks instants and loses the first
// kind: `30 2 * * *` in America/New_York has no tick on the spring-forward day, and
// `@daily` none in America/Santiago or America/Havana, whose midnight does not exist then.
// wallSchedule replaces it with these rules, the ones Vixie cron and cronie follow:
//
//   - A matched wall time that exists once fires at that instant.
//   - A matched wall time that does not exist (it falls in a spring-forward gap) fires at
//     the first instant after the gap (02:30 → 03:00 in New York; Saturday 23:30 in
//     America/Nuuk, whose gap is 23:00-24:00, fires at Sunday 00:00), and its window is
//     that of the wall time it stands for: its local date for daily, weekly and monthly
//     windows (Saturday above), its local hour/minute/second for the others. Several
//     such wall times fire at the same instant, one tick per distinct window. A schedule
//     that matches every hour (hour field `*`) has no such fire: the missing hour is not a
//     real hour, and the schedule's other ticks go on.
//   - A matched wall time that occurs twice (a fall-back change) fires once, at its first
//     occurrence; except that a schedule matching every hour fires at both, as they are
//     two real hours (their hourly, minutely and secondly windows differ by the zone
//     offset appended, see WindowRule).
//
// So every window a schedule has is ticked, listed by Gaps and filled by Fill exactly as
// one window; TestDSTWindows holds it for New York, Santiago and Havana, spring and autumn,
// daily and weekly.

// fire is one scheduled tick: when it is due and the window it ticks.
type fire struct {
	At     time.Time
	Window string
	civil  time.Time // the wall time the expression matched, as UTC fields
	second bool      // the second occurrence of a repeated wall time
	gap    bool      // a wall time that does not exist, fired at the end of the gap
	force  bool      // a forced fill: ticked even when its jobs may have been pruned
}

func (f fire) IsZero() bool { return f.At.IsZero() }

// wallSchedule is a template's schedule: the cron expression matched on the wall clock of
// loc, with the DST rules above.
type wallSchedule struct {
	civil     *cron.SpecSchedule // the expression in UTC: its Next walks wall time without DST
	loc       *time.Location
	rule      WindowRule
	everyHour bool // the hour field matches all 24 hours
}

// newWallSchedule wraps a parsed expression; its Location is ignored (loc is used).
func newWallSchedule(ss *cron.SpecSchedule, loc *time.Location, rule WindowRule) *wallSchedule {
	c := *ss
	c.Location = time.UTC
	const allHours = 1<<24 - 1
	return &wallSchedule{civil: &c, loc: loc, rule: rule, everyHour: c.Hour&allHours == allHours}
}

// Next returns the first fire's instant after t (cron.Schedule).
func (w *wallSchedule) Next(t time.Time) time.Time { return w.nextFire(t, nil).At }

// civilOf is the wall time of the instant t in loc, as UTC fields.
func (w *wallSchedule) civilOf(t time.Time) time.Time {
	_, off := t.In(w.loc).Zone()
	return t.Add(time.Duration(off) * time.Second).UTC()
}

func offsetAt(t time.Time, loc *time.Location) time.Duration {
	_, off := t.In(loc).Zone()
	return time.Duration(off) * time.Second
}

// fold describes the fall-back change whose second occurrence contains t (ok), from the
// transition instant at: its repeated wall times are [at+post, at+pre) (as civil values),
// their second occurrences the instants [at, at+pre-post).
func (w *wallSchedule) foldContaining(t time.Time) (at time.Time, pre, post time.Duration, ok bool) {
	start, _ := t.In(w.loc).ZoneBounds()
	if start.IsZero() {
		return time.Time{}, 0, 0, false
	}
	pre, post = offsetAt(start.Add(-time.Nanosecond), w.loc), offsetAt(start, w.loc)
	if pre > post && t.Before(start.Add(pre-post)) {
		return start, pre, post, true
	}
	return time.Time{}, 0, 0, false
}

// resolve returns the instants whose wall time is c: one, two (a repeated wall time,
// earliest first) or none, and then the first instant after the gap c falls in.
func (w *wallSchedule) resolve(c time.Time) (occ []time.Time, gapEnd time.Time) {
	// An instant whose wall time is c lies within [c-14h, c+12h] (the extreme offsets);
	// every offset in force around there is tried.
	lo, hi := c.Add(-15*time.Hour), c.Add(13*time.Hour)
	type transition struct {
		at        time.Time
		pre, post time.Duration
	}
	var offs []time.Duration
	var trans []transition
	for p := lo; ; {
		off := offsetAt(p, w.loc)
		if len(offs) == 0 || offs[len(offs)-1] != off {
			offs = append(offs, off)
		}
		_, end := p.In(w.loc).ZoneBounds()
		if end.IsZero() || end.After(hi) || !end.After(p) {
			break
		}
		trans = append(trans, transition{end, off, offsetAt(end, w.loc)})
		p = end
	}
	for _, off := range offs {
		i := c.Add(-off)
		if offsetAt(i, w.loc) != off {
			continue
		}
		dup := false
		for _, o := range occ {
			dup = dup || o.Equal(i)
		}
		if !dup {
			occ = append(occ, i)
		}
	}
	if len(occ) == 2 && occ[1].Before(occ[0]) {
		occ[0], occ[1] = occ[1], occ[0]
	}
	if len(occ) > 0 {
		return occ, time.Time{}
	}
	for _, tr := range trans {
		if tr.post > tr.pre && !c.Before(tr.at.Add(tr.pre)) && c.Before(tr.at.Add(tr.post)) {
			return nil, tr.at
		}
	}
	return nil, c.Add(-offsetAt(c, w.loc)) // not reached with the tz database
}

// maxFireSteps bounds the wall times one nextFire examines (they are skipped only in a
// gap or a repeated hour, at most a few hours' worth).
const maxFireSteps = 1_000_000

// nextFire returns the first fire after prev, or after the instant after when prev is nil
// (a fire at exactly after is not returned then). Fires are ordered by instant, then by
// wall time (several gap wall times fire at one instant). Zero when none within 5 years.
func (w *wallSchedule) nextFire(after time.Time, prev *fire) fire {
	if prev != nil {
		after = prev.At
	}
	best := fire{}
	// First occurrences and gap fires: their instant never decreases with the wall time,
	// so the first wall time past the bound is the one.
	c1 := w.civilOf(after).Truncate(time.Second).Add(time.Second)
	if at, pre, _, ok := w.foldContaining(after); ok {
		// after is in a repeated hour's second occurrence: its wall times' first
		// occurrences are all past.
		if end := at.Add(pre).UTC(); end.After(c1) {
			c1 = end
		}
	}
	if prev != nil && !prev.second {
		c1 = prev.civil.Add(time.Second)
	}
	for range maxFireSteps {
		c := w.civil.Next(c1.Add(-time.Second))
		if c.IsZero() {
			break
		}
		occ, gapEnd := w.resolve(c)
		var f fire
		switch {
		case len(occ) > 0:
			f = fire{At: occ[0], civil: c}
		case w.everyHour:
			c1 = w.civilOf(gapEnd) // the missing hour is not a real one: no fire
			continue
		default:
			f = fire{At: gapEnd, civil: c, gap: true}
		}
		if f.At.After(after) || (prev != nil && f.At.Equal(after) && c.After(prev.civil)) {
			best = f
			break
		}
		c1 = c.Add(time.Second)
	}
	if w.everyHour {
		if f := w.nextSecond(after, prev); !f.IsZero() && (best.IsZero() || f.At.Before(best.At)) {
			best = f
		}
	}
	if best.IsZero() {
		return best
	}
	best.Window = w.windowOf(best)
	return best
}

// nextSecond is the first second occurrence of a repeated wall time after after (or prev),
// in the fold after is in or the next one.
func (w *wallSchedule) nextSecond(after time.Time, prev *fire) fire {
	at, pre, post, ok := w.foldContaining(after)
	var from time.Time
	if ok {
		from = w.civilOf(after).Truncate(time.Second).Add(time.Second)
		if prev != nil && prev.second {
			from = prev.civil.Add(time.Second)
		}
	} else {
		_, end := after.In(w.loc).ZoneBounds()
		if end.IsZero() {
			return fire{}
		}
		at, pre, post = end, offsetAt(end.Add(-time.Nanosecond), w.loc), offsetAt(end, w.loc)
		if pre <= post {
			return fire{}
		}
		from = at.Add(post).UTC()
	}
	c := w.civil.Next(from.Add(-time.Second))
	if c.IsZero() || !c.Before(at.Add(pre).UTC()) {
		return fire{}
	}
	return fire{At: c.Add(-post), civil: c, second: true}
}

// windowOf is the window of f: that of its instant, or for a gap fire that of the wall
// time it stands for.
func (w *wallSchedule) windowOf(f fire) string {
	if f.gap {
		return w.rule.civilWindow(f.civil)
	}
	win, _ := w.rule.Window(f.At, w.loc)
	return win
}

// following is the fire the loop ticks after f when the clock says now: the next fire; or,
// when fires were missed (a tick outlasted the period), the first missed window, at its
// latest missed fire (a later fire of the same window stands for the earlier ones). No
// window is skipped.
func (w *wallSchedule) following(f fire, now time.Time) fire {
	next := w.nextFire(f.At, &f)
	for !next.IsZero() && !next.At.After(now) {
		n := w.nextFire(next.At, &next)
		if n.IsZero() || n.At.After(now) || n.Window != next.Window {
			break
		}
		next = n
	}
	return next
}

// lastFire returns the latest fire at or before now (zero if none in five years).
func (w *wallSchedule) lastFire(now time.Time) fire {
	for d := time.Minute; d <= 5*366*24*time.Hour; d *= 4 {
		f := w.nextFire(now.Add(-d), nil)
		if f.IsZero() || f.At.After(now) {
			continue
		}
		for {
			n := w.nextFire(f.At, &f)
			if n.IsZero() || n.At.After(now) {
				return f
			}
			f = n
		}
	}
	return fire{}
}

// fireAt returns the first fire due at exactly at, or (not a scheduled instant) a fire of
// at with the window of the instant.
func (w *wallSchedule) fireAt(at time.Time) fire {
	if f := w.nextFire(at.Add(-time.Nanosecond), nil); !f.IsZero() && f.At.Equal(at) {
		return f
	}
	return fire{At: at, civil: w.civilOf(at), Window: w.windowOf(fire{At: at})}
}

// latestSlotBefore is the latest wall time the expression matches before c (zero if none
// within five years).
func (w *wallSchedule) latestSlotBefore(c time.Time) time.Time {
	for d := time.Second; d <= 5*366*24*time.Hour; d *= 4 {
		s := w.civil.Next(c.Add(-d - time.Second))
		if s.IsZero() || !s.Before(c) {
			continue
		}
		for {
			n := w.civil.Next(s)
			if n.IsZero() || !n.Before(c) {
				return s
			}
			s = n
		}
	}
	return time.Time{}
}

// fireOfWindow computes (without walking the schedule from some start) the latest fire of
// window due at or before now; false when the window has none.
func (w *wallSchedule) fireOfWindow(window string, now time.Time) (fire, bool) {
	from, to, ok := w.rule.civilRange(window)
	if !ok {
		return fire{}, false
	}
	// Wall times from upper on fire after now: upper is just past now's wall time, or the
	// end of the repeated hour now is the second occurrence of.
	upper := w.civilOf(now).Truncate(time.Second).Add(time.Second)
	if at, pre, _, ok := w.foldContaining(now); ok {
		if end := at.Add(pre).UTC(); end.After(upper) {
			upper = end
		}
	}
	if to.Before(upper) {
		upper = to
	}
	for range maxFireSteps {
		c := w.latestSlotBefore(upper)
		if c.IsZero() || c.Before(from) {
			return fire{}, false
		}
		occ, gapEnd := w.resolve(c)
		var fs []fire
		switch {
		case len(occ) == 0 && !w.everyHour:
			fs = []fire{{At: gapEnd, civil: c, gap: true}}
		case len(occ) == 2 && w.everyHour:
			fs = []fire{{At: occ[1], civil: c, second: true}, {At: occ[0], civil: c}}
		case len(occ) > 0:
			fs = []fire{{At: occ[0], civil: c}}
		}
		for _, f := range fs {
			f.Window = w.windowOf(f)
			if f.Window == window && !f.At.After(now) {
				return f, true
			}
		}
		upper = c
	}
	return fire{}, false
}

// civilWindow is the window of the wall time c (UTC fields), without an offset: the window
// of a wall time a spring-forward gap skipped.
func (r WindowRule) civilWindow(c time.Time) string {
	switch r {
	case Daily:
		return c.Format("2006-01-02")
	case Monthly:
		return c.Format("2006-01")
	case Weekly:
		y, wk := c.ISOWeek()
		return fmt.Sprintf("%04d-W%02d", y, wk)
	case Hourly:
		return c.Format("2006-01-02T15")
	case Minutely:
		return c.Format("2006-01-02T15:04")
	case Secondly:
		return c.Format("2006-01-02T15:04:05")
	}
	return ""
}

// civilRange parses a window of rule r into the wall times it covers, [from, to) as UTC
// fields (a trailing zone offset of a repeated hour is accepted and left to the caller's
// check of the window it computes).
func (r WindowRule) civilRange(w string) (from, to time.Time, ok bool) {
	parse := func(layout string, n int) (time.Time, bool) {
		if len(w) < n {
			return time.Time{}, false
		}
		if rest := w[n:]; rest != "" && (len(rest) != 6 || (rest[0] != '-' && rest[0] != '+')) {
			return time.Time{}, false
		}
		t, err := time.Parse(layout, w[:n])
		return t, err == nil
	}
	switch r {
	case Daily:
		t, err := time.Parse("2006-01-02", w)
		return t, t.AddDate(0, 0, 1), err == nil
	case Monthly:
		t, err := time.Parse("2006-01", w)
		return t, t.AddDate(0, 1, 0), err == nil
	case Weekly:
		y, wk, found := strings.Cut(w, "-W")
		var year, week int
		if !found || len(y) != 4 || len(wk) != 2 {
			return time.Time{}, time.Time{}, false
		}
		if _, err := fmt.Sscanf(y+" "+wk, "%d %d", &year, &week); err != nil || week < 1 || week > 53 {
			return time.Time{}, time.Time{}, false
		}
		jan4 := time.Date(year, 1, 4, 0, 0, 0, 0, time.UTC)
		monday := jan4.AddDate(0, 0, -((int(jan4.Weekday())+6)%7)+7*(week-1))
		return monday, monday.AddDate(0, 0, 7), true
	case Hourly:
		t, ok := parse("2006-01-02T15", 13)
		return t, t.Add(time.Hour), ok
	case Minutely:
		t, ok := parse("2006-01-02T15:04", 16)
		return t, t.Add(time.Minute), ok
	case Secondly:
		t, ok := parse("2006-01-02T15:04:05", 19)
		return t, t.Add(time.Second), ok
	}
	return time.Time{}, time.Time{}, false
}
