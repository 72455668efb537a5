package service_test

import (
	"context"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// levelCounter is a slog.Handler that counts records at ERROR and above.
type levelCounter struct {
	mu     *sync.Mutex
	errors *[]string
}

func newLevelCounter() levelCounter { return levelCounter{mu: &sync.Mutex{}, errors: new([]string)} }

func (h levelCounter) Enabled(context.Context, slog.Level) bool { return true }
func (h levelCounter) Handle(_ context.Context, r slog.Record) error {
	if r.Level >= slog.LevelError {
		h.mu.Lock()
		*h.errors = append(*h.errors, r.Message)
		h.mu.Unlock()
	}
	return nil
}
func (h levelCounter) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h levelCounter) WithGroup(string) slog.Handler      { return h }
func (h levelCounter) logged() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), *h.errors...)
}

// TestJobPagesBadBytes400: a /jobs filter or a /jobs/{key} holding a NUL byte or bytes
// that are not UTF-8 is the request's mistake: 400 naming the parameter, no ERROR logged
// (PostgreSQL refuses such text, which read as "the job store did not answer", a 500 and an
// ERROR line per request).
func TestJobPagesBadBytes400(t *testing.T) {
	logs := newLevelCounter()
	b := setup(t, setupOpts{noDisp: true, logger: slog.New(logs)})

	for _, tc := range []struct {
		path, names string
	}{
		{"/jobs?kind=cat%00alog", "/jobs?kind="},
		{"/jobs?kind=%FF%FE", "/jobs?kind="},
		{"/jobs?window=2026-04-23%00", "/jobs?window="},
		{"/jobs?window=%C3", "/jobs?window="},
		{"/jobs?category=%00", "/jobs?category="},
		{"/jobs?category=parse%E2%82", "/jobs?category="},
		{"/jobs?prefix=catalog:%00", "/jobs?prefix="},
		{"/jobs?prefix=%80catalog", "/jobs?prefix="},
		{"/jobs?state=any&kind=catalog&window=%ED%A0%80", "/jobs?window="},
		{"/jobs/catalog:sku-1%00", "/jobs/{key}"},
		{"/jobs/%FF%FEcatalog", "/jobs/{key}"},
		{"/jobs/catalog%C0%AF", "/jobs/{key}"},
	} {
		t.Run(tc.path, func(t *testing.T) {
			code, body := b.do(t, "GET", tc.path, nil)
			assert.Equal(t, http.StatusBadRequest, code, body)
			assert.True(t, strings.HasPrefix(body, tc.names), "names the parameter: %q", body)
			assert.NotContains(t, body, "did not answer")
		})
	}
	assert.Empty(t, logs.logged(), "a bad request is not the store's failure: no ERROR line")

	// Good values next to them still answer.
	code, body := b.do(t, "GET", "/jobs?kind=catalog&window=2026-04-23&prefix=caf%C3%A9", nil)
	require.Equal(t, http.StatusOK, code, body)
	code, _ = b.do(t, "GET", "/jobs/caf%C3%A9", nil)
	require.Equal(t, http.StatusNotFound, code)
}
