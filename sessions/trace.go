package sessions

import (
	"context"
	"net/url"

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

func startSpan(ctx context.Context, name string, attrs ...attribute.KeyValue) (context.Context, trace.Span) {
	return trace.SpanFromContext(ctx).TracerProvider().Tracer(tasks.TracerName).Start(ctx, name, trace.WithAttributes(attrs...))
}

// endSpan ends span; a failure sets its status and category.
func endSpan(span trace.Span, fe *FetchError) {
	if fe != nil {
		span.SetAttributes(attribute.String("idemscrape.category", string(fe.Category)))
		if fe.Status != 0 {
			span.SetAttributes(attribute.Int("http.response.status_code", fe.Status))
		}
		span.SetStatus(codes.Error, fe.Error())
	}
	span.End()
}

// spanURL is rawURL without userinfo, query and fragment.
func spanURL(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "(unparsable)"
	}
	u.User, u.RawQuery, u.ForceQuery, u.Fragment, u.RawFragment = nil, "", false, "", ""
	return u.String()
}

// spanContext is the context a request's span is a child of: the running step's.
func (b *Bound) spanContext() context.Context {
	if b.stepCtx != nil {
		return b.stepCtx
	}
	return b.ctx
}
