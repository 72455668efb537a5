package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/cmd/internal/boot"
	"github.com/idemscrape/idemscrape/cmd/internal/envflag"
)

// TestProvidersFlag: -providers FILE (or $IDEMSCRAPE_PROVIDERS_FILE) gives the worker its
// proxy accounts, in priority order, logged at start by name with where they came from
// and no password; a bad file, or the file and a numbered IDEMSCRAPE_PROXY_ variable
// together, is a bad setting (exit 2) naming the line and the field, without the secret.
func TestProvidersFlag(t *testing.T) {
	for _, kv := range os.Environ() {
		if name, _, _ := strings.Cut(kv, "="); strings.HasPrefix(name, "IDEMSCRAPE_") && !strings.HasPrefix(name, "IDEMSCRAPE_TEST_") {
			t.Setenv(name, "")
			require.NoError(t, os.Unsetenv(name))
		}
	}
	const pass1, pass2 = "wk-pass-one-never-logged", "wk-pass-two-never-logged"
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "backup.pass"), []byte(pass2+"\n"), 0o600))
	t.Setenv("WK_MAIN_PASS", pass1)
	file := filepath.Join(dir, "providers.yaml")
	require.NoError(t, os.WriteFile(file, []byte(`providers:
  - name: backup
    format: decodo
    user: acct2
    password_file: backup.pass
    priority: 2
  - name: main
    format: oxylabs
    gateway: 127.0.0.1:7777
    user: acct1
    password_env: WK_MAIN_PASS
    price: 8.40 USD/GB
    priority: 1
`), 0o600))
	base := []string{"-catalog-base", "https://shop.example"}

	var logBuf bytes.Buffer
	log := envflag.Log{Format: "json", Level: "info"}.Logger(&logBuf)
	c, err := parseFlags(append(base, "-providers", file), &bytes.Buffer{})
	require.NoError(t, err)
	set, err := readSettings(c, log)
	require.NoError(t, err)
	require.Len(t, set.providers, 2)
	assert.Equal(t, "main", set.providers[0].Name(), "priority 1 first")
	assert.Equal(t, "backup", set.providers[1].Name())
	logStart(log, c, set, false, []string{"catalog"}, map[string]int{"catalog": 1})
	assert.Contains(t, logBuf.String(), `"proxies_from":"`+file+`"`)
	assert.Contains(t, logBuf.String(), "main 127.0.0.1:7777 (residential, 8.4 USD/GB)")

	t.Setenv(envflag.EnvProvidersFile, file)
	c, err = parseFlags(base, &bytes.Buffer{})
	require.NoError(t, err)
	set, err = readSettings(c, log)
	require.NoError(t, err, "$IDEMSCRAPE_PROVIDERS_FILE is -providers' variable")
	assert.Len(t, set.providers, 2)

	// The file and a numbered variable together.
	t.Setenv("IDEMSCRAPE_PROXY_PROVIDER_2", "oxylabs")
	_, err = readSettings(c, log)
	var bad *boot.SettingError
	require.ErrorAs(t, err, &bad)
	assert.ErrorContains(t, err, "$IDEMSCRAPE_PROXY_PROVIDER_2 are both set")
	require.NoError(t, os.Unsetenv("IDEMSCRAPE_PROXY_PROVIDER_2"))

	// A bad field: exit 2 (boot.RunExit), its line and field in the log, no secret.
	broken := filepath.Join(dir, "broken.yaml")
	require.NoError(t, os.WriteFile(broken, []byte("providers:\n  - format: oxylabs\n    user: acct1\n    password_env: WK_MAIN_PASS\n    tier: premium\n"), 0o600))
	c, err = parseFlags(append(base, "-providers", broken), &bytes.Buffer{})
	require.NoError(t, err)
	_, err = readSettings(c, log)
	require.ErrorAs(t, err, &bad)
	assert.Equal(t, 2, boot.RunExit("worker", err, log))
	assert.Contains(t, logBuf.String(), `line 5: provider 1: field tier: \"premium\"`)

	for _, secret := range []string{pass1, pass2} {
		assert.NotContains(t, logBuf.String(), secret)
	}
}
