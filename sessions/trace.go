package sessions

import (
	"context"
	"errors"

	"github.com/gocolly/colly/v2"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemscrape/idemscrape/tasks"
)

// Spans of a unit: "session" per session the unit runs on (replays are siblings), "step
// <name>" per step, "fetch" per request and "render" per render. They are children of the
// span in the unit's context (the runner's attempt) and use its provider: with no span
// there, or OpenTelemetry's default no-op provider, every span is a no-op. Attributes
// carry the session id, statuses, bytes and categories; URLs without userinfo or query
// (a query may hold a token); never a proxy credential.

// startSpan starts a child of ctx's span when that span records; otherwise it returns ctx
// and that span unchanged, allocating nothing (tracing off). Callers build attributes only
// when the returned span records.
func startSpan(ctx context.Context, name string) (context.Context, trace.Span) {
	parent := trace.SpanFromContext(ctx)
	if !parent.IsRecording() {
		return ctx, parent
	}
	return parent.TracerProvider().Tracer(tasks.TracerName).Start(ctx, name)
}

// endSpan ends span; a failure sets its status and category.
func endSpan(span trace.Span, fe *FetchError) {
	if !span.IsRecording() {
		return
	}
	if fe != nil {
		span.SetAttributes(attribute.String("idemscrape.category", string(fe.Category)))
		if fe.Status != 0 {
			span.SetAttributes(attribute.Int("http.response.status_code", fe.Status))
		}
		span.SetStatus(codes.Error, tasks.RedactURLs(fe.Error()))
	}
	span.End()
}

// spanURL is rawURL without userinfo, query and fragment.
func spanURL(rawURL string) string { return tasks.RedactURL(rawURL) }

// spanContext is the context a request's span is a child of: the running step's.
func (b *Bound) spanContext() context.Context {
	if b.stepCtx != nil {
		return b.stepCtx
	}
	return b.ctx
}

// endFetchSpan ends a Fetch's span: what it moved (bytes since bytesBefore, re-sends), its
// status and failure.
func (b *Bound) endFetchSpan(span trace.Span, method, rawURL string, bytesBefore, resentBefore int64, resp **colly.Response, err *error) {
	span.SetAttributes(attribute.String("http.request.method", method), attribute.String("url.full", spanURL(rawURL)),
		attribute.String("idemscrape.session", b.Session.ID), attribute.Int64("idemscrape.bytes", b.bytes.Load()-bytesBefore))
	if n := b.resent.Load() - resentBefore; n > 0 {
		span.SetAttributes(attribute.Int64("idemscrape.resent", n))
	}
	if *resp != nil {
		span.SetAttributes(attribute.Int("http.response.status_code", (*resp).StatusCode))
	}
	var fe *FetchError
	if *err != nil && !errors.As(*err, &fe) {
		fe = &FetchError{Category: tasks.CategoryInternal, Err: *err}
	}
	endSpan(span, fe)
}
