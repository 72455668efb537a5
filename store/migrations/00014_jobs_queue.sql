-- +goose NO TRANSACTION
-- +goose Up
-- The asynq queue a job's tasks go to, recorded when the job is created (issue 21). asynq
-- checks task ids per queue, so a job enqueued once to a queue other than its kind's (an
-- enqueuer with EnqueuerConfig.Queue, `idemscrape enqueue -queue`) and later to its kind's
-- queue by another enqueuer or the reconciler would have two tasks and run twice. Every
-- later enqueue of the job uses this queue. NULL (rows created before this migration, or
-- recorded without an enqueuer): the enqueuer's own queue, as before. No index: it is read
-- with the row. Changing a kind's queue in the configuration applies to jobs created after;
-- existing runnable jobs stay in their queue (keep a worker serving it until they drain).
-- The column is added bare (no rewrite, a brief lock) and its check added NOT VALID, then
-- validated in a statement that lets writes go on: a table of millions of rows is not
-- scanned under an exclusive lock.
-- (No transaction, so that each statement's lock ends with it; each can run again.)
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS queue text;
-- +goose StatementBegin
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conname = 'jobs_queue_not_empty') THEN
        ALTER TABLE jobs ADD CONSTRAINT jobs_queue_not_empty CHECK (queue <> '') NOT VALID;
    END IF;
END $$;
-- +goose StatementEnd
ALTER TABLE jobs VALIDATE CONSTRAINT jobs_queue_not_empty;

-- +goose Down
ALTER TABLE jobs DROP COLUMN IF EXISTS queue;
