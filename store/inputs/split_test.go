package inputs

import (
	"bytes"
	"compress/gzip"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

// splitObject must agree with encoding/json on every object json.Marshal writes.
func TestSplitObject(t *testing.T) {
	agrees := func(staged map[string]json.RawMessage) {
		t.Helper()
		raw, err := json.Marshal(staged)
		require.NoError(t, err)
		want := map[string]json.RawMessage{}
		require.NoError(t, json.Unmarshal(raw, &want))
		got, ok := splitObject(raw)
		require.True(t, ok, "%s", raw)
		require.Equal(t, want, got, "%s", raw)
	}
	for _, staged := range []map[string]json.RawMessage{
		{},
		{"a": json.RawMessage(`1`)},
		{"a": json.RawMessage(`"x,}\"]"`), "b": json.RawMessage(`{"c":[1,{"d":"}"}],"e":null}`), "f": json.RawMessage(`[]`)},
		{"page": json.RawMessage(`"<html lang=\"en\">\u003cbody\u003e, } ] {"`), "n": json.RawMessage(`-1.5e3`), "t": json.RawMessage(`true`)},
		{"nested": json.RawMessage(`{"x":{"y":{"z":"\\"}}}`), "last": json.RawMessage(`"\\"`)},
	} {
		agrees(staged)
	}
	// Strings made of quotes, backslashes and the structural characters, escaped by
	// json.Marshal: every closing quote is found (an escaped quote after any run of
	// backslashes is not one).
	rng := rand.New(rand.NewPCG(7, 8))
	alphabet := []rune{'"', '\\', ',', '}', ']', '{', '[', ':', 'a', ' ', '\u00e9'}
	for range 2000 {
		staged := map[string]json.RawMessage{}
		for k := range 1 + rng.IntN(3) {
			r := make([]rune, rng.IntN(12))
			for i := range r {
				r[i] = alphabet[rng.IntN(len(alphabet))]
			}
			v, err := json.Marshal(map[string]any{"s": string(r), "l": []string{string(r), "x"}})
			require.NoError(t, err)
			staged[fmt.Sprintf("k%d", k)] = v
		}
		agrees(staged)
	}
	for _, bad := range []string{``, `{`, `[1]`, `{"a":1`, `{"a\"b":1}`, `{ "a":1}`, `{"a":"x\"}`} {
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

// A blob whose bytes changed after it was written is refused, not decoded into whatever
// the damaged stream inflates to: the codec's checksum (zstd's xxhash64, gzip's CRC-32 of
// blobs written by earlier versions) is checked even when the raw size is known (the
// staged data is then split without validating it again).
func TestDecodeChecksCRC(t *testing.T) {
	raw := []byte(`{"page":"<html>` + fmt.Sprint(make([]int, 300)) + `</html>"}`)
	b := encode(raw)
	require.Equal(t, "zstd", b.encoding)
	require.Less(t, len(b.data), len(raw)/4)
	got, err := decodeSized(b.encoding, b.data, len(raw))
	require.NoError(t, err)
	require.Equal(t, raw, got)
	got, err = decode(b.encoding, b.data)
	require.NoError(t, err)
	require.Equal(t, raw, got)
	bad := slices.Clone(b.data)
	bad[len(bad)-1] ^= 0xff // the frame's checksum
	_, err = decodeSized(b.encoding, bad, len(raw))
	require.ErrorContains(t, err, "CRC check failed")
	_, err = decodeSized(b.encoding, b.data, len(raw)-1)
	require.ErrorContains(t, err, "holds", "a size that does not match is refused")

	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	_, err = zw.Write(raw)
	require.NoError(t, err)
	require.NoError(t, zw.Close())
	got, err = decodeSized("gzip", gz.Bytes(), len(raw))
	require.NoError(t, err)
	require.Equal(t, raw, got, "gzip blobs of earlier versions are read")
	bad = slices.Clone(gz.Bytes())
	bad[len(bad)-8] ^= 0xff // the trailer's CRC-32
	_, err = decodeSized("gzip", bad, len(raw))
	require.ErrorContains(t, err, "checksum")
	_, err = decode("gzip", bad)
	require.ErrorContains(t, err, "checksum")
}
