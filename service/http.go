package service

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"
)

// basicAuth lets a request through only with the configured credentials. Both the user
// and the password are compared as SHA-256 digests in constant time, so neither their
// content nor their length leaks through timing, and both are always compared.
func basicAuth(creds BasicAuth, next http.Handler) http.Handler {
	wantUser := sha256.Sum256([]byte(creds.User))
	wantPass := sha256.Sum256([]byte(creds.Password))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		user, pass, ok := r.BasicAuth()
		gotUser := sha256.Sum256([]byte(user))
		gotPass := sha256.Sum256([]byte(pass))
		userOK := subtle.ConstantTimeCompare(gotUser[:], wantUser[:])
		passOK := subtle.ConstantTimeCompare(gotPass[:], wantPass[:])
		if !ok || userOK&passOK != 1 {
			w.Header().Set("WWW-Authenticate", `Basic realm="idemscrape", charset="UTF-8"`)
			http.Error(w, "authentication required", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// checkResult is the outcome of one readiness check.
type checkResult struct {
	name string
	err  error
}

// readyChecks returns every readiness check: Redis (a write, see redisWritable), PostgreSQL, the asynq server, the
// registry's own readiness (a kind paused by a proxy-auth incident), and Config.ReadyChecks.
func (s *Service) readyChecks() []ReadyCheck {
	checks := []ReadyCheck{
		{Name: "redis", Check: s.redisWritable},
		{Name: "postgres", Check: func(ctx context.Context) error { return s.cfg.Store.Pool().Ping(ctx) }},
		{Name: "asynq", Check: func(ctx context.Context) error {
			if !s.running.Load() {
				return fmt.Errorf("server not running")
			}
			if s.asynqRedis != nil {
				// asynq's own connection: the server can not take tasks without it.
				if err := s.asynqRedis.Ping(ctx).Err(); err != nil {
					return fmt.Errorf("asynq's Redis: %w", err)
				}
			}
			return nil
		}},
	}
	checks = append(checks, ReadyCheck{Name: "registry", Check: func(context.Context) error { return s.cfg.Registry.Ready() }})
	return append(checks, s.cfg.ReadyChecks...)
}

// readyProbeTTL is how long a readiness probe's key lives.
const readyProbeTTL = 5 * time.Second

// readyProbeKey is this process's readiness probe key, <prefix>ready-probe:<host>/<pid>/<random>,
// under the outbox's key prefix (the service's keys in Redis). One key alone: no hash tag
// is needed on Redis Cluster.
func readyProbeKey(prefix string) string {
	host, _ := os.Hostname()
	var b [6]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%sready-probe:%s/%d/%s", prefix, host, os.Getpid(), hex.EncodeToString(b[:]))
}

// redisWritable is /readyz's Redis check: a SET with a short expiry, not a PING, since a
// Redis that answers but refuses every write (out of memory under noeviction, a read-only
// replica) takes no lease and queues no task.
func (s *Service) redisWritable(ctx context.Context) error {
	return s.cfg.Redis.Set(ctx, s.readyKey, "1", readyProbeTTL).Err()
}

// serveReady answers 200 when every check passes, 503 otherwise; the body names each
// check and says ok or failing, nothing more (anyone who can reach the port reads it: a
// driver's error may name hosts, users or certificates). Why a check failed is logged.
func (s *Service) serveReady(w http.ResponseWriter, r *http.Request) {
	checks := s.readyChecks()
	results := make([]checkResult, len(checks))
	var wg sync.WaitGroup
	for i, c := range checks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(r.Context(), s.cfg.ReadyTimeout)
			defer cancel()
			results[i] = checkResult{name: c.Name, err: c.Check(ctx)}
		}()
	}
	wg.Wait()
	var b strings.Builder
	status := http.StatusOK
	var failed []any
	for _, res := range results {
		if res.err != nil {
			status = http.StatusServiceUnavailable
			fmt.Fprintf(&b, "%s: failing\n", res.name)
			failed = append(failed, slog.String(res.name, res.err.Error()))
		} else {
			fmt.Fprintf(&b, "%s: ok\n", res.name)
		}
	}
	if status != http.StatusOK {
		s.log.WarnContext(r.Context(), "not ready", slog.Group("failing", failed...))
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_, _ = fmt.Fprint(w, b.String())
}

// asynqLogger adapts slog to asynq's Logger (asynq's logger is not slog).
type asynqLogger struct{ l *slog.Logger }

func (a asynqLogger) Debug(args ...any) { a.l.Debug(fmt.Sprint(args...)) }
func (a asynqLogger) Info(args ...any)  { a.l.Info(fmt.Sprint(args...)) }
func (a asynqLogger) Warn(args ...any)  { a.l.Warn(fmt.Sprint(args...)) }
func (a asynqLogger) Error(args ...any) { a.l.Error(fmt.Sprint(args...)) }

// Fatal logs and exits, as asynq expects of its logger.
func (a asynqLogger) Fatal(args ...any) {
	a.l.Error(fmt.Sprint(args...), "fatal", true)
	os.Exit(1)
}
