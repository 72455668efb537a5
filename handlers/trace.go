package handlers

import (
	"context"
	"encoding/json"
	"errors"

	"github.com/hibiken/asynq"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemscrape/idemscrape/sessions"
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

// startAttemptSpan starts the delivery's span. Its attributes are built only when the span
// records: off, a delivery pays one no-op Start and no allocation of attributes.
func (r *Registry) startAttemptSpan(ctx context.Context, k *kind, job tasks.Payload) (context.Context, trace.Span) {
	ctx = tasks.WithTraceParent(ctx, job.TraceParent)
	ctx, span := r.tracer.Start(ctx, "idemscrape.attempt", consumerSpan)
	if span.IsRecording() {
		span.SetAttributes(
			attribute.String("idemscrape.job.key", job.Key),
			attribute.String("idemscrape.kind", k.name),
			attribute.String("idemscrape.country", job.Spec.Country),
			attribute.String("idemscrape.worker", r.cfg.WorkerID),
		)
		if n, ok := asynq.GetRetryCount(ctx); ok {
			span.SetAttributes(attribute.Int("messaging.delivery.retry_count", n))
		}
	}
	return ctx, span
}

var consumerSpan = trace.WithSpanKind(trace.SpanKindConsumer)

// endAttemptSpan records how the delivery ended. A failure (retried or final) is the
// span's error; a delivery handed back without an attempt (lease busy, incident, window
// deferred) is not.
func endAttemptSpan(span trace.Span, err error) {
	if !span.IsRecording() {
		return
	}
	var re *retryError
	switch {
	case err == nil:
	case errors.As(err, &re) && !re.counted:
		span.SetAttributes(attribute.String("idemscrape.outcome", "handed_back"), attribute.String("idemscrape.retry_in", re.delay.String()))
	default:
		span.SetStatus(codes.Error, tasks.RedactURLs(err.Error()))
	}
	span.End()
}

// startSpan starts a child of ctx's span when that span records. Otherwise (tracing off)
// it returns ctx and its span as they are: nothing is allocated, and End, SetAttributes
// and SetStatus on the returned span do nothing. Callers build attributes only when the
// span records.
func startSpan(ctx context.Context, name string) (context.Context, trace.Span) {
	parent := trace.SpanFromContext(ctx)
	if !parent.IsRecording() {
		return ctx, parent
	}
	return parent.TracerProvider().Tracer(tasks.TracerName).Start(ctx, name)
}

// attemptSpan is the delivery's span when it records, nil otherwise.
func attemptSpan(ctx context.Context) trace.Span {
	if s := trace.SpanFromContext(ctx); s.IsRecording() {
		return s
	}
	return nil
}

// endSpan ends span, with err as its error when not nil.
func endSpan(span trace.Span, err error) {
	if !span.IsRecording() {
		return
	}
	if err != nil {
		span.SetStatus(codes.Error, tasks.RedactURLs(err.Error()))
	}
	span.End()
}

// parseTraced is runParser under a "parse" span, which ends even when the parser panics
// (work's recover then records the panic).
func (r *Registry) parseTraced(ctx context.Context, k *kind, parser ParserFunc, job tasks.Payload,
	staged map[string]json.RawMessage) (obs Observation, perr *sessions.FetchError) {
	ctx, span := startSpan(ctx, "parse")
	if !span.IsRecording() {
		return r.runParser(ctx, k, parser, job, staged)
	}
	span.SetAttributes(attribute.Int("idemscrape.parser_version", job.Spec.ParserVersion))
	panicked := true
	defer func() {
		switch {
		case panicked:
			span.SetStatus(codes.Error, "the parser panicked")
			span.End()
		case perr != nil:
			endSpan(span, perr)
		default:
			span.End()
		}
	}()
	obs, perr = r.runParser(ctx, k, parser, job, staged)
	panicked = false
	return obs, perr
}
