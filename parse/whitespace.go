package parse

import (
	"strings"
	"unicode"
	"unicode/utf8"
)

// Whitespace returns s with every run of Unicode white space (unicode.IsSpace: ASCII
// spaces, tabs and line breaks, NBSP U+00A0, U+1680, U+2000–U+200A, U+2028, U+2029,
// narrow NBSP U+202F, U+205F, U+3000, NEL U+0085) collapsed to one ASCII space and
// leading and trailing white space trimmed.
//
// Removed outright (they are invisible and never separate words): the zero-width space
// U+200B, word joiner U+2060, byte-order mark U+FEFF, soft hyphen U+00AD, Mongolian vowel
// separator U+180E, and every other control character (C0, DEL, C1). The zero-width
// non-joiner U+200C and joiner U+200D are kept: they are part of the text in Persian and
// Indic scripts and of emoji sequences. Each byte of invalid UTF-8 becomes U+FFFD.
//
// Whitespace is idempotent (Whitespace(Whitespace(s)) == Whitespace(s)), allocation-free
// when s is already normal, and safe for any input.
func Whitespace(s string) string {
	if isNormalWhitespace(s) {
		return s
	}
	var sb strings.Builder
	sb.Grow(len(s))
	pendingSpace := false
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		i += size
		switch {
		case r == utf8.RuneError && size == 1:
			// invalid byte: keep a visible marker, as strings.ToValidUTF8 would per byte
		case isInvisible(r):
			continue
		case unicode.IsSpace(r):
			pendingSpace = sb.Len() > 0
			continue
		case unicode.IsControl(r):
			continue
		}
		if pendingSpace {
			sb.WriteByte(' ')
			pendingSpace = false
		}
		sb.WriteRune(r)
	}
	return sb.String()
}

// isInvisible reports whether r is one of the zero-width characters Whitespace removes.
func isInvisible(r rune) bool {
	switch r {
	case '\u200B', '\u2060', '\uFEFF', '\u00AD', '\u180E':
		return true
	}
	return false
}

// isNormalWhitespace reports whether Whitespace(s) == s, without allocating.
func isNormalWhitespace(s string) bool {
	prevSpace := true // a leading space is not normal
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		i += size
		if r == utf8.RuneError && size == 1 {
			return false
		}
		if r == ' ' {
			if prevSpace {
				return false
			}
			prevSpace = true
			continue
		}
		if isInvisible(r) || unicode.IsSpace(r) || unicode.IsControl(r) {
			return false
		}
		prevSpace = false
	}
	return len(s) == 0 || !prevSpace
}
