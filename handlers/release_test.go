package handlers_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/tasks"
)

// recv returns the next value of ch; the fail-safe only ends a test that would otherwise
// hang (it is not what the test waits for).
func recv[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(time.Minute):
		t.Fatalf("fail-safe: %s never happened", what)
		var zero T
		return zero
	}
}

// leaseScripts is a go-redis hook that reports the lease scripts run on one job key (a
// claim has 2 keys and 4 arguments, a release 2 keys and 3) and holds the first release
// until gate is closed.
type leaseScripts struct {
	key    string
	events chan string
	gate   chan struct{}
	once   sync.Once
}

func (h *leaseScripts) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *leaseScripts) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *leaseScripts) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		args := cmd.Args()
		if (cmd.Name() != "evalsha" && cmd.Name() != "eval") || len(args) < 4 || !strings.Contains(args[3].(string), "{"+h.key+"}") {
			return next(ctx, cmd)
		}
		switch len(args) {
		case 9:
			h.events <- "claim"
		case 8:
			h.events <- "release"
			first := false
			h.once.Do(func() { first = true })
			if first {
				<-h.gate
			}
		}
		err := next(ctx, cmd)
		if len(args) == 8 {
			h.events <- "released"
		}
		return err
	}
}

// TestCommittedLeaseReleasedInBackground: the delivery of a job that committed returns
// without waiting for its lease release (ProcessTask returns while the release is held);
// a second delivery of the same job to the same registry waits for that release, then
// claims and is acknowledged as complete (no lease_busy retry); Close waits for releases in
// flight; and afterwards the job leaves no Redis key.
func TestCommittedLeaseReleasedInBackground(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	key, task := r.job(t, "sku-13")
	hook := &leaseScripts{key: key, events: make(chan string, 16), gate: make(chan struct{})}
	opts := *r.ns.Client.Options()
	client := redis.NewClient(&opts)
	t.Cleanup(func() { _ = client.Close() })
	client.AddHook(hook)
	reg := r.registry(t, func(c *handlers.Config) { c.Redis = client })

	first := make(chan error, 1)
	go func() { first <- reg.ProcessTask(ctx, task) }()
	require.Equal(t, "claim", recv(t, hook.events, "the first claim"))
	require.Equal(t, "release", recv(t, hook.events, "the first release, held"))
	require.NoError(t, recv(t, first, "ProcessTask returns while its release is held"))
	job, err := r.st.JobGet(ctx, key)
	require.NoError(t, err)
	require.Equal(t, tasks.StateComplete, job.State)

	second := make(chan error, 1)
	go func() { second <- reg.ProcessTask(ctx, task) }()
	closed := make(chan struct{})
	go func() { handlers.WaitReleases(reg); close(closed) }()
	close(hook.gate)
	require.Equal(t, "released", recv(t, hook.events, "the first release ends"))
	require.Equal(t, "claim", recv(t, hook.events, "the second delivery claims only after the release"))
	require.NoError(t, recv(t, second, "the second delivery is acknowledged: the job is complete"))
	recv[struct{}](t, closed, "releases in flight are waited for")
	reg.Close()

	n, err := r.ns.Client.Exists(ctx, r.ns.Prefix+"{"+key+"}:lease", r.ns.Prefix+"{"+key+"}:fence").Result()
	require.NoError(t, err)
	require.Zero(t, n, "no lease, no fence counter after Close")
}
