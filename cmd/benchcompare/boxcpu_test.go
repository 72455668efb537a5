package main

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/testutil"
)

func TestBoxCPU(t *testing.T) {
	ctx := context.Background()

	t.Run("StatCPU", func(t *testing.T) {
		// utime (field 14) = 7, stime (field 15) = 5; the name holds spaces and a ')'.
		comm, ticks := statCPU([]byte("4242 (a b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 7 5 0 0 20 0 1 0 100 0 0\n"))
		assert.Equal(t, "a b) c", comm)
		assert.Equal(t, int64(12), ticks)
		_, ticks = statCPU([]byte("garbage"))
		assert.Zero(t, ticks)
	})

	t.Run("PidCPUReadsThisProcess", func(t *testing.T) {
		// Spend CPU until getrusage shows 50 ms more, then /proc must show some of it.
		before := pidCPU(os.Getpid())
		start := processCPU()
		x := 0
		for processCPU()-start < 50*time.Millisecond {
			for i := range 100000 {
				x += i
			}
		}
		_ = x
		assert.Greater(t, pidCPU(os.Getpid()), before)
		assert.Zero(t, pidCPU(-1), "an unreadable pid reads 0")
		assert.Zero(t, backendCPU(-1), "an unreadable pid reads 0")
	})

	t.Run("BackendCPUReadsASingleThreadedProcess", func(t *testing.T) {
		// A PostgreSQL backend of this test's own database: its CPU so far is more than
		// nothing (it authenticated and ran a query) and only grows.
		pool := testutil.PG(t)
		conn, err := pool.Acquire(ctx)
		require.NoError(t, err)
		defer conn.Release()
		var pid int
		require.NoError(t, conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
		before := backendCPU(pid)
		assert.Positive(t, before)
		_, err = conn.Exec(ctx, `SELECT count(*) FROM generate_series(1, 200000)`)
		require.NoError(t, err)
		assert.Greater(t, backendCPU(pid), before)
	})

	t.Run("BackendsOfTheRunsDatabase", func(t *testing.T) {
		pool := testutil.PG(t)
		old := boxPool
		boxPool = pool
		t.Cleanup(func() { boxPool = old })
		conn, err := pool.Acquire(ctx)
		require.NoError(t, err)
		var pid int
		require.NoError(t, conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
		conn.Release()
		assert.Contains(t, backendPIDs(ctx), pid, "the pool's idle backend is listed")
		var other int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname <> current_database() AND pid = ANY($1)`, backendPIDs(ctx)).Scan(&other))
		assert.Zero(t, other, "only the run's database's backends are listed")
	})

	t.Run("RedisServerPID", func(t *testing.T) {
		rs, err := startRedisServer(ctx)
		require.NoError(t, err)
		t.Cleanup(rs.stop)
		rdb := redis.NewClient(&redis.Options{Addr: rs.addr})
		t.Cleanup(func() { rdb.Close() })
		assert.Equal(t, rs.cmd.Process.Pid, redisPID(ctx, rdb))
	})

	t.Run("SinceCountsANewBackendWhole", func(t *testing.T) {
		s0 := boxSnap{worker: 1, proxySite: 2, redis: 3, pg: map[int]time.Duration{10: 100, 11: 50}}
		s1 := boxSnap{worker: 11, proxySite: 12, redis: 13, pg: map[int]time.Duration{10: 150, 12: 30}}
		assert.Equal(t, boxCPU{Worker: 10, ProxySite: 10, Redis: 10, PG: 50 + 30}, s1.since(s0))
	})
}
