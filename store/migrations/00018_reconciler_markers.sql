-- +goose Up
-- The reconciler's record of each asynq queue's "tasks checked" marker (issue 36): Redis
-- holds the marker <prefix>reconciler:{<queue>}:tasks-checked (a HASH: epoch, seq) in the
-- queue's own slot, so on a Redis Cluster it is lost or rolled back together with the
-- queue's tasks; PostgreSQL is the witness of what it must hold. A marker absent, of
-- another epoch, or whose seq is below this row's (Redis came back from an older copy)
-- means the queue's node lost data since the last full check: the next sweep checks every
-- runnable job of that queue, then starts a new epoch here (compare-and-set on epoch, so
-- concurrent reconcilers agree on one) and in Redis. seq is the highest seq a sweep
-- recorded after incrementing the marker (GREATEST: it never goes down within an epoch).
-- A handful of rows (one per key prefix and queue); nothing prunes it.
CREATE TABLE reconciler_markers (
    prefix     text        NOT NULL,  -- the reconciler's Redis key prefix
    queue      text        NOT NULL CHECK (queue <> ''),
    epoch      text        NOT NULL CHECK (epoch <> ''),
    seq        bigint      NOT NULL DEFAULT 0 CHECK (seq >= 0),
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (prefix, queue)
);

-- +goose Down
DROP TABLE reconciler_markers;
