package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/internal/retry"
)

// Consumer defaults.
const (
	// DefaultConsumerBatchSize is how many entries one read or claim returns at most.
	DefaultConsumerBatchSize = 100
	// DefaultBlock is how long one XREADGROUP waits for new entries; it also bounds how
	// long Run takes to return after its context is cancelled.
	DefaultBlock = time.Second
	// DefaultMinIdle is how long an entry must have been pending before XAUTOCLAIM takes
	// it over. It must exceed the longest handler run, or a slow handler's entry is
	// handled twice concurrently.
	DefaultMinIdle = 30 * time.Second
	// DefaultStartID is where a new consumer group starts: the beginning of the stream.
	DefaultStartID = "0"
	// DefaultLedgerTTL is how long Run's ledger remembers a handled event key.
	DefaultLedgerTTL = 7 * 24 * time.Hour
	// DefaultHandlerTimeout bounds one handler call (and RunTx's transaction).
	DefaultHandlerTimeout = time.Minute
)

// ConsumerConfig configures a Consumer. Group and one of Topic or Stream are required.
type ConsumerConfig struct {
	// Prefix of the stream (when Topic is given) and of the ledger keys. Defaults to
	// DefaultPrefix.
	Prefix string
	// Topic whose stream (<Prefix>stream:{<Topic>}, see StreamKey) is consumed. Required
	// unless Stream is set.
	Topic string
	// Stream is the full stream key; it overrides Topic. Defaults to StreamKey(Prefix,
	// Topic). Its hash tag is also the ledger keys' (LedgerKey), so a consumer's keys live
	// in one cluster slot.
	Stream string
	// Group is the consumer group; created (with MKSTREAM) if missing. Required.
	Group string
	// Consumer is this consumer's name within the group; each concurrently running
	// Consumer needs its own. Defaults to "<hostname>-<pid>-<random>".
	Consumer string
	// StartID is where the group starts if this consumer creates it when it starts.
	// Defaults to DefaultStartID ("0", the whole stream); "$" starts with new entries. A
	// group found gone while running (Redis lost its data, the stream was deleted) is
	// created again at "0" whatever StartID says, so entries published again are read.
	StartID string
	// BatchSize is the most entries one XREADGROUP or XAUTOCLAIM returns. Defaults to
	// DefaultConsumerBatchSize.
	BatchSize int
	// Block is how long one XREADGROUP waits for new entries. Defaults to DefaultBlock.
	Block time.Duration
	// MinIdle is how long an entry must have been pending (unacknowledged since its last
	// delivery) before it is reclaimed. Defaults to DefaultMinIdle.
	MinIdle time.Duration
	// ReclaimInterval is how often XAUTOCLAIM runs. Defaults to MinIdle / 2.
	ReclaimInterval time.Duration
	// LedgerTTL is how long Run's ledger keeps a mark. Defaults to DefaultLedgerTTL.
	LedgerTTL time.Duration
	// HandlerTimeout bounds one handler call; in RunTx it bounds the event's transaction.
	// Defaults to DefaultHandlerTimeout.
	HandlerTimeout time.Duration
	// QueryTimeout bounds every PostgreSQL statement of RunTx outside the handler.
	// Defaults to DefaultQueryTimeout.
	QueryTimeout time.Duration
	// RedisTimeout bounds every Redis round trip except the blocking read. Defaults to
	// DefaultRedisTimeout.
	RedisTimeout time.Duration
	// RetryBackoff is the first delay after a Redis failure. Defaults to
	// DefaultRetryBackoff.
	RetryBackoff time.Duration
	// RetryBackoffMax caps that delay. Defaults to DefaultRetryBackoffMax.
	RetryBackoffMax time.Duration

	// OnLost, when set, is called with the ids of pending entries that were deleted or
	// trimmed from the stream before the group acknowledged them (after the error log and
	// the lost metric). Defaults to nil.
	OnLost func(ids []string)
	// BeforeAck is a failpoint for tests and chaos runs. When set, it is called with the
	// ids about to be acknowledged after a batch was handled; returning an error skips the
	// XACK as a crash at that point would: the entries stay pending, are reclaimed after
	// MinIdle and recognised as duplicates. Defaults to nil.
	BeforeAck func(ids []string) error
	// OnBatch, when set, is called after every non-empty batch with what happened to it.
	// A test signal; it must not block for long. Defaults to nil.
	OnBatch func(BatchReport)

	// Registerer receives the metrics. Defaults to a new private registry (never the
	// global default registry).
	Registerer prometheus.Registerer
	// Logger receives the consumer's logs. Defaults to slog.Default().
	Logger *slog.Logger
}

// BatchReport tells what a Consumer did with one batch of entries.
type BatchReport struct {
	Source       string // "new" (XREADGROUP >), "claimed" (XAUTOCLAIM) or "own" (own pending at start)
	Entries      int    // entries in the batch, lost ones included
	Handled      int    // handler succeeded
	Deduplicated int    // skipped as replays
	Failed       int    // handler (or its transaction) failed: left pending
	Lost         int    // deleted or trimmed while pending
	Malformed    int    // not outbox events
	Acked        int    // acknowledged (0 if the XACK failed or was skipped)
}

// Validate reports the first missing or invalid field.
func (c *ConsumerConfig) Validate() error {
	switch {
	case c.Group == "":
		return errors.New("outbox: ConsumerConfig.Group is required")
	case c.Topic == "" && c.Stream == "":
		return errors.New("outbox: ConsumerConfig: Topic or Stream is required")
	case c.BatchSize < 0:
		return fmt.Errorf("outbox: ConsumerConfig.BatchSize %d is negative", c.BatchSize)
	case c.Block < 0 || c.MinIdle < 0 || c.ReclaimInterval < 0:
		return fmt.Errorf("outbox: ConsumerConfig: Block %v, MinIdle %v and ReclaimInterval %v must not be negative", c.Block, c.MinIdle, c.ReclaimInterval)
	case c.LedgerTTL < 0 || c.HandlerTimeout < 0 || c.QueryTimeout < 0 || c.RedisTimeout < 0:
		return errors.New("outbox: ConsumerConfig: LedgerTTL, HandlerTimeout, QueryTimeout and RedisTimeout must not be negative")
	case c.RetryBackoff < 0 || c.RetryBackoffMax < 0:
		return errors.New("outbox: ConsumerConfig: RetryBackoff and RetryBackoffMax must not be negative")
	case c.LedgerTTL > 0 && c.LedgerTTL < time.Millisecond:
		return fmt.Errorf("outbox: ConsumerConfig.LedgerTTL %v is below 1ms", c.LedgerTTL)
	}
	return nil
}

func (c *ConsumerConfig) withDefaults() ConsumerConfig {
	out := *c
	if out.Prefix == "" {
		out.Prefix = DefaultPrefix
	}
	if out.Stream == "" {
		out.Stream = StreamKey(out.Prefix, out.Topic)
	}
	if out.Consumer == "" {
		host, _ := os.Hostname()
		out.Consumer = fmt.Sprintf("%s-%d-%08x", host, os.Getpid(), randUint32())
	}
	if out.StartID == "" {
		out.StartID = DefaultStartID
	}
	if out.BatchSize == 0 {
		out.BatchSize = DefaultConsumerBatchSize
	}
	if out.Block == 0 {
		out.Block = DefaultBlock
	}
	if out.MinIdle == 0 {
		out.MinIdle = DefaultMinIdle
	}
	if out.ReclaimInterval == 0 {
		out.ReclaimInterval = max(out.MinIdle/2, time.Millisecond)
	}
	if out.LedgerTTL == 0 {
		out.LedgerTTL = DefaultLedgerTTL
	}
	if out.HandlerTimeout == 0 {
		out.HandlerTimeout = DefaultHandlerTimeout
	}
	if out.QueryTimeout == 0 {
		out.QueryTimeout = DefaultQueryTimeout
	}
	if out.RedisTimeout == 0 {
		out.RedisTimeout = DefaultRedisTimeout
	}
	out.RetryBackoff, out.RetryBackoffMax = backoffDefaults(out.RetryBackoff, out.RetryBackoffMax)
	if out.Registerer == nil {
		out.Registerer = prometheus.NewRegistry()
	}
	if out.Logger == nil {
		out.Logger = slog.Default()
	}
	return out
}

// Consumer reads one stream in one consumer group under one consumer name and hands each
// event to a handler, acknowledging it only after the handler succeeded or the event was
// recognised as a replay; see the package doc. One Consumer runs one Run or RunTx at a
// time; run several Consumers (with distinct names) for parallelism.
type Consumer struct {
	rdb     redis.UniversalClient
	cfg     ConsumerConfig
	log     *slog.Logger
	metrics *ConsumerMetrics
	running atomic.Bool
	// noReplayColumn is set once outbox_inbox turned out to lack the replays column (a
	// database not yet migrated): RunTx then stops recording replays in PostgreSQL.
	noReplayColumn atomic.Bool
}

// NewConsumer returns a consumer on rdb. It does no I/O; the group is created when Run or
// RunTx starts.
func NewConsumer(rdb redis.UniversalClient, cfg *ConsumerConfig) (*Consumer, error) {
	if rdb == nil {
		return nil, errors.New("outbox: NewConsumer: rdb is required")
	}
	if cfg == nil {
		return nil, errors.New("outbox: NewConsumer: cfg is required (Group and Topic or Stream)")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	c := cfg.withDefaults()
	m, err := newConsumerMetrics(c.Registerer)
	if err != nil {
		return nil, err
	}
	return &Consumer{rdb: rdb, cfg: c, log: c.Logger.With("stream", c.Stream, "group", c.Group, "consumer", c.Consumer), metrics: m}, nil
}

// Metrics returns the consumer's collectors (shared with other components registered on
// the same Registerer).
func (c *Consumer) Metrics() *ConsumerMetrics { return c.metrics }

// Name returns the consumer's name within its group.
func (c *Consumer) Name() string { return c.cfg.Consumer }

// Stream returns the stream key the consumer reads.
func (c *Consumer) Stream() string { return c.cfg.Stream }

// Handler handles one event in Run mode. Returning nil acknowledges the event and marks
// its key in the ledger; an error leaves it pending for redelivery.
type Handler func(ctx context.Context, ev Event) error

// TxHandler handles one event in RunTx mode inside tx, which also holds the inbox mark.
// Its side effect must be written through tx to be exactly once. Returning an error rolls
// tx back and leaves the event pending for redelivery. It must not commit or roll back tx.
type TxHandler func(ctx context.Context, tx pgx.Tx, ev Event) error

// Run consumes until ctx is done, deduplicating with the Redis ledger: an event whose key
// the group already handled successfully is acknowledged without calling handler; the
// mark is set only after handler returned nil. Effect: at least once (exactly once for
// idempotent handlers); see the package doc for what the ledger cannot promise. Redis
// failures are logged and retried with backoff. Run returns nil when ctx is done, or an
// error if it cannot start (nil handler, already running).
func (c *Consumer) Run(ctx context.Context, handler Handler) error {
	if handler == nil {
		return errors.New("outbox: Run: nil handler")
	}
	return c.run(ctx, func(ctx context.Context, evs []Event, rep *BatchReport) []string {
		return c.processLedger(ctx, evs, handler, rep)
	})
}

// RunTx consumes until ctx is done, deduplicating with the outbox_inbox table: each event
// runs in one transaction on pool that inserts (group, event_key) into the inbox and, if
// the row is new, calls handler with the transaction, then commits; the entry is
// acknowledged after the commit. A replay finds the row and is acknowledged without
// calling handler. Effect: exactly once for side effects written through tx. Every replay
// recognised is also added to its inbox row's replays column (before the replay is
// acknowledged), so PostgreSQL can count the events deduplicated downstream:
// `SELECT sum(replays) FROM outbox_inbox`. Returns as Run does.
func (c *Consumer) RunTx(ctx context.Context, pool *pgxpool.Pool, handler TxHandler) error {
	if pool == nil || handler == nil {
		return errors.New("outbox: RunTx: nil pool or handler")
	}
	return c.run(ctx, func(ctx context.Context, evs []Event, rep *BatchReport) []string {
		return c.processInbox(ctx, pool, evs, handler, rep)
	})
}

// processFunc handles decoded events and returns the stream ids to acknowledge.
type processFunc func(ctx context.Context, evs []Event, rep *BatchReport) []string

func (c *Consumer) run(ctx context.Context, process processFunc) error {
	if !c.running.CompareAndSwap(false, true) {
		return fmt.Errorf("outbox: consumer %q is already running", c.cfg.Consumer)
	}
	defer c.running.Store(false)

	for failures := 0; ; {
		err := c.ensureGroup(ctx)
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return nil
		}
		failures++
		c.log.ErrorContext(ctx, "outbox: create consumer group failed", "failures", failures, "err", err)
		if !retry.Sleep(ctx, retry.Equal(c.cfg.RetryBackoff, c.cfg.RetryBackoffMax, failures)) {
			return nil
		}
	}

	// Entries this consumer name read before a restart and never acknowledged.
	c.drainOwn(ctx, process)

	var (
		lastReclaim time.Time
		cursor      = "0-0"
		failures    int
	)
	for ctx.Err() == nil {
		if time.Since(lastReclaim) >= c.cfg.ReclaimInterval {
			cursor = c.reclaim(ctx, process, cursor)
			lastReclaim = time.Now()
		}
		block := min(c.cfg.Block, max(time.Until(lastReclaim.Add(c.cfg.ReclaimInterval)), time.Millisecond))
		streams, err := c.rdb.XReadGroup(ctx, &redis.XReadGroupArgs{
			Group:    c.cfg.Group,
			Consumer: c.cfg.Consumer,
			Streams:  []string{c.cfg.Stream, ">"},
			Count:    int64(c.cfg.BatchSize),
			Block:    block,
		}).Result()
		switch {
		case errors.Is(err, redis.Nil):
			failures = 0
			continue
		case err != nil:
			if ctx.Err() != nil {
				return nil
			}
			failures++
			if isNoGroup(err) {
				// The stream or group was deleted under us, or Redis lost its data. The
				// group is created again at the beginning of the stream whatever StartID
				// says: entries the dispatchers publish again after a loss (and any
				// published before the group is back) must be read, not skipped.
				if gerr := c.createGroup(ctx, "0"); gerr == nil {
					c.log.WarnContext(ctx, "outbox: consumer group was gone (stream deleted, or Redis lost its data); created it again at the beginning of the stream", "err", err)
					cursor = "0-0"
					continue
				}
			}
			wait := retry.Equal(c.cfg.RetryBackoff, c.cfg.RetryBackoffMax, failures)
			c.log.ErrorContext(ctx, "outbox: XREADGROUP failed", "failures", failures, "retry_in", wait, "err", err)
			retry.Sleep(ctx, wait)
			continue
		}
		failures = 0
		for _, s := range streams {
			c.handle(ctx, "new", s.Messages, nil, process)
		}
	}
	return nil
}

func isNoGroup(err error) bool {
	return err != nil && strings.HasPrefix(err.Error(), "NOGROUP")
}

func (c *Consumer) ensureGroup(ctx context.Context) error { return c.createGroup(ctx, c.cfg.StartID) }

// createGroup creates the group (and the stream if missing) at start; an existing group is
// left as it is.
func (c *Consumer) createGroup(ctx context.Context, start string) error {
	rctx, cancel := context.WithTimeout(ctx, c.cfg.RedisTimeout)
	defer cancel()
	err := c.rdb.XGroupCreateMkStream(rctx, c.cfg.Stream, c.cfg.Group, start).Err()
	if err != nil && !strings.HasPrefix(err.Error(), "BUSYGROUP") {
		return fmt.Errorf("outbox: XGROUP CREATE %s %s: %w", c.cfg.Stream, c.cfg.Group, err)
	}
	return nil
}

// drainOwn handles the entries still pending for this consumer name (read by a previous
// run of the same name that stopped before acknowledging them), oldest first.
func (c *Consumer) drainOwn(ctx context.Context, process processFunc) {
	cursor := "0"
	for ctx.Err() == nil {
		rctx, cancel := context.WithTimeout(ctx, c.cfg.RedisTimeout)
		streams, err := c.rdb.XReadGroup(rctx, &redis.XReadGroupArgs{
			Group:    c.cfg.Group,
			Consumer: c.cfg.Consumer,
			Streams:  []string{c.cfg.Stream, cursor},
			Count:    int64(c.cfg.BatchSize),
			Block:    -1,
		}).Result()
		cancel()
		if err != nil {
			if !errors.Is(err, redis.Nil) && ctx.Err() == nil {
				c.log.WarnContext(ctx, "outbox: reading own pending entries failed; reclaim will get them", "err", err)
			}
			return
		}
		n := 0
		for _, s := range streams {
			n += len(s.Messages)
			if len(s.Messages) > 0 {
				cursor = s.Messages[len(s.Messages)-1].ID
				c.handle(ctx, "own", s.Messages, nil, process)
			}
		}
		if n == 0 {
			return
		}
	}
}

// maxReclaimPages bounds one reclaim round, so new entries are not starved by a long
// pending list; the next round continues from the returned cursor.
const maxReclaimPages = 10

// reclaim takes over entries pending longer than MinIdle (from any consumer of the group,
// this one included) and handles them. It returns the cursor for the next round.
func (c *Consumer) reclaim(ctx context.Context, process processFunc, cursor string) string {
	for page := 0; page < maxReclaimPages && ctx.Err() == nil; page++ {
		rctx, cancel := context.WithTimeout(ctx, c.cfg.RedisTimeout)
		msgs, next, deleted, err := c.rdb.XAutoClaimWithDeleted(rctx, &redis.XAutoClaimArgs{
			Stream:   c.cfg.Stream,
			Group:    c.cfg.Group,
			Consumer: c.cfg.Consumer,
			MinIdle:  c.cfg.MinIdle,
			Start:    cursor,
			Count:    int64(c.cfg.BatchSize),
		}).Result()
		cancel()
		if err != nil {
			if ctx.Err() == nil {
				c.log.WarnContext(ctx, "outbox: XAUTOCLAIM failed", "err", err)
			}
			return cursor
		}
		if len(deleted) > 0 {
			c.reportLost(ctx, deleted)
			if c.cfg.OnBatch != nil && len(msgs) == 0 {
				c.cfg.OnBatch(BatchReport{Source: "claimed", Entries: len(deleted), Lost: len(deleted)})
			}
		}
		if len(msgs) > 0 {
			c.metrics.Claimed.WithLabelValues(c.cfg.Group).Add(float64(len(msgs)))
			c.handle(ctx, "claimed", msgs, c.deliveries(ctx, msgs), process)
		}
		cursor = next
		if next == "0-0" || next == "" {
			return "0-0"
		}
	}
	return cursor
}

// deliveries returns the delivery count of claimed entries from one XPENDING call; an
// entry it does not report gets 0 (unknown).
func (c *Consumer) deliveries(ctx context.Context, msgs []redis.XMessage) map[string]int {
	rctx, cancel := context.WithTimeout(ctx, c.cfg.RedisTimeout)
	defer cancel()
	pend, err := c.rdb.XPendingExt(rctx, &redis.XPendingExtArgs{
		Stream:   c.cfg.Stream,
		Group:    c.cfg.Group,
		Start:    msgs[0].ID,
		End:      msgs[len(msgs)-1].ID,
		Count:    int64(2 * len(msgs)),
		Consumer: c.cfg.Consumer,
	}).Result()
	if err != nil {
		return nil
	}
	out := make(map[string]int, len(pend))
	for _, p := range pend {
		out[p.ID] = int(p.RetryCount)
	}
	return out
}

func (c *Consumer) reportLost(ctx context.Context, ids []string) {
	c.metrics.Lost.WithLabelValues(c.cfg.Group).Add(float64(len(ids)))
	c.log.ErrorContext(ctx, "outbox: LOST events: pending stream entries were deleted or trimmed before this group acknowledged them; their events were never handled by the group",
		"lost", len(ids), "ids", ids)
	if c.cfg.OnLost != nil {
		c.cfg.OnLost(ids)
	}
}

// handle decodes one batch, lets process run the handlers, and acknowledges what process
// returned plus entries that can never be handled (lost, malformed).
func (c *Consumer) handle(ctx context.Context, source string, msgs []redis.XMessage, delivery map[string]int, process processFunc) {
	rep := BatchReport{Source: source, Entries: len(msgs)}
	var (
		evs   = make([]Event, 0, len(msgs))
		ack   []string
		lost  []string
		first = source == "new"
	)
	for _, m := range msgs {
		if m.Values == nil {
			// Own pending entry read back after it was deleted from the stream.
			lost = append(lost, m.ID)
			continue
		}
		ev, err := decodeEvent(m.ID, m.Values)
		if err != nil {
			rep.Malformed++
			c.metrics.Malformed.WithLabelValues(c.cfg.Group).Inc()
			c.log.ErrorContext(ctx, "outbox: acknowledging a stream entry that is not an outbox event", "id", m.ID, "err", err)
			ack = append(ack, m.ID)
			continue
		}
		switch {
		case first:
			ev.Delivery = 1
		case delivery != nil:
			ev.Delivery = delivery[m.ID]
		}
		evs = append(evs, ev)
	}
	if len(lost) > 0 {
		rep.Lost = len(lost)
		c.reportLost(ctx, lost)
		ack = append(ack, lost...)
	}
	if len(evs) > 0 {
		ack = append(ack, process(ctx, evs, &rep)...)
	}
	rep.Acked = c.ack(ctx, ack)
	if c.cfg.OnBatch != nil {
		c.cfg.OnBatch(rep)
	}
}

// ack acknowledges ids and returns how many it acknowledged. It runs even when ctx was
// cancelled mid-batch (a graceful stop acknowledges what it finished); the BeforeAck
// failpoint can skip it.
func (c *Consumer) ack(ctx context.Context, ids []string) int {
	if len(ids) == 0 {
		return 0
	}
	if c.cfg.BeforeAck != nil {
		if err := c.cfg.BeforeAck(ids); err != nil {
			c.log.WarnContext(ctx, "outbox: BeforeAck failpoint: entries left pending", "entries", len(ids), "err", err)
			return 0
		}
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.RedisTimeout)
	defer cancel()
	if err := c.rdb.XAck(rctx, c.cfg.Stream, c.cfg.Group, ids...).Err(); err != nil {
		c.log.ErrorContext(ctx, "outbox: XACK failed; entries will be redelivered and deduplicated", "entries", len(ids), "err", err)
		return 0
	}
	return len(ids)
}

// processLedger is Run's strategy: one pipelined EXISTS for the batch, then per event the
// handler and, after it succeeded, SET NX of the ledger mark.
func (c *Consumer) processLedger(ctx context.Context, evs []Event, h Handler, rep *BatchReport) []string {
	keys := make([]string, len(evs))
	for i, ev := range evs {
		keys[i] = LedgerKey(c.cfg.Prefix, c.cfg.Stream, c.cfg.Group, ev.EventKey)
	}
	rctx, cancel := context.WithTimeout(ctx, c.cfg.RedisTimeout)
	exists := make([]*redis.IntCmd, len(keys))
	_, err := c.rdb.Pipelined(rctx, func(p redis.Pipeliner) error {
		for i, k := range keys {
			exists[i] = p.Exists(rctx, k)
		}
		return nil
	})
	cancel()
	if err != nil {
		// Without the ledger a replay cannot be recognised; leave the batch pending.
		rep.Failed += len(evs)
		c.log.ErrorContext(ctx, "outbox: ledger lookup failed; batch left pending", "entries", len(evs), "err", err)
		return nil
	}
	var ack []string
	done := make(map[string]bool)
	for i, ev := range evs {
		if ctx.Err() != nil {
			break
		}
		if exists[i].Val() > 0 || done[ev.EventKey] {
			rep.Deduplicated++
			c.metrics.Deduplicated.WithLabelValues(c.cfg.Group).Inc()
			ack = append(ack, ev.StreamID)
			continue
		}
		hctx, cancel := context.WithTimeout(ctx, c.cfg.HandlerTimeout)
		err := h(hctx, ev)
		cancel()
		if err != nil {
			rep.Failed++
			c.log.WarnContext(ctx, "outbox: handler failed; event left pending for redelivery",
				"event_key", ev.EventKey, "id", ev.StreamID, "delivery", ev.Delivery, "err", err)
			continue
		}
		rep.Handled++
		done[ev.EventKey] = true
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.RedisTimeout)
		if err := c.rdb.SetNX(rctx, keys[i], ev.StreamID, c.cfg.LedgerTTL).Err(); err != nil {
			c.log.ErrorContext(ctx, "outbox: ledger mark failed after the handler succeeded; a replay of this event will run the handler again",
				"event_key", ev.EventKey, "id", ev.StreamID, "err", err)
		}
		cancel()
		ack = append(ack, ev.StreamID)
	}
	return ack
}

// processInbox is RunTx's strategy: one SELECT for the batch finds replays cheaply, then
// one transaction per remaining event (inbox insert + handler + commit).
func (c *Consumer) processInbox(ctx context.Context, pool *pgxpool.Pool, evs []Event, h TxHandler, rep *BatchReport) []string {
	keys := make([]string, len(evs))
	for i, ev := range evs {
		keys[i] = ev.EventKey
	}
	seen := make(map[string]bool)
	qctx, cancel := context.WithTimeout(ctx, c.cfg.QueryTimeout)
	rows, _ := pool.Query(qctx, `SELECT event_key FROM outbox_inbox WHERE consumer_group = $1 AND event_key = ANY($2)`, c.cfg.Group, keys)
	var key string
	_, err := pgx.ForEachRow(rows, []any{&key}, func() error {
		seen[key] = true
		return nil
	})
	cancel()
	if err != nil {
		// Only an optimisation: the per-event insert decides.
		c.log.WarnContext(ctx, "outbox: inbox lookup failed", "err", err)
	}
	var ack, replays []string
	for _, ev := range evs {
		if ctx.Err() != nil {
			break
		}
		if seen[ev.EventKey] {
			rep.Deduplicated++
			c.metrics.Deduplicated.WithLabelValues(c.cfg.Group).Inc()
			replays = append(replays, ev.EventKey)
			ack = append(ack, ev.StreamID)
			continue
		}
		dup, err := c.handleTx(ctx, pool, ev, h)
		switch {
		case err != nil:
			rep.Failed++
			c.log.WarnContext(ctx, "outbox: handler transaction failed; event left pending for redelivery",
				"event_key", ev.EventKey, "id", ev.StreamID, "delivery", ev.Delivery, "err", err)
			continue
		case dup:
			rep.Deduplicated++
			c.metrics.Deduplicated.WithLabelValues(c.cfg.Group).Inc()
			replays = append(replays, ev.EventKey)
		default:
			rep.Handled++
		}
		seen[ev.EventKey] = true
		ack = append(ack, ev.StreamID)
	}
	c.recordReplays(ctx, pool, replays)
	return ack
}

// recordReplays adds the batch's replays to their inbox rows' replays counters, in one
// statement. It runs before the batch is acknowledged: a crash in between redelivers the
// entries, and each redelivery is a replay of its own, counted again. Counting is evidence,
// not part of the effect: a failure is logged and the batch is acknowledged anyway. Rows
// are locked in event_key order, so consumers of one group recording overlapping replays
// at the same moment wait for each other instead of deadlocking.
func (c *Consumer) recordReplays(ctx context.Context, pool *pgxpool.Pool, keys []string) {
	if len(keys) == 0 || c.noReplayColumn.Load() {
		return
	}
	qctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.QueryTimeout)
	defer cancel()
	_, err := pool.Exec(qctx, `
WITH d AS (
	SELECT k, count(*) AS n FROM unnest($2::text[]) AS k GROUP BY k
), l AS (
	SELECT i.event_key FROM outbox_inbox AS i JOIN d ON i.event_key = d.k
	WHERE i.consumer_group = $1 ORDER BY i.event_key FOR UPDATE OF i
)
UPDATE outbox_inbox AS i SET replays = i.replays + d.n
FROM d JOIN l ON l.event_key = d.k
WHERE i.consumer_group = $1 AND i.event_key = d.k`, c.cfg.Group, keys)
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == "42703": // undefined_column
		if c.noReplayColumn.CompareAndSwap(false, true) {
			c.log.WarnContext(ctx, "outbox: outbox_inbox has no replays column (database not migrated?): replays are not counted in PostgreSQL until the consumer restarts on a migrated database", "err", err)
		}
	case err != nil:
		c.log.WarnContext(ctx, "outbox: recording replays in the inbox failed; they stay uncounted in PostgreSQL (the metric counted them)",
			"replays", len(keys), "err", err)
	}
}

func (c *Consumer) handleTx(ctx context.Context, pool *pgxpool.Pool, ev Event, h TxHandler) (dup bool, err error) {
	tctx, cancel := context.WithTimeout(ctx, c.cfg.HandlerTimeout)
	defer cancel()
	tx, err := pool.Begin(tctx)
	if err != nil {
		return false, fmt.Errorf("begin: %w", err)
	}
	defer func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.QueryTimeout)
		_ = tx.Rollback(rctx) // a no-op after Commit
		cancel()
	}()
	qctx, qcancel := context.WithTimeout(tctx, c.cfg.QueryTimeout)
	tag, err := tx.Exec(qctx, `INSERT INTO outbox_inbox (consumer_group, event_key, stream_id) VALUES ($1, $2, $3)
ON CONFLICT (consumer_group, event_key) DO NOTHING`, c.cfg.Group, ev.EventKey, ev.StreamID)
	qcancel()
	if err != nil {
		return false, fmt.Errorf("inbox insert: %w", err)
	}
	if tag.RowsAffected() == 0 {
		return true, nil
	}
	if err := h(tctx, tx, ev); err != nil {
		return false, err
	}
	qctx, qcancel = context.WithTimeout(tctx, c.cfg.QueryTimeout)
	defer qcancel()
	if err := tx.Commit(qctx); err != nil {
		return false, fmt.Errorf("commit: %w", err)
	}
	return false, nil
}
