package outbox_test

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	ptu "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store/outbox"
	"github.com/idemscrape/idemscrape/testutil"
)

// preparedServer starts a throwaway PostgreSQL server that allows prepared transactions
// (max_prepared_transactions is 0 by default, and the shared server is never
// reconfigured), with database idemscrape migrated, and returns it with a bundle on that
// database and the shared Redis.
func preparedServer(t *testing.T) (*testutil.PostgresServer, *bundle) {
	t.Helper()
	srv := testutil.StartPostgres(t)
	conn, err := pgx.Connect(context.Background(), srv.URL())
	require.NoError(t, err)
	_, err = conn.Exec(context.Background(), `ALTER SYSTEM SET max_prepared_transactions = 10`)
	require.NoError(t, err)
	require.NoError(t, conn.Close(context.Background()))
	srv.Restart()
	ns := testutil.Redis(t)
	b := &bundle{pool: srv.MigratedPool(t), rdb: ns.Client, prefix: ns.Prefix, reg: prometheus.NewRegistry(), log: testLogger()}
	return srv, b
}

// prepare runs stmts in a transaction on pool's database and prepares it as gid: the
// transaction stays in progress with no session holding it, as a 2PC coordinator that
// crashed leaves it. It is rolled back when the test ends, if nobody ended it before.
func prepare(t *testing.T, pool *pgxpool.Pool, gid string, stmts ...string) {
	t.Helper()
	ctx := context.Background()
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), `ROLLBACK PREPARED '`+gid+`'`)
		require.Zero(t, count(t, pool, `SELECT count(*) FROM pg_prepared_xacts WHERE gid = $1`, gid))
	})
	for _, s := range append(append([]string{"BEGIN"}, stmts...), "PREPARE TRANSACTION '"+gid+"'") {
		_, err := conn.Exec(ctx, s)
		require.NoError(t, err, s)
	}
	require.Equal(t, 1, count(t, pool, `SELECT count(*) FROM pg_prepared_xacts WHERE gid = $1`, gid))
}

// TestPreparedXactOtherDB: a prepared transaction forgotten in another database of the
// server holds back the cluster's oldest running transaction id, but cannot insert a row
// into this database's outbox: it does not hold this database's dispatch back, and it is
// not reported as holding the horizon.
func TestPreparedXactOtherDB(t *testing.T) {
	const topic = "t"
	srv, b := preparedServer(t)
	srv.CreateDatabase(t, "other")
	other := srv.Pool(t, "other")
	exec(t, other, `CREATE TABLE side (n int)`)
	prepare(t, other, "forgotten-other", `INSERT INTO side VALUES (1)`)

	d := b.dispatcher(t, outbox.DispatcherConfig{Trim: outbox.TrimNever})
	insertEvents(t, b.pool, topic, 1, 1) // committed after the prepared transaction took its id
	require.Equal(t, 1, drain(t, d), "the event is dispatched while the other database's transaction is prepared")
	require.Equal(t, []string{"ev:1"}, streamKeys(t, b, topic))
	require.Zero(t, count(t, b.pool, `SELECT count(*) FROM outbox_unsent`))

	// Not reported either: it holds nothing of this database back.
	d2, batches, logs := alertDispatcher(t, b)
	runChecks(t, d2, batches, 2)
	require.Zero(t, ptu.ToFloat64(d2.Metrics().HeldByPrepared.WithLabelValues("idemscrape")))
	require.Empty(t, logs.lines(t, preparedMsg))
}

// logBuffer collects JSON log lines; safe for the dispatcher's goroutines.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

// lines returns the records whose message starts with msg.
func (l *logBuffer) lines(t *testing.T, msg string) []map[string]any {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(l.buf.String()), "\n") {
		if line == "" {
			continue
		}
		var rec map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &rec), line)
		if s, _ := rec["msg"].(string); strings.HasPrefix(s, msg) {
			out = append(out, rec)
		}
	}
	return out
}

const preparedMsg = "outbox: a prepared transaction holds every topic's dispatch back"

// runChecks starts d's background loop and returns after it ran n batches, then stops it.
// The loop tries a check of pg_prepared_xacts after each batch and runs it when the last
// one is a PollInterval old (PreparedAlertAge/4 is shorter here); between two tries it
// waits at least 90 % of a PollInterval (the jitter), so of two tries two apart at least
// one is due, and the first try of a dispatcher's first run is. With n = 4 (three tries
// that surely finished) at least one check runs, and at least two in the first run.
func runChecks(t *testing.T, d *outbox.Dispatcher, batches <-chan struct{}, n int) {
	t.Helper()
	for len(batches) > 0 { // signals of an earlier run
		<-batches
	}
	require.NoError(t, d.Start(context.Background()))
	for range n {
		<-batches
	}
	d.Stop()
}

// alertDispatcher is a dispatcher whose loop checks for prepared transactions after every
// batch (PreparedAlertAge 1 ns) and signals each batch on the returned channel; it logs to
// the returned buffer.
func alertDispatcher(t *testing.T, b *bundle) (*outbox.Dispatcher, <-chan struct{}, *logBuffer) {
	t.Helper()
	logs := &logBuffer{}
	b.log = slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	batches := make(chan struct{}, 64)
	d := b.dispatcher(t, outbox.DispatcherConfig{
		Trim:             outbox.TrimNever,
		PollInterval:     5 * time.Millisecond,
		DisableNotify:    true,
		PreparedAlertAge: time.Nanosecond,
		OnBatch: func(int, error) {
			select {
			case batches <- struct{}{}:
			default:
			}
		},
	})
	return d, batches, logs
}

// TestPreparedXactThisDB: a transaction prepared in this database holds every topic's
// dispatch back, as it must: it inserted an outbox row that COMMIT PREPARED makes visible
// with its own, smaller id, which a position moved past the later commit would leave behind
// for ever. The dispatcher reports it (idemscrape_outbox_horizon_held_by_prepared and one
// WARN line naming the gid, the database and the age, not one per check); once it is
// committed both rows go, its own first, and the gauge falls back to 0.
func TestPreparedXactThisDB(t *testing.T) {
	const topic, gid = "t", "forgotten-here"
	_, b := preparedServer(t)
	d, batches, logs := alertDispatcher(t, b)
	held := d.Metrics().HeldByPrepared.WithLabelValues("idemscrape")

	prepare(t, b.pool, gid, `INSERT INTO outbox (event_key, topic, payload) VALUES ('prepared', '`+topic+`', '{}')`)
	insertEvents(t, b.pool, topic, 1, 1) // committed after the prepared transaction took its id
	require.Zero(t, drain(t, d), "held back by the transaction prepared in this database")

	runChecks(t, d, batches, 4) // at least two checks: see runChecks
	require.Equal(t, 1.0, ptu.ToFloat64(held))
	recs := logs.lines(t, preparedMsg)
	require.Len(t, recs, 1, "one line, not one per check")
	require.Equal(t, "WARN", recs[0]["level"])
	require.Equal(t, gid, recs[0]["gid"])
	require.Equal(t, "idemscrape", recs[0]["database"])
	require.Contains(t, recs[0], "age")
	require.Contains(t, recs[0]["msg"], "ROLLBACK PREPARED")
	require.Empty(t, streamKeys(t, b, topic), "nothing went while it was prepared")

	exec(t, b.pool, `COMMIT PREPARED '`+gid+`'`)
	require.Equal(t, 2, drain(t, d))
	require.Equal(t, []string{"prepared", "ev:1"}, streamKeys(t, b, topic), "in (xid, id) order: the prepared one's id is the older")
	require.Zero(t, count(t, b.pool, `SELECT count(*) FROM outbox_unsent`))

	runChecks(t, d, batches, 4)
	require.Zero(t, ptu.ToFloat64(held), "no prepared transaction left")
	require.Len(t, logs.lines(t, preparedMsg), 1)
}
