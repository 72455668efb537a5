package main

import (
	"bufio"
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/testutil"
)

// TestSchedulerOverRedisTLS: the scheduler binary runs against a Redis that needs TLS
// and an ACL user (its password from a file): /healthz answers ok through both
// connections; its log holds no password.
func TestSchedulerOverRedisTLS(t *testing.T) {
	const password = "sched-app-pw-1f0e"
	dir := t.TempDir()
	bin := filepath.Join(dir, "scheduler")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, "go build: %s", out)
	srv := testutil.StartRedisWith(t, testutil.RedisOptions{Password: "sched-default-pw", ACL: []string{"app on >" + password + " ~* &* +@all -@admin"}, TLS: true})
	pool := testutil.PG(t)
	u, err := url.Parse(testutil.PGAdminDSN())
	require.NoError(t, err)
	u.Path = "/" + pool.Config().ConnConfig.Database
	cfg := filepath.Join(dir, "scheduler.yaml")
	require.NoError(t, os.WriteFile(cfg, []byte(`templates:
  - name: daily
    cron: "0 6 * * *"
    window: daily
    kind: tlskind
    sources: {ids: [sku-1]}
    countries: [US]
    parser_version: 1
    catchup: none
`), 0o600))
	pw := filepath.Join(dir, "redis-pw")
	require.NoError(t, os.WriteFile(pw, []byte(password+"\n"), 0o600))

	cmd := exec.Command(bin, "-config", cfg, "-http", "127.0.0.1:0", "-log-format", "json")
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "IDEMSCRAPE_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, "IDEMSCRAPE_PG="+u.String(), "IDEMSCRAPE_REDIS=rediss://app@"+srv.Addr,
		"IDEMSCRAPE_REDIS_PASSWORD_FILE="+pw, "IDEMSCRAPE_REDIS_TLS_CA="+srv.TLS.CAFile)
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill() // our own child, by pid
			_ = cmd.Wait()
		}
	})
	var log strings.Builder
	addr := ""
	sc := bufio.NewScanner(stderr)
	running := false
	for !running && sc.Scan() {
		line := sc.Text()
		log.WriteString(line + "\n")
		if strings.Contains(line, "http listening") {
			var v struct{ Addr string }
			require.NoError(t, json.Unmarshal([]byte(line), &v), line)
			addr = v.Addr
		}
		running = strings.Contains(line, "scheduler running")
	}
	require.True(t, running, "no scheduler running line:\n%s", log.String())
	require.NotEmpty(t, addr, "no http listening line:\n%s", log.String())
	resp, err := http.Get("http://" + addr + "/healthz")
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	assert.Equal(t, http.StatusOK, resp.StatusCode, string(body))
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	done := make(chan struct{})
	go func() {
		rest, _ := io.ReadAll(stderr)
		log.Write(rest)
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(90 * time.Second):
		t.Fatalf("scheduler still running 90 s after SIGTERM")
	}
	require.NoError(t, cmd.Wait(), log.String())
	assert.Contains(t, log.String(), `"redis":"rediss app@`+srv.Addr)
	assert.NotContains(t, log.String(), password)
}
