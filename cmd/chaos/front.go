package main

import (
	"bufio"
	"io"
	"net"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"
)

// siteFront stands between the fake proxy and the fake shop in the chaos phase: it relays
// every connection byte for byte, dialling the shop from the address the proxy dialled it
// from (the exit: the shop binds its sessions to it, StrictExit), and holds the requests
// for a SKU while the harness wants the attempt that sends them to stay running.
//
// A stale commit is continued while another attempt holds its job running (resumeStale):
// that attempt is a real worker's, and without the hold it fetches and commits within
// milliseconds, too fast for the harness to see the job running under it, let alone to
// send the stale commit meanwhile. Held at its first request, the attempt cannot commit
// until the harness lets it go, after the stale commit returned. The fake proxy sends one
// request per connection to a plain-HTTP destination, so the request line read from a
// connection is the only request on it.
type siteFront struct {
	URL    string // http://127.0.0.1:<port>, the workers' -catalog-base in the chaos phase
	ln     net.Listener
	target string // the shop's host:port

	mu     sync.Mutex
	holds  map[string]*skuHold // SKU → its hold, while held
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup
}

// skuHold is one SKU's hold: its requests wait until released is closed.
type skuHold struct {
	released chan struct{}
	held     int // requests that waited on it
}

// newSiteFront starts a front for the shop at siteURL; tb's cleanup closes it.
func newSiteFront(tb testing.TB, siteURL string) (*siteFront, error) {
	u, err := url.Parse(siteURL)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	f := &siteFront{URL: "http://" + ln.Addr().String(), ln: ln, target: u.Host,
		holds: map[string]*skuHold{}, conns: map[net.Conn]struct{}{}}
	f.wg.Add(1)
	go f.acceptLoop()
	tb.Cleanup(f.Close)
	return f, nil
}

// Hold holds every later request for sku until the returned release is called (release
// may be called more than once); held reports how many requests waited on the hold.
func (f *siteFront) Hold(sku string) (release func(), held func() int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	hd := &skuHold{released: make(chan struct{})}
	f.holds[sku] = hd
	var once sync.Once
	release = func() {
		once.Do(func() {
			f.mu.Lock()
			if f.holds[sku] == hd {
				delete(f.holds, sku)
			}
			f.mu.Unlock()
			close(hd.released)
		})
	}
	held = func() int {
		f.mu.Lock()
		defer f.mu.Unlock()
		return hd.held
	}
	return release, held
}

// Close stops accepting, releases every held request and closes every connection.
func (f *siteFront) Close() {
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		return
	}
	f.closed = true
	_ = f.ln.Close()
	for c := range f.conns {
		_ = c.Close()
	}
	for sku, hd := range f.holds {
		delete(f.holds, sku)
		close(hd.released)
	}
	f.mu.Unlock()
	f.wg.Wait()
}

// track registers c, or reports false once the front is closed.
func (f *siteFront) track(c net.Conn) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return false
	}
	f.conns[c] = struct{}{}
	return true
}

func (f *siteFront) untrack(c net.Conn) {
	f.mu.Lock()
	delete(f.conns, c)
	f.mu.Unlock()
	_ = c.Close()
}

func (f *siteFront) acceptLoop() {
	defer f.wg.Done()
	for {
		c, err := f.ln.Accept()
		if err != nil {
			return
		}
		if !f.track(c) {
			_ = c.Close()
			return
		}
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			defer f.untrack(c)
			f.relay(c)
		}()
	}
}

// relay reads the request line, waits out a hold of its SKU, then relays the connection
// to the shop from the client's address, both ways, until the shop closes it.
func (f *siteFront) relay(c net.Conn) {
	br := bufio.NewReader(c)
	line, err := br.ReadString('\n')
	if err != nil {
		return
	}
	if sku := skuOfRequestLine(line); sku != "" {
		f.mu.Lock()
		hd := f.holds[sku]
		if hd != nil {
			hd.held++
		}
		f.mu.Unlock()
		if hd != nil {
			<-hd.released // Close releases every hold
		}
	}
	var local *net.TCPAddr
	if a, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		local = &net.TCPAddr{IP: a.IP}
	}
	d := net.Dialer{LocalAddr: local, Timeout: 5 * time.Second}
	up, err := d.Dial("tcp", f.target)
	if err != nil {
		return
	}
	if !f.track(up) {
		_ = up.Close()
		return
	}
	defer f.untrack(up)
	if _, err := io.WriteString(up, line); err != nil {
		return
	}
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		_, _ = io.Copy(up, br) // the rest of the request, buffered or not; ends when either side closes
	}()
	_, _ = io.Copy(c, up) // the answer, until the shop closes (the proxy asked Connection: close)
	// Both deferred closes end the copy above.
}

// skuOfRequestLine is the SKU a catalog request line asks for (GET /search?q=<sku>,
// /product/<sku>, /api/price/<sku>?token=…), or "".
func skuOfRequestLine(line string) string {
	f := strings.Fields(line)
	if len(f) < 2 {
		return ""
	}
	u, err := url.ParseRequestURI(f[1])
	if err != nil {
		return ""
	}
	switch {
	case u.Path == "/search":
		return u.Query().Get("q")
	case strings.HasPrefix(u.Path, "/product/"):
		return strings.TrimPrefix(u.Path, "/product/")
	case strings.HasPrefix(u.Path, "/api/price/"):
		return strings.TrimPrefix(u.Path, "/api/price/")
	}
	return ""
}
