// Command fakes runs the test shop and residential proxy gateway of testutil on loopback
// until Ctrl-C, so that cmd/worker can run locally without a proxy account: it prints the
// environment the worker needs and the commands to try.
//
//	go run ./cmd/fakes              # then, in another shell, what it prints
//	go run ./cmd/fakes -products 50 -disconnect 0.05
//	go run ./cmd/fakes -challenge -challenge-block-every 10
//
// -challenge puts the shop behind an anti-bot challenge (testutil.FakeSiteConfig.Challenge):
// every request but robots.txt needs a clearance cookie bound to its exit, which a
// challenge page sets, and a clearance brought from another exit gets 403.
// -challenge-block-every N (with -challenge) answers every N-th challenge with a 403 block
// instead.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
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

// usage is the command's usage line.
const usage = "fakes: usage: fakes [-products N>=1] [-seed S] [-disconnect P in 0..1] [-challenge [-challenge-block-every N>=0]]"

// options are the command's flags.
type options struct {
	products   int
	seed       int64
	disconnect float64
	challenge  bool
	blockEvery int
}

// parseFlags reads the command line (without the program name); errors name the bad flag.
// The flag package's own complaints and -h's help go to out.
func parseFlags(args []string, out io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("fakes", flag.ContinueOnError)
	fs.SetOutput(out)
	fs.Usage = func() {
		fmt.Fprintln(out, usage)
		fs.PrintDefaults()
	}
	fs.IntVar(&o.products, "products", 20, "catalog size: sku-1 … sku-N")
	fs.Int64Var(&o.seed, "seed", 1, "seed of the catalog and the exits")
	fs.Float64Var(&o.disconnect, "disconnect", 0, "probability that a proxied request loses its device (0 … 1)")
	fs.BoolVar(&o.challenge, "challenge", false, "put the shop behind an anti-bot challenge (a clearance cookie bound to the exit)")
	fs.IntVar(&o.blockEvery, "challenge-block-every", 0, "with -challenge: answer every N-th challenge with a 403 block (0: never)")
	if err := fs.Parse(args); err != nil {
		return o, err // already printed, with the usage
	}
	switch {
	case fs.NArg() > 0:
		return o, &usageError{fmt.Sprintf("unexpected argument %q", fs.Arg(0))}
	case o.products < 1:
		return o, &usageError{fmt.Sprintf("-products %d: want at least 1", o.products)}
	case o.disconnect < 0 || o.disconnect > 1:
		return o, &usageError{fmt.Sprintf("-disconnect %v: want a probability in 0..1", o.disconnect)}
	case o.blockEvery < 0:
		return o, &usageError{fmt.Sprintf("-challenge-block-every %d: want 0 (never) or more", o.blockEvery)}
	case o.blockEvery > 0 && !o.challenge:
		return o, &usageError{"-challenge-block-every needs -challenge"}
	}
	return o, nil
}

// usageError is a flag value parseFlags refused after the flag package accepted it.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

// siteConfig is the shop's configuration for o.
func (o options) siteConfig() testutil.FakeSiteConfig {
	return testutil.FakeSiteConfig{Seed: o.seed, Products: o.products, Challenge: o.challenge, ChallengeBlockEvery: o.blockEvery}
}

// shopMode describes the shop's challenge mode for the banner.
func (o options) shopMode() string {
	switch {
	case !o.challenge:
		return ""
	case o.blockEvery > 0:
		return fmt.Sprintf("; challenge mode: clearance bound to the exit, 1 challenge in %d a 403 block", o.blockEvery)
	}
	return "; challenge mode: clearance bound to the exit"
}

func main() {
	o, err := parseFlags(os.Args[1:], os.Stderr)
	switch {
	case errors.Is(err, flag.ErrHelp):
		os.Exit(0)
	case errors.As(err, new(*usageError)):
		fmt.Fprintln(os.Stderr, "fakes:", err)
		fmt.Fprintln(os.Stderr, usage)
		os.Exit(2)
	case err != nil: // the flag package printed it
		os.Exit(2)
	}
	tb, err := testutil.NewProcessTB("fakes")
	if err != nil {
		fmt.Fprintln(os.Stderr, "fakes:", err)
		os.Exit(1)
	}
	defer tb.Close()
	site := testutil.NewFakeSite(tb, o.siteConfig())
	proxy := testutil.NewFakeProxy(tb, testutil.FakeProxyConfig{Seed: o.seed, Format: testutil.ProxyFormatOxylabs,
		User: proxyUser, Password: proxyPassword, DisconnectProb: o.disconnect})

	fmt.Printf(`fake shop    %s (sku-1 … sku-%d%s)
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
`, site.URL, o.products, o.shopMode(), proxy.Addr, site.URL, proxyUser, proxyPassword, proxy.Addr)

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	<-ctx.Done()
}
