package testutil

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
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
	args []string // extra redis-server arguments (StartRedisWith)
	// TLS is the CA and certificates of a server started with RedisOptions.TLS (nil
	// otherwise): it then listens for TLS only, on Addr.
	TLS      *TestCA
	password string // RedisOptions.Password: for the server's own readiness check
}

// RedisOptions configure StartRedisWith.
type RedisOptions struct {
	// Password is the default user's password (requirepass).
	Password string
	// ACL lines (redis.conf "user" directives without the word user), e.g.
	// "app on >secret ~app:* +@all".
	ACL []string
	// TLS: listen for TLS only (tls-port), with a certificate of a CA the test made
	// (RedisServer.TLS); client certificates are not required.
	TLS bool
}

// StartRedis starts a throwaway redis-server; it is stopped when the test ends.
func StartRedis(t testing.TB) *RedisServer {
	t.Helper()
	return StartRedisWith(t, RedisOptions{})
}

// StartRedisWith starts a throwaway redis-server with a password, ACL users or TLS.
func StartRedisWith(t testing.TB, o RedisOptions) *RedisServer {
	t.Helper()
	if _, err := exec.LookPath("redis-server"); err != nil {
		serviceDown(t, "redis-server binary", err)
	}
	s := &RedisServer{port: freePort(t), dir: t.TempDir(), t: t, password: o.Password}
	s.Addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port))
	if o.Password != "" {
		s.args = append(s.args, "--requirepass", o.Password)
	}
	if len(o.ACL) > 0 {
		acl := filepath.Join(s.dir, "users.acl")
		var lines []string
		for _, l := range o.ACL {
			lines = append(lines, "user "+l)
		}
		if o.Password != "" {
			lines = append(lines, "user default on >"+o.Password+" ~* &* +@all")
		} else {
			lines = append(lines, "user default on nopass ~* &* +@all")
		}
		if err := os.WriteFile(acl, []byte(strings.Join(lines, "\n")+"\n"), 0o600); err != nil {
			t.Fatalf("testutil: write ACL file: %v", err)
		}
		s.args = append(s.args, "--aclfile", acl)
		s.args = slicesWithout(s.args, "--requirepass", o.Password) // the ACL file sets it
	}
	if o.TLS {
		s.TLS = NewTestCA(t)
		s.args = append(s.args, "--tls-port", strconv.Itoa(s.port), "--tls-cert-file", s.TLS.CertFile,
			"--tls-key-file", s.TLS.KeyFile, "--tls-ca-cert-file", s.TLS.CAFile, "--tls-auth-clients", "no")
	}
	s.Start()
	t.Cleanup(s.Stop)
	return s
}

// slicesWithout returns args without the pair (flag, value).
func slicesWithout(args []string, flag, value string) []string {
	var out []string
	for i := 0; i < len(args); i++ {
		if args[i] == flag && i+1 < len(args) && args[i+1] == value {
			i++
			continue
		}
		out = append(out, args[i])
	}
	return out
}

// Start starts the server (again) on its port.
func (s *RedisServer) Start() {
	s.t.Helper()
	port := strconv.Itoa(s.port)
	if s.TLS != nil {
		port = "0" // TLS only, on tls-port
	}
	args := append([]string{"--bind", "127.0.0.1", "--port", port,
		"--save", "", "--appendonly", "no", "--dir", s.dir,
		"--logfile", filepath.Join(s.dir, "redis.log")}, s.args...)
	s.cmd = exec.Command("redis-server", args...)
	s.cmd.Stdout, s.cmd.Stderr = os.Stderr, os.Stderr
	if err := s.cmd.Start(); err != nil {
		s.t.Fatalf("testutil: start redis-server: %v", err)
	}
	c := redis.NewClient(s.options())
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
	c := redis.NewClient(s.options())
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

// options are a client's options for the server as the default user.
func (s *RedisServer) options() *redis.Options {
	o := &redis.Options{Addr: s.Addr, Password: s.password}
	if s.TLS != nil {
		pem, err := os.ReadFile(s.TLS.CAFile)
		if err != nil {
			s.t.Fatalf("testutil: read CA: %v", err)
		}
		pool := x509.NewCertPool()
		pool.AppendCertsFromPEM(pem)
		o.TLSConfig = &tls.Config{RootCAs: pool, ServerName: "127.0.0.1", MinVersion: tls.VersionTLS12}
	}
	return o
}

// Client returns a client for the server (as the default user), closed when the test ends.
func (s *RedisServer) Client() *redis.Client {
	o := s.options()
	o.MaxRetries = -1
	c := redis.NewClient(o)
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
