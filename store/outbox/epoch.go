package outbox

import (
	"context"
	"crypto/rand"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/fnv"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/lua"
)

var (
	//go:embed state.lua
	stateSrc string

	stateScript = redis.NewScript(stateSrc)
)

// LogStreamLost begins the message a dispatcher logs (at error level, once per recovery,
// with the attributes topic, stream and remarked) when it finds that Redis lost a stream's
// data and moves the topic's position back over the rows created within the recover
// window. Tools that read the logs
// (cmd/chaos) match on it.
const LogStreamLost = "outbox: Redis lost the stream's data"

// Redis data loss defaults.
const (
	// DefaultRecoverWindow is how far back, from the moment a loss is detected, a topic's
	// outbox rows (by creation time) are dispatched again when Redis lost its stream.
	DefaultRecoverWindow = 24 * time.Hour
	// DefaultRecoverBatch is how many rows one step of a recovery's walk back reads.
	DefaultRecoverBatch = 1000
	// recoverTimeout bounds one settlement under the exclusive lock: waiting for in-flight
	// batches, moving positions back, and writing the new epochs.
	recoverTimeout = 2 * time.Minute
)

// epochState is what state.lua found of a stream: its epoch marker, its entries-added and
// its length.
type epochState struct {
	value  string // "" when the marker is absent (or, oddly, empty: treated alike)
	added  int64  // the stream's entries-added (XINFO STREAM): 0 when there is no stream
	length int64  // the stream's length (XLEN): 0 when there is no stream
	err    error  // the script failed
}

// pgEpoch is PostgreSQL's record of a stream: its epoch and the greatest entries-added that
// a committed batch read right after its own XADDs (outbox_epochs.entries_added, migration
// 00013): every entry of every committed batch lies within that count, and the stream, a
// counter that never goes down unless Redis lost data, has at least that many.
type pgEpoch struct {
	epoch string
	added int64
}

// intact reports whether a stream's state agrees with PostgreSQL's record: the marker is
// the epoch and the stream was never set back below the entries the dispatchers added.
func (s epochState) intact(epoch string, floor int64) bool {
	return s.value != "" && s.value == epoch && s.added >= floor
}

// querier is what pgEpochs reads through: a batch's transaction, the pool, or the
// recovery's connection.
type querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// recoverLockKey is the PostgreSQL advisory lock that orders dispatch batches (shared,
// held from the claim to the commit) against a settlement (exclusive): an epoch is created
// or replaced only once every batch that may have published to the lost Redis has
// committed, and no batch takes a position while positions move back. One lock per stream prefix.
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

// knownEpoch is the epoch of topic that this dispatcher last found in PostgreSQL and in
// the marker alike ("" when none yet).
func (d *Dispatcher) knownEpoch(topic string) string {
	d.epochMu.Lock()
	defer d.epochMu.Unlock()
	return d.epochs[topic]
}

// floor is the entries-added of topic's stream that this dispatcher last read from
// PostgreSQL (0 when none yet): the stream, unless Redis lost part of it, has at least
// that many.
func (d *Dispatcher) floor(topic string) int64 {
	d.epochMu.Lock()
	defer d.epochMu.Unlock()
	return d.floors[topic]
}

// adopt records epoch as topic's current one and added as its floor (PostgreSQL holds
// them). An epoch that differs from the one remembered means another dispatcher settled a
// loss; that is logged once per change.
func (d *Dispatcher) adopt(ctx context.Context, topic, epoch string, added int64) {
	d.epochMu.Lock()
	old := d.epochs[topic]
	d.epochs[topic] = epoch
	d.floors[topic] = added
	d.epochMu.Unlock()
	if old != "" && old != epoch {
		d.log.WarnContext(ctx, "outbox: the stream's epoch changed: Redis lost its data and another dispatcher republished what it may have held",
			"topic", topic, "old_epoch", old, "epoch", epoch)
	}
}

// getEpochs reads the epoch marker, entries-added and length of the streams of topics:
// state.lua once per topic, in one pipeline. The lengths go to
// idemscrape_outbox_stream_length.
func (d *Dispatcher) getEpochs(ctx context.Context, topics []string) map[string]epochState {
	rctx, cancel := context.WithTimeout(ctx, d.cfg.RedisTimeout)
	defer cancel()
	keys := make([][]string, len(topics))
	for i, t := range topics {
		keys[i] = []string{EpochKey(d.cfg.Prefix, t), StreamKey(d.cfg.Prefix, t)}
	}
	cmds := lua.RunMany(rctx, d.rdb, stateScript, keys, nil)
	out := make(map[string]epochState, len(topics))
	for i, t := range topics {
		out[t] = parseState(cmds[i])
		d.recordLength(t, out[t])
	}
	return out
}

// recordLength sets idemscrape_outbox_stream_length of topic from a state read that
// succeeded (and its cap beside it): every read of a stream's state, before and after a
// batch's XADDs and in the idle check, keeps the gauge current at no extra round trip.
func (d *Dispatcher) recordLength(topic string, s epochState) {
	if s.err != nil {
		return
	}
	d.metrics.Length.WithLabelValues(topic).Set(float64(s.length))
	if d.cfg.MaxLen > 0 {
		d.metrics.MaxLength.WithLabelValues(topic).Set(float64(d.cfg.MaxLen))
	}
}

// parseState reads state.lua's reply.
func parseState(c *redis.Cmd) epochState {
	v, err := c.Slice()
	if err != nil {
		return epochState{err: err}
	}
	bad := func() epochState {
		return epochState{err: fmt.Errorf("stream state script: reply %v, want {marker, added, length}", v)}
	}
	if len(v) != 3 {
		return bad()
	}
	marker, ok1 := v[0].(string)
	added, ok2 := v[1].(int64)
	length, ok3 := v[2].(int64)
	if !ok1 || !ok2 || !ok3 || added < 0 || length < 0 {
		return bad()
	}
	return epochState{value: marker, added: added, length: length}
}

// pgEpochs reads the epochs PostgreSQL holds for topics under this dispatcher's prefix
// (every topic of the prefix when topics is nil), in one statement.
func (d *Dispatcher) pgEpochs(ctx context.Context, q querier, topics []string) (map[string]pgEpoch, error) {
	qctx, cancel := context.WithTimeout(ctx, d.cfg.QueryTimeout)
	defer cancel()
	var rows pgx.Rows
	if topics == nil {
		rows, _ = q.Query(qctx, `SELECT topic, epoch, entries_added FROM outbox_epochs WHERE prefix = $1`, d.cfg.Prefix)
	} else {
		rows, _ = q.Query(qctx, `SELECT topic, epoch, entries_added FROM outbox_epochs WHERE prefix = $1 AND topic = ANY($2)`, d.cfg.Prefix, topics)
	}
	out := make(map[string]pgEpoch)
	var topic string
	var e pgEpoch
	_, err := pgx.ForEachRow(rows, []any{&topic, &e.epoch, &e.added}, func() error {
		out[topic] = e
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("outbox: read stream epochs (table outbox_epochs, migrations 00007, 00013): %w", err)
	}
	return out, nil
}

// unsettled reads the state of the streams of topics (one Redis round trip) and returns
// the topics whose stream does not agree with PostgreSQL: a marker absent or not the
// epoch, a topic without an epoch yet, or a stream with fewer entries added than
// PostgreSQL recorded (Redis came back with an older copy). floors holds, per topic, the
// entries-added PostgreSQL recorded as read before this call (the batch's claim read it):
// a stream can only have more, unless Redis lost part of it. Topics that agree with what
// this dispatcher knows cost nothing more; the others are compared with PostgreSQL
// through q (one statement), and adopted when they agree (another dispatcher settled
// them). states is what Redis said of every topic.
func (d *Dispatcher) unsettled(ctx context.Context, q querier, topics []string, floors map[string]int64) (out []string, err error) {
	states := d.getEpochs(ctx, topics)
	var unsure []string
	for _, t := range topics {
		switch s := states[t]; {
		case s.err != nil:
			return nil, fmt.Errorf("outbox: read the epoch marker and length of %q's stream: %w", t, s.err)
		case !s.intact(d.knownEpoch(t), max(floors[t], d.floor(t))):
			unsure = append(unsure, t)
		}
	}
	if len(unsure) == 0 {
		return nil, nil
	}
	pg, err := d.pgEpochs(ctx, q, unsure)
	if err != nil {
		return nil, err
	}
	for _, t := range unsure {
		// PostgreSQL is read after Redis here, so its count may include entries another
		// dispatcher added since: such a topic is settled under the lock, which finds it
		// intact.
		if e, ok := pg[t]; ok && states[t].intact(e.epoch, e.added) {
			d.adopt(ctx, t, e.epoch, e.added)
			continue
		}
		out = append(out, t)
	}
	return out, nil
}

// CheckStreams compares the epoch marker of every topic PostgreSQL holds an epoch of
// (under this dispatcher's prefix) with that epoch, and settles those that differ (see the
// package doc, Redis data loss). It returns the topics whose stream was found lost and
// whose rows are dispatched again. The background loop runs the same check whenever
// it is idle (reading PostgreSQL's epochs at most once per PollInterval); call it directly
// to check at once.
func (d *Dispatcher) CheckStreams(ctx context.Context) ([]string, error) {
	return d.checkStreams(ctx, true)
}

// checkStreams is CheckStreams; refresh false reads PostgreSQL's epochs only if the last
// read is at least PollInterval old (the idle loop's rate).
func (d *Dispatcher) checkStreams(ctx context.Context, refresh bool) ([]string, error) {
	d.epochMu.Lock()
	due := refresh || time.Since(d.refreshed) >= d.cfg.PollInterval
	d.epochMu.Unlock()
	if due {
		pg, err := d.pgEpochs(ctx, d.pool, nil)
		if err != nil {
			return nil, err
		}
		for t, e := range pg {
			d.adopt(ctx, t, e.epoch, e.added)
		}
		d.epochMu.Lock()
		d.refreshed = time.Now()
		d.epochMu.Unlock()
	}
	d.epochMu.Lock()
	topics := make([]string, 0, len(d.epochs))
	for t := range d.epochs {
		topics = append(topics, t)
	}
	d.epochMu.Unlock()
	if len(topics) == 0 {
		return nil, nil
	}
	sort.Strings(topics)
	todo, err := d.unsettled(ctx, d.pool, topics, nil)
	if err != nil || len(todo) == 0 {
		return nil, err
	}
	return d.settle(ctx, todo)
}

// settle decides, under the exclusive recovery lock, what the epoch of each of topics is,
// and returns the topics it found lost (their positions moved back). The lock makes every batch
// that may have published to the old Redis commit first and holds new claims back; and
// since every decision that creates or replaces an epoch is taken under it, after
// re-reading both PostgreSQL and the marker, two dispatchers never both recover one loss
// nor take each other's first start for a loss. For each topic:
//
//   - PostgreSQL has no epoch: the topic was never dispatched with epochs (a fresh
//     install, an upgrade from a version without them, a new topic). The marker is adopted
//     if present, else a new epoch is SET, then the row is inserted. Nothing is published again,
//     whatever the stream holds. (Marker first: a crash in between leaves a marker without
//     a row, which the next dispatcher adopts, never a row without a marker.)
//   - PostgreSQL's epoch equals the marker: another dispatcher settled it; adopted.
//   - The marker is absent or different: Redis lost the stream's data (or came back from
//     a snapshot older than the epoch). The topic's position moves back to just before its
//     first row created within RecoverWindow before now (rewind; counted in
//     idemscrape_outbox_remarked_total, logged once), then a new epoch is written to
//     PostgreSQL and SET as the marker. A crash in between leaves the two different: the
//     next dispatcher moves the position back again, which only republishes more copies.
func (d *Dispatcher) settle(ctx context.Context, topics []string) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, recoverTimeout)
	defer cancel()
	// A connection of its own, closed at the end: the session lock cannot outlive it, even
	// if the unlock fails.
	conn, err := pgx.ConnectConfig(ctx, d.pool.Config().ConnConfig.Copy())
	if err != nil {
		return nil, fmt.Errorf("outbox: settle epochs: connect: %w", err)
	}
	defer closeConn(conn, d.cfg.QueryTimeout)
	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock($1)`, d.lockKey); err != nil {
		return nil, fmt.Errorf("outbox: settle epochs: wait for in-flight batches (advisory lock): %w", err)
	}
	defer func() {
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), d.cfg.QueryTimeout)
		_, _ = conn.Exec(uctx, `SELECT pg_advisory_unlock($1)`, d.lockKey)
		cancel()
	}()
	// Re-read both sides under the lock: another dispatcher may have settled them while
	// this one waited.
	pg, err := d.pgEpochs(ctx, conn, topics)
	if err != nil {
		return nil, err
	}
	states := d.getEpochs(ctx, topics)
	var lost []string
	for _, topic := range topics {
		s := states[topic]
		if s.err != nil {
			return lost, fmt.Errorf("outbox: settle epochs: read epoch marker %s and stream %s: %w", EpochKey(d.cfg.Prefix, topic), StreamKey(d.cfg.Prefix, topic), s.err)
		}
		switch e, ok := pg[topic]; {
		case !ok:
			err = d.firstEpoch(ctx, conn, topic, s.value)
		case s.intact(e.epoch, e.added):
			d.adopt(ctx, topic, e.epoch, e.added)
		default:
			lost = append(lost, topic)
			err = d.recoverStream(ctx, conn, topic, e, s)
		}
		if err != nil {
			return lost, err
		}
	}
	return lost, nil
}

// firstEpoch gives topic its first epoch: the marker's value if there is one, else a new
// one SET as the marker; then the PostgreSQL row. Called under the exclusive lock.
func (d *Dispatcher) firstEpoch(ctx context.Context, conn *pgx.Conn, topic, marker string) error {
	epoch, key := marker, EpochKey(d.cfg.Prefix, topic)
	if epoch == "" {
		epoch = newEpoch()
		rctx, cancel := context.WithTimeout(ctx, d.cfg.RedisTimeout)
		err := d.rdb.Set(rctx, key, epoch, 0).Err()
		cancel()
		if err != nil {
			return fmt.Errorf("outbox: settle epochs: create epoch marker %s: %w", key, err)
		}
	}
	qctx, cancel := context.WithTimeout(ctx, d.cfg.QueryTimeout)
	_, err := conn.Exec(qctx, `INSERT INTO outbox_epochs (prefix, topic, epoch) VALUES ($1, $2, $3)`, d.cfg.Prefix, topic, epoch)
	cancel()
	if err != nil {
		return fmt.Errorf("outbox: settle epochs: record the first epoch of %q: %w", topic, err)
	}
	d.adopt(ctx, topic, epoch, 0)
	d.log.InfoContext(ctx, "outbox: the stream's first epoch (first dispatch of this topic with epochs: nothing republished)",
		"topic", topic, "epoch", epoch, "adopted_marker", marker != "")
	return nil
}

// rewind moves topic's position back to just before its first row (in (xid, id) order)
// created at or after since, if that row is behind it, and returns how many rows are in
// front of the position again. It walks back from the position in steps of RecoverBatch
// rows (outbox_topic_xid_idx) and stops after a whole step of rows created before since:
// created_at follows the commit order but for rows of transactions that ran long, which
// the step's margin covers. Called under the exclusive lock: no batch holds the position.
func (d *Dispatcher) rewind(ctx context.Context, conn *pgx.Conn, topic string, since time.Time) (int64, error) {
	var (
		curXid string
		curID  int64
	)
	qctx, cancel := context.WithTimeout(ctx, d.cfg.QueryTimeout)
	err := conn.QueryRow(qctx, `SELECT xid::text, id FROM outbox_positions WHERE topic = $1`, topic).Scan(&curXid, &curID)
	cancel()
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, nil // never dispatched: nothing to publish again
	}
	if err != nil {
		return 0, err
	}
	var (
		walked, back int64
		firstXid     string
		firstID      int64
		xid          = curXid
		id           = curID
	)
	for {
		qctx, cancel := context.WithTimeout(ctx, d.cfg.QueryTimeout)
		rows, _ := conn.Query(qctx, `
SELECT xid::text, id, created_at >= $4 FROM outbox
WHERE topic = $1 AND (xid, id) <= ($2::xid8, $3)
ORDER BY xid DESC, id DESC LIMIT $5`, topic, xid, id, since, d.cfg.RecoverBatch)
		var (
			rx     string
			rid    int64
			recent bool
			n      int
			found  bool
		)
		_, err := pgx.ForEachRow(rows, []any{&rx, &rid, &recent}, func() error {
			n++
			walked++
			xid, id = rx, rid
			if recent {
				found = true
				firstXid, firstID, back = rx, rid, walked
			}
			return nil
		})
		cancel()
		if err != nil {
			return 0, err
		}
		if !found || n < d.cfg.RecoverBatch {
			break
		}
		// The next step starts below the last row read.
		if id == 0 {
			break
		}
		id--
	}
	if back == 0 {
		return 0, nil
	}
	qctx, cancel = context.WithTimeout(ctx, d.cfg.QueryTimeout)
	defer cancel()
	_, err = conn.Exec(qctx, `UPDATE outbox_positions SET xid = $2::xid8, id = $3, updated_at = now() WHERE topic = $1`,
		topic, firstXid, firstID-1)
	return back, err
}

// recoverStream moves a lost stream's topic position back and starts a new epoch (its count of
// entries added starts again at 0). Called under the exclusive lock; old is PostgreSQL's
// record, found what Redis holds.
func (d *Dispatcher) recoverStream(ctx context.Context, conn *pgx.Conn, topic string, old pgEpoch, found epochState) error {
	key := EpochKey(d.cfg.Prefix, topic)
	var cut time.Time
	qctx, qcancel := context.WithTimeout(ctx, d.cfg.QueryTimeout)
	err := conn.QueryRow(qctx, `SELECT now()`).Scan(&cut)
	qcancel()
	if err != nil {
		return fmt.Errorf("outbox: recover %q: %w", topic, err)
	}
	since := cut.Add(-d.cfg.RecoverWindow)
	remarked, err := d.rewind(ctx, conn, topic, since)
	if err != nil {
		return fmt.Errorf("outbox: recover: move %q's position back to its first row created since %v: %w", topic, since, err)
	}
	d.metrics.StreamsLost.WithLabelValues(topic).Inc()
	d.metrics.Remarked.WithLabelValues(topic).Add(float64(remarked))

	epoch := newEpoch()
	qctx, qcancel = context.WithTimeout(ctx, d.cfg.QueryTimeout)
	_, err = conn.Exec(qctx, `UPDATE outbox_epochs SET epoch = $3, entries_added = 0, created_at = now() WHERE prefix = $1 AND topic = $2`,
		d.cfg.Prefix, topic, epoch)
	qcancel()
	if err != nil {
		return fmt.Errorf("outbox: recover: record the new epoch of %q (%d rows to publish again): %w", topic, remarked, err)
	}
	rctx, rcancel := context.WithTimeout(ctx, d.cfg.RedisTimeout)
	err = d.rdb.Set(rctx, key, epoch, 0).Err()
	rcancel()
	if err != nil {
		return fmt.Errorf("outbox: recover: set epoch marker %s (%d rows to publish again): %w", key, remarked, err)
	}
	d.epochMu.Lock()
	d.epochs[topic], d.floors[topic] = epoch, 0
	d.epochMu.Unlock()
	marker, why := found.value, "its epoch marker is not the one PostgreSQL holds"
	switch {
	case marker == "":
		marker = "(absent)"
	case marker == old.epoch:
		why = "the stream has had fewer entries added than the dispatchers published: Redis came back with an older copy of it"
	}
	d.log.ErrorContext(ctx, LogStreamLost+" ("+why+"): the rows created within the recover window will be published again (the position moved back); inbox consumers deduplicate them, ledger consumers whose ledger was lost too run them again",
		"topic", topic, "stream", StreamKey(d.cfg.Prefix, topic), "epoch_expected", old.epoch, "marker_found", marker,
		"entries_added_recorded", old.added, "entries_added_found", found.added,
		"remarked", remarked, "since", since, "epoch", epoch)
	return nil
}
