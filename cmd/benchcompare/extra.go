package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/outbox"
	"github.com/idemscrape/idemscrape/tasks"
)

// benchPrefix is the Redis key prefix of ours in every mode.
const benchPrefix = "bench:"

// b2Factor: a lease cycle is cheap, so b2 runs b2Factor × N of them (N would be over in a
// few tens of milliseconds, too short to measure).
const b2Factor = 10

// runB2 measures the lease alone, b2Factor × N cycles from s.Conc goroutines, one job key
// each, after a warm-up (connections) on other keys: ours takes the lease as the runner
// does (lua.Leases.Take: SET NX PX GET, the holder read back when refused; the token comes
// from PostgreSQL's start, not measured here) and gives it up as the runner does after a
// commit (ReleaseCommitted: DEL of lease and counter); the peer takes a plain lock with
// SET NX PX and drops it with DEL.
func runB2(ctx context.Context, s runSpec, rdb *redis.Client, rrt *redisCounter, pgrt *pgCounter) (runResult, error) {
	keys := make([]string, s.N*b2Factor)
	for i := range keys {
		keys[i] = fmt.Sprintf("page:p-%d:US:w:v1", i)
	}
	warm := make([]string, 4*s.Conc)
	for i := range warm {
		warm[i] = fmt.Sprintf("warm-%d", i)
	}
	const ttl = 30 * time.Second
	var do func(ctx context.Context, key string) error
	if s.Side == "ours" {
		leases, err := lua.NewLeases(rdb, benchPrefix)
		if err != nil {
			return runResult{}, err
		}
		do = func(ctx context.Context, k string) error {
			l, err := leases.Take(ctx, k, "worker-1", ttl)
			if err != nil {
				return err
			}
			return leases.ReleaseCommitted(ctx, l)
		}
	} else {
		do = func(ctx context.Context, k string) error {
			ok, err := rdb.SetNX(ctx, benchPrefix+"lock:"+k, "worker-1", ttl).Result()
			if err != nil {
				return err
			}
			if !ok {
				return fmt.Errorf("b2 peer: %s already locked", k)
			}
			return rdb.Del(ctx, benchPrefix+"lock:"+k).Err()
		}
	}
	if err := parallel(ctx, s.Conc, warm, do); err != nil {
		return runResult{}, err
	}
	m := startMeasure(ctx, rdb, rrt, pgrt)
	if err := parallel(ctx, s.Conc, keys, do); err != nil {
		return runResult{}, err
	}
	return m.stop(ctx, len(keys)), nil
}

// runB4 measures dispatch. Throughput: b2Factor × N outbox rows committed before the
// clock starts;
// ours moves them to the stream with outbox.Dispatcher.DispatchOnce (claim, pipelined
// XADD, the position moved, commit, batches of outbox.DefaultDispatchBatchSize), the peer XADDs
// the same N entries in pipelines of the same size with nothing else. Then, ours only,
// the lag: N more jobs are committed through a store.GroupCommitter from s.Conc
// goroutines while a started dispatcher (LISTEN, woken by the committer's NOTIFY)
// publishes them; lag is from a commit's return to its entry being read from the stream.
func runB4(ctx context.Context, s runSpec, st *store.PG, pool *pgxpool.Pool, rdb *redis.Client, rrt *redisCounter, pgrt *pgCounter) (runResult, error) {
	const topic = "page"
	batch := outbox.DefaultDispatchBatchSize
	events := s.N * b2Factor
	if s.Side == "peer" {
		stream := outbox.StreamKey(benchPrefix, topic)
		created := time.Now().UTC().Format(time.RFC3339Nano)
		m := startMeasure(ctx, rdb, rrt, pgrt)
		for i := 0; i < events; i += batch {
			_, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
				for j := i; j < min(i+batch, events); j++ {
					p.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []any{
						outbox.FieldEventKey, "observed:" + strconv.Itoa(j), outbox.FieldTopic, topic,
						outbox.FieldPayload, `{"len":8192}`, outbox.FieldOutboxID, strconv.Itoa(j + 1),
						outbox.FieldCreatedAt, created,
					}})
				}
				return nil
			})
			if err != nil {
				return runResult{}, err
			}
		}
		res := m.stop(ctx, events)
		if n, err := rdb.XLen(ctx, stream).Result(); err != nil || n != int64(events) {
			return runResult{}, fmt.Errorf("b4 peer: stream holds %d entries, want %d (%v)", n, events, err)
		}
		return res, nil
	}

	if _, err := pool.Exec(ctx, `INSERT INTO outbox (event_key, topic, payload)
SELECT 'observed:' || g, $1, '{"len":8192}'::jsonb FROM generate_series(1, $2) AS g`, topic, events); err != nil {
		return runResult{}, err
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	d, err := outbox.NewDispatcher(pool, rdb, &outbox.DispatcherConfig{Prefix: benchPrefix, Logger: log, DisableNotify: true})
	if err != nil {
		return runResult{}, err
	}
	m := startMeasure(ctx, rdb, rrt, pgrt)
	for sent := 0; sent < events; {
		n, err := d.DispatchOnce(ctx)
		if err != nil {
			return runResult{}, err
		}
		if n == 0 {
			return runResult{}, fmt.Errorf("b4: dispatcher found nothing after %d of %d", sent, events)
		}
		sent += n
	}
	res := m.stop(ctx, events)

	p50, p99, rate, err := dispatchLag(ctx, s, st, rdb, log)
	if err != nil {
		return runResult{}, err
	}
	res.LagP50MS, res.LagP99MS, res.CommitsPerSec = p50, p99, rate
	return res, nil
}

// dispatchLag commits s.N jobs through a GroupCommitter from s.Conc goroutines with a
// listening dispatcher running, and returns the p50 and p99 of the time from each commit's
// return to its entry being read from the stream, and the commits per second.
func dispatchLag(ctx context.Context, s runSpec, st *store.PG, rdb *redis.Client, log *slog.Logger) (p50, p99, rate float64, err error) {
	const topic = "page"
	keys := make([]string, s.N)
	recs := make([]tasks.JobRecord, s.N)
	for i := range recs {
		keys[i] = fmt.Sprintf("page:lag-%d:US:w:v1", i)
		recs[i] = tasks.JobRecord{Key: keys[i], Spec: tasks.Spec{Kind: "page", SourceID: fmt.Sprintf("lag-%d", i), Country: "US", Window: "w", ParserVersion: 1}}
	}
	for i := 0; i < s.N; i += 1000 {
		if _, err := st.JobsRecord(ctx, recs[i:min(i+1000, s.N)]); err != nil {
			return 0, 0, 0, err
		}
	}
	g := st.NewGroupCommitter(0, 0)
	defer g.Close()
	if err := parallel(ctx, s.Conc, keys, func(ctx context.Context, k string) error {
		_, err := g.JobStart(ctx, store.AttemptStartParams{Key: k, Token: 1})
		return err
	}); err != nil {
		return 0, 0, 0, err
	}
	d, err := outbox.NewDispatcher(st.Pool(), rdb, &outbox.DispatcherConfig{Prefix: benchPrefix, Logger: log})
	if err != nil {
		return 0, 0, 0, err
	}
	if err := d.Start(ctx); err != nil {
		return 0, 0, 0, err
	}
	defer d.Stop()

	var mu sync.Mutex
	committed := make(map[string]time.Time, s.N)
	arrived := make(map[string]time.Time, s.N)
	stream := outbox.StreamKey(benchPrefix, topic)
	last, _ := rdb.XInfoStream(ctx, stream).Result()
	from := "0"
	if last != nil && last.LastGeneratedID != "" {
		from = last.LastGeneratedID
	}
	readCtx, stopRead := context.WithCancel(ctx)
	defer stopRead()
	readErr := make(chan error, 1)
	go func() {
		for {
			got, err := rdb.XRead(readCtx, &redis.XReadArgs{Streams: []string{stream, from}, Count: 1000, Block: time.Second}).Result()
			if errors.Is(err, redis.Nil) {
				continue
			}
			if err != nil {
				readErr <- err
				return
			}
			now := time.Now()
			mu.Lock()
			for _, st := range got {
				for _, msg := range st.Messages {
					from = msg.ID
					if k, ok := msg.Values[outbox.FieldEventKey].(string); ok {
						arrived[k] = now
					}
				}
			}
			n := len(arrived)
			mu.Unlock()
			if n >= s.N {
				readErr <- nil
				return
			}
		}
	}()
	start := time.Now()
	if err := parallel(ctx, s.Conc, keys, func(ctx context.Context, k string) error {
		_, err := g.Commit(ctx, store.CommitParams{Key: k, Token: 1, ObservationKey: k, ParserVersion: 1,
			Data: json.RawMessage(`{"len":8192}`), EventKey: handlers.EventKey(k), Topic: topic, EventPayload: json.RawMessage(`{}`), Bytes: 8400})
		t := time.Now()
		mu.Lock()
		committed[handlers.EventKey(k)] = t
		mu.Unlock()
		return err
	}); err != nil {
		return 0, 0, 0, err
	}
	rate = float64(s.N) / time.Since(start).Seconds()
	select {
	case err := <-readErr:
		if err != nil {
			return 0, 0, 0, fmt.Errorf("b4 lag: read stream: %w", err)
		}
	case <-time.After(2 * time.Minute):
		mu.Lock()
		defer mu.Unlock()
		return 0, 0, 0, fmt.Errorf("b4 lag: only %d of %d events reached the stream", len(arrived), s.N)
	}
	mu.Lock()
	defer mu.Unlock()
	lags := make([]float64, 0, s.N)
	for k, c := range committed {
		a, ok := arrived[k]
		if !ok {
			return 0, 0, 0, fmt.Errorf("b4 lag: %s never reached the stream", k)
		}
		lags = append(lags, max(0, a.Sub(c).Seconds()*1000))
	}
	slices.Sort(lags)
	return percentile(lags, 0.50), percentile(lags, 0.99), rate, nil
}

// percentile of sorted xs (nearest rank).
func percentile(xs []float64, q float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	i := int(q*float64(len(xs))+0.5) - 1
	return xs[min(max(i, 0), len(xs)-1)]
}

// runB6 measures Redis memory per pending job: N jobs enqueued and left pending; the
// used_memory delta of INFO memory over N. Ours: tasks.Enqueuer.EnqueueMany (the task
// carries the job key as its asynq task id and the spec as its payload). The peer: a bare
// asynq client.Enqueue per job of the same spec as JSON, asynq's defaults (random id).
func runB6(ctx context.Context, s runSpec, st *store.PG, rdb *redis.Client, rrt *redisCounter, pgrt *pgCounter) (runResult, error) {
	specs := make([]tasks.Spec, s.N)
	for i := range specs {
		specs[i] = tasks.Spec{Kind: "page", SourceID: fmt.Sprintf("p-%d", i), Country: "US", Window: "2026-04-23", ParserVersion: 1}
	}
	client := asynq.NewClientFromRedisClient(rdb)
	var enqueue func() error
	if s.Side == "ours" {
		enq, err := tasks.NewEnqueuer(client, st, &tasks.EnqueuerConfig{Queue: benchQueue})
		if err != nil {
			return runResult{}, err
		}
		enqueue = func() error {
			for rest := specs; len(rest) > 0; {
				b := rest[:min(500, len(rest))]
				rest = rest[len(b):]
				if _, err := enq.EnqueueMany(ctx, b); err != nil {
					return err
				}
			}
			return nil
		}
	} else {
		enqueue = func() error {
			return parallel(ctx, max(s.Conc, 1), indexes(s.N), func(ctx context.Context, i string) error {
				n, _ := strconv.Atoi(i)
				sp := specs[n]
				b, err := json.Marshal(struct {
					Kind, SourceID, Country, Window string
					ParserVersion                   int
				}{sp.Kind, sp.SourceID, sp.Country, sp.Window, sp.ParserVersion})
				if err != nil {
					return err
				}
				_, err = client.EnqueueContext(ctx, asynq.NewTask("page", b), asynq.Queue(benchQueue))
				return err
			})
		}
	}
	// One warm-up call creates the queue's bookkeeping keys on both sides, so the delta is
	// the jobs' own memory.
	before, err := usedMemory(ctx, rdb)
	if err != nil {
		return runResult{}, err
	}
	m := startMeasure(ctx, rdb, rrt, pgrt)
	if err := enqueue(); err != nil {
		return runResult{}, err
	}
	res := m.stop(ctx, s.N)
	after, err := usedMemory(ctx, rdb)
	if err != nil {
		return runResult{}, err
	}
	if n, err := rdb.LLen(ctx, "asynq:{"+benchQueue+"}:pending").Result(); err != nil || n != int64(s.N) {
		return runResult{}, fmt.Errorf("b6 %s: %d pending tasks, want %d (%v)", s.Side, n, s.N, err)
	}
	res.RedisBytesPerJob = float64(after-before) / float64(s.N)
	return res, nil
}

func indexes(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = strconv.Itoa(i)
	}
	return out
}

// usedMemory is INFO memory's used_memory.
func usedMemory(ctx context.Context, rdb *redis.Client) (int64, error) {
	info, err := rdb.Info(ctx, "memory").Result()
	if err != nil {
		return 0, err
	}
	sc := bufio.NewScanner(strings.NewReader(info))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(strings.TrimSpace(sc.Text()), "used_memory:"); ok {
			return strconv.ParseInt(v, 10, 64)
		}
	}
	return 0, errors.New("INFO memory has no used_memory")
}

// runB7 measures the fetch alone, from s.Conc goroutines, N fetches of the page through
// the proxy, each on a new sticky session (robots.txt off on both sides: B1 covers it).
// Ours: sessions.Provider.NewSession + sessions.NewCollector + Get + Close, as the runner
// does per attempt. The peer: b1's fetch (peerFetch), a new colly collector with the
// defaults per fetch and the session's credentials in the proxy URL (c.SetProxy).
func runB7(ctx context.Context, s runSpec, rdb *redis.Client, rrt *redisCounter, pgrt *pgCounter) (runResult, error) {
	var do func(ctx context.Context, _ string) error
	if s.Side == "ours" {
		prov, err := sessions.NewProvider("generic", s.ProxyAddr, "{user}[-country-{country}]-session-{session}", "{pass}", s.ProxyUser, s.ProxyPass, 0)
		if err != nil {
			return runResult{}, err
		}
		cfg := &sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), IgnoreRobotsTxt: true}
		do = func(ctx context.Context, _ string) error {
			sess, err := prov.NewSession("US", 0, time.Now())
			if err != nil {
				return err
			}
			b, err := sessions.NewCollector(ctx, sess, cfg)
			if err != nil {
				return err
			}
			defer b.Close()
			resp, err := b.Get(s.Page)
			if err == nil && len(resp.Body) == 0 {
				err = errors.New("b7: empty body")
			}
			return err
		}
	} else {
		do = func(context.Context, string) error {
			n, err := peerFetch(s.ProxyAddr, s.ProxyUser, s.ProxyPass, s.Page, false)
			if err == nil && n == 0 {
				err = errors.New("b7 peer: empty body")
			}
			return err
		}
	}
	m := startMeasure(ctx, rdb, rrt, pgrt)
	if err := parallel(ctx, s.Conc, indexes(s.N), do); err != nil {
		return runResult{}, err
	}
	return m.stop(ctx, s.N), nil
}

// printExtras prints the measures that are not throughput: the fetching modes' requests
// at the site per job, B4's dispatch lag and B6's bytes per pending job.
func printExtras(out io.Writer, rows []tableRow) {
	var site []string
	for _, r := range rows {
		if slices.Contains(fetchModes, r.mode) {
			page := func(x runResult) float64 { return x.SitePagePerJob }
			robots := func(x runResult) float64 { return x.SiteRobotsPerJob }
			site = append(site, fmt.Sprintf("%s c=%d ours %.2f + %.4f, peer %.2f + %.4f", r.mode, r.conc,
				median(col(r.ours, page)), median(col(r.ours, robots)), median(col(r.peer, page)), median(col(r.peer, robots))))
		}
	}
	if len(site) > 0 {
		fmt.Fprintf(out, "Site requests per job (page + robots.txt, medians): %s\n", strings.Join(site, "; "))
	}
	for _, r := range rows {
		switch r.mode {
		case "b4":
			fmt.Fprintf(out, "B4 dispatch lag c=%d (ours, commit return → stream read): p50 %.1f ms, p99 %.1f ms (median over %d runs; worst p99 %.1f ms) at %.0f commits/s; dispatch %.0f events/s = %.2f× the commit rate\n",
				r.conc, median(col(r.ours, func(x runResult) float64 { return x.LagP50MS })), median(col(r.ours, func(x runResult) float64 { return x.LagP99MS })),
				len(r.ours), slices.Max(col(r.ours, func(x runResult) float64 { return x.LagP99MS })),
				median(col(r.ours, func(x runResult) float64 { return x.CommitsPerSec })),
				median(col(r.ours, func(x runResult) float64 { return x.JobsPerSec })),
				median(col(r.ours, func(x runResult) float64 { return x.JobsPerSec }))/median(col(r.ours, func(x runResult) float64 { return x.CommitsPerSec })))
		case "b6":
			o := median(col(r.ours, func(x runResult) float64 { return x.RedisBytesPerJob }))
			p := median(col(r.peer, func(x runResult) float64 { return x.RedisBytesPerJob }))
			ratios := make([]float64, len(r.ours))
			for i := range r.ours {
				ratios[i] = r.ours[i].RedisBytesPerJob / r.peer[i].RedisBytesPerJob
			}
			fmt.Fprintf(out, "B6 Redis bytes per pending job: ours %.0f, peer (bare asynq) %.0f, ratio %.2f× (spread %.2f–%.2f)\n",
				o, p, o/p, slices.Min(ratios), slices.Max(ratios))
		}
	}
}
