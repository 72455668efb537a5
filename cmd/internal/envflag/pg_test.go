package envflag_test

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/cmd/internal/envflag"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestPostgresTLS: a PostgreSQL of the test's own with ssl = on and a certificate of the
// test's CA, whose role "app" may log in only over TLS with its password: the libpq URL's
// sslmode=verify-full and sslrootcert work unchanged, the password comes from
// $<prefix>PG_PASSWORD_FILE; a wrong CA, a missing password and a password given twice
// fail clearly, and no error holds the password.
func TestPostgresTLS(t *testing.T) {
	const password = "pg-app-pw-31c7"
	srv := testutil.StartPostgres(t)
	ca := testutil.NewTestCA(t)
	srv.EnableTLS(ca, "app", password)
	url := func(rootCA string) string {
		return "postgres://app@" + net.JoinHostPort("127.0.0.1", strconv.Itoa(srv.Port)) +
			"/postgres?sslmode=verify-full&sslrootcert=" + rootCA + "&connect_timeout=10"
	}
	pwFile := filepath.Join(t.TempDir(), "pg-pw")
	require.NoError(t, os.WriteFile(pwFile, []byte(password+"\n"), 0o600))
	connect := func(t *testing.T, dsn string) error {
		t.Helper()
		cfg, err := envflag.PGConfig(dsn, "$PGT_PG", "PGT_")
		if err != nil {
			return err
		}
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		require.NoError(t, err)
		defer pool.Close()
		var ssl bool
		if err := pool.QueryRow(context.Background(), `SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()`).Scan(&ssl); err != nil {
			return err
		}
		assert.True(t, ssl, "the connection is TLS")
		return nil
	}

	t.Run("VerifyFullWithPasswordFile", func(t *testing.T) {
		t.Setenv("PGT_PG_PASSWORD_FILE", pwFile)
		require.NoError(t, connect(t, url(ca.CAFile)))
	})
	t.Run("WrongCA", func(t *testing.T) {
		t.Setenv("PGT_PG_PASSWORD_FILE", pwFile)
		err := connect(t, url(ca.OtherCAFile))
		require.Error(t, err)
		assert.Contains(t, err.Error(), "certificate signed by unknown authority")
		assert.NotContains(t, err.Error(), password)
	})
	t.Run("NoPassword", func(t *testing.T) {
		t.Setenv("PGT_PG_PASSWORD_FILE", "")
		t.Setenv("PGPASSWORD", "")
		err := connect(t, url(ca.CAFile))
		require.Error(t, err)
		assert.Contains(t, err.Error(), "password authentication failed")
	})
	t.Run("PasswordTwice", func(t *testing.T) {
		t.Setenv("PGT_PG_PASSWORD_FILE", pwFile)
		_, err := envflag.PGConfig("postgres://app:"+password+"@127.0.0.1:1/x", "$PGT_PG", "PGT_")
		require.Error(t, err)
		assert.Contains(t, err.Error(), "give it one way")
		assert.NotContains(t, err.Error(), password)
	})
	t.Run("BadURLHidesPassword", func(t *testing.T) {
		_, err := envflag.PGConfig("postgres://app:"+password+"@127.0.0.1:notaport/x", "$PGT_PG", "PGT_")
		require.Error(t, err)
		assert.Contains(t, err.Error(), "$PGT_PG")
		assert.NotContains(t, err.Error(), password)
	})
}
