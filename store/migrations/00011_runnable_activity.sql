-- +goose NO TRANSACTION
-- +goose Up
-- The reconciler's re-enqueue pass reads only what changed (issue 21: its cost follows
-- change, not backlog): pending and retryable jobs by their activity time — when the row
-- last changed, or when it comes due, whichever is later — through this index. Built
-- CONCURRENTLY: a table of millions of jobs keeps taking writes while it is built.
CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_runnable_activity_idx
    ON jobs ((GREATEST(updated_at, next_attempt_at)), key) WHERE state IN ('pending', 'retryable');

-- +goose Down
DROP INDEX CONCURRENTLY IF EXISTS jobs_runnable_activity_idx;
