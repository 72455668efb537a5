-- +goose NO TRANSACTION
-- +goose Up
-- Retention (issue 21: nothing grows without bound). The reconciler deletes terminal jobs
-- (complete, failed) unchanged for reconciler.job_retention, with their attempts, results,
-- quarantine, notes and saved inputs (ON DELETE CASCADE), oldest first, in bounded batches
-- found through the first index; and quarantined staging older than
-- reconciler.quarantine_retention through the second (without it every sweep would read
-- the whole table to find nothing). Built CONCURRENTLY: tables of millions of rows keep
-- taking writes.
CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_terminal_updated_idx
    ON jobs (updated_at) WHERE state IN ('complete', 'failed');
CREATE INDEX CONCURRENTLY IF NOT EXISTS quarantine_created_idx ON quarantine (created_at);

-- +goose Down
DROP INDEX CONCURRENTLY IF EXISTS quarantine_created_idx;
DROP INDEX CONCURRENTLY IF EXISTS jobs_terminal_updated_idx;
