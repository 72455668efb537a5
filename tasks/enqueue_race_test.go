package tasks

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"os"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// These tests inject the races of the conflict path between asynq calls. They live inside
// the package (testutil imports store, which imports tasks) and so use the shared Redis
// directly, on a queue of their own that is deleted afterwards.

// pendingRecorder records nothing and reports every job as an existing pending row.
type pendingRecorder struct{}

func (pendingRecorder) JobsRecord(_ context.Context, records []JobRecord) ([]JobRecordResult, error) {
	out := make([]JobRecordResult, len(records))
	for i, r := range records {
		out[i] = JobRecordResult{Key: r.Key, State: StatePending}
	}
	return out, nil
}

// hookedInspector runs a hook before the real call, to change the task under the Enqueuer.
type hookedInspector struct {
	real         *asynq.Inspector
	beforeGet    func()
	beforeDelete func() error // a non-nil error is returned instead of deleting
}

func (h *hookedInspector) GetTaskInfo(queue, id string) (*asynq.TaskInfo, error) {
	if h.beforeGet != nil {
		h.beforeGet()
	}
	return h.real.GetTaskInfo(queue, id)
}

func (h *hookedInspector) DeleteTask(queue, id string) error {
	if h.beforeDelete != nil {
		if err := h.beforeDelete(); err != nil {
			return err
		}
	}
	return h.real.DeleteTask(queue, id)
}

type raceBundle struct {
	queue  string
	client *asynq.Client
	insp   *asynq.Inspector
	hooked *hookedInspector
	enq    *Enqueuer
	spec   Spec
	key    string
}

func setupRace(t *testing.T) *raceBundle {
	t.Helper()
	addr := os.Getenv("IDEMSCRAPE_TEST_REDIS")
	if addr == "" {
		addr = "127.0.0.1:6379"
	}
	opt := asynq.RedisClientOpt{Addr: addr}
	id := make([]byte, 4)
	_, _ = rand.Read(id)
	queue := "trace" + hex.EncodeToString(id)
	client := asynq.NewClient(opt)
	insp := asynq.NewInspector(opt)
	if err := client.Ping(); err != nil {
		t.Fatalf("Redis is not reachable at %s: %v", addr, err)
	}
	t.Cleanup(func() {
		_ = insp.DeleteQueue(queue, true)
		_ = insp.Close()
		_ = client.Close()
	})
	enq, err := NewEnqueuer(client, pendingRecorder{}, &EnqueuerConfig{Queue: queue})
	require.NoError(t, err)
	hooked := &hookedInspector{real: insp}
	enq.insp = hooked
	spec := Spec{Kind: "catalog", URL: "https://shop.example.com/p/1", Country: "US", Window: "w1", ParserVersion: 1}
	key, err := spec.Key()
	require.NoError(t, err)
	return &raceBundle{queue: queue, client: client, insp: insp, hooked: hooked, enq: enq, spec: spec, key: key}
}

// putTask enqueues the job's task directly, as another Enqueuer would.
func (b *raceBundle) putTask(t *testing.T) {
	t.Helper()
	_, err := b.client.Enqueue(asynq.NewTask("catalog", []byte("{}")), asynq.TaskID(b.key), asynq.Queue(b.queue))
	require.NoError(t, err)
}

func (b *raceBundle) state(t *testing.T) asynq.TaskState {
	t.Helper()
	info, err := b.insp.GetTaskInfo(b.queue, b.key)
	require.NoError(t, err)
	return info.State
}

// setupArchivedTask is setupRace with the job's task put and archived, as asynq leaves it
// after its last retry.
func setupArchivedTask(t *testing.T) *raceBundle {
	t.Helper()
	b := setupRace(t)
	b.putTask(t)
	require.NoError(t, b.insp.ArchiveTask(b.queue, b.key))
	return b
}

// assertEnqueued enqueues the job and checks the outcome, and that its task is pending
// afterwards.
func (b *raceBundle) assertEnqueued(t *testing.T, want Outcome, msgAndArgs ...any) {
	t.Helper()
	res, err := b.enq.Enqueue(context.Background(), b.spec)
	require.NoError(t, err)
	assert.Equal(t, want, res.Outcome, msgAndArgs...)
	assert.Equal(t, asynq.TaskStatePending, b.state(t))
}

func TestEnqueueConflictRaces(t *testing.T) {
	ctx := context.Background()

	t.Run("LiveTaskAlreadyQueued", func(t *testing.T) {
		b := setupRace(t)
		b.putTask(t)
		b.assertEnqueued(t, AlreadyQueued)
	})

	t.Run("TaskVanishedBeforeInspect", func(t *testing.T) {
		b := setupRace(t)
		b.putTask(t)
		b.hooked.beforeGet = func() {
			b.hooked.beforeGet = nil
			require.NoError(t, b.insp.DeleteTask(b.queue, b.key)) // its handler succeeded meanwhile
		}
		b.assertEnqueued(t, Requeued, "the task is gone: enqueue it again")
	})

	t.Run("ArchivedThenConcurrentRepair", func(t *testing.T) {
		b := setupArchivedTask(t)
		// Another Enqueuer repairs the job between our inspection and our delete: we delete
		// its fresh task, enqueue ours, and exactly one pending task remains.
		b.hooked.beforeDelete = func() error {
			b.hooked.beforeDelete = nil
			require.NoError(t, b.insp.DeleteTask(b.queue, b.key))
			b.putTask(t)
			return nil
		}
		b.assertEnqueued(t, Repaired)
		pending, err := b.insp.ListPendingTasks(b.queue)
		require.NoError(t, err)
		assert.Len(t, pending, 1)
	})

	t.Run("ArchivedDeletedByOtherRepairer", func(t *testing.T) {
		b := setupArchivedTask(t)
		// The other repairer deleted and re-enqueued before our delete: our DeleteTask then
		// meets a live task it must not take for archived; here it deletes it (asynq has no
		// conditional delete) and our enqueue restores it.
		b.hooked.beforeGet = func() {
			b.hooked.beforeGet = nil
			require.NoError(t, b.insp.DeleteTask(b.queue, b.key))
			b.putTask(t)
		}
		b.assertEnqueued(t, AlreadyQueued, "the other repairer's task is live")
	})

	t.Run("DeleteKeepsFailing", func(t *testing.T) {
		b := setupArchivedTask(t)
		b.hooked.beforeDelete = func() error { return errors.New("boom") }
		_, err := b.enq.Enqueue(ctx, b.spec)
		require.ErrorContains(t, err, "still in conflict")
		require.ErrorContains(t, err, "boom")
		assert.Equal(t, asynq.TaskStateArchived, b.state(t))
	})
}
