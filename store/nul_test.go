package store_test

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
)

func TestJSONHasNUL(t *testing.T) {
	cases := []struct {
		name string
		json string // encoded JSON, as it would be committed
		want bool
		repl string // JSONReplaceNUL(json)
	}{
		{"NoEscape", `{"a":"plain text"}`, false, `{"a":"plain text"}`},
		{"RealNUL", `{"a":"x\u0000y"}`, true, `{"a":"x\ufffdy"}`},
		{"RealNULAtStart", `"\u0000"`, true, `"\ufffd"`},
		{"EscapedBackslashThenText", `{"js":"s.replace(/\\u0000/g,'')"}`, false, `{"js":"s.replace(/\\u0000/g,'')"}`},
		{"EscapedBackslashThenRealNUL", `{"a":"\\\u0000"}`, true, `{"a":"\\\ufffd"}`},
		{"TwoEscapedBackslashesThenText", `{"a":"\\\\u0000"}`, false, `{"a":"\\\\u0000"}`},
		{"ThreeBackslashPairsThenRealNUL", `{"a":"\\\\\\\u0000"}`, true, `{"a":"\\\\\\\ufffd"}`},
		{"TextThenRealNUL", `["\\u0000","\u0000"]`, true, `["\\u0000","\ufffd"]`},
		{"OtherEscape", `{"a":"\u0001\u00001"}`, true, `{"a":"\u0001\ufffd1"}`},
		{"NotNUL", `{"a":"\u00000"}`, true, `{"a":"\ufffd0"}`},
		{"Lookalike", `{"a":"\u0010\u1000\u00a0"}`, false, `{"a":"\u0010\u1000\u00a0"}`},
		{"RawText", `{"a":"u0000 and \\ alone"}`, false, `{"a":"u0000 and \\ alone"}`},
		{"RawNULByte", "{\"a\":\"x\x00y\"}", true, `{"a":"xy"}`},
		{"Empty", ``, false, ``},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, store.JSONHasNUL([]byte(tc.json)))
			got := store.JSONReplaceNUL([]byte(tc.json))
			assert.Equal(t, tc.repl, string(got))
			assert.False(t, store.JSONHasNUL(got), "replaced output still has a NUL")
			if tc.want && json.Valid([]byte(tc.json)) {
				// The oracle: decoding shows whether the value really holds U+0000.
				var v any
				require.NoError(t, json.Unmarshal([]byte(tc.json), &v))
				b, err := json.Marshal(v)
				require.NoError(t, err)
				assert.Contains(t, string(b), `\u0000`)
			}
		})
	}

	t.Run("AgreesWithDecoding", func(t *testing.T) {
		// Every string of up to 5 characters over an alphabet that builds escapes: the
		// function agrees with "decode, then look for U+0000".
		alphabet := []string{`\\`, `\u0000`, `u0000`, `a`, `\"`}
		var walk func(prefix string, depth int)
		walk = func(prefix string, depth int) {
			doc := `"` + prefix + `"`
			var s string
			require.NoError(t, json.Unmarshal([]byte(doc), &s), doc)
			want := false
			for _, r := range s {
				if r == 0 {
					want = true
				}
			}
			require.Equal(t, want, store.JSONHasNUL([]byte(doc)), doc)
			if depth == 0 {
				return
			}
			for _, a := range alphabet {
				walk(prefix+a, depth-1)
			}
		}
		walk("", 5)
	})
}
