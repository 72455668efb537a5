package main

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestSiteFront: the front relays a request byte for byte from the address the client
// dialled it from (the shop binds sessions to the exit), and holds the requests of a held
// SKU, and only those, until released.
func TestSiteFront(t *testing.T) {
	var hits atomic.Int64
	site := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		host, _, _ := net.SplitHostPort(r.RemoteAddr)
		w.Header().Set("X-Exit", host)
		_, _ = io.WriteString(w, r.URL.RequestURI())
	}))
	t.Cleanup(site.Close)
	f, err := newSiteFront(t, site.URL)
	require.NoError(t, err)

	// get sends one request from exit, as the fake proxy does (one per connection).
	get := func(exit, target string) (string, string, error) {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(exit)}}
		c, err := d.Dial("tcp", strings.TrimPrefix(f.URL, "http://"))
		if err != nil {
			return "", "", err
		}
		defer c.Close()
		if _, err := io.WriteString(c, "GET "+target+" HTTP/1.1\r\nHost: shop\r\nConnection: close\r\n\r\n"); err != nil {
			return "", "", err
		}
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			return "", "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return resp.Header.Get("X-Exit"), string(b), err
	}

	exit, body, err := get("127.0.0.7", "/api/price/sku-1?token=abc")
	require.NoError(t, err)
	assert.Equal(t, "127.0.0.7", exit, "the shop sees the client's exit")
	assert.Equal(t, "/api/price/sku-1?token=abc", body)

	release, held := f.Hold("sku-1")
	type answer struct {
		body string
		err  error
	}
	done := make(chan answer, 1)
	go func() {
		_, b, err := get("127.0.0.8", "/search?q=sku-1")
		done <- answer{b, err}
	}()
	for held() == 0 {
		select {
		case a := <-done:
			t.Fatalf("a held request was answered: %+v", a)
		default:
		}
		time.Sleep(5 * time.Millisecond) // polling the front's count
	}
	// Another SKU, even one the held one prefixes, goes through meanwhile.
	_, body, err = get("127.0.0.9", "/product/sku-10")
	require.NoError(t, err)
	assert.Equal(t, "/product/sku-10", body)
	assert.Equal(t, int64(2), hits.Load(), "the held request has not reached the shop")
	release()
	a := <-done
	require.NoError(t, a.err)
	assert.Equal(t, "/search?q=sku-1", a.body)
	assert.Equal(t, int64(3), hits.Load())
	assert.Equal(t, 1, held())
	release() // twice is harmless

	// After the release, the SKU goes through again.
	_, body, err = get("127.0.0.8", "/product/sku-1")
	require.NoError(t, err)
	assert.Equal(t, "/product/sku-1", body)
}

func TestSkuOfRequestLine(t *testing.T) {
	for line, want := range map[string]string{
		"GET /search?q=sku-5 HTTP/1.1\r\n":              "sku-5",
		"GET /product/sku-5 HTTP/1.1\r\n":               "sku-5",
		"GET /api/price/sku-50?token=x HTTP/1.1\r\n":    "sku-50",
		"GET /robots.txt HTTP/1.1\r\n":                  "",
		"GET /search?q=sku-5&x=1 HTTP/1.1\r\n":          "sku-5",
		"garbage\r\n":                                   "",
		"GET http://127.0.0.1:1/product/sku-2 HTTP/1.1": "sku-2",
	} {
		assert.Equal(t, want, skuOfRequestLine(line), line)
	}
}
