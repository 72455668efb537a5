package tasks

import (
	"context"
	"time"
)

// JobState is the state of a logical job in the system of record (the jobs table).
//
//	pending → running → complete | retryable | failed
//	retryable → running, running → retryable (lease expired), running → running (takeover
//	with a higher fencing token after the holder's lease expired)
//
// complete is terminal; failed → pending only by an operator's requeue (idemscrape requeue,
// ops.JobRequeue) or a reparse that re-queues it.
type JobState string

// The job states.
const (
	StatePending   JobState = "pending"
	StateRunning   JobState = "running"
	StateRetryable JobState = "retryable"
	StateComplete  JobState = "complete"
	StateFailed    JobState = "failed"
)

// Terminal reports whether no attempt may start from s.
func (s JobState) Terminal() bool { return s == StateComplete || s == StateFailed }

// JobRecord is one jobs row to record: the key and the normalised spec it was derived from.
type JobRecord struct {
	Key  string
	Spec Spec
	// Queue is the asynq queue the recording enqueuer would put the job's task in, kept
	// with a job it creates ("" records none). An existing job keeps the queue it has.
	Queue string
}

// JobRecordResult tells what recording one JobRecord found or did.
type JobRecordResult struct {
	Key     string
	Created bool     // this call inserted the row
	State   JobState // the row's state after the call
	// NextAttemptAt is when a retryable job may run again (nil otherwise).
	NextAttemptAt *time.Time
	// Queue is the asynq queue recorded with the job ("" when none was: the enqueuer's).
	Queue string
}

// JobRecorder stores jobs rows in the system of record. store.PG implements it.
type JobRecorder interface {
	// JobsRecord inserts one pending row per record whose key does not exist yet and leaves
	// existing rows untouched. Results are in the order of records.
	JobsRecord(ctx context.Context, records []JobRecord) ([]JobRecordResult, error)
}
