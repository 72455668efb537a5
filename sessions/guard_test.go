package sessions

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/tasks"
)

type fakeResolver map[string][]netip.Addr

func (f fakeResolver) LookupNetIP(_ context.Context, _, host string) ([]netip.Addr, error) {
	if a, ok := f[host]; ok {
		return a, nil
	}
	return nil, errors.New("no such host")
}

func TestSSRFGuard(t *testing.T) {
	ctx := context.Background()
	res := fakeResolver{
		"public.example":    {netip.MustParseAddr("93.184.215.14")},
		"rebind.example":    {netip.MustParseAddr("93.184.215.14"), netip.MustParseAddr("10.0.0.7")},
		"router.example":    {netip.MustParseAddr("192.168.1.1")},
		"metadata.example":  {netip.MustParseAddr("169.254.169.254")},
		"v6private.example": {netip.MustParseAddr("fd00::1")},
	}
	g := &Guard{Resolver: res}
	forbidden := []string{
		"http://127.0.0.1/", "http://127.1/", "http://2130706433/", "http://0x7f000001/",
		"http://0177.0.0.1/", "http://0x7f.0.0.1/", "http://[::1]/", "http://[::ffff:127.0.0.1]/",
		"http://[::ffff:7f00:1]/", "http://10.0.0.1/", "http://172.16.5.4/", "http://192.168.0.1:8080/",
		"http://169.254.169.254/latest/meta-data/", "http://[fe80::1]/", "http://100.64.0.1/",
		"http://100.100.100.200/", "http://224.0.0.1/", "http://[ff02::1]/", "http://0.0.0.0/",
		"http://[::]/", "http://255.255.255.255/", "http://[fd00:ec2::254]/", "http://[64:ff9b::a00:1]/",
		"http://[2002:c0a8:101::1]/", "https://localhost./", /* refused by name, before any lookup */
		"http://router.example/", "http://metadata.example/", "http://v6private.example/",
		"http://rebind.example/",
	}
	for _, u := range forbidden {
		err := g.Check(ctx, u)
		require.ErrorIs(t, err, ErrForbiddenAddress, u)
	}
	for _, u := range []string{"https://public.example/p/1", "http://93.184.215.14/", "http://[2606:2800:21f:cb07:6820:80da:af6b:8b2c]/"} {
		require.NoError(t, g.Check(ctx, u), u)
	}
	// A public name that resolves to a private address names both in the error.
	err := g.Check(ctx, "http://router.example/admin")
	require.ErrorContains(t, err, "router.example")
	require.ErrorContains(t, err, "192.168.1.1")

	// Allow-listing is explicit and narrow.
	lg := LoopbackGuard()
	require.NoError(t, lg.Check(ctx, "http://127.0.0.1:8080/"))
	require.NoError(t, lg.Check(ctx, "http://2130706433/"))
	require.ErrorIs(t, lg.Check(ctx, "http://10.0.0.1/"), ErrForbiddenAddress)
}

func TestClassifyNetworkFailures(t *testing.T) {
	cases := []struct {
		name string
		err  error
		want tasks.Category
	}{
		{"GuardNXDOMAIN", &ResolveError{Host: "gone.example", Err: &net.DNSError{IsNotFound: true}}, tasks.CategoryDNSNotFound},
		{"GuardTemporary", &ResolveError{Host: "flaky.example", Err: &net.DNSError{IsTemporary: true}}, tasks.CategoryNetwork},
		{"GuardTimeoutIsNetwork", &ResolveError{Host: "slow.example", Err: &net.DNSError{IsTimeout: true}}, tasks.CategoryNetwork},
		// The transport resolves only the proxy gateway: never terminal for the job.
		{"GatewayNXDOMAIN", &url.Error{Op: "Get", URL: "http://x/", Err: &net.OpError{Op: "dial", Err: &net.DNSError{IsNotFound: true, Name: "gw.example"}}}, tasks.CategoryNetwork},
		{"ProxyStatusNXDOMAIN", &proxyStatusError{status: 502, header: http.Header{"Proxy-Status": {`brd; error=dns_error; rcode="NXDOMAIN"`}}}, tasks.CategoryDNSNotFound},
		{"ProxyStatusDNSTimeout", &proxyStatusError{status: 504, header: http.Header{"Proxy-Status": {`brd; error=dns_timeout`}}}, tasks.CategoryNetwork},
		{"ProxyStatusOther", &proxyStatusError{status: 502, header: http.Header{"Proxy-Status": {`brd; error=destination_unreachable`}}}, tasks.CategoryExitUnavailable},
		{"ProxyOutOfBalance", &proxyStatusError{status: 402, header: http.Header{"X-Brd-Err-Code": {"balance_exhausted"}}}, tasks.CategoryProxyAuth},
		{"Canceled", fmt.Errorf("get: %w", context.Canceled), tasks.CategoryInterrupted},
		{"Budget", fmt.Errorf("read: %w", &budgetExceededError{moved: 10, budget: 5}), tasks.CategoryBudgetExceeded},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, classify(tc.err, false).Category)
		})
	}
	// A plain-HTTP 402 is the provider's only with its error header; a shop's own (a
	// paywall) is the destination's answer.
	require.True(t, isProxyRefusal(&http.Response{StatusCode: http.StatusPaymentRequired, Header: http.Header{"X-Brd-Err-Code": {"balance_exhausted"}}}))
	require.False(t, isProxyRefusal(&http.Response{StatusCode: http.StatusPaymentRequired, Header: http.Header{}}))
}
