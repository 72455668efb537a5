package envflag

import (
	"errors"
	"flag"
	"io"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestSet(t *testing.T) {
	type vals struct {
		s  string
		b  bool
		i  int
		f  float64
		d  time.Duration
		lg Log
	}
	define := func(v *vals) *Set {
		s := New("t", "EFT_", io.Discard)
		s.String(&v.s, "s", "S", "def", "a string")
		s.Bool(&v.b, "b", "B", "a bool")
		s.Int(&v.i, "i", "I", 7, "an int")
		s.Float(&v.f, "f", "F", 1.5, "a float")
		s.Duration(&v.d, "d", "D", time.Second, "a duration")
		v.lg.Define(s)
		return s
	}

	t.Run("Defaults", func(t *testing.T) {
		var v vals
		require.NoError(t, define(&v).Parse(nil))
		assert.Equal(t, vals{s: "def", i: 7, f: 1.5, d: time.Second, lg: Log{Format: "text", Level: "info"}}, v)
		require.NoError(t, v.lg.Validate())
	})
	t.Run("EnvironmentThenFlagWins", func(t *testing.T) {
		t.Setenv("EFT_S", "env")
		t.Setenv("EFT_B", "true")
		t.Setenv("EFT_I", "9")
		t.Setenv("EFT_D", "2m")
		var v vals
		require.NoError(t, define(&v).Parse([]string{"-i", "3"}))
		assert.Equal(t, "env", v.s)
		assert.True(t, v.b)
		assert.Equal(t, 3, v.i, "the flag wins")
		assert.Equal(t, 2*time.Minute, v.d)
	})
	t.Run("BadEnvironmentNamed", func(t *testing.T) {
		t.Setenv("EFT_I", "many")
		t.Setenv("EFT_D", "soon")
		var v vals
		err := define(&v).Parse(nil)
		assert.ErrorContains(t, err, `$EFT_I: "many" is not an integer`)
		assert.ErrorContains(t, err, `$EFT_D: "soon" is not a duration`)
	})
	t.Run("StrayArgumentsAndHelp", func(t *testing.T) {
		var v vals
		assert.ErrorContains(t, define(&v).Parse([]string{"extra"}), "unexpected arguments")
		assert.True(t, errors.Is(define(&v).Parse([]string{"-h"}), flag.ErrHelp))
	})
	t.Run("LogValidation", func(t *testing.T) {
		assert.ErrorContains(t, Log{Format: "xml", Level: "info"}.Validate(), "-log-format")
		assert.ErrorContains(t, Log{Format: "json", Level: "loud"}.Validate(), "-log-level")
		assert.NotNil(t, Log{Format: "json", Level: "debug"}.Logger(io.Discard))
	})
}
