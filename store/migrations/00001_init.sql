-- +goose Up
-- idemscrape schema v1. Postgres is the system of record: every transition of a job is a
-- conditional UPDATE on this table (see store/jobs.go), and uniqueness is enforced here,
-- never by "check then insert".

CREATE TABLE jobs (
    key             text        PRIMARY KEY,
    kind            text        NOT NULL,
    url             text,
    source_id       text,
    country         text        NOT NULL,
    "window"        text        NOT NULL,
    parser_version  integer     NOT NULL CHECK (parser_version >= 1),
    scope           text        NOT NULL DEFAULT '',
    state           text        NOT NULL DEFAULT 'pending'
                    CHECK (state IN ('pending', 'running', 'retryable', 'complete', 'failed')),
    -- Highest fencing token any attempt of this job was started with. Only ever raised.
    fence           bigint      NOT NULL DEFAULT 0 CHECK (fence >= 0),
    attempts        integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    next_attempt_at timestamptz,
    last_category   text,
    bytes_total     bigint      NOT NULL DEFAULT 0 CHECK (bytes_total >= 0),
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    completed_at    timestamptz,
    CHECK ((url IS NULL) <> (source_id IS NULL)),
    CHECK ((state = 'complete') = (completed_at IS NOT NULL))
);

-- The reconciler and `idemscrape status` look jobs up by state; complete rows are the bulk
-- and are never scanned by state, so they stay out of the index.
CREATE INDEX jobs_state_idx ON jobs (state, next_attempt_at) WHERE state <> 'complete';

CREATE TABLE attempts (
    job_key        text        NOT NULL REFERENCES jobs (key) ON DELETE CASCADE,
    attempt_no     integer     NOT NULL CHECK (attempt_no >= 1),
    fence          bigint      NOT NULL CHECK (fence >= 1),
    worker         text        NOT NULL DEFAULT '',
    session_id     text        NOT NULL DEFAULT '',
    country        text        NOT NULL DEFAULT '',
    -- host:port of the proxy gateway only. The CHECK is a last line of defence against a
    -- credential ever reaching a row: an endpoint with user info is refused by the database.
    proxy_endpoint text        NOT NULL DEFAULT '' CHECK (proxy_endpoint !~ '[@/]'),
    started_at     timestamptz NOT NULL DEFAULT now(),
    finished_at    timestamptz,
    http_status    integer,
    bytes          bigint      NOT NULL DEFAULT 0 CHECK (bytes >= 0),
    outcome        text        NOT NULL DEFAULT 'running'
                   CHECK (outcome IN ('running', 'complete', 'retryable', 'failed', 'superseded')),
    category       text,
    error          text,
    PRIMARY KEY (job_key, attempt_no),
    UNIQUE (job_key, fence)
);

CREATE TABLE results (
    observation_key      text        PRIMARY KEY,
    job_key              text        NOT NULL REFERENCES jobs (key) ON DELETE CASCADE,
    parser_version       integer     NOT NULL CHECK (parser_version >= 1),
    data                 jsonb       NOT NULL,
    response_fingerprint text        NOT NULL DEFAULT '',
    fence                bigint      NOT NULL,
    created_at           timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX results_job_key_idx ON results (job_key);

CREATE TABLE outbox (
    id         bigserial   PRIMARY KEY,
    event_key  text        NOT NULL UNIQUE,
    topic      text        NOT NULL,
    payload    jsonb       NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    sent_at    timestamptz
);
-- The dispatcher claims unsent rows oldest first.
CREATE INDEX outbox_unsent_idx ON outbox (id) WHERE sent_at IS NULL;

CREATE TABLE quarantine (
    id         bigserial   PRIMARY KEY,
    job_key    text        NOT NULL REFERENCES jobs (key) ON DELETE CASCADE,
    attempt_no integer     NOT NULL,
    session_id text        NOT NULL DEFAULT '',
    reason     text        NOT NULL,
    staged     jsonb,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX quarantine_job_key_idx ON quarantine (job_key);

-- +goose Down
DROP TABLE quarantine;
DROP TABLE outbox;
DROP TABLE results;
DROP TABLE attempts;
DROP TABLE jobs;
