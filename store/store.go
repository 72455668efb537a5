// Package store is the system of record: embedded migrations, the jobs / attempts /
// results / outbox / quarantine tables, and every state transition of a job as one
// conditional statement.
//
// Every transition is an UPDATE guarded by the state it leaves and, once an attempt runs,
// by the fencing token the attempt was started with. A refused transition never silently
// does nothing: it returns a *TransitionError that says which state and fence the row held,
// and wraps one of the sentinel errors (ErrJobNotFound, ErrJobComplete, ErrJobFailed,
// ErrStaleFence, ErrInvalidTransition) for errors.Is.
package store

import (
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemscrape/idemscrape/tasks"
)

// Sentinel reasons a transition is refused. A *TransitionError wraps exactly one of them.
var (
	// ErrJobNotFound: no jobs row has the key.
	ErrJobNotFound = errors.New("store: job not found")
	// ErrJobComplete: the job is complete; nothing may change it any more.
	ErrJobComplete = errors.New("store: job already complete")
	// ErrJobFailed: the job failed terminally; it needs review or a new job.
	ErrJobFailed = errors.New("store: job failed terminally")
	// ErrStaleFence: the caller's fencing token is not the job's current one (attempt
	// finish: the job runs under another token, or its fence moved past ours, e.g. after a
	// rescue) or not higher than it (attempt start). A late worker gets this.
	ErrStaleFence = errors.New("store: stale fencing token")
	// ErrInvalidTransition: the job's state does not allow the transition.
	ErrInvalidTransition = errors.New("store: invalid state transition")
)

// TransitionError reports a refused state transition and the row as the statement saw it.
// Nothing was written.
type TransitionError struct {
	Op    string         // e.g. "JobComplete"
	Key   string         // job key
	State tasks.JobState // state the row held ("" if not found)
	Fence int64          // fence the row held
	Token int64          // fencing token the caller presented
	Err   error          // one of the sentinel errors
}

func (e *TransitionError) Error() string {
	if errors.Is(e.Err, ErrJobNotFound) {
		return fmt.Sprintf("%s %q: %v", e.Op, e.Key, e.Err)
	}
	return fmt.Sprintf("%s %q: %v (state %s, fence %d, token %d)", e.Op, e.Key, e.Err, e.State, e.Fence, e.Token)
}

func (e *TransitionError) Unwrap() error { return e.Err }

// PG is the Postgres implementation of the store interfaces. It is safe for concurrent use.
type PG struct {
	pool *pgxpool.Pool
}

// New returns a store on pool. The schema must be migrated (Migrate).
func New(pool *pgxpool.Pool) *PG { return &PG{pool: pool} }

// Pool returns the pool the store uses.
func (s *PG) Pool() *pgxpool.Pool { return s.pool }

var _ tasks.JobRecorder = (*PG)(nil)
