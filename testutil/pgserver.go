package testutil

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemscrape/idemscrape/store"
)

// pgStartTimeout bounds how long Start waits for the server to accept connections; crash
// recovery on a busy 2-core box is included.
const pgStartTimeout = 60 * time.Second

// PostgresServer is a throwaway PostgreSQL server this test started (initdb + postgres) on a
// free loopback port in a temporary directory, for tests that crash, stop or restart
// PostgreSQL — never done to the shared server that parallel tests use.
//
// It listens on 127.0.0.1 only (its unix socket lives in its own directory), trusts every
// local connection (user postgres, no password) and runs with fsync, full_page_writes and
// synchronous_commit on, so what survives Crash is what a real server keeps: a transaction
// whose commit was acknowledged with synchronous_commit on survives, one committed with
// synchronous_commit off may be lost, none is half-applied.
//
// When the test process runs as root (initdb and postgres refuse to), both run as the
// `postgres` OS user, which then owns the directory. The server is the test's own child
// process and is killed if the test binary dies; t.Cleanup stops it and removes the directory.
type PostgresServer struct {
	// Port is the TCP port on 127.0.0.1; it stays the same across Stop/Crash and Start.
	Port int
	// Dir holds the data directory (Dir/data), the unix socket and the server log
	// (Dir/postgres.log).
	Dir string

	t    testing.TB
	bin  string
	cred *syscall.Credential // nil unless we run as root

	mu     sync.Mutex
	cmd    *exec.Cmd
	exited chan struct{} // closed when cmd has been waited for
	log    *os.File
}

// StartPostgres initialises a fresh cluster and starts it; the server is stopped and its
// directory removed when the test ends. A missing PostgreSQL installation fails the test.
func StartPostgres(t testing.TB) *PostgresServer {
	t.Helper()
	bin, err := pgBinDir()
	if err != nil {
		serviceDown(t, "PostgreSQL server binaries", err)
	}
	s := &PostgresServer{Port: freePort(t), t: t, bin: bin}
	if os.Geteuid() == 0 {
		s.cred, err = pgCredential()
		if err != nil {
			t.Fatalf("testutil: running as root, PostgreSQL needs another OS user: %v", err)
		}
	}
	// Not t.TempDir: its parents are private to root, and the postgres user must reach this
	// one. Short, too: a unix socket path is limited to ~107 bytes.
	s.Dir, err = os.MkdirTemp("", "idemscrape-pg-")
	if err != nil {
		t.Fatalf("testutil: temp dir for PostgreSQL: %v", err)
	}
	t.Cleanup(func() {
		s.kill()
		if err := os.RemoveAll(s.Dir); err != nil {
			t.Errorf("testutil: remove %s: %v", s.Dir, err)
		}
	})
	if s.cred != nil {
		if err := os.Chown(s.Dir, int(s.cred.Uid), int(s.cred.Gid)); err != nil {
			t.Fatalf("testutil: chown %s to postgres: %v", s.Dir, err)
		}
	}
	s.initdb()
	s.Start()
	return s
}

// pgBinDir finds the directory holding initdb and postgres: $IDEMSCRAPE_PG_BIN, then the
// newest /usr/lib/postgresql/<version>/bin, then the one of `pg_config --bindir`, then PATH.
func pgBinDir() (string, error) {
	if d := os.Getenv("IDEMSCRAPE_PG_BIN"); d != "" {
		return d, nil
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return pgVersionOf(dirs[i]) > pgVersionOf(dirs[j]) })
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d, nil
		}
	}
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		d := strings.TrimSpace(string(out))
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d, nil
		}
	}
	p, err := exec.LookPath("initdb")
	if err != nil {
		return "", errors.New("initdb not found under /usr/lib/postgresql/*/bin, pg_config --bindir or PATH (set IDEMSCRAPE_PG_BIN)")
	}
	return filepath.Dir(p), nil
}

// pgVersionOf returns the major version in /usr/lib/postgresql/<version>/bin, 0 if none.
func pgVersionOf(binDir string) int {
	v, _ := strconv.Atoi(filepath.Base(filepath.Dir(binDir)))
	return v
}

func pgCredential() (*syscall.Credential, error) {
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, err
	}
	uid, err := strconv.ParseUint(u.Uid, 10, 32)
	if err != nil {
		return nil, err
	}
	gid, err := strconv.ParseUint(u.Gid, 10, 32)
	if err != nil {
		return nil, err
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), NoSetGroups: true}, nil
}

func (s *PostgresServer) command(name string, args ...string) *exec.Cmd {
	cmd := exec.Command(filepath.Join(s.bin, name), args...)
	cmd.Dir = s.Dir
	// Only what the server needs: no PG* variable of the caller leaks in.
	cmd.Env = []string{"PATH=" + s.bin + ":/usr/bin:/bin", "LC_ALL=C", "HOME=" + s.Dir, "TZ=UTC"}
	// Pdeathsig: if the test binary dies (timeout panic, kill), the postmaster gets SIGKILL
	// and its backends exit on their own, so no server outlives its test.
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: s.cred, Pdeathsig: syscall.SIGKILL}
	return cmd
}

func (s *PostgresServer) initdb() {
	s.t.Helper()
	cmd := s.command("initdb", "-D", s.dataDir(), "-U", "postgres", "-A", "trust",
		"-E", "UTF8", "--no-locale")
	out, err := cmd.CombinedOutput()
	if err != nil {
		s.t.Fatalf("testutil: initdb: %v\n%s", err, out)
	}
}

func (s *PostgresServer) dataDir() string { return filepath.Join(s.Dir, "data") }

// LogPath is the server's log file (appended to across restarts).
func (s *PostgresServer) LogPath() string { return filepath.Join(s.Dir, "postgres.log") }

// URL is a libpq URL for the database `postgres` as user postgres over TCP.
func (s *PostgresServer) URL() string { return s.DSN("postgres") }

// DSN is a libpq URL for database dbname as user postgres over TCP.
func (s *PostgresServer) DSN(dbname string) string {
	u := url.URL{
		Scheme:   "postgres",
		User:     url.User("postgres"),
		Host:     net.JoinHostPort("127.0.0.1", strconv.Itoa(s.Port)),
		Path:     "/" + dbname,
		RawQuery: "sslmode=disable&connect_timeout=5",
	}
	return u.String()
}

// Start starts the server on its data directory and port (again, after Stop or Crash; after
// Crash it runs WAL recovery first) and waits until it accepts connections. It fails the test
// if the server does not come up within a minute, quoting the log's tail.
func (s *PostgresServer) Start() {
	s.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd != nil {
		s.t.Fatalf("testutil: %v already running", s)
	}
	logf, err := os.OpenFile(s.LogPath(), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		s.t.Fatalf("testutil: open PostgreSQL log: %v", err)
	}
	cmd := s.command("postgres", "-D", s.dataDir(),
		"-p", strconv.Itoa(s.Port),
		"-c", "listen_addresses=127.0.0.1",
		"-c", "unix_socket_directories="+s.Dir,
		"-c", "fsync=on",
		"-c", "synchronous_commit=on",
		"-c", "full_page_writes=on",
		"-c", "max_connections=60",
		"-c", "shared_buffers=32MB",
		"-c", "logging_collector=off",
		"-c", "log_min_messages=warning",
	)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		logf.Close()
		s.t.Fatalf("testutil: start postgres: %v", err)
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()
	s.cmd, s.exited, s.log = cmd, exited, logf

	deadline := time.Now().Add(pgStartTimeout)
	for {
		err := s.ping()
		if err == nil {
			return
		}
		select {
		case <-exited:
			s.cmd = nil
			s.log.Close()
			s.t.Fatalf("testutil: postgres on port %d exited at start: %v\n%s", s.Port, err, s.logTail())
		default:
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("testutil: postgres on port %d did not accept connections within %v: %v\n%s",
				s.Port, pgStartTimeout, err, s.logTail())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (s *PostgresServer) ping() error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.URL())
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	return conn.Ping(ctx)
}

func (s *PostgresServer) logTail() string {
	b, _ := os.ReadFile(s.LogPath())
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}

// Stop shuts the server down fast (as `pg_ctl stop -m fast`: SIGINT, open transactions
// rolled back, a checkpoint written) and waits for it to exit. No-op when not running.
func (s *PostgresServer) Stop() { s.signal(syscall.SIGINT) }

// Crash stops the server as `pg_ctl stop -m immediate` does (SIGQUIT): no checkpoint, no
// flush of WAL still in shared memory; the next Start runs crash recovery. Connections
// die; a pool keeps dead connections until it uses them (call Reset on it after Start).
func (s *PostgresServer) Crash() { s.signal(syscall.SIGQUIT) }

// Restart is Stop followed by Start.
func (s *PostgresServer) Restart() {
	s.t.Helper()
	s.Stop()
	s.Start()
}

// Running reports whether the server process is up (started and not yet stopped).
func (s *PostgresServer) Running() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cmd != nil
}

func (s *PostgresServer) signal(sig syscall.Signal) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Signal(sig)
	select {
	case <-s.exited:
	case <-time.After(pgStartTimeout):
		// A shutdown that hangs must not hang the test: kill the postmaster (ours, by pid).
		s.t.Errorf("testutil: postgres did not exit on %v within %v; killing it\n%s", sig, pgStartTimeout, s.logTail())
		_ = s.cmd.Process.Kill()
		<-s.exited
	}
	s.cmd = nil
	s.log.Close()
}

// kill ends the server immediately at cleanup: its data is about to be removed.
func (s *PostgresServer) kill() { s.signal(syscall.SIGQUIT) }

// CreateDatabase creates database name (an identifier) on the server.
func (s *PostgresServer) CreateDatabase(t testing.TB, name string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.URL())
	if err != nil {
		t.Fatalf("testutil: connect to %v: %v", s, err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatalf("testutil: create database %s on %v: %v", name, s, err)
	}
}

// Pool returns a pool on database dbname, closed when the test ends. After Crash and Start
// its old connections are dead: call Reset on it.
func (s *PostgresServer) Pool(t testing.TB, dbname string) *pgxpool.Pool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, s.DSN(dbname))
	if err != nil {
		t.Fatalf("testutil: pool on %v/%s: %v", s, dbname, err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// MigratedPool creates database `idemscrape` with every migration applied (store.Migrate)
// and returns a pool on it, closed when the test ends.
func (s *PostgresServer) MigratedPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	s.CreateDatabase(t, "idemscrape")
	pool := s.Pool(t, "idemscrape")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := store.Migrate(ctx, pool, nil); err != nil {
		t.Fatalf("testutil: migrate %v: %v", s, err)
	}
	return pool
}

// String implements fmt.Stringer.
func (s *PostgresServer) String() string { return fmt.Sprintf("postgres 127.0.0.1:%d", s.Port) }

// EnableTLS turns on TLS with the server certificate of ca (ssl = on), adds a role user
// with password that may connect only over TLS with that password (scram-sha-256; every
// other role keeps trust, plain or TLS), and restarts the server.
func (s *PostgresServer) EnableTLS(ca *TestCA, user, password string) {
	s.t.Helper()
	conn, err := pgx.Connect(context.Background(), s.URL())
	if err != nil {
		s.t.Fatalf("testutil: connect to %v: %v", s, err)
	}
	_, err = conn.Exec(context.Background(), fmt.Sprintf(`CREATE ROLE %s LOGIN SUPERUSER PASSWORD %s`,
		pgx.Identifier{user}.Sanitize(), quoteLiteral(password)))
	_ = conn.Close(context.Background())
	if err != nil {
		s.t.Fatalf("testutil: create role %s: %v", user, err)
	}
	copyOwned := func(src, name string) string {
		b, err := os.ReadFile(src)
		if err != nil {
			s.t.Fatalf("testutil: read %s: %v", src, err)
		}
		dst := filepath.Join(s.dataDir(), name)
		if err := os.WriteFile(dst, b, 0o600); err != nil {
			s.t.Fatalf("testutil: write %s: %v", dst, err)
		}
		if s.cred != nil {
			if err := os.Chown(dst, int(s.cred.Uid), int(s.cred.Gid)); err != nil {
				s.t.Fatalf("testutil: chown %s: %v", dst, err)
			}
		}
		return dst
	}
	cert, key := copyOwned(ca.CertFile, "server.crt"), copyOwned(ca.KeyFile, "server.key")
	appendTo := func(name, text string, prepend bool) {
		p := filepath.Join(s.dataDir(), name)
		old, err := os.ReadFile(p)
		if err != nil {
			s.t.Fatalf("testutil: read %s: %v", p, err)
		}
		out := string(old) + text
		if prepend {
			out = text + string(old)
		}
		if err := os.WriteFile(p, []byte(out), 0o600); err != nil {
			s.t.Fatalf("testutil: write %s: %v", p, err)
		}
	}
	appendTo("postgresql.conf", fmt.Sprintf("\nssl = on\nssl_cert_file = '%s'\nssl_key_file = '%s'\n", cert, key), false)
	appendTo("pg_hba.conf", fmt.Sprintf("hostssl all %s 127.0.0.1/32 scram-sha-256\nhostnossl all %s 127.0.0.1/32 reject\n", user, user), true)
	s.Restart()
}

// quoteLiteral quotes s as an SQL string literal.
func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
