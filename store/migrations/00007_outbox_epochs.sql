-- +goose Up
-- Epochs of the outbox streams (store/outbox, Redis data loss): PostgreSQL is the witness
-- of each stream's epoch. The dispatchers keep the same id in the Redis marker
-- <prefix>epoch:{<topic>} beside the stream; a marker absent or different from this row
-- means Redis lost the stream's data, and the rows sent within the recover window are
-- published again. No row for a topic means the topic was never dispatched with epochs
-- (a fresh install, an upgrade, a new topic): the row is created and nothing is
-- republished. Rows are created and replaced only under the dispatchers' exclusive
-- recovery advisory lock. A handful of rows (one per prefix and topic); nothing prunes it.
CREATE TABLE outbox_epochs (
    prefix     text        NOT NULL,  -- the dispatchers' Redis key prefix
    topic      text        NOT NULL,
    epoch      text        NOT NULL CHECK (epoch <> ''),
    created_at timestamptz NOT NULL DEFAULT now(),  -- when this epoch began
    PRIMARY KEY (prefix, topic)
);

-- +goose Down
DROP TABLE outbox_epochs;
