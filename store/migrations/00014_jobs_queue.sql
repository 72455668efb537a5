-- +goose Up
-- The asynq queue a job's tasks go to, recorded when the job is created (issue 21). asynq
-- checks task ids per queue, so a job enqueued once to a queue other than its kind's (an
-- enqueuer with EnqueuerConfig.Queue, `idemscrape enqueue -queue`) and later to its kind's
-- queue by another enqueuer or the reconciler would have two tasks and run twice. Every
-- later enqueue of the job uses this queue. NULL (rows created before this migration, or
-- recorded without an enqueuer): the enqueuer's own queue, as before. No index: it is read
-- with the row.
ALTER TABLE jobs ADD COLUMN queue text CHECK (queue <> '');

-- +goose Down
ALTER TABLE jobs DROP COLUMN queue;
