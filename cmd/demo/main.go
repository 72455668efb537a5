// Command demo runs idemscrape end to end on this machine, in under two minutes, against a
// local fake shop behind a local fake residential proxy with a fault mix:
//
//   - proxy devices disconnect mid-workflow (the unit is quarantined and replayed on another
//     sticky session: a warm one of the session pool, else a new one);
//   - the shop answers its first requests 429 Too Many Requests with Retry-After (the attempt
//     is retried no earlier than the shop asked);
//   - the proxy has no peers in one country (JP): those jobs retry, then fail at their attempt
//     cap, as the retry policy says;
//   - the outbox dispatcher crashes once between its XADDs and moving its position (its batch is published
//     twice; the consumer recognises the replays).
//   - a product page that needs JavaScript (its price arrives by XHR) is rendered in
//     Chromium on the unit's sticky session, and the device drops under the price XHR
//     (the unit is quarantined and replayed from its first step on another session). make
//     demo installs Debian's chromium; without one the phase is skipped and says so.
//
// It runs the worker entry point (package service: asynq server with the runner, the outbox
// dispatcher, /monitoring and /jobs), one scheduler tick per template (and the same tick
// again, which enqueues nothing new), and a consumer in inbox mode whose side effect is a
// "price alerts" table. A progress line shows jobs done, attempts and bytes; a summary
// table shows what happened, one line per fault, and the invariants. It exits 1 if an
// invariant breaks or a fault did not happen.
//
// Everything it creates is its own: a fresh database idemscrape_demo_<run id> marked with
// COMMENT ON DATABASE (it drops only a database carrying its mark), a Redis key prefix and
// asynq queue idemscrape-demo-<run id> (it deletes only keys under them; it never flushes).
//
//	make demo                 (starts PostgreSQL and Redis if needed)
//	make demo UI=1            (keeps the worker's HTTP server up: asynqmon, job pages)
//	make demo KEEP=1          (keeps the run's database and keys, and prints the CLI's
//	                           environment for them, a job key and how to delete them)
//	go run ./cmd/demo -drop RUNID   (deletes a kept run)
//	go run ./cmd/demo [-ui] [-pg postgres://postgres@127.0.0.1:5432/postgres] [-redis 127.0.0.1:6379]
//	go run ./cmd/demo -redis-cluster 127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002
//
// -redis and -redis-cluster also read $IDEMSCRAPE_REDIS and $IDEMSCRAPE_REDIS_CLUSTER, as
// cmd/worker does.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/idemscrape/idemscrape/cmd/internal/envflag"
	"github.com/idemscrape/idemscrape/testutil"
)

// envUI turns UI mode on when set to 1, true or yes (what `make demo UI=1` passes).
const envUI = "IDEMSCRAPE_DEMO_UI"

func main() {
	o := defaultOptions()
	flag.StringVar(&o.AdminDSN, "pg", o.AdminDSN, "PostgreSQL DSN of a role that may CREATE DATABASE (the demo creates and drops its own database)")
	// -redis / -redis-cluster (and $IDEMSCRAPE_REDIS / $IDEMSCRAPE_REDIS_CLUSTER) as the worker
	// reads them; the demo uses and deletes only its own key prefix and queue.
	var rf envflag.Redis
	rf.Define(&envflag.Set{FS: flag.CommandLine, Prefix: "IDEMSCRAPE_"})
	flag.IntVar(&o.Products, "products", o.Products, "catalog size: one job per product and served country")
	flag.IntVar(&o.Rendered, "rendered", o.Rendered, "JavaScript product pages rendered in Chromium in the last phase (0 skips it)")
	flag.Float64Var(&o.Disconnect, "disconnect", o.Disconnect, "probability that the fake proxy's device drops a request")
	flag.StringVar(&o.Price, "proxy-price", o.Price, `the fake proxy's price, "<amount> <CUR>/GB" ("" for none): each attempt's cost`)
	flag.BoolVar(&o.UI, "ui", envBool(envUI), "keep the HTTP server (asynqmon, job pages) up after the summary until Ctrl-C (or set "+envUI+"=1)")
	flag.StringVar(&o.HTTPAddr, "http", o.HTTPAddr, "listen address of the worker's HTTP server")
	flag.BoolVar(&o.Keep, "keep", false, "keep the demo's database and Redis keys at exit (prints their names, the CLI's environment for them and how to delete them)")
	drop := flag.String("drop", "", "delete the kept run `RUNID` (its database, if it carries the run's mark, and its Redis keys and queue), then exit")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: demo [flags]\n\nRuns idemscrape end to end against a fake shop and a fake residential proxy with faults.\n\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "demo: unexpected argument %q\n", flag.Arg(0))
		flag.Usage()
		os.Exit(2)
	}
	var err error
	if o.Redis, err = rf.Config(); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(2)
	}
	if *drop != "" {
		dctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		err := dropRun(dctx, o.AdminDSN, o.Redis, *drop)
		cancel()
		if err != nil {
			fmt.Fprintln(os.Stderr, "demo:", err)
			os.Exit(1)
		}
		fmt.Printf("demo run %s deleted: database %s, Redis keys %s*, asynq queue %s\n", *drop, newNames(*drop).Database, newNames(*drop).Prefix, newNames(*drop).Queue)
		return
	}
	o.Out = os.Stdout
	o.Progress = progressPlain
	if isTerminal(os.Stdout) {
		o.Progress = progressTerminal
	}

	// Ctrl-C or SIGTERM stops the run (or the UI wait); cleanup still runs.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	tb, err := testutil.NewProcessTB("demo")
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
	began := time.Now()
	err = runRecovered(ctx, tb, o)
	tb.Close()
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
	fmt.Printf("demo finished in %v\n", time.Since(began).Round(100*time.Millisecond))
}

func envBool(name string) bool {
	switch strings.ToLower(strings.TrimSpace(os.Getenv(name))) {
	case "1", "true", "yes", "on":
		return true
	}
	return false
}

func isTerminal(f *os.File) bool {
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

// runRecovered is run with a fake's start-up failure (testutil.FatalError) as an error,
// so that the cleanups still run.
func runRecovered(ctx context.Context, tb *testutil.ProcessTB, o options) (err error) {
	defer testutil.RecoverFatal(&err)
	return run(ctx, tb, o)
}
