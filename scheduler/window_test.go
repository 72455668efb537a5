package scheduler_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/scheduler"
)

func TestWindowRules(t *testing.T) {
	ny, err := time.LoadLocation("America/New_York")
	require.NoError(t, err)
	kolkata, err := time.LoadLocation("Asia/Kolkata")
	require.NoError(t, err)
	utc := func(s string) time.Time {
		t.Helper()
		v, err := time.Parse(time.RFC3339, s)
		require.NoError(t, err)
		return v
	}
	type want map[scheduler.WindowRule]string
	cases := []struct {
		name string
		at   time.Time
		loc  *time.Location
		want want
	}{
		{"UTC/midday", utc("2026-04-23T14:05:09Z"), time.UTC,
			want{"daily": "2026-04-23", "hourly": "2026-04-23T14", "weekly": "2026-W17", "monthly": "2026-04",
				"minutely": "2026-04-23T14:05", "secondly": "2026-04-23T14:05:09"}},
		{"UTC/ISOYearBoundary", utc("2027-01-01T00:00:00Z"), time.UTC,
			want{"daily": "2027-01-01", "hourly": "2027-01-01T00", "weekly": "2026-W53", "monthly": "2027-01"}},
		{"UTC/ISOWeek1OfNextYear", utc("2024-12-30T12:00:00Z"), time.UTC,
			want{"daily": "2024-12-30", "weekly": "2025-W01", "monthly": "2024-12"}},
		// New York: the local date differs from UTC's in the evening.
		{"NewYork/EveningIsPreviousUTCDay", utc("2026-04-24T02:30:00Z"), ny,
			want{"daily": "2026-04-23", "hourly": "2026-04-23T22", "weekly": "2026-W17", "monthly": "2026-04"}},
		{"NewYork/MonthEndInLocalTime", utc("2026-05-01T03:59:59Z"), ny,
			want{"daily": "2026-04-30", "monthly": "2026-04", "hourly": "2026-04-30T23"}},
		// Spring forward, 2026-03-08 02:00 EST → 03:00 EDT: 01:59 EST is followed by 03:00 EDT.
		{"NewYork/SpringForwardBefore", utc("2026-03-08T06:59:00Z"), ny,
			want{"daily": "2026-03-08", "hourly": "2026-03-08T01", "minutely": "2026-03-08T01:59"}},
		{"NewYork/SpringForwardAfter", utc("2026-03-08T07:00:00Z"), ny,
			want{"daily": "2026-03-08", "hourly": "2026-03-08T03", "minutely": "2026-03-08T03:00"}},
		{"NewYork/SpringForwardMidnightBefore", utc("2026-03-08T04:59:59Z"), ny,
			want{"daily": "2026-03-07", "weekly": "2026-W10"}},
		// Fall back, 2026-11-01 02:00 EDT → 01:00 EST: the hour 01 happens twice, two windows.
		{"NewYork/FallBackFirst01", utc("2026-11-01T05:30:00Z"), ny,
			want{"daily": "2026-11-01", "hourly": "2026-11-01T01-04:00", "minutely": "2026-11-01T01:30-04:00", "weekly": "2026-W44"}},
		{"NewYork/FallBackSecond01", utc("2026-11-01T06:30:00Z"), ny,
			want{"daily": "2026-11-01", "hourly": "2026-11-01T01-05:00", "minutely": "2026-11-01T01:30-05:00"}},
		{"NewYork/FallBackHourBefore", utc("2026-11-01T04:59:00Z"), ny,
			want{"daily": "2026-11-01", "hourly": "2026-11-01T00"}},
		{"NewYork/FallBackHourAfter", utc("2026-11-01T07:00:00Z"), ny,
			want{"daily": "2026-11-01", "hourly": "2026-11-01T02"}},
		// Kolkata is UTC+05:30 without DST: half-hour offsets move the date and the hour.
		{"Kolkata/AfterUTCMidnightShift", utc("2026-04-23T18:30:00Z"), kolkata,
			want{"daily": "2026-04-24", "hourly": "2026-04-24T00", "weekly": "2026-W17", "monthly": "2026-04"}},
		{"Kolkata/BeforeLocalMidnight", utc("2026-04-23T18:29:59Z"), kolkata,
			want{"daily": "2026-04-23", "hourly": "2026-04-23T23", "secondly": "2026-04-23T23:59:59"}},
		{"Kolkata/NewMonth", utc("2026-04-30T18:30:00Z"), kolkata,
			want{"daily": "2026-05-01", "monthly": "2026-05", "weekly": "2026-W18"}},
		{"NilLocationIsUTC", utc("2026-04-23T23:00:00Z"), nil,
			want{"daily": "2026-04-23", "hourly": "2026-04-23T23"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for rule, w := range tc.want {
				got, err := rule.Window(tc.at, tc.loc)
				require.NoError(t, err, rule)
				assert.Equal(t, w, got, "rule %s", rule)
			}
		})
	}

	t.Run("EveryHourOfADSTYearIsOneDistinctWindow", func(t *testing.T) {
		// Every real hour of 2026 in New York gets its own hourly window, and consecutive
		// hours never share one: DST neither merges nor splits hours.
		seen := map[string]time.Time{}
		start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
		for at := start; at.Before(start.AddDate(1, 0, 0)); at = at.Add(time.Hour) {
			w, err := scheduler.Hourly.Window(at, ny)
			require.NoError(t, err)
			prev, dup := seen[w]
			require.False(t, dup, "window %s for %v and %v", w, prev, at)
			seen[w] = at
		}
		assert.Len(t, seen, 365*24)
	})

	t.Run("UnknownRule", func(t *testing.T) {
		_, err := scheduler.WindowRule("yearly").Window(time.Now(), time.UTC)
		assert.ErrorContains(t, err, "unknown window rule")
	})
}
