package handlers_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

const benchConcurrency = 20

// BenchmarkEndToEnd processes b.N jobs through a real asynq server (concurrency 20), each
// fetching one 8 KB page of the fake site through the fake proxy, in one run:
//   - Runner: the full runner (lease claim, fenced attempt start, keeper, sticky session,
//     unit, parse, one-statement commit of job + result + outbox + attempt, release);
//   - RunnerTraced: Runner with an OpenTelemetry SDK provider that records every span
//     (attempt, lease, start, session, step, fetch, parse, commit, release) and exports
//     none: what tracing costs over Runner, whose provider is the default no-op;
//   - BareAsynq: a plain asynq handler doing the same fetch through the same proxy and one
//     INSERT of the result — no lease, no fencing, no attempt evidence, no outbox.
func BenchmarkEndToEnd(b *testing.B) {
	for _, mode := range []string{"Runner", "RunnerTraced", "RunnerGroupCommit", "RunnerRobots", "RunnerPolite", "BareAsynq"} {
		b.Run(mode, func(b *testing.B) {
			r := newBenchRig(b)
			page := r.site.URL + "/big"
			var handler asynq.Handler
			switch mode {
			case "Runner", "RunnerTraced", "RunnerGroupCommit", "RunnerRobots", "RunnerPolite":
				cfg := handlers.Config{
					Store: r.st, NoGroupCommit: mode == "Runner" || mode == "RunnerTraced", Redis: r.ns.Client, Provider: r.prov, KeyPrefix: r.ns.Prefix,
					Collector: sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), IgnoreRobotsTxt: true},
					Logger:    discardLogger(),
				}
				switch mode {
				case "RunnerTraced":
					tp := sdktrace.NewTracerProvider() // samples everything, exports nothing
					defer func() { _ = tp.Shutdown(context.Background()) }()
					cfg.TracerProvider = tp
				case "RunnerRobots": // robots.txt through the shared cache (the default)
					cfg.Collector.IgnoreRobotsTxt = false
				case "RunnerPolite": // and a generous fleet-wide limit on the host: one EVALSHA per request
					cfg.Collector.IgnoreRobotsTxt = false
					cfg.DefaultHostLimit = &lua.Limit{Rate: 1e6, Burst: 1e6}
				}
				reg, err := handlers.NewRegistry(cfg)
				if err != nil {
					b.Fatal(err)
				}
				defer reg.Close()
				if err := reg.Register("page", pageWorkflow(page), pageParse); err != nil {
					b.Fatal(err)
				}
				handler = reg
			case "BareAsynq":
				handler = bareHandler(b, r, page)
			}
			r.enqueue(b, b.N)
			elapsed := r.process(b, handler, b.N)
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "jobs/s")
			if mode != "BareAsynq" {
				if n := testutil.Count(b, r.st.Pool(), `SELECT count(*) FROM jobs WHERE state = 'complete'`); n != b.N {
					b.Fatalf("%d of %d jobs complete", n, b.N)
				}
			}
		})
	}
}

// BenchmarkCommit compares the runner's commit (job fenced + result + outbox + attempt +
// NOTIFY, one statement) with a raw single-row INSERT, sequentially on one connection.
func BenchmarkCommit(b *testing.B) {
	ctx := context.Background()
	b.Run("FencedCommit", func(b *testing.B) {
		st := store.New(testutil.PG(b))
		keys := recordJobs(b, st, b.N)
		for i, k := range keys {
			if _, err := st.JobStart(ctx, store.AttemptStartParams{Key: k, Token: int64(i + 1)}); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportAllocs()
		b.ResetTimer()
		for i, k := range keys {
			_, err := st.Commit(ctx, store.CommitParams{Key: k, Token: int64(i + 1), ObservationKey: k, ParserVersion: 1,
				Data: json.RawMessage(`{"len":8192}`), EventKey: handlers.EventKey(k), Topic: "page", EventPayload: json.RawMessage(`{}`), Bytes: 8400})
			if err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("RawInsert", func(b *testing.B) {
		st := store.New(testutil.PG(b))
		keys := recordJobs(b, st, b.N)
		b.ReportAllocs()
		b.ResetTimer()
		for _, k := range keys {
			if _, err := st.Pool().Exec(ctx, `INSERT INTO results (observation_key, job_key, parser_version, data, fence) VALUES ($1, $1, 1, $2, 1)`,
				k, json.RawMessage(`{"len":8192}`)); err != nil {
				b.Fatal(err)
			}
		}
	})
}

type benchRig struct {
	st    *store.PG
	ns    *testutil.RedisNS
	proxy *testutil.FakeProxy
	site  *testutil.FakeSite
	prov  *sessions.Provider
}

func newBenchRig(b *testing.B) *benchRig {
	r := &benchRig{
		st: store.New(testutil.PG(b)), ns: testutil.Redis(b),
		proxy: testutil.NewFakeProxy(b, testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: "acct", Password: canary}),
		site:  testutil.NewFakeSite(b, testutil.FakeSiteConfig{BigSize: 8 << 10}),
	}
	r.prov = newProvider(b, "generic", r.proxy.Addr)
	return r
}

func (r *benchRig) enqueue(b *testing.B, n int) {
	client := asynq.NewClient(r.ns.AsynqOpt())
	defer client.Close()
	enq, err := tasks.NewEnqueuer(client, r.st, &tasks.EnqueuerConfig{Queue: r.ns.Queue})
	if err != nil {
		b.Fatal(err)
	}
	specs := make([]tasks.Spec, n)
	for i := range specs {
		specs[i] = tasks.Spec{Kind: "page", SourceID: fmt.Sprintf("p-%d", i), Country: "US", Window: "2026-04-23", ParserVersion: 1}
	}
	for len(specs) > 0 {
		batch := specs[:min(500, len(specs))]
		specs = specs[len(batch):]
		if _, err := enq.EnqueueMany(context.Background(), batch); err != nil {
			b.Fatal(err)
		}
	}
}

// process runs an asynq server until n tasks succeeded and returns how long that took.
func (r *benchRig) process(b *testing.B, h asynq.Handler, n int) time.Duration {
	var done atomic.Int64
	finished := make(chan struct{})
	srv := asynq.NewServer(r.ns.AsynqOpt(), (&handlers.Registry{}).ServerConfig(asynq.Config{
		Queues: map[string]int{r.ns.Queue: 1}, Concurrency: benchConcurrency, LogLevel: asynq.FatalLevel,
	}))
	mux := asynq.NewServeMux()
	mux.HandleFunc("page", func(ctx context.Context, t *asynq.Task) error {
		err := h.ProcessTask(ctx, t)
		if err == nil && done.Add(1) == int64(n) {
			close(finished)
		}
		return err
	})
	b.ResetTimer()
	start := time.Now()
	if err := srv.Start(mux); err != nil {
		b.Fatal(err)
	}
	select {
	case <-finished:
	case <-time.After(10 * time.Minute):
		b.Fatalf("only %d of %d jobs done", done.Load(), n)
	}
	elapsed := time.Since(start)
	b.StopTimer()
	srv.Shutdown()
	return elapsed
}

func pageWorkflow(page string) handlers.WorkflowFunc {
	return func(tasks.Payload) (*sessions.Unit, error) {
		return &sessions.Unit{Name: "page", Steps: []sessions.Step{{Name: "get", Safe: true,
			Run: func(_ context.Context, sc *sessions.StepContext) error {
				resp, err := sc.Get(page)
				if err != nil {
					return err
				}
				return sc.Staging.Put("page", len(resp.Body))
			}}}}, nil
	}
}

func pageParse(_ tasks.Payload, staged map[string]json.RawMessage) (handlers.Observation, error) {
	var n int
	if err := json.Unmarshal(staged["page"], &n); err != nil {
		return handlers.Observation{}, err
	}
	return handlers.Observation{Data: map[string]int{"len": n}}, nil
}

// bareHandler fetches through the proxy with one shared keep-alive client (credentials
// in the proxy URL, as a plain setup would have them) and inserts the result.
func bareHandler(b *testing.B, r *benchRig, page string) asynq.Handler {
	proxyURL := &url.URL{Scheme: "http", Host: r.proxy.Addr, User: url.UserPassword("acct-country-us-session-bare0001", canary)}
	client := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(proxyURL), MaxIdleConnsPerHost: benchConcurrency}, Timeout: 30 * time.Second}
	b.Cleanup(client.CloseIdleConnections)
	return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		p, err := tasks.DecodePayload(t.Payload(), nil)
		if err != nil {
			return err
		}
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, page, nil)
		resp, err := client.Do(req)
		if err != nil {
			return err
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			return err
		}
		data, _ := json.Marshal(map[string]int{"len": len(body)})
		_, err = r.st.Pool().Exec(ctx, `INSERT INTO results (observation_key, job_key, parser_version, data, fence) VALUES ($1, $1, 1, $2, 1) ON CONFLICT DO NOTHING`, p.Key, data)
		return err
	})
}

func recordJobs(b *testing.B, st *store.PG, n int) []string {
	recs := make([]tasks.JobRecord, n)
	keys := make([]string, n)
	for i := range recs {
		keys[i] = fmt.Sprintf("page:p-%d:US:w:v1", i)
		recs[i] = tasks.JobRecord{Key: keys[i], Spec: tasks.Spec{Kind: "page", SourceID: fmt.Sprintf("p-%d", i), Country: "US", Window: "w", ParserVersion: 1}}
	}
	for i := 0; i < n; i += 1000 {
		if _, err := st.JobsRecord(context.Background(), recs[i:min(i+1000, n)]); err != nil {
			b.Fatal(err)
		}
	}
	return keys
}

func discardLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }
