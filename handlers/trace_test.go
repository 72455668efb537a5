package handlers_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestTraceOfRetriedJob: a job enqueued through the Enqueuer, whose first attempt is
// throttled (429) and whose second loses its session under the product page and replays
// on a new one, is one trace: the enqueue's span, and under it each attempt with its
// lease, start, sessions, steps and fetches, the parse, the commit and the release. The
// failures are on the spans that had them; every log line of the job names the trace; no
// attribute, event or status holds the proxy's password or the sticky username.
func TestTraceOfRetriedJob(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	var logs testutil.SyncBuffer
	reg := r.registry(t, func(c *handlers.Config) {
		c.TracerProvider = tp
		c.Logger = slog.New(slog.NewJSONHandler(&logs, nil))
	})

	client := asynq.NewClient(r.ns.AsynqOpt())
	t.Cleanup(func() { _ = client.Close() })
	insp := asynq.NewInspector(r.ns.AsynqOpt())
	t.Cleanup(func() { _ = insp.Close() })
	enq, err := tasks.NewEnqueuer(client, r.st, &tasks.EnqueuerConfig{Queue: r.ns.Queue, Inspector: insp, TracerProvider: tp,
		Destinations: tasks.LoopbackPolicy()})
	require.NoError(t, err)
	res, err := enq.Enqueue(ctx, tasks.Spec{Kind: catalog.Kind, SourceID: "sku-9", Country: "US", Window: "2026-04-23", ParserVersion: 1})
	require.NoError(t, err)
	require.Equal(t, tasks.Created, res.Outcome)
	info, err := insp.GetTaskInfo(r.ns.Queue, res.Key)
	require.NoError(t, err)
	job, err := tasks.DecodePayload(info.Payload, nil)
	require.NoError(t, err)
	require.NotEmpty(t, job.TraceParent, "the task carries the enqueue's trace context")
	task := asynq.NewTask(info.Type, info.Payload)

	r.site.Throttle(1, time.Second)
	require.True(t, decisionOf(reg.ProcessTask(ctx, task)).Retry, "attempt 1: throttled")
	r.proxy.DropNext("/product/")
	require.NoError(t, reg.ProcessTask(ctx, task), "attempt 2: a lost session, replayed, complete")

	spans := exp.GetSpans()
	require.NotEmpty(t, spans)
	trace := spans[0].SpanContext.TraceID()
	byName := map[string][]tracetest.SpanStub{}
	for _, s := range spans {
		assert.Equal(t, trace, s.SpanContext.TraceID(), "span %q is in the job's trace", s.Name)
		byName[s.Name] = append(byName[s.Name], s)
	}
	require.Len(t, byName["idemscrape.enqueue"], 1)
	enqSpan := byName["idemscrape.enqueue"][0]
	attempts := byName["idemscrape.attempt"]
	require.Len(t, attempts, 2)
	for _, a := range attempts {
		assert.Equal(t, enqSpan.SpanContext.SpanID(), a.Parent.SpanID(), "each attempt is a child of the enqueue")
	}
	first, second := attempts[0], attempts[1]
	if attr(first, "idemscrape.attempt") != "1" {
		first, second = second, first
	}
	assert.Equal(t, "1", attr(first, "idemscrape.attempt"))
	assert.Equal(t, "throttled", attr(first, "idemscrape.category"))
	assert.Equal(t, codes.Error, first.Status.Code)
	assert.Equal(t, "2", attr(second, "idemscrape.attempt"))
	assert.Equal(t, "complete", attr(second, "idemscrape.outcome"))
	assert.Equal(t, "1", attr(second, "idemscrape.session_restarts"))

	children := func(parent tracetest.SpanStub, name string) []tracetest.SpanStub {
		var out []tracetest.SpanStub
		for _, s := range byName[name] {
			if s.Parent.SpanID() == parent.SpanContext.SpanID() {
				out = append(out, s)
			}
		}
		return out
	}
	for _, a := range attempts {
		for _, name := range []string{"lease", "start", "release"} {
			assert.Len(t, children(a, name), 1, "attempt %s: one %s span", attr(a, "idemscrape.attempt"), name)
		}
	}
	assert.Len(t, children(first, "session"), 1)
	assert.Empty(t, children(first, "commit"))
	sessions := children(second, "session")
	require.Len(t, sessions, 2, "the lost session and its replay")
	assert.Equal(t, "session_lost", attr(sessions[0], "idemscrape.category"))
	assert.NotEqual(t, attr(sessions[0], "idemscrape.session"), attr(sessions[1], "idemscrape.session"))
	assert.Len(t, children(second, "parse"), 1)
	assert.Len(t, children(second, "commit"), 1)

	// Steps under sessions, fetches under steps: the 429 and the cut on theirs.
	steps := children(sessions[1], "step search")
	require.Len(t, steps, 1)
	fetches := children(steps[0], "fetch")
	require.Len(t, fetches, 1)
	assert.Equal(t, "200", attr(fetches[0], "http.response.status_code"))
	assert.NotEmpty(t, attr(fetches[0], "idemscrape.bytes"))
	assert.NotContains(t, attr(fetches[0], "url.full"), "?", "no query in a span")
	var throttled bool
	for _, s := range children(children(first, "session")[0], "step search") {
		for _, f := range children(s, "fetch") {
			throttled = throttled || attr(f, "http.response.status_code") == "429"
		}
	}
	assert.True(t, throttled, "the 429 is on attempt 1's fetch")
	cut := children(sessions[0], "step product")
	require.Len(t, cut, 1)
	assert.Equal(t, "session_lost", attr(cut[0], "idemscrape.category"))

	// No credential anywhere in the trace.
	for _, s := range spans {
		texts := []string{s.Name, s.Status.Description}
		for _, kv := range s.Attributes {
			texts = append(texts, kv.Value.String())
		}
		for _, ev := range s.Events {
			texts = append(texts, ev.Name)
			for _, kv := range ev.Attributes {
				texts = append(texts, kv.Value.String())
			}
		}
		for _, text := range texts {
			assert.NotContains(t, text, canary, "span %q", s.Name)
			assert.NotContains(t, text, "acct-country", "span %q: no sticky username", s.Name)
		}
	}

	// The job's log lines carry the trace.
	lines := strings.Split(strings.TrimSpace(logs.String()), "\n")
	var failedLine bool
	for _, l := range lines {
		if strings.Contains(l, `"msg":"attempt failed"`) {
			failedLine = true
			assert.Contains(t, l, `"trace_id":"`+trace.String()+`"`)
			assert.Contains(t, l, `"span_id":"`+first.SpanContext.SpanID().String()+`"`)
		}
		assert.NotContains(t, l, canary)
	}
	assert.True(t, failedLine, "attempt 1 logged its failure")
}

// TestNoTraceWhenOff: without a tracer provider (OpenTelemetry's default no-op), the task
// carries no trace context and the job runs as before.
func TestNoTraceWhenOff(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	reg := r.registry(t, nil)
	client := asynq.NewClient(r.ns.AsynqOpt())
	t.Cleanup(func() { _ = client.Close() })
	insp := asynq.NewInspector(r.ns.AsynqOpt())
	t.Cleanup(func() { _ = insp.Close() })
	enq, err := tasks.NewEnqueuer(client, r.st, &tasks.EnqueuerConfig{Queue: r.ns.Queue, Inspector: insp, Destinations: tasks.LoopbackPolicy()})
	require.NoError(t, err)
	res, err := enq.Enqueue(ctx, tasks.Spec{Kind: catalog.Kind, SourceID: "sku-8", Country: "US", Window: "2026-04-23", ParserVersion: 1})
	require.NoError(t, err)
	info, err := insp.GetTaskInfo(r.ns.Queue, res.Key)
	require.NoError(t, err)
	assert.NotContains(t, string(info.Payload), "traceparent")
	require.NoError(t, reg.ProcessTask(ctx, asynq.NewTask(info.Type, info.Payload)))
}

func attr(s tracetest.SpanStub, key string) string {
	for _, kv := range s.Attributes {
		if kv.Key == attribute.Key(key) {
			return kv.Value.String()
		}
	}
	return ""
}

// TestTraceOfPanickingParser: a parser that panics still ends its parse span (with the
// error) and its attempt's span.
func TestTraceOfPanickingParser(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	_, task := r.job(t, "sku-7")
	reg := r.registry(t, func(c *handlers.Config) { c.TracerProvider = tp })
	require.NoError(t, reg.Register("catalog.panics", catalog.Workflow(r.site.URL),
		func(tasks.Payload, map[string]json.RawMessage) (handlers.Observation, error) {
			panic("the parser's bug")
		}))
	task = asynq.NewTask("catalog.panics", task.Payload())
	require.True(t, decisionOf(reg.ProcessTask(ctx, task)).Retry)
	names := map[string]tracetest.SpanStub{}
	for _, s := range exp.GetSpans() {
		names[s.Name] = s
	}
	require.Contains(t, names, "parse", "the parse span ended")
	assert.Equal(t, codes.Error, names["parse"].Status.Code)
	require.Contains(t, names, "idemscrape.attempt")
	assert.Equal(t, "panic", attr(names["idemscrape.attempt"], "idemscrape.category"))
}
