package store

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// Group commit defaults.
const (
	// DefaultGroupWindow is kept for compatibility: the committer no longer waits for a
	// window (see NewGroupCommitter).
	DefaultGroupWindow = 2 * time.Millisecond
	// DefaultGroupMaxBatch caps the jobs of one statement.
	DefaultGroupMaxBatch = 64
	// DefaultGroupQueue bounds the requests waiting per kind (start, commit).
	DefaultGroupQueue = 1024
	// DefaultGroupTryTimeout bounds one statement of the committer.
	DefaultGroupTryTimeout = 10 * time.Second
	// DefaultGroupLockWait bounds how long a request waits for its jobs row while another
	// transaction holds it locked.
	DefaultGroupLockWait = 5 * time.Second
	// DefaultGroupOverlapAfter is how long a statement may run before a batch that is not
	// full is sent beside it (see GroupConfig.OverlapAfter).
	DefaultGroupOverlapAfter = 20 * time.Millisecond
	// DefaultGroupMaxTries bounds the tries of a request whose statement failed before it
	// reached the server or was resolved as not written.
	DefaultGroupMaxTries = 3
)

// Errors of the group committer.
var (
	// ErrGroupCommitterClosed: Commit or JobStart was called after Close.
	ErrGroupCommitterClosed = errors.New("store: group committer closed")
	// ErrOutcomeUnknown: the statement was sent and may or may not have taken effect
	// (the caller's context ended while it ran, or the re-read that resolves a lost reply
	// failed). Read the job to find out; a retry with the same token is safe (fenced).
	ErrOutcomeUnknown = errors.New("store: outcome unknown, the statement may have taken effect")
	// ErrRowBusy: another transaction held the job's row locked for longer than
	// GroupConfig.LockWait; nothing was written.
	ErrRowBusy = errors.New("store: job row locked by another transaction, nothing written")
)

// GroupConfig configures a GroupCommitter. The zero value is valid.
type GroupConfig struct {
	// MaxBatch caps the jobs of one statement. Defaults to DefaultGroupMaxBatch.
	MaxBatch int
	// MaxInFlight is how many statements of one kind (starts, commits) run at once.
	// Defaults to a quarter of the pool's MaxConns, at least 1 and at most 2, so both
	// kinds together use at most half of the pool.
	MaxInFlight int
	// OverlapAfter: a batch that is not full waits for the statement of its kind already
	// in flight (taking in what queues meanwhile) until that statement has run this long,
	// then is sent beside it; a full batch is sent at once. Bigger batches while
	// statements are quick, no stall behind one that is slow. Defaults to
	// DefaultGroupOverlapAfter.
	OverlapAfter time.Duration
	// QueueSize bounds the requests waiting per kind; a caller beyond it blocks until
	// there is room or its context ends (back-pressure). Defaults to DefaultGroupQueue.
	QueueSize int
	// TryTimeout bounds each statement. Defaults to DefaultGroupTryTimeout.
	TryTimeout time.Duration
	// LockWait is how long a request keeps trying while its jobs row is locked by another
	// transaction before it fails with ErrRowBusy. Defaults to DefaultGroupLockWait.
	LockWait time.Duration
	// MaxTries bounds the tries of a request after failures that wrote nothing.
	// Defaults to DefaultGroupMaxTries.
	MaxTries int
	// NotifyInterval is the shortest time between two NOTIFYs on OutboxNotifyChannel
	// (PostgreSQL serialises the commits of notifying transactions, so a NOTIFY in every
	// commit capped commits at a few hundred per second). A commit statement notifies
	// itself when no NOTIFY was sent for NotifyInterval; the events of a statement that
	// did not are covered by the next riding NOTIFY or, if none follows, by one the
	// committer sends on its own (an asynchronously committed transaction) within
	// 2 × NotifyInterval. Every commit that inserted events is followed by a NOTIFY sent after
	// it. Defaults to DefaultNotifyInterval.
	NotifyInterval time.Duration
	// OnEvents, if set, is called after every commit statement that inserted outbox
	// events has returned (the rows are committed and visible), before the NOTIFY: an
	// in-process dispatcher can wake on it without a round trip. It runs on the
	// committer's goroutine and must return at once (e.g. a non-blocking send on a
	// channel of capacity 1).
	OnEvents func()
}

// Validate reports the first field that is out of range.
func (c GroupConfig) Validate() error {
	switch {
	case c.MaxBatch < 0:
		return fmt.Errorf("store: GroupConfig.MaxBatch %d is negative", c.MaxBatch)
	case c.MaxInFlight < 0:
		return fmt.Errorf("store: GroupConfig.MaxInFlight %d is negative", c.MaxInFlight)
	case c.OverlapAfter < 0:
		return fmt.Errorf("store: GroupConfig.OverlapAfter %s is negative", c.OverlapAfter)
	case c.QueueSize < 0:
		return fmt.Errorf("store: GroupConfig.QueueSize %d is negative", c.QueueSize)
	case c.TryTimeout < 0:
		return fmt.Errorf("store: GroupConfig.TryTimeout %s is negative", c.TryTimeout)
	case c.LockWait < 0:
		return fmt.Errorf("store: GroupConfig.LockWait %s is negative", c.LockWait)
	case c.MaxTries < 0:
		return fmt.Errorf("store: GroupConfig.MaxTries %d is negative", c.MaxTries)
	case c.NotifyInterval < 0:
		return fmt.Errorf("store: GroupConfig.NotifyInterval %s is negative", c.NotifyInterval)
	}
	return nil
}

func (c GroupConfig) withDefaults(poolConns int) GroupConfig {
	if c.MaxBatch == 0 {
		c.MaxBatch = DefaultGroupMaxBatch
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = min(2, max(1, poolConns/4))
	}
	if c.OverlapAfter == 0 {
		c.OverlapAfter = DefaultGroupOverlapAfter
	}
	if c.QueueSize == 0 {
		c.QueueSize = DefaultGroupQueue
	}
	if c.TryTimeout == 0 {
		c.TryTimeout = DefaultGroupTryTimeout
	}
	if c.LockWait == 0 {
		c.LockWait = DefaultGroupLockWait
	}
	if c.MaxTries == 0 {
		c.MaxTries = DefaultGroupMaxTries
	}
	if c.NotifyInterval == 0 {
		c.NotifyInterval = DefaultNotifyInterval
	}
	return c
}

// GroupCommitter batches the attempt starts and commits of concurrent handlers: each kind
// goes to PostgreSQL as ONE statement per batch (one transaction, one WAL flush for
// commits), with every job's fence checked row by row — a stale job is refused on its
// own and never rolls back the others. Each caller gets the result PG.Commit (PG.JobStart)
// would have given it.
//
// Batching is natural group commit: an idle committer sends a request at once, and
// whatever queued while the previous statement ran is the next batch; there is no timer
// when idle. A second statement of a kind runs beside the first (up to MaxInFlight) when
// its batch is full or the first has run for OverlapAfter, so a slow statement never
// stalls the queue. The queue is bounded (QueueSize): callers beyond it wait. Each batch is sorted by
// job key and locks its rows in that order; a row locked by another transaction is
// skipped and tried again on its own (for up to LockWait), so it never delays the other
// jobs. Every statement has its own timeout (TryTimeout). A failure that reached the
// server and may have committed is resolved by re-reading the rows (the job's state and
// fence tell whether the statement took effect), never by guessing.
//
// A caller whose context ends gets its error at once: a request not yet sent is dropped
// (nothing written, ctx.Err()); one already in a statement returns ErrOutcomeUnknown.
//
// Start it with NewGroupCommitter and Close it when the workers stop.
type GroupCommitter struct {
	commits *batcher[CommitParams, CommitResult]
	starts  *batcher[AttemptStartParams, StartedAttempt]
	notify  *notifier
}

// NewGroupCommitter starts a group committer with the default GroupConfig and maxBatch as
// MaxBatch (0 = DefaultGroupMaxBatch; negative is treated as 0). window is ignored: the
// committer batches whatever queued while the previous statement ran and never waits for
// company (it was the wait of the first statement of a batch).
func (s *PG) NewGroupCommitter(window time.Duration, maxBatch int) *GroupCommitter {
	_ = window
	g, err := s.NewGroupCommitterConfig(GroupConfig{MaxBatch: max(0, maxBatch)})
	if err != nil {
		panic(err) // unreachable: the config is valid
	}
	return g
}

// NewGroupCommitterConfig starts a group committer configured by cfg.
func (s *PG) NewGroupCommitterConfig(cfg GroupConfig) (*GroupCommitter, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults(int(s.pool.Config().MaxConns))
	n := newNotifier(s.pool, cfg.NotifyInterval, cfg.TryTimeout, cfg.OnEvents)
	// Wake the dispatchers after every statement that inserted events (or, resolved after
	// a lost reply, may have): by its own NOTIFY when one was due, else by the notifier.
	signalled := func(notified bool, out []rowOutcome[CommitResult], err error) ([]rowOutcome[CommitResult], error) {
		if err == nil {
			for _, o := range out {
				if o.err == nil && !o.busy && o.res.EventInserted {
					n.events(notified)
					break
				}
			}
		}
		return out, err
	}
	g := &GroupCommitter{
		notify: n,
		commits: newBatcher(cfg, rowOps[CommitParams, CommitResult]{
			op: "Commit", key: func(p CommitParams) string { return p.Key },
			exec: func(ctx context.Context, batch []CommitParams, lock lockMode) ([]rowOutcome[CommitResult], error) {
				ride, snap := n.ride()
				out, err := s.commitRows(ctx, batch, lock, ride)
				// The statement notified iff it was asked to and inserted an event.
				notified := ride && err == nil && slices.ContainsFunc(out, func(o rowOutcome[CommitResult]) bool {
					return o.err == nil && !o.busy && o.res.EventInserted
				})
				if notified {
					n.rodeOK(snap)
				}
				return signalled(notified, out, err)
			},
			resolve: func(ctx context.Context, batch []CommitParams) ([]rowOutcome[CommitResult], error) {
				out, err := s.resolveCommits(ctx, batch)
				return signalled(false, out, err)
			},
		}),
		starts: newBatcher(cfg, rowOps[AttemptStartParams, StartedAttempt]{
			op: "JobStart", key: func(p AttemptStartParams) string { return p.Key },
			exec: s.startRows, resolve: s.resolveStarts,
		}),
	}
	return g, nil
}

// Commit is PG.Commit through the batch: same validation, same fencing, same result.
func (g *GroupCommitter) Commit(ctx context.Context, p CommitParams) (CommitResult, error) {
	if err := p.Validate(); err != nil {
		return CommitResult{}, err
	}
	return g.commits.do(ctx, p)
}

// JobStart is PG.JobStart through the batch.
func (g *GroupCommitter) JobStart(ctx context.Context, p AttemptStartParams) (StartedAttempt, error) {
	if p.Token < 0 {
		return StartedAttempt{}, fmt.Errorf("store: JobStart %q: token %d is negative (0 issues one)", p.Key, p.Token)
	}
	if err := p.check(); err != nil {
		return StartedAttempt{}, err
	}
	return g.starts.do(ctx, p)
}

// GroupStats counts the statements of a GroupCommitter.
type GroupStats struct {
	CommitBatches, CommitRows int64 // commit statements sent and the jobs in them
	StartBatches, StartRows   int64 // start statements sent and the jobs in them
	Busy                      int64 // jobs found locked by another transaction (tried again)
	Resolved                  int64 // statements whose outcome was resolved by re-reading
	// NOTIFYs that rode in commit statements, NOTIFYs sent on their own (after the last
	// commit of a burst), and own NOTIFYs that failed.
	NotifiesRode, Notifies, NotifyFailures int64
}

// Stats reports how many statements were sent and how many jobs they carried (their
// ratio is the mean batch size).
func (g *GroupCommitter) Stats() GroupStats {
	return GroupStats{
		CommitBatches: g.commits.batches.Load(), CommitRows: g.commits.rows.Load(),
		StartBatches: g.starts.batches.Load(), StartRows: g.starts.rows.Load(),
		Busy:         g.commits.busy.Load() + g.starts.busy.Load(),
		Resolved:     g.commits.resolved.Load() + g.starts.resolved.Load(),
		NotifiesRode: g.notify.rode.Load(), Notifies: g.notify.sent.Load(), NotifyFailures: g.notify.failed.Load(),
	}
}

// Close stops taking requests, runs every request already queued (or blocked on a full
// queue), waits for the statements in flight, sends the NOTIFY they owe and returns.
// Calls after Close fail with ErrGroupCommitterClosed. Safe to call more than once and
// concurrently.
func (g *GroupCommitter) Close() {
	g.commits.close()
	g.starts.close()
	g.notify.close()
}

// rowOps are one kind's fenced statement and its re-read (fenced.go).
type rowOps[Req, Res any] struct {
	op      string
	key     func(Req) string
	exec    func(context.Context, []Req, lockMode) ([]rowOutcome[Res], error)
	resolve func(context.Context, []Req) ([]rowOutcome[Res], error)
}

// groupHooks let tests observe and steer the committer; nil in production.
type groupHooks struct {
	queued  func()               // a request entered the queue
	collect func()               // a statement slot and a first request are taken; the batch is collected next
	before  func([]string) error // a statement is about to be sent; an error replaces it
	after   func([]string) error // a statement succeeded; an error replaces its outcome (a lost reply)
}

// Request states.
const (
	reqQueued int32 = iota
	reqTaken
	reqAbandoned
)

type groupReq[Req, Res any] struct {
	ctx   context.Context
	req   Req
	key   string
	state atomic.Int32
	reply chan rowOutcome[Res]
	tries int
	since time.Time // when it was first found busy
	busy  bool      // last try found its row locked
	maybe bool      // an earlier statement of it may have taken effect (see try)
	last  error     // last failure that wrote nothing
}

type batcher[Req, Res any] struct {
	cfg   GroupConfig
	ops   rowOps[Req, Res]
	hooks *groupHooks

	reqs     chan *groupReq[Req, Res]
	slots    chan struct{}
	lone     chan struct{} // statements of requests tried on their own (alone)
	mu       sync.Mutex
	closed   bool
	senders  sync.WaitGroup
	inflight sync.WaitGroup
	done     chan struct{}
	running  atomic.Int32  // statements in flight
	started  atomic.Int64  // when the last statement started (UnixNano)
	finished chan struct{} // a statement ended (capacity 1)

	batches, rows, busy, resolved atomic.Int64
}

func newBatcher[Req, Res any](cfg GroupConfig, ops rowOps[Req, Res]) *batcher[Req, Res] {
	b := &batcher[Req, Res]{cfg: cfg, ops: ops,
		reqs:     make(chan *groupReq[Req, Res], cfg.QueueSize),
		slots:    make(chan struct{}, cfg.MaxInFlight),
		lone:     make(chan struct{}, max(4, 2*cfg.MaxInFlight)),
		finished: make(chan struct{}, 1),
		done:     make(chan struct{})}
	go b.loop()
	return b
}

func (b *batcher[Req, Res]) do(ctx context.Context, req Req) (Res, error) {
	var zero Res
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return zero, ErrGroupCommitterClosed
	}
	b.senders.Add(1)
	b.mu.Unlock()
	r := &groupReq[Req, Res]{ctx: ctx, req: req, key: b.ops.key(req), reply: make(chan rowOutcome[Res], 1)}
	select {
	case b.reqs <- r:
		b.senders.Done()
	case <-ctx.Done():
		b.senders.Done()
		return zero, fmt.Errorf("store: %s %q: not sent: %w", b.ops.op, r.key, ctx.Err())
	}
	if h := b.hooks; h != nil && h.queued != nil {
		h.queued()
	}
	select {
	case out := <-r.reply:
		return out.res, out.err
	case <-ctx.Done():
		if r.state.CompareAndSwap(reqQueued, reqAbandoned) {
			return zero, fmt.Errorf("store: %s %q: not sent: %w", b.ops.op, r.key, ctx.Err())
		}
		select {
		case out := <-r.reply:
			return out.res, out.err
		default:
		}
		return zero, fmt.Errorf("store: %s %q: %w: %w", b.ops.op, r.key, ErrOutcomeUnknown, ctx.Err())
	}
}

func (b *batcher[Req, Res]) close() {
	b.mu.Lock()
	if !b.closed {
		b.closed = true
		go func() {
			b.senders.Wait() // nobody sends after this
			close(b.reqs)
		}()
	}
	b.mu.Unlock()
	<-b.done
}

// loop takes a statement slot, then the first queued request and everything queued
// behind it (up to MaxBatch), and runs them; it ends once the queue is closed and empty
// and every statement has returned.
func (b *batcher[Req, Res]) loop() {
	defer close(b.done)
	defer b.inflight.Wait()
	for {
		b.slots <- struct{}{}
		first, ok := <-b.reqs
		if !ok {
			<-b.slots
			return
		}
		if h := b.hooks; h != nil && h.collect != nil {
			h.collect()
		}
		batch := b.collect([]*groupReq[Req, Res]{first})
		select { // a stale signal of a statement that ended before now
		case <-b.finished:
		default:
		}
		if len(batch) < b.cfg.MaxBatch && b.running.Load() > 0 {
			if wait := b.cfg.OverlapAfter - time.Since(time.Unix(0, b.started.Load())); wait > 0 {
				t := time.NewTimer(wait)
				select {
				case <-b.finished:
				case <-t.C:
				}
				t.Stop()
				batch = b.collect(batch)
			}
		}
		b.started.Store(time.Now().UnixNano())
		b.running.Add(1)
		b.inflight.Add(1)
		go func() {
			defer b.inflight.Done()
			b.run(batch)
		}()
	}
}

// collect adds what is queued to batch, up to MaxBatch, without waiting.
func (b *batcher[Req, Res]) collect(batch []*groupReq[Req, Res]) []*groupReq[Req, Res] {
	for len(batch) < b.cfg.MaxBatch {
		select {
		case r, ok := <-b.reqs:
			if !ok {
				return batch
			}
			batch = append(batch, r)
		default:
			return batch
		}
	}
	return batch
}

// run sends one batch (holding the slot the loop took for it), then tries on their own,
// outside the slot and each on its own goroutine, the requests that need it: a second
// request for a job already in the batch, a job whose row was locked, every job of a
// statement that failed as a whole.
func (b *batcher[Req, Res]) run(batch []*groupReq[Req, Res]) {
	live := batch[:0]
	for _, r := range batch {
		if r.state.CompareAndSwap(reqQueued, reqTaken) {
			live = append(live, r)
		}
	}
	slices.SortStableFunc(live, func(x, y *groupReq[Req, Res]) int { return cmp.Compare(x.key, y.key) })
	var now, later []*groupReq[Req, Res]
	for i, r := range live {
		if i > 0 && live[i-1].key == r.key {
			later = append(later, r)
		} else {
			now = append(now, r)
		}
	}
	if len(now) > 0 {
		later = append(b.try(context.Background(), now), later...)
	}
	b.running.Add(-1)
	<-b.slots
	select {
	case b.finished <- struct{}{}:
	default:
	}
	// Each is tried on its own goroutine, at once: tried one after another, a second locked
	// row freed right after the batch waited out the first one's LockWait and was then
	// refused untried, its own LockWait (counted from the batch) spent.
	for _, r := range later[min(1, len(later)):] {
		b.inflight.Add(1) // run holds one already: Close's Wait can not have returned
		go func() {
			defer b.inflight.Done()
			b.alone(r)
		}()
	}
	if len(later) > 0 {
		b.alone(later[0])
	}
}

// alone tries one request on its own until it is answered: a busy row is tried again
// after a short pause for up to LockWait, a failure that wrote nothing up to MaxTries.
func (b *batcher[Req, Res]) alone(r *groupReq[Req, Res]) {
	pause := time.Millisecond
	for {
		if err := r.ctx.Err(); err != nil {
			// The caller is gone; its request wrote nothing so far and is not tried again.
			r.reply <- rowOutcome[Res]{err: fmt.Errorf("store: %s %q: not written: %w", b.ops.op, r.key, err)}
			return
		}
		switch {
		case r.busy && time.Since(r.since) >= b.cfg.LockWait:
			r.reply <- rowOutcome[Res]{err: fmt.Errorf("store: %s %q: gave up after %s: %w", b.ops.op, r.key, b.cfg.LockWait, ErrRowBusy)}
			return
		case !r.busy && r.tries >= b.cfg.MaxTries:
			r.reply <- rowOutcome[Res]{err: fmt.Errorf("store: %s %q: nothing written after %d tries: %w", b.ops.op, r.key, r.tries, r.last)}
			return
		}
		if r.busy {
			t := time.NewTimer(pause)
			select {
			case <-t.C:
			case <-r.ctx.Done():
				t.Stop()
				continue
			}
			pause = min(2*pause, 50*time.Millisecond)
		}
		// The caller leaving cancels a statement that is its alone. At most
		// max(4, 2×MaxInFlight) lone statements of a kind run at once, beside the batches'.
		ctx, cancel := context.WithCancel(context.Background())
		stop := context.AfterFunc(r.ctx, cancel)
		select {
		case b.lone <- struct{}{}:
		case <-r.ctx.Done():
			stop()
			cancel()
			continue // answered as gone at the top of the loop
		}
		again := b.try(ctx, []*groupReq[Req, Res]{r})
		<-b.lone
		stop()
		cancel()
		if len(again) == 0 {
			return
		}
	}
}

// try runs one statement for reqs (distinct jobs, sorted by key) and answers every
// request whose outcome it knows; it returns the requests to try again (nothing of them
// was written).
func (b *batcher[Req, Res]) try(parent context.Context, reqs []*groupReq[Req, Res]) (again []*groupReq[Req, Res]) {
	in, keys := b.startTry(reqs)
	ctx, cancel := context.WithTimeout(parent, b.cfg.TryTimeout)
	defer cancel()
	out, err := b.send(ctx, in, keys)
	if err != nil {
		if !maybeWritten(err) {
			return b.unwritten(reqs, err)
		}
		// Sent, and maybe committed: the rows tell.
		var ok bool
		if out, ok = b.resolveSent(reqs, in, err); !ok {
			return nil
		}
	}
	b.rereadRefused(reqs, in, out)
	return b.answer(reqs, out)
}

// startTry is try's first step: the requests' inputs and keys, each request's try
// counted, and the statement counted in the batcher's statistics.
func (b *batcher[Req, Res]) startTry(reqs []*groupReq[Req, Res]) (in []Req, keys []string) {
	in = make([]Req, len(reqs))
	keys = make([]string, len(reqs))
	for i, r := range reqs {
		in[i], keys[i] = r.req, r.key
		r.tries++
	}
	b.batches.Add(1)
	b.rows.Add(int64(len(reqs)))
	return in, keys
}

// send is the step that runs the statement, between the test hooks before and after.
func (b *batcher[Req, Res]) send(ctx context.Context, in []Req, keys []string) (out []rowOutcome[Res], err error) {
	if h := b.hooks; h != nil && h.before != nil {
		err = h.before(keys)
	}
	if err == nil {
		out, err = b.ops.exec(ctx, in, lockSkip)
	}
	if err == nil {
		if h := b.hooks; h != nil && h.after != nil {
			if herr := h.after(keys); herr != nil {
				out, err = nil, herr
			}
		}
	}
	return out, err
}

// unwritten is the step for a statement of which nothing was written (err): it answers a
// lone request refused by the server and returns the others to try again.
func (b *batcher[Req, Res]) unwritten(reqs []*groupReq[Req, Res], err error) (again []*groupReq[Req, Res]) {
	// Nothing of the statement was written: never sent, or refused by the server
	// (the transaction rolled back). Each request is tried on its own, so one bad
	// row can not fail the others; a lone request gets a server's error as is.
	var pgErr *pgconn.PgError
	for _, r := range reqs {
		if len(reqs) == 1 && errors.As(err, &pgErr) {
			r.reply <- rowOutcome[Res]{err: fmt.Errorf("store: %s %q: %w", b.ops.op, r.key, err)}
			continue
		}
		if len(reqs) > 1 {
			r.tries-- // a batch that failed as a whole does not count against each job
		}
		r.busy, r.last = false, err
		again = append(again, r)
	}
	return again
}

// resolveSent is the step for a statement that failed (err) after it was sent: it re-reads
// the rows for the outcomes. When they can not be read it answers every request with
// ErrOutcomeUnknown and returns false.
func (b *batcher[Req, Res]) resolveSent(reqs []*groupReq[Req, Res], in []Req, err error) ([]rowOutcome[Res], bool) {
	b.resolved.Add(1)
	rctx, rcancel := context.WithTimeout(context.Background(), b.cfg.TryTimeout)
	defer rcancel()
	out, rerr := b.ops.resolve(rctx, in)
	if rerr != nil {
		for _, r := range reqs {
			r.reply <- rowOutcome[Res]{err: fmt.Errorf("store: %s %q: %w: %w (re-read: %w)", b.ops.op, r.key, ErrOutcomeUnknown, err, rerr)}
		}
		return nil, false
	}
	for _, r := range reqs {
		r.last, r.maybe = err, true
	}
	return out, true
}

// rereadRefused is the step that re-reads the rows of the refused requests whose earlier
// statement may have taken effect, and takes the rows' answer where they have one.
func (b *batcher[Req, Res]) rereadRefused(reqs []*groupReq[Req, Res], in []Req, out []rowOutcome[Res]) {
	// A request whose earlier statement may have taken effect (a lost reply, a timeout
	// while the server still ran it) and that is refused now may have been refused by its
	// own earlier statement: the rows tell.
	var again1 []int
	for i, r := range reqs {
		if r.maybe && out[i].err != nil {
			again1 = append(again1, i)
		}
	}
	if len(again1) == 0 {
		return
	}
	in1 := make([]Req, len(again1))
	for j, i := range again1 {
		in1[j] = in[i]
	}
	rctx, rcancel := context.WithTimeout(context.Background(), b.cfg.TryTimeout)
	defer rcancel()
	b.resolved.Add(1)
	if out1, rerr := b.ops.resolve(rctx, in1); rerr == nil {
		for j, i := range again1 {
			if out1[j].err == nil && !out1[j].busy {
				out[i] = out1[j]
			}
		}
	}
}

// answer is try's last step: it answers every request with its outcome, except those
// whose row was locked, which it returns to try again.
func (b *batcher[Req, Res]) answer(reqs []*groupReq[Req, Res], out []rowOutcome[Res]) (again []*groupReq[Req, Res]) {
	for i, r := range reqs {
		if out[i].busy {
			b.busy.Add(1)
			if !r.busy {
				r.busy, r.since = true, time.Now()
			}
			again = append(again, r)
			continue
		}
		if r.maybe && out[i].err != nil && r.last != nil {
			// Answered by re-reading the rows: say after what, for the log.
			out[i].err = fmt.Errorf("%w (answered by re-reading the rows after: %v)", out[i].err, r.last)
		}
		r.reply <- out[i]
	}
	return again
}

// OutcomeUnknown reports whether err, from JobStart or Commit (of PG or a GroupCommitter),
// leaves open whether the statement took effect: ErrOutcomeUnknown, or a failure after a
// lone statement was sent (PG does not re-read the rows). A refusal (TransitionError),
// ErrRowBusy, ErrGroupCommitterClosed, PostgreSQL's ERROR (the statement rolled back) or a
// failure before the statement was sent is an answer, not an unknown. A start sent again
// with the same Owner is safe either way: it recognises its own earlier start.
func OutcomeUnknown(err error) bool {
	var te *TransitionError
	switch {
	case err == nil:
		return false
	case errors.Is(err, ErrOutcomeUnknown):
		return true
	case errors.As(err, &te), errors.Is(err, ErrRowBusy), errors.Is(err, ErrGroupCommitterClosed):
		return false
	}
	return maybeWritten(err)
}

// maybeWritten: err came after the statement was sent and is not the server refusing it,
// so the statement may have committed.
func maybeWritten(err error) bool {
	if pgconn.SafeToRetry(err) {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		// An ERROR rolls the statement's transaction back; FATAL or PANIC end the session
		// and may come after the commit.
		return pgErr.Severity != "ERROR"
	}
	return true
}
