package tasks

import (
	"context"
	"net/url"
	"regexp"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// TracerName is the instrumentation scope of idemscrape's spans.
const TracerName = "github.com/idemscrape/idemscrape"

// traceContext reads and writes W3C trace context (the traceparent header's format).
var traceContext = propagation.TraceContext{}

// TraceParent is the W3C traceparent of the span in ctx ("" when ctx carries no valid
// span context, e.g. when tracing is off).
func TraceParent(ctx context.Context) string {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return ""
	}
	c := propagation.MapCarrier{}
	traceContext.Inject(ctx, c)
	return c.Get("traceparent")
}

// WithTraceParent returns ctx with the remote span context of a W3C traceparent, so that
// spans started from it continue that trace. An empty or malformed traceparent leaves
// ctx as it is: a payload's trace context is a hint, never a reason to refuse work.
func WithTraceParent(ctx context.Context, traceparent string) context.Context {
	if traceparent == "" {
		return ctx
	}
	return traceContext.Extract(ctx, propagation.MapCarrier{"traceparent": traceparent})
}

// tracerOf is the tracer of tp, or of the global provider (a no-op one unless the program
// set one: free when tracing is off).
func tracerOf(tp trace.TracerProvider) trace.Tracer {
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	return tp.Tracer(TracerName)
}

// startEnqueueSpan starts the span of one task's enqueue. A task of a batch starts its own
// trace (a scheduler tick's thousands of jobs would otherwise share one), linked to the
// caller's span; a single enqueue continues the caller's trace.
func (e *Enqueuer) startEnqueueSpan(ctx context.Context, rec JobRecord, batch bool) (context.Context, trace.Span) {
	var span trace.Span
	if batch {
		opts := []trace.SpanStartOption{producerSpan, trace.WithNewRoot()}
		if parent := trace.SpanContextFromContext(ctx); parent.IsValid() {
			opts = append(opts, trace.WithLinks(trace.Link{SpanContext: parent}))
		}
		ctx, span = e.tracer.Start(ctx, "idemscrape.enqueue", opts...)
	} else {
		ctx, span = e.tracer.Start(ctx, "idemscrape.enqueue", producerSpan)
	}
	if span.IsRecording() { // attributes are built only when they are kept
		span.SetAttributes(
			attribute.String("idemscrape.job.key", rec.Key),
			attribute.String("idemscrape.kind", rec.Spec.Kind),
			attribute.String("messaging.destination.name", rec.Queue),
		)
	}
	return ctx, span
}

var producerSpan = trace.WithSpanKind(trace.SpanKindProducer)

// endEnqueueSpan records the enqueue's outcome and ends the span.
func endEnqueueSpan(span trace.Span, res taskResult, err error) {
	if !span.IsRecording() {
		return
	}
	if err != nil {
		span.SetStatus(codes.Error, RedactURLs(err.Error()))
	} else {
		span.SetAttributes(attribute.String("idemscrape.enqueue.result", [...]string{"already_queued", "enqueued", "repaired"}[res]))
	}
	span.End()
}

// RedactURL is rawURL without userinfo, query and fragment: what a span or a trace may
// show of a URL (a query may carry a token, userinfo a password).
func RedactURL(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "(unparsable URL)"
	}
	u.User, u.RawQuery, u.ForceQuery, u.Fragment, u.RawFragment = nil, "", false, "", ""
	return u.String()
}

// urlPattern finds the URLs in an error's text (a *url.Error quotes its request's URL).
var urlPattern = regexp.MustCompile(`(?i)\b(?:https?|wss?)://[^\s"'<>]+`)

// RedactURLs returns s with every URL in it reduced as RedactURL does: what a span's
// status may say of an error whose text holds the URL of the request that failed.
func RedactURLs(s string) string {
	return urlPattern.ReplaceAllStringFunc(s, RedactURL)
}
