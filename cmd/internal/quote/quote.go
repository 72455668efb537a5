// Package quote is how the binaries' error messages echo what an operator gave them: one
// spelling for every value and every byte, whatever command or setting reports it.
//
// A value is quoted as Go's %q quotes it ("a\xffb": an invalid byte as \xff, a control
// character as \x1b or \u200b), cut after MaxInput bytes with its length appended, so that
// a 130 kB key does not come back in full. A byte is named by its offset and the character
// (or lone byte) it starts, quoted the same way: `byte 3 ("\xff")`.
package quote

import (
	"fmt"
	"strconv"
	"unicode/utf8"
)

// MaxInput is how many bytes of a value Input echoes.
const MaxInput = 200

// Input quotes s for an error message: strconv.Quote(s) when s is at most MaxInput bytes,
// else its first MaxInput bytes (cut at a character boundary) quoted and followed by
// "… (N bytes)".
func Input(s string) string {
	if len(s) <= MaxInput {
		return strconv.Quote(s)
	}
	cut := MaxInput
	// Back up to the start of a character, so that a valid one is not shown as bytes.
	for i := 0; i < utf8.UTFMax && cut > 0 && !utf8.RuneStart(s[cut]); i++ {
		cut--
	}
	if !utf8.RuneStart(s[cut]) {
		cut = MaxInput // not UTF-8 there anyway
	}
	return fmt.Sprintf("%s… (%d bytes)", strconv.Quote(s[:cut]), len(s))
}

// Byte names the byte at offset i of s: `byte 3 ("\xff")`, quoting the character that
// starts there, or the lone byte when none does.
func Byte(s string, i int) string {
	if i < 0 || i >= len(s) {
		return fmt.Sprintf("byte %d", i)
	}
	r, n := utf8.DecodeRuneInString(s[i:])
	if r == utf8.RuneError && n <= 1 {
		n = 1
	}
	return fmt.Sprintf("byte %d (%s)", i, strconv.Quote(s[i:i+n]))
}

// InvalidUTF8 returns the offset of the first byte of s that is not part of valid UTF-8,
// or -1 when s is valid.
func InvalidUTF8(s string) int {
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && n <= 1 {
			return i
		}
		i += n
	}
	return -1
}

// CheckUTF8 returns "" when s is valid UTF-8, else why not: `not valid UTF-8 at byte 3
// ("\xff")`.
func CheckUTF8(s string) string {
	if i := InvalidUTF8(s); i >= 0 {
		return "not valid UTF-8 at " + Byte(s, i)
	}
	return ""
}
