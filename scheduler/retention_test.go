package scheduler_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/scheduler"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/ops"
	"github.com/idemscrape/idemscrape/tasks"
)

// TestRetentionPrunes: terminal jobs unchanged for longer than job_retention go with every
// row under their key (attempts, results, quarantine, notes), in batches; newer jobs and
// old jobs that are not terminal stay untouched; quarantine older than its own retention
// goes whatever the job; old schedule windows go; a pruned key enqueued again is a new job.
func TestRetentionPrunes(t *testing.T) {
	ctx := context.Background()
	b := setup(t)
	leases := b.leases(t)
	pool := b.st.Pool()

	// 5 old complete, 3 old failed (one with an operator's note), 2 recent complete,
	// 2 old pending (never pruned: not terminal), each with a quarantine row.
	recs := b.recordJobs(t, "ret", 12)
	key := func(i int) string { return recs[i].Key }
	complete := func(i int) {
		l := b.run(t, leases, key(i), "w")
		_, err := b.st.Commit(ctx, store.CommitParams{Key: key(i), Token: l.Token, ObservationKey: key(i), ParserVersion: 1,
			Data: []byte(`{}`), EventKey: "observed:" + key(i), Topic: "catalog", EventPayload: []byte(`{}`)})
		require.NoError(t, err)
	}
	for i := range 12 {
		switch {
		case i < 5 || i >= 8 && i < 10:
			complete(i)
		case i < 8:
			l := b.run(t, leases, key(i), "w")
			require.NoError(t, b.st.JobFail(ctx, store.AttemptFinishParams{Key: key(i), Token: l.Token, Category: "parse_error"}))
		}
		require.NoError(t, b.st.QuarantineInsert(ctx, store.QuarantineParams{Key: key(i), AttemptNo: 1, Reason: "session_lost",
			Staged: json.RawMessage(`{"half":true}`)}))
	}
	_, err := ops.New(pool).JobRequeue(ctx, ops.RequeueParams{Key: key(7), By: "op", Note: "try again"})
	require.NoError(t, err)
	l := b.run(t, leases, key(7), "w")
	require.NoError(t, b.st.JobFail(ctx, store.AttemptFinishParams{Key: key(7), Token: l.Token, Category: "parse_error"}))
	require.Equal(t, 1, countRows(t, b, `SELECT count(*) FROM job_notes`))

	old := []string{key(0), key(1), key(2), key(3), key(4), key(5), key(6), key(7)}
	kept := []string{key(8), key(9), key(10), key(11)}
	_, err = pool.Exec(ctx, `UPDATE jobs SET updated_at = now() - interval '100 days' WHERE key = ANY($1) OR key = ANY($2)`,
		old, []string{key(10), key(11)})
	require.NoError(t, err)
	// One recent job's quarantine is 10 days old: older than quarantine_retention.
	_, err = pool.Exec(ctx, `UPDATE quarantine SET created_at = now() - interval '10 days' WHERE job_key = $1`, key(9))
	require.NoError(t, err)
	// Windows: one due 100 days ago, one today.
	for _, w := range []struct{ name, age string }{{"old", "100 days"}, {"new", "0 days"}} {
		_, err = pool.Exec(ctx, `INSERT INTO schedule_windows (template, "window", kind, due_at) VALUES ('t', $1, 'catalog', now() - $2::interval)`, w.name, w.age)
		require.NoError(t, err)
	}

	// prune_batch 3: the 8 old jobs take three statements.
	r := b.reconciler(t, recOpts{yaml: "prune_batch: 3"})
	rep := r.Sweep(ctx)
	require.NoError(t, rep.Err)
	assert.EqualValues(t, 8, rep.Actions[scheduler.ActionJobsPruned], "%v", rep.Actions)
	assert.EqualValues(t, 1, rep.Actions[scheduler.ActionQuarantinePruned], "%v", rep.Actions)
	assert.EqualValues(t, 1, rep.Actions[scheduler.ActionWindowsPruned], "%v", rep.Actions)

	for table, col := range map[string]string{"jobs": "key", "attempts": "job_key", "results": "job_key",
		"quarantine": "job_key", "job_notes": "job_key"} {
		assert.Zero(t, countRows(t, b, `SELECT count(*) FROM `+table+` WHERE `+col+` = ANY('{`+strings.Join(old, ",")+`}')`),
			"%s of pruned jobs", table)
	}
	assert.Equal(t, 4, countRows(t, b, `SELECT count(*) FROM jobs WHERE key = ANY('{`+strings.Join(kept, ",")+`}')`), "newer and non-terminal jobs stay")
	assert.Equal(t, 2, countRows(t, b, `SELECT count(*) FROM results`), "the recent jobs' results")
	assert.Equal(t, 2, countRows(t, b, `SELECT count(*) FROM attempts`), "the recent jobs' attempts")
	assert.Equal(t, 3, countRows(t, b, `SELECT count(*) FROM quarantine`), "recent quarantine stays")
	assert.Equal(t, 1, countRows(t, b, `SELECT count(*) FROM schedule_windows`))
	for _, k := range []string{key(10), key(11)} {
		j, err := b.st.JobGet(ctx, k)
		require.NoError(t, err)
		assert.Equal(t, tasks.StatePending, j.State, "an old pending job is never pruned")
	}
	stats, err := b.st.StatsGet(ctx)
	require.NoError(t, err)
	assert.EqualValues(t, 8, stats.Maintenance[scheduler.ActionJobsPruned], "shown by idemscrape stats")

	// Nothing is due any more; a second sweep deletes nothing.
	due, err := b.st.RetentionDue(ctx, scheduler.DefaultJobRetention, scheduler.DefaultQuarantineRetention, scheduler.DefaultJobRetention+scheduler.DefaultWindowRetentionMargin)
	require.NoError(t, err)
	assert.Equal(t, store.RetentionPreview{}, due)
	rep = r.Sweep(ctx)
	require.NoError(t, rep.Err)
	assert.Zero(t, rep.Actions[scheduler.ActionJobsPruned]+rep.Actions[scheduler.ActionQuarantinePruned]+rep.Actions[scheduler.ActionWindowsPruned])

	// A pruned key enqueued again is a new job: pending, no attempts, fence 0, and it
	// commits a result of its own.
	created, err := b.st.JobsRecord(ctx, []tasks.JobRecord{recs[0]})
	require.NoError(t, err)
	require.Len(t, created, 1)
	assert.True(t, created[0].Created, "a new row")
	j, err := b.st.JobGet(ctx, key(0))
	require.NoError(t, err)
	assert.Equal(t, tasks.StatePending, j.State)
	assert.Zero(t, j.Attempts)
	complete(0)
	assert.Equal(t, 1, countRows(t, b, `SELECT count(*) FROM results WHERE job_key = '`+key(0)+`'`))
}

// TestRetentionDue counts what retention would delete, by table, without deleting it.
func TestRetentionDue(t *testing.T) {
	ctx := context.Background()
	b := setup(t)
	leases := b.leases(t)
	recs := b.recordJobs(t, "due", 3)
	for _, rec := range recs {
		l := b.run(t, leases, rec.Key, "w")
		require.NoError(t, b.st.JobFail(ctx, store.AttemptFinishParams{Key: rec.Key, Token: l.Token, Category: "parse_error"}))
	}
	_, err := b.st.Pool().Exec(ctx, `UPDATE jobs SET updated_at = now() - interval '91 days' WHERE key <> $1`, recs[2].Key)
	require.NoError(t, err)
	due, err := b.st.RetentionDue(ctx, scheduler.DefaultJobRetention, scheduler.DefaultQuarantineRetention, scheduler.DefaultJobRetention+scheduler.DefaultWindowRetentionMargin)
	require.NoError(t, err)
	assert.Equal(t, store.RetentionPreview{TerminalJobs: 2}, due)
	assert.Equal(t, 3, countRows(t, b, `SELECT count(*) FROM jobs`), "nothing deleted")
}
