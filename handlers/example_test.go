package handlers_test

import (
	"context"
	"encoding/json"
	"log"
	"os"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
)

func parsePrice(html json.RawMessage) map[string]string {
	return map[string]string{"raw": string(html)}
}

// The README's example, kept compiling here (it is not run: it needs a proxy account).
func Example_registry() {
	ctx := context.Background()
	pool, _ := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if _, err := store.Migrate(ctx, pool, nil); err != nil {
		log.Fatal(err)
	} // safe from many workers
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	provider, err := sessions.ProviderFromEnv() // IDEMSCRAPE_PROXY_PROVIDER, _USER, _PASSWORD (never logged)
	if err != nil {
		log.Fatal(err)
	}

	reg, err := handlers.NewRegistry(handlers.Config{Store: store.New(pool), Redis: rdb, Provider: provider})
	if err != nil {
		log.Fatal(err)
	}
	defer reg.Close()
	reg.Register("catalog",
		func(job tasks.Payload) (*sessions.Unit, error) { // the steps of one job, on one sticky session
			return &sessions.Unit{Steps: []sessions.Step{
				{Name: "page", Safe: true, Run: func(ctx context.Context, sc *sessions.StepContext) error {
					resp, err := sc.Get(job.Spec.URL) // classified errors: throttled, session_lost, …
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
	srv := asynq.NewServer(asynq.RedisClientOpt{Addr: "127.0.0.1:6379"},
		reg.ServerConfig(asynq.Config{Queues: map[string]int{"catalog": 1}, Concurrency: 20}))
	log.Fatal(srv.Run(reg))
}
