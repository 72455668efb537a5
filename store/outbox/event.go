package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"time"
)

// NotifyChannel is the PostgreSQL LISTEN/NOTIFY channel dispatchers listen on. A committer
// that inserts an outbox row must also notify this channel in the same transaction
// (NOTIFY idemscrape_outbox, or pg_notify with this name); the payload is ignored and may
// be empty. PostgreSQL delivers the notification only when the transaction commits, so a
// dispatcher never wakes for a row it cannot see yet. Without it the row is still
// dispatched, one PollInterval later. It is the channel store.Commit notifies
// (store.OutboxNotifyChannel).
const NotifyChannel = "idemscrape_outbox"

// DefaultPrefix is the key prefix of streams and ledger keys unless a config sets one.
const DefaultPrefix = "idemscrape:"

// Stream entry field names. Every entry the dispatcher writes has all five.
const (
	FieldEventKey  = "event_key"
	FieldTopic     = "topic"
	FieldPayload   = "payload"
	FieldOutboxID  = "outbox_id"
	FieldCreatedAt = "created_at"
)

// StreamKey returns the STREAM a topic is published to: <prefix>stream:<topic>.
func StreamKey(prefix, topic string) string { return prefix + "stream:" + topic }

// LedgerKey returns the STRING that marks an event key as handled by group in Run mode:
// <prefix>ledger:{<group>}:<eventKey>. The hash tag keeps one group's marks on one cluster
// slot.
func LedgerKey(prefix, group, eventKey string) string {
	return prefix + "ledger:{" + group + "}:" + eventKey
}

// Event is one outbox event as a consumer receives it.
type Event struct {
	StreamID  string          // the stream entry id; a replay has a different one
	Topic     string          // outbox.topic
	EventKey  string          // outbox.event_key: stable per event, the deduplication key
	OutboxID  int64           // outbox.id
	Payload   json.RawMessage // outbox.payload (JSON as PostgreSQL's jsonb renders it)
	CreatedAt time.Time       // outbox.created_at
	// Delivery is how many times the group delivered this entry, this delivery included:
	// 1 for an entry read for the first time, the XPENDING delivery count for a reclaimed
	// entry, 0 when unknown.
	Delivery int
}

// errMalformed marks a stream entry that is not an outbox event.
var errMalformed = errors.New("outbox: malformed stream entry")

func decodeEvent(id string, values map[string]any) (Event, error) {
	str := func(field string) (string, error) {
		v, ok := values[field]
		if !ok {
			return "", fmt.Errorf("%w %s: no field %q", errMalformed, id, field)
		}
		s, ok := v.(string)
		if !ok {
			return "", fmt.Errorf("%w %s: field %q is %T", errMalformed, id, field, v)
		}
		return s, nil
	}
	ev := Event{StreamID: id}
	var err error
	if ev.EventKey, err = str(FieldEventKey); err != nil {
		return Event{}, err
	}
	if ev.EventKey == "" {
		return Event{}, fmt.Errorf("%w %s: empty %s", errMalformed, id, FieldEventKey)
	}
	if ev.Topic, err = str(FieldTopic); err != nil {
		return Event{}, err
	}
	payload, err := str(FieldPayload)
	if err != nil {
		return Event{}, err
	}
	ev.Payload = json.RawMessage(payload)
	oid, err := str(FieldOutboxID)
	if err != nil {
		return Event{}, err
	}
	if ev.OutboxID, err = strconv.ParseInt(oid, 10, 64); err != nil {
		return Event{}, fmt.Errorf("%w %s: %s: %v", errMalformed, id, FieldOutboxID, err)
	}
	created, err := str(FieldCreatedAt)
	if err != nil {
		return Event{}, err
	}
	if ev.CreatedAt, err = time.Parse(time.RFC3339Nano, created); err != nil {
		return Event{}, fmt.Errorf("%w %s: %s: %v", errMalformed, id, FieldCreatedAt, err)
	}
	return ev, nil
}

// backoff returns the delay before retry number attempt (1-based): exponential from base,
// capped at max, with "equal jitter" (half fixed, half random), so a fleet spreads out but
// never spins.
func backoff(attempt int, base, max time.Duration) time.Duration {
	d := base
	for i := 1; i < attempt && d < max; i++ {
		d *= 2
	}
	d = min(d, max)
	half := d / 2
	return half + time.Duration(rand.Int64N(int64(half)+1))
}

// jittered varies d by up to ± frac.
// backoffDefaults fills unset retry backoff settings: the first delay defaults to
// DefaultRetryBackoff (never above a given max), the max to DefaultRetryBackoffMax (never
// below the first delay).
func backoffDefaults(first, maxDelay time.Duration) (time.Duration, time.Duration) {
	if first == 0 {
		first = DefaultRetryBackoff
		if maxDelay > 0 {
			first = min(first, maxDelay)
		}
	}
	if maxDelay == 0 {
		maxDelay = max(DefaultRetryBackoffMax, first)
	}
	return first, maxDelay
}

func jittered(d time.Duration, frac float64) time.Duration {
	return time.Duration(float64(d) * (1 + frac*(2*rand.Float64()-1)))
}

// sleepCtx waits for d or until ctx is done; it reports whether the full d passed.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

func randUint32() uint32 { return rand.Uint32() }
