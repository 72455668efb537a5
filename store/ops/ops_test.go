package ops_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/ops"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

type bundle struct {
	pool *pgxpool.Pool
	st   *store.PG
	ops  *ops.Store
}

func setup(t *testing.T) *bundle {
	t.Helper()
	pool := testutil.PG(t)
	return &bundle{pool: pool, st: store.New(pool), ops: ops.New(pool)}
}

func (b *bundle) record(t *testing.T, keys ...string) {
	t.Helper()
	recs := make([]tasks.JobRecord, len(keys))
	for i, k := range keys {
		recs[i] = tasks.JobRecord{Key: k, Spec: tasks.Spec{Kind: "catalog", SourceID: k, Country: "US", Window: "2026-04-23", ParserVersion: 3}}
	}
	_, err := b.st.JobsRecord(context.Background(), recs)
	require.NoError(t, err)
}

// recordURL records a pending job for url as an Enqueuer configured with n would (the
// normalised spec under the key n derives) and returns both.
func (b *bundle) recordURL(t *testing.T, n *tasks.Normalizer, url string) (tasks.Spec, string) {
	t.Helper()
	spec, err := n.Normalize(tasks.Spec{Kind: "catalog", URL: url, Country: "US", Window: "2026-04-23", ParserVersion: 3})
	require.NoError(t, err)
	key, err := n.Key(spec)
	require.NoError(t, err)
	_, err = b.st.JobsRecord(context.Background(), []tasks.JobRecord{{Key: key, Spec: spec}})
	require.NoError(t, err)
	return spec, key
}

func (b *bundle) start(t *testing.T, key string, token int64) {
	t.Helper()
	_, err := b.st.JobStart(context.Background(), store.AttemptStartParams{Key: key, Token: token, Worker: "w", Country: "US"})
	require.NoError(t, err)
}

func (b *bundle) commit(t *testing.T, key string, token int64, obsKey string) {
	t.Helper()
	payload, err := json.Marshal(map[string]string{"job_key": key, "observation_key": obsKey})
	require.NoError(t, err)
	_, err = b.st.Commit(context.Background(), store.CommitParams{Key: key, Token: token, ObservationKey: obsKey, ParserVersion: 3,
		Data: []byte(`{}`), EventKey: ops.DefaultEventKeyPrefix + key, Topic: "catalog", EventPayload: payload})
	require.NoError(t, err)
}

func (b *bundle) fail(t *testing.T, key string, token int64) {
	t.Helper()
	require.NoError(t, b.st.JobFail(context.Background(), store.AttemptFinishParams{Key: key, Token: token, Category: "parse_error", Bytes: 70}))
}

func (b *bundle) exec(t *testing.T, q string, args ...any) {
	t.Helper()
	_, err := b.pool.Exec(context.Background(), q, args...)
	require.NoError(t, err)
}

// liveTasks is a fake queue: the keys it holds are live.
type liveTasks struct {
	mu    sync.Mutex
	live  map[string]bool
	asked []string
}

func (l *liveTasks) fn(_ context.Context, kind, key string) (bool, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.asked = append(l.asked, kind+"/"+key)
	return l.live[key], nil
}

func verdicts(rep ops.AuditReport) map[string]int64 {
	out := map[string]int64{}
	for _, i := range rep.Invariants {
		out[i.Name] = i.Violations
	}
	return out
}

func TestAudit(t *testing.T) {
	ctx := context.Background()
	clean := map[string]int64{ops.InvCompleteHasResultAndEvent: 0, ops.InvResultHasCompleteJob: 0, ops.InvRunningHasLiveTask: 0,
		ops.InvOutboxLag: 0, ops.InvFencesIncreasing: 0, ops.InvAttemptPerStart: 0}

	t.Run("HealthyRunPasses", func(t *testing.T) {
		b := setup(t)
		b.record(t, "a", "b", "dup", "run", "p")
		b.start(t, "a", 1)
		b.start(t, "a", 2)
		b.commit(t, "a", 2, "a")
		b.start(t, "b", 1)
		b.fail(t, "b", 1)
		b.start(t, "dup", 1)
		b.commit(t, "dup", 1, "a") // a rejected duplicate: its event names a's observation
		b.start(t, "run", 1)
		b.exec(t, `UPDATE jobs SET attempt_started_at = now() - interval '1 hour' WHERE key = 'run'`)
		q := &liveTasks{live: map[string]bool{"run": true}}
		rep, err := b.ops.Audit(ctx, ops.AuditConfig{TaskLive: q.fn, BatchSize: 2})
		require.NoError(t, err)
		assert.True(t, rep.OK(), "%+v", rep)
		assert.Equal(t, clean, verdicts(rep))
		assert.Equal(t, []string{"catalog/run"}, q.asked, "only the running job past its lease is looked up")
		for _, i := range rep.Invariants {
			switch i.Name {
			case ops.InvFencesIncreasing:
				assert.EqualValues(t, 5, i.Checked, "every job, across pages of 2")
			case ops.InvCompleteHasResultAndEvent:
				assert.EqualValues(t, 2, i.Checked)
			case ops.InvOutboxLag:
				assert.EqualValues(t, 2, i.Checked, "two unsent events")
			}
		}
	})

	t.Run("EachInvariantBroken", func(t *testing.T) {
		b := setup(t)
		b.record(t, "a", "b", "c", "run", "p")
		b.start(t, "a", 1)
		b.commit(t, "a", 1, "a")
		b.start(t, "b", 1)
		b.commit(t, "b", 1, "b")
		b.start(t, "c", 1)
		b.start(t, "c", 2)
		b.commit(t, "c", 2, "c")
		b.start(t, "run", 1)
		b.exec(t, `DELETE FROM results WHERE job_key = 'a'`)
		b.exec(t, `INSERT INTO results (observation_key, job_key, parser_version, data, fence) VALUES ('x', 'p', 3, '{}', 1)`)
		b.exec(t, `UPDATE jobs SET attempt_started_at = now() - interval '1 hour' WHERE key = 'run'`)
		b.exec(t, `UPDATE outbox SET created_at = now() - interval '1 hour' WHERE event_key = 'observed:b'`)
		// Dispatched up to a, not from b on (c is not late: only b counts).
		b.exec(t, `INSERT INTO outbox_positions (topic, xid, id)
			SELECT DISTINCT ON (topic) topic, xid, id FROM outbox ORDER BY topic, xid DESC, id DESC
			ON CONFLICT (topic) DO UPDATE SET xid = excluded.xid, id = excluded.id`)
		b.exec(t, `UPDATE outbox_positions p SET xid = o.xid, id = o.id - 1 FROM outbox o WHERE o.event_key = 'observed:b' AND p.topic = o.topic`)
		b.exec(t, `UPDATE attempts SET fence = 9 WHERE job_key = 'c' AND attempt_no = 1`)
		b.exec(t, `DELETE FROM attempts WHERE job_key = 'b'`) // a complete job whose one start left no row
		q := &liveTasks{}
		rep, err := b.ops.Audit(ctx, ops.AuditConfig{TaskLive: q.fn, BatchSize: 1})
		require.NoError(t, err)
		assert.False(t, rep.OK())
		want := map[string][]string{
			ops.InvCompleteHasResultAndEvent: {"a"},
			ops.InvResultHasCompleteJob:      {"p"},
			ops.InvRunningHasLiveTask:        {"run"},
			ops.InvOutboxLag:                 {"b"},
			ops.InvFencesIncreasing:          {"c"},
			ops.InvAttemptPerStart:           {"b"},
		}
		got := map[string][]string{}
		for _, i := range rep.Broken() {
			got[i.Name] = i.Examples
		}
		assert.Equal(t, want, got)
	})

	t.Run("PrunedEventsAndStrayEvents", func(t *testing.T) {
		b := setup(t)
		b.record(t, "old", "recent", "stray")
		for _, k := range []string{"old", "recent"} {
			b.start(t, k, 1)
			b.commit(t, k, 1, k)
		}
		b.exec(t, `INSERT INTO outbox_positions (topic, xid, id)
			SELECT DISTINCT ON (topic) topic, xid, id FROM outbox ORDER BY topic, xid DESC, id DESC
			ON CONFLICT (topic) DO UPDATE SET xid = excluded.xid, id = excluded.id`) // dispatched
		// The reconciler pruned old's sent event after the retention; recent lost its event
		// too early (a broken invariant); stray has an event though it never completed.
		b.exec(t, `UPDATE jobs SET completed_at = now() - interval '8 days' WHERE key = 'old'`)
		b.exec(t, `DELETE FROM outbox WHERE event_key IN ('observed:old', 'observed:recent')`)
		b.exec(t, `INSERT INTO outbox (event_key, topic, payload) VALUES ('observed:stray', 'catalog', '{}')`)
		b.exec(t, `INSERT INTO outbox_positions (topic, xid, id)
			SELECT DISTINCT ON (topic) topic, xid, id FROM outbox ORDER BY topic, xid DESC, id DESC
			ON CONFLICT (topic) DO UPDATE SET xid = excluded.xid, id = excluded.id`) // dispatched
		rep, err := b.ops.Audit(ctx, ops.AuditConfig{TaskLive: (&liveTasks{}).fn})
		require.NoError(t, err)
		broken := rep.Broken()
		require.Len(t, broken, 1, "%+v", rep)
		assert.Equal(t, ops.InvCompleteHasResultAndEvent, broken[0].Name)
		assert.Equal(t, []string{"recent", "stray"}, broken[0].Examples, "old's event was pruned after the retention: not a violation")
	})

	t.Run("ExamplesCapped", func(t *testing.T) {
		b := setup(t)
		keys := make([]string, 25)
		for i := range keys {
			keys[i] = fmt.Sprintf("k%02d", i)
		}
		b.record(t, keys...)
		for _, k := range keys {
			b.start(t, k, 1)
		}
		b.exec(t, `UPDATE jobs SET attempt_started_at = now() - interval '1 hour' WHERE state = 'running'`)
		rep, err := b.ops.Audit(ctx, ops.AuditConfig{TaskLive: (&liveTasks{}).fn, BatchSize: 7, MaxExamples: 3})
		require.NoError(t, err)
		broken := rep.Broken()
		require.Len(t, broken, 1)
		assert.EqualValues(t, 25, broken[0].Violations, "counted across every page")
		assert.Equal(t, []string{"k00", "k01", "k02"}, broken[0].Examples)
	})

	t.Run("QueueErrorIsAnError", func(t *testing.T) {
		b := setup(t)
		b.record(t, "run")
		b.start(t, "run", 1)
		boom := errors.New("redis down")
		_, err := b.ops.Audit(ctx, ops.AuditConfig{LeaseMax: time.Nanosecond,
			TaskLive: func(context.Context, string, string) (bool, error) { return false, boom }})
		require.ErrorIs(t, err, boom)
		assert.ErrorContains(t, err, `"run"`)
	})

	t.Run("ConfigValidated", func(t *testing.T) {
		b := setup(t)
		_, err := b.ops.Audit(ctx, ops.AuditConfig{})
		assert.ErrorContains(t, err, "TaskLive is required")
		_, err = b.ops.Audit(ctx, ops.AuditConfig{TaskLive: (&liveTasks{}).fn, LeaseMax: -time.Second})
		assert.ErrorContains(t, err, "LeaseMax")
	})
}

func TestJobRequeue(t *testing.T) {
	ctx := context.Background()

	t.Run("FailedJobGetsFreshBudget", func(t *testing.T) {
		b := setup(t)
		b.record(t, "f")
		b.start(t, "f", 1)
		b.fail(t, "f", 1)
		job, err := b.ops.JobRequeue(ctx, ops.RequeueParams{Key: "f", By: "alice", Note: "parser fixed"})
		require.NoError(t, err)
		assert.Equal(t, tasks.StatePending, job.State)
		assert.Equal(t, 1, job.Attempts, "attempts are evidence")
		assert.EqualValues(t, 1, job.Fence, "fences never go back")
		assert.Empty(t, job.LastCategory)
		assert.Equal(t, 1, testutil.Count(t, b.pool,
			`SELECT count(*) FROM jobs WHERE key = 'f' AND budget_attempts = 1 AND budget_bytes = 70 AND budget_since IS NOT NULL`))
		budget, err := b.ops.BudgetGet(ctx, "f")
		require.NoError(t, err)
		require.NotNil(t, budget.Since)
		assert.Equal(t, ops.Budget{Attempts: 1, Bytes: 70, Since: budget.Since}, budget)
		notes, err := b.ops.NoteListByJob(ctx, "f")
		require.NoError(t, err)
		require.Len(t, notes, 1)
		n := notes[0]
		assert.Equal(t, ops.Note{Action: ops.NoteRequeue, Actor: "alice", Note: "parser fixed", PreviousState: "failed",
			PreviousCategory: "parse_error", AttemptsBefore: 1, CreatedAt: n.CreatedAt}, n)

		// The next attempt is number 2 and runs under a higher token.
		b.start(t, "f", 2)
		b.fail(t, "f", 2)
		_, err = b.ops.JobRequeue(ctx, ops.RequeueParams{Key: "f", By: "bob"})
		require.NoError(t, err)
		assert.Equal(t, 1, testutil.Count(t, b.pool, `SELECT count(*) FROM jobs WHERE key = 'f' AND budget_attempts = 2 AND budget_bytes = 140`))
		notes, err = b.ops.NoteListByJob(ctx, "f")
		require.NoError(t, err)
		assert.Len(t, notes, 2)
	})

	t.Run("OnlyFailedJobs", func(t *testing.T) {
		b := setup(t)
		b.record(t, "p", "r", "c")
		b.start(t, "r", 1)
		b.start(t, "c", 1)
		b.commit(t, "c", 1, "c")
		for key, state := range map[string]string{"p": "pending", "r": "running", "c": "complete"} {
			before := testutil.TableSnapshot(t, b.pool, "jobs")
			_, err := b.ops.JobRequeue(ctx, ops.RequeueParams{Key: key, By: "alice"})
			require.ErrorIs(t, err, ops.ErrNotFailed, key)
			assert.ErrorContains(t, err, "the job is "+state)
			assert.Equal(t, before, testutil.TableSnapshot(t, b.pool, "jobs"), "nothing written")
		}
		_, err := b.ops.JobRequeue(ctx, ops.RequeueParams{Key: "nope", By: "alice"})
		require.ErrorIs(t, err, store.ErrJobNotFound)
		_, err = b.ops.JobRequeue(ctx, ops.RequeueParams{Key: "p", By: " "})
		assert.ErrorContains(t, err, "By")
		assert.Zero(t, testutil.Count(t, b.pool, `SELECT count(*) FROM job_notes`))
	})

	// A job recorded under one normaliser configuration and re-queued under another: the
	// tracking parameter "ref" is removed only by the new one, so the recorded spec derives
	// another key now. The refusal leaves the job as it was; the same job under the
	// configuration it was recorded with is re-queued.
	t.Run("KeyMismatchRefusedUnchanged", func(t *testing.T) {
		b := setup(t)
		spec, key := b.recordURL(t, tasks.DefaultNormalizer, "https://shop.example/p/42?ref=mail&color=red")
		b.start(t, key, 1)
		b.fail(t, key, 1)
		changed := tasks.NewNormalizer(tasks.WithTrackingParams("ref"))
		derived, err := changed.Key(spec)
		require.NoError(t, err)
		require.NotEqual(t, key, derived, "precondition: the new configuration derives another key")

		tables := []string{"jobs", "job_notes", "attempts"}
		before := map[string][]string{}
		for _, tbl := range tables {
			before[tbl] = testutil.TableSnapshot(t, b.pool, tbl)
		}
		_, err = b.ops.JobRequeue(ctx, ops.RequeueParams{Key: key, By: "alice", Note: "try again", Normalizer: changed})
		require.ErrorIs(t, err, ops.ErrKeyMismatch)
		var mismatch *ops.KeyMismatchError
		require.ErrorAs(t, err, &mismatch)
		assert.Equal(t, ops.KeyMismatchError{Key: key, Derived: derived}, *mismatch)
		assert.ErrorContains(t, err, fmt.Sprintf("job %q", key))
		assert.ErrorContains(t, err, fmt.Sprintf("%q", derived))
		assert.ErrorContains(t, err, "normaliser")
		for _, tbl := range tables {
			assert.Equal(t, before[tbl], testutil.TableSnapshot(t, b.pool, tbl), "%s: nothing written", tbl)
		}
		job, err := b.st.JobGet(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, tasks.StateFailed, job.State)

		// A missing job is still a missing job, with the check on.
		_, err = b.ops.JobRequeue(ctx, ops.RequeueParams{Key: "nope", By: "alice", Normalizer: changed})
		require.ErrorIs(t, err, store.ErrJobNotFound)

		// Under the configuration it was recorded with, the key matches: re-queued.
		job, err = b.ops.JobRequeue(ctx, ops.RequeueParams{Key: key, By: "alice", Normalizer: tasks.DefaultNormalizer})
		require.NoError(t, err)
		assert.Equal(t, tasks.StatePending, job.State)
		assert.Equal(t, spec, ops.SpecOf(job))
		notes, err := b.ops.NoteListByJob(ctx, key)
		require.NoError(t, err)
		assert.Len(t, notes, 1)
	})

	t.Run("KeyCheckStillRefusesNotFailed", func(t *testing.T) {
		b := setup(t)
		_, key := b.recordURL(t, tasks.DefaultNormalizer, "https://shop.example/p/43")
		before := testutil.TableSnapshot(t, b.pool, "jobs")
		_, err := b.ops.JobRequeue(ctx, ops.RequeueParams{Key: key, By: "alice", Normalizer: tasks.DefaultNormalizer})
		require.ErrorIs(t, err, ops.ErrNotFailed)
		assert.NotErrorIs(t, err, ops.ErrKeyMismatch)
		assert.Equal(t, before, testutil.TableSnapshot(t, b.pool, "jobs"))
		assert.Zero(t, testutil.Count(t, b.pool, `SELECT count(*) FROM job_notes`))
	})

	t.Run("ConcurrentRequeuesNoteOnce", func(t *testing.T) {
		b := setup(t)
		b.record(t, "f")
		b.start(t, "f", 1)
		b.fail(t, "f", 1)
		const n = 8
		errs := make(chan error, n)
		for i := 0; i < n; i++ {
			go func() {
				_, err := b.ops.JobRequeue(ctx, ops.RequeueParams{Key: "f", By: fmt.Sprint("op", i)})
				errs <- err
			}()
		}
		ok := 0
		for i := 0; i < n; i++ {
			if err := <-errs; err == nil {
				ok++
			} else {
				require.ErrorIs(t, err, ops.ErrNotFailed)
			}
		}
		assert.Equal(t, 1, ok)
		assert.Equal(t, 1, testutil.Count(t, b.pool, `SELECT count(*) FROM job_notes`))
	})
}

func TestJobStatus(t *testing.T) {
	ctx := context.Background()
	b := setup(t)
	b.record(t, "a")
	b.start(t, "a", 1)
	b.start(t, "a", 2)
	b.commit(t, "a", 2, "a")
	st, err := b.ops.JobStatus(ctx, "a", "observed:a")
	require.NoError(t, err)
	assert.Equal(t, tasks.StateComplete, st.Job.State)
	require.Len(t, st.Attempts, 2)
	assert.Equal(t, []string{"lost", "complete"}, []string{st.Attempts[0].Outcome, st.Attempts[1].Outcome}, "the takeover wrote attempt 1's row")
	require.Len(t, st.Results, 1)
	assert.EqualValues(t, 2, st.Results[0].Fence)
	require.NotNil(t, st.Outbox)
	assert.Nil(t, st.Outbox.SentAt)
	assert.Empty(t, st.Notes)

	st, err = b.ops.JobStatus(ctx, "a", "observed:other")
	require.NoError(t, err)
	assert.Nil(t, st.Outbox)
	_, err = b.ops.JobStatus(ctx, "nope", "observed:nope")
	require.ErrorIs(t, err, store.ErrJobNotFound)

	b.record(t, "f")
	b.start(t, "f", 1)
	b.fail(t, "f", 1)
	probs, err := b.ops.JobListProblems(ctx, 10)
	require.NoError(t, err)
	require.Len(t, probs, 1)
	assert.Equal(t, ops.ProblemJob{Key: "f", Kind: "catalog", State: "failed", Attempts: 1, Category: "parse_error",
		UpdatedAt: probs[0].UpdatedAt}, probs[0])
}

func TestCheckMigrated(t *testing.T) {
	ctx := context.Background()
	b := setup(t)
	require.NoError(t, b.ops.CheckMigrated(ctx))
	latest, err := ops.LatestMigration()
	require.NoError(t, err)
	assert.GreaterOrEqual(t, latest, int64(5))
	b.exec(t, `DELETE FROM goose_db_version WHERE version_id = $1`, latest)
	err = b.ops.CheckMigrated(ctx)
	require.ErrorIs(t, err, ops.ErrNotMigrated)
	assert.ErrorContains(t, err, fmt.Sprintf("this binary needs %d", latest))
	b.exec(t, `DROP TABLE goose_db_version`)
	require.ErrorIs(t, b.ops.CheckMigrated(ctx), ops.ErrNotMigrated, "a database never migrated")
}

func TestDiagnose(t *testing.T) {
	assert.Nil(t, ops.Diagnose(store.Stats{Attempts: 100, AttemptsPerCompletedJob: 1}), "no duplicate work, nothing to say")
	for _, tc := range []struct {
		name  string
		stats store.Stats
		want  string
	}{
		{"LeasesTooShort", store.Stats{Attempts: 100, SupersededAttempts: 4, LeaseExpiredAttempts: 2}, "leases too short: 6 of 100"},
		{"LateAcks", store.Stats{OutboxSent: 100, OutboxReplaysDeduplicated: 3}, "late acks: consumers recognised 3"},
		{"OverlappingSchedulers", store.Stats{DuplicateResultsRejected: 2}, "overlapping schedulers: 2 result writes"},
		{"Timeouts", store.Stats{Attempts: 20, RetriesCausedByCategory: map[string]int64{"timeout": 2}}, "timeouts: 2 retries"},
		{"RisingWithoutOneCause", store.Stats{Attempts: 100, AttemptsPerCompletedJob: 2,
			RetriesCausedByCategory: map[string]int64{"throttled": 30, "session_lost": 20}}, `the top cause of retries is "throttled" (30)`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := ops.Diagnose(tc.stats)
			require.Len(t, got, 1, "%q", got)
			assert.Contains(t, got[0], tc.want)
		})
	}
	assert.Nil(t, ops.Diagnose(store.Stats{Attempts: 100, SupersededAttempts: 4}), "4% lost leases is under the threshold")
}
