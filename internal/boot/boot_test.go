package boot

import (
	"bytes"
	"context"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/assert"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// TestTracingMisconfiguredIsAWarning: a tracing setting this build can not honour (set
// fleet-wide for other services) leaves tracing off with a warning; the binary goes on.
func TestTracingMisconfiguredIsAWarning(t *testing.T) {
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
	var logs bytes.Buffer
	flush, on := Tracing(context.Background(), "idemscrape-test", slog.New(slog.NewTextHandler(&logs, nil)))
	flush()
	assert.False(t, on)
	assert.Contains(t, logs.String(), "tracing off")
	assert.Contains(t, logs.String(), "OTEL_EXPORTER_OTLP_PROTOCOL")

	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "")
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "")
	logs.Reset()
	flush, on = Tracing(context.Background(), "idemscrape-test", slog.New(slog.NewTextHandler(&logs, nil)))
	flush()
	assert.False(t, on, "off by default")
	assert.Empty(t, logs.String())
}
