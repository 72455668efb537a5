-- +goose Up
-- Replays a consumer's inbox recognised (store/outbox, Consumer.RunTx): an event delivered
-- again after it took effect is counted on its inbox row before the ack, so `idemscrape
-- stats` can report outbox events deduplicated downstream from PostgreSQL alone.
ALTER TABLE outbox_inbox ADD COLUMN replays bigint NOT NULL DEFAULT 0 CHECK (replays >= 0);

-- +goose Down
ALTER TABLE outbox_inbox DROP COLUMN replays;
