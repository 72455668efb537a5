package store

import "bytes"

// nulEscape is the JSON escape of U+0000, which PostgreSQL jsonb refuses ("unsupported
// Unicode escape sequence") and text columns can not hold.
var nulEscape = []byte(`\u0000`)

// JSONHasNUL reports whether the encoded JSON b holds a U+0000 character: a `\u0000`
// escape that is itself not escaped (preceded by an even number of backslashes, zero
// included), or a raw NUL byte. The text `\u0000` inside a string, encoded as `\\u0000`
// (common in scraped inline JavaScript), is six ordinary characters and is not reported.
// b need not be valid JSON; for valid JSON the answer is exact.
func JSONHasNUL(b []byte) bool {
	if bytes.IndexByte(b, 0) >= 0 {
		return true
	}
	return nextNULEscape(b, 0) >= 0
}

// JSONReplaceNUL returns b with every U+0000 escape (as JSONHasNUL finds them) replaced by
// `\ufffd`, the replacement character, and every raw NUL byte dropped; escaped text such
// as `\\u0000` is left alone. It returns b itself when there is nothing to replace.
func JSONReplaceNUL(b []byte) []byte {
	if !JSONHasNUL(b) {
		return b
	}
	out := make([]byte, 0, len(b))
	for from := 0; ; {
		i := nextNULEscape(b, from)
		if i < 0 {
			out = append(out, b[from:]...)
			break
		}
		out = append(out, b[from:i]...)
		out = append(out, `\ufffd`...)
		from = i + len(nulEscape)
	}
	return bytes.ReplaceAll(out, []byte{0}, nil)
}

// nextNULEscape returns the index of the first unescaped `\u0000` in b at or after from,
// or -1.
func nextNULEscape(b []byte, from int) int {
	for from < len(b) {
		j := bytes.Index(b[from:], nulEscape)
		if j < 0 {
			return -1
		}
		i := from + j
		// The backslash at i escapes "u" only if the backslashes running up to it pair off
		// before it: an odd run ending at i means b[i] is itself escaped text.
		n := 0
		for k := i - 1; k >= 0 && b[k] == '\\'; k-- {
			n++
		}
		if n%2 == 0 {
			return i
		}
		from = i + 1
	}
	return -1
}
