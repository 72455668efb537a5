package parse

import (
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode"
)

// ErrRelativeTime is matched (errors.Is) by the error of Timestamp for relative forms such
// as "2 hours ago", "yesterday" or "today": they depend on when the page was fetched, so
// they are refused rather than guessed.
var ErrRelativeTime = errors.New("parse: relative time refused")

// DefaultTimeLayouts are the layouts Timestamp tries, in order, when TimeOptions.Layouts is
// empty. All are unambiguous: day-month order is never guessed ("03/04/2026" is not in the
// list; a page that writes dates so must pass its own layout).
var DefaultTimeLayouts = []string{
	time.RFC3339Nano,
	"2006-01-02T15:04:05",
	"2006-01-02T15:04",
	"2006-01-02 15:04:05Z07:00",
	"2006-01-02 15:04:05",
	"2006-01-02 15:04",
	"2006-01-02",
	time.RFC1123Z,
	time.RFC1123,
	"Mon, 2 Jan 2006 15:04:05 -0700",
	"Mon, 2 Jan 2006 15:04:05 MST",
	time.RFC850,
	"2 January 2006",
	"2 Jan 2006",
	"January 2, 2006",
	"Jan 2, 2006",
	"02.01.2006 15:04",
	"02.01.2006",
}

// TimeOptions say how to read a page's timestamps.
type TimeOptions struct {
	// Layouts are Go time layouts tried in order. Defaults to DefaultTimeLayouts.
	Layouts []string
	// Zone is the zone of a timestamp that states none (no offset, no "Z", no UTC/GMT).
	// Defaults to nil: such timestamps are refused, never read as UTC or local time.
	Zone *time.Location
}

// relativeWords mark relative times (compared case-insensitively, as whole words).
var relativeWords = []string{"ago", "yesterday", "today", "tomorrow", "now", "just now",
	"last week", "last month", "last year", "next week", "gestern", "heute", "vor", "hier", "aujourd'hui", "il y a", "hace", "ayer"}

// Timestamp reads a timestamp and returns it in UTC as RFC 3339 ("2026-04-23T08:15:00Z",
// with fractional seconds only when the input has them). The zone is the one the text
// states (an offset, "Z", or the abbreviations UTC and GMT: other abbreviations such as
// "PST" or "CET" are ambiguous and refused), else TimeOptions.Zone. Relative forms are
// refused with ErrRelativeTime. A date without a time is midnight in its zone. Errors name
// the input. Timestamp never reads the clock.
func Timestamp(s string, opts TimeOptions) (string, error) {
	t, err := ParseTime(s, opts)
	if err != nil {
		return "", err
	}
	if y := t.Year(); y < 0 || y > 9999 {
		// RFC 3339 has four-digit years; Go would write "-0001" or "10000".
		return "", fmt.Errorf("parse: timestamp %s: year %d in UTC is outside RFC 3339's 0000–9999", quoteShort(s), y)
	}
	return t.Format(time.RFC3339Nano), nil
}

// ParseTime is Timestamp returning the time.Time (in UTC).
func ParseTime(s string, opts TimeOptions) (time.Time, error) {
	text := Whitespace(s)
	if text == "" {
		return time.Time{}, fmt.Errorf("parse: timestamp %s: empty", quoteShort(s))
	}
	if isRelative(text) {
		return time.Time{}, fmt.Errorf("%w: %s depends on the fetch time", ErrRelativeTime, quoteShort(s))
	}
	layouts := opts.Layouts
	if len(layouts) == 0 {
		layouts = DefaultTimeLayouts
	}
	var zoneless bool
	for _, layout := range layouts {
		if !layoutHasZone(layout) {
			if _, err := time.ParseInLocation(layout, text, time.UTC); err == nil {
				if opts.Zone == nil {
					zoneless = true
					continue
				}
				t, _ := time.ParseInLocation(layout, text, opts.Zone)
				return t.UTC(), nil
			}
			continue
		}
		t, err := time.ParseInLocation(layout, text, time.UTC)
		if err != nil {
			continue
		}
		if strings.Contains(layout, "MST") {
			// Go gives an unknown abbreviation a zero offset: only UTC and GMT (GMT+3 and
			// the like included, which Go reads as offsets) say what they mean.
			if name, off := t.Zone(); !(name == "UTC" && off == 0) && !strings.HasPrefix(name, "GMT") {
				return time.Time{}, fmt.Errorf("parse: timestamp %s: zone abbreviation %q is ambiguous, want a numeric offset, UTC or GMT", quoteShort(s), name)
			}
		}
		return t.UTC(), nil
	}
	if zoneless {
		return time.Time{}, fmt.Errorf("parse: timestamp %s: states no zone and TimeOptions.Zone is not set", quoteShort(s))
	}
	return time.Time{}, fmt.Errorf("parse: timestamp %s: matches none of %d layouts", quoteShort(s), len(layouts))
}

// layoutHasZone reports whether a Go layout reads a zone (offset or abbreviation).
func layoutHasZone(layout string) bool {
	for _, z := range []string{"Z07", "-07", "MST"} {
		if strings.Contains(layout, z) {
			return true
		}
	}
	return false
}

func isRelative(text string) bool {
	words := strings.FieldsFunc(strings.ToLower(text), func(r rune) bool { return !unicode.IsLetter(r) && r != '\'' })
	lower := " " + strings.Join(words, " ") + " "
	for _, w := range relativeWords {
		if strings.Contains(lower, " "+w+" ") {
			return true
		}
	}
	return false
}
