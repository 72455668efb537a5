package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
)

// The River peer (modes river and riverfast) is what a user who wants the guarantee we
// give — the result and the job's completion in one transaction — writes by hand with
// River, as River's own example of transactional completion shows
// (example_complete_job_within_tx_test.go, "JobCompleteTx" in River's docs): a worker
// whose Work fetches the page exactly as the asynq + colly peer does (peerFetch: a new
// sticky session and a new colly.NewCollector() with colly's defaults per job, through the
// same proxy), then begins a transaction on the pgxpool, runs the same INSERT and
// river.JobCompleteTx, and commits. The jobs are River jobs in River's own tables (created
// with rivermigrate, River's documented way), inserted with Client.InsertMany before the
// clock starts.
//
// Two rows, the same code:
//   - river: River's defaults (river.Config sets only Queues, with MaxWorkers = the run's
//     concurrency, Workers and a quiet Logger), i.e. FetchCooldown 100 ms and
//     FetchPollInterval 1 s.
//   - riverfast: River at its fastest documented poll. River's Config docs
//     (pkg.go.dev/github.com/riverqueue/river#Config) say of FetchCooldown "the minimum
//     amount of time to wait between fetches of new jobs … Throughput is limited by this
//     value", and the package documents the floors FetchCooldownMin = 1 ms and
//     FetchPollIntervalMin = 1 ms (NewClient refuses less, and FetchPollInterval below
//     FetchCooldown); riverfast sets both to those minimums.

// riverPageArgs is the River job's arguments: the job key the result is stored under.
type riverPageArgs struct {
	Key string `json:"key"`
}

// Kind is River's job kind.
func (riverPageArgs) Kind() string { return "page" }

// riverPageWorker fetches the page, stores the result and completes the job in one
// transaction.
type riverPageWorker struct {
	river.WorkerDefaults[riverPageArgs]
	cfg  peerConfig
	done func() // called after each committed job
}

func (w *riverPageWorker) Work(ctx context.Context, job *river.Job[riverPageArgs]) error {
	n, err := peerFetch(w.cfg.proxyAddr, w.cfg.proxyUser, w.cfg.proxyPass, w.cfg.page, false)
	if err != nil {
		return err
	}
	data, err := jsonLen(n)
	if err != nil {
		return err
	}
	tx, err := w.cfg.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	if _, err := tx.Exec(ctx, peerInsert, job.Args.Key, data); err != nil {
		return err
	}
	if _, err := river.JobCompleteTx[*riverpgxv5.Driver](ctx, tx, job); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	w.done()
	return nil
}

// riverConfig is the River client's configuration of a run: River's defaults, or (fast)
// its documented minimum FetchCooldown and FetchPollInterval.
func riverConfig(s runSpec, workers *river.Workers, fast bool) *river.Config {
	cfg := &river.Config{
		Queues:  map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: s.Conc}},
		Workers: workers,
		Logger:  slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
	if fast {
		cfg.FetchCooldown = river.FetchCooldownMin
		cfg.FetchPollInterval = river.FetchPollIntervalMin
	}
	return cfg
}

// runRiver is the River peer's run: River's migrations and the N jobs before the clock;
// the clock runs from Client.Start to the N-th committed job.
func runRiver(ctx context.Context, s runSpec, pool *pgxpool.Pool, rdb *redis.Client, rrt *redisCounter, pgrt *pgCounter) (runResult, error) {
	driver := riverpgxv5.New(pool)
	migrator, err := rivermigrate.New(driver, nil)
	if err != nil {
		return runResult{}, err
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return runResult{}, fmt.Errorf("river migrations: %w", err)
	}
	// The results' foreign key wants a jobs row per key (our schema, not River's): written
	// here with one statement, outside the clock, as the asynq peer's come from the enqueue.
	if _, err := pool.Exec(ctx, `INSERT INTO jobs (key, kind, source_id, country, "window", parser_version)
		SELECT 'page:p-' || i || ':US:2026-04-23:v1', 'page', 'p-' || i, 'US', '2026-04-23', 1 FROM generate_series(0, $1 - 1) AS i`, s.N); err != nil {
		return runResult{}, err
	}

	var done atomic.Int64
	finished := make(chan struct{})
	workers := river.NewWorkers()
	pc := peerConfig{pool: pool, page: s.Page, proxyAddr: s.ProxyAddr, proxyUser: s.ProxyUser, proxyPass: s.ProxyPass, conc: s.Conc}
	if err := river.AddWorkerSafely(workers, &riverPageWorker{cfg: pc, done: func() {
		if done.Add(1) == int64(s.N) {
			close(finished)
		}
	}}); err != nil {
		return runResult{}, err
	}
	client, err := river.NewClient(driver, riverConfig(s, workers, s.Mode == "riverfast"))
	if err != nil {
		return runResult{}, err
	}
	params := make([]river.InsertManyParams, 0, 500)
	for i := 0; i < s.N; i += 500 {
		params = params[:0]
		for j := i; j < min(i+500, s.N); j++ {
			params = append(params, river.InsertManyParams{Args: riverPageArgs{Key: fmt.Sprintf("page:p-%d:US:2026-04-23:v1", j)}})
		}
		if _, err := client.InsertMany(ctx, params); err != nil {
			return runResult{}, err
		}
	}

	m := startMeasure(ctx, rdb, rrt, pgrt)
	if err := client.Start(ctx); err != nil {
		return runResult{}, err
	}
	stop := func() { _ = client.Stop(context.WithoutCancel(ctx)) }
	select {
	case <-finished:
	case <-time.After(10 * time.Minute):
		stop()
		return runResult{}, fmt.Errorf("only %d of %d River jobs done", done.Load(), s.N)
	case <-ctx.Done():
		stop()
		return runResult{}, ctx.Err()
	}
	res := m.stopAt(ctx, s.N, time.Now())
	stop()

	var stored, completed int
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM results), (SELECT count(*) FROM river_job WHERE state = 'completed')`).Scan(&stored, &completed); err != nil {
		return runResult{}, err
	}
	if stored != s.N || completed != s.N {
		return runResult{}, fmt.Errorf("%s/peer: %d results stored and %d River jobs completed, want %d", s.Mode, stored, completed, s.N)
	}
	return res, nil
}

// jsonLen is the result's data, as the asynq peer stores it.
func jsonLen(n int) ([]byte, error) {
	if n < 0 {
		return nil, errors.New("peer: no response")
	}
	return json.Marshal(map[string]int{"len": n})
}
