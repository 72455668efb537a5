package scheduler_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/scheduler"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestDSTWindows: around every DST change of New York, Santiago and Havana (spring and
// autumn), daily and weekly templates whose wall time does not exist (spring) or occurs
// twice (autumn) that day have every window exactly once: the loop ticks each once and in
// order (a wall time in the gap at the gap's end, a repeated one at its first occurrence),
// Gaps lists each unticked one once, due at that tick, and Fill finds each at that tick.
func TestDSTWindows(t *testing.T) {
	cases := []struct {
		name, zone, cron string
		rule             scheduler.WindowRule
		first, last      string // local dates the check covers
	}{
		{"NewYork/Spring/Daily0230", "America/New_York", "30 2 * * *", scheduler.Daily, "2026-03-05", "2026-03-11"},
		{"NewYork/Autumn/Daily0130", "America/New_York", "30 1 * * *", scheduler.Daily, "2026-10-29", "2026-11-04"},
		{"NewYork/Spring/WeeklySunday0230", "America/New_York", "30 2 * * 0", scheduler.Weekly, "2026-02-16", "2026-03-29"},
		{"NewYork/Autumn/WeeklySunday0130", "America/New_York", "30 1 * * 0", scheduler.Weekly, "2026-10-12", "2026-11-22"},
		{"Santiago/Spring/Daily", "America/Santiago", "@daily", scheduler.Daily, "2026-09-03", "2026-09-09"},
		{"Santiago/Autumn/Daily", "America/Santiago", "@daily", scheduler.Daily, "2026-04-02", "2026-04-08"},
		{"Santiago/Autumn/Daily2330", "America/Santiago", "30 23 * * *", scheduler.Daily, "2026-04-02", "2026-04-08"},
		{"Santiago/Spring/Weekly", "America/Santiago", "@weekly", scheduler.Weekly, "2026-08-17", "2026-09-27"},
		{"Havana/Spring/Daily", "America/Havana", "@daily", scheduler.Daily, "2026-03-05", "2026-03-11"},
		{"Havana/Autumn/Daily", "America/Havana", "@daily", scheduler.Daily, "2026-10-29", "2026-11-04"},
		{"Havana/Spring/Weekly", "America/Havana", "@weekly", scheduler.Weekly, "2026-02-16", "2026-03-29"},
		{"Havana/Autumn/Weekly", "America/Havana", "@weekly", scheduler.Weekly, "2026-10-12", "2026-11-22"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			b := setup(t)
			loc, err := time.LoadLocation(tc.zone)
			require.NoError(t, err)
			first, err := time.ParseInLocation("2006-01-02", tc.first, loc)
			require.NoError(t, err)
			last, err := time.ParseInLocation("2006-01-02", tc.last, loc)
			require.NoError(t, err)
			// The windows the template has: every local date, or the ISO week of every
			// Sunday (all the weekly templates fire on Sundays).
			var want []string
			lastDay, err := time.Parse("2006-01-02", tc.last)
			require.NoError(t, err)
			for d, _ := time.Parse("2006-01-02", tc.first); !d.After(lastDay); d = d.AddDate(0, 0, 1) { // dates, not instants
				switch {
				case tc.rule == scheduler.Daily:
					want = append(want, d.Format("2006-01-02"))
				case d.Weekday() == time.Sunday:
					y, w := d.ISOWeek()
					want = append(want, fmt.Sprintf("%04d-W%02d", y, w))
				}
			}
			f := b.file(t, fmt.Sprintf(`templates:
  - name: dst
    cron: %q
    timezone: %s
    window: %s
    kind: catalog
    catchup: none
    sources: {ids: [sku-1]}
    countries: [US]
    parser_version: 1
`, tc.cron, tc.zone, tc.rule))
			// first and last are local midnights (each exists in these zones on these
			// dates except Santiago's and Havana's spring-forward days, not at the ends).
			from, to := first.Add(-time.Second), last.AddDate(0, 0, 1).Add(-time.Second)
			clock := testutil.NewClock(to.AddDate(0, 0, 15))
			s := b.scheduler(t, f, clock.Now, nil)

			ats, wins := scheduler.LoopFires(s, "dst", from, to)
			require.Equal(t, want, wins, "the loop ticks every window once, in order (at %v)", ats)
			for i := 1; i < len(ats); i++ {
				require.True(t, ats[i].After(ats[i-1]), "ticks in order: %v then %v", ats[i-1], ats[i])
			}

			// The first window is ticked; every other one is a gap, listed once.
			rep := s.Tick(ctx, "dst", ats[0])
			require.NoError(t, rep.Err)
			require.Equal(t, want[0], rep.Window)
			gaps, err := s.Gaps(ctx)
			require.NoError(t, err)
			var gapWins []string
			gapDue := map[string]time.Time{}
			for _, g := range gaps {
				if !g.Due.After(to) {
					gapWins = append(gapWins, g.Window)
					gapDue[g.Window] = g.Due
				}
			}
			require.Equal(t, want[1:], gapWins, "every unticked window is a gap, once")
			for i, w := range want[1:] {
				assert.True(t, ats[i+1].Equal(gapDue[w]), "gap %s due %v, the loop ticks it at %v", w, gapDue[w], ats[i+1])
			}

			// Fill finds every window at the instant the loop ticks it, and creates its
			// job once; no gap is left among them.
			for i, w := range want {
				rep, err := s.Fill(ctx, "dst", w)
				require.NoError(t, err, "fill %s", w)
				assert.True(t, ats[i].Equal(rep.At), "fill %s at %v, the loop ticks it at %v", w, rep.At, ats[i])
				assert.Equal(t, w, rep.Window)
			}
			gaps, err = s.Gaps(ctx)
			require.NoError(t, err)
			for _, g := range gaps {
				assert.True(t, g.Due.After(to), "gap %s (due %v) left after the fills", g.Window, g.Due)
			}
			jobs := b.windows(t)
			for _, w := range want {
				assert.Equal(t, 1, jobs[w], "window %s has its one job", w)
			}
			assert.Len(t, jobs, len(want), "no other window: %v", jobs)
		})
	}
}

// TestDSTWindowsEdges: a gap ending at local midnight (America/Nuuk, 23:00-24:00) fires
// Saturday's 23:30 at Sunday 00:00 as Saturday's window; an hourly schedule fires both real
// hours of a repeated hour as two windows and none for the missing hour; several wall times
// in a gap fire at its end as distinct windows. Fill finds each at the loop's instant.
func TestDSTWindowsEdges(t *testing.T) {
	cases := []struct {
		name, zone, cron string
		rule             scheduler.WindowRule
		from, to         string // UTC instants
		want             []string
	}{
		{"Nuuk/GapAtMidnight", "America/Nuuk", "30 23 * * *", scheduler.Daily, "2026-03-27T12:00:00Z", "2026-03-30T12:00:00Z",
			[]string{"2026-03-27", "2026-03-28", "2026-03-29"}},
		{"NewYork/HourlyFold", "America/New_York", "30 * * * *", scheduler.Hourly, "2026-11-01T04:00:00Z", "2026-11-01T08:00:00Z",
			[]string{"2026-11-01T00", "2026-11-01T01-04:00", "2026-11-01T01-05:00", "2026-11-01T02"}},
		{"NewYork/HourlyGap", "America/New_York", "30 * * * *", scheduler.Hourly, "2026-03-08T05:00:00Z", "2026-03-08T08:00:00Z",
			[]string{"2026-03-08T00", "2026-03-08T01", "2026-03-08T03"}},
		{"NewYork/SeveralInGap", "America/New_York", "*/20 2,3 * * *", scheduler.Minutely, "2026-03-08T06:00:00Z", "2026-03-08T07:50:00Z",
			[]string{"2026-03-08T02:00", "2026-03-08T02:20", "2026-03-08T02:40", "2026-03-08T03:00", "2026-03-08T03:20", "2026-03-08T03:40"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := setup(t)
			f := b.file(t, fmt.Sprintf("templates:\n  - {name: dst, cron: %q, timezone: %s, window: %s, kind: catalog, catchup: none, sources: {ids: [sku-1]}, countries: [US], parser_version: 1}\n",
				tc.cron, tc.zone, tc.rule))
			from, err := time.Parse(time.RFC3339, tc.from)
			require.NoError(t, err)
			to, err := time.Parse(time.RFC3339, tc.to)
			require.NoError(t, err)
			s := b.scheduler(t, f, testutil.NewClock(to.Add(time.Hour)).Now, nil)
			ats, wins := scheduler.LoopFires(s, "dst", from, to)
			require.Equal(t, tc.want, wins, "at %v", ats)
			for i, w := range wins {
				rep, err := s.Fill(context.Background(), "dst", w)
				require.NoError(t, err, w)
				assert.True(t, ats[i].Equal(rep.At), "fill %s at %v, the loop at %v", w, rep.At, ats[i])
			}
			assert.Len(t, b.windows(t), len(tc.want))
		})
	}
}
