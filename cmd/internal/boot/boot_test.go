package boot

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
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

// TestFlagsExit: -h exits 0 with nothing more printed, a bad flag exits 2 with the error
// after the binary's name, and no error starts the binary.
func TestFlagsExit(t *testing.T) {
	for name, tt := range map[string]struct {
		err    error
		code   int
		exit   bool
		stderr string
	}{
		"None":    {nil, 0, false, ""},
		"Help":    {flag.ErrHelp, 0, true, ""},
		"BadFlag": {errors.New("-concurrency 0 must be >= 1"), 2, true, "worker: -concurrency 0 must be >= 1\n(worker -h lists the flags)\n"},
	} {
		t.Run(name, func(t *testing.T) {
			var stderr bytes.Buffer
			code, exit := FlagsExit("worker", tt.err, &stderr, "text")
			assert.Equal(t, tt.code, code)
			assert.Equal(t, tt.exit, exit)
			assert.Equal(t, tt.stderr, stderr.String())
		})
	}
}

// TestRunExit: run's error decides the exit status and the last log line: a bad setting
// (wrapped or not) is 2, as for a bad flag; any other error is 1; none is 0, logging nothing.
func TestRunExit(t *testing.T) {
	for name, tt := range map[string]struct {
		err  error
		code int
		log  string // "": nothing logged
	}{
		"None":           {nil, 0, ""},
		"BadSetting":     {&SettingError{errors.New("no proxy")}, 2, `level=ERROR msg="bad setting" err="no proxy"`},
		"WrappedSetting": {fmt.Errorf("start: %w", &SettingError{errors.New("no proxy")}), 2, `level=ERROR msg="bad setting" err="no proxy"`},
		"Failed":         {errors.New("postgres: down"), 1, `level=ERROR msg="scheduler failed" err="postgres: down"`},
	} {
		t.Run(name, func(t *testing.T) {
			var logs bytes.Buffer
			assert.Equal(t, tt.code, RunExit("scheduler", tt.err, slog.New(slog.NewTextHandler(&logs, nil))))
			if tt.log == "" {
				assert.Empty(t, logs.String())
				return
			}
			assert.Contains(t, logs.String(), tt.log)
		})
	}
}
