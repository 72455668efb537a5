package profile_test

import (
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"github.com/gocolly/colly/v2"
	"github.com/google/go-cmp/cmp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/sessions/profile"
)

// recorder is a server that keeps the headers of every request it receives.
type recorder struct {
	*httptest.Server
	mu   sync.Mutex
	seen []http.Header
}

func newRecorder(t *testing.T) *recorder {
	r := &recorder{}
	r.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		r.mu.Lock()
		r.seen = append(r.seen, req.Header.Clone())
		r.mu.Unlock()
		w.Header().Set("Content-Type", "text/html")
		_, _ = w.Write([]byte("<html><body>ok</body></html>"))
	}))
	t.Cleanup(r.Close)
	return r
}

func (r *recorder) last(t *testing.T) http.Header {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	require.NotEmpty(t, r.seen, "the server saw no request")
	return r.seen[len(r.seen)-1]
}

// withoutTransportHeaders returns h without what Go's transport adds by itself
// (Accept-Encoding: gzip), having checked that it is exactly that.
func withoutTransportHeaders(t *testing.T, h http.Header) http.Header {
	t.Helper()
	h = h.Clone()
	assert.Equal(t, []string{"gzip"}, h.Values("Accept-Encoding"), "the transport's own Accept-Encoding")
	h.Del("Accept-Encoding")
	return h
}

// TestWireHTTPClient sends a request through net/http after Apply: the server receives
// the profile's headers and nothing else but the transport's Accept-Encoding.
func TestWireHTTPClient(t *testing.T) {
	srv := newRecorder(t)
	client := srv.Client()
	for _, p := range profile.All() {
		p, err := p.WithLocale("de-DE")
		require.NoError(t, err)
		t.Run(p.Name, func(t *testing.T) {
			req, err := http.NewRequest(http.MethodGet, srv.URL+"/page", nil)
			require.NoError(t, err)
			p.Apply(req.Header)
			resp, err := client.Do(req)
			require.NoError(t, err)
			_ = resp.Body.Close()

			got := withoutTransportHeaders(t, srv.last(t))
			assert.Empty(t, cmp.Diff(p.Headers(), got), "on the wire (-profile +received)")
		})
	}

	t.Run("StepHeaderWinsOnTheWire", func(t *testing.T) {
		p, _ := profile.Named("chrome-linux")
		req, err := http.NewRequest(http.MethodGet, srv.URL+"/api", nil)
		require.NoError(t, err)
		req.Header.Set("Accept", "application/json")
		p.Apply(req.Header)
		resp, err := client.Do(req)
		require.NoError(t, err)
		_ = resp.Body.Close()
		got := srv.last(t)
		assert.Equal(t, []string{"application/json"}, got.Values("Accept"))
		assert.Equal(t, p.UserAgent, got.Get("User-Agent"))
	})
}

// TestWireColly checks the colly wiring the package documentation recommends
// (Collector.UserAgent and Collector.Headers from the profile): colly's own defaults
// (its User-Agent, "Accept: */*") do not leak onto the wire.
func TestWireColly(t *testing.T) {
	srv := newRecorder(t)
	for _, p := range profile.All() {
		t.Run(p.Name, func(t *testing.T) {
			c := colly.NewCollector(colly.UserAgent(p.UserAgent))
			hdr := p.Headers()
			c.Headers = &hdr
			require.NoError(t, c.Visit(srv.URL+"/colly/"+p.Name))
			got := withoutTransportHeaders(t, srv.last(t))
			assert.Empty(t, cmp.Diff(p.Headers(), got), "on the wire (-profile +received)")
		})
	}
}
