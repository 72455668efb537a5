package testutil

import (
	"context"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// TCPProxy forwards connections on a loopback port to a target address, and can make the
// target look gone: Refuse cuts every connection it carries and closes new ones at once
// (a PostgreSQL or Redis that went away, for the clients behind the proxy only); Accept
// lets them through again. It is closed at the end of the test.
type TCPProxy struct {
	// Addr is the proxy's host:port.
	Addr string

	target   string
	ln       net.Listener
	refused  atomic.Int64
	mu       sync.Mutex
	refusing bool
	conns    map[net.Conn]struct{}
	wg       sync.WaitGroup
}

// NewTCPProxy starts a proxy to target (host:port, loopback).
func NewTCPProxy(t testing.TB, target string) *TCPProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("testutil: tcp proxy: %v", err)
	}
	p := &TCPProxy{Addr: ln.Addr().String(), target: target, ln: ln, conns: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go p.serve()
	t.Cleanup(p.Close)
	return p
}

func (p *TCPProxy) serve() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		refusing := p.refusing
		if !refusing {
			p.conns[c] = struct{}{}
		}
		p.mu.Unlock()
		if refusing {
			p.refused.Add(1)
			_ = c.Close()
			continue
		}
		p.wg.Add(1)
		go p.pipe(c)
	}
}

func (p *TCPProxy) pipe(c net.Conn) {
	defer p.wg.Done()
	up, err := net.Dial("tcp", p.target)
	if err != nil {
		p.drop(c)
		return
	}
	p.mu.Lock()
	if p.refusing {
		p.mu.Unlock()
		_ = up.Close()
		p.drop(c)
		return
	}
	p.conns[up] = struct{}{}
	p.mu.Unlock()
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(up, c); done <- struct{}{} }()
	go func() { _, _ = io.Copy(c, up); done <- struct{}{} }()
	<-done
	p.drop(c)
	p.drop(up)
	<-done
}

func (p *TCPProxy) drop(c net.Conn) {
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
	_ = c.Close()
}

// Refuse cuts every connection through the proxy and refuses new ones until Accept.
func (p *TCPProxy) Refuse() {
	p.mu.Lock()
	p.refusing = true
	conns := p.conns
	p.conns = map[net.Conn]struct{}{}
	p.mu.Unlock()
	for c := range conns {
		_ = c.Close()
	}
}

// Accept lets connections through again.
func (p *TCPProxy) Accept() {
	p.mu.Lock()
	p.refusing = false
	p.mu.Unlock()
}

// Refused counts the connections refused since the start.
func (p *TCPProxy) Refused() int64 { return p.refused.Load() }

// Close stops the proxy and cuts its connections.
func (p *TCPProxy) Close() {
	_ = p.ln.Close()
	p.Refuse()
	p.wg.Wait()
}

// PoolVia returns a pool on pool's database through a TCPProxy of the test's own (and
// the proxy): a client whose PostgreSQL can go away (Refuse) while the other clients of
// the test keep theirs. Both are closed when the test ends.
func PoolVia(t testing.TB, pool *pgxpool.Pool) (*pgxpool.Pool, *TCPProxy) {
	t.Helper()
	cfg := pool.Config().Copy()
	proxy := NewTCPProxy(t, net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port))))
	host, port, err := net.SplitHostPort(proxy.Addr)
	if err != nil {
		t.Fatalf("testutil: proxy address %s: %v", proxy.Addr, err)
	}
	p, err := strconv.Atoi(port)
	if err != nil {
		t.Fatalf("testutil: proxy port %s: %v", port, err)
	}
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = host, uint16(p)
	cfg.ConnConfig.ConnectTimeout = 5 * time.Second
	via, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("testutil: pool via proxy: %v", err)
	}
	t.Cleanup(via.Close)
	return via, proxy
}
