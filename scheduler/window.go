package scheduler

import (
	"fmt"
	"time"
)

// WindowRule turns the scheduled time of a tick into the Window field of the job key.
// Windows are computed in the template's time zone from the tick's scheduled instant (not
// from the moment it ran), so two instances, a late tick and a catch-up after a restart
// all compute the same window.
type WindowRule string

// The window rules.
const (
	// Daily: the local date, "2026-04-23".
	Daily WindowRule = "daily"
	// Hourly: the local date and hour, "2026-04-23T14". The hour that a fall-back DST
	// change repeats gets the zone offset appended to both of its occurrences
	// ("2026-11-01T01-04:00", then "2026-11-01T01-05:00"), so the two real hours are two
	// windows instead of one.
	Hourly WindowRule = "hourly"
	// Weekly: the ISO 8601 week of the local date, "2026-W17" (the year is the ISO
	// week-numbering year: 2027-01-01 is in "2026-W53").
	Weekly WindowRule = "weekly"
	// Monthly: the local year and month, "2026-04".
	Monthly WindowRule = "monthly"
	// Minutely: the local minute, "2026-04-23T14:05", with the offset appended in a
	// repeated hour as for Hourly. Meant for short-period templates and tests.
	Minutely WindowRule = "minutely"
	// Secondly: the local second, "2026-04-23T14:05:09", with the offset appended in a
	// repeated hour as for Hourly. Meant for tests of the tick loop.
	Secondly WindowRule = "secondly"
)

// WindowRules lists every rule, in the order the documentation shows them.
var WindowRules = []WindowRule{Daily, Hourly, Weekly, Monthly, Minutely, Secondly}

// Valid reports whether r is one of WindowRules.
func (r WindowRule) Valid() bool {
	for _, v := range WindowRules {
		if r == v {
			return true
		}
	}
	return false
}

// Window returns the window of the tick scheduled at t, computed in loc (UTC when nil).
// It is a pure function of the instant t and loc: DST changes never make two distinct
// periods share a window nor one period have two windows (except that the repeated hour of
// a fall-back change is two windows, being two real hours).
func (r WindowRule) Window(t time.Time, loc *time.Location) (string, error) {
	if loc == nil {
		loc = time.UTC
	}
	lt := t.In(loc)
	switch r {
	case Daily:
		return lt.Format("2006-01-02"), nil
	case Monthly:
		return lt.Format("2006-01"), nil
	case Weekly:
		y, w := lt.ISOWeek()
		return fmt.Sprintf("%04d-W%02d", y, w), nil
	case Hourly:
		return withRepeatedHourOffset(t, loc, "2006-01-02T15"), nil
	case Minutely:
		return withRepeatedHourOffset(t, loc, "2006-01-02T15:04"), nil
	case Secondly:
		return withRepeatedHourOffset(t, loc, "2006-01-02T15:04:05"), nil
	}
	return "", fmt.Errorf("scheduler: unknown window rule %q, want one of %v", string(r), WindowRules)
}

// withRepeatedHourOffset formats t in loc with layout and appends the UTC offset when the
// local hour of t occurs twice that day (a fall-back DST change), so the two occurrences
// differ. The hour is repeated when the same local hour label is also shown one real hour
// earlier or later (offset changes of up to an hour; every zone in the tz database today).
func withRepeatedHourOffset(t time.Time, loc *time.Location, layout string) string {
	const hourLayout = "2006-01-02T15"
	lt := t.In(loc)
	h := lt.Format(hourLayout)
	if t.Add(-time.Hour).In(loc).Format(hourLayout) == h || t.Add(time.Hour).In(loc).Format(hourLayout) == h {
		return lt.Format(layout + "-07:00")
	}
	return lt.Format(layout)
}
