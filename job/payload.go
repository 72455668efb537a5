package job

import (
	"encoding/json"
	"fmt"
)

// Payload is the job a task carries. The task id is Key.
//
// On the wire (what asynqmon shows) it is one flat JSON object with snake_case fields and
// a format version, PayloadV2:
//
//	{"v":2,"key":"catalog:sku-42:US:2026-04-23:v3","kind":"catalog","source_id":"sku-42",
//	 "country":"US","window":"2026-04-23","parser_version":3}
//
// (url, scope and meta when set). Workers read both formats — PayloadV1, the older
// {"key":…,"spec":{"Kind":…}} form, and PayloadV2 — so a fleet upgrades workers first,
// then enqueuers; EnqueuerConfig.PayloadVersion = PayloadV1 keeps writing the old format
// while workers of a release that can not read V2 still run.
//
// TraceParent, when set, is the W3C traceparent of the enqueue's span: every attempt of
// the job continues that trace. It is optional and not part of the job's identity (the
// key); workers that do not know it ignore it.
type Payload struct {
	Key         string `json:"key"`
	Spec        Spec   `json:"spec"`
	TraceParent string `json:"traceparent,omitempty"`
}

// Payload format versions.
const (
	// PayloadV1 is {"key":…,"spec":{Go field names}}, written before v2.
	PayloadV1 = 1
	// PayloadV2 is the flat snake_case form with "v":2.
	PayloadV2 = 2
	// DefaultPayloadVersion is what Enqueuers write.
	DefaultPayloadVersion = PayloadV2
)

// payloadV2 is the wire form of PayloadV2.
type payloadV2 struct {
	V             int               `json:"v"`
	Key           string            `json:"key"`
	Kind          string            `json:"kind"`
	URL           string            `json:"url,omitempty"`
	SourceID      string            `json:"source_id,omitempty"`
	Country       string            `json:"country"`
	Window        string            `json:"window"`
	ParserVersion int               `json:"parser_version"`
	Scope         string            `json:"scope,omitempty"`
	Meta          map[string]string `json:"meta,omitempty"`
	TraceParent   string            `json:"traceparent,omitempty"`
}

// EncodePayload writes p in format version (PayloadV1 or PayloadV2).
func EncodePayload(p Payload, version int) ([]byte, error) {
	switch version {
	case PayloadV1:
		return json.Marshal(p)
	case PayloadV2:
		s := p.Spec
		return json.Marshal(payloadV2{V: PayloadV2, Key: p.Key, Kind: s.Kind, URL: s.URL, SourceID: s.SourceID,
			Country: s.Country, Window: s.Window, ParserVersion: s.ParserVersion, Scope: s.Scope, Meta: s.Meta,
			TraceParent: p.TraceParent})
	}
	return nil, fmt.Errorf("tasks: payload version %d unknown (want %d or %d)", version, PayloadV1, PayloadV2)
}

// DecodePayload reads a task payload of either format version and checks that its key
// matches its spec, so a task edited by hand or written by another version can not run
// under a foreign key. A payload of a newer format version is refused with an error that
// names the version (a newer worker may read it).
//
// A payload as enqueuers write it (V2, spec already canonical) is read in one JSON pass and
// its URL checked with one normaliser pass; anything else takes the full path, which
// gives the same payload or the same error.
func DecodePayload(b []byte, n *Normalizer) (Payload, error) {
	if n == nil {
		n = DefaultNormalizer
	}
	var w payloadWire
	if err := json.Unmarshal(b, &w); err == nil && w.V != nil && *w.V == PayloadV2 {
		p := Payload{Key: w.Key, Spec: Spec{Kind: w.Kind, URL: w.URL, SourceID: w.SourceID, Country: w.Country,
			Window: w.Window, ParserVersion: w.ParserVersion, Scope: w.Scope, Meta: w.Meta}, TraceParent: w.TraceParent}
		if key, ok := n.keyOfCanonical(p.Spec); ok && key == p.Key {
			return p, nil
		}
	}
	return decodePayloadFull(b, n)
}

// payloadWire reads PayloadV2 and the format version in one pass.
type payloadWire struct {
	V *int `json:"v"`
	payloadV2
}

// decodePayloadFull is DecodePayload without the fast path.
func decodePayloadFull(b []byte, n *Normalizer) (Payload, error) {
	var head struct {
		V *int `json:"v"`
	}
	if err := json.Unmarshal(b, &head); err != nil {
		return Payload{}, fmt.Errorf("tasks: decode payload: %w", err)
	}
	var p Payload
	switch {
	case head.V == nil: // PayloadV1 carries no version
		if err := json.Unmarshal(b, &p); err != nil {
			return Payload{}, fmt.Errorf("tasks: decode payload v1: %w", err)
		}
	case *head.V == PayloadV2:
		var w payloadV2
		if err := json.Unmarshal(b, &w); err != nil {
			return Payload{}, fmt.Errorf("tasks: decode payload v2: %w", err)
		}
		p = Payload{Key: w.Key, Spec: Spec{Kind: w.Kind, URL: w.URL, SourceID: w.SourceID, Country: w.Country,
			Window: w.Window, ParserVersion: w.ParserVersion, Scope: w.Scope, Meta: w.Meta}, TraceParent: w.TraceParent}
	default:
		return Payload{}, fmt.Errorf("tasks: decode payload: format version %d is not one this worker reads (%d, %d)", *head.V, PayloadV1, PayloadV2)
	}
	key, err := n.Key(p.Spec)
	if err != nil {
		return Payload{}, fmt.Errorf("tasks: decode payload: %w", err)
	}
	if key != p.Key {
		return Payload{}, fmt.Errorf("tasks: decode payload: key %q does not match its spec (derived %q)", p.Key, key)
	}
	return p, nil
}
