package tasks

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestPayloadFormats: workers read both payload formats, so a fleet can upgrade workers
// first and enqueuers second; the V2 wire form is flat snake_case, as asynqmon shows it.
func TestPayloadFormats(t *testing.T) {
	spec, err := Spec{Kind: "catalog", SourceID: "sku-42", Country: "us", Window: "2026-04-23", ParserVersion: 3,
		Meta: map[string]string{"request": "r1"}}.Normalize()
	require.NoError(t, err)
	key, err := spec.Key()
	require.NoError(t, err)
	p := Payload{Key: key, Spec: spec}

	t.Run("V2WireForm", func(t *testing.T) {
		b, err := EncodePayload(p, PayloadV2)
		require.NoError(t, err)
		require.JSONEq(t, `{"v":2,"key":"catalog:sku-42:US:2026-04-23:v3","kind":"catalog","source_id":"sku-42",
			"country":"US","window":"2026-04-23","parser_version":3,"meta":{"request":"r1"}}`, string(b))
		got, err := DecodePayload(b, nil)
		require.NoError(t, err)
		require.Equal(t, p, got)
	})
	t.Run("V1StillRead", func(t *testing.T) {
		b, err := json.Marshal(p) // what enqueuers before v2 wrote
		require.NoError(t, err)
		require.Contains(t, string(b), `"ParserVersion":3`)
		got, err := DecodePayload(b, nil)
		require.NoError(t, err)
		require.Equal(t, p, got)
		b1, err := EncodePayload(p, PayloadV1)
		require.NoError(t, err)
		require.Equal(t, b, b1)
	})
	t.Run("URLSpec", func(t *testing.T) {
		s, err := Spec{Kind: "catalog", URL: "https://Shop.example/p/1?b=2&a=1", Country: "US", Window: "w", ParserVersion: 1, Scope: "acme"}.Normalize()
		require.NoError(t, err)
		k, err := s.Key()
		require.NoError(t, err)
		b, err := EncodePayload(Payload{Key: k, Spec: s}, PayloadV2)
		require.NoError(t, err)
		require.NotContains(t, string(b), "source_id")
		got, err := DecodePayload(b, nil)
		require.NoError(t, err)
		require.Equal(t, s, got.Spec)
	})
	t.Run("Refusals", func(t *testing.T) {
		_, err := DecodePayload([]byte(`{"v":3,"key":"x"}`), nil)
		require.ErrorContains(t, err, "format version 3")
		_, err = DecodePayload([]byte(`not json`), nil)
		require.ErrorContains(t, err, "decode payload")
		b, err := EncodePayload(Payload{Key: "catalog:sku-1:US:2026-04-23:v3", Spec: spec}, PayloadV2)
		require.NoError(t, err)
		_, err = DecodePayload(b, nil)
		require.ErrorContains(t, err, "does not match its spec", "a foreign key is refused")
		_, err = EncodePayload(p, 7)
		require.ErrorContains(t, err, "payload version 7")
		c := EnqueuerConfig{PayloadVersion: 5}
		require.ErrorContains(t, c.Validate(), "PayloadVersion 5")
	})
}
