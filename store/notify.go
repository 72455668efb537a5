package store

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// DefaultNotifyInterval is the shortest time between two NOTIFYs of one GroupCommitter.
const DefaultNotifyInterval = 5 * time.Millisecond

// notifySQL wakes the dispatchers LISTENing on OutboxNotifyChannel. It runs in a
// transaction of its own, AFTER the commit that wrote the events returned, so a dispatcher
// woken by it always sees the rows. The transaction commits asynchronously: PostgreSQL
// holds a database-wide lock across the commit of every notifying transaction, and with
// synchronous_commit off that lock is not held across a WAL flush. Losing the notification
// in a server crash loses nothing: the rows are durable and dispatchers poll as a fallback.
const notifySQL = `SELECT set_config('synchronous_commit', 'off', true), pg_notify($1, '')`

// sendNotify sends one NOTIFY on OutboxNotifyChannel.
func sendNotify(ctx context.Context, pool *pgxpool.Pool) error {
	_, err := pool.Exec(ctx, notifySQL, OutboxNotifyChannel)
	return err
}

// notifier wakes dispatchers for a GroupCommitter with at most one NOTIFY per interval,
// so notifying transactions never queue on PostgreSQL's notify lock, and with no lost
// wake-up: every commit that inserted events is followed by a NOTIFY sent after it.
//
// A NOTIFY rides in a commit statement when one is due (ride): it covers that statement's
// events and every commit that returned before the statement was sent. A commit that
// inserted events without notifying (signal) takes a sequence number; the loop sends a
// NOTIFY of its own (after the interval) only if no riding NOTIFY sent later covered it.
// The loop waits twice the interval after the last NOTIFY before it sends its own, so under
// steady load the NOTIFYs ride along and cost no round trip; after the last commit of a
// burst one NOTIFY of its own follows within 2 × interval.
type notifier struct {
	pool     *pgxpool.Pool
	interval time.Duration
	timeout  time.Duration
	onEvents func()

	mu      sync.Mutex
	seq     uint64    // commits that inserted events without notifying, so far
	covered uint64    // every commit up to this sequence number is covered by a sent NOTIFY
	rideAt  time.Time // when a commit statement was last asked to notify (it may not have)
	last    time.Time // when the last NOTIFY (riding or own) was actually sent

	kick chan struct{} // capacity 1: check whether a NOTIFY is owed
	stop chan struct{}
	done chan struct{}
	once sync.Once

	rode, sent, failed atomic.Int64
}

func newNotifier(pool *pgxpool.Pool, interval, timeout time.Duration, onEvents func()) *notifier {
	n := &notifier{pool: pool, interval: interval, timeout: timeout, onEvents: onEvents,
		kick: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
	go n.loop()
	return n
}

// ride reports whether the commit statement about to be sent should notify: yes when no
// NOTIFY was sent for interval. snap is what the NOTIFY will cover once its statement
// returns (pass it to rodeOK).
func (n *notifier) ride() (yes bool, snap uint64) {
	n.mu.Lock()
	defer n.mu.Unlock()
	now := time.Now()
	if now.Sub(n.rideAt) < n.interval || now.Sub(n.last) < n.interval {
		return false, 0
	}
	// rideAt, not last: a statement asked to notify sends nothing when it inserts no event
	// (all its rows refused or busy), and an owed NOTIFY must not wait for one that never
	// went out.
	n.rideAt = now
	return true, n.seq
}

// rodeOK records that a statement that notified (ride gave snap) committed.
func (n *notifier) rodeOK(snap uint64) {
	n.rode.Add(1)
	n.mu.Lock()
	n.covered = max(n.covered, snap)
	n.last = time.Now()
	n.mu.Unlock()
}

// events reports a commit statement that returned having inserted outbox events;
// notified says its own transaction notified.
func (n *notifier) events(notified bool) {
	if n.onEvents != nil {
		n.onEvents()
	}
	if notified {
		return
	}
	n.mu.Lock()
	n.seq++
	n.mu.Unlock()
	select {
	case n.kick <- struct{}{}:
	default: // the loop will look anyway
	}
}

// loop sends the NOTIFYs no riding one covered, at most one per interval.
func (n *notifier) loop() {
	defer close(n.done)
	for {
		select {
		case <-n.kick:
		case <-n.stop:
			n.flush(true)
			return
		}
		n.mu.Lock()
		wait := 2*n.interval - time.Since(n.last)
		n.mu.Unlock()
		if wait > 0 {
			t := time.NewTimer(wait)
			select {
			case <-t.C:
			case <-n.stop:
				t.Stop()
				n.flush(true)
				return
			}
		}
		n.flush(false)
	}
}

// flush sends a NOTIFY if a commit is not covered yet (and, unless final, none was sent
// for 2 × interval; else a kick is left pending to come back for it).
func (n *notifier) flush(final bool) {
	n.mu.Lock()
	if n.covered >= n.seq {
		n.mu.Unlock()
		return
	}
	if !final && time.Since(n.last) < 2*n.interval {
		n.mu.Unlock()
		select { // a riding NOTIFY went out meanwhile: look again after the interval
		case n.kick <- struct{}{}:
		default:
		}
		return
	}
	snap := n.seq
	n.last = time.Now()
	n.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), n.timeout)
	defer cancel()
	if err := sendNotify(ctx, n.pool); err != nil {
		n.failed.Add(1) // the dispatchers' poll picks the rows up
		return
	}
	n.sent.Add(1)
	n.mu.Lock()
	n.covered = max(n.covered, snap)
	n.mu.Unlock()
}

// close sends a NOTIFY still owed and stops the loop. Call it once no commit can come.
func (n *notifier) close() {
	n.once.Do(func() { close(n.stop) })
	<-n.done
}
