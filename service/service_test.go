package service_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/PuerkitoBio/goquery"
	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/service"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/outbox"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// bundle is a running service on a test database and Redis namespace.
type bundle struct {
	svc    *service.Service
	pool   *pgxpool.Pool
	st     *store.PG
	rdb    redis.UniversalClient
	opt    asynq.RedisClientOpt
	queue  string
	prefix string // of lease and stream keys
	reg    *handlers.Registry
	base   string // http://127.0.0.1:port
}

type setupOpts struct {
	auth      *service.BasicAuth
	writable  bool                  // asynqmon may change tasks
	insecure  bool                  // HTTPInsecure
	httpAddr  string                // default 127.0.0.1:0
	redisAddr string                // default: the shared test Redis
	rdb       redis.UniversalClient // with redisAddr
	checks    []service.ReadyCheck
	noDisp    bool
	provider  *sessions.Provider // default: Oxylabs on its real gateway, never reached
	shop      string             // catalog base URL; default: a closed port
	logger    *slog.Logger       // default: quiet
	budgets   map[string]store.Cost
	hosts     []string // AllowedHosts
}

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func setup(t *testing.T, o setupOpts) *bundle {
	t.Helper()
	pool := testutil.PG(t)
	st := store.New(pool)
	b := &bundle{pool: pool, st: st}
	prefix := "t" + testutil.RandomID(4) + ":"
	if o.redisAddr == "" {
		ns := testutil.Redis(t)
		b.rdb, b.opt, b.queue, prefix = ns.Client, ns.AsynqOpt(), ns.Queue, ns.Prefix
	} else {
		b.rdb, b.opt, b.queue = o.rdb, asynq.RedisClientOpt{Addr: o.redisAddr}, "q"+testutil.RandomID(4)
	}
	provider := o.provider
	if provider == nil {
		var err error
		provider, err = sessions.Oxylabs("user", "secret-password")
		require.NoError(t, err)
	}
	shop := o.shop
	if shop == "" {
		shop = "http://127.0.0.1:9"
	}
	reg, err := handlers.NewRegistry(handlers.Config{
		Store: st, Redis: b.rdb, Provider: provider, KeyPrefix: prefix, Logger: quietLogger(),
		Collector: sessions.CollectorConfig{Guard: sessions.LoopbackGuard()},
	})
	require.NoError(t, err)
	t.Cleanup(reg.Close)
	require.NoError(t, reg.Register(catalog.Kind, catalog.Workflow(shop), catalog.Parse))

	logger := o.logger
	if logger == nil {
		logger = quietLogger()
	}
	httpAddr := o.httpAddr
	if httpAddr == "" {
		httpAddr = "127.0.0.1:0"
	}
	b.svc, err = service.New(service.Config{
		Registry: reg, Store: st, Redis: b.rdb, RedisConnOpt: b.opt,
		Queues:             map[string]int{b.queue: 1},
		Concurrency:        2,
		ShutdownTimeout:    time.Second,
		Dispatcher:         &outbox.DispatcherConfig{Prefix: prefix},
		NoDispatcher:       o.noDisp,
		HTTPAddr:           httpAddr,
		MonitoringWritable: o.writable,
		HTTPInsecure:       o.insecure,
		BasicAuth:          o.auth,
		ReadyChecks:        o.checks,
		WindowBudgets:      o.budgets,
		AllowedHosts:       o.hosts,
		Logger:             logger,
		AsynqLogLevel:      asynq.FatalLevel,
	})
	require.NoError(t, err)
	require.NoError(t, b.svc.Start(context.Background()))
	t.Cleanup(func() { assert.NoError(t, b.svc.Shutdown(context.Background())) })
	b.base = "http://" + b.svc.HTTPAddr()
	b.prefix = prefix
	b.reg = reg
	return b
}

// validConfig is a valid config on the bundle's dependencies (not started).
func (b *bundle) validConfig(t *testing.T) service.Config {
	t.Helper()
	return service.Config{Registry: b.reg, Store: b.st, Redis: b.rdb, RedisConnOpt: b.opt, Queues: map[string]int{b.queue: 1}}
}

// do sends a request and returns the status and body.
func (b *bundle) do(t *testing.T, method, path string, auth *service.BasicAuth) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, b.base+path, nil)
	require.NoError(t, err)
	if auth != nil {
		req.SetBasicAuth(auth.User, auth.Password)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(body)
}

// probeTask puts a task far in the future on the bundle's queue, so asynq knows the queue
// and the worker never runs it.
func (b *bundle) probeTask(t *testing.T) string {
	t.Helper()
	client := asynq.NewClient(b.opt)
	defer client.Close()
	id := "probe-" + testutil.RandomID(4)
	_, err := client.Enqueue(asynq.NewTask("probe", nil), asynq.Queue(b.queue), asynq.TaskID(id), asynq.ProcessIn(time.Hour))
	require.NoError(t, err)
	return id
}

func (b *bundle) taskExists(t *testing.T, id string) bool {
	t.Helper()
	n, err := b.rdb.Exists(context.Background(), "asynq:{"+b.queue+"}:t:"+id).Result()
	require.NoError(t, err)
	return n == 1
}

func TestAsynqmonMounted(t *testing.T) {
	t.Run("QueueListed", func(t *testing.T) {
		b := setup(t, setupOpts{})
		b.probeTask(t)
		code, body := b.do(t, "GET", "/monitoring/api/queues", nil)
		require.Equal(t, http.StatusOK, code, body)
		var got struct {
			Queues []struct {
				Queue string `json:"queue"`
				Size  int    `json:"size"`
			} `json:"queues"`
		}
		require.NoError(t, json.Unmarshal([]byte(body), &got))
		found := false
		for _, q := range got.Queues {
			if q.Queue == b.queue {
				found = true
				assert.Equal(t, 1, q.Size)
			}
		}
		assert.True(t, found, "queue %s not in %s", b.queue, body)

		for _, path := range []string{"/monitoring/", "/monitoring"} {
			code, body = b.do(t, "GET", path, nil)
			assert.Equal(t, http.StatusOK, code, path)
			assert.Contains(t, body, "<html", path)
		}
	})

	t.Run("BasicAuth", func(t *testing.T) {
		right := &service.BasicAuth{User: "ops", Password: "correct horse"}
		b := setup(t, setupOpts{auth: right})
		for _, path := range []string{"/monitoring/api/queues", "/monitoring/", "/jobs", "/jobs/nope"} {
			t.Run(strings.Trim(path, "/"), func(t *testing.T) {
				code, _ := b.do(t, "GET", path, nil)
				assert.Equal(t, http.StatusUnauthorized, code, "no credentials")
				code, _ = b.do(t, "GET", path, &service.BasicAuth{User: "ops", Password: "wrong"})
				assert.Equal(t, http.StatusUnauthorized, code, "wrong password")
				code, _ = b.do(t, "GET", path, &service.BasicAuth{User: "admin", Password: right.Password})
				assert.Equal(t, http.StatusUnauthorized, code, "wrong user")
				code, _ = b.do(t, "GET", path, &service.BasicAuth{User: "ops", Password: right.Password + "x"})
				assert.Equal(t, http.StatusUnauthorized, code, "password with a suffix")
				code, body := b.do(t, "GET", path, right)
				want := http.StatusOK
				if path == "/jobs/nope" {
					want = http.StatusNotFound
				}
				assert.Equal(t, want, code, body)
			})
		}
		// Probes and scrapers need no credentials.
		for _, path := range []string{"/healthz", "/readyz", "/metrics"} {
			code, body := b.do(t, "GET", path, nil)
			assert.Equal(t, http.StatusOK, code, "%s: %s", path, body)
		}
	})

	t.Run("ReadOnlyByDefaultRefusesDelete", func(t *testing.T) {
		b := setup(t, setupOpts{})
		id := b.probeTask(t)
		code, body := b.do(t, "DELETE", "/monitoring/api/queues/"+b.queue+"/scheduled_tasks/"+id, nil)
		assert.Equal(t, http.StatusMethodNotAllowed, code, body)
		assert.True(t, b.taskExists(t, id), "read-only asynqmon deleted the task")
		code, _ = b.do(t, "GET", "/monitoring/api/queues/"+b.queue+"/scheduled_tasks", nil)
		assert.Equal(t, http.StatusOK, code)
	})

	t.Run("WritableDeletes", func(t *testing.T) {
		// The counterpart of ReadOnlyByDefaultRefusesDelete: the same request works when
		// writable.
		b := setup(t, setupOpts{writable: true})
		id := b.probeTask(t)
		code, body := b.do(t, "DELETE", "/monitoring/api/queues/"+b.queue+"/scheduled_tasks/"+id, nil)
		assert.Equal(t, http.StatusNoContent, code, body)
		assert.False(t, b.taskExists(t, id))
	})

	t.Run("CrossOriginWriteRefused", func(t *testing.T) {
		// Writable, with basic auth: a browser would send the credentials with another
		// site's request too. Refused unless it comes from the same origin.
		auth := &service.BasicAuth{User: "ops", Password: "pw"}
		b := setup(t, setupOpts{writable: true, auth: auth})
		id := b.probeTask(t)
		del := func(headers map[string]string) int {
			req, err := http.NewRequest(http.MethodDelete, b.base+"/monitoring/api/queues/"+b.queue+"/scheduled_tasks/"+id, nil)
			require.NoError(t, err)
			req.SetBasicAuth(auth.User, auth.Password)
			for k, v := range headers {
				req.Header.Set(k, v)
			}
			resp, err := http.DefaultClient.Do(req)
			require.NoError(t, err)
			resp.Body.Close()
			return resp.StatusCode
		}
		assert.Equal(t, http.StatusForbidden, del(map[string]string{"Sec-Fetch-Site": "cross-site"}))
		assert.Equal(t, http.StatusForbidden, del(map[string]string{"Origin": "http://evil.example"}))
		assert.True(t, b.taskExists(t, id), "a cross-origin request deleted the task")
		assert.Equal(t, http.StatusNoContent, del(map[string]string{"Sec-Fetch-Site": "same-origin"}))
		assert.False(t, b.taskExists(t, id))
	})
}

// TestUISafeByDefault: a service that would listen beyond loopback without basic auth is
// refused (New: nothing started) unless HTTPInsecure says so; asynqmon is read-only unless MonitoringWritable
// (ReadOnlyByDefaultRefusesDelete, CrossOriginWriteRefused above).
func TestUISafeByDefault(t *testing.T) {
	b := setup(t, setupOpts{noDisp: true}) // its registry, store and Redis
	cfg := func(addr string, insecure bool, auth *service.BasicAuth) service.Config {
		return service.Config{Registry: b.reg, Store: b.st, Redis: b.rdb, RedisConnOpt: b.opt,
			Queues: map[string]int{b.queue: 1}, NoDispatcher: true, HTTPAddr: addr, HTTPInsecure: insecure, BasicAuth: auth,
			ShutdownTimeout: time.Second, Logger: quietLogger(), AsynqLogLevel: asynq.FatalLevel}
	}
	for _, addr := range []string{"0.0.0.0:0", ":0", "[::]:0"} {
		_, err := service.New(cfg(addr, false, nil))
		require.Error(t, err, addr)
		assert.Contains(t, err.Error(), "is not loopback and no basic auth is set", addr)
		assert.Contains(t, err.Error(), "-http-insecure")
	}
	for name, c := range map[string]service.Config{
		"Insecure":  cfg("0.0.0.0:0", true, nil),
		"BasicAuth": cfg("0.0.0.0:0", false, &service.BasicAuth{User: "u", Password: "p"}),
		"Loopback":  cfg("127.0.0.1:0", false, nil),
	} {
		t.Run(name, func(t *testing.T) {
			svc, err := service.New(c)
			require.NoError(t, err)
			require.NoError(t, svc.Start(context.Background()))
			assert.NoError(t, svc.Shutdown(context.Background()))
		})
	}
}

// startAttempt records an attempt of key under token and returns.
func startAttempt(t *testing.T, st *store.PG, key string, token int64, session string) {
	t.Helper()
	_, err := st.JobStart(context.Background(), store.AttemptStartParams{
		Key: key, Token: token, Worker: "host/42", SessionID: session, Country: "US", ProxyEndpoint: "pr.oxylabs.io:7777",
	})
	require.NoError(t, err)
}

func recordJob(t *testing.T, st *store.PG, key string, spec tasks.Spec) {
	t.Helper()
	_, err := st.JobsRecord(context.Background(), []tasks.JobRecord{{Key: key, Spec: spec}})
	require.NoError(t, err)
}

func TestJobPage(t *testing.T) {
	ctx := context.Background()
	b := setup(t, setupOpts{noDisp: true}) // the test dispatches itself
	spec := tasks.Spec{Kind: catalog.Kind, SourceID: "sku-1", Country: "US", Window: "2026-04-23", ParserVersion: 1}

	// A job that failed after two attempts: throttled (retryable), then a parse error.
	failedKey := "catalog:sku-1:US:2026-04-23:v1"
	recordJob(t, b.st, failedKey, spec)
	startAttempt(t, b.st, failedKey, 1, "sess0001")
	require.NoError(t, b.st.JobMarkRetryable(ctx, store.AttemptFinishParams{
		Key: failedKey, Token: 1, NextAttemptAt: time.Now().Add(time.Minute), Category: "throttled",
		Error: "429 Too Many Requests", HTTPStatus: 429, Bytes: 1234,
	}))
	startAttempt(t, b.st, failedKey, 2, "sess0002")
	require.NoError(t, b.st.JobFail(ctx, store.AttemptFinishParams{
		Key: failedKey, Token: 2, Category: "parse_error", Error: "price answer is not JSON", HTTPStatus: 200, Bytes: 99,
	}))

	// A complete job with its result and outbox event.
	spec2 := spec
	spec2.SourceID = "sku-2"
	doneKey := "catalog:sku-2:US:2026-04-23:v1"
	recordJob(t, b.st, doneKey, spec2)
	startAttempt(t, b.st, doneKey, 1, "sess0003")
	_, err := b.st.Commit(ctx, store.CommitParams{
		Key: doneKey, Token: 1, ObservationKey: doneKey, ParserVersion: 1, Data: json.RawMessage(`{"price":"1.00"}`),
		Fingerprint: "sha256:abc", EventKey: handlers.EventKey(doneKey), Topic: "catalog",
		EventPayload: json.RawMessage(`{}`), HTTPStatus: 200, Bytes: 10, SessionID: "sess0003", ProxyEndpoint: "pr.oxylabs.io:7777",
	})
	require.NoError(t, err)

	// A retryable job, updated after the failed one: it is listed first.
	spec4 := spec
	spec4.SourceID = "sku-4"
	retryKey := "catalog:sku-4:US:2026-04-23:v1"
	recordJob(t, b.st, retryKey, spec4)
	startAttempt(t, b.st, retryKey, 1, "sess0004")
	require.NoError(t, b.st.JobMarkRetryable(ctx, store.AttemptFinishParams{
		Key: retryKey, Token: 1, NextAttemptAt: time.Now().Add(time.Minute), Category: "session_lost", Error: "EOF",
	}))

	// A key with HTML in it (and a '/', which the route must keep).
	htmlKey := `catalog:<script>alert("x")</script>&<b>`
	spec3 := spec
	spec3.SourceID = "sku-3"
	recordJob(t, b.st, htmlKey, spec3)

	get := func(t *testing.T, key string) (int, string) {
		t.Helper()
		return b.do(t, "GET", "/jobs/"+url.PathEscape(key), nil)
	}

	t.Run("TwoAttemptsInOrderWithCategories", func(t *testing.T) {
		code, body := get(t, failedKey)
		require.Equal(t, http.StatusOK, code, body)
		doc, err := goquery.NewDocumentFromReader(strings.NewReader(body))
		require.NoError(t, err)
		assert.Equal(t, failedKey, doc.Find("#job-key").Text())
		assert.Equal(t, "failed", doc.Find("#job-state").Text())
		rows := doc.Find("#attempts tr.attempt")
		require.Equal(t, 2, rows.Length(), body)
		cells := func(i int) []string {
			var out []string
			rows.Eq(i).Find("td").Each(func(_ int, s *goquery.Selection) { out = append(out, strings.TrimSpace(s.Text())) })
			return out
		}
		first, second := cells(0), cells(1)
		// #, started, duration, worker, session, endpoint, fence, outcome, category, HTTP, bytes, error
		assert.Equal(t, []string{"1", "host/42", "sess0001", "pr.oxylabs.io:7777", "1", "retryable", "throttled", "429", "1234", "429 Too Many Requests"},
			[]string{first[0], first[3], first[4], first[5], first[6], first[7], first[8], first[9], first[10], first[11]})
		assert.Equal(t, []string{"2", "sess0002", "failed", "parse_error", "200", "99", "price answer is not JSON"},
			[]string{second[0], second[4], second[7], second[8], second[9], second[10], second[11]})
		assert.Contains(t, body, "No result.")
	})

	t.Run("ResultAndOutbox", func(t *testing.T) {
		code, body := get(t, doneKey)
		require.Equal(t, http.StatusOK, code, body)
		doc, err := goquery.NewDocumentFromReader(strings.NewReader(body))
		require.NoError(t, err)
		assert.Equal(t, "complete", doc.Find("#job-state").Text())
		assert.Contains(t, doc.Find("#results").Text(), doneKey)
		assert.Contains(t, doc.Find("#results").Text(), "sha256:abc")
		assert.Contains(t, doc.Find("#outbox").Text(), "observed:"+doneKey)
		assert.Equal(t, "not sent yet", doc.Find("#outbox-sent").Text())

		// Once dispatched, the page says when.
		disp, err := outbox.NewDispatcher(b.pool, b.rdb, &outbox.DispatcherConfig{Prefix: b.prefix})
		require.NoError(t, err)
		n, err := disp.DispatchOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		_, body = get(t, doneKey)
		doc, err = goquery.NewDocumentFromReader(strings.NewReader(body))
		require.NoError(t, err)
		assert.True(t, strings.HasPrefix(doc.Find("#outbox-sent").Text(), "sent 2"), doc.Find("#outbox-sent").Text())
	})

	t.Run("HTMLInKeyEscaped", func(t *testing.T) {
		code, body := get(t, htmlKey)
		require.Equal(t, http.StatusOK, code, body)
		assert.NotContains(t, body, "<script>")
		assert.NotContains(t, body, "<b>")
		assert.Contains(t, body, "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;&amp;&lt;b&gt;")
		doc, err := goquery.NewDocumentFromReader(strings.NewReader(body))
		require.NoError(t, err)
		assert.Equal(t, htmlKey, doc.Find("#job-key").Text())
	})

	t.Run("UnknownKeyNotFound", func(t *testing.T) {
		code, body := get(t, "catalog:nope<i>")
		assert.Equal(t, http.StatusNotFound, code)
		assert.Contains(t, body, "catalog:nope&lt;i&gt;")
		assert.NotContains(t, body, "<i>")
	})

	t.Run("ListFailedAndRetryable", func(t *testing.T) {
		code, body := b.do(t, "GET", "/jobs", nil)
		require.Equal(t, http.StatusOK, code, body)
		doc, err := goquery.NewDocumentFromReader(strings.NewReader(body))
		require.NoError(t, err)
		rows := doc.Find("#jobs tr").FilterFunction(func(_ int, s *goquery.Selection) bool { return s.Find("td").Length() > 0 })
		require.Equal(t, 2, rows.Length(), "the failed and the retryable job, nothing else: %s", body)
		var got [][3]string
		rows.Each(func(_ int, r *goquery.Selection) {
			got = append(got, [3]string{r.Find("td code").First().Text(), r.Find("td").Eq(2).Text(), r.Find("td.category").Text()})
		})
		assert.Equal(t, [][3]string{
			{retryKey, "retryable", "session_lost"}, // newest first
			{failedKey, "failed", "parse_error"},
		}, got)
		href, _ := rows.Last().Find("a").Attr("href")
		assert.Equal(t, "/jobs/"+url.PathEscape(failedKey), href)
	})
}

func TestMetrics(t *testing.T) {
	b := setup(t, setupOpts{})
	code, body := b.do(t, "GET", "/metrics", nil)
	require.Equal(t, http.StatusOK, code, body)
	for _, name := range []string{
		"idemscrape_commit_seconds",              // the registry's
		"idemscrape_outbox_dispatch_lag_seconds", // the dispatcher's
		"go_goroutines",                          // Go runtime
		"process_cpu_seconds_total",              // process
	} {
		assert.Contains(t, body, "\n# TYPE "+name+" ", name)
	}
}

func TestConfig(t *testing.T) {
	t.Run("Validate", func(t *testing.T) {
		b := setup(t, setupOpts{})
		_ = b
		ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": "127.0.0.1:1"}})
		t.Cleanup(func() { _ = ring.Close() })
		for name, tc := range map[string]struct {
			mut  func(*service.Config)
			want string
		}{
			"NoRegistry": {func(c *service.Config) { c.Registry = nil }, "Config.Registry is required"},
			"NoStore":    {func(c *service.Config) { c.Store = nil }, "Config.Store is required"},
			"NoRedis":    {func(c *service.Config) { c.Redis = nil }, "Config.Redis is required"},
			"NoConnOptRing": {func(c *service.Config) {
				c.RedisConnOpt = nil
				c.Redis = ring
			}, "Config.RedisConnOpt is required with a *redis.Ring"},
			"NegativeTimeout":  {func(c *service.Config) { c.ShutdownTimeout = -1 }, "Config.ShutdownTimeout"},
			"ZeroWeight":       {func(c *service.Config) { c.Queues = map[string]int{"q": 0} }, `queue "q" has weight 0`},
			"BraceInQueue":     {func(c *service.Config) { c.Queues = map[string]int{"{q}": 1} }, "without braces"},
			"HalfBasicAuth":    {func(c *service.Config) { c.BasicAuth = &service.BasicAuth{User: "u"} }, "Config.BasicAuth needs"},
			"UnnamedCheck":     {func(c *service.Config) { c.ReadyChecks = []service.ReadyCheck{{}} }, "Config.ReadyChecks[0]"},
			"BadDispatcherCfg": {func(c *service.Config) { c.Dispatcher = &outbox.DispatcherConfig{BatchSize: -1} }, "Config.Dispatcher"},
		} {
			t.Run(name, func(t *testing.T) {
				c := b.validConfig(t)
				tc.mut(&c)
				_, err := service.New(c)
				assert.ErrorContains(t, err, tc.want)
			})
		}
		c := b.validConfig(t)
		require.NoError(t, c.Validate())
		c.Queues = nil
		require.NoError(t, c.Validate(), "queues default to one per registered kind")
	})

	t.Run("BasicAuthNeverPrinted", func(t *testing.T) {
		a := service.BasicAuth{User: "ops", Password: "hunter2-secret"}
		for _, s := range []string{fmt.Sprint(a), fmt.Sprintf("%+v", a), fmt.Sprintf("%#v", a), fmt.Sprint(&a)} {
			assert.NotContains(t, s, "hunter2")
			assert.Contains(t, s, "ops")
		}
		var buf strings.Builder
		slog.New(slog.NewJSONHandler(&buf, nil)).Info("x", "auth", a)
		assert.NotContains(t, buf.String(), "hunter2")
	})

	t.Run("BasicAuthFromEnv", func(t *testing.T) {
		t.Setenv(service.EnvBasicAuthUser, "")
		t.Setenv(service.EnvBasicAuthPassword, "")
		a, err := service.BasicAuthFromEnv()
		require.NoError(t, err)
		assert.Nil(t, a)
		t.Setenv(service.EnvBasicAuthPassword, "pw-secret")
		_, err = service.BasicAuthFromEnv()
		assert.ErrorContains(t, err, service.EnvBasicAuthUser)
		assert.NotContains(t, err.Error(), "pw-secret")
		t.Setenv(service.EnvBasicAuthUser, "ops")
		a, err = service.BasicAuthFromEnv()
		require.NoError(t, err)
		assert.Equal(t, &service.BasicAuth{User: "ops", Password: "pw-secret"}, a)
	})
}

func TestReadyz(t *testing.T) {
	t.Run("RedisStoppedThenBack", func(t *testing.T) {
		srv := testutil.StartRedis(t)
		b := setup(t, setupOpts{redisAddr: srv.Addr, rdb: srv.Client()})
		code, body := b.do(t, "GET", "/readyz", nil)
		require.Equal(t, http.StatusOK, code, body)
		assert.Contains(t, body, "redis: ok")
		assert.Contains(t, body, "postgres: ok")
		assert.Contains(t, body, "asynq: ok")
		assert.Contains(t, body, "registry: ok")

		srv.Stop()
		code, body = b.do(t, "GET", "/readyz", nil)
		assert.Equal(t, http.StatusServiceUnavailable, code, body)
		assert.Contains(t, body, "redis: failing")
		assert.Contains(t, body, "asynq: failing", "asynq's own connection is checked")
		assert.Contains(t, body, "postgres: ok")
		assert.NotContains(t, body, "refused", "no driver detail: it is in the log")
		code, _ = b.do(t, "GET", "/healthz", nil)
		assert.Equal(t, http.StatusOK, code, "the process is still up")

		srv.Start()
		code, body = b.do(t, "GET", "/readyz", nil)
		assert.Equal(t, http.StatusOK, code, body)
	})

	t.Run("ExtraCheckFails", func(t *testing.T) {
		b := setup(t, setupOpts{checks: []service.ReadyCheck{{Name: "proxy", Check: func(context.Context) error {
			return assert.AnError
		}}}})
		code, body := b.do(t, "GET", "/readyz", nil)
		assert.Equal(t, http.StatusServiceUnavailable, code)
		assert.Contains(t, body, "proxy: failing\n")
		assert.NotContains(t, body, assert.AnError.Error(), "the error is logged, not shown")
		assert.Contains(t, body, "redis: ok")
	})

	t.Run("ProxyIncidentPausesRegistry", func(t *testing.T) {
		// Wrong proxy password: the gateway answers 407, the registry's breaker opens and
		// /readyz says so, naming the incident.
		site := testutil.NewFakeSite(t, testutil.FakeSiteConfig{Products: 1})
		proxy := testutil.NewFakeProxy(t, testutil.FakeProxyConfig{Format: testutil.ProxyFormatOxylabs, User: "acct", Password: "right-password"})
		provider, err := sessions.Oxylabs("acct", "wrong-password")
		require.NoError(t, err)
		provider, err = provider.WithGateway(proxy.Addr)
		require.NoError(t, err)
		b := setup(t, setupOpts{provider: provider, shop: site.URL})
		code, body := b.do(t, "GET", "/readyz", nil)
		require.Equal(t, http.StatusOK, code, body)

		client := asynq.NewClient(b.opt)
		defer client.Close()
		enq, err := tasks.NewEnqueuer(client, b.st, &tasks.EnqueuerConfig{Queue: b.queue})
		require.NoError(t, err)
		_, err = enq.Enqueue(context.Background(), tasks.Spec{Kind: catalog.Kind, SourceID: "sku-1", Country: "US", Window: "2026-04-23", ParserVersion: 1})
		require.NoError(t, err)

		require.Eventually(t, func() bool {
			code, _ := b.do(t, "GET", "/readyz", nil)
			return code == http.StatusServiceUnavailable
		}, 60*time.Second, 20*time.Millisecond)
		_, body = b.do(t, "GET", "/readyz", nil)
		assert.Contains(t, body, "registry: failing")
		assert.Contains(t, body, "redis: ok")
		assert.NotContains(t, body, "wrong-password")
	})

	t.Run("NotReadyAfterShutdown", func(t *testing.T) {
		b := setup(t, setupOpts{})
		h := b.svc.Handler()
		require.NoError(t, b.svc.Shutdown(context.Background()))
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
		assert.Equal(t, http.StatusServiceUnavailable, rec.Code)
		assert.Contains(t, rec.Body.String(), "asynq: failing")
	})
}

// TestJobListFiltersAndWindows: /jobs filters by kind, state, category, window and key
// prefix (a bad state is a 400 naming it), and /windows lists the recorded schedule
// windows with their jobs by state, a failed tick marked a gap.
func TestJobListFiltersAndWindows(t *testing.T) {
	ctx := context.Background()
	b := setup(t, setupOpts{noDisp: true})
	rec := func(kind, src, win string) string {
		spec := tasks.Spec{Kind: kind, SourceID: src, Country: "US", Window: win, ParserVersion: 1}
		key := kind + ":" + src + ":US:" + win + ":v1"
		recordJob(t, b.st, key, spec)
		return key
	}
	fail := func(key string, token int64, cat tasks.Category) {
		startAttempt(t, b.st, key, token, "s")
		require.NoError(t, b.st.JobFail(ctx, store.AttemptFinishParams{Key: key, Token: token, Category: string(cat), Error: "x"}))
	}
	aFail := rec("catalog", "sku-1", "2026-04-23")
	fail(aFail, 1, tasks.CategoryParseError)
	aPending := rec("catalog", "sku-2", "2026-04-23")
	bFail := rec("reviews", "sku-1", "2026-04-23")
	fail(bFail, 1, tasks.CategoryBlocked)
	cFail := rec("catalog", "sku-3", "2026-04-24")
	fail(cFail, 1, tasks.CategoryParseError)

	list := func(t *testing.T, query string) []string {
		t.Helper()
		code, body := b.do(t, "GET", "/jobs"+query, nil)
		require.Equal(t, http.StatusOK, code, body)
		doc, err := goquery.NewDocumentFromReader(strings.NewReader(body))
		require.NoError(t, err)
		var keys []string
		doc.Find("#jobs tr td:first-child code").Each(func(_ int, s *goquery.Selection) { keys = append(keys, s.Text()) })
		sort.Strings(keys)
		return keys
	}
	sorted := func(k ...string) []string { sort.Strings(k); return k }
	assert.Equal(t, sorted(aFail, bFail, cFail), list(t, ""), "default: failed and retryable")
	assert.Equal(t, sorted(aFail, cFail), list(t, "?kind=catalog"))
	assert.Equal(t, sorted(aFail, aPending), list(t, "?kind=catalog&window=2026-04-23&state=any"))
	assert.Equal(t, []string{aPending}, list(t, "?state=pending"))
	assert.Equal(t, []string{bFail}, list(t, "?category="+string(tasks.CategoryBlocked)))
	assert.Equal(t, sorted(aFail, aPending), list(t, "?prefix=catalog:sku-&window=2026-04-23&state=failed,pending"))
	assert.Empty(t, list(t, "?prefix=catalog:sku-_"), "the prefix is literal")

	code, body := b.do(t, "GET", "/jobs?state=bogus", nil)
	assert.Equal(t, http.StatusBadRequest, code)
	assert.Contains(t, body, `state "bogus"`)
	assert.Contains(t, body, "any")

	// Two windows recorded by a scheduler: one enqueued, one whose tick failed.
	due := time.Date(2026, 4, 23, 6, 0, 0, 0, time.UTC)
	require.NoError(t, b.st.WindowBegin(ctx, store.WindowParams{Template: "daily", Window: "2026-04-23", Kind: "catalog", Due: due}))
	require.NoError(t, b.st.WindowEnqueued(ctx, "daily", "2026-04-23", 2, 2))
	require.NoError(t, b.st.WindowBegin(ctx, store.WindowParams{Template: "daily", Window: "2026-04-24", Kind: "catalog", Due: due.Add(24 * time.Hour)}))
	require.NoError(t, b.st.WindowFailed(ctx, "daily", "2026-04-24", errors.New("connection refused")))
	code, body = b.do(t, "GET", "/windows", nil)
	require.Equal(t, http.StatusOK, code, body)
	doc, err := goquery.NewDocumentFromReader(strings.NewReader(body))
	require.NoError(t, err)
	rows := doc.Find("#windows tr.window")
	require.Equal(t, 2, rows.Length(), body)
	cells := func(i int) []string {
		var out []string
		rows.Eq(i).Find("td").Each(func(_ int, s *goquery.Selection) { out = append(out, strings.TrimSpace(s.Text())) })
		return out
	}
	// template, window, kind, due, tick, tries, specs·enqueued, pending, running, retryable, complete, failed, gap
	newest, older := cells(0), cells(1)
	assert.Equal(t, []string{"daily", "2026-04-24", "catalog"}, newest[:3])
	assert.Contains(t, newest[4], "failed: ")
	assert.Equal(t, []string{"0", "0", "0", "0", "1", "gap"}, newest[7:13])
	assert.Equal(t, []string{"daily", "2026-04-23", "catalog"}, older[:3])
	assert.Equal(t, "2 · 2", older[6])
	assert.Equal(t, []string{"1", "0", "0", "0", "1", "—"}, older[7:13], "the catalog jobs of the window by state; reviews' are another kind")
	href, _ := rows.Eq(1).Find("td a").Attr("href")
	assert.Equal(t, "/jobs?kind=catalog&window=2026-04-23&state=any", href)
}

// TestRedisNamedOnce: with Config.RedisConnOpt left out, the asynq server and asynqmon
// connect with Config.Redis's own options: a task is processed and asynqmon lists its
// queue; a client whose options can not be read needs the option, said by name.
func TestRedisNamedOnce(t *testing.T) {
	ctx := context.Background()
	ns := testutil.Redis(t)
	st := store.New(testutil.PG(t))
	provider, err := sessions.Oxylabs("user", "secret-password")
	require.NoError(t, err)
	reg, err := handlers.NewRegistry(handlers.Config{Store: st, Redis: ns.Client, Provider: provider, KeyPrefix: ns.Prefix,
		Logger: quietLogger(), Collector: sessions.CollectorConfig{Guard: sessions.LoopbackGuard()}})
	require.NoError(t, err)
	t.Cleanup(reg.Close)
	require.NoError(t, reg.Register(catalog.Kind, catalog.Workflow("http://127.0.0.1:9"), catalog.Parse))
	svc, err := service.New(service.Config{Registry: reg, Store: st, Redis: ns.Client, Queues: map[string]int{ns.Queue: 1},
		HTTPAddr: "127.0.0.1:0", NoDispatcher: true, ShutdownTimeout: time.Second, Logger: quietLogger(), AsynqLogLevel: asynq.FatalLevel})
	require.NoError(t, err)
	require.NoError(t, svc.Start(ctx))
	t.Cleanup(func() { assert.NoError(t, svc.Shutdown(context.Background())) })

	// A task of a kind nobody registered is archived by the asynq server: it took it from
	// the queue through its own connection.
	client := asynq.NewClientFromRedisClient(ns.Client)
	_, err = client.Enqueue(asynq.NewTask("nobody", nil), asynq.Queue(ns.Queue), asynq.TaskID("probe"), asynq.MaxRetry(0))
	require.NoError(t, err)
	insp := asynq.NewInspectorFromRedisClient(ns.Client)
	require.Eventually(t, func() bool {
		info, err := insp.GetTaskInfo(ns.Queue, "probe")
		return err == nil && info.State == asynq.TaskStateArchived
	}, time.Minute, 20*time.Millisecond, "the asynq server never took the task")

	res, err := http.Get("http://" + svc.HTTPAddr() + "/monitoring/api/queues")
	require.NoError(t, err)
	body, _ := io.ReadAll(res.Body)
	res.Body.Close()
	require.Equal(t, http.StatusOK, res.StatusCode, string(body))
	assert.Contains(t, string(body), ns.Queue, "asynqmon reads the same Redis")

	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": "127.0.0.1:1"}})
	defer ring.Close()
	_, err = service.New(service.Config{Registry: reg, Store: st, Redis: ring})
	require.ErrorContains(t, err, "Config.RedisConnOpt is required with a *redis.Ring")
}
