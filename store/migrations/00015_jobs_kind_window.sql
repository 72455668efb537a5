-- +goose NO TRANSACTION
-- +goose Up
-- The service's /windows page counts each schedule window's jobs by state, and /jobs
-- filters by kind and window (issue 21): without this index both read the whole jobs
-- table. Built CONCURRENTLY: tables of millions of rows keep taking writes.
CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_kind_window_idx ON jobs (kind, "window", state);

-- +goose Down
DROP INDEX CONCURRENTLY IF EXISTS jobs_kind_window_idx;
