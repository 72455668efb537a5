package handlers

import (
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// WaitReleases waits for the background lease releases of committed jobs (releaseDone).
func WaitReleases(r *Registry) { r.releases.Wait() }

// RedisOf is the registry's Redis client.
func RedisOf(r *Registry) redis.UniversalClient { return r.cfg.Redis }

// SetWindowHoldSlack sets how long after its delivery's deadline a window reservation is
// held, for the test (restored at its end).
func SetWindowHoldSlack(t testing.TB, d time.Duration) {
	old := windowHoldSlack
	windowHoldSlack = d
	t.Cleanup(func() { windowHoldSlack = old })
}

// SetBeforeWindowRestore makes f run between a window restore's read of PostgreSQL and its
// write to Redis, on r.
func SetBeforeWindowRestore(r *Registry, f func()) { r.beforeWindowRestore = f }
