package handlers

import (
	"context"
	"errors"

	"github.com/hibiken/asynq"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemscrape/idemscrape/tasks"
)

// Tracing. Each delivery is one span, "idemscrape.attempt", continuing the trace whose
// context the task carries (tasks.Payload.TraceParent, written by the Enqueuer), so an
// enqueue and every attempt of its job share one trace. Its children are the lease, the
// attempt start, the unit's sessions and steps with their fetches and renders (package
// sessions), the parse, the commit and the release. Attributes name the job, its attempt,
// fence, session, bytes, cost, outcome and failure category — never a credential, a URL's
// query or a staged value. With OpenTelemetry's default (no-op) provider every span is a
// no-op: tracing is free until a program installs a provider.

// startAttemptSpan starts the delivery's span.
func (r *Registry) startAttemptSpan(ctx context.Context, k *kind, job tasks.Payload) (context.Context, trace.Span) {
	ctx = tasks.WithTraceParent(ctx, job.TraceParent)
	attrs := []attribute.KeyValue{
		attribute.String("idemscrape.job.key", job.Key),
		attribute.String("idemscrape.kind", k.name),
		attribute.String("idemscrape.country", job.Spec.Country),
		attribute.String("idemscrape.worker", r.cfg.WorkerID),
	}
	if n, ok := asynq.GetRetryCount(ctx); ok {
		attrs = append(attrs, attribute.Int("messaging.delivery.retry_count", n))
	}
	return r.tracer.Start(ctx, "idemscrape.attempt", trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...))
}

// endAttemptSpan records how the delivery ended. A failure (retried or final) is the
// span's error; a delivery handed back without an attempt (lease busy, incident, window
// deferred) is not.
func endAttemptSpan(span trace.Span, err error) {
	var re *retryError
	switch {
	case err == nil:
	case errors.As(err, &re) && !re.counted:
		span.SetAttributes(attribute.String("idemscrape.outcome", "handed_back"), attribute.String("idemscrape.retry_in", re.delay.String()))
	default:
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

// tracerOf is the tracer of ctx's span's provider: the attempt's, so that children need no
// configuration of their own.
func tracerOf(ctx context.Context) trace.Tracer {
	return trace.SpanFromContext(ctx).TracerProvider().Tracer(tasks.TracerName)
}

// startSpan starts a child of ctx's span.
func startSpan(ctx context.Context, name string, attrs ...attribute.KeyValue) (context.Context, trace.Span) {
	return tracerOf(ctx).Start(ctx, name, trace.WithAttributes(attrs...))
}

// endSpan ends span, with err as its error when not nil.
func endSpan(span trace.Span, err error) {
	if err != nil {
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}
