package scheduler_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/scheduler"
)

// TestSeasonSettingsChecked: settings that only make sense together are refused at start
// with an error naming both.
func TestSeasonSettingsChecked(t *testing.T) {
	for name, tc := range map[string]struct{ yaml, want string }{
		"InboxNotLongerThanOutbox": {"reconciler: {outbox_retention: 72h, inbox_retention: 48h}\n", "inbox_retention"},
		"NegativeRetryUntil": {`templates:
  - {name: t, cron: "@daily", window: daily, kind: catalog, sources: {ids: [a]}, countries: [US], parser_version: 1, retry_until: -1h}
`, "retry_until"},
		"ScanTooLarge": {"reconciler: {requeue_scan_per_sweep: 2000000}\n", "requeue_scan_per_sweep"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := scheduler.ParseFile([]byte(tc.yaml), "", nil)
			require.Error(t, err)
			assert.True(t, errors.Is(err, scheduler.ErrInvalidConfig))
			assert.ErrorContains(t, err, tc.want)
		})
	}
	_, err := scheduler.ParseFile([]byte("reconciler: {outbox_retention: 72h, inbox_retention: 48h}\n"), "", nil)
	assert.ErrorContains(t, err, "outbox_retention", "both settings are named")
	f, err := scheduler.ParseFile([]byte("reconciler: {}\n"), "", nil)
	require.NoError(t, err)
	assert.Equal(t, scheduler.DefaultRequeueScanPerSweep, f.Reconciler.RequeueScanPerSweep)
	assert.Equal(t, scheduler.DefaultRequeueChangedPerSweep, f.Reconciler.RequeueChangedPerSweep)
}
