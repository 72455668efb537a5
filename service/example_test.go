package service_test

import (
	"context"
	"log"
	"os"
	"os/signal"
	"syscall"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/service"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
)

// A service's main: register kinds, then run the service until SIGTERM or SIGINT.
func Example() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()

	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := store.Migrate(ctx, pool, nil); err != nil {
		log.Fatal(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	defer rdb.Close()
	provider, err := sessions.ProviderFromEnv()
	if err != nil {
		log.Fatal(err)
	}
	reg, err := handlers.NewRegistry(handlers.Config{Store: store.New(pool), Redis: rdb, Provider: provider})
	if err != nil {
		log.Fatal(err)
	}
	defer reg.Close() // after the service stopped: Run returns first
	if err := reg.Register(catalog.Kind, catalog.Workflow("https://shop.example"), catalog.Parse); err != nil {
		log.Fatal(err)
	}
	auth, err := service.BasicAuthFromEnv() // IDEMSCRAPE_HTTP_USER, IDEMSCRAPE_HTTP_PASSWORD
	if err != nil {
		log.Fatal(err)
	}
	svc, err := service.New(service.Config{
		Registry:  reg,
		Store:     store.New(pool),
		Redis:     rdb,                             // asynq's server and asynqmon connect with its options
		Queues:    map[string]int{catalog.Kind: 1}, // one queue per kind, named like it
		HTTPAddr:  "127.0.0.1:8080",                // /metrics /healthz /readyz /monitoring /jobs
		BasicAuth: auth,
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := svc.Run(ctx); err != nil { // blocks until a signal, then shuts down gracefully
		log.Fatal(err)
	}
}
