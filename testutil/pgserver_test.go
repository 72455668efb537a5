package testutil

import (
	"context"
	"net/url"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestStartPostgres(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	srv := StartPostgres(t)

	connect := func(t *testing.T, dsn string) *pgx.Conn {
		t.Helper()
		conn, err := pgx.Connect(ctx, dsn)
		require.NoError(t, err)
		t.Cleanup(func() { _ = conn.Close(context.Background()) })
		return conn
	}
	show := func(t *testing.T, conn *pgx.Conn, setting string) string {
		t.Helper()
		var v string
		require.NoError(t, conn.QueryRow(ctx, "SHOW "+setting).Scan(&v))
		return v
	}

	t.Run("ConfiguredForDurabilityOnLoopback", func(t *testing.T) {
		conn := connect(t, srv.URL())
		assert.Equal(t, "on", show(t, conn, "fsync"))
		assert.Equal(t, "on", show(t, conn, "synchronous_commit"))
		assert.Equal(t, "on", show(t, conn, "full_page_writes"))
		assert.Equal(t, "127.0.0.1", show(t, conn, "listen_addresses"))
		assert.Equal(t, srv.Dir, show(t, conn, "unix_socket_directories"))
		assert.Equal(t, strconv.Itoa(srv.Port), show(t, conn, "port"))
		var dataDir string
		require.NoError(t, conn.QueryRow(ctx, `SELECT current_setting('data_directory')`).Scan(&dataDir))
		assert.Equal(t, srv.dataDir(), dataDir)
	})

	t.Run("SeparateFromSharedServer", func(t *testing.T) {
		shared, err := url.Parse(PGAdminDSN())
		require.NoError(t, err)
		own, err := url.Parse(srv.URL())
		require.NoError(t, err)
		assert.NotEqual(t, shared.Host, own.Host, "the throwaway server must not be the shared one")

		sharedConn := connect(t, PGAdminDSN())
		ownConn := connect(t, srv.URL())
		var sharedID, ownID string
		q := `SELECT system_identifier::text FROM pg_control_system()`
		require.NoError(t, sharedConn.QueryRow(ctx, q).Scan(&sharedID))
		require.NoError(t, ownConn.QueryRow(ctx, q).Scan(&ownID))
		assert.NotEqual(t, sharedID, ownID, "same cluster as the shared server")
	})

	t.Run("CommittedRowSurvivesCrash", func(t *testing.T) {
		srv.CreateDatabase(t, "crash")
		pool := srv.Pool(t, "crash")
		_, err := pool.Exec(ctx, `CREATE TABLE kept (id int PRIMARY KEY)`)
		require.NoError(t, err)
		_, err = pool.Exec(ctx, `INSERT INTO kept VALUES (1)`)
		require.NoError(t, err)
		// Sharing the server's lifecycle with a second session that holds an open, unfinished
		// transaction: a crash must roll it back, not half-apply it.
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		_, err = tx.Exec(ctx, `INSERT INTO kept VALUES (2)`)
		require.NoError(t, err)

		srv.Crash()
		require.False(t, srv.Running())
		assert.Error(t, pool.Ping(ctx), "the server is down")
		shared := connect(t, PGAdminDSN())
		assert.NoError(t, shared.Ping(ctx), "crashing the throwaway server touched the shared one")
		_ = tx.Rollback(context.Background()) // its connection is gone

		srv.Start()
		pool.Reset()
		var ids []int
		rows, err := pool.Query(ctx, `SELECT id FROM kept ORDER BY id`)
		require.NoError(t, err)
		ids, err = pgx.CollectRows(rows, pgx.RowTo[int])
		require.NoError(t, err)
		assert.Equal(t, []int{1}, ids)
		log, err := os.ReadFile(srv.LogPath())
		require.NoError(t, err)
		assert.Contains(t, string(log), "not properly shut down", "Crash must force crash recovery")
	})

	t.Run("StopAndStartKeepData", func(t *testing.T) {
		srv.CreateDatabase(t, "stopstart")
		pool := srv.Pool(t, "stopstart")
		_, err := pool.Exec(ctx, `CREATE TABLE kept AS SELECT 7 AS v`)
		require.NoError(t, err)
		srv.Restart()
		pool.Reset()
		var v int
		require.NoError(t, pool.QueryRow(ctx, `SELECT v FROM kept`).Scan(&v))
		assert.Equal(t, 7, v)
		srv.Stop()
		srv.Stop() // no-op
		srv.Start()
	})

	t.Run("MigrationsApply", func(t *testing.T) {
		pool := srv.MigratedPool(t)
		var n int
		require.NoError(t, pool.QueryRow(ctx,
			`SELECT count(*) FROM information_schema.tables WHERE table_name IN ('jobs', 'outbox')`).Scan(&n))
		assert.Equal(t, 2, n)
	})
}

// TestStartPostgresCleanup proves the server dies and its directory goes when the test ends.
func TestStartPostgresCleanup(t *testing.T) {
	var srv *PostgresServer
	t.Run("Inner", func(t *testing.T) {
		srv = StartPostgres(t)
		require.True(t, srv.Running())
	})
	assert.False(t, srv.Running())
	_, err := os.Stat(srv.Dir)
	assert.True(t, os.IsNotExist(err), "dir %s left behind: %v", srv.Dir, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = pgx.Connect(ctx, srv.URL())
	assert.Error(t, err, "server still answers after cleanup")
}
