-- +goose Up
-- Reconciler support (scheduler package) and the evidence of superseded attempts.
--
-- The reconciler sweeps stranded jobs in keyset-paged batches (ORDER BY key, key > last).
-- These partial indexes hold only the rows a sweep can act on, so a sweep costs in
-- proportion to the running / runnable rows, not to the table (which is mostly complete
-- rows). They are built in the migration's transaction (plain CREATE INDEX): on a large
-- existing jobs table, writes to it wait for the build.

-- Running jobs, in key order (JobsListRunning).
CREATE INDEX jobs_running_key_idx ON jobs (key) WHERE state = 'running';
-- Pending and retryable jobs, in key order (JobsListRunnable).
CREATE INDEX jobs_runnable_key_idx ON jobs (key) WHERE state IN ('pending', 'retryable');

-- Pruning sent outbox rows older than their retention, oldest first, in LIMIT batches.
CREATE INDEX outbox_sent_at_idx ON outbox (sent_at) WHERE sent_at IS NOT NULL;

-- An attempt closed by someone other than its own worker (a takeover's JobStart marks it
-- superseded; the reconciler's JobRescue marks it retryable, lease_expired) has not
-- recorded the bytes its worker transferred. evidence_due is true until that worker reports
-- them with AttemptSupersede, which clears it, so a repeated report counts once.
ALTER TABLE attempts ADD COLUMN evidence_due boolean NOT NULL DEFAULT false;

-- Counts of the maintenance services' actions (jobs rescued, tasks re-enqueued, rows
-- pruned, ...), added to by every reconciler instance; `idemscrape stats` shows them.
CREATE TABLE maintenance_counters (
    name       text        PRIMARY KEY,
    n          bigint      NOT NULL,
    updated_at timestamptz
);

-- +goose Down
DROP TABLE maintenance_counters;
ALTER TABLE attempts DROP COLUMN evidence_due;
DROP INDEX outbox_sent_at_idx;
DROP INDEX jobs_runnable_key_idx;
DROP INDEX jobs_running_key_idx;
