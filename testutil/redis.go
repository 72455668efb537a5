package testutil

import (
	"context"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// RedisNS is an isolated slice of the shared Redis server for one test: its own key prefix
// for idemscrape keys and its own asynq queue (asynq keys are `asynq:{<queue>}:…`). Every key
// under both is deleted when the test ends.
type RedisNS struct {
	Client *redis.Client
	Addr   string
	Prefix string // e.g. "t3f9a0c12:"; pass to components as their key prefix
	Queue  string // asynq queue name, e.g. "t3f9a0c12"
}

// Redis returns a fresh namespace on the shared test Redis server.
func Redis(t testing.TB) *RedisNS {
	t.Helper()
	id := "t" + RandomID(4)
	ns := &RedisNS{
		Client: redis.NewClient(&redis.Options{Addr: RedisAddr(), PoolSize: 64}),
		Addr:   RedisAddr(),
		Prefix: id + ":",
		Queue:  id,
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := ns.Client.Ping(ctx).Err(); err != nil {
		_ = ns.Client.Close()
		serviceDown(t, "Redis", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		for _, pattern := range []string{ns.Prefix + "*", "asynq:{" + ns.Queue + "}:*"} {
			iter := ns.Client.Scan(ctx, 0, pattern, 1000).Iterator()
			var keys []string
			for iter.Next(ctx) {
				keys = append(keys, iter.Val())
			}
			if len(keys) > 0 {
				ns.Client.Del(ctx, keys...)
			}
		}
		ns.Client.SRem(ctx, "asynq:queues", ns.Queue)
		_ = ns.Client.Close()
	})
	return ns
}

// AsynqOpt returns the asynq connection option for this namespace's server.
func (ns *RedisNS) AsynqOpt() asynq.RedisClientOpt {
	return asynq.RedisClientOpt{Addr: ns.Addr}
}

// AsynqTaskExists reports whether asynq holds a task with id in the namespace's queue, in
// any state (pending, active, scheduled, retry, archived, completed).
func (ns *RedisNS) AsynqTaskExists(t testing.TB, id string) bool {
	t.Helper()
	n, err := ns.Client.Exists(context.Background(), "asynq:{"+ns.Queue+"}:t:"+id).Result()
	if err != nil {
		t.Fatalf("testutil: EXISTS task %q: %v", id, err)
	}
	return n == 1
}

// AsynqPending returns the number of pending tasks in the namespace's queue.
func (ns *RedisNS) AsynqPending(t testing.TB) int {
	t.Helper()
	n, err := ns.Client.LLen(context.Background(), "asynq:{"+ns.Queue+"}:pending").Result()
	if err != nil {
		t.Fatalf("testutil: LLEN pending: %v", err)
	}
	return int(n)
}
