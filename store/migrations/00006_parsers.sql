-- +goose Up
-- Saved inputs (store/inputs, issue 12): what a parser consumed, so that a parse can be
-- replayed — by `idemscrape reparse`, with another parser version — without another proxy
-- request.
--
-- input_blobs holds every body once, content-addressed by the sha256 of its raw bytes and
-- stored compressed (encoding names how). A blob is shared by every saved input that
-- references it: identical bodies are stored once. last_used_at is refreshed (at most
-- hourly) by a save that finds the blob already there; the prune deletes only blobs
-- unreferenced and unused since its cutoff, and the save's ON CONFLICT DO UPDATE locks the
-- row, so a prune can not delete a blob a concurrent save is about to reference.
CREATE TABLE input_blobs (
    sha256       bytea       PRIMARY KEY CHECK (length(sha256) = 32),
    encoding     text        NOT NULL CHECK (encoding IN ('identity', 'gzip')),
    size         integer     NOT NULL CHECK (size >= 0),  -- raw bytes
    data         bytea       NOT NULL,                    -- stored (compressed) bytes
    created_at   timestamptz NOT NULL DEFAULT now(),
    last_used_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX input_blobs_last_used_idx ON input_blobs (last_used_at);

-- One saved input per attempt (job_key, fence): the attempt row it belongs to is found by
-- the same pair, and results.response_fingerprint of that attempt's result equals
-- fingerprint (sha256 of the staged data), so "the attempt and the result carry the
-- fingerprint" without touching the fenced commit statement.
CREATE TABLE saved_inputs (
    id             bigserial   PRIMARY KEY,
    job_key        text        NOT NULL,
    fence          bigint      NOT NULL,
    kind           text        NOT NULL,
    parser_version integer     NOT NULL CHECK (parser_version >= 1),
    -- 'parsed' when the attempt's parser produced a record, else its failure category.
    outcome        text        NOT NULL,
    fingerprint    text        NOT NULL DEFAULT '',   -- "sha256:<hex>" of the staged JSON
    staged_sha256  bytea       REFERENCES input_blobs (sha256), -- NULL: nothing was staged
    session_id     text        NOT NULL DEFAULT '',
    -- Set when a body was left out because of the policy's size cap.
    truncated      boolean     NOT NULL DEFAULT false,
    created_at     timestamptz NOT NULL DEFAULT now(),
    UNIQUE (job_key, fence),
    FOREIGN KEY (job_key, fence) REFERENCES attempts (job_key, fence) ON DELETE CASCADE
);
CREATE INDEX saved_inputs_created_idx ON saved_inputs (created_at);
CREATE INDEX saved_inputs_staged_idx ON saved_inputs (staged_sha256);

-- The raw responses of the attempt's steps, in the order they arrived.
CREATE TABLE saved_responses (
    input_id   bigint      NOT NULL REFERENCES saved_inputs (id) ON DELETE CASCADE,
    seq        integer     NOT NULL,
    -- NULL when the body was left out (the policy's size cap, or no body).
    sha256     bytea       REFERENCES input_blobs (sha256),
    size       integer     NOT NULL CHECK (size >= 0),   -- raw body bytes, stored or not
    method     text        NOT NULL DEFAULT 'GET',
    url        text        NOT NULL,   -- credentials never: the proxy is not in it
    status     integer     NOT NULL,
    headers    jsonb       NOT NULL DEFAULT '{}', -- the headers that matter, see store/inputs
    fetched_at timestamptz NOT NULL,
    session_id text        NOT NULL DEFAULT '',
    PRIMARY KEY (input_id, seq)
);
CREATE INDEX saved_responses_sha256_idx ON saved_responses (sha256);

-- +goose Down
DROP TABLE saved_responses;
DROP TABLE saved_inputs;
DROP TABLE input_blobs;
