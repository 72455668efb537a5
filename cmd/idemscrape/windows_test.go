package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/testutil"
)

// TestWindowsTimesInUTC: a template at 02:30 in America/New_York has, on the day clocks
// spring forward, a fire at the gap's end that the scheduler computes in the zone
// (03:00-04:00); `windows` prints it, as every other time of its output (the listing, a
// fill's due time, -json), in UTC with Z: one form, never the zone's offset.
func TestWindowsTimesInUTC(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	ns := testutil.Redis(t)
	cliEnv(t, dsnOf(t, pool), ns.Addr)
	kind := ns.Queue
	cfg := filepath.Join(t.TempDir(), "scheduler.yaml")
	require.NoError(t, os.WriteFile(cfg, []byte(`templates:
  - name: ny-prices
    cron: "30 2 * * *"
    timezone: America/New_York
    window: daily
    kind: `+kind+`
    catchup: none
    sources: {ids: [sku-1]}
    countries: [US]
    parser_version: 1
kinds:
  `+kind+`: {queue: `+ns.Queue+`}
`), 0o600))
	ny, err := time.LoadLocation("America/New_York")
	require.NoError(t, err)
	// The latest spring-forward day (the second Sunday of March) at least two days past,
	// and a window recorded two days before it: the gaps from there run over it.
	now := time.Now().In(ny)
	var spring time.Time
	for y := now.Year(); spring.IsZero() || !spring.Before(now.AddDate(0, 0, -2)); y-- {
		d := time.Date(y, time.March, 1, 12, 0, 0, 0, ny)
		for d.Weekday() != time.Sunday {
			d = d.AddDate(0, 0, 1)
		}
		spring = d.AddDate(0, 0, 7)
	}
	first := time.Date(spring.Year(), spring.Month(), spring.Day()-2, 2, 30, 0, 0, ny)
	_, err = pool.Exec(ctx, `INSERT INTO schedule_windows (template, "window", kind, due_at, state, enqueued_at)
VALUES ('ny-prices', $1, $2, $3, 'enqueued', $3)`, first.Format("2006-01-02"), kind, first)
	require.NoError(t, err)

	anyTime := regexp.MustCompile(`\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)`)
	allUTC := func(t *testing.T, what, out string) {
		t.Helper()
		times := anyTime.FindAllString(out, -1)
		require.NotEmpty(t, times, "%s prints times: %s", what, out)
		for _, x := range times {
			assert.Regexp(t, `Z$`, x, "%s: every time in UTC with Z:\n%s", what, out)
		}
	}
	run := func(args ...string) (string, int, string) {
		var stderr bytes.Buffer
		out, code := runInProcess(nil, &stderr, args...)
		return out, code, stderr.String()
	}

	out, code, stderr := run("windows")
	require.Equal(t, 0, code, stderr)
	allUTC(t, "windows", out)

	out, code, stderr = run("windows", "-config", cfg, "-gaps")
	require.Equal(t, 1, code, "a gap: %s", stderr)
	allUTC(t, "windows -gaps", out)
	assert.Regexp(t, spring.Format("2006-01-02")+`\s+`+spring.Format("2006-01-02")+`T07:00:00Z`, out,
		"the spring-forward day's fire, 03:00 EDT, in UTC")

	out, code, _ = run("windows", "-config", cfg, "-gaps", "-json")
	require.Equal(t, 1, code)
	var gaps []struct {
		Window string `json:"window"`
		Due    string `json:"due"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &gaps))
	require.NotEmpty(t, gaps)
	for _, g := range gaps {
		assert.Regexp(t, `Z$`, g.Due, "-json too: window %s", g.Window)
	}

	// The latest gap (an old one's jobs may have been pruned: refused without -force).
	out, code, stderr = run("windows", "-config", cfg, "-fill", "ny-prices", gaps[len(gaps)-1].Window)
	require.Equal(t, 0, code, stderr)
	allUTC(t, "windows -fill", out)

	out, code, stderr = run("windows", "-json")
	require.Equal(t, 0, code, stderr)
	allUTC(t, "windows -json", out)
}
