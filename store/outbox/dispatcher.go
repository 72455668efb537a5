package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/internal/retry"
)

// Dispatcher defaults.
const (
	// DefaultDispatchBatchSize is how many rows one dispatch transaction claims.
	DefaultDispatchBatchSize = 500
	// DefaultPollInterval is how long an idle dispatcher waits for a notification before it
	// looks for unsent rows anyway.
	DefaultPollInterval = time.Second
	// DefaultPollJitter varies each idle wait by up to ± this fraction.
	DefaultPollJitter = 0.1
	// DefaultPublishAttempts is how many times one batch's XADDs are tried before the
	// batch rolls back.
	DefaultPublishAttempts = 3
	// DefaultRetryBackoff is the first delay after a failure; it doubles per failure.
	DefaultRetryBackoff = 100 * time.Millisecond
	// DefaultRetryBackoffMax caps the delay after failures.
	DefaultRetryBackoffMax = 5 * time.Second
	// DefaultQueryTimeout bounds every PostgreSQL statement.
	DefaultQueryTimeout = 10 * time.Second
	// DefaultRedisTimeout bounds every Redis round trip (except a consumer's blocking read,
	// which is bounded by its Block).
	DefaultRedisTimeout = 5 * time.Second
	// DefaultTrimInterval is how often a dispatcher trims one topic (TrimConsumed): the
	// acknowledged entries, and the length cap.
	DefaultTrimInterval = time.Minute
	// DefaultMaxLen is the length cap of each stream under TrimConsumed: the most entries
	// a trim leaves in it (see DispatcherConfig.MaxLen). About 0.4 GB of Redis memory with
	// the runner's events: 399 bytes each, measured (docs/OPERATIONS.md, Bounded Redis).
	DefaultMaxLen = 1_000_000
	// NoMaxLen as DispatcherConfig.MaxLen turns the length cap off: only acknowledged
	// entries are trimmed, and a consumer group that stops reading grows the stream
	// without bound.
	NoMaxLen = -1
	// DefaultLossLogInterval is the least time between two log lines about events the
	// length cap took from consumer groups, per topic.
	DefaultLossLogInterval = 10 * time.Minute
)

// TrimPolicy says whether a Dispatcher trims the streams it publishes to.
type TrimPolicy int

const (
	// TrimConsumed, the default (the zero value): after a batch, at most once per
	// TrimInterval per topic, the dispatcher removes the entries every consumer group has
	// delivered and acknowledged (Trimmer.Trim; see the package doc for the bound), and
	// caps the stream at MaxLen entries, counting what the cap takes from groups that had
	// not acknowledged it (see the package doc, Trimming).
	TrimConsumed TrimPolicy = iota
	// TrimNever: the dispatcher never trims, the length cap included; streams grow until
	// something else trims them (a Trimmer run by an operator) or Redis runs out of memory.
	TrimNever
)

// String implements fmt.Stringer: "consumed" or "never", the names ParseTrimPolicy reads.
func (p TrimPolicy) String() string {
	switch p {
	case TrimNever:
		return "never"
	case TrimConsumed:
		return "consumed"
	}
	return "TrimPolicy(" + strconv.Itoa(int(p)) + ")"
}

// ParseTrimPolicy reads a policy by its name: "consumed" or "never".
func ParseTrimPolicy(s string) (TrimPolicy, error) {
	switch s {
	case "consumed":
		return TrimConsumed, nil
	case "never":
		return TrimNever, nil
	}
	return 0, fmt.Errorf("outbox: trim policy %q: want consumed or never", s)
}

// MarshalText implements encoding.TextMarshaler (the policy's name).
func (p TrimPolicy) MarshalText() ([]byte, error) {
	if p != TrimConsumed && p != TrimNever {
		return nil, fmt.Errorf("outbox: unknown trim policy %d", int(p))
	}
	return []byte(p.String()), nil
}

// UnmarshalText implements encoding.TextUnmarshaler (see ParseTrimPolicy).
func (p *TrimPolicy) UnmarshalText(b []byte) error {
	v, err := ParseTrimPolicy(string(b))
	if err != nil {
		return err
	}
	*p = v
	return nil
}

// DispatcherConfig configures a Dispatcher. The zero value is valid: every field has a
// default.
type DispatcherConfig struct {
	// Prefix of the stream keys (<Prefix>stream:{<topic>}) and epoch markers. Defaults to
	// DefaultPrefix.
	Prefix string
	// BatchSize is the most rows claimed and published per transaction. Defaults to
	// DefaultDispatchBatchSize.
	BatchSize int
	// PollInterval is the longest an idle dispatcher waits before it looks for unsent rows
	// without a notification; also the most time between two checks of every stream's
	// epoch and length by the background loop, busy or idle. Defaults to
	// DefaultPollInterval.
	PollInterval time.Duration
	// DisableNotify turns off LISTEN on NotifyChannel: the dispatcher only polls. Defaults
	// to false (listen).
	DisableNotify bool
	// PublishAttempts is how many times a batch's XADDs are tried (only the failed ones are
	// retried) before the batch rolls back. Defaults to DefaultPublishAttempts.
	PublishAttempts int
	// RetryBackoff is the first delay after a failed publish attempt or a failed batch.
	// Defaults to DefaultRetryBackoff.
	RetryBackoff time.Duration
	// RetryBackoffMax caps those delays. Defaults to DefaultRetryBackoffMax.
	RetryBackoffMax time.Duration
	// QueryTimeout bounds every PostgreSQL statement. Defaults to DefaultQueryTimeout.
	QueryTimeout time.Duration
	// RedisTimeout bounds every Redis round trip. Defaults to DefaultRedisTimeout.
	RedisTimeout time.Duration
	// Trim is the trimming policy of the streams the dispatcher publishes to. Defaults to
	// TrimConsumed (the zero value): entries every consumer group acknowledged are
	// removed, and MaxLen caps each stream. TrimNever turns every trim off, the cap
	// included.
	Trim TrimPolicy
	// TrimInterval is the least time between two trims of one topic by this dispatcher
	// under TrimConsumed (both the acknowledged entries and the cap). A trim rides on a batch that publishes
	// to the topic: the cap is one more command in the batch's XADD pipeline, the
	// acknowledged entries one round trip after the commit. Between two trims a stream
	// grows by what is published to it meanwhile. Defaults to DefaultTrimInterval.
	TrimInterval time.Duration
	// MaxLen caps each stream under TrimConsumed: a trim that finds a stream longer
	// removes its oldest entries down to MaxLen (exactly), whether every consumer group
	// acknowledged them or not. A consumer group that had not acknowledged a removed entry
	// (never delivered to it, or delivered and pending) loses that event: counted in
	// idemscrape_outbox_stream_cap_lost_total{topic,group} and logged (see
	// LossLogInterval). Between two trims a stream may exceed MaxLen by what was
	// published in between. Must be 0, NoMaxLen (no cap: a group that stops reading grows
	// the stream without bound) or at least BatchSize; must be 0 under TrimNever. Defaults
	// to DefaultMaxLen.
	MaxLen int
	// LossLogInterval is the window of the log lines (level ERROR) about events the cap
	// took from consumer groups, per topic: a topic's first loss is logged at once and
	// opens a window; within it, only a group that starts losing is logged (at once);
	// other losses are counted in the metrics and summed into the next line, written by
	// the first loss after the window. Defaults to DefaultLossLogInterval.
	LossLogInterval time.Duration
	// RecoverWindow is how far back, by creation time, a topic's rows are dispatched again
	// when Redis lost its stream's data (its position moves back; see the package doc,
	// Redis data loss): events created earlier are assumed consumed. Keep it longer than consumers can lag, and shorter than the outbox
	// retention (PruneSent), the inbox retention and the ledger TTL. Defaults to
	// DefaultRecoverWindow.
	RecoverWindow time.Duration
	// RecoverBatch is how many rows one step of a recovery's walk back over a topic's rows
	// reads; the walk ends after a whole step of rows older than RecoverWindow. Defaults to
	// DefaultRecoverBatch.
	RecoverBatch int

	// PreparedAlertAge is how long ago a transaction must have been prepared (PREPARE
	// TRANSACTION) in the dispatcher's database for the dispatcher to report it: such a
	// transaction holds every topic's dispatch back until it is committed or rolled back
	// (COMMIT PREPARED / ROLLBACK PREPARED 'gid'). One prepared in another database of the
	// server holds nothing back and is not reported (see the package doc, the horizon).
	// The background loop reads pg_prepared_xacts every PreparedAlertAge/4, or every
	// PollInterval if that is longer (one statement on a view of shared memory), sets
	// idemscrape_outbox_horizon_held_by_prepared{database} to the number found and logs
	// each at level WARN with its gid, database and age: once when first found, then once
	// per DefaultPreparedLogInterval while it stays. Defaults to DefaultPreparedAlertAge.
	PreparedAlertAge time.Duration

	// AfterPublish is a failpoint for tests and chaos runs. When set, it is called with the
	// outbox ids of a batch after all of the batch's XADDs succeeded and before the
	// topic's position moves past them. Returning an error aborts the batch as a crash at
	// that point would: the transaction rolls back, the position stays, the entries stay in the stream
	// and the rows are published again by a later batch (counted as republished).
	// Defaults to nil.
	AfterPublish func(ids []int64) error
	// OnBatch, when set, is called by the background loop after every batch it ran, with
	// the number of rows dispatched and the batch's error. A test signal; it must not
	// block for long. Defaults to nil.
	OnBatch func(sent int, err error)

	// Registerer receives the metrics. Defaults to a new private registry (never the
	// global default registry).
	Registerer prometheus.Registerer
	// Logger receives the dispatcher's logs. Defaults to slog.Default().
	Logger *slog.Logger
}

// Validate reports the first invalid field. Zero values are valid (they mean the default).
func (c *DispatcherConfig) Validate() error {
	switch {
	case c.BatchSize < 0:
		return fmt.Errorf("outbox: DispatcherConfig.BatchSize %d is negative", c.BatchSize)
	case c.PollInterval < 0:
		return fmt.Errorf("outbox: DispatcherConfig.PollInterval %v is negative", c.PollInterval)
	case c.PublishAttempts < 0:
		return fmt.Errorf("outbox: DispatcherConfig.PublishAttempts %d is negative", c.PublishAttempts)
	case c.RetryBackoff < 0 || c.RetryBackoffMax < 0:
		return fmt.Errorf("outbox: DispatcherConfig.RetryBackoff %v / RetryBackoffMax %v is negative", c.RetryBackoff, c.RetryBackoffMax)
	case c.RetryBackoff > 0 && c.RetryBackoffMax > 0 && c.RetryBackoff > c.RetryBackoffMax:
		return fmt.Errorf("outbox: DispatcherConfig.RetryBackoff %v exceeds RetryBackoffMax %v", c.RetryBackoff, c.RetryBackoffMax)
	case c.QueryTimeout < 0 || c.RedisTimeout < 0:
		return fmt.Errorf("outbox: DispatcherConfig.QueryTimeout %v / RedisTimeout %v is negative", c.QueryTimeout, c.RedisTimeout)
	case c.Trim != TrimNever && c.Trim != TrimConsumed:
		return fmt.Errorf("outbox: DispatcherConfig.Trim: unknown policy %v", c.Trim)
	case c.TrimInterval < 0:
		return fmt.Errorf("outbox: DispatcherConfig.TrimInterval %v is negative", c.TrimInterval)
	case c.MaxLen < NoMaxLen:
		return fmt.Errorf("outbox: DispatcherConfig.MaxLen %d: want a number of entries, 0 (DefaultMaxLen) or NoMaxLen (-1, no cap)", c.MaxLen)
	case c.MaxLen > 0 && c.Trim == TrimNever:
		return fmt.Errorf("outbox: DispatcherConfig.MaxLen %d is set but Trim is never, which turns the cap off too", c.MaxLen)
	case c.MaxLen > 0 && c.MaxLen < c.batchSize():
		return fmt.Errorf("outbox: DispatcherConfig.MaxLen %d is below the batch size %d: a batch could be trimmed away before anyone read it",
			c.MaxLen, c.batchSize())
	case c.LossLogInterval < 0:
		return fmt.Errorf("outbox: DispatcherConfig.LossLogInterval %v is negative", c.LossLogInterval)
	case c.PreparedAlertAge < 0:
		return fmt.Errorf("outbox: DispatcherConfig.PreparedAlertAge %v is negative", c.PreparedAlertAge)
	case c.RecoverWindow < 0 || c.RecoverBatch < 0:
		return fmt.Errorf("outbox: DispatcherConfig.RecoverWindow %v / RecoverBatch %d is negative", c.RecoverWindow, c.RecoverBatch)
	}
	return nil
}

// batchSize is BatchSize or its default.
func (c *DispatcherConfig) batchSize() int {
	if c.BatchSize == 0 {
		return DefaultDispatchBatchSize
	}
	return c.BatchSize
}

func (c *DispatcherConfig) withDefaults() DispatcherConfig {
	out := *c
	if out.Prefix == "" {
		out.Prefix = DefaultPrefix
	}
	if out.BatchSize == 0 {
		out.BatchSize = DefaultDispatchBatchSize
	}
	if out.PollInterval == 0 {
		out.PollInterval = DefaultPollInterval
	}
	if out.PublishAttempts == 0 {
		out.PublishAttempts = DefaultPublishAttempts
	}
	out.RetryBackoff, out.RetryBackoffMax = backoffDefaults(out.RetryBackoff, out.RetryBackoffMax)
	if out.QueryTimeout == 0 {
		out.QueryTimeout = DefaultQueryTimeout
	}
	if out.RedisTimeout == 0 {
		out.RedisTimeout = DefaultRedisTimeout
	}
	if out.TrimInterval == 0 {
		out.TrimInterval = DefaultTrimInterval
	}
	if out.MaxLen == 0 && out.Trim == TrimConsumed {
		out.MaxLen = DefaultMaxLen
	}
	if out.LossLogInterval == 0 {
		out.LossLogInterval = DefaultLossLogInterval
	}
	if out.PreparedAlertAge == 0 {
		out.PreparedAlertAge = DefaultPreparedAlertAge
	}
	if out.RecoverWindow == 0 {
		out.RecoverWindow = DefaultRecoverWindow
	}
	if out.RecoverBatch == 0 {
		out.RecoverBatch = DefaultRecoverBatch
	}
	if out.Registerer == nil {
		out.Registerer = prometheus.NewRegistry()
	}
	if out.Logger == nil {
		out.Logger = slog.Default()
	}
	return out
}

// Dispatcher moves committed outbox rows to Redis Streams; see the package doc for its
// guarantees. It is safe for concurrent use, and any number of dispatchers (in any number
// of processes) may work on one outbox table at once.
type Dispatcher struct {
	pool    *pgxpool.Pool
	rdb     redis.UniversalClient
	cfg     DispatcherConfig
	log     *slog.Logger
	metrics *DispatcherMetrics
	trimmer *Trimmer

	wake chan struct{} // buffered(1): a notification arrived

	mu     sync.Mutex // guards the fields below (Start/Stop)
	cancel context.CancelFunc
	done   chan struct{} // closed when the loop and the listener have returned

	trimMu   sync.Mutex             // guards lastTrim and losses
	lastTrim map[string]time.Time   // topic → when this dispatcher last trimmed it
	losses   map[string]*lossWindow // topic → what the cap took since its last log line
	capStep  int                    // most entries one cap.lua call removes (defaultCapStep)

	lockKey   int64             // recoverLockKey(Prefix)
	epochMu   sync.Mutex        // guards epochs, floors and refreshed
	epochs    map[string]string // topic → its epoch, as last found in PostgreSQL and the marker alike
	floors    map[string]int64  // topic → the entries-added of its stream PostgreSQL recorded, as last read
	refreshed time.Time         // when the idle check last read every epoch from PostgreSQL

	posMu      sync.Mutex // guards lastTopic and discovered
	lastTopic  string     // the topic of this dispatcher's last batch (claimSQL's round robin)
	discovered time.Time  // when this dispatcher last looked for topics without a position

	preparedMu      sync.Mutex           // guards preparedChecked and preparedLogged
	preparedChecked time.Time            // when the loop last read pg_prepared_xacts
	preparedLogged  map[string]time.Time // gid → when its prepared transaction was last logged

	beforeSettle  func(topics []string) // test hook (export_test.go): a batch found topics unsettled
	beforePublish func(topics []string) // test hook (export_test.go): a batch checked its streams
}

// NewDispatcher returns a dispatcher that reads the outbox table through pool and
// publishes to rdb. cfg may be nil (all defaults). It does not start the background loop
// (Start does) and does no I/O.
func NewDispatcher(pool *pgxpool.Pool, rdb redis.UniversalClient, cfg *DispatcherConfig) (*Dispatcher, error) {
	if pool == nil || rdb == nil {
		return nil, errors.New("outbox: NewDispatcher: pool and rdb are required")
	}
	if cfg == nil {
		cfg = &DispatcherConfig{}
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	c := cfg.withDefaults()
	m, err := newDispatcherMetrics(c.Registerer)
	if err != nil {
		return nil, err
	}
	d := &Dispatcher{
		pool: pool, rdb: rdb, cfg: c, log: c.Logger, metrics: m,
		wake:     make(chan struct{}, 1),
		lastTrim: make(map[string]time.Time),
		losses:   make(map[string]*lossWindow),
		capStep:  defaultCapStep,
		lockKey:  recoverLockKey(c.Prefix),
		epochs:   make(map[string]string),
		floors:   make(map[string]int64),
	}
	if c.Trim == TrimConsumed {
		d.trimmer, err = NewTrimmer(rdb, &TrimmerConfig{Prefix: c.Prefix, RedisTimeout: c.RedisTimeout, Logger: c.Logger})
		if err != nil {
			return nil, err
		}
	}
	return d, nil
}

// Metrics returns the dispatcher's collectors (shared with other components registered on
// the same Registerer).
func (d *Dispatcher) Metrics() *DispatcherMetrics { return d.metrics }

// outboxRow is one claimed row.
type outboxRow struct {
	xid       string // outbox.xid (xid8, as text): the inserting transaction
	id        int64
	eventKey  string
	topic     string
	payload   string
	createdAt time.Time
	added     int64 // outbox_epochs.entries_added of the topic when the row was claimed
}

// DispatchOnce runs one batch: it takes a topic whose position no other dispatcher holds,
// reads up to BatchSize of its rows after the position and behind the horizon (see the
// package doc), publishes them and moves the position past them, in one transaction. It
// returns the number of rows dispatched; on error the position stays (some rows may have
// been published: they are published again by a later batch). A result equal to BatchSize
// means more rows may be waiting. A batch whose topic's epoch marker is not the epoch
// PostgreSQL holds (Redis lost its data, or the topic has no epoch yet) is rolled back
// before anything is published, the epoch settled (see the package doc) and a batch
// taken again, once. Topics without a position get one when no batch was found, and at
// least once per PollInterval.
func (d *Dispatcher) DispatchOnce(ctx context.Context) (int, error) {
	if d.discoveryDue() {
		if _, err := d.discover(ctx); err != nil {
			return 0, err
		}
	}
	discovered := false
	var settled []string // topics this call settled: a batch of another topic may come next
	for {
		n, unsettled, err := d.dispatchBatch(ctx)
		if err == nil && n == 0 && len(unsettled) == 0 && !discovered {
			discovered = true
			if found, err := d.discover(ctx); err != nil || !found {
				return 0, err
			}
			continue // a new topic: its rows are waiting
		}
		if len(unsettled) == 0 {
			return n, err
		}
		for _, t := range unsettled {
			if slices.Contains(settled, t) {
				return 0, fmt.Errorf("outbox: dispatch: epoch markers of %q differ from PostgreSQL's again right after they were settled (is Redis losing its data?)", unsettled)
			}
		}
		settled = append(settled, unsettled...)
		if d.beforeSettle != nil {
			d.beforeSettle(unsettled)
		}
		if _, err := d.settle(ctx, unsettled); err != nil {
			return 0, err
		}
	}
}

// dispatchBatch is one try of DispatchOnce. unsettled lists the batch's topics whose epoch
// marker is not the epoch PostgreSQL holds; the batch is then rolled back unpublished (its
// topic's position stays).
func (d *Dispatcher) dispatchBatch(ctx context.Context) (sent int, unsettled []string, err error) {
	qctx, cancel := context.WithTimeout(ctx, d.cfg.QueryTimeout)
	tx, err := d.pool.Begin(qctx)
	cancel()
	if err != nil {
		return 0, nil, fmt.Errorf("outbox: dispatch: begin: %w", err)
	}
	defer func() {
		// A no-op after Commit. Detached from ctx so a cancelled caller still frees the
		// row locks at once instead of when the connection is reaped.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), d.cfg.QueryTimeout)
		_ = tx.Rollback(rctx)
		cancel()
	}()

	rows, err := d.claim(ctx, tx)
	if err != nil || len(rows) == 0 {
		return 0, nil, err
	}

	// The epoch markers of the batch's topics are read before anything is published (one
	// round trip per batch; a topic whose marker this dispatcher has not matched with
	// PostgreSQL yet costs one statement more, in the batch's transaction, under the shared
	// lock): a batch never appends to a stream whose marker is absent or not PostgreSQL's
	// epoch, so a lost stream gets nothing from the dispatchers until it is recovered.
	// The claim read how many entries PostgreSQL recorded as added to each stream: a
	// stream that has fewer lost its newest entries (an older copy came back).
	var topics []string
	floors := make(map[string]int64)
	for _, r := range rows {
		if _, seen := floors[r.topic]; !seen {
			topics = append(topics, r.topic)
		}
		floors[r.topic] = r.added
	}
	unsettled, err = d.unsettled(ctx, tx, topics, floors)
	if err != nil || len(unsettled) > 0 {
		return 0, unsettled, err
	}
	if d.beforePublish != nil {
		d.beforePublish(topics)
	}

	// The topics due for a trim get their length cap in the XADD pipeline (no round trip
	// of its own) and their trim of acknowledged entries after the commit.
	due := d.dueTrims(topics)
	var caps []string
	if d.cfg.MaxLen != NoMaxLen {
		caps = due
	}
	published, capAgain, after, err := d.publish(ctx, rows, caps)
	if err != nil {
		d.countRepublished(rows, published)
		return 0, nil, err
	}
	// What PostgreSQL records of each stream: its entries-added as read right after the
	// batch's last XADD to it (in the XADDs' pipeline). The batch's entries lie within that
	// count whatever other dispatchers appended before, between or after them, so a copy of
	// the stream that lacks any of them has fewer entries added. (What the stream had before
	// the batch plus the batch's own would not do: batches that read the stream before
	// either appended would each record less than both added.)
	added := make([]int64, len(topics))
	for i, t := range topics {
		s := after[t] // every topic of the batch: publish succeeded
		if s.err != nil {
			// The read in the pipeline failed: a connection that broke after the XADDs, or a
			// NOSCRIPT (Redis restarted since the check). A read in another round trip might
			// reach a Redis that came back without the batch's entries, and record a count
			// that misses them: the batch rolls back instead, and its rows go again.
			d.countRepublished(rows, published)
			return 0, nil, fmt.Errorf("outbox: dispatch: read the entries-added of %q's stream after publishing (the batch rolls back; its rows are published again): %w", t, s.err)
		}
		added[i] = s.added
	}

	ids := make([]int64, len(rows))
	for i, r := range rows {
		ids[i] = r.id
	}
	if d.cfg.AfterPublish != nil {
		if err := d.cfg.AfterPublish(ids); err != nil {
			d.countRepublished(rows, published)
			return 0, nil, fmt.Errorf("outbox: dispatch: AfterPublish failpoint: %w", err)
		}
	}

	qctx, cancel = context.WithTimeout(ctx, d.cfg.QueryTimeout)
	defer cancel()
	lastRow := rows[len(rows)-1]
	if _, err := tx.Exec(qctx, advanceSQL, lastRow.topic, lastRow.xid, lastRow.id, added[0], d.cfg.Prefix); err != nil {
		d.countRepublished(rows, published)
		return 0, nil, fmt.Errorf("outbox: dispatch: move %q's position past %d rows: %w", lastRow.topic, len(ids), err)
	}
	if err := tx.Commit(qctx); err != nil {
		// The commit may have happened; if so the republished count is one batch too high.
		d.countRepublished(rows, published)
		return 0, nil, fmt.Errorf("outbox: dispatch: commit: %w", err)
	}
	d.trim(ctx, due, capAgain)
	return len(rows), nil, nil
}

// advanceSQL moves a topic's position past the last row of its batch and raises the
// entries-added PostgreSQL records of the topic's stream (to the count read after the
// batch's XADDs: the record is the greatest such count of the committed batches), in one
// statement: two row writes per batch, none per event. Both are HOT updates (no indexed
// column changes).
const advanceSQL = `
WITH moved AS (
	UPDATE outbox_positions SET xid = $2::xid8, id = $3, updated_at = now() WHERE topic = $1
)
UPDATE outbox_epochs e SET entries_added = $4
WHERE e.prefix = $5 AND e.topic = $1 AND e.entries_added < $4`

func (d *Dispatcher) claim(ctx context.Context, tx pgx.Tx) ([]outboxRow, error) {
	qctx, cancel := context.WithTimeout(ctx, d.cfg.QueryTimeout)
	defer cancel()
	d.posMu.Lock()
	last := d.lastTopic
	d.posMu.Unlock()
	rows, _ := tx.Query(qctx, claimSQL, d.lockKey, last, d.cfg.Prefix, d.cfg.BatchSize)
	var r outboxRow
	out := make([]outboxRow, 0, d.cfg.BatchSize)
	_, err := pgx.ForEachRow(rows, []any{&r.topic, &r.xid, &r.id, &r.eventKey, &r.payload, &r.createdAt, &r.added}, func() error {
		out = append(out, r)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("outbox: dispatch: claim: %w", err)
	}
	if len(out) > 0 {
		d.posMu.Lock()
		d.lastTopic = out[0].topic
		d.posMu.Unlock()
	}
	return out, nil
}

// claimSQL takes a topic that has rows waiting behind the horizon and whose position no
// other dispatcher holds (FOR UPDATE SKIP LOCKED: the dispatchers of one topic take turns,
// those of different topics work side by side), the topic after the one this dispatcher
// served last first ($2: round robin, so that a busy topic does not starve the others),
// and reads up to $4 of its rows after the position, in (xid, id) order, with the
// entries-added PostgreSQL recorded of its stream.
//
// The horizon: the smallest transaction id that was still running when the statement's
// snapshot was taken (pg_snapshot_xip) and may belong to this database, or, when none, the
// snapshot's xmax. Every transaction below it has ended and the snapshot sees every one of
// them that committed, so a row below it is final; a row at or above it may still be
// joined by rows of a transaction that commits later with a smaller (xid, id) than rows
// already read, so it waits. The position only ever moves over rows below the horizon, so
// a row can never appear behind it. A running transaction that pg_stat_activity, read
// after the snapshot, shows in another database, or a prepared one that pg_prepared_xacts
// shows in another database, can never insert into this outbox and does not hold the
// horizon back (pg_snapshot_xmin alone would: any write transaction, or any forgotten
// prepared transaction, on the server would); one that neither shows in another database
// (of this database, ended since, or hidden from this role) does, to be safe. The proof,
// and what the dispatcher reports about transactions prepared in this database, which hold
// it legitimately: prepared.go.
//
// The shared recovery lock ($1) is taken before the position's row lock (a one-time
// filter, evaluated before the scan) and held until the batch commits or rolls back: a
// recovery (exclusive) waits for batches in flight, holds new batches back while it
// moves positions, and never waits for a position a batch holds.
const claimSQL = `
WITH horizon AS MATERIALIZED (
	SELECT least(pg_snapshot_xmax(s.s), (
		SELECT min(x) FROM pg_snapshot_xip(s.s) AS x
		WHERE NOT EXISTS (SELECT 1 FROM pg_stat_activity a
			WHERE a.backend_xid = x::xid AND a.datid IS NOT NULL AND a.datname <> current_database())
		AND NOT EXISTS (SELECT 1 FROM pg_prepared_xacts p
			WHERE p.transaction = x::xid AND p.database <> current_database())
	)) AS h
	FROM (SELECT pg_current_snapshot() AS s) s
), pos AS (
	SELECT p.topic, p.xid, p.id FROM outbox_positions p
	WHERE (SELECT 1 FROM (SELECT pg_advisory_xact_lock_shared($1::bigint)) l) = 1
		AND EXISTS (SELECT 1 FROM outbox o WHERE o.topic = p.topic AND (o.xid, o.id) > (p.xid, p.id)
			AND o.xid < (SELECT h FROM horizon))
	ORDER BY p.topic <= $2, p.topic
	LIMIT 1
	FOR UPDATE OF p SKIP LOCKED
)
SELECT pos.topic, o.xid::text, o.id, o.event_key, o.payload::text, o.created_at,
	COALESCE((SELECT e.entries_added FROM outbox_epochs e WHERE e.prefix = $3 AND e.topic = pos.topic), 0)
FROM pos CROSS JOIN LATERAL (
	SELECT o.xid, o.id, o.event_key, o.payload, o.created_at FROM outbox o
	WHERE o.topic = pos.topic AND (o.xid, o.id) > (pos.xid, pos.id)
		AND o.xid < (SELECT h FROM horizon)
	ORDER BY o.xid, o.id
	LIMIT $4
) o
ORDER BY o.xid, o.id`

// discoverSQL gives every topic of the outbox that has no position yet one at (0, 0): its
// rows were never dispatched. The topics are found by a walk over outbox_topic_xid_idx
// (one index descent per topic), not a scan of the table.
const discoverSQL = `
WITH RECURSIVE t(topic) AS (
	SELECT min(topic) FROM outbox
	UNION ALL
	SELECT (SELECT min(o.topic) FROM outbox o WHERE o.topic > t.topic) FROM t WHERE t.topic IS NOT NULL
)
INSERT INTO outbox_positions (topic)
SELECT t.topic FROM t
WHERE t.topic IS NOT NULL AND NOT EXISTS (SELECT 1 FROM outbox_positions p WHERE p.topic = t.topic)
ON CONFLICT (topic) DO NOTHING`

// discover runs discoverSQL and reports whether it gave a topic its first position.
func (d *Dispatcher) discover(ctx context.Context) (bool, error) {
	qctx, cancel := context.WithTimeout(ctx, d.cfg.QueryTimeout)
	defer cancel()
	tag, err := d.pool.Exec(qctx, discoverSQL)
	if err != nil {
		return false, fmt.Errorf("outbox: dispatch: find new topics (table outbox_positions, migration 00020): %w", err)
	}
	d.posMu.Lock()
	d.discovered = time.Now()
	d.posMu.Unlock()
	return tag.RowsAffected() > 0, nil
}

// discoveryDue reports whether the last discover is PollInterval old (or there was none).
func (d *Dispatcher) discoveryDue() bool {
	d.posMu.Lock()
	defer d.posMu.Unlock()
	return d.discovered.IsZero() || time.Since(d.discovered) >= d.cfg.PollInterval
}

// publish XADDs rows in one pipeline, retrying only the XADDs that failed, up to
// PublishAttempts rounds. published[i] reports whether row i's XADD succeeded. Each round
// reads, after its XADDs and in the same pipeline, the state of each stream it appended to
// (state.lua): after holds, per topic, the read that followed the topic's last XADD (its
// err set when that read failed). The first round also caps the streams of the topics in
// caps (cap.lua after the XADDs, in the same pipeline); capAgain lists the topics whose
// cap must run again on its own (the script was not cached, or the step left entries
// above the cap).
func (d *Dispatcher) publish(ctx context.Context, rows []outboxRow, caps []string) (published []bool, capAgain []string, after map[string]epochState, err error) {
	published = make([]bool, len(rows))
	after = make(map[string]epochState)
	todo := make([]int, len(rows))
	for i := range rows {
		todo[i] = i
	}
	for attempt := 1; ; attempt++ {
		var failed []int
		var capCmds []*redis.Cmd
		failed, capCmds, err = d.xadd(ctx, rows, todo, published, caps, after)
		capAgain = append(capAgain, d.capped(ctx, caps, capCmds)...)
		caps = nil
		if err == nil {
			return published, capAgain, after, nil
		}
		d.log.WarnContext(ctx, "outbox: publish failed", "attempt", attempt, "of", d.cfg.PublishAttempts,
			"failed", len(failed), "batch", len(rows), "err", err)
		if attempt >= d.cfg.PublishAttempts {
			return published, nil, nil, fmt.Errorf("outbox: dispatch: publish %d of %d rows failed after %d attempts: %w",
				len(failed), len(rows), attempt, err)
		}
		if !retry.Sleep(ctx, retry.Equal(d.cfg.RetryBackoff, d.cfg.RetryBackoffMax, attempt)) {
			return published, nil, nil, fmt.Errorf("outbox: dispatch: publish: %w (last error: %v)", context.Cause(ctx), err)
		}
		todo = failed
	}
}

// capped records the results of the cap commands of a publish round and returns the
// topics whose cap must run again on its own.
func (d *Dispatcher) capped(ctx context.Context, caps []string, cmds []*redis.Cmd) (again []string) {
	for k, topic := range caps {
		v, err := cmds[k].Result()
		if redis.HasErrorPrefix(err, "NOSCRIPT") {
			again = append(again, topic) // Redis lost its script cache: EVAL after the commit
			continue
		}
		var res capResult
		if err == nil {
			res, err = parseCapReply(v)
		}
		if err != nil {
			d.log.WarnContext(ctx, "outbox: stream length cap failed; it runs again at the next trim", "topic", topic, "err", err)
			continue
		}
		d.recordCap(ctx, topic, res)
		if res.over > 0 && res.removed > 0 {
			again = append(again, topic)
		}
	}
	return again
}

// xadd is one round of publish: the XADDs of the rows todo, the caps, then state.lua for
// each stream the XADDs append to (after[topic] replaced by its reply), in one pipeline.
func (d *Dispatcher) xadd(ctx context.Context, rows []outboxRow, todo []int, published []bool, caps []string, after map[string]epochState) (failed []int, capCmds []*redis.Cmd, err error) {
	rctx, cancel := context.WithTimeout(ctx, d.cfg.RedisTimeout)
	defer cancel()
	cmds := make([]*redis.StringCmd, len(todo))
	var topics []string
	for _, i := range todo {
		if !slices.Contains(topics, rows[i].topic) {
			topics = append(topics, rows[i].topic)
		}
	}
	stateCmds := make([]*redis.Cmd, len(topics))
	capCmds = make([]*redis.Cmd, len(caps))
	_, err = d.rdb.Pipelined(rctx, func(p redis.Pipeliner) error {
		for j, i := range todo {
			r := rows[i]
			cmds[j] = p.XAdd(rctx, &redis.XAddArgs{
				Stream: StreamKey(d.cfg.Prefix, r.topic),
				Values: []any{
					FieldEventKey, r.eventKey,
					FieldTopic, r.topic,
					FieldPayload, r.payload,
					FieldOutboxID, strconv.FormatInt(r.id, 10),
					FieldCreatedAt, r.createdAt.UTC().Format(time.RFC3339Nano),
				},
			})
		}
		for k, topic := range caps {
			capCmds[k] = capScript.EvalSha(rctx, p, []string{StreamKey(d.cfg.Prefix, topic)}, d.capArgs()...)
		}
		// After the caps, which do not change entries-added: the length read is the capped one.
		for k, topic := range topics {
			stateCmds[k] = stateScript.EvalSha(rctx, p, []string{EpochKey(d.cfg.Prefix, topic), StreamKey(d.cfg.Prefix, topic)})
		}
		return nil
	})
	for k, topic := range topics {
		// Replaces a read of an earlier round: it came before this round's XADDs.
		st := epochState{err: errors.New("not sent")}
		if stateCmds[k] != nil {
			st = parseState(stateCmds[k])
		}
		after[topic] = st
		d.recordLength(topic, st)
	}
	now := time.Now()
	var firstErr error
	for j, i := range todo {
		if cmds[j] == nil || cmds[j].Err() != nil {
			failed = append(failed, i)
			if firstErr == nil && cmds[j] != nil {
				firstErr = cmds[j].Err()
			}
			continue
		}
		published[i] = true
		d.metrics.Published.WithLabelValues(rows[i].topic).Inc()
		d.metrics.Lag.Observe(now.Sub(rows[i].createdAt).Seconds())
	}
	if len(failed) == 0 {
		return nil, capCmds, nil
	}
	if firstErr == nil {
		firstErr = err
	}
	if firstErr == nil {
		firstErr = errors.New("XADD failed")
	}
	return failed, capCmds, firstErr
}

func (d *Dispatcher) countRepublished(rows []outboxRow, published []bool) {
	n := 0
	for i, ok := range published {
		if ok {
			d.metrics.Republished.WithLabelValues(rows[i].topic).Inc()
			n++
		}
	}
	if n > 0 {
		d.log.Warn("outbox: batch rolled back after publishing; its events will be published again",
			"republished", n, "batch", len(rows))
	}
}

// dueTrims returns the topics (of a batch about to be published) that this dispatcher has
// not trimmed for TrimInterval, and marks them trimmed now. None under TrimNever.
func (d *Dispatcher) dueTrims(topics []string) []string {
	if d.cfg.Trim == TrimNever {
		return nil
	}
	now := time.Now()
	var due []string
	d.trimMu.Lock()
	defer d.trimMu.Unlock()
	for _, topic := range topics {
		if last, ok := d.lastTrim[topic]; !ok || now.Sub(last) >= d.cfg.TrimInterval {
			d.lastTrim[topic] = now
			due = append(due, topic)
		}
	}
	return due
}

// trim runs after a batch committed: the trim of acknowledged entries of the due topics
// (one round trip each), then the caps that must run on their own (capAgain, see publish).
// The acknowledged entries go first, so that a cap catching up on a long stream does not
// count as capped what the trim removes anyway.
func (d *Dispatcher) trim(ctx context.Context, due, capAgain []string) {
	for _, topic := range due {
		if _, err := d.trimmer.Trim(ctx, topic); err != nil {
			d.log.WarnContext(ctx, "outbox: trim failed", "topic", topic, "err", err)
		}
	}
	for _, topic := range capAgain {
		d.capStream(ctx, topic)
	}
	d.measureLengths(ctx, due)
}

// measureLengths reads the trimmed streams' lengths (one pipelined XLEN per trim round)
// into idemscrape_outbox_stream_length, beside their cap: the alert on a stream nearing
// its cap reads both.
func (d *Dispatcher) measureLengths(ctx context.Context, topics []string) {
	if len(topics) == 0 {
		return
	}
	rctx, cancel := context.WithTimeout(ctx, d.cfg.RedisTimeout)
	defer cancel()
	cmds := make([]*redis.IntCmd, len(topics))
	_, _ = d.rdb.Pipelined(rctx, func(p redis.Pipeliner) error {
		for i, topic := range topics {
			cmds[i] = p.XLen(rctx, StreamKey(d.cfg.Prefix, topic))
		}
		return nil
	})
	for i, topic := range topics {
		if n, err := cmds[i].Result(); err == nil {
			d.metrics.Length.WithLabelValues(topic).Set(float64(n))
		}
		if d.cfg.MaxLen > 0 {
			d.metrics.MaxLength.WithLabelValues(topic).Set(float64(d.cfg.MaxLen))
		}
	}
}

// Start runs the dispatcher in the background until Stop is called or ctx is done: it
// dispatches batches until one comes back short, then waits for a NOTIFY on NotifyChannel
// or the (jittered) PollInterval, whichever comes first. After a failed batch it waits an
// exponential backoff with jitter and tries again. When LISTEN is enabled, Start opens the
// dedicated listening connection before it returns (if PostgreSQL answers; otherwise the
// loop keeps polling and reconnects in the background), so a NOTIFY sent after Start
// returned is not missed. Calling Start on a running dispatcher does nothing.
func (d *Dispatcher) Start(ctx context.Context) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.done != nil {
		select {
		case <-d.done: // the previous run ended with its context; start anew
		default:
			return nil
		}
	}
	runCtx, cancel := context.WithCancel(ctx)
	var conn *pgx.Conn
	if !d.cfg.DisableNotify {
		var err error
		if conn, err = d.listenConn(runCtx); err != nil {
			d.log.WarnContext(ctx, "outbox: LISTEN failed; polling until it reconnects", "err", err)
		}
	}
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		d.loop(runCtx)
	}()
	if !d.cfg.DisableNotify {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d.listen(runCtx, conn)
		}()
	}
	go func() {
		wg.Wait()
		close(done)
	}()
	d.cancel, d.done = cancel, done
	return nil
}

// Stop ends the background loop after its in-flight batch (which completes: its rows are
// dispatched rather than rolled back and published again) and waits for it and the
// listening connection to finish. Safe to call more than once, and on
// a dispatcher that was never started.
func (d *Dispatcher) Stop() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.done == nil {
		return
	}
	d.cancel()
	<-d.done
	d.cancel, d.done = nil, nil
}

func (d *Dispatcher) loop(ctx context.Context) {
	failures := 0
	var lastCheck time.Time // when the loop last ran checkStreams
	// A batch runs to its end even when Stop (or the caller's context) ends the loop: its
	// rows are published already, and cutting it short would roll back the mark and publish
	// them again. Every step of a batch is bounded by QueryTimeout / RedisTimeout and
	// PublishAttempts, so Stop still returns promptly (a recovery after a Redis data loss,
	// which waits for every dispatcher's batch in flight, is bounded by recoverTimeout).
	batchCtx := context.WithoutCancel(ctx)
	for {
		n, err := d.DispatchOnce(batchCtx)
		if ctx.Err() != nil {
			return
		}
		if d.cfg.OnBatch != nil {
			d.cfg.OnBatch(n, err)
		}
		if err != nil {
			if !d.backOff(ctx, &failures, slog.LevelError, "outbox: dispatch batch failed", err) {
				return
			}
			continue
		}
		failures = 0
		full := n >= d.cfg.BatchSize // more rows are probably waiting
		if full && time.Since(lastCheck) < d.cfg.PollInterval {
			continue
		}
		// Idle, or busy for a PollInterval: make sure no stream this dispatcher watches lost
		// its data while nothing was published to it, and read every stream's length
		// (idemscrape_outbox_stream_length) on the way. The first check follows the first
		// batch, so the lengths are reported right after a start.
		lastCheck = time.Now()
		d.checkPrepared(ctx) // a transaction prepared in this database holds the horizon
		if recovered, err := d.checkStreams(ctx, false); err != nil {
			if ctx.Err() != nil {
				return
			}
			d.log.WarnContext(ctx, "outbox: checking the streams' epoch markers failed", "err", err)
		} else if len(recovered) > 0 {
			continue // rows put in front of a position again are waiting
		}
		if full {
			continue
		}
		if ctx.Err() != nil {
			return
		}
		t := time.NewTimer(retry.Jitter(d.cfg.PollInterval, DefaultPollJitter))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-d.wake:
		case <-t.C:
		}
		t.Stop()
	}
}

// backOff counts one more failure in a row of loop's batches or listen's reconnects, logs
// err at level with the failures so far and the wait before the next try, and sleeps that
// wait (RetryBackoff to RetryBackoffMax); false: ctx ended meanwhile.
func (d *Dispatcher) backOff(ctx context.Context, failures *int, level slog.Level, msg string, err error) bool {
	*failures++
	wait := retry.Equal(d.cfg.RetryBackoff, d.cfg.RetryBackoffMax, *failures)
	d.log.Log(ctx, level, msg, "failures", *failures, "retry_in", wait, "err", err)
	return retry.Sleep(ctx, wait)
}

// poke wakes the loop; a wake-up that is already pending absorbs this one.
func (d *Dispatcher) poke() {
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// listenConn opens a connection of its own (not from the pool: it is held for as long as
// the dispatcher runs) and LISTENs on NotifyChannel.
func (d *Dispatcher) listenConn(ctx context.Context) (*pgx.Conn, error) {
	qctx, cancel := context.WithTimeout(ctx, d.cfg.QueryTimeout)
	defer cancel()
	conn, err := pgx.ConnectConfig(qctx, d.pool.Config().ConnConfig.Copy())
	if err != nil {
		return nil, fmt.Errorf("outbox: listen: connect: %w", err)
	}
	if _, err := conn.Exec(qctx, "LISTEN "+pgx.Identifier{NotifyChannel}.Sanitize()); err != nil {
		closeConn(conn, d.cfg.QueryTimeout)
		return nil, fmt.Errorf("outbox: listen: %w", err)
	}
	return conn, nil
}

func closeConn(conn *pgx.Conn, timeout time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	_ = conn.Close(ctx)
}

// listen turns notifications into wake-ups, reconnecting with backoff when the connection
// breaks. The loop keeps polling meanwhile, and is woken after every reconnect because
// notifications sent while the connection was down are gone.
func (d *Dispatcher) listen(ctx context.Context, conn *pgx.Conn) {
	failures := 0
	defer func() {
		if conn != nil {
			closeConn(conn, d.cfg.QueryTimeout)
		}
	}()
	for {
		if conn == nil {
			var err error
			if conn, err = d.listenConn(ctx); err != nil {
				if ctx.Err() != nil {
					return
				}
				if !d.backOff(ctx, &failures, slog.LevelWarn, "outbox: LISTEN reconnect failed", err) {
					return
				}
				continue
			}
			failures = 0
			d.poke()
		}
		if _, err := conn.WaitForNotification(ctx); err != nil {
			if ctx.Err() != nil {
				return
			}
			d.log.WarnContext(ctx, "outbox: LISTEN connection lost; reconnecting", "err", err)
			closeConn(conn, d.cfg.QueryTimeout)
			conn = nil
			continue
		}
		d.poke()
	}
}
