package testutil

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisServer is a throwaway redis-server this test started on a free loopback port, for
// tests that flush, stop or restart Redis — never done to the shared server that parallel
// tests use. It keeps nothing on disk, so a restart loses every key, as a Redis without
// persistence does in production.
type RedisServer struct {
	Addr string
	port int
	dir  string
	cmd  *exec.Cmd
	t    testing.TB
}

// StartRedis starts a throwaway redis-server; it is stopped when the test ends.
func StartRedis(t testing.TB) *RedisServer {
	t.Helper()
	if _, err := exec.LookPath("redis-server"); err != nil {
		serviceDown(t, "redis-server binary", err)
	}
	s := &RedisServer{port: freePort(t), dir: t.TempDir(), t: t}
	s.Addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port))
	s.Start()
	t.Cleanup(s.Stop)
	return s
}

// Start starts the server (again) on its port.
func (s *RedisServer) Start() {
	s.t.Helper()
	s.cmd = exec.Command("redis-server",
		"--bind", "127.0.0.1", "--port", strconv.Itoa(s.port),
		"--save", "", "--appendonly", "no", "--dir", s.dir,
		"--logfile", filepath.Join(s.dir, "redis.log"))
	s.cmd.Stdout, s.cmd.Stderr = os.Stderr, os.Stderr
	if err := s.cmd.Start(); err != nil {
		s.t.Fatalf("testutil: start redis-server: %v", err)
	}
	c := redis.NewClient(&redis.Options{Addr: s.Addr})
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for c.Ping(context.Background()).Err() != nil {
		if time.Now().After(deadline) {
			s.t.Fatalf("testutil: redis-server on %s did not answer within 10s", s.Addr)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Stop kills the server (this test's own process, by pid) and waits for it to exit.
func (s *RedisServer) Stop() {
	if s.cmd == nil || s.cmd.Process == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
	s.cmd = nil
}

// Restart stops and starts the server: every key is gone afterwards.
func (s *RedisServer) Restart() {
	s.t.Helper()
	s.Stop()
	s.Start()
}

// Snapshot saves the server's data (SAVE) to a file of the test's own and returns its
// path, for RestoreSnapshot. The server keeps no dump file of its own: a Restart still
// loses every key.
func (s *RedisServer) Snapshot(name string) string {
	s.t.Helper()
	c := redis.NewClient(&redis.Options{Addr: s.Addr})
	defer c.Close()
	if err := c.Save(context.Background()).Err(); err != nil {
		s.t.Fatalf("testutil: SAVE on %s: %v", s.Addr, err)
	}
	path := filepath.Join(s.dir, "snapshot-"+name+".rdb")
	if err := os.Rename(filepath.Join(s.dir, "dump.rdb"), path); err != nil {
		s.t.Fatalf("testutil: keep the snapshot: %v", err)
	}
	return path
}

// RestoreSnapshot stops the server and starts it again from a Snapshot, as a Redis that
// came back from an older RDB file (or failed over to a replica that lagged) does: every
// key as it was then, whatever was written since is gone.
func (s *RedisServer) RestoreSnapshot(path string) {
	s.t.Helper()
	s.Stop()
	b, err := os.ReadFile(path)
	if err == nil {
		err = os.WriteFile(filepath.Join(s.dir, "dump.rdb"), b, 0o600)
	}
	if err != nil {
		s.t.Fatalf("testutil: restore snapshot %s: %v", path, err)
	}
	s.Start()
	if err := os.Remove(filepath.Join(s.dir, "dump.rdb")); err != nil {
		s.t.Fatalf("testutil: remove the restored dump file: %v", err)
	}
}

// Client returns a client for the server, closed when the test ends.
func (s *RedisServer) Client() *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: s.Addr, MaxRetries: -1})
	s.t.Cleanup(func() { _ = c.Close() })
	return c
}

func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("testutil: free port: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// String implements fmt.Stringer.
func (s *RedisServer) String() string { return fmt.Sprintf("redis-server %s", s.Addr) }
