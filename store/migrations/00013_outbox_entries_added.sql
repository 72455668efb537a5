-- +goose Up
-- Partial Redis loss (issue 21): how many entries the dispatchers know each stream has had
-- added (XINFO STREAM entries-added, which trims and deletions do not lower), raised by every
-- dispatch batch in the statement that marks its rows sent. A stream found with fewer came
-- back from an older copy (a failover to a lagging replica, an RDB restored) and lacks
-- the newest entries: the rows sent within the recover window are published again, as
-- after a full loss, and the count starts again at 0 with the new epoch.
ALTER TABLE outbox_epochs ADD COLUMN entries_added bigint NOT NULL DEFAULT 0 CHECK (entries_added >= 0);

-- +goose Down
ALTER TABLE outbox_epochs DROP COLUMN entries_added;
