package scheduler_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/scheduler"
	"github.com/idemscrape/idemscrape/store"
)

// shortRetention is a reconciler section with a 48 h job retention (the other retentions
// below it, as job_retention requires).
const shortRetention = `reconciler:
  job_retention: 48h
  quarantine_retention: 24h
  outbox_retention: 24h
  inbox_retention: 30h
  saved_input_retention: 24h
`

// TestRetentionNeverRerunsWindow: a job retention shorter than the time a template ticks
// one window (a weekly window, a daily cron) is refused at load, and so are a window
// retention not longer than the job retention and an outbox retention below the Redis-loss
// recover window. With an accepted configuration, a window whose jobs were pruned by the
// reconciler is never ticked again: the window ledger outlives them, a tick is refused
// (store.ErrWindowExpired) without creating anything, a fill says why and what -force
// does, and only a forced fill creates the jobs again.
func TestRetentionNeverRerunsWindow(t *testing.T) {
	b := setup(t)
	tmpl := func(cron, window string) string {
		return "templates:\n  - {name: t, cron: \"" + cron + "\", window: " + window +
			", kind: catalog, sources: {ids: [sku-1]}, countries: [US], parser_version: 1}\n"
	}
	refused := map[string]struct {
		yaml  string
		wants []string
	}{
		"WeeklyWindowDailyCron": {tmpl("0 6 * * *", "weekly") + shortRetention,
			[]string{"job_retention", "48h0m0s", `template "t"`, "weekly", "144h0m0s", "create them again"}},
		"MonthlyWindowDefaultRetention": {tmpl("0 6 * * *", "monthly") + "reconciler: {job_retention: 720h, inbox_retention: 700h}\n",
			[]string{"job_retention", "monthly", "720h0m0s"}},
		"RetryUntilPastRetention": {"templates:\n  - {name: t, cron: \"0 6 * * *\", window: daily, retry_until: 48h, kind: catalog, sources: {ids: [sku-1]}, countries: [US], parser_version: 1}\n" + shortRetention,
			[]string{"job_retention", "retry_until 48h0m0s"}},
		"WindowRetentionNotLonger": {shortRetention + "  window_retention: 48h\n",
			[]string{"window_retention", "job_retention 48h0m0s", "outlive"}},
		"OutboxBelowRecoverWindow": {"reconciler: {outbox_retention: 12h}\n",
			[]string{"outbox_retention", "12h0m0s", "RecoverWindow", "24h0m0s"}},
	}
	for name, c := range refused {
		t.Run("Refused/"+name, func(t *testing.T) {
			_, err := scheduler.ParseFile([]byte(c.yaml), "", nil)
			require.Error(t, err)
			assert.True(t, errors.Is(err, scheduler.ErrInvalidConfig), "%v", err)
			for _, w := range c.wants {
				assert.ErrorContains(t, err, w)
			}
		})
	}
	// Accepted: daily window, daily cron; the ledger defaults to 48h + 48h.
	f, err := scheduler.ParseFile([]byte(tmpl("0 6 * * *", "daily")+"kinds:\n  catalog: {queue: "+b.ns.Queue+"}\n"+shortRetention), "", nil)
	require.NoError(t, err)
	assert.Equal(t, 96*time.Hour, f.Reconciler.WindowRetention)

	ctx := context.Background()
	now := time.Now()
	at := now.UTC().Truncate(24 * time.Hour).Add(6 * time.Hour)
	if at.After(now) {
		at = at.Add(-24 * time.Hour)
	}
	s := b.scheduler(t, f, time.Now, nil)
	rep := s.Tick(ctx, "t", at)
	require.NoError(t, rep.Err)
	win := rep.Window
	require.Equal(t, map[string]int{win: 1}, b.windows(t))

	// The job completed three days ago, when the window was first ticked: the reconciler
	// prunes it (job_retention 48h) and keeps the window's record.
	var key string
	require.NoError(t, b.st.Pool().QueryRow(ctx, `SELECT key FROM jobs WHERE "window" = $1`, win).Scan(&key))
	l := b.run(t, b.leases(t), key, "w")
	_, err = b.st.Commit(ctx, store.CommitParams{Key: key, Token: l.Token, ObservationKey: key, ParserVersion: 1,
		Data: []byte(`{}`), EventKey: "observed:" + key, Topic: "catalog", EventPayload: []byte(`{}`)})
	require.NoError(t, err)
	_, err = b.st.Pool().Exec(ctx, `UPDATE jobs SET updated_at = now() - interval '72 hours' WHERE key = $1`, key)
	require.NoError(t, err)
	insp := asynq.NewInspector(b.ns.AsynqOpt()) // the worker's asynq task is gone, as after it completed
	defer insp.Close()
	require.NoError(t, insp.DeleteTask(b.ns.Queue, key))
	_, err = b.st.Pool().Exec(ctx, `UPDATE schedule_windows SET started_at = now() - interval '72 hours'`)
	require.NoError(t, err)
	r := b.reconciler(t, recOpts{yaml: "job_retention: 48h, quarantine_retention: 24h, outbox_retention: 24h, inbox_retention: 30h, saved_input_retention: 24h"})
	sw := r.Sweep(ctx)
	require.NoError(t, sw.Err)
	require.EqualValues(t, 1, sw.Actions[scheduler.ActionJobsPruned], "%v", sw.Actions)
	assert.Empty(t, b.windows(t), "the job is pruned")
	row := windowRow(t, b, "t", win)
	assert.Equal(t, store.WindowEnqueued, row.State, "the ledger keeps the window")

	// A tick of the window again is refused and creates nothing.
	rep = s.Tick(ctx, "t", at)
	require.Error(t, rep.Err)
	assert.True(t, errors.Is(rep.Err, store.ErrWindowExpired), "%v", rep.Err)
	assert.Empty(t, b.windows(t), "no job created again")
	assert.Equal(t, row.Tries, windowRow(t, b, "t", win).Tries, "a refused tick is not a try")

	// A fill is refused, saying why and what -force does; a forced fill creates the job.
	_, err = s.Fill(ctx, "t", win)
	require.Error(t, err)
	assert.True(t, errors.Is(err, store.ErrWindowExpired), "%v", err)
	for _, w := range []string{"job retention 48h0m0s", "pruned", "-force", "same event keys"} {
		assert.ErrorContains(t, err, w)
	}
	assert.Empty(t, b.windows(t))
	frep, err := s.ForceFill(ctx, "t", win)
	require.NoError(t, err)
	assert.Equal(t, 1, frep.Outcomes["created"])
	assert.Equal(t, map[string]int{win: 1}, b.windows(t))
}

// TestFillOfUnrecordedOldWindowRefused: a window due longer ago than window_retention
// without a record (its record may have been pruned) is not filled unless forced.
func TestFillOfUnrecordedOldWindowRefused(t *testing.T) {
	b := setup(t)
	f := b.file(t, "templates:\n  - {name: t, cron: \"0 6 * * *\", window: daily, kind: catalog, catchup: none, sources: {ids: [sku-1]}, countries: [US], parser_version: 1}\n")
	ctx := context.Background()
	s := b.scheduler(t, f, time.Now, nil)
	old := time.Now().Add(-f.Reconciler.WindowRetention - 48*time.Hour).UTC().Format("2006-01-02")
	_, err := s.Fill(ctx, "t", old)
	require.Error(t, err)
	assert.True(t, errors.Is(err, store.ErrWindowExpired), "%v", err)
	assert.ErrorContains(t, err, "no record")
	assert.Empty(t, b.windows(t))
	_, err = s.ForceFill(ctx, "t", old)
	require.NoError(t, err)
	assert.Equal(t, map[string]int{old: 1}, b.windows(t))
}
