-- +goose NO TRANSACTION
-- +goose Up
-- The outbox loses its per-row sent mark (issue 38): the dispatchers read each topic's rows
-- in commit order behind a safe horizon and record one position per topic and batch
-- (outbox_positions) instead of an UPDATE of every row (one more heap tuple and three index
-- entries per event). A row is dispatched when (xid, id) <= its topic's position.
--
-- outbox.xid is the inserting transaction's id. Every transaction below the horizon
-- pg_snapshot_xmin(pg_current_snapshot()) has ended, so no row can appear behind a position
-- that only moves over rows below it. The commit's INSERT is unchanged: the column's
-- default fills it, for rows inserted by workers of the previous version during a rolling
-- upgrade too.
--
-- On a live database: every statement runs on its own (no transaction around the file).
-- The column is added with a constant default (no rewrite: the rows already there read
-- xid 0, ordered among themselves by id, before every row inserted afterwards), then given
-- its real default (a catalog change); each ALTER waits for a brief exclusive lock behind
-- any long reader, see 00016. The index is built CONCURRENTLY. Every statement is
-- idempotent, so a migration that failed half-way can simply run again.
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS xid xid8 NOT NULL DEFAULT '0';
ALTER TABLE outbox ALTER COLUMN xid SET DEFAULT pg_current_xact_id();

-- One row per topic: the last row dispatched, in (xid, id) order. Dispatchers of one topic
-- take turns on its row (FOR UPDATE SKIP LOCKED); dispatchers of different topics run in
-- parallel. A topic without a row gets one, at (0, 0), from the first dispatcher that sees
-- its rows. A Redis data loss moves the position back (store/outbox, Redis data loss), and
-- an operator may move it back by hand to publish a topic's events again.
CREATE TABLE IF NOT EXISTS outbox_positions (
    topic      text        PRIMARY KEY,
    xid        xid8        NOT NULL DEFAULT '0',
    id         bigint      NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now()  -- when a batch last moved it
);

-- Today's state carries over: the rows already there (xid 0) that were marked sent are
-- behind the position, the unsent ones in front of it. The position sits just before the
-- topic's oldest unsent row (the few rows sent after it by dispatchers racing each other
-- are published once more: consumers deduplicate them); a topic with no unsent row is
-- wholly behind it. Rows inserted since the ALTER above (xid > 0) are in front of every
-- such position. Dispatchers of the previous version still running meanwhile publish rows
-- by their sent_at (copies, never losses).
INSERT INTO outbox_positions (topic, xid, id)
SELECT topic, '0', COALESCE(min(id) FILTER (WHERE sent_at IS NULL) - 1, max(id))
FROM outbox WHERE xid = '0' GROUP BY topic
ON CONFLICT (topic) DO NOTHING;

-- The dispatchers' reads (a topic's rows after its position, in order), the lag report,
-- the recovery's walk back and the pruning's walk forward. A run of this migration that
-- was cancelled during the build leaves an INVALID index of this name, which IF NOT EXISTS
-- would keep: goose runs the file again only after such a failure, so the index is dropped
-- and built anew (CONCURRENTLY both: no long lock).
DROP INDEX CONCURRENTLY IF EXISTS outbox_topic_xid_idx;
CREATE INDEX CONCURRENTLY outbox_topic_xid_idx ON outbox (topic, xid, id);

-- Every new row has sent_at NULL now: outbox_unsent_idx would take an entry per event and
-- serve nothing; outbox_sent_at_idx gets no new entries and nothing reads it. The sent_at
-- column stays (previous-version binaries of a rolling upgrade still write and read it;
-- nothing of this version does) and can go in a later migration.
DROP INDEX CONCURRENTLY IF EXISTS outbox_unsent_idx;
DROP INDEX CONCURRENTLY IF EXISTS outbox_sent_at_idx;

-- For operators, tools and tests: the rows not dispatched yet, and the rows dispatched.
-- (Both read the whole outbox; the dispatcher and outbox.Lag read per topic by the index.)
CREATE OR REPLACE VIEW outbox_unsent AS
SELECT o.* FROM outbox o
WHERE NOT EXISTS (SELECT 1 FROM outbox_positions p WHERE p.topic = o.topic AND (o.xid, o.id) <= (p.xid, p.id));
CREATE OR REPLACE VIEW outbox_sent AS
SELECT o.* FROM outbox o
WHERE EXISTS (SELECT 1 FROM outbox_positions p WHERE p.topic = o.topic AND (o.xid, o.id) <= (p.xid, p.id));

-- +goose Down
-- The previous version reads sent_at: the rows behind a position are marked sent (now),
-- so that it does not publish them all again.
DROP VIEW IF EXISTS outbox_sent;
DROP VIEW IF EXISTS outbox_unsent;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_unsent_idx ON outbox (id) WHERE sent_at IS NULL;
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_sent_at_idx ON outbox (sent_at) WHERE sent_at IS NOT NULL;
UPDATE outbox o SET sent_at = now() FROM outbox_positions p
WHERE o.topic = p.topic AND o.sent_at IS NULL AND (o.xid, o.id) <= (p.xid, p.id);
DROP INDEX CONCURRENTLY IF EXISTS outbox_topic_xid_idx;
DROP TABLE IF EXISTS outbox_positions;
ALTER TABLE outbox DROP COLUMN IF EXISTS xid;
