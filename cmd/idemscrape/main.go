// Command idemscrape is the operator's CLI.
//
//	idemscrape migrate                       apply pending migrations
//	idemscrape enqueue -kind K (-url U | -source-id S) -country CC -window W -parser-version N [-scope S]
//	idemscrape key     (same flags as enqueue) print the job key without storing anything
//	idemscrape status  KEY                   the job row and its attempts
//	idemscrape stats                         duplicate work: attempts per job, retries by category, bytes per job
//
// Connections: IDEMSCRAPE_PG (libpq URL, default postgres://postgres@127.0.0.1:5432/postgres)
// and IDEMSCRAPE_REDIS (host:port, default 127.0.0.1:6379); IDEMSCRAPE_QUEUE names the asynq
// queue (default: the kind's name, tasks.QueueFor, where cmd/worker listens).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
)

func main() {
	if len(os.Args) < 2 {
		usage()
		os.Exit(2)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var err error
	switch os.Args[1] {
	case "migrate":
		err = migrate(ctx)
	case "enqueue":
		err = enqueue(ctx, os.Args[2:], false)
	case "key":
		err = enqueue(ctx, os.Args[2:], true)
	case "status":
		err = status(ctx, os.Args[2:])
	case "stats":
		err = stats(ctx)
	default:
		usage()
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "idemscrape:", err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: idemscrape migrate | enqueue FLAGS | key FLAGS | status KEY | stats")
}

func env(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func connect(ctx context.Context) (*pgxpool.Pool, error) {
	pool, err := pgxpool.New(ctx, env("IDEMSCRAPE_PG", "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"))
	if err != nil {
		return nil, fmt.Errorf("postgres: %w", err)
	}
	return pool, nil
}

func migrate(ctx context.Context) error {
	pool, err := connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	applied, err := store.Migrate(ctx, pool, slog.New(slog.NewTextHandler(os.Stderr, nil)))
	if err != nil {
		return err
	}
	fmt.Printf("applied %d migration(s): %v\n", len(applied), applied)
	return nil
}

func enqueue(ctx context.Context, args []string, keyOnly bool) error {
	fs := flag.NewFlagSet("enqueue", flag.ContinueOnError)
	var s tasks.Spec
	fs.StringVar(&s.Kind, "kind", "", "job kind (workflow type)")
	fs.StringVar(&s.URL, "url", "", "source URL (or -source-id)")
	fs.StringVar(&s.SourceID, "source-id", "", "source record id (or -url)")
	fs.StringVar(&s.Country, "country", "", "ISO 3166-1 alpha-2 exit country")
	fs.StringVar(&s.Window, "window", "", "collection window, e.g. 2026-04-23")
	fs.IntVar(&s.ParserVersion, "parser-version", 0, "parser version (>= 1)")
	fs.StringVar(&s.Scope, "scope", "", "customer / data product scope (optional)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if keyOnly {
		key, err := s.Key()
		if err != nil {
			return err
		}
		fmt.Println(key)
		return nil
	}
	pool, err := connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	redisOpt := asynq.RedisClientOpt{Addr: env("IDEMSCRAPE_REDIS", "127.0.0.1:6379")}
	client := asynq.NewClient(redisOpt)
	defer client.Close()
	insp := asynq.NewInspector(redisOpt)
	defer insp.Close()
	// The queue defaults to the kind's (tasks.QueueFor), where cmd/worker listens.
	enq, err := tasks.NewEnqueuer(client, store.New(pool), &tasks.EnqueuerConfig{Queue: os.Getenv("IDEMSCRAPE_QUEUE"), Inspector: insp})
	if err != nil {
		return err
	}
	res, err := enq.Enqueue(ctx, s)
	if err != nil {
		return err
	}
	fmt.Printf("%s %s (state %s)\n", res.Outcome, res.Key, res.State)
	return nil
}

func status(ctx context.Context, args []string) error {
	if len(args) != 1 {
		return errors.New("status takes one job key")
	}
	pool, err := connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	st := store.New(pool)
	job, err := st.JobGet(ctx, args[0])
	if err != nil {
		return err
	}
	attempts, err := st.AttemptList(ctx, args[0])
	if err != nil {
		return err
	}
	out := json.NewEncoder(os.Stdout)
	out.SetIndent("", "  ")
	return out.Encode(struct {
		Job      store.Job       `json:"job"`
		Attempts []store.Attempt `json:"attempts"`
	}{job, attempts})
}

func stats(ctx context.Context) error {
	pool, err := connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	st, err := store.New(pool).StatsGet(ctx)
	if err != nil {
		return err
	}
	out := json.NewEncoder(os.Stdout)
	out.SetIndent("", "  ")
	return out.Encode(st)
}
