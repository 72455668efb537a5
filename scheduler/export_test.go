package scheduler

import (
	"context"
	"time"

	"github.com/redis/go-redis/v9"
)

// LoopFires returns what the loop of template name ticks from its first fire after from
// through to, the clock reading each fire's instant: the instants and their windows.
func LoopFires(s *Scheduler, name string, from, to time.Time) (ats []time.Time, windows []string) {
	t := s.template(name)
	for f := t.sched.nextFire(from, nil); !f.IsZero() && !f.At.After(to); f = t.sched.following(f, f.At) {
		ats, windows = append(ats, f.At), append(windows, f.Window)
	}
	return ats, windows
}

// RefusedFirst is the scheduler's refusedWindows.first, and MaxRefusedWindows its bound.
func RefusedFirst(s *Scheduler, template, window string) bool {
	return s.refused.first(template, window)
}

const MaxRefusedWindows = maxRefusedWindows

// AsynqRequeue runs asynq_requeue.lua on task id of queue, active under lease score.
func AsynqRequeue(ctx context.Context, rdb redis.Scripter, queue, id string, score int64) (int64, error) {
	return asynqRequeueScript.Run(ctx, rdb,
		[]string{asynqQueueKey(queue, "active"), asynqQueueKey(queue, "lease"), asynqQueueKey(queue, "pending"), AsynqTaskKey(queue, id)},
		id, score).Int64()
}
