package handlers_test

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// BenchmarkProtocol is the runner's per-attempt cost with no fetch at all: every step of
// ProcessTask on real Redis and PostgreSQL (payload decode, lease claim, fenced attempt
// start, keeper, a unit whose one step stages a value, parse, fenced commit of job + result
// + outbox + attempt, release), called directly (no asynq server), so that ns/op, B/op and
// allocs/op are the runner's own plus its clients'.
//   - Serial: one job at a time, one statement per start and commit (NoGroupCommit).
//   - Parallel20: 20 goroutines through the default group committer.
//
// Parallel20 also reports how long a job waited for its grouped attempt start and commit
// (start-p50-ms, start-p99-ms, commit-p50-ms, commit-p99-ms: from the call to its answer).
func BenchmarkProtocol(b *testing.B) {
	for _, mode := range []string{"Serial", "Parallel20"} {
		b.Run(mode, func(b *testing.B) {
			r := newBenchRig(b)
			var timed *timedCommitter
			cfg := handlers.Config{
				Store: r.st, NoGroupCommit: mode == "Serial", Redis: r.ns.Client, Provider: r.prov, KeyPrefix: r.ns.Prefix,
				Collector: sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), IgnoreRobotsTxt: true},
				Logger:    discardLogger(),
			}
			if mode != "Serial" {
				g, err := r.st.NewGroupCommitterConfig(store.GroupConfig{})
				if err != nil {
					b.Fatal(err)
				}
				defer g.Close()
				timed = &timedCommitter{g: g}
				cfg.Committer = timed
			}
			reg, err := handlers.NewRegistry(cfg)
			if err != nil {
				b.Fatal(err)
			}
			defer reg.Close()
			if err := reg.Register("page", stageOnlyWorkflow, pageParse); err != nil {
				b.Fatal(err)
			}
			ts := protocolTasks(b, r, b.N)
			ctx := context.Background()
			var failed atomic.Int64
			b.ReportAllocs()
			cpu0 := processCPU()
			b.ResetTimer()
			if mode == "Serial" {
				for _, t := range ts {
					if err := reg.ProcessTask(ctx, t); err != nil {
						b.Fatal(err)
					}
				}
			} else {
				var next atomic.Int64
				b.SetParallelism((20 + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						if err := reg.ProcessTask(ctx, ts[next.Add(1)-1]); err != nil {
							failed.Add(1)
						}
					}
				})
			}
			b.StopTimer()
			b.ReportMetric(float64((processCPU()-cpu0).Microseconds())/float64(b.N), "cpu-µs/op")
			if timed != nil {
				timed.report(b)
			}
			if n := failed.Load(); n > 0 {
				b.Fatalf("%d deliveries failed", n)
			}
			if n := testutil.Count(b, r.st.Pool(), `SELECT count(*) FROM jobs WHERE state = 'complete'`); n != b.N {
				b.Fatalf("%d of %d jobs complete", n, b.N)
			}
		})
	}
}

// processCPU is the CPU time (user + system) this process used so far: the runner's and
// its clients', not the servers'.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// stageOnlyWorkflow is a unit whose one step fetches nothing and stages a length.
func stageOnlyWorkflow(tasks.Payload) (*sessions.Unit, error) {
	return &sessions.Unit{Name: "page", Steps: []sessions.Step{{Name: "stage", Safe: true,
		Run: func(_ context.Context, sc *sessions.StepContext) error { return sc.Staging.Put("page", 8192) }}}}, nil
}

// protocolTasks records n page jobs and returns their tasks as the enqueuer builds them.
func protocolTasks(b *testing.B, r *benchRig, n int) []*asynq.Task {
	recs := make([]tasks.JobRecord, n)
	ts := make([]*asynq.Task, n)
	for i := range recs {
		spec, err := tasks.Spec{Kind: "page", SourceID: fmt.Sprintf("p-%d", i), Country: "US", Window: "2026-04-23", ParserVersion: 1}.Normalize()
		if err != nil {
			b.Fatal(err)
		}
		key, err := spec.Key()
		if err != nil {
			b.Fatal(err)
		}
		recs[i] = tasks.JobRecord{Key: key, Spec: spec}
		payload, err := tasks.EncodePayload(tasks.Payload{Key: key, Spec: spec}, tasks.PayloadV2)
		if err != nil {
			b.Fatal(err)
		}
		ts[i] = asynq.NewTask("page", payload)
	}
	for i := 0; i < n; i += 1000 {
		if _, err := r.st.JobsRecord(context.Background(), recs[i:min(i+1000, n)]); err != nil {
			b.Fatal(err)
		}
	}
	return ts
}

// timedCommitter times each grouped attempt start and commit of the runner, from the
// call to its answer: the wait a job spends in the group committer.
type timedCommitter struct {
	g             *store.GroupCommitter
	mu            sync.Mutex
	start, commit []time.Duration
}

func (c *timedCommitter) Commit(ctx context.Context, p store.CommitParams) (store.CommitResult, error) {
	defer c.took(&c.commit, time.Now())
	return c.g.Commit(ctx, p)
}

func (c *timedCommitter) JobStart(ctx context.Context, p store.AttemptStartParams) (store.StartedAttempt, error) {
	defer c.took(&c.start, time.Now())
	return c.g.JobStart(ctx, p)
}

// took records the time since t0 in list.
func (c *timedCommitter) took(list *[]time.Duration, t0 time.Time) {
	d := time.Since(t0)
	c.mu.Lock()
	*list = append(*list, d)
	c.mu.Unlock()
}

// report adds the p50 and p99 of both waits, in milliseconds, and the mean batch sizes.
func (c *timedCommitter) report(b *testing.B) {
	c.mu.Lock()
	defer c.mu.Unlock()
	q := func(ds []time.Duration, p float64) float64 {
		if len(ds) == 0 {
			return 0
		}
		s := slices.Clone(ds)
		slices.Sort(s)
		return float64(s[min(len(s)-1, int(p*float64(len(s))))].Microseconds()) / 1000
	}
	b.ReportMetric(q(c.start, 0.5), "start-p50-ms")
	b.ReportMetric(q(c.start, 0.99), "start-p99-ms")
	b.ReportMetric(q(c.commit, 0.5), "commit-p50-ms")
	b.ReportMetric(q(c.commit, 0.99), "commit-p99-ms")
	st := c.g.Stats()
	if st.CommitBatches > 0 && st.StartBatches > 0 {
		b.ReportMetric(float64(st.CommitRows)/float64(st.CommitBatches), "commit-rows/stmt")
		b.ReportMetric(float64(st.StartRows)/float64(st.StartBatches), "start-rows/stmt")
	}
}
