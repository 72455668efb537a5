-- +goose Up
-- Schema fingerprints of committed parses (handlers, issue 12): which selectors a parser
-- version's pages matched and how many nodes. Drift is judged against them, so a worker
-- that starts (or restarts) judges a page against what the fleet committed before, not
-- against nothing. One row per distinct fingerprint of a kind's parser version: a handful,
-- not one per job (a worker writes a fingerprint the first time it commits it). Nothing
-- prunes it; a kind's old versions can be deleted by hand.
CREATE TABLE schema_fingerprints (
    kind           text        NOT NULL,
    parser_version integer     NOT NULL CHECK (parser_version >= 1),
    sha256         bytea       NOT NULL CHECK (length(sha256) = 32), -- of the fingerprint's JSON
    fingerprint    jsonb       NOT NULL,
    first_seen     timestamptz NOT NULL DEFAULT now(),
    last_seen      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (kind, parser_version, sha256)
);
CREATE INDEX schema_fingerprints_recent_idx ON schema_fingerprints (kind, parser_version, last_seen DESC);

-- +goose Down
DROP TABLE schema_fingerprints;
