package main

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
)

// runB3 measures commits alone, from s.Conc goroutines: ours is the runner's fenced commit
// (job + result + outbox + attempt) — one statement per job in b3, through a
// store.GroupCommitter in b3g — and the peer one INSERT … ON CONFLICT DO NOTHING per job.
// The jobs rows and, for ours, their attempt starts are written before the clock starts.
func runB3(ctx context.Context, s runSpec, st *store.PG, pool *pgxpool.Pool, rdb *redis.Client, rrt *redisCounter, pgrt *pgCounter) (runResult, error) {
	keys := make([]string, s.N)
	recs := make([]tasks.JobRecord, s.N)
	for i := range recs {
		keys[i] = fmt.Sprintf("page:p-%d:US:w:v1", i)
		recs[i] = tasks.JobRecord{Key: keys[i], Spec: tasks.Spec{Kind: "page", SourceID: fmt.Sprintf("p-%d", i), Country: "US", Window: "w", ParserVersion: 1}}
	}
	for i := 0; i < s.N; i += 1000 {
		if _, err := st.JobsRecord(ctx, recs[i:min(i+1000, s.N)]); err != nil {
			return runResult{}, err
		}
	}
	var do func(ctx context.Context, key string) error
	if s.Side == "ours" {
		if err := parallel(ctx, s.Conc, keys, func(ctx context.Context, k string) error {
			_, err := st.JobStart(ctx, store.AttemptStartParams{Key: k, Token: 1})
			return err
		}); err != nil {
			return runResult{}, err
		}
		var c handlers.Committer = st
		if s.Mode == "b3g" {
			g := st.NewGroupCommitter(0, 0)
			defer g.Close()
			c = g
		}
		do = func(ctx context.Context, k string) error {
			_, err := c.Commit(ctx, store.CommitParams{Key: k, Token: 1, ObservationKey: k, ParserVersion: 1,
				Data: json.RawMessage(`{"len":8192}`), EventKey: handlers.EventKey(k), Topic: "page", EventPayload: json.RawMessage(`{}`), Bytes: 8400})
			return err
		}
	} else {
		do = func(ctx context.Context, k string) error { return insertLen(ctx, pool, k, 8192) }
	}
	m := startMeasure(ctx, rdb, rrt, pgrt)
	if err := parallel(ctx, s.Conc, keys, do); err != nil {
		return runResult{}, err
	}
	res := m.stop(ctx, s.N)
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM results`).Scan(&n); err != nil {
		return runResult{}, err
	}
	if n != s.N {
		return runResult{}, fmt.Errorf("%s/%s: %d of %d results stored", s.Mode, s.Side, n, s.N)
	}
	return res, nil
}

// parallel runs f for every key from conc goroutines and returns the first error.
func parallel(ctx context.Context, conc int, keys []string, f func(context.Context, string) error) error {
	ch := make(chan string)
	var wg sync.WaitGroup
	var once sync.Once
	var first error
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k := range ch {
				if err := f(ctx, k); err != nil {
					once.Do(func() { first = err; cancel() })
				}
			}
		}()
	}
	for _, k := range keys {
		select {
		case ch <- k:
		case <-ctx.Done():
		}
	}
	close(ch)
	wg.Wait()
	return first
}
