package testutil

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io/fs"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemscrape/idemscrape/store"
)

// templateLockID serialises template creation across test processes (go test runs
// packages in parallel).
const templateLockID = 0x69647470

var (
	templateOnce sync.Once
	templateName string
	templateErr  error
)

// PG returns a pool on a fresh database of its own, cloned from a template that holds the
// migrated schema. The template is built once per migration set (its name carries a hash of
// the migrations), so a schema change gets a new template. The database is dropped when
// the test ends.
func PG(t testing.TB) *pgxpool.Pool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	templateOnce.Do(func() { templateName, templateErr = ensureTemplate(ctx) })
	if templateErr != nil {
		serviceDown(t, "PostgreSQL", templateErr)
	}

	admin, err := pgx.Connect(ctx, PGAdminDSN())
	if err != nil {
		serviceDown(t, "PostgreSQL", err)
	}
	defer admin.Close(context.Background())

	name := "idemscrape_t_" + RandomID(6)
	if _, err := admin.Exec(ctx, fmt.Sprintf(`CREATE DATABASE %s TEMPLATE %s`, name, templateName)); err != nil {
		t.Fatalf("testutil: create test database: %v", err)
	}
	cfg, err := pgxpool.ParseConfig(PGAdminDSN())
	if err != nil {
		t.Fatalf("testutil: parse DSN: %v", err)
	}
	cfg.ConnConfig.Database = name
	cfg.MaxConns = 32
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("testutil: connect to %s: %v", name, err)
	}
	t.Cleanup(func() {
		pool.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, PGAdminDSN())
		if err != nil {
			t.Errorf("testutil: drop %s: %v", name, err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, fmt.Sprintf(`DROP DATABASE IF EXISTS %s WITH (FORCE)`, name)); err != nil {
			t.Errorf("testutil: drop %s: %v", name, err)
		}
	})
	return pool
}

// ensureTemplate builds the migrated template database unless it exists. It builds under a
// temporary name and renames at the end, so a crash mid-build never leaves a half-migrated
// template behind.
func ensureTemplate(ctx context.Context) (string, error) {
	h := sha256.New()
	err := fs.WalkDir(store.Migrations(), ".", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := fs.ReadFile(store.Migrations(), path)
		if err != nil {
			return err
		}
		fmt.Fprintf(h, "%s\x00%d\x00", path, len(b))
		h.Write(b)
		return nil
	})
	if err != nil {
		return "", err
	}
	name := "idemscrape_tpl_" + hex.EncodeToString(h.Sum(nil))[:16]

	admin, err := pgx.Connect(ctx, PGAdminDSN())
	if err != nil {
		return "", err
	}
	defer admin.Close(context.Background())
	if _, err := admin.Exec(ctx, `SELECT pg_advisory_lock($1)`, templateLockID); err != nil {
		return "", err
	}
	defer admin.Exec(context.Background(), `SELECT pg_advisory_unlock($1)`, templateLockID) //nolint:errcheck // the session ends right after

	var exists bool
	if err := admin.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)`, name).Scan(&exists); err != nil {
		return "", err
	}
	if exists {
		return name, nil
	}
	build := name + "_build"
	if _, err := admin.Exec(ctx, fmt.Sprintf(`DROP DATABASE IF EXISTS %s WITH (FORCE)`, build)); err != nil {
		return "", err
	}
	if _, err := admin.Exec(ctx, fmt.Sprintf(`CREATE DATABASE %s`, build)); err != nil {
		return "", err
	}
	cfg, err := pgxpool.ParseConfig(PGAdminDSN())
	if err != nil {
		return "", err
	}
	cfg.ConnConfig.Database = build
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return "", err
	}
	_, err = store.Migrate(ctx, pool, nil)
	pool.Close()
	if err != nil {
		return "", fmt.Errorf("migrate template: %w", err)
	}
	if _, err := admin.Exec(ctx, fmt.Sprintf(`ALTER DATABASE %s RENAME TO %s`, build, name)); err != nil {
		return "", err
	}
	return name, nil
}

// Count runs a query that returns one integer (e.g. `SELECT count(*) FROM results`) and
// returns it, failing the test on error.
func Count(t testing.TB, pool *pgxpool.Pool, query string, args ...any) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), query, args...).Scan(&n); err != nil {
		t.Fatalf("testutil: %s: %v", query, err)
	}
	return n
}

// TableSnapshot returns every row of table as text, ordered, so a test can prove that a
// refused operation changed nothing.
func TableSnapshot(t testing.TB, pool *pgxpool.Pool, table string) []string {
	t.Helper()
	rows, err := pool.Query(context.Background(),
		fmt.Sprintf(`SELECT t::text FROM %s AS t ORDER BY t::text`, pgx.Identifier{table}.Sanitize()))
	if err != nil {
		t.Fatalf("testutil: snapshot %s: %v", table, err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatalf("testutil: snapshot %s: %v", table, err)
	}
	return out
}
