package telemetry

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// TestEnabled: off by default; on with an endpoint or exporter otlp; none and the SDK
// switch turn it off; an exporter or protocol this build does not have is an error that
// names the variable.
func TestEnabled(t *testing.T) {
	for _, c := range []struct {
		env  map[string]string
		on   bool
		fail string
	}{
		{env: nil},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, on: true},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, on: true},
		{env: map[string]string{"OTEL_TRACES_EXPORTER": "otlp"}, on: true},
		{env: map[string]string{"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}},
		{env: map[string]string{"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}},
		{env: map[string]string{"OTEL_TRACES_EXPORTER": "zipkin"}, fail: "OTEL_TRACES_EXPORTER"},
		{env: map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, fail: "OTEL_EXPORTER_OTLP_PROTOCOL"},
		{env: map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, on: true},
	} {
		on, err := Enabled(func(k string) string { return c.env[k] })
		if c.fail != "" {
			require.Error(t, err, "%v", c.env)
			assert.Contains(t, err.Error(), c.fail)
			continue
		}
		require.NoError(t, err, "%v", c.env)
		assert.Equal(t, c.on, on, "%v", c.env)
	}
}
