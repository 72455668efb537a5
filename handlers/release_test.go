package handlers_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/tasks"
)

// recv returns the next value of ch; the fail-safe (handlers.WaitTimeout) only ends a test
// that would otherwise hang (it is not what the test waits for).
func recv[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(handlers.WaitTimeout):
		t.Fatal("fail-safe: " + handlers.NotHappened(what, handlers.WaitTimeout))
		var zero T
		return zero
	}
}

// leaseScripts is a go-redis hook that reports the lease commands run on one job key (the
// runner's take is a SET, its release after a commit a DEL) and holds the first release
// until gate is closed.
type leaseScripts struct {
	key      string
	events   chan string
	gate     chan struct{}
	once     sync.Once
	openOnce sync.Once
}

// open lets the held release go (again: a no-op). Registered as a cleanup after the
// registry's, so that a failed test does not leave Close waiting for a held release.
func (h *leaseScripts) open() { h.openOnce.Do(func() { close(h.gate) }) }

func (h *leaseScripts) DialHook(next redis.DialHook) redis.DialHook { return next }

// ours: cmd is a command on the job's lease key.
func (h *leaseScripts) ours(cmd redis.Cmder) bool {
	args := cmd.Args()
	return len(args) >= 2 && strings.HasSuffix(fmt.Sprint(args[1]), "{"+h.key+"}:lease")
}

// release reports a release and holds the first one until gate is closed.
func (h *leaseScripts) release() {
	h.events <- "release"
	first := false
	h.once.Do(func() { first = true })
	if first {
		<-h.gate
	}
}

// ProcessPipelineHook sees the releases of committed leases (pipelined by the registry's
// flusher).
func (h *leaseScripts) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if !slices.ContainsFunc(cmds, func(c redis.Cmder) bool { return c.Name() == "del" && h.ours(c) }) {
			return next(ctx, cmds)
		}
		h.release()
		err := next(ctx, cmds)
		h.events <- "released"
		return err
	}
}

// ProcessHook sees the take (SET) and a release sent on its own (DEL).
func (h *leaseScripts) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if !h.ours(cmd) {
			return next(ctx, cmd)
		}
		switch cmd.Name() {
		case "set":
			h.events <- "claim"
		case "del":
			h.release()
		}
		err := next(ctx, cmd)
		if cmd.Name() == "del" {
			h.events <- "released"
		}
		return err
	}
}

// hookedRegistry returns a registry on the rig whose Redis client carries a leaseScripts
// hook for key.
func (r *rig) hookedRegistry(t *testing.T, key string, mutate func(*handlers.Config)) (*handlers.Registry, *leaseScripts) {
	t.Helper()
	hook := &leaseScripts{key: key, events: make(chan string, 16), gate: make(chan struct{})}
	opts := *r.ns.Client.Options()
	client := redis.NewClient(&opts)
	t.Cleanup(func() { _ = client.Close() })
	client.AddHook(hook)
	reg := r.registry(t, func(c *handlers.Config) {
		c.Redis = client
		if mutate != nil {
			mutate(c)
		}
	})
	t.Cleanup(hook.open) // after the registry's cleanup is registered: runs before Close
	return reg, hook
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
	reg, hook := r.hookedRegistry(t, key, nil)

	first := make(chan error, 1)
	go func() { first <- reg.ProcessTask(ctx, task) }()
	require.Equal(t, "claim", recv(t, hook.events, "the first claim"))
	require.Equal(t, "release", recv(t, hook.events, "the first release, held"))
	require.NoError(t, recv(t, first, "ProcessTask returns while its release is held"))
	requireState(t, r.st, key, tasks.StateComplete)

	second := make(chan error, 1)
	go func() { second <- reg.ProcessTask(ctx, task) }()
	closed := make(chan struct{})
	go func() { handlers.WaitReleases(reg); close(closed) }()
	hook.open()
	require.Equal(t, "released", recv(t, hook.events, "the first release ends"))
	require.Equal(t, "claim", recv(t, hook.events, "the second delivery claims only after the release"))
	require.NoError(t, recv(t, second, "the second delivery is acknowledged: the job is complete"))
	recv[struct{}](t, closed, "releases in flight are waited for")
	reg.Close()

	n, err := r.ns.Client.Exists(ctx, r.ns.Prefix+"{"+key+"}:lease", r.ns.Prefix+"{"+key+"}:fence").Result()
	require.NoError(t, err)
	require.Zero(t, n, "no lease, no fence counter after Close")
}

// TestReleaseAfterClose: a job that commits after Close was called (a handler still
// running past the asynq server's drain timeout) releases its lease in the delivery
// itself — Close, already returned, waits for nothing more — so ProcessTask returns only
// after its release ended, and no key stays behind.
func TestReleaseAfterClose(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	key, task := r.job(t, "sku-14")
	// Without the registry's own group committer, which Close stops (a process's own
	// committer outlives the registry). One ordered stream of what happens: the hook's
	// events and ProcessTask's return.
	reg, hook := r.hookedRegistry(t, key, func(c *handlers.Config) { c.NoGroupCommit = true })
	reg.Close()
	go func() {
		err := reg.ProcessTask(ctx, task)
		if err != nil {
			t.Error(err)
		}
		hook.events <- "returned"
	}()
	require.Equal(t, "claim", recv(t, hook.events, "the claim"))
	require.Equal(t, "release", recv(t, hook.events, "the release, held"))
	hook.open()
	require.Equal(t, "released", recv(t, hook.events, "the release ends"))
	require.Equal(t, "returned", recv(t, hook.events, "ProcessTask returns after its release"))
	n, err := r.ns.Client.Exists(ctx, r.ns.Prefix+"{"+key+"}:lease", r.ns.Prefix+"{"+key+"}:fence").Result()
	require.NoError(t, err)
	require.Zero(t, n, "no lease, no fence counter")
}

// delCounter records, per pipeline that deletes anything, how many DELs it carried.
type delCounter struct {
	mu    sync.Mutex
	sizes []int
}

func (d *delCounter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (d *delCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return next
}
func (d *delCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		n := 0
		for _, c := range cmds {
			if c.Name() == "del" {
				n++
			}
		}
		if n > 0 {
			d.mu.Lock()
			d.sizes = append(d.sizes, n)
			d.mu.Unlock()
		}
		return next(ctx, cmds)
	}
}

// TestCommittedReleasesBatched: the releases of committed leases queued while one pipeline
// is on its way go together in the next one (one round trip for many jobs), and every job
// still ends without a Redis key.
func TestCommittedReleasesBatched(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	first, task := r.job(t, "sku-20")
	counter := &delCounter{}
	reg, hook := r.hookedRegistry(t, first, nil)
	// The counter sees every pipeline the registry's client sends (the hooks share it).
	handlers.RedisOf(reg).AddHook(counter)

	require.NoError(t, reg.ProcessTask(ctx, task))
	require.Equal(t, "claim", recv(t, hook.events, "the first claim"))
	require.Equal(t, "release", recv(t, hook.events, "the first release, held"))
	// The flusher is held in the first pipeline: these queue behind it.
	const more = 6
	keys := []string{first}
	for i := range more {
		key, task := r.job(t, fmt.Sprintf("sku-%d", 21+i))
		keys = append(keys, key)
		require.NoError(t, reg.ProcessTask(ctx, task))
	}
	hook.open()
	require.Equal(t, "released", recv(t, hook.events, "the first release ends"))
	handlers.WaitReleases(reg)
	counter.mu.Lock()
	sizes := slices.Clone(counter.sizes)
	counter.mu.Unlock()
	require.Equal(t, []int{1, more}, sizes, "DELs per pipeline: the held one, then all that queued behind it")
	for _, key := range keys {
		n, err := r.ns.Client.Exists(ctx, r.ns.Prefix+"{"+key+"}:lease", r.ns.Prefix+"{"+key+"}:fence").Result()
		require.NoError(t, err)
		require.Zero(t, n, key)
	}
}
