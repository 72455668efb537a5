package main

import (
	"context"
	"encoding/hex"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// otlpCollector is a loopback OTLP/HTTP endpoint that keeps what it is sent.
type otlpCollector struct {
	srv  *httptest.Server
	mu   sync.Mutex
	reqs []*collectortrace.ExportTraceServiceRequest
	raw  [][]byte
}

func newOTLPCollector(t *testing.T) *otlpCollector {
	c := &otlpCollector{}
	c.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil || r.URL.Path != "/v1/traces" {
			http.Error(w, "bad request", http.StatusBadRequest)
			return
		}
		var req collectortrace.ExportTraceServiceRequest
		if err := proto.Unmarshal(body, &req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		c.mu.Lock()
		c.reqs, c.raw = append(c.reqs, &req), append(c.raw, body)
		c.mu.Unlock()
		w.Header().Set("Content-Type", "application/x-protobuf")
		out, _ := proto.Marshal(&collectortrace.ExportTraceServiceResponse{})
		_, _ = w.Write(out)
	}))
	t.Cleanup(c.srv.Close)
	return c
}

// TestWorkerExportsTraces: a worker started with the standard OTEL_* environment exports
// its spans over OTLP/HTTP; each job's attempt continues the trace its enqueue started (the
// task carries the traceparent); the resource names the service; no span or attribute the
// worker sent holds the proxy password.
func TestWorkerExportsTraces(t *testing.T) {
	bin := buildWorker(t)
	col := newOTLPCollector(t)
	w := newWorldOn(t, 0, 2, testutil.Redis(t))
	w.gate.open()

	// The enqueues, traced in this process.
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	client := asynq.NewClient(w.ns.AsynqOpt())
	t.Cleanup(func() { _ = client.Close() })
	enq, err := tasks.NewEnqueuer(client, w.st, &tasks.EnqueuerConfig{Queue: w.ns.Queue, TracerProvider: tp})
	require.NoError(t, err)
	for _, sku := range []string{"sku-1", "sku-2"} {
		res, err := enq.Enqueue(context.Background(), tasks.Spec{Kind: catalog.Kind, SourceID: sku, Country: "US", Window: "2026-04-23", ParserVersion: 1})
		require.NoError(t, err)
		w.keys = append(w.keys, res.Key)
	}
	enqueueTraces := map[string]bool{}
	for _, s := range exp.GetSpans() {
		enqueueTraces[s.SpanContext.TraceID().String()] = true
	}
	require.Len(t, enqueueTraces, 2)

	env := append(w.env(t), "OTEL_EXPORTER_OTLP_ENDPOINT="+col.srv.URL, "OTEL_SERVICE_NAME=", "OTEL_TRACES_EXPORTER=",
		"OTEL_EXPORTER_OTLP_PROTOCOL=", "OTEL_SDK_DISABLED=")
	wk := startWorker(t, bin, w.args(2, 30*time.Second), env)
	waitTerminal(t, 2, wk)
	require.NoError(t, wk.cmd.Process.Signal(syscall.SIGTERM))
	assert.Equal(t, 0, wk.wait(t, 90*time.Second))
	assert.Contains(t, wk.log(), `"tracing":true`)

	col.mu.Lock()
	defer col.mu.Unlock()
	require.NotEmpty(t, col.reqs, "the worker exported its spans before it exited")
	attemptTraces := map[string]bool{}
	names := map[string]int{}
	for _, req := range col.reqs {
		for _, rs := range req.ResourceSpans {
			var service string
			for _, a := range rs.Resource.GetAttributes() {
				if a.Key == "service.name" {
					service = a.Value.GetStringValue()
				}
			}
			assert.Equal(t, "idemscrape-worker", service)
			for _, ss := range rs.ScopeSpans {
				for _, s := range ss.Spans {
					names[s.Name]++
					if s.Name == "idemscrape.attempt" {
						attemptTraces[hex.EncodeToString(s.TraceId)] = true
					}
				}
			}
		}
	}
	assert.Equal(t, enqueueTraces, attemptTraces, "each attempt continues its enqueue's trace")
	for _, name := range []string{"lease", "start", "session", "step search", "fetch", "parse", "commit", "release"} {
		assert.Positive(t, names[name], "a %q span", name)
	}
	for _, raw := range col.raw {
		assert.NotContains(t, string(raw), proxyPassword)
	}
}
