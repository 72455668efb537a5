package sessions_test

import (
	"context"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/testutil"
)

// connRelay is a TCP relay in front of a proxy that counts the connections it accepted
// and reports each one that ended.
type connRelay struct {
	addr     string
	accepted atomic.Int64
	ended    chan struct{}
}

func newConnRelay(t *testing.T, target string) *connRelay {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	r := &connRelay{addr: ln.Addr().String(), ended: make(chan struct{}, 1024)}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			r.accepted.Add(1)
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer func() { r.ended <- struct{}{} }()
				up, err := net.Dial("tcp", target)
				if err != nil {
					c.Close()
					return
				}
				done := make(chan struct{}, 2)
				go func() { _, _ = io.Copy(up, c); done <- struct{}{} }()
				go func() { _, _ = io.Copy(c, up); done <- struct{}{} }()
				<-done
				c.Close()
				up.Close()
				<-done
			}()
		}
	}()
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	return r
}

// TestPlainHTTPSharesGatewayConnections: plain-HTTP requests of different sessions reuse
// the gateway's kept-alive connections (a new session needs no new TCP connection), yet
// each request carries its own session's credentials (the proxy attributes the traffic
// to each session); HTTPS tunnels stay per session; the shared connections close once
// the last collector of the gateway is closed.
func TestPlainHTTPSharesGatewayConnections(t *testing.T) {
	e := setup(t, testutil.FakeProxyConfig{}, testutil.FakeSiteConfig{})
	relay := newConnRelay(t, e.proxy.Addr)
	p, err := e.provider.WithGateway(relay.addr)
	require.NoError(t, err)
	cfg := &sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), IgnoreRobotsTxt: true, RequestTimeout: 5 * time.Second}
	page := e.site.URL + "/search?q=sku-1"

	open := func() *sessions.Bound {
		s, err := p.NewSession("US", time.Hour, time.Now())
		require.NoError(t, err)
		b, err := sessions.NewCollector(context.Background(), s, cfg)
		require.NoError(t, err)
		return b
	}
	first := open() // holds the gateway's shared connections open
	_, err = first.Get(page)
	require.NoError(t, err)
	var ids []string
	for range 5 {
		b := open()
		_, err := b.Get(page)
		require.NoError(t, err)
		ids = append(ids, b.Session.ID)
		b.Close()
		b.Close() // idempotent
	}
	require.Equal(t, int64(1), relay.accepted.Load(), "six sessions, one after the other, share one connection to the gateway")
	for _, id := range append(ids, first.Session.ID) {
		require.Positive(t, e.proxy.BytesFor(id), "the proxy saw session %s's own credentials", id)
	}
	require.Len(t, relay.ended, 0, "the shared connection stays open while a collector uses the gateway")
	first.Close()
	recvSignal(t, relay.ended, "the shared connection closed with the last collector")

	// IsolatePlainHTTP: every session its own connection, as for a gateway that binds a
	// connection to its first request's session.
	icfg := *cfg
	icfg.IsolatePlainHTTP = true
	before := relay.accepted.Load()
	for range 2 {
		s, err := p.NewSession("US", time.Hour, time.Now())
		require.NoError(t, err)
		b, err := sessions.NewCollector(context.Background(), s, &icfg)
		require.NoError(t, err)
		_, err = b.Get(page)
		require.NoError(t, err)
		defer b.Close()
	}
	require.Equal(t, before+2, relay.accepted.Load(), "isolated: two sessions, two connections")

	// HTTPS: every session opens its own CONNECT tunnel.
	tlsSite := testutil.NewFakeSite(t, testutil.FakeSiteConfig{TLS: true})
	tcfg := *cfg
	tcfg.TLSConfig = (&env{site: tlsSite}).tlsConfig()
	before = relay.accepted.Load()
	var bounds []*sessions.Bound
	for range 2 {
		s, err := p.NewSession("US", time.Hour, time.Now())
		require.NoError(t, err)
		b, err := sessions.NewCollector(context.Background(), s, &tcfg)
		require.NoError(t, err)
		_, err = b.Get(tlsSite.URL + "/search?q=sku-1")
		require.NoError(t, err)
		bounds = append(bounds, b)
	}
	require.Equal(t, before+2, relay.accepted.Load(), "two HTTPS sessions, two tunnels")
	for _, b := range bounds {
		b.Close()
		_, err := b.Get(tlsSite.URL + "/")
		require.Error(t, err, "a closed collector makes no new tunnel")
	}
}

func recvSignal(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(time.Minute):
		t.Fatalf("%s never happened", what)
	}
}
