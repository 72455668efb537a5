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

// TestRetentionSettingsChecked: job and quarantine retention against their minimums and
// the other retentions, each error naming both settings.
func TestRetentionSettingsChecked(t *testing.T) {
	for name, tc := range map[string]struct{ yaml, want1, want2 string }{
		"JobBelowMinimum":         {"job_retention: 12h", "job_retention", "minimum 24h"},
		"JobBelowInbox":           {"job_retention: 480h", "job_retention", "inbox_retention 720h"},
		"JobBelowSavedInputs":     {"job_retention: 800h, saved_input_retention: 900h", "job_retention", "saved_input_retention 900h"},
		"QuarantineBelowMinimum":  {"quarantine_retention: 30m", "quarantine_retention", "minimum 1h"},
		"QuarantineAboveJobs":     {"job_retention: 800h, quarantine_retention: 900h", "quarantine_retention", "job_retention 800h"},
		"NegativeJobRetention":    {"job_retention: -1h", "job_retention", "negative"},
		"NegativeQuarantineValue": {"quarantine_retention: -1h", "quarantine_retention", "negative"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := scheduler.ParseFile([]byte("reconciler: {"+tc.yaml+"}\n"), "", nil)
			require.ErrorIs(t, err, scheduler.ErrInvalidConfig)
			assert.ErrorContains(t, err, tc.want1)
			assert.ErrorContains(t, err, tc.want2)
		})
	}
	f, err := scheduler.ParseFile([]byte("reconciler: {}\n"), "", nil)
	require.NoError(t, err)
	assert.Equal(t, scheduler.DefaultJobRetention, f.Reconciler.JobRetention)
	assert.Equal(t, scheduler.DefaultQuarantineRetention, f.Reconciler.QuarantineRetention)
}
