-- +goose NO TRANSACTION
-- +goose Up
-- PostgreSQL write diet (issue 38): jobs_state_idx (state, next_attempt_at) WHERE state <>
-- 'complete' took an entry for every job at its enqueue and again at every start (a start
-- changes the state, so its update is never HOT and writes one entry into every index
-- whose predicate the new row meets). No query needs it any more:
--   - running jobs by key (rescue, audit): jobs_running_key_idx;
--   - pending and retryable jobs (requeue sweeps): jobs_runnable_key_idx and
--     jobs_runnable_activity_idx;
--   - complete and failed jobs (retention): jobs_terminal_updated_idx;
--   - the problem listing (`idemscrape jobs`, /jobs, requeue selectors: failed and
--     retryable jobs, newest first) and stats' failed jobs by category: the index below,
--     which holds only failed and retryable rows, in the listing's order.
-- So a job's start writes three index entries (jobs_pkey, jobs_kind_window_idx,
-- jobs_running_key_idx) instead of four, and its enqueue four instead of five.
-- Built and dropped CONCURRENTLY (no long lock on a live table); idempotent, and a build
-- cancelled half-way (an INVALID index of this name) is dropped and built anew.
DROP INDEX CONCURRENTLY IF EXISTS jobs_problem_idx;
CREATE INDEX CONCURRENTLY jobs_problem_idx ON jobs (updated_at DESC, key) WHERE state IN ('failed', 'retryable');
DROP INDEX CONCURRENTLY IF EXISTS jobs_state_idx;

-- +goose Down
DROP INDEX CONCURRENTLY IF EXISTS jobs_state_idx; -- an INVALID leftover of a cancelled build
CREATE INDEX CONCURRENTLY jobs_state_idx ON jobs (state, next_attempt_at) WHERE state <> 'complete';
DROP INDEX CONCURRENTLY IF EXISTS jobs_problem_idx;
