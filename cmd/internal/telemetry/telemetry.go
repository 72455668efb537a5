// Package telemetry installs OpenTelemetry tracing in idemscrape's binaries from the
// standard OTEL_* environment, so that a team points the worker, the scheduler and the
// CLI at its collector without a flag of ours:
//
//	OTEL_EXPORTER_OTLP_ENDPOINT=http://otel-collector:4318   (or …_TRACES_ENDPOINT)
//	OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_EXPORTER_OTLP_HEADERS, …_TIMEOUT,
//	OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG (e.g. parentbased_traceidratio, 0.01)
//
// Tracing is off unless an OTLP endpoint is set or OTEL_TRACES_EXPORTER=otlp; it stays off
// with OTEL_TRACES_EXPORTER=none or OTEL_SDK_DISABLED=true. Spans are exported over
// OTLP/HTTP (protobuf); OTEL_EXPORTER_OTLP_PROTOCOL=grpc or another exporter is an error
// that says so, which the binaries log as a warning before going on without traces. Off, the global provider stays OpenTelemetry's no-op one: no span is recorded
// and no trace context is written into task payloads.
package telemetry

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// Enabled reports whether the environment asks for tracing, or why it is misconfigured.
func Enabled(getenv func(string) string) (bool, error) {
	if strings.EqualFold(getenv("OTEL_SDK_DISABLED"), "true") {
		return false, nil
	}
	switch exp := strings.ToLower(strings.TrimSpace(getenv("OTEL_TRACES_EXPORTER"))); exp {
	case "none":
		return false, nil
	case "otlp":
	case "":
		if getenv("OTEL_EXPORTER_OTLP_ENDPOINT") == "" && getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") == "" {
			return false, nil
		}
	default:
		return false, fmt.Errorf("telemetry: OTEL_TRACES_EXPORTER=%q: this build exports traces with otlp only (or none)", exp)
	}
	for _, k := range []string{"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"} {
		switch p := getenv(k); p {
		case "", "http/protobuf":
		default:
			return false, fmt.Errorf("telemetry: %s=%q: this build exports OTLP over http/protobuf only (point it at the collector's HTTP port, usually 4318)", k, p)
		}
		if getenv(k) != "" {
			break // the traces-specific setting wins over the general one
		}
	}
	return true, nil
}

// Setup installs a tracer provider exporting over OTLP/HTTP when the environment asks for
// it (see the package comment), with service as the default service.name. It returns the
// function that flushes and stops it (a no-op when tracing is off) and whether it is on.
func Setup(ctx context.Context, service string) (shutdown func(context.Context) error, on bool, err error) {
	noop := func(context.Context) error { return nil }
	on, err = Enabled(os.Getenv)
	if err != nil || !on {
		return noop, false, err
	}
	exp, err := otlptracehttp.New(ctx) // endpoint, headers, timeout, TLS from the OTEL_* environment
	if err != nil {
		return noop, false, fmt.Errorf("telemetry: OTLP exporter: %w", err)
	}
	res, err := resource.New(ctx,
		resource.WithAttributes(attribute.String("service.name", service)),
		resource.WithFromEnv(), // OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES override the default
		resource.WithTelemetrySDK(),
		resource.WithHost(),
		resource.WithProcessPID(),
	)
	if err != nil && !errors.Is(err, resource.ErrPartialResource) {
		return noop, false, fmt.Errorf("telemetry: resource: %w", err)
	}
	// The sampler comes from OTEL_TRACES_SAMPLER (default: parent-based, always on).
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	return tp.Shutdown, true, nil
}
