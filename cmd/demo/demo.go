package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/cmd/internal/envflag"
	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/examples/catalogjs"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/scheduler"
	"github.com/idemscrape/idemscrape/service"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/outbox"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// options configure one run of the demo.
type options struct {
	AdminDSN string
	// Redis is the server or cluster the demo uses (only its own key prefix and queue).
	Redis envflag.RedisConfig
	// Products is the catalog size; the main template makes one job per product and
	// country of Countries.
	Products  int
	Countries []string
	// Unavailable is the country the fake proxy has no peers in; UnavailableJobs products
	// are scheduled there. "" or 0 schedules none.
	Unavailable     string
	UnavailableJobs int
	// Disconnect is the fake proxy's per-request probability of dropping the device.
	Disconnect float64
	// Throttled is how many of the shop's first requests answer 429 with Retry-After
	// RetryAfter.
	Throttled  int
	RetryAfter time.Duration
	// SchemaChangeJobs products are scraped in a second phase, after the shop renamed its
	// price field: validation fails, the staging is quarantined, nothing is committed.
	// 0 skips the phase.
	SchemaChangeJobs int
	// Rendered products are scraped in a last phase by the catalog.js kind, whose product
	// page gets its price from JavaScript: rendered in Chromium on the unit's sticky
	// session, and the proxy drops the device under the first page's price XHR. 0 skips
	// the phase; so does a machine without Chromium (the summary says so).
	Rendered int
	// MaxAttempts caps the attempts of a job (the unavailable country's jobs reach it).
	MaxAttempts int
	// MaxSessionRestarts is how many other sessions one attempt may replay its unit on.
	MaxSessionRestarts int
	// Price is the fake proxy's price: every attempt's cost, the summary's cost per job and
	// top waste category.
	Price string
	// Timeout bounds the run (not the UI wait).
	Timeout time.Duration
	// UI keeps the HTTP server up after the summary until ctx is done.
	UI       bool
	HTTPAddr string
	// Keep leaves the database and the Redis keys in place at exit.
	Keep     bool
	Progress progressMode
	Out      io.Writer

	// afterSettled runs after every job settled and every event was consumed, before the
	// checks: tests break an invariant through it.
	afterSettled func(ctx context.Context, pool *pgxpool.Pool) error
	// onNames reports the run's names as soon as they are chosen (tests).
	onNames func(names)
}

func defaultOptions() options {
	return options{
		AdminDSN:         "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable",
		Redis:            envflag.RedisConfig{Addr: envflag.DefaultRedisAddr},
		Products:         30,
		Countries:        []string{"US", "DE"},
		Unavailable:      "JP",
		UnavailableJobs:  3,
		Disconnect:       0.15,
		Throttled:        6,
		RetryAfter:       time.Second,
		SchemaChangeJobs: 2,
		Rendered:         3,
		MaxAttempts:      3,
		// With 15 % disconnects a session finishes its 4 requests half the time: 6 sessions
		// per attempt and 3 attempts make a served job's failure a one-in-a-million event.
		MaxSessionRestarts: 5,
		Price:              "8.40 USD/GB", // a residential proxy's list price
		Timeout:            110 * time.Second,
		HTTPAddr:           "127.0.0.1:0",
		Progress:           progressPlain,
	}
}

const (
	// proxyPassword is the fake proxy account's password. It must never be printed: the
	// demo's output is checked for it in the test.
	proxyPassword = "demo-password-never-printed"
	consumerGroup = "price-alerts"
	// fastRetry replaces the default backoffs (seconds to minutes) so the demo's retries
	// happen within its two minutes; asynq still moves due retries only every ~5 s.
	fastRetryBase = 200 * time.Millisecond
	fastRetryMax  = time.Second
)

// validate names the first option that cannot make a demo.
func (o *options) validate() error {
	switch {
	case o.Products < max(1, o.UnavailableJobs, o.SchemaChangeJobs) || o.Products > 5000:
		return fmt.Errorf("products %d: want %d to 5000", o.Products, max(1, o.UnavailableJobs, o.SchemaChangeJobs))
	case o.Rendered < 0 || o.Rendered > o.Products:
		return fmt.Errorf("rendered %d: want 0 to the catalog size (-products %d)", o.Rendered, o.Products)
	case len(o.Countries) == 0:
		return errors.New("countries: want at least one")
	case o.Disconnect < 0 || o.Disconnect >= 1:
		return fmt.Errorf("disconnect %v: want a probability in [0, 1)", o.Disconnect)
	case o.Out == nil:
		return errors.New("out: required")
	}
	return nil
}

// run is the whole demo. Everything it creates is removed before it returns (unless
// o.Keep), whatever happened.
func run(ctx context.Context, tb testing.TB, o options) (err error) {
	if err := o.validate(); err != nil {
		return err
	}
	out := o.Out
	discard := slog.New(slog.NewTextHandler(io.Discard, nil))
	n := newNames(testutil.RandomID(4))
	if o.onNames != nil {
		o.onNames(n)
	}
	runCtx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()

	// The world first (it owns nothing outside this process): a shop whose price API
	// needs the cookie and token of the same exit, and a residential proxy gateway in
	// Oxylabs' username format whose devices drop out and which has no peers in one
	// country.
	// It also puts a bot challenge in front of its pages (a 24 KiB page whose clearance
	// cookie is bound to the exit): the worker's session pool passes it once per session.
	site := testutil.NewFakeSite(tb, testutil.FakeSiteConfig{Seed: 7, Products: o.Products, StrictExit: true, Challenge: true})
	var unavailable []string
	if o.Unavailable != "" && o.UnavailableJobs > 0 {
		unavailable = []string{o.Unavailable}
	}
	proxy := testutil.NewFakeProxy(tb, testutil.FakeProxyConfig{Seed: 7, Format: testutil.ProxyFormatOxylabs,
		User: "demo", Password: proxyPassword, DisconnectProb: o.Disconnect, UnavailableCountries: unavailable})
	provider, err := sessions.Oxylabs("demo", proxyPassword)
	if err != nil {
		return err
	}
	if provider, err = provider.WithGateway(proxy.Addr); err != nil {
		return err
	}
	if o.Price != "" {
		price, err := sessions.ParsePrice(o.Price)
		if err != nil {
			return err
		}
		if provider, err = provider.WithPrice(price); err != nil {
			return err
		}
	}

	// The browser of the JavaScript phase: one Chromium process at most, started at the
	// first render, ended by the registry's Close. Without Chromium the phase is skipped.
	var browsers *sessions.BrowserPool
	browserNote := ""
	if o.Rendered > 0 {
		browsers, err = sessions.NewBrowserPool(sessions.BrowserConfig{MaxBrowsers: 1})
		switch {
		case errors.Is(err, sessions.ErrNoChromium):
			browserNote = "no Chromium on this machine (make demo installs Debian's chromium)"
			o.Rendered = 0
		case err != nil:
			return err
		}
	}

	// Our own database and Redis namespace, removed at exit.
	rdb := o.Redis.NewClient()
	defer rdb.Close()
	if err := rdb.Ping(runCtx).Err(); err != nil {
		return fmt.Errorf("%s (is it running? `make services`): %w", o.Redis, err)
	}
	pool, err := createDatabase(runCtx, o.AdminDSN, n)
	if err != nil {
		return err
	}
	defer func() {
		if o.Keep {
			printKept(out, o, n, sampleKey(context.WithoutCancel(ctx), pool))
			pool.Close()
			return
		}
		pool.Close()
		cctx, ccancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer ccancel()
		err = errors.Join(err, cleanupRedis(cctx, rdb, n), dropDatabase(cctx, o.AdminDSN, n))
	}()
	if _, err := store.Migrate(runCtx, pool, nil); err != nil {
		return err
	}
	// The consumer's side effect: a price alert per observed price. Deliberately without a
	// unique key, so that an effect taking place twice would show as two rows.
	if _, err := pool.Exec(runCtx, `CREATE TABLE price_alerts (id bigserial PRIMARY KEY, event_key text NOT NULL, sku text NOT NULL, price text NOT NULL)`); err != nil {
		return err
	}
	st := store.New(pool)
	asynqOpt := o.Redis.AsynqConnOpt()
	client := asynq.NewClient(asynqOpt)
	defer client.Close()
	insp := asynq.NewInspector(asynqOpt)
	defer insp.Close()

	fmt.Fprintf(out, "idemscrape demo, run %s\n", n.RunID)
	dropped, deleted := "dropped at exit", "deleted at exit"
	if o.Keep {
		dropped, deleted = "kept at exit (-keep)", "kept at exit"
	}
	fmt.Fprintf(out, "  database    %s on %s (created for this run, %s)\n", n.Database, redactDSN(o.AdminDSN), dropped)
	fmt.Fprintf(out, "  redis       %s, keys %s* and asynq queue %s (%s)\n", strings.TrimPrefix(o.Redis.String(), "redis "), n.Prefix, n.Queue, deleted)
	fmt.Fprintf(out, "  fake shop   %s (its first %d requests answer 429, Retry-After %v)\n", site.URL, o.Throttled, o.RetryAfter)
	fmt.Fprintf(out, "  fake proxy  %s, %s username format, %.0f%% of requests lose their device", provider.Gateway(), provider.Name(), o.Disconnect*100)
	if len(unavailable) > 0 {
		fmt.Fprintf(out, ", no peers in %s", o.Unavailable)
	}
	fmt.Fprintln(out)
	switch {
	case browserNote != "":
		fmt.Fprintf(out, "  browser     %s: the JavaScript phase is skipped\n", browserNote)
	case o.Rendered > 0:
		fmt.Fprintf(out, "  browser     %s, one process, started at the first render\n", browsers.ExecPath())
	}

	// The worker: a registry with the catalog kind (retries made fast for the demo), run by
	// the service entry point with the outbox dispatcher on. The dispatcher crashes once
	// between its XADDs and moving its position (a failpoint), so its first batch is published twice.
	destinations := tasks.LoopbackPolicy() // the shop and the proxy live on loopback
	fast := handlers.Policy{Retry: true, Base: fastRetryBase, Max: fastRetryMax}
	reg, err := handlers.NewRegistry(handlers.Config{
		Store: st, Redis: rdb, Provider: provider, KeyPrefix: n.Prefix, WorkerID: "demo-worker",
		Collector:          sessions.CollectorConfig{Guard: sessions.NewGuard(destinations)},
		Browsers:           browsers,
		MaxSessionRestarts: o.MaxSessionRestarts,
		SessionPool:        &sessions.PoolConfig{}, // as cmd/worker by default
		Retry: handlers.RetryConfig{MaxAttempts: o.MaxAttempts, Policies: map[tasks.Category]handlers.Policy{
			tasks.CategorySessionLost: fast, tasks.CategoryExitUnavailable: fast, tasks.CategoryThrottled: fast,
			tasks.CategoryTimeout: fast, tasks.CategoryNetwork: fast,
		}},
		Logger: discard,
	})
	if err != nil {
		return err
	}
	defer reg.Close()
	if err := reg.Register(catalog.Kind, catalog.Workflow(site.URL), catalog.Parse); err != nil {
		return err
	}
	topics := []string{catalog.Kind}
	if o.Rendered > 0 {
		if err := reg.Register(catalogjs.Kind, catalogjs.Workflow(site.URL), catalogjs.Parse); err != nil {
			return err
		}
		topics = append(topics, catalogjs.Kind)
	}
	var crashedBatch atomic.Int64 // events in the batch the dispatcher crashed after publishing
	svc, err := service.New(service.Config{
		Registry: reg, Store: st, Redis: rdb, RedisConnOpt: asynqOpt,
		Queues: map[string]int{n.Queue: 1}, Concurrency: 10,
		ShutdownTimeout: 3 * time.Second, DrainTimeout: 20 * time.Second,
		Dispatcher: &outbox.DispatcherConfig{Prefix: n.Prefix, BatchSize: 25, Logger: discard,
			AfterPublish: func(ids []int64) error {
				if crashedBatch.CompareAndSwap(0, int64(len(ids))) {
					return fmt.Errorf("demo failpoint: dispatcher crashes after XADD of %d events, before marking them sent", len(ids))
				}
				return nil
			}},
		HTTPAddr: o.HTTPAddr, Logger: discard, AsynqLogLevel: asynq.FatalLevel,
	})
	if err != nil {
		return err
	}

	// One scheduler tick per template enqueues the window's jobs; the same ticks fired
	// again (a second scheduler, a restart) enqueue nothing new.
	sched, err := newScheduler(o, n, client, rdb, st, insp, destinations, discard)
	if err != nil {
		return err
	}
	at := tickInstant(time.Now())
	fmt.Fprintf(out, "\nscheduler tick at %s:\n", at.Format("2006-01-02 15:04 MST"))
	var total, dupEnqueues int
	for _, tmpl := range sched.templates {
		rep := sched.s.Tick(runCtx, tmpl, at)
		if rep.Err != nil {
			return fmt.Errorf("tick of %s: %w", tmpl, rep.Err)
		}
		total += rep.Specs
		fmt.Fprintf(out, "  %-18s window %s: %d specs, %d created\n", tmpl, rep.Window, rep.Specs, rep.Outcomes[tasks.Created.String()])
	}
	again := 0
	for _, tmpl := range sched.templates {
		rep := sched.s.Tick(runCtx, tmpl, at)
		if rep.Err != nil {
			return fmt.Errorf("second tick of %s: %w", tmpl, rep.Err)
		}
		again += rep.Outcomes[tasks.Created.String()]
		dupEnqueues += rep.Specs - rep.Outcomes[tasks.Created.String()]
	}
	fmt.Fprintf(out, "  the same ticks again: %d created, %d already queued (same window, same keys)\n", again, dupEnqueues)
	if again != 0 {
		return fmt.Errorf("the second tick of the same window created %d jobs, want 0", again)
	}
	// An operator enqueues a few of the same jobs by hand, spelled differently.
	enq, err := tasks.NewEnqueuer(client, st, &tasks.EnqueuerConfig{Queue: n.Queue, Inspector: insp, Destinations: destinations})
	if err != nil {
		return err
	}
	var byHand []tasks.Spec
	for i := 1; i <= min(5, o.Products); i++ {
		byHand = append(byHand, tasks.Spec{Kind: catalog.Kind, SourceID: fmt.Sprintf("sku-%d", i),
			Country: strings.ToLower(o.Countries[0]), Window: sched.window, ParserVersion: 1})
	}
	res, err := enq.EnqueueMany(runCtx, byHand)
	if err != nil {
		return err
	}
	handDup := 0
	for _, r := range res {
		if r.Outcome != tasks.Created {
			handDup++
		}
	}
	dupEnqueues += handDup
	fmt.Fprintf(out, "  %d of the same jobs enqueued by hand (country %q): %d already queued\n", len(byHand), byHand[0].Country, handDup)

	// Work: the shop starts throttling, the service and the consumer start.
	site.Throttle(o.Throttled, o.RetryAfter)
	began := time.Now()
	if err := svc.Start(runCtx); err != nil {
		return err
	}
	svcDown := false
	shutdown := func() error {
		if svcDown {
			return nil
		}
		svcDown = true
		sctx, scancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer scancel()
		return svc.Shutdown(sctx)
	}
	defer func() { err = errors.Join(err, shutdown()) }()
	// One consumer per kind's stream, the same group and side effect.
	var streams []string
	var consumers []*outbox.Consumer
	for _, topic := range topics {
		cons, err := outbox.NewConsumer(rdb, &outbox.ConsumerConfig{
			Prefix: n.Prefix, Topic: topic, Group: consumerGroup, Block: 100 * time.Millisecond, Logger: discard,
		})
		if err != nil {
			return err
		}
		consumers = append(consumers, cons)
		streams = append(streams, outbox.StreamKey(n.Prefix, topic))
	}
	cctx, stopConsumer := context.WithCancel(runCtx)
	consumed := make(chan error, len(consumers))
	for _, cons := range consumers {
		go func() { consumed <- cons.RunTx(cctx, pool, priceAlert) }()
	}
	stopCons := func() error {
		if stopConsumer == nil {
			return nil
		}
		stopConsumer()
		stopConsumer = nil
		var errs []error
		for range consumers {
			if err := <-consumed; err != nil && !errors.Is(err, context.Canceled) {
				errs = append(errs, fmt.Errorf("consumer: %w", err))
			}
		}
		return errors.Join(errs...)
	}
	defer func() { err = errors.Join(err, stopCons()) }()

	fmt.Fprintf(out, "\nworker %s: %d jobs, concurrency 10; consumer group %q writes price alerts (inbox mode)\n",
		"http://"+svc.HTTPAddr(), total, consumerGroup)
	var schemaWindow string // the window ticked after the schema change
	if err := waitSettled(runCtx, pool, rdb, streams, o.Progress, out, began); err != nil {
		return err
	}
	// Phase 2: the shop renames its price field, and an hourly template's tick sends a
	// few jobs against it. Validation refuses the staging (quarantined), the job fails
	// without retry (a deterministic failure), and no result or event is written.
	// The proxy's devices hold from here on: the tick's units start on the warm sessions the
	// first phase handed back (their exits and clearance cookies), which the bot challenge
	// line counts; a random device loss under both of them would leave none to count.
	if sched.schemaTemplate != "" {
		proxy.SetDisconnectProb(0)
		site.SetSchemaChange(true)
		rep := sched.s.Tick(runCtx, sched.schemaTemplate, at)
		if rep.Err != nil {
			return fmt.Errorf("tick of %s: %w", sched.schemaTemplate, rep.Err)
		}
		fmt.Fprintf(out, "\nthe shop renames its price field \"price\" to \"amount\"; tick of %s (window %s): %d created,\n"+
			"  on the warm sessions the first jobs handed back (the proxy's devices hold from here on)\n",
			sched.schemaTemplate, rep.Window, rep.Outcomes[tasks.Created.String()])
		if err := waitSettled(runCtx, pool, rdb, streams, o.Progress, out, began); err != nil {
			return err
		}
		schemaWindow = rep.Window
	}
	// Phase 3: product pages that need JavaScript (the price arrives by XHR), rendered in
	// Chromium on each unit's sticky session. The proxy drops the device under the first
	// page's price XHR: that unit's staging is quarantined and it replays from its first
	// step on another session; every job still ends with one result, all from one session.
	var rendered []tasks.Spec
	if o.Rendered > 0 {
		site.SetSchemaChange(false)
		site.SetChallenge(false) // the example's rendered kind does not pass challenges
		for i := 1; i <= o.Rendered; i++ {
			rendered = append(rendered, tasks.Spec{Kind: catalogjs.Kind, SourceID: fmt.Sprintf("sku-%d", i),
				Country: o.Countries[0], Window: sched.window, ParserVersion: 1})
		}
		proxy.DropNext("/api/price/")
		res, err := enq.EnqueueMany(runCtx, rendered)
		if err != nil {
			return err
		}
		created := 0
		for _, r := range res {
			if r.Outcome == tasks.Created {
				created++
			}
		}
		fmt.Fprintf(out, "\nthe shop reverts its rename; its JavaScript product pages (price by XHR): %d %s jobs created, rendered in Chromium\n"+
			"  on their sticky sessions; the proxy drops the device under the first page's price XHR\n",
			created, catalogjs.Kind)
		if err := waitSettled(runCtx, pool, rdb, streams, o.Progress, out, began); err != nil {
			return err
		}
	}
	elapsed := time.Since(began)
	if err := stopCons(); err != nil {
		return err
	}
	if o.afterSettled != nil {
		if err := o.afterSettled(runCtx, pool); err != nil {
			return err
		}
	}

	sum, err := collect(runCtx, pool, rdb, reg, proxy, n, o, streams, schemaWindow)
	if err != nil {
		return err
	}
	sum.Challenges = int64(site.Challenges())
	sum.BrowserNote = browserNote
	if err := sum.collectRendered(runCtx, pool, site, rendered); err != nil {
		return err
	}
	sum.DuplicateEnqueues = dupEnqueues
	sum.CrashedBatch = crashedBatch.Load()
	sum.Elapsed = elapsed
	sum.render(out, o)

	if o.UI {
		base := "http://" + svc.HTTPAddr()
		fmt.Fprintf(out, "\nUI mode: the worker's HTTP server stays up until Ctrl-C\n")
		fmt.Fprintf(out, "  asynqmon (queues, tasks)           %s/monitoring/\n", base)
		fmt.Fprintf(out, "  failed and retryable jobs          %s/jobs\n", base)
		for _, k := range sum.ShowcaseKeys {
			fmt.Fprintf(out, "  %-34s %s/jobs/%s\n", k[0], base, url.PathEscape(k[1]))
		}
		fmt.Fprintf(out, "  metrics                            %s/metrics\n", base)
		<-ctx.Done()
		fmt.Fprintln(out, "\nstopping")
	}
	if err := shutdown(); err != nil {
		return err
	}
	return sum.verdict()
}

// priceAlert is the consumer's side effect, written through the inbox transaction: it
// takes place exactly once per event.
func priceAlert(ctx context.Context, tx pgx.Tx, ev outbox.Event) error {
	var e struct {
		Data catalog.Record `json:"data"`
	}
	if err := json.Unmarshal(ev.Payload, &e); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, `INSERT INTO price_alerts (event_key, sku, price) VALUES ($1, $2, $3)`, ev.EventKey, e.Data.SKU, e.Data.Price)
	return err
}

// demoScheduler is the scheduler with the demo's templates.
type demoScheduler struct {
	s              *scheduler.Scheduler
	templates      []string // ticked in phase 1
	schemaTemplate string   // ticked in phase 2, after the shop's schema change ("" none)
	window         string
}

// newScheduler builds the scheduler from a YAML configuration, as cmd/scheduler reads it:
// a daily template over the catalog in the served countries, and one for a few products
// in the country the proxy has no peers in.
func newScheduler(o options, n names, client *asynq.Client, rdb redis.UniversalClient, st *store.PG, insp *asynq.Inspector,
	destinations *tasks.DestinationPolicy, logger *slog.Logger) (*demoScheduler, error) {
	// template is one catalog template over the products sku-1 … sku-<products>, without
	// catch-up.
	template := func(name, cron, window string, products int, countries string) string {
		ids := make([]string, products)
		for i := range ids {
			ids[i] = fmt.Sprintf("sku-%d", i+1)
		}
		return fmt.Sprintf(`  - name: %s
    cron: %q
    window: %s
    kind: catalog
    sources: {ids: [%s]}
    countries: [%s]
    parser_version: 1
    catchup: none
`, name, cron, window, strings.Join(ids, ", "), countries)
	}
	yaml := "\ntemplates:\n" + template("catalog-daily", "0 6 * * *", "daily", o.Products, strings.Join(o.Countries, ", "))
	templates := []string{"catalog-daily"}
	if o.Unavailable != "" && o.UnavailableJobs > 0 {
		name := "catalog-daily-" + strings.ToLower(o.Unavailable)
		yaml += template(name, "0 6 * * *", "daily", o.UnavailableJobs, o.Unavailable)
		templates = append(templates, name)
	}
	schemaTemplate := ""
	if o.SchemaChangeJobs > 0 {
		schemaTemplate = "catalog-hourly"
		yaml += template(schemaTemplate, "0 * * * *", "hourly", o.SchemaChangeJobs, o.Countries[0])
	}
	yaml += fmt.Sprintf("kinds:\n  catalog: {queue: %s}\n", n.Queue)
	file, err := scheduler.ParseFile([]byte(yaml), ".", nil)
	if err != nil {
		return nil, err
	}
	s, err := scheduler.New(scheduler.Config{File: file, Client: client, Redis: rdb, Store: st, Inspector: insp,
		Destinations: destinations, Logger: logger})
	if err != nil {
		return nil, err
	}
	return &demoScheduler{s: s, templates: templates, schemaTemplate: schemaTemplate, window: tickInstant(time.Now()).Format("2006-01-02")}, nil
}

// tickInstant is the most recent 06:00 UTC at or before now: the scheduled instant of the
// daily templates' latest tick.
func tickInstant(now time.Time) time.Time {
	now = now.UTC()
	t := time.Date(now.Year(), now.Month(), now.Day(), 6, 0, 0, 0, time.UTC)
	if t.After(now) {
		t = t.AddDate(0, 0, -1)
	}
	return t
}

// redactDSN shows a DSN's host and database, never its password.
func redactDSN(dsn string) string {
	u, err := url.Parse(dsn)
	if err != nil || u.Host == "" {
		return "the configured server"
	}
	return u.Host
}
