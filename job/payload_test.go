package job

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
	t.Run("FastPathSameAnswers", func(t *testing.T) {
		// DecodePayload checks a canonical V2 payload with one normaliser pass; every
		// other payload must get exactly the answer of the full path.
		canon, err := Spec{Kind: "catalog", URL: "https://shop.example/p/1?a=1&b=2", Country: "US", Window: "w", ParserVersion: 1}.Normalize()
		require.NoError(t, err)
		key, err := canon.Key()
		require.NoError(t, err)
		raw := canon
		raw.URL = "HTTPS://Shop.Example:443/p/./1?b=2&a=1&utm_source=x#frag" // same canonical form
		rawKey := deriveKey(raw)                                             // a key derived without normalising
		require.NotEqual(t, key, rawKey)
		for _, tc := range []struct {
			name string
			p    Payload
			err  string
		}{
			{"canonical", Payload{Key: key, Spec: canon}, ""},
			{"raw URL, canonical key", Payload{Key: key, Spec: raw}, ""},
			{"raw URL, key of the raw URL", Payload{Key: rawKey, Spec: raw}, "does not match its spec"},
			{"canonical URL, foreign key", Payload{Key: rawKey, Spec: canon}, "does not match its spec"},
			{"lower-case country", Payload{Key: key, Spec: func() Spec { s := canon; s.Country = "us"; return s }()}, ""},
			{"invalid window", Payload{Key: key, Spec: func() Spec { s := canon; s.Window = "a b"; return s }()}, "field Window"},
			{"credentials in URL", Payload{Key: key, Spec: func() Spec { s := canon; s.URL = "https://u:pw@shop.example/p/1"; return s }()}, "credentials"},
		} {
			b, err := EncodePayload(tc.p, PayloadV2)
			require.NoError(t, err)
			got, err := DecodePayload(b, nil)
			full, ferr := decodePayloadFull(b, DefaultNormalizer)
			require.Equal(t, full, got, tc.name)
			if tc.err == "" {
				require.NoError(t, err, tc.name)
				require.NoError(t, ferr, tc.name)
				continue
			}
			require.ErrorContains(t, err, tc.err, tc.name)
			require.Equal(t, ferr.Error(), err.Error(), tc.name)
			require.NotContains(t, err.Error(), "pw", tc.name)
		}
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
	})
}

// BenchmarkDecodePayload is the per-attempt decode a worker does before anything else
// : JSON, validation and the key check.
func BenchmarkDecodePayload(b *testing.B) {
	for _, tc := range []struct {
		name string
		spec Spec
	}{
		{"URL", Spec{Kind: "catalog", URL: "https://shop.example/products/widget-42?color=blue&size=m", Country: "US", Window: "2026-04-23", ParserVersion: 3,
			Meta: map[string]string{"request": "r1"}}},
		{"SourceID", Spec{Kind: "catalog", SourceID: "sku-42", Country: "US", Window: "2026-04-23", ParserVersion: 3}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			s, err := tc.spec.Normalize()
			if err != nil {
				b.Fatal(err)
			}
			k, err := s.Key()
			if err != nil {
				b.Fatal(err)
			}
			raw, err := EncodePayload(Payload{Key: k, Spec: s}, PayloadV2)
			if err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			for b.Loop() {
				if _, err := DecodePayload(raw, nil); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
