package handlers_test

import (
	"context"
	"encoding/json"
	"log"
	"os"
	"os/signal"
	"syscall"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/service"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
)

func parsePrice(html json.RawMessage) map[string]string {
	return map[string]string{"raw": string(html)}
}

// The README's example, kept compiling here (it is not run: it needs a proxy account).
func Example_registry() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := store.Migrate(ctx, pool, nil); err != nil { // safe from many workers
		log.Fatal(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	defer rdb.Close()
	provider, err := sessions.ProviderFromEnv() // IDEMSCRAPE_PROXY_PROVIDER, _USER, _PASSWORD (never logged)
	if err != nil {
		log.Fatal(err)
	}

	st := store.New(pool)
	reg, err := handlers.NewRegistry(handlers.Config{Store: st, Redis: rdb, Provider: provider})
	if err != nil {
		log.Fatal(err)
	}
	defer reg.Close() // after the service has shut down
	err = reg.Register("catalog",
		func(job tasks.Payload) (*sessions.Unit, error) { // the steps of one job, on one sticky session
			return &sessions.Unit{Steps: []sessions.Step{
				{Name: "page", Safe: true, Run: func(ctx context.Context, sc *sessions.StepContext) error {
					resp, err := sc.Get(job.Spec.URL) // runs under ctx; classified errors: throttled, session_lost, …
					if err != nil {
						return err
					}
					return sc.Staging.Put("html", string(resp.Body))
				}},
			}}, nil
		},
		func(job tasks.Payload, staged map[string]json.RawMessage) (handlers.Observation, error) {
			return handlers.Observation{Data: parsePrice(staged["html"])}, nil // deterministic
		},
		handlers.WithRetry(handlers.RetryConfig{MaxAttempts: 5, BandwidthBudget: 20 << 20}),
	)
	if err != nil {
		log.Fatal(err)
	}
	// asynq server (queue "catalog", the kind's), outbox dispatcher, /metrics, /healthz,
	// /readyz, asynqmon at /monitoring, job pages at /jobs.
	svc, err := service.New(service.Config{Registry: reg, Store: st, Redis: rdb,
		RedisConnOpt: asynq.RedisClientOpt{Addr: "127.0.0.1:6379"}, Concurrency: 20})
	if err != nil {
		log.Fatal(err)
	}
	// Until SIGTERM: then no new work, in-flight jobs finish or are handed back, leases released.
	if err := svc.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
