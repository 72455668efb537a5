package secretenv

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestSecretsFromFiles: a secret from NAME or from the file NAME_FILE names (one trailing
// newline dropped); both, an empty, missing, oversized or non-regular file are errors that
// name the variable and the path and never the secret.
func TestSecretsFromFiles(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, []byte(content), 0o600))
		return p
	}
	const secret = "s3cr3t-value"
	for name, tc := range map[string]struct {
		value, file string
		want        string
		set         bool
		err         string
	}{
		"Unset":          {},
		"Value":          {value: secret, want: secret, set: true},
		"File":           {file: write("a", secret+"\n"), want: secret, set: true},
		"FileCRLF":       {file: write("b", secret+"\r\n"), want: secret, set: true},
		"FileNoNewline":  {file: write("c", secret), want: secret, set: true},
		"OnlyOneNewline": {file: write("d", secret+"\n\n"), want: secret + "\n", set: true},
		"Both":           {value: secret, file: write("e", secret), err: "$SE_PW and $SE_PW_FILE are both set"},
		"Empty":          {file: write("f", "\n"), err: "is empty"},
		"Missing":        {file: filepath.Join(dir, "nope"), err: "$SE_PW_FILE: secret file " + filepath.Join(dir, "nope") + ": no such file"},
		"Directory":      {file: dir, err: "is not a regular file"},
		"TooLarge":       {file: write("g", strings.Repeat("x", MaxSize+1)), err: "more than 65536"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Setenv("SE_PW", tc.value)
			t.Setenv("SE_PW_FILE", tc.file)
			got, set, err := Lookup("SE_PW")
			if tc.err != "" {
				require.Error(t, err)
				assert.Contains(t, err.Error(), tc.err)
				assert.NotContains(t, err.Error(), secret)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.set, set)
			assert.Equal(t, tc.want, got)
		})
	}
}
