package idemscrape_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"net/url"
	"os"
	"os/signal"
	"path"
	"strings"
	"syscall"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape"
)

// A service that registers one kind, enqueues one job, runs the worker and consumes the
// job's event: the product name on a shop's page, collected through a residential proxy
// (IDEMSCRAPE_PROXY_PROVIDER, _USER, _PASSWORD and _GATEWAY name it).
func Example() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	pg, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pg.Close()
	if err := idemscrape.Migrate(ctx, pg); err != nil {
		log.Fatal(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: os.Getenv("REDIS_ADDR")})
	defer rdb.Close()

	c, err := idemscrape.New(idemscrape.Config{PG: pg, Redis: rdb,
		HTTPAddr:      os.Getenv("HTTP_ADDR"), // /metrics /healthz /readyz /monitoring /jobs
		AllowLoopback: os.Getenv("SHOP_ON_LOOPBACK") != "",
	})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close() // after Run returned

	// The kind: two steps on one sticky session (the shop serves a product page only with
	// the cookie its search page set), then Parse makes the record of what they staged.
	err = c.Register("product-name", idemscrape.Kind{
		Workflow: func(job idemscrape.Job) (*idemscrape.Unit, error) {
			u, err := url.Parse(job.Spec.URL)
			if err != nil {
				return nil, err
			}
			search := func(_ context.Context, sc *idemscrape.StepContext) error {
				// The search page sets the shop's session cookie in the unit's cookie jar. An
				// error is classified (blocked, throttled, session lost…) and retried by category.
				_, err := sc.Get(u.Scheme + "://" + u.Host + "/search?q=" + path.Base(u.Path))
				return err
			}
			product := func(_ context.Context, sc *idemscrape.StepContext) error {
				resp, err := sc.Get(job.Spec.URL)
				if err != nil {
					return err
				}
				_, name, _ := strings.Cut(string(resp.Body), `<h1 class="name">`)
				name, _, _ = strings.Cut(name, "</h1>")
				return sc.Staging.Put("name", strings.TrimSpace(name))
			}
			return &idemscrape.Unit{Name: "product-name", Site: u.Host, Steps: []idemscrape.Step{
				{Name: "search", Safe: true, Run: search}, {Name: "product", Safe: true, Run: product},
			}}, nil
		},
		Parse: func(job idemscrape.Job, staged map[string]json.RawMessage) (idemscrape.Observation, error) {
			var name string
			if err := json.Unmarshal(staged["name"], &name); err != nil || name == "" {
				return idemscrape.Observation{}, fmt.Errorf("no product name on %s", job.Spec.URL)
			}
			return idemscrape.Observation{Data: map[string]string{"name": name}}, nil
		},
	})
	if err != nil {
		log.Fatal(err)
	}

	// One logical job: the same spec enqueued again is the same job, never a second one.
	spec := idemscrape.Spec{Kind: "product-name", URL: os.Getenv("SHOP_URL") + "/product/sku-1",
		Country: "US", Window: "2026-12-07", ParserVersion: 1}
	for range 2 {
		res, err := c.Enqueue(ctx, spec)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println("enqueue:", res.Outcome)
	}

	worker := make(chan error, 1)
	go func() { worker <- c.Run(ctx) }() // until ctx is done, then a graceful shutdown

	// The kind's events (topic = the kind's name), each handed over once per event key.
	cons, err := c.Consumer("product-name", "example")
	if err != nil {
		log.Fatal(err)
	}
	err = cons.Run(ctx, func(_ context.Context, ev idemscrape.Event) error {
		var e struct{ Data map[string]string }
		if err := json.Unmarshal(ev.Payload, &e); err != nil {
			return err // not acknowledged: delivered again
		}
		fmt.Println("event:", ev.Topic, e.Data["name"])
		stop() // one event is all this example waits for
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := <-worker; err != nil {
		log.Fatal(err)
	}
}
