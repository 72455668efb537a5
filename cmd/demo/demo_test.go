package main

import (
	"bytes"
	"context"
	"fmt"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/cmd/internal/envflag"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestDemo runs the demo's run function, as `make demo` does but with a smaller catalog,
// against the test servers, and checks what a newcomer is promised: every fault of the mix
// happened at least once and is shown, every invariant holds, the exit is clean, and
// nothing of the run is left in PostgreSQL or Redis; a broken invariant fails the run; and
// the cleanup never touches a database or key that is not the run's own.
func TestDemo(t *testing.T) {
	setup := func(t *testing.T) (options, *bytes.Buffer, *names) {
		var out bytes.Buffer
		var n names
		o := defaultOptions()
		o.AdminDSN = testutil.PGAdminDSN()
		o.Redis = envflag.RedisConfig{Addr: testutil.RedisAddr()}
		o.Products = 8
		o.Countries = []string{"US"}
		o.Rendered = 2
		o.UnavailableJobs = 2
		// 8 jobs make ~40 sticky requests: at 0.2 a disconnect is all but certain (1 − 0.8^40).
		// A new session survives its 4 requests with 0.8^4 ≈ 0.41: with 10 sessions per
		// attempt and 3 attempts a job of a served country fails with 0.59^30 ≈ 10⁻⁷.
		o.Disconnect = 0.2
		o.MaxSessionRestarts = 9
		// A 429 cut by the proxy is not seen as one: all 10 are cut with 0.2^10 ≈ 10⁻⁷.
		o.Throttled = 10
		// A bound against hanging on a loaded box, not a speed goal.
		o.Timeout = 5 * time.Minute
		o.Progress = progressPlain
		o.Out = &out
		o.onNames = func(got names) { n = got }
		return o, &out, &n
	}
	ctx := context.Background()

	t.Run("HappyPath", func(t *testing.T) {
		o, out, n := setup(t)
		err := run(ctx, t, o)
		t.Log("\n" + out.String())
		require.NoError(t, err)
		text := out.String()

		for _, f := range []struct{ name, evidence string }{
			{"bot challenge", `(\d+) challenge pages served \(one per new exit\); (\d+) attempts? on warm sessions \(the session pool\) skipped it`},
			{"device disconnects", `(\d+) at the proxy; (\d+) half-done units quarantined \(session_lost\)`},
			{"429 with Retry-After", `(\d+) requests? waited out and sent again on their session`},
			{"no proxy peers in JP", `(\d+) jobs, \d+ attempts \((\d+) failed exit_unavailable\): failed (\d+)`},
			{"shop schema change", `(\d+) jobs: failed/validation (\d+), not retried; (\d+) stagings quarantined as validation failures, 0 results written`},
			{"dispatcher crash after XADD", `its batch \((\d+) events?\) was published again; the consumer skipped (\d+) replays?`},
			{"device drop mid-render", `(\d+) jobs rendered in Chromium: complete (\d+); (\d+) of them hold the price the shop's script shows; (\d+) stagings? quarantined \(session_lost\)`},
		} {
			m := regexp.MustCompile(`(?m)^  ok\s+` + regexp.QuoteMeta(f.name) + `\s+` + f.evidence).FindStringSubmatch(text)
			require.NotNil(t, m, "fault line %q missing or not ok", f.name)
			for _, num := range m[1:] {
				k, err := strconv.Atoi(num)
				require.NoError(t, err)
				assert.GreaterOrEqual(t, k, 1, "fault %q: %s", f.name, m[0])
			}
		}
		assert.Regexp(t, `(?m)^  jobs by state\s+complete 10 · failed 4 \(of 14\)$`, text)
		assert.Regexp(t, `(?m)^  ok\s+device drop mid-render\s+2 jobs rendered in Chromium: complete 2; 2 of them`, text)
		assert.Regexp(t, `(?m)^  outbox replays deduplicated\s+[1-9]\d* \(10 events, \d+ stream entries, 10 took effect\)$`, text)
		assert.Regexp(t, `(?m)^  duplicates rejected\s+15 enqueues`, text) // 10 on the second tick, 5 by hand
		assert.Regexp(t, `(?m)^\[\s*\d+\.\ds\] jobs 14/14 done`, text)
		assert.Regexp(t, `(?m)^  proxy cost\s+0\.\d{6} USD per completed job · 0\.\d{6} USD in all \(8\.40 USD/GB\) · top waste: \S+ 0\.\d{6} USD \(\d+ % of the cost\)$`, text)
		assert.Equal(t, 6, len(regexp.MustCompile(`(?m)^  ok\s+(every complete|every outbox|every event|no result|no outbox) `).FindAllString(text, -1)), "six invariants shown as ok")
		assert.NotContains(t, text, "FAIL")
		assert.NotContains(t, text, proxyPassword)
		assertRunGone(t, *n)
	})

	t.Run("BrokenInvariantFails", func(t *testing.T) {
		o, out, n := setup(t)
		// No slow faults: this run only has to reach the checks.
		o.UnavailableJobs, o.Throttled = 0, 0
		o.afterSettled = func(ctx context.Context, pool *pgxpool.Pool) error {
			// The consumer's effect taking place twice for one event.
			_, err := pool.Exec(ctx, `INSERT INTO price_alerts (event_key, sku, price)
				SELECT event_key, sku, price FROM price_alerts ORDER BY id LIMIT 1`)
			return err
		}
		err := run(ctx, t, o)
		require.Error(t, err)
		assert.Contains(t, err.Error(), "invariant broken: every event took effect exactly once (price alerts) (1 violations")
		assert.Regexp(t, `(?m)^  FAIL\s+every event took effect exactly once \(price alerts\)\s+BROKEN for 1: observed:catalog:sku-`, out.String())
		assertRunGone(t, *n)
	})

	t.Run("KeptRunSaysHowToUseAndDeleteIt", func(t *testing.T) {
		o, out, n := setup(t)
		// Fewer faults: this run only has to leave something to look at.
		o.UnavailableJobs, o.Rendered = 0, 0
		o.Keep = true
		t.Cleanup(func() { // a failed assertion must not leave the run behind
			if n.RunID != "" {
				_ = dropRun(context.Background(), testutil.PGAdminDSN(), o.Redis, n.RunID)
			}
		})
		err := run(ctx, t, o)
		t.Log("\n" + out.String())
		require.NoError(t, err)
		text := out.String()
		assert.NotContains(t, text, "dropped at exit", "the header says what -keep does")
		assert.Contains(t, text, "(created for this run, kept at exit (-keep))")
		dsn, _, ok := runDSN(testutil.PGAdminDSN(), n.Database)
		require.True(t, ok)
		assert.Contains(t, text, "export IDEMSCRAPE_PG='"+dsn+"'")
		assert.Contains(t, text, "IDEMSCRAPE_QUEUE="+n.Queue)
		m := regexp.MustCompile(`go run ./cmd/idemscrape status '([^']+)'`).FindStringSubmatch(text)
		require.NotNil(t, m, "a key to try")
		assert.True(t, databaseExists(t, n.Database), "kept")
		pool, err := pgxpool.New(ctx, dsn)
		require.NoError(t, err)
		var state string
		require.NoError(t, pool.QueryRow(ctx, `SELECT state FROM jobs WHERE key = $1`, m[1]).Scan(&state))
		pool.Close()
		assert.Equal(t, "complete", state, "the key printed is a job of the run")
		assert.Contains(t, text, "go run ./cmd/demo -drop "+n.RunID)

		require.Error(t, dropRun(ctx, testutil.PGAdminDSN(), o.Redis, "../x"), "not a run id")
		require.NoError(t, dropRun(ctx, testutil.PGAdminDSN(), o.Redis, n.RunID))
		assertRunGone(t, *n)
	})

	t.Run("DropRefusesDatabaseWithoutItsMark", func(t *testing.T) {
		n := newNames(testutil.RandomID(4))
		admin := adminConn(t)
		ident := pgx.Identifier{n.Database}.Sanitize()
		_, err := admin.Exec(ctx, `CREATE DATABASE `+ident)
		require.NoError(t, err)
		t.Cleanup(func() {
			_, _ = adminConn(t).Exec(context.Background(), `DROP DATABASE IF EXISTS `+ident+` WITH (FORCE)`)
		})

		// No comment at all: a database of the demo's name that the demo did not create.
		err = dropDatabase(ctx, testutil.PGAdminDSN(), n)
		require.ErrorIs(t, err, errNotOurs)
		assert.True(t, databaseExists(t, n.Database))

		// Another run's mark.
		_, err = admin.Exec(ctx, `COMMENT ON DATABASE `+ident+` IS '`+dbMarkPrefix+`00000000'`)
		require.NoError(t, err)
		err = dropDatabase(ctx, testutil.PGAdminDSN(), n)
		require.ErrorIs(t, err, errNotOurs)
		assert.True(t, databaseExists(t, n.Database))

		// Its own mark: dropped.
		_, err = admin.Exec(ctx, `COMMENT ON DATABASE `+ident+` IS '`+n.Mark+`'`)
		require.NoError(t, err)
		require.NoError(t, dropDatabase(ctx, testutil.PGAdminDSN(), n))
		assert.False(t, databaseExists(t, n.Database))
	})

	t.Run("CreateRefusesExistingDatabase", func(t *testing.T) {
		n := newNames(testutil.RandomID(4))
		ident := pgx.Identifier{n.Database}.Sanitize()
		_, err := adminConn(t).Exec(ctx, `CREATE DATABASE `+ident)
		require.NoError(t, err)
		t.Cleanup(func() {
			_, _ = adminConn(t).Exec(context.Background(), `DROP DATABASE IF EXISTS `+ident+` WITH (FORCE)`)
		})

		_, err = createDatabase(ctx, testutil.PGAdminDSN(), n)
		require.Error(t, err)
		var comment *string
		require.NoError(t, adminConn(t).QueryRow(ctx, `SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = $1`,
			n.Database).Scan(&comment))
		assert.Nil(t, comment, "an existing database is not adopted (marked)")
	})

	t.Run("RedisCleanupDeletesOnlyItsOwnKeys", func(t *testing.T) {
		ns := testutil.Redis(t) // a foreign namespace, cleaned by testutil
		rdb := ns.Client
		n := newNames(testutil.RandomID(4))
		other := newNames(testutil.RandomID(4)) // another demo run's keys
		t.Cleanup(func() { _ = cleanupRedis(context.Background(), rdb, other) })
		own := []string{n.Prefix + "{catalog:sku-1:US:2026-12-03:v1}:fence", n.Prefix + "stream:catalog", "asynq:{" + n.Queue + "}:t:x"}
		foreign := []string{ns.Prefix + "x", other.Prefix + "stream:catalog", "asynq:{" + other.Queue + "}:t:x", "asynq:{" + ns.Queue + "}:t:x"}
		for _, k := range append(append([]string{}, own...), foreign...) {
			require.NoError(t, rdb.Set(ctx, k, "1", time.Hour).Err())
		}
		checkCleanupRedis(ctx, t, rdb, n, other, own, foreign)
	})
}

// TestDemoRedisCleanupOnCluster: on a Redis Cluster the run's keys are spread over every
// master (SCAN sees one node's keys only); the cleanup deletes them all and nothing else.
func TestDemoRedisCleanupOnCluster(t *testing.T) {
	ctx := context.Background()
	cluster := testutil.StartRedisCluster(t, 3, 0)
	rdb := envflag.RedisConfig{Cluster: cluster.Addrs()}.NewClient()
	defer rdb.Close()
	n, other := newNames(testutil.RandomID(4)), newNames(testutil.RandomID(4))
	var own, foreign []string
	for i := range 30 {
		own = append(own, fmt.Sprintf("%s{catalog:sku-%d:US:2026-12-03:v1}:fence", n.Prefix, i))
		foreign = append(foreign, fmt.Sprintf("%s{catalog:sku-%d:US:2026-12-03:v1}:fence", other.Prefix, i))
	}
	own = append(own, n.Prefix+"stream:{catalog}", "asynq:{"+n.Queue+"}:t:x")
	foreign = append(foreign, other.Prefix+"stream:{catalog}", "asynq:{"+other.Queue+"}:t:x")
	masters := map[string]bool{}
	for _, k := range append(append([]string{}, own...), foreign...) {
		require.NoError(t, rdb.Set(ctx, k, "1", time.Hour).Err())
		m, err := rdb.(*redis.ClusterClient).MasterForKey(ctx, k)
		require.NoError(t, err)
		masters[m.Options().Addr] = true
	}
	require.Len(t, masters, 3, "the keys are on every master")
	checkCleanupRedis(ctx, t, rdb, n, other, own, foreign)
}

// checkCleanupRedis lists n's and other's queues in asynq's set of queues, runs
// cleanupRedis for n (whose keys own and other's keys foreign are set), and checks that it
// deleted own and n's queue and kept foreign and other's queue.
func checkCleanupRedis(ctx context.Context, t *testing.T, rdb redis.UniversalClient, n, other names, own, foreign []string) {
	t.Helper()
	require.NoError(t, rdb.SAdd(ctx, "asynq:queues", n.Queue, other.Queue).Err())

	require.NoError(t, cleanupRedis(ctx, rdb, n))
	for _, k := range own {
		assert.Zero(t, rdb.Exists(ctx, k).Val(), "own key %s deleted", k)
	}
	for _, k := range foreign {
		assert.Equal(t, int64(1), rdb.Exists(ctx, k).Val(), "foreign key %s kept", k)
	}
	assert.False(t, rdb.SIsMember(ctx, "asynq:queues", n.Queue).Val())
	assert.True(t, rdb.SIsMember(ctx, "asynq:queues", other.Queue).Val())
}

// assertRunGone checks that the run left nothing behind: no database, no Redis key under its
// prefix or queue, no entry in asynq's set of queues.
func assertRunGone(t *testing.T, n names) {
	t.Helper()
	require.NotEmpty(t, n.RunID)
	assert.False(t, databaseExists(t, n.Database), "database %s dropped", n.Database)
	ns := testutil.Redis(t)
	var keys []string
	iter := ns.Client.Scan(context.Background(), 0, "*"+n.RunID+"*", 1000).Iterator()
	for iter.Next(context.Background()) {
		keys = append(keys, iter.Val())
	}
	require.NoError(t, iter.Err())
	assert.Empty(t, keys, "Redis keys of the run left behind")
	assert.False(t, ns.Client.SIsMember(context.Background(), "asynq:queues", n.Queue).Val())
}

func adminConn(t *testing.T) *pgx.Conn {
	t.Helper()
	c, err := pgx.Connect(context.Background(), testutil.PGAdminDSN())
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	return c
}

func databaseExists(t *testing.T, name string) bool {
	t.Helper()
	var n int
	require.NoError(t, adminConn(t).QueryRow(context.Background(), `SELECT count(*) FROM pg_database WHERE datname = $1`, name).Scan(&n))
	return n == 1
}

// TestRenderPhaseWithoutChromium: on a machine without Chromium the browser pool says so
// (sessions.ErrNoChromium), and the summary shows the JavaScript phase as skipped, which
// does not fail the run; a phase that ran but did not show its fault does.
func TestRenderPhaseWithoutChromium(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	t.Setenv("IDEMSCRAPE_CHROMIUM", "")
	_, err := sessions.NewBrowserPool(sessions.BrowserConfig{})
	require.ErrorIs(t, err, sessions.ErrNoChromium)

	s := &summary{BrowserNote: "no Chromium on this machine"}
	var out bytes.Buffer
	s.render(&out, defaultOptions())
	assert.Regexp(t, `(?m)^  skip\s+device drop mid-render\s+skipped: no Chromium on this machine$`, out.String())
	assert.NotContains(t, fmt.Sprint(s.verdict()), "device drop mid-render", "a skipped phase is not a failure")

	s = &summary{RenderedJobs: map[string]int64{"complete": 2}, RenderedRight: 2}
	require.ErrorContains(t, s.verdict(), "fault not demonstrated: device drop mid-render")
}

// TestOptionsValidate: a bad option names itself and what would be accepted.
func TestOptionsValidate(t *testing.T) {
	for _, c := range []struct {
		set  func(*options)
		want string
	}{
		{func(o *options) { o.Rendered = -1 }, "rendered -1: want 0 to the catalog size (-products 30)"},
		{func(o *options) { o.Rendered = 31 }, "rendered 31: want 0 to the catalog size (-products 30)"},
		{func(o *options) { o.Products = 0 }, "products 0: want 3 to 5000"},
		{func(o *options) { o.Disconnect = 1 }, "disconnect 1: want a probability in [0, 1)"},
	} {
		o := defaultOptions()
		o.Out = &bytes.Buffer{}
		c.set(&o)
		assert.EqualError(t, o.validate(), c.want)
	}
	o := defaultOptions()
	o.Out = &bytes.Buffer{}
	assert.NoError(t, o.validate())
}
