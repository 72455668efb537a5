package outbox

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/fnv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
)

// Redis data loss defaults.
const (
	// DefaultRecoverWindow is how far back, from the moment a loss is detected, outbox rows
	// marked sent are marked unsent again when Redis lost a stream.
	DefaultRecoverWindow = 24 * time.Hour
	// DefaultRecoverBatch is how many rows one re-marking statement changes.
	DefaultRecoverBatch = 1000
	// recoverTimeout bounds one recovery: waiting for in-flight batches, re-marking, and
	// recreating the epoch markers.
	recoverTimeout = 2 * time.Minute
)

// epochState is what a pipelined GET of a stream's epoch marker found.
type epochState struct {
	value string // "" when the marker is absent
	err   error  // a failed GET (not redis.Nil)
}

// recoverLockKey is the PostgreSQL advisory lock that orders dispatch batches (shared,
// held from the claim to the commit) against a recovery (exclusive): a recovery starts
// only once every batch that may have published to the lost Redis has committed, and no
// batch claims rows while it re-marks. One lock per stream prefix.
func recoverLockKey(prefix string) int64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte("idemscrape/outbox/recover\x00" + prefix))
	return int64(h.Sum64())
}

func newEpoch() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:]) + "@" + time.Now().UTC().Format(time.RFC3339)
}

// absentEpochs reads the epoch markers of topics (one round trip), adopts those present
// and returns the topics whose marker is absent. For those this dispatcher had seen a
// marker of, it records that the marker vanished: proof that Redis lost the stream's
// data, whatever the stream holds by the time it is recovered.
func (d *Dispatcher) absentEpochs(ctx context.Context, topics []string) ([]string, error) {
	states, err := d.getEpochs(ctx, topics)
	if err != nil {
		return nil, err
	}
	var absent []string
	for _, t := range topics {
		switch s := states[t]; {
		case s.err != nil:
			return nil, fmt.Errorf("outbox: read epoch marker of %q: %w", t, s.err)
		case s.value == "":
			absent = append(absent, t)
			d.epochMu.Lock()
			if d.epochs[t] != "" {
				d.vanished[t] = d.epochs[t]
			}
			d.epochMu.Unlock()
		default:
			d.adopt(ctx, t, s.value)
		}
	}
	return absent, nil
}

// adopt records the epoch marker value seen for topic. A value that differs from the one
// remembered means another dispatcher recovered the stream after a loss; that is logged
// once per change.
func (d *Dispatcher) adopt(ctx context.Context, topic, value string) {
	d.epochMu.Lock()
	old, known := d.epochs[topic]
	d.epochs[topic] = value
	d.epochMu.Unlock()
	if known && old != "" && old != value {
		d.log.WarnContext(ctx, "outbox: the stream's epoch changed: Redis lost its data and another dispatcher republished what it may have held",
			"topic", topic, "old_epoch", old, "epoch", value)
	}
}

// track adds topics to those the idle check watches.
func (d *Dispatcher) track(topics ...string) {
	d.epochMu.Lock()
	defer d.epochMu.Unlock()
	for _, t := range topics {
		if _, ok := d.epochs[t]; !ok {
			d.epochs[t] = ""
		}
	}
}

// getEpochs reads the epoch markers of topics in one pipeline.
func (d *Dispatcher) getEpochs(ctx context.Context, topics []string) (map[string]epochState, error) {
	rctx, cancel := context.WithTimeout(ctx, d.cfg.RedisTimeout)
	defer cancel()
	cmds := make([]*redis.StringCmd, len(topics))
	_, err := d.rdb.Pipelined(rctx, func(p redis.Pipeliner) error {
		for i, t := range topics {
			cmds[i] = p.Get(rctx, EpochKey(d.cfg.Prefix, t))
		}
		return nil
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("outbox: read epoch markers: %w", err)
	}
	out := make(map[string]epochState, len(topics))
	for i, t := range topics {
		out[t] = epochOf(cmds[i])
	}
	return out, nil
}

func epochOf(cmd *redis.StringCmd) epochState {
	v, err := cmd.Result()
	switch {
	case errors.Is(err, redis.Nil):
		return epochState{}
	case err != nil:
		return epochState{err: err}
	case v == "":
		return epochState{value: "?"} // present, if oddly empty: not a loss
	}
	return epochState{value: v}
}

// CheckStreams reads the epoch marker of every topic this dispatcher has published to or
// found in the outbox's recently sent rows, and recovers the streams whose marker is gone
// (see the package doc, Redis data loss). It returns the topics it recovered. The
// background loop calls it whenever it is idle; call it directly to check at once.
func (d *Dispatcher) CheckStreams(ctx context.Context) ([]string, error) {
	d.epochMu.Lock()
	topics := make([]string, 0, len(d.epochs))
	for t := range d.epochs {
		topics = append(topics, t)
	}
	d.epochMu.Unlock()
	if len(topics) == 0 {
		return nil, nil
	}
	absent, err := d.absentEpochs(ctx, topics)
	if err != nil || len(absent) == 0 {
		return nil, err
	}
	return absent, d.recoverStreams(ctx, absent)
}

// discoverTopics adds the topics of rows sent within RecoverWindow to the watched ones, so
// a dispatcher that starts after Redis lost its data (and has no new event of that topic
// to publish) still finds the loss. It reads the sent rows of the window once.
func (d *Dispatcher) discoverTopics(ctx context.Context) error {
	qctx, cancel := context.WithTimeout(ctx, d.cfg.QueryTimeout)
	defer cancel()
	rows, _ := d.pool.Query(qctx, `SELECT DISTINCT topic FROM outbox WHERE sent_at >= now() - $1::interval`, d.cfg.RecoverWindow)
	topics, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("outbox: discover topics: %w", err)
	}
	d.track(topics...)
	return nil
}

// recoverStreams handles streams whose epoch marker is gone. Under the exclusive recovery
// lock (so that batches already past their XADD have committed and no new batch claims
// rows meanwhile), for each topic whose marker is still absent:
//
//  1. it decides whether the stream lost its history: this dispatcher saw the marker
//     before and saw it vanish, or the stream has recorded fewer entries ever added (XINFO
//     STREAM entries-added, 0 when the key is missing) than the outbox holds rows of the
//     topic marked sent. Every sent row was appended to the stream at least once before it
//     was marked sent, and trimming or deleting entries never lowers entries-added, so an
//     intact stream always has at least as many (no dispatcher appends to a stream whose
//     marker is absent, so a recreated stream holds only what a consumer's MKSTREAM or a
//     batch racing the loss put there). A marker absent on an intact stream (the first
//     start of this version, or of a new topic) is created and nothing is re-marked;
//  2. if it did, it marks unsent again, in batches of RecoverBatch, the rows of the topic
//     sent within RecoverWindow before now, so the dispatchers publish them again (counted
//     in idemscrape_outbox_remarked_total, logged once per recovery);
//  3. it creates the marker anew (SET NX, a new random epoch).
//
// A crash between 2 and 3 leaves the marker absent: the next dispatcher re-marks again,
// which only republishes more copies (consumers deduplicate them).
func (d *Dispatcher) recoverStreams(ctx context.Context, topics []string) error {
	ctx, cancel := context.WithTimeout(ctx, recoverTimeout)
	defer cancel()
	// A connection of its own, closed at the end: the session lock cannot outlive it, even
	// if the unlock fails.
	conn, err := pgx.ConnectConfig(ctx, d.pool.Config().ConnConfig.Copy())
	if err != nil {
		return fmt.Errorf("outbox: recover: connect: %w", err)
	}
	defer closeConn(conn, d.cfg.QueryTimeout)
	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock($1)`, d.lockKey); err != nil {
		return fmt.Errorf("outbox: recover: wait for in-flight batches (advisory lock): %w", err)
	}
	defer func() {
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), d.cfg.QueryTimeout)
		_, _ = conn.Exec(uctx, `SELECT pg_advisory_unlock($1)`, d.lockKey)
		cancel()
	}()
	for _, topic := range topics {
		if err := d.recoverStream(ctx, conn, topic); err != nil {
			return err
		}
	}
	return nil
}

func (d *Dispatcher) recoverStream(ctx context.Context, conn *pgx.Conn, topic string) error {
	stream, marker := StreamKey(d.cfg.Prefix, topic), EpochKey(d.cfg.Prefix, topic)
	states, err := d.getEpochs(ctx, []string{topic})
	if err != nil {
		return err
	}
	if s := states[topic]; s.err != nil {
		return fmt.Errorf("outbox: recover: read epoch marker %s: %w", marker, s.err)
	} else if s.value != "" {
		d.adopt(ctx, topic, s.value) // another dispatcher recovered it first
		d.epochMu.Lock()
		delete(d.vanished, topic)
		d.epochMu.Unlock()
		return nil
	}

	rctx, rcancel := context.WithTimeout(ctx, d.cfg.RedisTimeout)
	info, err := d.rdb.XInfoStream(rctx, stream).Result()
	rcancel()
	var added int64
	switch {
	case err == nil:
		added = info.EntriesAdded
	case strings.Contains(err.Error(), "no such key"):
		added = 0
	default:
		return fmt.Errorf("outbox: recover: XINFO STREAM %s: %w", stream, err)
	}
	qctx, qcancel := context.WithTimeout(ctx, d.cfg.QueryTimeout)
	d.epochMu.Lock()
	vanished := d.vanished[topic]
	d.epochMu.Unlock()
	var lost bool
	var cut time.Time
	err = conn.QueryRow(qctx, `
SELECT (SELECT count(*) FROM (SELECT 1 FROM outbox WHERE topic = $1 AND sent_at IS NOT NULL LIMIT $2::bigint + 1) s) > $2::bigint, now()`,
		topic, added).Scan(&lost, &cut)
	qcancel()
	if err != nil {
		return fmt.Errorf("outbox: recover: count sent rows of %q: %w", topic, err)
	}
	lost = lost || vanished != ""

	var remarked int64
	if lost {
		since := cut.Add(-d.cfg.RecoverWindow)
		for {
			qctx, qcancel := context.WithTimeout(ctx, d.cfg.QueryTimeout)
			tag, err := conn.Exec(qctx, `
UPDATE outbox SET sent_at = NULL WHERE id IN (
	SELECT id FROM outbox WHERE topic = $1 AND sent_at >= $2 AND sent_at < $3
	ORDER BY sent_at LIMIT $4)`, topic, since, cut, d.cfg.RecoverBatch)
			qcancel()
			if err != nil {
				d.metrics.Remarked.WithLabelValues(topic).Add(float64(remarked))
				return fmt.Errorf("outbox: recover: re-mark rows of %q sent since %v as unsent (%d done): %w", topic, since, remarked, err)
			}
			remarked += tag.RowsAffected()
			if tag.RowsAffected() < int64(d.cfg.RecoverBatch) {
				break
			}
		}
		d.metrics.StreamsLost.WithLabelValues(topic).Inc()
		d.metrics.Remarked.WithLabelValues(topic).Add(float64(remarked))
	}

	epoch := newEpoch()
	rctx, rcancel = context.WithTimeout(ctx, d.cfg.RedisTimeout)
	ok, err := d.rdb.SetNX(rctx, marker, epoch, 0).Result()
	if err == nil && !ok {
		epoch, err = d.rdb.Get(rctx, marker).Result()
	}
	rcancel()
	if err != nil {
		return fmt.Errorf("outbox: recover: create epoch marker %s: %w", marker, err)
	}
	d.epochMu.Lock()
	d.epochs[topic] = epoch
	delete(d.vanished, topic)
	d.epochMu.Unlock()
	if lost {
		d.log.ErrorContext(ctx, "outbox: Redis lost the stream's history (epoch marker gone): rows sent within the recover window are marked unsent and will be published again; inbox consumers deduplicate them, ledger consumers whose ledger was lost too run them again",
			"topic", topic, "stream", stream, "entries_added", added, "marker_vanished", vanished, "remarked", remarked,
			"since", cut.Add(-d.cfg.RecoverWindow), "epoch", epoch)
	} else {
		d.log.InfoContext(ctx, "outbox: created the stream's epoch marker (stream intact: first start, or marker deleted)",
			"topic", topic, "stream", stream, "entries_added", added, "epoch", epoch)
	}
	return nil
}
