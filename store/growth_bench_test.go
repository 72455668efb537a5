package store_test

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// BenchmarkCostGrowth (issue 11 item 5): the enqueue statement (JobsRecord of 100 new
// jobs), an attempt start and a lone fenced commit, one after another, on an empty
// database and on one that already holds `rows` complete jobs, each with its attempt,
// result and sent outbox row (loaded with generate_series into the benchmark's own
// throwaway database). Reports the latency of each. Afterwards every distinct statement
// the three ran is EXPLAINed with the arguments it ran with, and on the loaded database a
// sequential scan of jobs, attempts, results or outbox fails the benchmark.
//
// IDEMSCRAPE_GROWTH_ROWS sets the preloaded sizes (comma-separated; default "0,1000000"):
// 5,000,000 takes about ten minutes to load on a 2-core box and ~6 GB of disk.
func BenchmarkCostGrowth(b *testing.B) {
	sizes := []int{0, 1_000_000}
	if env := os.Getenv("IDEMSCRAPE_GROWTH_ROWS"); env != "" {
		sizes = nil
		for _, f := range strings.Split(env, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n < 0 {
				b.Fatalf("IDEMSCRAPE_GROWTH_ROWS=%q: %q is not a row count", env, f)
			}
			sizes = append(sizes, n)
		}
	}
	for _, rows := range sizes {
		b.Run(fmt.Sprintf("rows=%d", rows), func(b *testing.B) { benchGrowth(b, rows) })
	}
}

func benchGrowth(b *testing.B, rows int) {
	ctx := context.Background()
	pool := testutil.PG(b)
	if rows > 0 {
		_, err := pool.Exec(ctx, `
WITH j AS (
	INSERT INTO jobs (key, kind, source_id, country, "window", parser_version, state, fence, attempts, completed_at)
	SELECT 'old:' || lpad(i::text, 8, '0'), 'page', 'old-' || i, 'US', '2026-04-23', 1, 'complete', 1, 1, now()
	FROM generate_series(1, $1) AS i
	RETURNING key
), a AS (
	INSERT INTO attempts (job_key, attempt_no, fence, worker, finished_at, http_status, outcome)
	SELECT key, 1, 1, 'w', now(), 200, 'complete' FROM j
), r AS (
	INSERT INTO results (observation_key, job_key, parser_version, data, fence)
	SELECT key, key, 1, '{"price":"19.99"}', 1 FROM j
)
INSERT INTO outbox (event_key, topic, payload)
SELECT 'observed:' || key, 'page', '{}' FROM j`, rows)
		if err != nil {
			b.Fatal(err)
		}
	}
	// Dispatched, as on a running system: the position passes every row.
	if _, err := pool.Exec(ctx, `INSERT INTO outbox_positions (topic, xid, id)
SELECT DISTINCT ON (topic) topic, xid, id FROM outbox ORDER BY topic, xid DESC, id DESC
ON CONFLICT (topic) DO UPDATE SET xid = excluded.xid, id = excluded.id`); err != nil {
		b.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `ANALYZE`); err != nil {
		b.Fatal(err)
	}
	cfg := pool.Config() // a copy: the same database and settings
	tracer := &statements{seen: map[string][]any{}}
	cfg.ConnConfig.Tracer = tracer
	traced, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer traced.Close()
	s := store.New(traced)

	const batch = 100
	var enqueue, startT, commit time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		recs := make([]tasks.JobRecord, batch)
		for j := range recs {
			key := fmt.Sprintf("new:%08d:%03d", i, j)
			recs[j] = tasks.JobRecord{Key: key, Spec: tasks.Spec{Kind: "page", SourceID: key, Country: "US", Window: "w", ParserVersion: 1}}
		}
		t0 := time.Now()
		if _, err := s.JobsRecord(ctx, recs); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		if _, err := s.JobStart(ctx, store.AttemptStartParams{Key: recs[0].Key, Token: 1, Worker: "w"}); err != nil {
			b.Fatal(err)
		}
		t2 := time.Now()
		if _, err := s.Commit(ctx, commitParams(recs[0].Key, 1)); err != nil {
			b.Fatal(err)
		}
		enqueue += t1.Sub(t0)
		startT += t2.Sub(t1)
		commit += time.Since(t2)
	}
	b.StopTimer()
	b.ReportMetric(enqueue.Seconds()*1e3/float64(b.N), "ms/enqueue100")
	b.ReportMetric(startT.Seconds()*1e3/float64(b.N), "ms/start")
	b.ReportMetric(commit.Seconds()*1e3/float64(b.N), "ms/commit")

	seqScan := regexp.MustCompile(`Seq Scan on (jobs|attempts|results|outbox)\b`)
	stmts := tracer.list()
	if len(stmts) < 3 {
		b.Fatalf("traced %d statements, want at least the enqueue, start and commit statements", len(stmts))
	}
	for _, q := range stmts {
		r, err := pool.Query(ctx, "EXPLAIN "+q.sql, q.args...)
		if err != nil {
			b.Fatalf("EXPLAIN %s: %v", q.sql, err)
		}
		var plan []string
		for r.Next() {
			var line string
			if err := r.Scan(&line); err != nil {
				b.Fatal(err)
			}
			plan = append(plan, line)
		}
		if err := r.Err(); err != nil {
			b.Fatalf("EXPLAIN %s: %v", q.sql, err)
		}
		text := strings.Join(plan, "\n")
		b.Logf("rows=%d EXPLAIN %s\n%s", rows, oneLine(q.sql), text)
		if rows > 0 && seqScan.MatchString(text) {
			b.Errorf("rows=%d: a hot statement scans a table sequentially:\n%s\n%s", rows, q.sql, text)
		}
	}
}

func oneLine(sql string) string {
	s := strings.Join(strings.Fields(sql), " ")
	if len(s) > 160 {
		s = s[:160] + "…"
	}
	return s
}

// statements records the first arguments of every distinct data statement a pool ran.
type statements struct {
	mu    sync.Mutex
	order []string
	seen  map[string][]any
}

type statement struct {
	sql  string
	args []any
}

func (t *statements) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	sql := strings.TrimSpace(data.SQL)
	head := strings.ToUpper(strings.SplitN(sql, " ", 2)[0])
	switch head {
	case "SELECT", "WITH", "INSERT", "UPDATE", "DELETE":
	default:
		return ctx // BEGIN, COMMIT, SET …
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, ok := t.seen[sql]; !ok {
		t.seen[sql] = data.Args
		t.order = append(t.order, sql)
	}
	return ctx
}

func (t *statements) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (t *statements) list() []statement {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]statement, len(t.order))
	for i, sql := range t.order {
		out[i] = statement{sql, t.seen[sql]}
	}
	return out
}
