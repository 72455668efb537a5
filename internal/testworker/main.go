// Command testworker is a TEST FIXTURE of package scheduler's process tests, not a product
// binary (the worker is cmd/worker). It runs an asynq server with a handlers.Registry of one
// kind, "catalog", whose only step prints "STEP <job key>" on stdout and then blocks until
// the job's context ends, so a test can SIGKILL a worker in the middle of a job: the job
// stays running in PostgreSQL, its lease and asynq task stay in Redis.
//
//	testworker -pg URL -redis host:port [-queue catalog] [-key-prefix idemscrape:] [-lease 0]
//
// The proxy provider is a placeholder: the step makes no request.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
)

func main() {
	pg := flag.String("pg", "", "PostgreSQL URL")
	addr := flag.String("redis", "", "Redis host:port")
	queue := flag.String("queue", "catalog", "asynq queue")
	prefix := flag.String("key-prefix", handlers.DefaultKeyPrefix, "lease key prefix")
	lease := flag.Duration("lease", 0, "the jobs' lease length (handlers.Config.LeaseLength; 0: the handlers' default)")
	flag.Parse()
	if err := run(*pg, *addr, *queue, *prefix, *lease); err != nil {
		fmt.Fprintln(os.Stderr, "testworker:", err)
		os.Exit(1)
	}
}

func run(pg, addr, queue, prefix string, lease time.Duration) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	pool, err := pgxpool.New(ctx, pg)
	if err != nil {
		return err
	}
	defer pool.Close()
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	defer rdb.Close()
	prov, err := sessions.NewProvider("generic", "127.0.0.1:1", "{user}-session-{session}", "{pass}", "fixture", "fixture", 0)
	if err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	reg, err := handlers.NewRegistry(handlers.Config{Store: store.New(pool), Redis: rdb, Provider: prov, KeyPrefix: prefix,
		LeaseLength: lease, NoGroupCommit: true, Logger: log})
	if err != nil {
		return err
	}
	defer reg.Close()
	err = reg.Register("catalog", func(job tasks.Payload) (*sessions.Unit, error) {
		return &sessions.Unit{Name: "block", Steps: []sessions.Step{{Name: "block", Safe: true,
			Run: func(ctx context.Context, sc *sessions.StepContext) error {
				fmt.Printf("STEP %s\n", job.Key)
				<-ctx.Done()
				return ctx.Err()
			}}}}, nil
	}, func(tasks.Payload, map[string]json.RawMessage) (handlers.Observation, error) {
		return handlers.Observation{Data: map[string]string{}}, nil
	})
	if err != nil {
		return err
	}
	srv := asynq.NewServer(asynq.RedisClientOpt{Addr: addr}, reg.ServerConfig(asynq.Config{
		Queues: map[string]int{queue: 1}, Concurrency: 4, LogLevel: asynq.WarnLevel,
	}))
	if err := srv.Start(reg); err != nil {
		return err
	}
	<-ctx.Done()
	srv.Shutdown()
	return nil
}
