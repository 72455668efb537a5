package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/cmd/internal/envflag"
	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// Passwords of TestRedisACLAndTLS: none may appear in the worker's log.
const (
	redisAppPassword     = "redis-app-pw-4e1d"
	redisDefaultPassword = "redis-default-pw-9b2c"
	uiPassword           = "ui-basic-auth-pw-5a8b"
	pgPassword           = "pg-app-pw-c39e"
)

// secretFile writes a secret as Kubernetes mounts one (a trailing newline) and returns
// its path.
func secretFile(t *testing.T, name, value string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	require.NoError(t, os.WriteFile(p, []byte(value+"\n"), 0o600))
	return p
}

// TestRedisACLAndTLS: the worker binary runs its jobs end to end against a Redis that
// needs TLS (a certificate of the test's own CA) and an ACL user and a PostgreSQL that
// needs TLS (verify-full) and a password, its secrets (Redis, PostgreSQL, proxy and UI
// passwords) given as files; none of them is in its log, /readyz, /metrics, Redis or the
// database (CanaryEverywhere). A bad Redis URL or TLS
// setting is exit status 2 with one line naming the setting; a wrong password or CA is a
// runtime failure: /readyz fails and says which check, without the cause's details.
func TestRedisACLAndTLS(t *testing.T) {
	bin := buildWorker(t)
	srv := testutil.StartRedisWith(t, testutil.RedisOptions{
		Password: redisDefaultPassword,
		// The ACL a team needs (docs/DEPLOY.md): every key and channel of the deployment,
		// every command but the administrative ones.
		ACL: []string{"app on >" + redisAppPassword + " ~* &* +@all -@admin"},
		TLS: true,
	})
	// The test's own client, configured as the worker is: from the environment.
	t.Setenv("TLST_REDIS", "rediss://app@"+srv.Addr)
	t.Setenv("TLST_REDIS_PASSWORD_FILE", secretFile(t, "client-pw", redisAppPassword))
	t.Setenv("TLST_REDIS_TLS_CA", srv.TLS.CAFile)
	rc, err := envflag.RedisFromEnv("TLST_")
	require.NoError(t, err)
	// PostgreSQL of the test's own, with TLS and a role that logs in with its password only
	// over TLS: the worker connects as it (verify-full), the test as postgres.
	pgSrv := testutil.StartPostgres(t)
	pgCA := testutil.NewTestCA(t)
	pgSrv.EnableTLS(pgCA, "app", pgPassword)
	pool := pgSrv.MigratedPool(t)
	workerPG := "postgres://app@127.0.0.1:" + strconv.Itoa(pgSrv.Port) + "/idemscrape?sslmode=verify-full&sslrootcert=" + pgCA.CAFile
	st := store.New(pool)
	site := testutil.NewFakeSite(t, testutil.FakeSiteConfig{Seed: 5, Products: 3})
	proxy := testutil.NewFakeProxy(t, testutil.FakeProxyConfig{Seed: 5, Format: testutil.ProxyFormatOxylabs, User: "acct", Password: proxyPassword})
	queue := "q" + testutil.RandomID(4)

	client := asynq.NewClient(rc.AsynqConnOpt())
	t.Cleanup(func() { _ = client.Close() })
	enqRedis := rc.NewClient()
	t.Cleanup(func() { _ = enqRedis.Close() })
	enq, err := tasks.NewEnqueuer(client, st, &tasks.EnqueuerConfig{Queue: queue, Redis: enqRedis})
	require.NoError(t, err)
	var keys []string
	for i := 1; i <= 3; i++ {
		res, err := enq.Enqueue(context.Background(), tasks.Spec{Kind: catalog.Kind, SourceID: fmt.Sprintf("sku-%d", i), Country: "US", Window: "2026-04-23", ParserVersion: 1})
		require.NoError(t, err)
		keys = append(keys, res.Key)
	}

	url := "rediss://app@" + srv.Addr
	args := []string{"-queues", queue, "-concurrency", "3", "-http", "127.0.0.1:0", "-catalog-base", site.URL,
		"-allow-loopback", "-log-format", "json", "-shutdown-timeout", "30s"}
	env := func(extra ...string) []string {
		return append([]string{
			"IDEMSCRAPE_PG=" + workerPG, "IDEMSCRAPE_PG_PASSWORD_FILE=" + secretFile(t, "pg-pw", pgPassword), "IDEMSCRAPE_REDIS_CLUSTER=",
			"IDEMSCRAPE_PROXY_PROVIDER=oxylabs", "IDEMSCRAPE_PROXY_USER=acct", "IDEMSCRAPE_PROXY_PASSWORD=",
			"IDEMSCRAPE_PROXY_PASSWORD_FILE=" + secretFile(t, "proxy-pw", proxyPassword), "IDEMSCRAPE_PROXY_GATEWAY=" + proxy.Addr,
			"IDEMSCRAPE_HTTP_USER=", "IDEMSCRAPE_HTTP_PASSWORD=", "IDEMSCRAPE_QUEUES=", "IDEMSCRAPE_HTTP_ADDR=",
			"IDEMSCRAPE_REDIS_PASSWORD=", "IDEMSCRAPE_REDIS_TLS_CERT=", "IDEMSCRAPE_REDIS_TLS_KEY=", "IDEMSCRAPE_REDIS_TLS_SERVER_NAME=",
		}, extra...)
	}
	noSecrets := func(t *testing.T, log string) {
		t.Helper()
		for _, s := range []string{redisAppPassword, redisDefaultPassword, proxyPassword, uiPassword, pgPassword} {
			assert.NotContains(t, log, s)
		}
	}

	t.Run("CanaryEverywhere", func(t *testing.T) {
		// End to end, every secret from a file (Redis, PostgreSQL, proxy, UI basic auth).
		wk := startWorker(t, bin, args, env("IDEMSCRAPE_REDIS="+url,
			"IDEMSCRAPE_REDIS_PASSWORD_FILE="+secretFile(t, "redis-pw", redisAppPassword), "IDEMSCRAPE_REDIS_TLS_CA="+srv.TLS.CAFile,
			"IDEMSCRAPE_HTTP_USER=ops", "IDEMSCRAPE_HTTP_PASSWORD_FILE="+secretFile(t, "ui-pw", uiPassword)))
		// The worker logs each job it completed: wait on those lines, then check the rows.
		for range keys {
			wk.waitLine(t, `"msg":"job complete"`)
		}
		for _, k := range keys {
			j, err := st.JobGet(context.Background(), k)
			require.NoError(t, err)
			assert.Equal(t, tasks.StateComplete, j.State, k)
		}
		assert.Equal(t, len(keys), testutil.Count(t, pool, `SELECT count(*) FROM results`))
		// The canary search: no secret on /metrics, /readyz, in any Redis key or value, in
		// the database, in the log.
		addr := listenAddr(t, wk.log())
		code, ready := getReadyz(t, addr)
		assert.Equal(t, 200, code, ready)
		metrics := get(t, "http://"+addr+"/metrics")
		resp, err := http.Get("http://" + addr + "/jobs")
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, http.StatusUnauthorized, resp.StatusCode, "the UI password from its file is required")
		require.NoError(t, wk.cmd.Process.Signal(syscall.SIGTERM))
		assert.Equal(t, 0, wk.wait(t, 90*time.Second))
		assert.Contains(t, wk.log(), `"redis":"rediss app@`+srv.Addr)
		redisText := redisDump(t, rc.NewClient())
		require.Contains(t, redisText, "asynq:", "the search saw asynq's keys")
		dump, err := exec.Command("pg_dump", "--no-owner", "-d", pgSrv.DSN("idemscrape")).Output()
		require.NoError(t, err, "pg_dump")
		require.Contains(t, string(dump), keys[0], "the search saw the jobs")
		for name, text := range map[string]string{"log": wk.log(), "/readyz": ready, "/metrics": metrics, "redis": redisText, "pg_dump": string(dump)} {
			for _, secret := range []string{redisAppPassword, redisDefaultPassword, proxyPassword, uiPassword, pgPassword} {
				assert.NotContains(t, text, secret, "a secret in %s", name)
			}
		}
	})

	t.Run("BadSettingsExit2", func(t *testing.T) {
		for name, tc := range map[string]struct {
			env  []string
			want string
		}{
			"NotARedisURL":    {[]string{"IDEMSCRAPE_REDIS=http://" + srv.Addr}, `-redis ($IDEMSCRAPE_REDIS): URL scheme \"http\"`}, // a JSON log line (-log-format json)
			"CAWithoutTLS":    {[]string{"IDEMSCRAPE_REDIS=redis://" + srv.Addr, "IDEMSCRAPE_REDIS_TLS_CA=" + srv.TLS.CAFile}, "is a TLS setting"},
			"PasswordTwice":   {[]string{"IDEMSCRAPE_REDIS=rediss://app:" + redisAppPassword + "@" + srv.Addr, "IDEMSCRAPE_REDIS_PASSWORD_FILE=" + secretFile(t, "pw2", redisAppPassword)}, "give it one way"},
			"MissingProxyPW":  {[]string{"IDEMSCRAPE_REDIS=" + url, "IDEMSCRAPE_PROXY_PASSWORD_FILE=/nonexistent/proxy-pw"}, "IDEMSCRAPE_PROXY_PASSWORD_FILE: secret file /nonexistent/proxy-pw"},
			"EmptyPGPassword": {[]string{"IDEMSCRAPE_REDIS=" + url, "IDEMSCRAPE_PG_PASSWORD_FILE=" + secretFile(t, "empty", "")}, "IDEMSCRAPE_PG_PASSWORD_FILE: secret file"},
		} {
			t.Run(name, func(t *testing.T) {
				wk := startWorker(t, bin, args, env(tc.env...))
				assert.Equal(t, 2, wk.wait(t, 60*time.Second))
				assert.Contains(t, wk.log(), tc.want)
				noSecrets(t, wk.log())
			})
		}
	})

	t.Run("WrongPasswordOrCAFailsReadyz", func(t *testing.T) {
		for name, extra := range map[string][]string{
			"WrongPassword": {"IDEMSCRAPE_REDIS=" + url, "IDEMSCRAPE_REDIS_PASSWORD_FILE=" + secretFile(t, "bad", "not-the-password"), "IDEMSCRAPE_REDIS_TLS_CA=" + srv.TLS.CAFile},
			"WrongCA":       {"IDEMSCRAPE_REDIS=" + url, "IDEMSCRAPE_REDIS_PASSWORD_FILE=" + secretFile(t, "ok", redisAppPassword), "IDEMSCRAPE_REDIS_TLS_CA=" + srv.TLS.OtherCAFile},
			"PlainToTLS":    {"IDEMSCRAPE_REDIS=redis://app@" + srv.Addr, "IDEMSCRAPE_REDIS_PASSWORD_FILE=" + secretFile(t, "ok2", redisAppPassword)},
		} {
			t.Run(name, func(t *testing.T) {
				wk := startWorker(t, bin, args, env(extra...))
				wk.waitLine(t, "service started")
				code, body := getReadyz(t, listenAddr(t, wk.log()))
				assert.Equal(t, 503, code, body)
				assert.Contains(t, body, "redis")
				assert.NotContains(t, strings.ToLower(body), "certificate", "no driver detail on /readyz")
				assert.NotContains(t, body, "WRONGPASS")
				require.NoError(t, wk.cmd.Process.Signal(syscall.SIGTERM))
				wk.wait(t, 90*time.Second)
				noSecrets(t, wk.log())
			})
		}
	})
}

// listenAddr finds the HTTP address in the worker's "service started" line.
func listenAddr(t *testing.T, log string) string {
	t.Helper()
	for _, line := range strings.Split(log, "\n") {
		if !strings.Contains(line, "service started") {
			continue
		}
		var v struct{ HTTP string }
		require.NoError(t, json.Unmarshal([]byte(line), &v), line)
		return v.HTTP
	}
	t.Fatalf("no service started line in:\n%s", log)
	return ""
}

// getReadyz reads /readyz.
func getReadyz(t *testing.T, addr string) (int, string) {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/readyz")
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b)
}

// TestLogsStayJSON: with Redis stopped under a running worker, go-redis's and asynq's
// complaints come through the worker's JSON handler: every line of the log parses.
func TestLogsStayJSON(t *testing.T) {
	bin := buildWorker(t)
	srv := testutil.StartRedis(t)
	pool := testutil.PG(t)
	site := testutil.NewFakeSite(t, testutil.FakeSiteConfig{Seed: 6, Products: 1})
	proxy := testutil.NewFakeProxy(t, testutil.FakeProxyConfig{Seed: 6, Format: testutil.ProxyFormatOxylabs, User: "acct", Password: proxyPassword})
	wk := startWorker(t, bin, []string{"-queues", "q" + testutil.RandomID(4), "-http", "127.0.0.1:0", "-catalog-base", site.URL,
		"-allow-loopback", "-log-format", "json", "-shutdown-timeout", "5s"}, []string{
		"IDEMSCRAPE_PG=" + dsnOf(t, pool), "IDEMSCRAPE_REDIS=" + srv.Addr, "IDEMSCRAPE_REDIS_CLUSTER=",
		"IDEMSCRAPE_PROXY_PROVIDER=oxylabs", "IDEMSCRAPE_PROXY_USER=acct", "IDEMSCRAPE_PROXY_PASSWORD=" + proxyPassword,
		"IDEMSCRAPE_PROXY_GATEWAY=" + proxy.Addr, "IDEMSCRAPE_HTTP_USER=", "IDEMSCRAPE_HTTP_PASSWORD=", "IDEMSCRAPE_QUEUES=", "IDEMSCRAPE_HTTP_ADDR=",
	})
	wk.waitLine(t, "service started")
	addr := listenAddr(t, wk.log())
	srv.Stop()
	code, body := getReadyz(t, addr)
	assert.Equal(t, 503, code, body)
	assert.Contains(t, body, "redis: failing")
	assert.Contains(t, body, "asynq: failing")
	wk.waitLine(t, `"component":"go-redis"`) // go-redis's own line, as JSON
	require.NoError(t, wk.cmd.Process.Signal(syscall.SIGTERM))
	wk.wait(t, 90*time.Second)
	n := 0
	for _, line := range strings.Split(strings.TrimSpace(wk.log()), "\n") {
		var v map[string]any
		assert.NoError(t, json.Unmarshal([]byte(line), &v), "not JSON: %s", line)
		n++
	}
	assert.Greater(t, n, 3)
}

// get reads a URL's body.
func get(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return string(b)
}

// redisDump is every key of the server and its value, as text, for the canary search.
func redisDump(t *testing.T, rdb redis.UniversalClient) string {
	t.Helper()
	defer rdb.Close()
	ctx := context.Background()
	var b strings.Builder
	iter := rdb.Scan(ctx, 0, "*", 1000).Iterator()
	for iter.Next(ctx) {
		k := iter.Val()
		fmt.Fprintf(&b, "%s = ", k)
		switch typ := rdb.Type(ctx, k).Val(); typ {
		case "string":
			fmt.Fprintln(&b, rdb.Get(ctx, k).Val())
		case "hash":
			fmt.Fprintln(&b, rdb.HGetAll(ctx, k).Val())
		case "list":
			fmt.Fprintln(&b, rdb.LRange(ctx, k, 0, -1).Val())
		case "set":
			fmt.Fprintln(&b, rdb.SMembers(ctx, k).Val())
		case "zset":
			fmt.Fprintln(&b, rdb.ZRange(ctx, k, 0, -1).Val())
		case "stream":
			fmt.Fprintln(&b, rdb.XRange(ctx, k, "-", "+").Val())
		default:
			fmt.Fprintln(&b, "("+typ+")")
		}
	}
	require.NoError(t, iter.Err())
	return b.String()
}
