-- +goose Up
-- Consumer inbox of the outbox streams (store/outbox, Consumer.RunTx): one row per event a
-- consumer group has taken effect for. The row is inserted in the same transaction as the
-- consumer's side effect, so a replayed event (same event_key) finds it and is skipped:
-- the effect happens exactly once per group.

CREATE TABLE outbox_inbox (
    consumer_group text        NOT NULL,
    event_key      text        NOT NULL,
    -- Stream entry id of the delivery that took effect, for debugging.
    stream_id      text,
    seen_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, event_key)
);
-- Pruning old rows (older than any replay can be) scans by age.
CREATE INDEX outbox_inbox_seen_at_idx ON outbox_inbox (seen_at);

-- +goose Down
DROP TABLE outbox_inbox;
