package main

import (
	"bytes"
	"context"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

// Whole-box CPU per job: the CPU time of every process that does a run's work, read over
// the child's measured phase (the same window as its other figures), so that a side that
// moves work out of the worker — into PostgreSQL, Redis or the network — is charged for it:
//
//   - worker: the child process itself (getrusage, user + sys, as the "CPU µs/job" column);
//   - PostgreSQL: the backends of the run's own database — the pids pg_stat_activity lists
//     for it at the start and at the end, each read from /proc/<pid>/schedstat (time on a
//     CPU in ns: a backend is one thread, and at c = 200 the 10 ms ticks of
//     /proc/<pid>/stat, 200 backends of them, would blur a run's few seconds of PostgreSQL
//     CPU); a backend first seen at the end counts whole, its connection's start included
//     (both sides' pools open connections as their concurrency needs them, so both pay it;
//     it weighs less the larger N is). Server-wide processes (WAL writer,
//     checkpointer, autovacuum) are left out: on a shared box they also work for others.
//     The "PG CPU" column (postgresCPU) adds them to the run's backends;
//   - Redis: the run's own redis-server (its pid from INFO server), from /proc;
//   - proxy and site: they run in the parent process (testutil.FakeProxy and FakeSite),
//     which does nothing else while a child runs: the parent's /proc/<ppid>/stat.
//
// The worker, redis-server and parent are read from /proc/<pid>/stat (utime + stime, every
// thread, in 10 ms ticks: one read error of a tick per process), so a run should last a few
// seconds; where /proc is not readable a part reads 0.

// boxPool is the child's pool, through which the run's backends are listed; set by runChild.
var boxPool *pgxpool.Pool

// boxSnap is the CPU so far of the processes of a run, per part.
type boxSnap struct {
	worker, proxySite, redis time.Duration
	pg                       map[int]time.Duration // backend pid → CPU so far
}

// boxCPU is the whole-box CPU of a measured phase, per part.
type boxCPU struct {
	Worker, PG, Redis, ProxySite time.Duration
}

func takeBoxSnap(ctx context.Context, rdb *redis.Client) boxSnap {
	s := boxSnap{worker: processCPU(), proxySite: pidCPU(os.Getppid()), pg: map[int]time.Duration{}}
	if pid := redisPID(ctx, rdb); pid > 0 {
		s.redis = pidCPU(pid)
	}
	for _, pid := range backendPIDs(ctx) {
		s.pg[pid] = backendCPU(pid)
	}
	return s
}

// since is the CPU spent from s0 to s.
func (s boxSnap) since(s0 boxSnap) boxCPU {
	b := boxCPU{Worker: s.worker - s0.worker, ProxySite: s.proxySite - s0.proxySite, Redis: s.redis - s0.redis}
	for pid, cpu := range s.pg {
		b.PG += cpu - s0.pg[pid] // a backend started during the phase counts whole
	}
	return b
}

// backendPIDs are the pids of the PostgreSQL backends connected to the run's database.
func backendPIDs(ctx context.Context) []int {
	if boxPool == nil {
		return nil
	}
	rows, err := boxPool.Query(ctx, `SELECT pid FROM pg_stat_activity WHERE datname = current_database()`)
	if err != nil {
		return nil
	}
	defer rows.Close()
	var pids []int
	for rows.Next() {
		var pid int
		if rows.Scan(&pid) == nil {
			pids = append(pids, pid)
		}
	}
	return pids
}

// redisPID is the pid of the run's redis-server (INFO server process_id), 0 if unknown.
func redisPID(ctx context.Context, rdb *redis.Client) int {
	info, err := rdb.Info(ctx, "server").Result()
	if err != nil {
		return 0
	}
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "process_id:"); ok {
			pid, _ := strconv.Atoi(v)
			return pid
		}
	}
	return 0
}

// pidCPU is the user + system CPU time so far of process pid, from /proc/<pid>/stat at
// clock-tick resolution; 0 if it is not readable.
func pidCPU(pid int) time.Duration {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0
	}
	_, ticks := statCPU(b)
	return time.Duration(ticks) * (time.Second / 100) // USER_HZ is 100 on Linux
}

// backendCPU is the time on a CPU so far of the single-threaded process pid (a PostgreSQL
// backend), from /proc/<pid>/schedstat in nanoseconds; /proc/<pid>/stat where schedstat is
// missing; 0 if neither is readable.
func backendCPU(pid int) time.Duration {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/schedstat")
	if err != nil {
		return pidCPU(pid)
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return pidCPU(pid)
	}
	ns, err := strconv.ParseInt(f[0], 10, 64)
	if err != nil {
		return pidCPU(pid)
	}
	return time.Duration(ns)
}

// statCPU parses a /proc/<pid>/stat line: the command name and utime + stime in ticks
// (fields 14 and 15; the name, in parentheses, may hold spaces).
func statCPU(b []byte) (comm string, ticks int64) {
	open, end := bytes.IndexByte(b, '('), bytes.LastIndexByte(b, ')')
	if open < 0 || end < open {
		return "", 0
	}
	f := bytes.Fields(b[end+1:])
	if len(f) < 13 {
		return string(b[open+1 : end]), 0
	}
	u, _ := strconv.ParseInt(string(f[11]), 10, 64)
	st, _ := strconv.ParseInt(string(f[12]), 10, 64)
	return string(b[open+1 : end]), u + st
}
