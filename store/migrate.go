package store

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"log/slog"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
)

//go:embed migrations/*.sql
var migrationsFS embed.FS

// Migrations returns the embedded SQL migrations (goose format), for tools that want to
// inspect or fingerprint them.
func Migrations() fs.FS {
	sub, err := fs.Sub(migrationsFS, "migrations")
	if err != nil {
		panic(err) // the directory is embedded at build time; absence is a build bug
	}
	return sub
}

// migrateLockID is the Postgres advisory lock that serialises concurrent Migrate calls
// (every worker migrates at start). The value is the ASCII bytes "idms" read as a
// big-endian integer; it only has to differ from the other advisory lock ids the
// project uses (testutil's template lock is "idtp").
const migrateLockID = 0x69646d73

// Migrate applies every pending embedded migration to the database behind pool and returns
// the versions it applied. It is safe to call from many processes at once: a session-level
// advisory lock lets one migrate while the others wait, then find nothing pending.
func Migrate(ctx context.Context, pool *pgxpool.Pool, logger *slog.Logger) ([]int64, error) {
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()

	locker, err := lock.NewPostgresSessionLocker(
		lock.WithLockID(migrateLockID),
		lock.WithLockTimeout(1, 300), // poll every second, up to 5 minutes
	)
	if err != nil {
		return nil, fmt.Errorf("store: migrate: %w", err)
	}
	opts := []goose.ProviderOption{goose.WithSessionLocker(locker), goose.WithDisableGlobalRegistry(true)}
	if logger != nil {
		opts = append(opts, goose.WithSlog(logger))
	}
	provider, err := goose.NewProvider(goose.DialectPostgres, db, Migrations(), opts...)
	if err != nil {
		return nil, fmt.Errorf("store: migrate: %w", err)
	}
	results, err := provider.Up(ctx)
	if err != nil {
		return nil, fmt.Errorf("store: migrate: %w", err)
	}
	applied := make([]int64, 0, len(results))
	for _, r := range results {
		applied = append(applied, r.Source.Version)
	}
	return applied, nil
}
