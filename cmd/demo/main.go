// Command demo runs idemscrape's main job end to end on this machine: it (re)creates the
// database idemscrape_demo, enqueues a small catalog (each product under several spellings
// of its key fields, and everything twice), and runs a real asynq worker with the runner
// against a local fake shop behind a local fake residential proxy whose devices disconnect
// now and then. It prints what happened: deduplicated enqueues, attempts, session replays,
// quarantined halves, exactly one result and one outbox event per job — and then publishes
// the events to a Redis Stream through a dispatcher that crashes once between XADD and
// mark-sent, and consumes them into a table with exactly-once effect.
//
//	make demo            (starts PostgreSQL and Redis if needed)
//	go run ./cmd/demo -pg postgres://postgres@127.0.0.1:5432/postgres -redis 127.0.0.1:6379
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/outbox"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

const (
	demoDB     = "idemscrape_demo"
	demoQueue  = "idemscrape-demo"
	demoPrefix = "idemscrape-demo:"
	products   = 40
)

func main() {
	pgDSN := flag.String("pg", "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable", "PostgreSQL admin DSN (the demo creates its own database)")
	redisAddr := flag.String("redis", "127.0.0.1:6379", "Redis address")
	disconnect := flag.Float64("disconnect", 0.15, "probability that the fake proxy's device drops a request")
	flag.Parse()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	tb := &demoTB{}
	defer tb.cleanup()
	if err := run(ctx, tb, *pgDSN, *redisAddr, *disconnect); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		tb.cleanup()
		os.Exit(1)
	}
}

func run(ctx context.Context, tb *demoTB, adminDSN, redisAddr string, disconnect float64) error {
	pool, err := freshDatabase(ctx, adminDSN)
	if err != nil {
		return err
	}
	defer pool.Close()
	if _, err := store.Migrate(ctx, pool, nil); err != nil {
		return err
	}
	st := store.New(pool)
	rdb := redis.NewClient(&redis.Options{Addr: redisAddr})
	defer rdb.Close()
	if err := clearRedis(ctx, rdb); err != nil {
		return err
	}

	// The world: a shop whose price API needs the cookie and token of the same exit, and a
	// residential proxy gateway in Oxylabs' username format whose devices drop out.
	site := testutil.NewFakeSite(tb, testutil.FakeSiteConfig{Seed: 7, Products: products, StrictExit: true})
	const password = "demo-password-never-printed"
	proxy := testutil.NewFakeProxy(tb, testutil.FakeProxyConfig{Seed: 7, Format: testutil.ProxyFormatOxylabs, User: "demo", Password: password, DisconnectProb: disconnect})
	provider, err := sessions.Oxylabs("demo", password)
	if err != nil {
		return err
	}
	if provider, err = provider.WithGateway(proxy.Addr); err != nil {
		return err
	}
	fmt.Printf("fake shop %s, fake proxy %s (%s format, %.0f%% of requests lose their device)\n\n",
		site.URL, provider.Gateway(), provider.Name(), disconnect*100)

	// 1. Enqueue: every product under two spellings, the whole plan twice.
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: redisAddr})
	defer client.Close()
	insp := asynq.NewInspector(asynq.RedisClientOpt{Addr: redisAddr})
	defer insp.Close()
	// The demo's shop and proxy live on loopback: relax the destination policy here, in
	// one place, for the enqueuer and the fetch guard alike.
	destinations := tasks.LoopbackPolicy()
	enq, err := tasks.NewEnqueuer(client, st, &tasks.EnqueuerConfig{Queue: demoQueue, Inspector: insp, Destinations: destinations})
	if err != nil {
		return err
	}
	var specs []tasks.Spec
	for i := 1; i <= products; i++ {
		base := tasks.Spec{Kind: catalog.Kind, SourceID: fmt.Sprintf("sku-%d", i), Country: "US", Window: "2026-04-23", ParserVersion: 1}
		lower := base
		lower.Country = "us"
		specs = append(specs, base, lower)
	}
	outcomes := map[tasks.Outcome]int{}
	for round := 0; round < 2; round++ {
		res, err := enq.EnqueueMany(ctx, specs)
		if err != nil {
			return err
		}
		for _, r := range res {
			outcomes[r.Outcome]++
		}
	}
	fmt.Printf("enqueued %d specs: %d created, %d already queued\n", 2*len(specs), outcomes[tasks.Created], outcomes[tasks.AlreadyQueued])

	bad := tasks.Spec{Kind: catalog.Kind, URL: "https://user:secret@shop.example/p/1", Country: "US", Window: "2026-04-23", ParserVersion: 1}
	_, err = enq.Enqueue(ctx, bad)
	fmt.Printf("a bad spec is refused before anything is stored: %v\n\n", err)

	// 2. Work: a real asynq server, the runner in front of every catalog task.
	reg, err := handlers.NewRegistry(handlers.Config{
		Store: st, Redis: rdb, Provider: provider, KeyPrefix: demoPrefix,
		Collector:          sessions.CollectorConfig{Guard: sessions.NewGuard(destinations)},
		MaxSessionRestarts: 3,
		Retry:              handlers.RetryConfig{Policies: map[tasks.Category]handlers.Policy{tasks.CategorySessionLost: {Retry: true, Base: 50 * time.Millisecond, Max: 200 * time.Millisecond}}},
		Logger:             slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		return err
	}
	defer reg.Close()
	if err := reg.Register(catalog.Kind, catalog.Workflow(site.URL), catalog.Parse); err != nil {
		return err
	}
	srv := asynq.NewServer(asynq.RedisClientOpt{Addr: redisAddr}, reg.ServerConfig(asynq.Config{
		Queues: map[string]int{demoQueue: 1}, Concurrency: 10, LogLevel: asynq.FatalLevel,
	}))
	began := time.Now()
	if err := srv.Start(reg); err != nil {
		return err
	}
	defer srv.Shutdown()
	if err := waitSettled(ctx, pool); err != nil {
		return err
	}
	fmt.Printf("worker settled every job in %v\n\n", time.Since(began).Round(time.Millisecond))

	// 3. Duplicate deliveries after the fact change nothing.
	res, err := enq.EnqueueMany(ctx, specs[:10])
	if err != nil {
		return err
	}
	fmt.Printf("enqueueing 10 specs again: %v … (%d of 10 already complete)\n\n", res[0].Outcome, countOutcome(res, tasks.AlreadyComplete))

	if err := report(ctx, pool, proxy); err != nil {
		return err
	}
	return sideEffects(ctx, pool, rdb)
}

// sideEffects publishes the committed events to a Redis Stream and consumes them into a
// "price alerts" table with exactly-once effect, while the dispatcher crashes once between
// XADD and mark-sent (a failpoint) so that some events reach the stream twice.
func sideEffects(ctx context.Context, pool *pgxpool.Pool, rdb *redis.Client) error {
	if _, err := pool.Exec(ctx, `CREATE TABLE price_alerts (event_key text PRIMARY KEY, sku text NOT NULL, price text NOT NULL)`); err != nil {
		return err
	}
	crashed := false
	disp, err := outbox.NewDispatcher(pool, rdb, &outbox.DispatcherConfig{
		Prefix: demoPrefix, BatchSize: 25, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		AfterPublish: func(ids []int64) error {
			if !crashed {
				crashed = true
				return fmt.Errorf("demo: dispatcher crashes after XADD of %d events, before marking them sent", len(ids))
			}
			return nil
		},
	})
	if err != nil {
		return err
	}
	if err := disp.Start(ctx); err != nil {
		return err
	}
	defer disp.Stop()

	cons, err := outbox.NewConsumer(rdb, &outbox.ConsumerConfig{
		Prefix: demoPrefix, Topic: catalog.Kind, Group: "price-alerts", Block: 100 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		return err
	}
	cctx, stop := context.WithCancel(ctx)
	consumed := make(chan error, 1)
	go func() {
		consumed <- cons.RunTx(cctx, pool, func(ctx context.Context, tx pgx.Tx, ev outbox.Event) error {
			var e struct {
				Data catalog.Record `json:"data"`
			}
			if err := json.Unmarshal(ev.Payload, &e); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `INSERT INTO price_alerts (event_key, sku, price) VALUES ($1, $2, $3)`, ev.EventKey, e.Data.SKU, e.Data.Price)
			return err
		})
	}()
	for {
		var unsent, alerts, entries int64
		if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM outbox WHERE sent_at IS NULL), (SELECT count(*) FROM price_alerts)`).Scan(&unsent, &alerts); err != nil {
			stop()
			return err
		}
		entries, _ = rdb.XLen(ctx, outbox.StreamKey(demoPrefix, catalog.Kind)).Result()
		if unsent == 0 && alerts == products && entries > 0 {
			stop()
			if err := <-consumed; err != nil && !errors.Is(err, context.Canceled) {
				return err
			}
			var inbox int64
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox_inbox`).Scan(&inbox); err != nil {
				return err
			}
			fmt.Printf("\noutbox → Redis Stream %s → consumer (inbox mode):\n", outbox.StreamKey(demoPrefix, catalog.Kind))
			fmt.Printf("  stream entries %d (the crashed batch was published twice), inbox rows %d, price alerts %d\n", entries, inbox, alerts)
			return nil
		}
		select {
		case <-ctx.Done():
			stop()
			return fmt.Errorf("side effects did not settle: %d unsent, %d alerts: %w", unsent, alerts, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func countOutcome(res []tasks.Result, o tasks.Outcome) int {
	n := 0
	for _, r := range res {
		if r.Outcome == o {
			n++
		}
	}
	return n
}

// waitSettled polls until no job is pending, running or retryable.
func waitSettled(ctx context.Context, pool *pgxpool.Pool) error {
	for {
		var open int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM jobs WHERE state NOT IN ('complete', 'failed')`).Scan(&open); err != nil {
			return err
		}
		if open == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%d jobs still open: %w", open, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func report(ctx context.Context, pool *pgxpool.Pool, proxy *testutil.FakeProxy) error {
	w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	row := func(label, query string) error {
		var n int64
		if err := pool.QueryRow(ctx, query).Scan(&n); err != nil {
			return err
		}
		fmt.Fprintf(w, "%s\t%d\n", label, n)
		return nil
	}
	for _, r := range [][2]string{
		{"jobs", `SELECT count(*) FROM jobs`},
		{"jobs complete", `SELECT count(*) FROM jobs WHERE state = 'complete'`},
		{"jobs failed", `SELECT count(*) FROM jobs WHERE state = 'failed'`},
		{"attempts", `SELECT count(*) FROM attempts`},
		{"attempts retried (session lost after 3 replays)", `SELECT count(*) FROM attempts WHERE outcome = 'retryable'`},
		{"quarantined halves (session lost mid-unit)", `SELECT count(*) FROM quarantine`},
		{"results", `SELECT count(*) FROM results`},
		{"outbox events", `SELECT count(*) FROM outbox`},
		{"bytes through the proxy, all attempts", `SELECT COALESCE(sum(bytes_total), 0) FROM jobs`},
	} {
		if err := row(r[0], r[1]); err != nil {
			return err
		}
	}
	fmt.Fprintf(w, "device disconnects at the proxy\t%d\n", proxy.Disconnects())
	w.Flush()

	fmt.Println("\nthree jobs in detail:")
	rows, err := pool.Query(ctx, `
SELECT j.key, j.attempts, j.state, r.data->>'name', r.data->>'price',
	(SELECT count(*) FROM quarantine q WHERE q.job_key = j.key)
FROM jobs j LEFT JOIN results r ON r.job_key = j.key ORDER BY j.attempts DESC, j.key LIMIT 3`)
	if err != nil {
		return err
	}
	w = tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "KEY\tATTEMPTS\tSTATE\tNAME\tPRICE\tQUARANTINED")
	for rows.Next() {
		var key, state string
		var name, price *string
		var attempts, q int
		if err := rows.Scan(&key, &attempts, &state, &name, &price, &q); err != nil {
			return err
		}
		fmt.Fprintf(w, "%s\t%d\t%s\t%s\t%s\t%d\n", key, attempts, state, deref(name), deref(price), q)
	}
	w.Flush()
	return rows.Err()
}

func deref(s *string) string {
	if s == nil {
		return "-"
	}
	return *s
}

func freshDatabase(ctx context.Context, adminDSN string) (*pgxpool.Pool, error) {
	admin, err := pgx.Connect(ctx, adminDSN)
	if err != nil {
		return nil, fmt.Errorf("connect to PostgreSQL (is it running? `make services`): %w", err)
	}
	defer admin.Close(context.Background())
	if _, err := admin.Exec(ctx, `DROP DATABASE IF EXISTS `+demoDB+` WITH (FORCE)`); err != nil {
		return nil, err
	}
	if _, err := admin.Exec(ctx, `CREATE DATABASE `+demoDB); err != nil {
		return nil, err
	}
	cfg, err := pgxpool.ParseConfig(adminDSN)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.Database = demoDB
	return pgxpool.NewWithConfig(ctx, cfg)
}

func clearRedis(ctx context.Context, rdb *redis.Client) error {
	for _, pattern := range []string{"asynq:{" + demoQueue + "}:*", demoPrefix + "*"} {
		iter := rdb.Scan(ctx, 0, pattern, 1000).Iterator()
		for iter.Next(ctx) {
			if err := rdb.Del(ctx, iter.Val()).Err(); err != nil {
				return err
			}
		}
		if err := iter.Err(); err != nil {
			return fmt.Errorf("redis (is it running? `make services`): %w", err)
		}
	}
	return nil
}

// demoTB lets the demo use testutil's fakes outside a test: it runs their cleanups at exit
// and turns their failures into errors on stderr.
type demoTB struct {
	testing.TB
	cleanups []func()
}

func (d *demoTB) Helper()                   {}
func (d *demoTB) Cleanup(f func())          { d.cleanups = append(d.cleanups, f) }
func (d *demoTB) Errorf(f string, a ...any) { fmt.Fprintf(os.Stderr, "demo: "+f+"\n", a...) }
func (d *demoTB) Fatalf(f string, a ...any) {
	fmt.Fprintf(os.Stderr, "demo: "+f+"\n", a...)
	d.cleanup()
	os.Exit(1)
}

func (d *demoTB) cleanup() {
	for i := len(d.cleanups) - 1; i >= 0; i-- {
		d.cleanups[i]()
	}
	d.cleanups = nil
}
