package testutil

import (
	"os"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// TestProcessTB: cleanups run last first on Close, Fatalf panics with a FatalError and
// marks the TB failed, the temporary directory goes with Close, and a throwaway
// redis-server started through it is stopped by Close.
func TestProcessTB(t *testing.T) {
	tb, err := NewProcessTB("t")
	require.NoError(t, err)
	var order []int
	tb.Cleanup(func() { order = append(order, 1) })
	tb.Cleanup(func() { order = append(order, 2) })
	dir := tb.TempDir()
	srv := StartRedis(tb)
	c := srv.Client()
	require.NoError(t, c.Ping(t.Context()).Err())

	func() {
		defer func() {
			fe, ok := recover().(FatalError)
			require.True(t, ok)
			require.Equal(t, "boom 7", fe.Msg)
		}()
		tb.Fatalf("boom %d", 7)
	}()
	require.True(t, tb.Failed())

	tb.Close()
	require.Equal(t, []int{2, 1}, order)
	_, err = os.Stat(dir)
	require.True(t, os.IsNotExist(err), "the temporary directory is removed")
	fresh := redis.NewClient(&redis.Options{Addr: srv.Addr, MaxRetries: -1})
	defer fresh.Close()
	require.Error(t, fresh.Ping(t.Context()).Err(), "the redis-server was stopped")
}

// TestRecoverFatal: a deferred RecoverFatal turns a ProcessTB failure into the function's
// error and lets any other panic go on.
func TestRecoverFatal(t *testing.T) {
	tb, err := NewProcessTB("recover")
	if err != nil {
		t.Fatal(err)
	}
	defer tb.Close()
	run := func() (err error) {
		defer RecoverFatal(&err)
		tb.Fatalf("fake %s failed", "shop")
		return nil
	}
	if err := run(); err == nil || err.Error() != "setup: fake shop failed" {
		t.Fatalf("RecoverFatal: %v, want setup: fake shop failed", err)
	}
	defer func() {
		if r := recover(); r != "other" {
			t.Fatalf("another panic was not passed on: %v", r)
		}
	}()
	_ = func() (err error) {
		defer RecoverFatal(&err)
		panic("other")
	}()
}
