// Package soak holds the season test: a simulated run of many days, with the scheduler,
// the reconciler (and its retention) driven by a simulated clock while a real worker (the
// runner behind the service, the outbox dispatcher, an inbox consumer) does each day's
// jobs against the fake shop and proxy, and the faults of a season come each day. `make
// soak` runs the full season (IDEMSCRAPE_SOAK=full: 100 days of 1,000 jobs); `make test`
// runs a short one (20 days of 50 jobs) with the same checks.
package soak

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/scheduler"
	"github.com/idemscrape/idemscrape/service"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/outbox"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// season is the size of a run.
type season struct {
	Days, JobsPerDay, RetentionDays int
}

func seasonFromEnv() season {
	if os.Getenv("IDEMSCRAPE_SOAK") == "full" {
		return season{Days: 100, JobsPerDay: 1000, RetentionDays: 30}
	}
	return season{Days: 20, JobsPerDay: 50, RetentionDays: 3}
}

// gapCycle: every gapCycle-th day's tick is not retried, so the next day finds the gap and
// fills it.
const gapCycle = 5

// recoverWindow is the dispatchers' recover window (real time): after each day's Redis
// restart, the events sent within it are published again (the inbox takes them once). A
// simulated day lasts a second or more for real, so this is a fraction of a day, as 24 h
// is of a week's outbox retention in a deployment; a longer one would republish (and so
// keep young) days of rows at every restart.
const recoverWindow = 300 * time.Millisecond

// clock maps the simulated days onto real time: day d began (in the simulation) at
// start + d×24h and (for real) at began[d]. Rows the workers write carry real times
// (updated_at, sent_at, seen_at), windows carry simulated ones (due_at); the retention
// wrappers below turn a simulated age into the real one.
type clock struct {
	*testutil.Clock           // simulated now
	start           time.Time // simulated 00:00 of day 0
	mu              sync.Mutex
	began           []time.Time // guarded by mu
}

func (c *clock) set(t time.Time) { c.Set(t) }

// dayStarts records the real time at which simulated day d begins.
func (c *clock) dayStarts(d int) {
	c.mu.Lock()
	c.began = append(c.began, time.Now())
	c.mu.Unlock()
	c.Set(c.start.Add(time.Duration(d) * 24 * time.Hour))
}

// realAge is the real age that corresponds to a simulated age at simulated now: rows
// written before the real start of the simulated instant now − age are older than it.
func (c *clock) realAge(age time.Duration) time.Duration {
	cut := c.Now().Add(-age)
	c.mu.Lock()
	defer c.mu.Unlock()
	day := int(cut.Sub(c.start) / (24 * time.Hour))
	if day < 0 {
		return time.Since(c.began[0]) + time.Hour // before the season: nothing is that old
	}
	if day >= len(c.began) {
		return time.Millisecond
	}
	return time.Since(c.began[day])
}

// simRetention is the reconciler's retention in simulated time (store.PG works in real time).
type simRetention struct {
	st *store.PG
	c  *clock
}

func (r simRetention) JobsPruneTerminal(ctx context.Context, age time.Duration, limit int) (int64, error) {
	return r.st.JobsPruneTerminal(ctx, r.c.realAge(age), limit)
}

func (r simRetention) QuarantinePrune(ctx context.Context, age time.Duration, limit int) (int64, error) {
	return r.st.QuarantinePrune(ctx, r.c.realAge(age), limit)
}

// WindowsPrune: due_at is simulated time, compared with the database's real now().
func (r simRetention) WindowsPrune(ctx context.Context, age time.Duration, limit int) (int64, error) {
	return r.st.WindowsPrune(ctx, max(time.Since(r.c.Now().Add(-age)), time.Millisecond), limit)
}

// simOutbox is the outbox's upkeep in simulated time. The inbox keeps its rows at least
// for the recover window (plus a margin): what inbox_retention > the recover window
// guarantees in a deployment, since republished events are recognised only while their
// inbox rows are kept.
type simOutbox struct {
	o *outbox.Maintainer
	c *clock
}

func (s simOutbox) Lag(ctx context.Context, olderThan time.Duration) (int64, time.Time, error) {
	return s.o.Lag(ctx, time.Hour) // real time: nothing should stay unsent for an hour
}

func (s simOutbox) PruneSent(ctx context.Context, age time.Duration, limit int) (int64, error) {
	return s.o.PruneSent(ctx, s.c.realAge(age), limit)
}

func (s simOutbox) PruneInbox(ctx context.Context, age time.Duration, limit int) (int64, error) {
	return s.o.PruneInbox(ctx, max(s.c.realAge(age), 4*recoverWindow), limit)
}

// dayRow is one line of the season's curve.
type dayRow struct {
	Day         int
	Created     int
	Complete    int
	RedisMemory int64
	StreamLen   int64
	Rows        map[string]int64
	Seconds     float64
}

// tables whose row counts must stay flat once the retention horizon is past.
var tables = []string{"jobs", "attempts", "results", "outbox", "outbox_inbox", "schedule_windows", "quarantine"}

func TestSoak(t *testing.T) {
	s := seasonFromEnv()
	ctx := context.Background()
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))

	// The world: a shop, a proxy gateway, our own Redis (restarted each day, without
	// persistence: it loses everything), our own database.
	site := testutil.NewFakeSite(t, testutil.FakeSiteConfig{Seed: 11, Products: s.JobsPerDay})
	proxy := testutil.NewFakeProxy(t, testutil.FakeProxyConfig{Seed: 11, Format: testutil.ProxyFormatOxylabs, User: "acct", Password: "soak-pw"})
	provider, err := sessions.Oxylabs("acct", "soak-pw")
	require.NoError(t, err)
	provider, err = provider.WithGateway(proxy.Addr)
	require.NoError(t, err)
	rs := testutil.StartRedis(t)
	rdb := rs.Client()
	pool := testutil.PG(t)
	st := store.New(pool)
	_, err = pool.Exec(ctx, `CREATE TABLE side_effects (id bigserial PRIMARY KEY, event_key text NOT NULL)`)
	require.NoError(t, err)
	// The scheduler reaches PostgreSQL through a proxy that a blip closes.
	schedPool, pgProxy := testutil.PoolVia(t, pool)
	schedStore := store.New(schedPool)

	const prefix, queue, topic = "soak:", "soak", catalog.Kind
	c := &clock{Clock: testutil.NewClock(time.Time{}), start: time.Now().UTC().Truncate(24*time.Hour).AddDate(0, 0, -s.Days-1)}
	c.dayStarts(0)

	// The worker.
	reg, err := handlers.NewRegistry(handlers.Config{
		Store: st, Redis: rdb, Provider: provider, KeyPrefix: prefix, WorkerID: "soak-worker", Logger: quiet,
		Collector: sessions.CollectorConfig{Guard: sessions.NewGuard(tasks.LoopbackPolicy())},
	})
	require.NoError(t, err)
	t.Cleanup(reg.Close)
	require.NoError(t, reg.Register(catalog.Kind, catalog.Workflow(site.URL), catalog.Parse))
	asynqOpt := asynq.RedisClientOpt{Addr: rs.Addr}
	svc, err := service.New(service.Config{
		Registry: reg, Store: st, Redis: rdb, RedisConnOpt: asynqOpt, Queues: map[string]int{queue: 1},
		Concurrency: 20, ShutdownTimeout: 5 * time.Second, HTTPAddr: "127.0.0.1:0",
		Dispatcher: &outbox.DispatcherConfig{Prefix: prefix, RecoverWindow: recoverWindow,
			MaxLen: 2 * max(s.JobsPerDay, outbox.DefaultDispatchBatchSize), TrimInterval: 200 * time.Millisecond, Logger: quiet},
		Logger: quiet, AsynqLogLevel: asynq.FatalLevel,
	})
	require.NoError(t, err)
	require.NoError(t, svc.Start(ctx))
	t.Cleanup(func() { assert.NoError(t, svc.Shutdown(context.Background())) })

	// The consumer: an inbox consumer whose side effect is a row per event (no unique
	// key: an effect taking place twice shows as two rows).
	// It signals every batch it handled: the day's waits re-read PostgreSQL on that signal.
	consumed := make(chan struct{}, 1)
	cons, err := outbox.NewConsumer(rdb, &outbox.ConsumerConfig{Prefix: prefix, Topic: topic, Group: "effects", StartID: "0",
		Block: 50 * time.Millisecond, MinIdle: 5 * time.Second, Logger: quiet,
		OnBatch: func(outbox.BatchReport) {
			select {
			case consumed <- struct{}{}:
			default:
			}
		}})
	require.NoError(t, err)
	cctx, cstop := context.WithCancel(ctx)
	consDone := make(chan error, 1)
	go func() {
		consDone <- cons.RunTx(cctx, pool, func(ctx context.Context, tx pgx.Tx, ev outbox.Event) error {
			_, err := tx.Exec(ctx, `INSERT INTO side_effects (event_key) VALUES ($1)`, ev.EventKey)
			return err
		})
	}()
	t.Cleanup(func() {
		cstop()
		if err := <-consDone; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("consumer: %v", err)
		}
	})

	// The scheduler and the reconciler, on the simulated clock.
	ids := make([]string, s.JobsPerDay)
	for i := range ids {
		ids[i] = fmt.Sprintf("sku-%d", i+1)
	}
	day := 24 * time.Hour
	file, err := scheduler.ParseFile([]byte(fmt.Sprintf(`
templates:
  - name: daily
    cron: "0 6 * * *"
    window: daily
    kind: catalog
    sources: {ids: [%s]}
    countries: [US]
    parser_version: 1
    catchup: none
kinds:
  catalog: {queue: %s}
reconciler:
  job_retention: %s
  quarantine_retention: %s
  outbox_retention: %s
  inbox_retention: %s
  saved_input_retention: %s
  prune_batch: 5000
`, strings.Join(ids, ", "), queue, time.Duration(s.RetentionDays)*day, day, day, 2*day, 2*day)), "", nil)
	require.NoError(t, err)
	client := asynq.NewClient(asynqOpt)
	t.Cleanup(func() { _ = client.Close() })
	insp := asynq.NewInspector(asynqOpt)
	t.Cleanup(func() { _ = insp.Close() })
	sched, err := scheduler.New(scheduler.Config{File: file, Client: client, Redis: rdb, Store: schedStore, Inspector: insp,
		Destinations: tasks.LoopbackPolicy(), Logger: quiet, Now: c.Now})
	require.NoError(t, err)
	rec, err := scheduler.NewReconciler(scheduler.ReconcilerConfig{File: file, Store: st, Redis: rdb, Client: client, Inspector: insp,
		Outbox: simOutbox{&outbox.Maintainer{Pool: pool}, c}, Retention: simRetention{st, c}, KeyPrefix: prefix,
		Destinations: tasks.LoopbackPolicy(), Logger: quiet, Now: c.Now})
	require.NoError(t, err)

	var curve []dayRow
	began := time.Now()
	for d := 1; d <= s.Days; d++ {
		dayBegan := time.Now()
		c.dayStarts(d)
		at := c.start.Add(time.Duration(d)*day + 6*time.Hour)
		c.set(at)
		window := at.Format("2006-01-02")

		// Fault 1, a PostgreSQL blip at tick time: the tick fails and enqueues nothing. On
		// most days it is tried again once PostgreSQL is back (the scheduler's loop retries
		// until the window's deadline); every gapCycle-th day nobody retries, and the next day's
		// gap check finds the window and fills it.
		pgProxy.Refuse()
		rep := sched.Tick(ctx, "daily", at)
		require.Error(t, rep.Err, "day %d: the tick while PostgreSQL is away", d)
		pgProxy.Accept()
		created := 0
		if d%gapCycle != 0 {
			rep = sched.Tick(ctx, "daily", at)
			require.NoError(t, rep.Err, "day %d: the tick once PostgreSQL is back", d)
			created += rep.Outcomes[tasks.Created.String()]
		}
		if d > 1 && (d-1)%gapCycle == 0 {
			gaps, err := sched.Gaps(ctx)
			require.NoError(t, err)
			prev := at.Add(-day).Format("2006-01-02")
			require.Len(t, gaps, 1, "day %d: yesterday's window is the one gap: %v", d, gaps)
			require.Equal(t, prev, gaps[0].Window)
			frep, err := sched.Fill(ctx, "daily", prev)
			require.NoError(t, err)
			require.Equal(t, s.JobsPerDay, frep.Outcomes[tasks.Created.String()], "day %d: the fill created yesterday's jobs", d)
			require.NoError(t, waitTookEffect(ctx, t, pool, consumed, prev, s.JobsPerDay))
			filled, err := sched.Fill(ctx, "daily", prev)
			require.NoError(t, err)
			require.Zero(t, filled.Outcomes[tasks.Created.String()], "day %d: a second fill creates nothing", d)
		}
		if d%gapCycle != 0 {
			require.Equal(t, s.JobsPerDay, created, "day %d: the window's jobs, once", d)
			require.NoError(t, waitTookEffect(ctx, t, pool, consumed, window, s.JobsPerDay))
		}

		// Every event consumed; Redis as the day leaves it (the dead group holds the stream
		// up to its length cap).
		require.NoError(t, waitTookEffect(ctx, t, pool, consumed, "", 0))
		row := dayRow{Day: d, Created: s.JobsPerDay, Rows: map[string]int64{}}
		row.RedisMemory = redisMemory(ctx, t, rdb)
		row.StreamLen, _ = rdb.XLen(ctx, outbox.StreamKey(prefix, topic)).Result()

		// Fault 2: Redis restarts. Most days cleanly, with its data (an RDB written at
		// shutdown, loaded at start); on one day of each cycle it comes back empty
		// (streams, groups, asynq's queues, leases gone) and the dispatcher republishes
		// what it sent within the recover window. Fault 3: a consumer group that never
		// reads, on the stream from day 1 (created again after a loss): only the length
		// cap bounds the stream.
		if d%gapCycle == 3 {
			rs.Restart()
		} else {
			rs.RestoreSnapshot(rs.Snapshot(fmt.Sprint(d)))
		}
		if err := rdb.XGroupCreateMkStream(ctx, outbox.StreamKey(prefix, topic), "dead", "$").Err(); err != nil && !strings.Contains(err.Error(), "BUSYGROUP") {
			require.NoError(t, err)
		}

		// The end of the day: the reconciler sweeps (rescues, re-enqueues, retention).
		c.set(at.Add(17 * time.Hour))
		for range 5 {
			srep := rec.Sweep(ctx)
			require.NoError(t, srep.Err, "day %d: sweep", d)
			if srep.Actions[scheduler.ActionJobsPruned] < 5000 {
				break
			}
		}

		for _, tb := range tables {
			row.Rows[tb] = int64(testutil.Count(t, pool, `SELECT count(*) FROM `+tb))
		}
		row.Complete = testutil.Count(t, pool, `SELECT count(*) FROM jobs WHERE state = 'complete'`)
		row.Seconds = time.Since(dayBegan).Seconds()
		curve = append(curve, row)

		// No duplicate: one result per job, one side effect per event, ever.
		require.Zero(t, testutil.Count(t, pool, `SELECT count(*) FROM (SELECT job_key FROM results GROUP BY job_key HAVING count(*) > 1) d`), "day %d: a job with two results", d)
		require.Zero(t, testutil.Count(t, pool, `SELECT count(*) FROM (SELECT event_key FROM side_effects GROUP BY event_key HAVING count(*) > 1) d`), "day %d: an effect twice", d)
	}

	// The season's last day may have left its window as a gap: the check of the day after.
	if s.Days%gapCycle == 0 {
		c.set(c.Now().Add(8 * time.Hour))
		last := c.start.Add(time.Duration(s.Days) * day).Format("2006-01-02")
		gaps, err := sched.Gaps(ctx)
		require.NoError(t, err)
		require.Len(t, gaps, 1, "the last day's window is the one gap: %v", gaps)
		frep, err := sched.Fill(ctx, "daily", last)
		require.NoError(t, err)
		require.Equal(t, s.JobsPerDay, frep.Outcomes[tasks.Created.String()])
		require.NoError(t, waitTookEffect(ctx, t, pool, consumed, last, s.JobsPerDay))
	}
	printCurve(t, s, curve, time.Since(began))

	// Nothing lost: every job of every day took effect once.
	assert.Equal(t, s.Days*s.JobsPerDay, testutil.Count(t, pool, `SELECT count(DISTINCT event_key) FROM side_effects`))
	assert.Equal(t, s.Days*s.JobsPerDay, testutil.Count(t, pool, `SELECT count(*) FROM side_effects`))
	assert.Zero(t, testutil.Count(t, pool, `SELECT count(*) FROM jobs WHERE state <> 'complete'`), "every job complete")

	// Flat after the retention horizon: each table holds at most what the retention keeps
	// (its days and the day being swept, plus a filled gap's day), and nothing grows: the
	// last cycle of faults (gapCycle days) after the horizon holds no more than the first,
	// give or take a tenth of a day's rows. Redis's memory likewise.
	horizon := s.RetentionDays + 3
	require.GreaterOrEqual(t, len(curve), horizon+2*gapCycle, "the season must outlast its retention horizon by two cycles")
	after := curve[horizon:]
	third := gapCycle
	keep := int64((s.RetentionDays + 3) * s.JobsPerDay)
	bound := map[string]int64{"jobs": keep, "attempts": 2 * keep, "results": keep, "outbox": keep, "outbox_inbox": keep,
		"schedule_windows": int64(s.RetentionDays + 3), "quarantine": keep}
	peak := func(rows []dayRow, f func(dayRow) int64) int64 {
		var m int64
		for _, r := range rows {
			m = max(m, f(r))
		}
		return m
	}
	for _, tb := range tables {
		get := func(r dayRow) int64 { return r.Rows[tb] }
		assert.LessOrEqual(t, peak(after, get), bound[tb], "table %s holds more than its retention keeps", tb)
		early, late := peak(after[:third], get), peak(after[len(after)-third:], get)
		assert.LessOrEqual(t, late, early+int64(s.JobsPerDay/10)+1, "table %s grows after day %d: peak %d early, %d late", tb, horizon, early, late)
	}
	mem := func(r dayRow) int64 { return r.RedisMemory }
	early, late := peak(after[:third], mem), peak(after[len(after)-third:], mem)
	assert.LessOrEqual(t, float64(late), 1.3*float64(early)+float64(1<<20), "Redis memory grows after day %d: peak %d early, %d late", horizon, early, late)
	xlen := func(r dayRow) int64 { return r.StreamLen }
	// The cap runs with the trims (every TrimInterval), so between two the stream may pass
	// it by what was published meanwhile.
	capLen := int64(2 * max(s.JobsPerDay, outbox.DefaultDispatchBatchSize))
	assert.LessOrEqual(t, peak(curve, xlen), capLen+capLen/4, "the stream exceeds its cap by more than a trim interval's events")
}

// waitTookEffect waits until every job of the window (none: "") is complete and every
// outbox row is sent and has taken effect. It reads PostgreSQL once, then again on every
// batch the consumer handled (each complete job's event reaches it), and every 500 ms
// besides: the dispatcher marks a row sent after the stream has it, so the consumer's
// last batch may come before the last mark, and no batch follows it. Its bound, generous,
// names the counts and the load.
func waitTookEffect(ctx context.Context, t *testing.T, pool *pgxpool.Pool, consumed <-chan struct{}, window string, n int) error {
	t.Helper()
	deadline := time.NewTimer(5 * time.Minute)
	defer deadline.Stop()
	poll := time.NewTicker(500 * time.Millisecond)
	defer poll.Stop()
	for {
		var done, failed, unsent, missing int
		err := pool.QueryRow(ctx, `SELECT
			(SELECT count(*) FROM jobs WHERE "window" = $1 AND state = 'complete'),
			(SELECT count(*) FROM jobs WHERE "window" = $1 AND state = 'failed'),
			(SELECT count(*) FROM outbox_unsent),
			(SELECT count(*) FROM outbox o WHERE NOT EXISTS (SELECT 1 FROM side_effects e WHERE e.event_key = o.event_key))`,
			window).Scan(&done, &failed, &unsent, &missing)
		switch {
		case err != nil:
			return err
		case failed > 0:
			return fmt.Errorf("window %s: %d jobs failed", window, failed)
		case done == n && unsent == 0 && missing == 0:
			return nil
		}
		select {
		case <-consumed:
		case <-poll.C:
		case <-deadline.C:
			return fmt.Errorf("window %s: %d of %d jobs complete, %d outbox rows unsent, %d without their effect after 5 min (load %s)",
				window, done, n, unsent, missing, loadAvg())
		}
	}
}

func redisMemory(ctx context.Context, t *testing.T, rdb redis.UniversalClient) int64 {
	t.Helper()
	info, err := rdb.Info(ctx, "memory").Result()
	require.NoError(t, err)
	for _, l := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(l), "used_memory:"); ok {
			n, err := strconv.ParseInt(v, 10, 64)
			require.NoError(t, err)
			return n
		}
	}
	t.Fatal("INFO memory without used_memory")
	return 0
}

func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	return strings.Join(strings.Fields(string(b))[:3], " ")
}

// printCurve logs the season by day (every day of a short season, every fifth of a long
// one): docs/RELIABILITY.md quotes it.
func printCurve(t *testing.T, s season, curve []dayRow, took time.Duration) {
	var b strings.Builder
	fmt.Fprintf(&b, "season: %d days × %d jobs, job retention %d days, %v\n", s.Days, s.JobsPerDay, s.RetentionDays, took.Round(time.Second))
	fmt.Fprintf(&b, "%4s %8s %8s %8s %8s %8s %8s %6s %6s %10s %7s %5s\n", "day", "jobs", "attempts", "results", "outbox", "inbox", "windows", "quar.", "xlen", "redis_mem", "complete", "s")
	step := 1
	if len(curve) > 30 {
		step = 5
	}
	for i, r := range curve {
		if i%step != step-1 && i != 0 && i != len(curve)-1 {
			continue
		}
		fmt.Fprintf(&b, "%4d %8d %8d %8d %8d %8d %8d %6d %6d %10d %7d %5.1f\n", r.Day, r.Rows["jobs"], r.Rows["attempts"], r.Rows["results"],
			r.Rows["outbox"], r.Rows["outbox_inbox"], r.Rows["schedule_windows"], r.Rows["quarantine"], r.StreamLen, r.RedisMemory, r.Complete, r.Seconds)
	}
	t.Log("\n" + b.String())
}
