package main

import (
	"context"
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/ops"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestAttemptRowPerFence: an attempt's row is written when it ends, and an attempt whose
// worker never ends it gets its row from its successor. Worker A is SIGKILLed and worker B
// SIGSTOPped while each holds one job at its last step; worker C takes both over. A's
// attempt ends as 'lost' (written by C's start), B's as 'superseded' once B is continued
// and reports its evidence. Every job then has exactly one attempt row per start, which
// idemscrape audit checks, and the audit fails once one of them is missing.
func TestAttemptRowPerFence(t *testing.T) {
	bin := buildWorker(t)
	ctx := context.Background()
	w := newWorld(t, 2)
	short := []string{"-lease-default", "2s", "-lease-min", "1s", "-lease-max", "2s"}
	args := func(id, queue string) []string {
		a := append(w.args(1, 30*time.Second), short...)
		for i := range a {
			if a[i] == "-queues" {
				a[i+1] = queue
			}
		}
		return append(a, "-worker-id", id)
	}
	a := startWorker(t, bin, args("worker-A", w.ns.Queue), w.env(t))
	w.gate.waitHeld(t, 1) // A holds one job (concurrency 1)…
	b := startWorker(t, bin, args("worker-B", w.ns.Queue), w.env(t))
	w.gate.waitHeld(t, 1) // …and B the other
	running := map[string]string{}
	rows, err := w.pool.Query(ctx, `SELECT key, attempt_worker FROM jobs WHERE state = 'running'`)
	require.NoError(t, err)
	for rows.Next() {
		var k, by string
		require.NoError(t, rows.Scan(&k, &by))
		running[by] = k
	}
	require.NoError(t, rows.Err())
	require.Len(t, running, 2, "each worker runs one job: %v", running)
	require.Zero(t, testutil.Count(t, w.pool, `SELECT count(*) FROM attempts`), "a running attempt has no row yet")

	require.NoError(t, a.cmd.Process.Signal(syscall.SIGKILL)) // our own child, by pid
	require.NoError(t, b.cmd.Process.Signal(syscall.SIGSTOP))
	stopped := true
	t.Cleanup(func() {
		if stopped {
			_ = b.cmd.Process.Signal(syscall.SIGCONT) // so that the cleanup's kill is not left pending
		}
	})
	a.wait(t, time.Minute)
	w.gate.open()

	// Their asynq tasks stay active under the dead and the stopped server until asynq's own
	// recovery (a minute or more): C serves a second queue holding the same tasks (a task
	// id is unique per queue), as a re-enqueue by the reconciler would give them.
	q2 := w.ns.Queue + "x"
	insp := asynq.NewInspector(w.ns.AsynqOpt())
	client := asynq.NewClient(w.ns.AsynqOpt())
	t.Cleanup(func() {
		_ = client.Close()
		_ = insp.Close()
		keys, _ := w.ns.Client.Keys(ctx, "asynq:{"+q2+"}:*").Result()
		if len(keys) > 0 {
			_ = w.ns.Client.Del(ctx, keys...).Err()
		}
		_ = w.ns.Client.SRem(ctx, "asynq:queues", q2).Err()
	})
	for _, key := range running {
		info, err := insp.GetTaskInfo(w.ns.Queue, key)
		require.NoError(t, err)
		_, err = client.Enqueue(asynq.NewTask(info.Type, info.Payload), asynq.Queue(q2), asynq.TaskID(key), asynq.MaxRetry(1000))
		require.NoError(t, err)
	}
	c := startWorker(t, bin, args("worker-C", q2), w.env(t))
	c.waitLine(t, "job complete")
	c.waitLine(t, "job complete")
	for k, s := range w.states(t) {
		require.Equal(t, tasks.StateComplete, s, k)
	}

	// B wakes: its lease is gone, its attempt was taken over; it reports and writes nothing else.
	require.NoError(t, b.cmd.Process.Signal(syscall.SIGCONT))
	stopped = false
	b.waitLine(t, "attempt superseded")

	type row struct {
		No      int
		Worker  string
		Outcome string
	}
	for by, want := range map[string][]row{
		"worker-A": {{1, "worker-A", store.OutcomeLost}, {2, "worker-C", store.OutcomeComplete}},
		"worker-B": {{1, "worker-B", store.OutcomeSuperseded}, {2, "worker-C", store.OutcomeComplete}},
	} {
		atts, err := w.st.AttemptList(ctx, running[by])
		require.NoError(t, err)
		var got []row
		for _, at := range atts {
			got = append(got, row{at.AttemptNo, at.Worker, at.Outcome})
		}
		assert.Equal(t, want, got, "attempts of the job %s held", by)
	}
	assert.Positive(t, testutil.Count(t, w.pool, `SELECT bytes FROM attempts WHERE job_key = $1 AND attempt_no = 1`, running["worker-B"]),
		"B's bytes were added when it reported")

	audit := func() ops.Invariant {
		t.Helper()
		rep, err := ops.New(w.pool).Audit(ctx, ops.AuditConfig{TaskLive: func(context.Context, string, string) (bool, error) { return true, nil }})
		require.NoError(t, err)
		for _, inv := range rep.Invariants {
			if inv.Name == ops.InvAttemptPerStart {
				return inv
			}
		}
		t.Fatalf("audit has no %s", ops.InvAttemptPerStart)
		return ops.Invariant{}
	}
	inv := audit()
	assert.True(t, inv.OK(), "%+v", inv)
	assert.EqualValues(t, 2, inv.Checked)
	_, err = w.pool.Exec(ctx, `DELETE FROM attempts WHERE job_key = $1 AND attempt_no = 1`, running["worker-A"])
	require.NoError(t, err)
	inv = audit()
	assert.Equal(t, []string{running["worker-A"]}, inv.Examples, fmt.Sprintf("%+v", inv))
	assert.NotContains(t, a.log()+b.log()+c.log(), proxyPassword)
}
