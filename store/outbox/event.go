package outbox

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// NotifyChannel is the PostgreSQL LISTEN/NOTIFY channel dispatchers listen on. A committer
// that inserts an outbox row should notify this channel once its transaction committed —
// in the same transaction or in a later one (NOTIFY idemscrape_outbox, or pg_notify with
// this name); the payload is ignored and may be empty. A notification sent in the same
// transaction is delivered only when it commits, so a dispatcher never wakes for a row it
// cannot see yet. Without it the row is still dispatched, one PollInterval later. It is the
// channel store.Commit notifies, in its own asynchronously committed transaction after the
// commit (store.OutboxNotifyChannel).
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

// StreamKey returns the STREAM a topic is published to: <prefix>stream:{<topic>}. The hash
// tag is the topic (see [TopicTag]), so on Redis Cluster a stream, its epoch marker
// ([EpochKey]) and the ledger marks of its consumers ([LedgerKey]) live in one slot.
func StreamKey(prefix, topic string) string { return prefix + "stream:" + TopicTag(topic) }

// EpochKey returns the STRING that marks a stream's history as intact:
// <prefix>epoch:{<topic>}, in the stream's slot. A dispatcher creates it (SET, under the
// settlement lock) and publishes to the stream only while it exists; finding it gone means
// Redis lost the
// stream's data, and the dispatcher publishes again what may have been lost (see the
// package doc, Redis data loss).
func EpochKey(prefix, topic string) string { return prefix + "epoch:" + TopicTag(topic) }

// TopicTag returns the hash tag of a topic, braces included: "{<topic>}", or a hash of the
// topic ("{t:<hex>}") when the topic is empty or holds a brace, which would end or empty
// the tag.
func TopicTag(topic string) string {
	if topic == "" || strings.ContainsAny(topic, "{}") {
		sum := sha256.Sum256([]byte(topic))
		return "{t:" + hex.EncodeToString(sum[:12]) + "}"
	}
	return "{" + topic + "}"
}

// streamTag returns the hash tag Redis Cluster hashes stream by, braces included: the
// first "{…}" with something inside, as Redis finds it, or else "{<stream>}" (a hash of it
// when it holds a brace), which maps ledger keys to one slot (not the stream's).
func streamTag(stream string) string {
	if i := strings.IndexByte(stream, '{'); i >= 0 {
		if j := strings.IndexByte(stream[i+1:], '}'); j > 0 {
			return stream[i : i+1+j+1]
		}
	}
	return TopicTag(stream)
}

// LedgerKey returns the STRING that marks an event key as handled by group in Run mode, for
// a consumer of stream (its full key, e.g. StreamKey(prefix, topic)):
// <prefix>ledger:{<tag>}:<group>:<eventKey>, where {<tag>} is the stream's hash tag, so a
// consumer's stream and ledger marks live in one cluster slot, and group is query-escaped
// (a ':' in it cannot make two groups' marks collide).
func LedgerKey(prefix, stream, group, eventKey string) string {
	return prefix + "ledger:" + streamTag(stream) + ":" + url.QueryEscape(group) + ":" + eventKey
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

func randUint32() uint32 { return rand.Uint32() }
