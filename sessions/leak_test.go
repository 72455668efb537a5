package sessions_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gocolly/colly/v2"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestCredentialsNeverLeak runs every fault path with a canary password and looks for it
// (and its base64 form in a Proxy-Authorization header) in everything the code produces:
// log output, error strings, returned structs, colly's request context and request, the
// quarantined (recorded) rows, and what the destination received.
func TestCredentialsNeverLeak(t *testing.T) {
	var seen []string
	var mu sync.Mutex
	record := func(format string, v ...any) {
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, fmt.Sprintf(format, v...))
	}

	// A TLS destination that records every header it receives: through CONNECT it must
	// never see Proxy-Authorization.
	var destHeaders []http.Header
	dest := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		destHeaders = append(destHeaders, r.Header.Clone())
		mu.Unlock()
		fmt.Fprint(w, "<html><body>ok</body></html>")
	}))
	defer dest.Close()

	// Capture colly's view of each request: the Request (with its ProxyURL field and
	// headers) and the Context.
	capture := sessions.Step{Name: "capture", Safe: true, Run: func(_ context.Context, sc *sessions.StepContext) error {
		c := sc.Collector()
		c.OnResponse(func(r *colly.Response) {
			record("%+v %+v %v", *r.Request, *r.Request.Headers, r.Request.ProxyURL)
			r.Ctx.ForEach(func(k string, v any) any { record("%s=%+v", k, v); return nil })
		})
		c.OnError(func(r *colly.Response, err error) {
			record("%v %+v", err, r)
			if r != nil && r.Request != nil {
				record("%+v %v", *r.Request, r.Request.ProxyURL)
			}
		})
		return nil
	}}

	type path struct {
		name    string
		pc      testutil.FakeProxyConfig
		sc      testutil.FakeSiteConfig
		prepare func(e *env)
		mutate  func(*sessions.RunConfig)
		url     string // if set, a one-step unit fetching it instead of the catalog
	}
	paths := []path{
		{name: "success"},
		{name: "success TLS", sc: testutil.FakeSiteConfig{TLS: true}},
		{name: "407 forward", pc: testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: "acct", Password: "wrong"}},
		{name: "407 CONNECT", pc: testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: "acct", Password: "wrong"}, sc: testutil.FakeSiteConfig{TLS: true}},
		{name: "502 country", pc: testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: "acct", Password: canary, UnavailableCountries: []string{"US"}, ErrorHeaders: true}},
		{name: "502 CONNECT", pc: testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: "acct", Password: canary, UnavailableCountries: []string{"US"}}, sc: testutil.FakeSiteConfig{TLS: true}},
		{name: "disconnect", prepare: func(e *env) { e.proxy.SetDisconnectProb(1) }},
		{name: "disconnect TLS", sc: testutil.FakeSiteConfig{TLS: true}, prepare: func(e *env) { e.proxy.SetDisconnectProb(1) }},
		{name: "throttled", prepare: func(e *env) { e.site.Throttle(5, time.Second) }},
		{name: "timeout", prepare: func(e *env) { e.site.SetSlow(time.Second) }, mutate: func(c *sessions.RunConfig) { c.Collector.RequestTimeout = 100 * time.Millisecond }},
		{name: "schema change", prepare: func(e *env) { e.site.SetSchemaChange(true) }},
		{name: "robots", sc: testutil.FakeSiteConfig{Robots: "User-agent: *\nDisallow: /\n"}},
		{name: "ssrf", mutate: func(c *sessions.RunConfig) { c.Collector.Guard = &sessions.Guard{} }},
		{name: "body too large", url: "/big", mutate: func(c *sessions.RunConfig) { c.Collector.MaxBodyBytes = 1 << 20 }},
		{name: "gzip bomb", url: "/bomb"},
		{name: "CONNECT destination", url: "dest"},
	}
	for _, p := range paths {
		e := setup(t, p.pc, p.sc)
		if p.prepare != nil {
			p.prepare(e)
		}
		cfg := e.runCfg()
		cfg.MaxSessionRestarts = 1
		if p.mutate != nil {
			p.mutate(&cfg)
		}
		var unit *sessions.Unit
		switch p.url {
		case "":
			var err error
			unit, err = catalog.Unit(e.site.URL, "sku-1")
			require.NoError(t, err)
		default:
			target := e.site.URL + p.url
			if p.url == "dest" {
				target = dest.URL + "/"
				cfg.Collector.TLSConfig = dest.Client().Transport.(*http.Transport).TLSClientConfig
			}
			unit = &sessions.Unit{Name: "one", Steps: []sessions.Step{{Name: "get", Safe: true, Run: func(_ context.Context, sc *sessions.StepContext) error {
				resp, err := sc.Get(target)
				if resp != nil {
					record("%+v", *resp.Request)
				}
				return err
			}}}}
		}
		unit.Steps = append([]sessions.Step{capture}, unit.Steps...)
		res, err := unit.Run(context.Background(), cfg)
		record("%s: err=%v %+v %#v", p.name, err, err, err)
		if err != nil {
			record("%s", err.Error())
		}
		b, _ := json.Marshal(res)
		record("%s: res=%+v %#v %s", p.name, res, res, b)
		for _, q := range e.quarantined {
			qb, _ := json.Marshal(q)
			record("quarantine %+v %s", q, qb)
		}
		record("%s", e.logs.String())
	}

	secrets := []string{canary, base64.StdEncoding.EncodeToString([]byte("acct-country-us-session-"))[:16]}
	all := strings.Join(seen, "\n")
	require.Greater(t, len(seen), 50, "the fault paths produced output to search")
	for _, s := range secrets {
		require.NotContains(t, all, s)
	}
	require.NotEmpty(t, destHeaders, "the TLS destination was reached through CONNECT")
	for _, h := range destHeaders {
		require.Empty(t, h.Get("Proxy-Authorization"), "the destination must not see proxy credentials")
	}
}
