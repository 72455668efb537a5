// Package testutil holds helpers for tests that talk to real services: an isolated,
// migrated PostgreSQL database per test and an isolated Redis namespace (key prefix and
// asynq queue) per test, plus readers for the state they leave behind.
//
// Services are never optional: when PostgreSQL or Redis does not answer, the test fails
// with the command that starts it. Addresses come from IDEMSCRAPE_TEST_PG (a libpq URL of a
// role allowed to CREATE DATABASE; default postgres://postgres@127.0.0.1:5432/postgres) and
// IDEMSCRAPE_TEST_REDIS (host:port; default 127.0.0.1:6379). Both must be loopback or a
// test network namespace of your own.
//
// Only tests and cmd import this package.
package testutil

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"os"
	"sync"
	"testing"
)

const (
	defaultPGDSN     = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	defaultRedisAddr = "127.0.0.1:6379"
)

// PGAdminDSN is the DSN tests use to create their databases.
func PGAdminDSN() string {
	if v := os.Getenv("IDEMSCRAPE_TEST_PG"); v != "" {
		return v
	}
	return defaultPGDSN
}

// RedisAddr is the Redis server tests use.
func RedisAddr() string {
	if v := os.Getenv("IDEMSCRAPE_TEST_REDIS"); v != "" {
		return v
	}
	return defaultRedisAddr
}

// serviceDown fails the test: a missing service is never a skip, in CI or elsewhere,
// because a skipped test proves nothing.
func serviceDown(t testing.TB, service string, err error) {
	t.Helper()
	t.Fatalf("%s is not reachable: %v\n"+
		"start the services with `.ci/run --services-only` (or `docker compose up -d`), "+
		"or point IDEMSCRAPE_TEST_PG / IDEMSCRAPE_TEST_REDIS at running ones", service, err)
}

// RandomID returns n random bytes as lower-case hex, for names of test databases, queues
// and key prefixes.
func RandomID(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// SyncBuffer is a bytes.Buffer that several goroutines may write while a test reads it: a
// log sink for components that log from their own goroutines.
type SyncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write appends p.
func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// String returns what was written so far.
func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Reset empties the buffer.
func (s *SyncBuffer) Reset() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.b.Reset()
}
