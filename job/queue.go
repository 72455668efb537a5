package job

import "fmt"

// MaxQueueLen is the longest asynq queue name an enqueuer, a worker or the scheduler
// accepts (the scheduler's kinds.<kind>.queue has the same bound).
const MaxQueueLen = 128

// CheckQueue reports whether name may be an asynq queue: 1 to MaxQueueLen bytes of
// [A-Za-z0-9._-], the characters of a kind (QueueFor) and of asynq's "default". A queue
// is part of every Redis key of its tasks (asynq:{<queue>}:…) and is recorded with each
// job for life (jobs.queue), so a name with braces (a cluster hash tag of its own), control
// characters, spaces or colons, or one of any length, is refused before anything is
// stored. The error names the problem, not the value (which may be unprintable).
func CheckQueue(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("queue name is empty, want [A-Za-z0-9._-]{1,%d}", MaxQueueLen)
	case len(name) > MaxQueueLen:
		return fmt.Errorf("queue name is %d bytes, want [A-Za-z0-9._-]{1,%d}", len(name), MaxQueueLen)
	}
	for i := 0; i < len(name); i++ {
		if !isSafeByte(name[i]) {
			return fmt.Errorf("queue name: byte %d (%q) not allowed, want [A-Za-z0-9._-]{1,%d}", i, name[i], MaxQueueLen)
		}
	}
	return nil
}
