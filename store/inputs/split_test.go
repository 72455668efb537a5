package inputs

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

// splitObject must agree with encoding/json on every object json.Marshal writes.
func TestSplitObject(t *testing.T) {
	for _, staged := range []map[string]json.RawMessage{
		{},
		{"a": json.RawMessage(`1`)},
		{"a": json.RawMessage(`"x,}\"]"`), "b": json.RawMessage(`{"c":[1,{"d":"}"}],"e":null}`), "f": json.RawMessage(`[]`)},
		{"page": json.RawMessage(`"<html lang=\"en\">\u003cbody\u003e, } ] {"`), "n": json.RawMessage(`-1.5e3`), "t": json.RawMessage(`true`)},
		{"nested": json.RawMessage(`{"x":{"y":{"z":"\\"}}}`), "last": json.RawMessage(`"\\"`)},
	} {
		raw, err := json.Marshal(staged)
		require.NoError(t, err)
		want := map[string]json.RawMessage{}
		require.NoError(t, json.Unmarshal(raw, &want))
		got, ok := splitObject(raw)
		require.True(t, ok, "%s", raw)
		require.Equal(t, want, got, "%s", raw)
	}
	for _, bad := range []string{``, `{`, `[1]`, `{"a":1`, `{"a\"b":1}`, `{ "a":1}`} {
		_, ok := splitObject([]byte(bad))
		require.False(t, ok, bad)
	}
}

func FuzzSplitObject(f *testing.F) {
	f.Add(`{"a":"b","c":[1,2,{"d":"e"}]}`)
	f.Add(`{"x":"\"}"}`)
	f.Fuzz(func(t *testing.T, s string) {
		var v map[string]json.RawMessage
		if json.Unmarshal([]byte(s), &v) != nil {
			return
		}
		raw, err := json.Marshal(v)
		if err != nil {
			return
		}
		want := map[string]json.RawMessage{}
		require.NoError(t, json.Unmarshal(raw, &want))
		if got, ok := splitObject(raw); ok {
			require.Equal(t, want, got, "%s", raw)
		}
	})
}
