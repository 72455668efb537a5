package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestCommandLineCheckedBeforeDatabase: with IDEMSCRAPE_PG on a loopback port nobody
// listens on, a mistake in a command line is still reported as one (exit 2, the message
// and the usage), not as the database being down; a good command line then reaches for
// the database and exits 1 naming it.
func TestCommandLineCheckedBeforeDatabase(t *testing.T) {
	cliEnv(t, "postgres://postgres@127.0.0.1:1/nowhere?sslmode=disable&connect_timeout=2", "127.0.0.1:1")
	badCfg := filepath.Join(t.TempDir(), "bad.yaml")
	require.NoError(t, os.WriteFile(badCfg, []byte("templates: [{name: x, frobnicate: 1}]\n"), 0o600))
	for _, tc := range []struct {
		name string
		args []string
		code int
		want string
	}{
		{"reparse bad state", []string{"reparse", "-state", "bogus"}, 2, `-state "bogus"`},
		{"reparse negative version", []string{"reparse", "-to-version", "-1"}, 2, "-to-version must be >= 0"},
		{"windows bad limit", []string{"windows", "-limit", "0"}, 2, "-limit 0 must be >= 1"},
		// A configuration given is read and validated, even to list windows only.
		{"windows missing config", []string{"windows", "-config", "/no/such/file.yaml"}, 2, `-config "/no/such/file.yaml" ($IDEMSCRAPE_SCHEDULER_CONFIG): `},
		{"windows bad config", []string{"windows", "-config", badCfg}, 2, "-config " + strconv.Quote(badCfg) + " ($IDEMSCRAPE_SCHEDULER_CONFIG): "},
		{"requeue empty by", []string{"requeue", "-by", "", "catalog:x"}, 2, "-by is empty"},
		{"status reaches the database", []string{"status", "catalog:x"}, 1, "postgres (IDEMSCRAPE_PG): "},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var stderr bytes.Buffer
			_, code := runInProcess(nil, &stderr, tc.args...)
			require.Equal(t, tc.code, code, stderr.String())
			require.Contains(t, stderr.String(), tc.want)
			if tc.code == 2 {
				require.Contains(t, stderr.String(), "usage: idemscrape "+tc.args[0])
				require.NotContains(t, stderr.String(), "127.0.0.1:1", "a usage error must not be the database's")
			}
		})
	}
}
