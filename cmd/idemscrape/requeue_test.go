package main

import (
	"context"
	"fmt"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestRequeueKeyCheck: `idemscrape requeue` of a job whose recorded spec no longer derives
// its key with the binary's normaliser is refused before anything is written (the job stays
// failed, no note, no task); a URL job whose key still matches is re-queued and enqueued.
func TestRequeueKeyCheck(t *testing.T) {
	ctx := context.Background()
	bin, pool, ns, st := cliFixture(t)
	kind := queueKind(t, ns)

	run := func(t *testing.T, args ...string) cliRun {
		t.Helper()
		return runCLI(t, bin, []string{"IDEMSCRAPE_PG=" + dsnOf(t, pool), "IDEMSCRAPE_REDIS=" + ns.Addr, "USER=tester"}, "", args...)
	}
	// failedJob records a job for url as an enqueuer configured with n would, and fails it.
	failedJob := func(t *testing.T, n *tasks.Normalizer, url string) (tasks.Spec, string) {
		t.Helper()
		spec, err := n.Normalize(tasks.Spec{Kind: kind, URL: url, Country: "US", Window: "2026-04-23", ParserVersion: 3})
		require.NoError(t, err)
		key, err := n.Key(spec)
		require.NoError(t, err)
		recordFailedJob(ctx, t, st, key, spec, "w1")
		return spec, key
	}

	t.Run("KeyMismatchRefusedUnchanged", func(t *testing.T) {
		// Enqueued while the configuration kept utm_ parameters; the binary's (the default)
		// removes them now, so the recorded spec derives another key.
		spec, key := failedJob(t, tasks.NewNormalizer(tasks.WithoutDefaultTrackingParams()),
			"https://shop.example/p/1?utm_source=mail&id=1")
		derived, err := spec.Key()
		require.NoError(t, err)
		require.NotEqual(t, key, derived, "precondition: the default normaliser derives another key")
		tables := []string{"jobs", "job_notes", "attempts"}
		before := map[string][]string{}
		for _, tbl := range tables {
			before[tbl] = testutil.TableSnapshot(t, pool, tbl)
		}

		r := run(t, "requeue", "-by", "alice", "-note", "parser fixed", key)
		assert.Equal(t, 1, r.code, "a refusal, like requeue of a job that is not failed: %s", r.stderr)
		assert.Empty(t, r.stdout)
		assert.Contains(t, r.stderr, "idemscrape requeue: refused, nothing changed")
		assert.Contains(t, r.stderr, fmt.Sprintf("job %q", key), "names the job")
		assert.Contains(t, r.stderr, fmt.Sprintf("%q", derived), "names the key its spec derives now")
		assert.Contains(t, r.stderr, "normaliser's configuration", "says why")
		assert.NotContains(t, r.stderr, "usage:", "the command line was right")

		for _, tbl := range tables {
			assert.Equal(t, before[tbl], testutil.TableSnapshot(t, pool, tbl), "%s: nothing written", tbl)
		}
		assert.False(t, ns.AsynqTaskExists(t, key), "no task under the job's key")
		assert.False(t, ns.AsynqTaskExists(t, derived), "no task under the derived key")
		assert.Zero(t, ns.AsynqPending(t), "nothing enqueued")
		assert.Zero(t, testutil.Count(t, pool, `SELECT count(*) FROM jobs WHERE key = $1`, derived), "no second job")
	})

	t.Run("MatchingURLKeyRequeued", func(t *testing.T) {
		_, key := failedJob(t, tasks.DefaultNormalizer, "https://shop.example/p/2?id=2&utm_source=mail")
		r := run(t, "requeue", "-by", "alice", key)
		require.Equal(t, 0, r.code, r.stderr)
		assert.Equal(t, "requeued "+key+" by alice: state pending, task requeued\n", r.stdout)
		job, err := st.JobGet(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, tasks.StatePending, job.State)
		assert.Equal(t, 1, testutil.Count(t, pool, `SELECT count(*) FROM job_notes WHERE job_key = $1 AND actor = 'alice'`, key))
		insp := asynq.NewInspector(ns.AsynqOpt())
		t.Cleanup(func() { _ = insp.Close() })
		info, err := insp.GetTaskInfo(ns.Queue, key)
		require.NoError(t, err)
		assert.Equal(t, asynq.TaskStatePending, info.State)
	})
}
