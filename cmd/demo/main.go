// Command demo shows idemscrape's job identity and enqueue deduplication against the local
// PostgreSQL and Redis: it (re)creates the database idemscrape_demo, migrates it, enqueues a
// small catalog in which the same product appears under many spellings of its URL, enqueues
// it all again, then prints what happened and what the system of record holds.
//
//	make demo            (starts the services if needed)
//	go run ./cmd/demo -pg postgres://postgres@127.0.0.1:5432/postgres -redis 127.0.0.1:6379
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"text/tabwriter"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
)

const (
	demoDB    = "idemscrape_demo"
	demoQueue = "idemscrape-demo"
)

func main() {
	pgDSN := flag.String("pg", "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable", "PostgreSQL admin DSN (the demo creates its own database)")
	redisAddr := flag.String("redis", "127.0.0.1:6379", "Redis address")
	flag.Parse()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := run(ctx, *pgDSN, *redisAddr); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, adminDSN, redisAddr string) error {
	pool, err := freshDatabase(ctx, adminDSN)
	if err != nil {
		return err
	}
	defer pool.Close()
	applied, err := store.Migrate(ctx, pool, slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	if err != nil {
		return err
	}
	fmt.Printf("database %s: applied migrations %v\n", demoDB, applied)

	rdb := redis.NewClient(&redis.Options{Addr: redisAddr})
	defer rdb.Close()
	if err := clearQueue(ctx, rdb); err != nil {
		return err
	}
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: redisAddr})
	defer client.Close()
	enq, err := tasks.NewEnqueuer(client, store.New(pool), &tasks.EnqueuerConfig{Queue: demoQueue})
	if err != nil {
		return err
	}

	specs := catalog()
	for round := 1; round <= 2; round++ {
		results, err := enq.EnqueueMany(ctx, specs)
		if err != nil {
			return err
		}
		fmt.Printf("\nround %d: enqueued %d specs\n", round, len(specs))
		w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(w, "OUTCOME\tKEY\tSOURCE AS WRITTEN")
		for i, r := range results {
			src := specs[i].URL
			if src == "" {
				src = specs[i].SourceID
			}
			fmt.Fprintf(w, "%s\t%s\t%s\n", r.Outcome, r.Key, src)
		}
		w.Flush()
	}

	bad := tasks.Spec{Kind: "catalog", URL: "ftp://files.example.com/x", Country: "US", Window: "2026-04-23", ParserVersion: 3}
	_, err = enq.Enqueue(ctx, bad)
	fmt.Printf("\na bad spec is refused before anything is stored:\n  %v\n", err)

	var jobs, pending int
	if err := pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE state = 'pending') FROM jobs`).Scan(&jobs, &pending); err != nil {
		return err
	}
	queued, err := rdb.LLen(ctx, "asynq:{"+demoQueue+"}:pending").Result()
	if err != nil {
		return err
	}
	fmt.Printf("\n%d specs enqueued twice ⇒ %d jobs rows (%d pending) and %d asynq tasks (task id = job key)\n",
		2*len(specs), jobs, pending, queued)
	return nil
}

// catalog is a small scrape plan: one product under five spellings of its URL, two more
// products, the first product for another country, and two jobs named by source id.
func catalog() []tasks.Spec {
	base := tasks.Spec{Kind: "catalog", Country: "US", Window: "2026-04-23", ParserVersion: 3}
	var specs []tasks.Spec
	for _, u := range []string{
		"https://Shop.Example.com/p/sku-42?color=red&size=m",
		"https://shop.example.com:443/p/sku-42?size=m&color=red#reviews",
		"HTTPS://SHOP.EXAMPLE.COM/p/sku-42?size=m&color=red&utm_source=newsletter",
		"https://shop.example.com/p/%73ku-42?color=red&size=m&gclid=abc123",
		"https://shop.example.com/p/sku-42?color=red&fbclid=x&size=m",
		"https://shop.example.com/p/sku-43",
		"https://shop.example.com/p/sku-44",
	} {
		s := base
		s.URL = u
		specs = append(specs, s)
	}
	de := base
	de.URL, de.Country = "https://shop.example.com/p/sku-42?color=red&size=m", "DE"
	specs = append(specs, de)
	for _, id := range []string{"sku-42", "sku-43"} {
		s := base
		s.SourceID = id
		specs = append(specs, s)
	}
	return specs
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

func clearQueue(ctx context.Context, rdb *redis.Client) error {
	iter := rdb.Scan(ctx, 0, "asynq:{"+demoQueue+"}:*", 1000).Iterator()
	for iter.Next(ctx) {
		if err := rdb.Del(ctx, iter.Val()).Err(); err != nil {
			return err
		}
	}
	if err := iter.Err(); err != nil {
		return fmt.Errorf("redis (is it running? `make services`): %w", err)
	}
	return nil
}
