// Command fakes runs the test shop and residential proxy gateway of testutil on loopback
// until Ctrl-C, so that cmd/worker can run locally without a proxy account: it prints the
// environment the worker needs and the commands to try.
//
//	go run ./cmd/fakes              # then, in another shell, what it prints
//	go run ./cmd/fakes -products 50 -disconnect 0.05
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/idemscrape/idemscrape/testutil"
)

// proxyUser and proxyPassword are the fake gateway's account: local only, printed on purpose.
const (
	proxyUser     = "local"
	proxyPassword = "local-fake-proxy-pw"
)

func main() {
	products := flag.Int("products", 20, "catalog size: sku-1 … sku-N")
	seed := flag.Int64("seed", 1, "seed of the catalog and the exits")
	disconnect := flag.Float64("disconnect", 0, "probability that a proxied request loses its device (0 … 1)")
	flag.Parse()
	if flag.NArg() > 0 || *products < 1 || *disconnect < 0 || *disconnect > 1 {
		fmt.Fprintln(os.Stderr, "fakes: usage: fakes [-products N>=1] [-seed S] [-disconnect P in 0..1]")
		os.Exit(2)
	}
	tb, err := testutil.NewProcessTB("fakes")
	if err != nil {
		fmt.Fprintln(os.Stderr, "fakes:", err)
		os.Exit(1)
	}
	defer tb.Close()
	site := testutil.NewFakeSite(tb, testutil.FakeSiteConfig{Seed: *seed, Products: *products})
	proxy := testutil.NewFakeProxy(tb, testutil.FakeProxyConfig{Seed: *seed, Format: testutil.ProxyFormatOxylabs,
		User: proxyUser, Password: proxyPassword, DisconnectProb: *disconnect})

	fmt.Printf(`fake shop    %s (sku-1 … sku-%d)
fake proxy   %s (Oxylabs username format, sticky loopback exits)

In another shell (Redis and PostgreSQL on loopback: make services):

  export IDEMSCRAPE_CATALOG_BASE=%s
  export IDEMSCRAPE_PROXY_PROVIDER=oxylabs IDEMSCRAPE_PROXY_USER=%s IDEMSCRAPE_PROXY_PASSWORD=%s
  export IDEMSCRAPE_PROXY_GATEWAY=%s
  go run ./cmd/worker -allow-loopback            # the shop and the proxy live on loopback
  go run ./cmd/idemscrape enqueue -kind catalog -source-id sku-1 -country US -window 2026-04-23 -parser-version 1
  go run ./cmd/idemscrape status catalog:sku-1:US:2026-04-23:v1
  open http://127.0.0.1:8080/jobs

Ctrl-C stops the fakes.
`, site.URL, *products, proxy.Addr, site.URL, proxyUser, proxyPassword, proxy.Addr)

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	<-ctx.Done()
}
