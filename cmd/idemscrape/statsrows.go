package main

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemscrape/idemscrape/store"
)

// maxRowCount bounds the count of a table PostgreSQL has no estimate for (one never
// analysed: reltuples -1, which store.TableSizes shows as 0). Such a table is young and
// small (autovacuum analyses a table once it has grown), so the count is cheap; the bound
// keeps it so on a database whose autovacuum is off.
const maxRowCount = 1_000_000

// countUnanalysed replaces the 0 estimate of each table PostgreSQL never analysed with its
// count (at most maxRowCount), so that `stats` does not show 0 rows next to "complete 63".
func countUnanalysed(ctx context.Context, pool *pgxpool.Pool, tables []store.TableSize) error {
	names := make([]string, len(tables))
	for i, t := range tables {
		names[i] = t.Table
	}
	rows, err := pool.Query(ctx, `SELECT t.name FROM unnest($1::text[]) AS t(name)
JOIN pg_class c ON c.oid = to_regclass(t.name) WHERE c.reltuples < 0`, names)
	if err != nil {
		return fmt.Errorf("tables without a row estimate: %w", err)
	}
	unanalysed, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("tables without a row estimate: %w", err)
	}
	for _, name := range unanalysed {
		for i := range tables {
			if tables[i].Table != name || tables[i].Rows != 0 {
				continue
			}
			q := fmt.Sprintf(`SELECT count(*) FROM (SELECT 1 FROM %s LIMIT %d) AS t`, pgx.Identifier{name}.Sanitize(), maxRowCount)
			if err := pool.QueryRow(ctx, q).Scan(&tables[i].Rows); err != nil {
				return fmt.Errorf("count %s: %w", name, err)
			}
		}
	}
	return nil
}

// retentionText prints a retention as an operator writes it: 90d, 36h, else Go's form.
// Its argument is a duration as time.Duration.String wrote it (storage's fields).
func retentionText(s string) string {
	d, err := time.ParseDuration(s)
	switch {
	case err != nil || d <= 0:
		return s
	case d%(24*time.Hour) == 0:
		return fmt.Sprintf("%dd", d/(24*time.Hour))
	case d%time.Hour == 0:
		return fmt.Sprintf("%dh", d/time.Hour)
	}
	return s
}
