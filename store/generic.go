package store

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// genericPlanSQL makes the statement after it, in the same implicit transaction, run
// PostgreSQL's generic plan of its prepared statement.
const genericPlanSQL = `SELECT set_config('plan_cache_mode', 'force_generic_plan', true)`

// queryGeneric runs one fenced statement (the attempt start or the commit) under its
// generic plan, in one round trip: the set_config and the statement are one pipeline with
// one Sync, so one implicit transaction, and the setting ends with it.
//
// Why: pgx prepares each statement once per connection and PostgreSQL then chooses, per
// execution, between a custom plan (planned again with the parameters' values) and the
// cached generic one. For these statements, whose parameters are arrays of a few rows, the
// custom plan always looks cheaper (it knows the arrays' length), so every execution was
// planned again: ~0.5 ms of PostgreSQL's CPU per statement, more than its execution (a
// start of 5 jobs: 1.36 ms planned each time, 0.84 ms on the generic plan). Both plans
// find the jobs rows by primary key (TestStartPlanByPrimaryKey); TestFencedStatementsGeneric
// checks that no custom plan is made.
func (s *PG) queryGeneric(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	b := &pgx.Batch{}
	b.Queue(genericPlanSQL)
	b.Queue(sql, args...)
	br := s.pool.SendBatch(ctx, b)
	if _, err := br.Exec(); err != nil {
		_ = br.Close()
		return nil, err
	}
	rows, err := br.Query()
	if err != nil {
		_ = br.Close()
		return nil, err
	}
	return &batchRows{Rows: rows, br: br}, nil
}

// batchRows are the rows of a batch's last statement; Close also ends the batch (and gives
// its connection back to the pool).
type batchRows struct {
	pgx.Rows
	br     pgx.BatchResults
	closed bool
	err    error
}

func (r *batchRows) Close() {
	if r.closed {
		return
	}
	r.closed = true
	r.Rows.Close()
	if err := r.br.Close(); err != nil && r.Rows.Err() == nil {
		r.err = err
	}
}

func (r *batchRows) Err() error {
	if err := r.Rows.Err(); err != nil {
		return err
	}
	return r.err
}

func (r *batchRows) Next() bool {
	if r.Rows.Next() {
		return true
	}
	r.Close()
	return false
}
