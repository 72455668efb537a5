package quote

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestInput(t *testing.T) {
	assert.Equal(t, `"abc"`, Input("abc"))
	assert.Equal(t, `"a\xffb"`, Input("a\xffb"))
	long := strings.Repeat("k", 130_000)
	got := Input(long)
	assert.Equal(t, `"`+strings.Repeat("k", MaxInput)+`"… (130000 bytes)`, got)
	// A cut inside a character backs up to its start: no half character shown as bytes.
	s := strings.Repeat("a", MaxInput-1) + "é" + strings.Repeat("b", 10)
	assert.Equal(t, `"`+strings.Repeat("a", MaxInput-1)+`"… (211 bytes)`, Input(s))
	// Invalid bytes at the cut are cut as bytes.
	s = strings.Repeat("\xff", MaxInput+5)
	assert.Equal(t, `"`+strings.Repeat(`\xff`, MaxInput)+`"… (205 bytes)`, Input(s))
	assert.Equal(t, `"`+strings.Repeat("x", MaxInput)+`"`, Input(strings.Repeat("x", MaxInput)), "MaxInput bytes are shown whole")
}

func TestByte(t *testing.T) {
	assert.Equal(t, `byte 1 ("\xff")`, Byte("a\xffb", 1))
	assert.Equal(t, `byte 1 ("\x1b")`, Byte("q\x1b[31m", 1))
	assert.Equal(t, `byte 1 ("é")`, Byte("aé", 1))
	assert.Equal(t, `byte 0 ("\u200b")`, Byte("\u200b", 0))
	assert.Equal(t, `byte 9`, Byte("a", 9))
	assert.Equal(t, 1, InvalidUTF8("a\xffb"))
	assert.Equal(t, -1, InvalidUTF8("aé"))
	assert.Equal(t, `not valid UTF-8 at byte 2 ("\xc3")`, CheckUTF8("ab\xc3"))
	assert.Equal(t, "", CheckUTF8("ok"))
}
