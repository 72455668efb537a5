package store_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// BenchmarkGroupCommit measures a start and a commit per job through one GroupCommitter
// at a fixed number of concurrent callers (asynq's concurrency), reporting the mean
// latency of each call as a handler sees it.
func BenchmarkGroupCommit(b *testing.B) {
	for _, bc := range []struct{ conc, inflight int }{{20, 0}, {50, 0}} {
		conc := bc.conc
		name := fmt.Sprintf("c=%d", conc)
		if bc.inflight > 0 {
			name += fmt.Sprintf("/inflight=%d", bc.inflight)
		}
		b.Run(name, func(b *testing.B) {
			ctx := context.Background()
			s := store.New(testutil.PG(b))
			recs := make([]tasks.JobRecord, b.N)
			keys := make([]string, b.N)
			for i := range recs {
				keys[i] = fmt.Sprintf("bench:%07d", i)
				recs[i] = tasks.JobRecord{Key: keys[i], Spec: tasks.Spec{Kind: "page", SourceID: keys[i], Country: "US", Window: "w", ParserVersion: 1}}
			}
			for i := 0; i < b.N; i += 1000 {
				if _, err := s.JobsRecord(ctx, recs[i:min(i+1000, b.N)]); err != nil {
					b.Fatal(err)
				}
			}
			g, err := s.NewGroupCommitterConfig(store.GroupConfig{MaxInFlight: bc.inflight})
			if err != nil {
				b.Fatal(err)
			}
			defer g.Close()
			var next atomic.Int64
			var startNS, commitNS atomic.Int64
			b.ReportAllocs()
			b.ResetTimer()
			var wg sync.WaitGroup
			for range conc {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for {
						i := int(next.Add(1)) - 1
						if i >= b.N {
							return
						}
						t0 := time.Now()
						if _, err := g.JobStart(ctx, store.AttemptStartParams{Key: keys[i], Token: 1, Worker: "w"}); err != nil {
							b.Error(err)
							return
						}
						t1 := time.Now()
						if _, err := g.Commit(ctx, commitParams(keys[i], 1)); err != nil {
							b.Error(err)
							return
						}
						startNS.Add(int64(t1.Sub(t0)))
						commitNS.Add(int64(time.Since(t1)))
					}
				}()
			}
			wg.Wait()
			b.StopTimer()
			b.ReportMetric(float64(startNS.Load())/float64(b.N)/1e6, "ms/start")
			b.ReportMetric(float64(commitNS.Load())/float64(b.N)/1e6, "ms/commit")
			reportBatches(b, g)
		})
	}
}

// BenchmarkCommitSingle measures lone fenced commits (PG.Commit, one statement and one
// transaction per job) from conc concurrent callers: the per-transaction ceiling that
// group commit amortises (issue 11: it sat at ~240/s at any concurrency while the commit
// statement issued NOTIFY, which PostgreSQL serialises across committing transactions).
func BenchmarkCommitSingle(b *testing.B) {
	for _, conc := range []int{1, 20} {
		b.Run(fmt.Sprintf("c=%d", conc), func(b *testing.B) {
			ctx := context.Background()
			s := store.New(testutil.PG(b))
			keys := make([]string, b.N)
			recs := make([]tasks.JobRecord, b.N)
			starts := make([]store.AttemptStartParams, b.N)
			for i := range keys {
				keys[i] = fmt.Sprintf("single:%07d", i)
				recs[i] = tasks.JobRecord{Key: keys[i], Spec: tasks.Spec{Kind: "page", SourceID: keys[i], Country: "US", Window: "w", ParserVersion: 1}}
				starts[i] = store.AttemptStartParams{Key: keys[i], Token: 1, Worker: "w"}
			}
			for i := 0; i < b.N; i += 1000 {
				if _, err := s.JobsRecord(ctx, recs[i:min(i+1000, b.N)]); err != nil {
					b.Fatal(err)
				}
			}
			g, err := s.NewGroupCommitterConfig(store.GroupConfig{})
			if err != nil {
				b.Fatal(err)
			}
			for i := 0; i < b.N; i += 64 { // started through the batch: only commits are timed
				var wg sync.WaitGroup
				for j := i; j < min(i+64, b.N); j++ {
					wg.Add(1)
					go func() {
						defer wg.Done()
						if _, err := g.JobStart(ctx, starts[j]); err != nil {
							b.Error(err)
						}
					}()
				}
				wg.Wait()
			}
			g.Close()
			var next atomic.Int64
			b.ReportAllocs()
			b.ResetTimer()
			var wg sync.WaitGroup
			for range conc {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for {
						i := int(next.Add(1)) - 1
						if i >= b.N {
							return
						}
						if _, err := s.Commit(ctx, commitParams(keys[i], 1)); err != nil {
							b.Error(err)
							return
						}
					}
				}()
			}
			wg.Wait()
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "commits/s")
		})
	}
}

func reportBatches(b *testing.B, g *store.GroupCommitter) {
	st := g.Stats()
	if st.CommitBatches > 0 {
		b.ReportMetric(float64(st.CommitRows)/float64(st.CommitBatches), "jobs/commit-batch")
	}
	b.ReportMetric(float64(st.Busy), "busy-rows")
	if st.CommitBatches > 0 {
		b.ReportMetric(float64(st.Notifies)/float64(st.CommitBatches), "own-notifies/commit-batch")
		b.ReportMetric(float64(st.NotifiesRode)/float64(st.CommitBatches), "riding-notifies/commit-batch")
	}
	if st.StartBatches > 0 {
		b.ReportMetric(float64(st.StartRows)/float64(st.StartBatches), "jobs/start-batch")
	}
}
