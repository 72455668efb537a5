-- +goose Up
-- Operator actions (store/ops, `idemscrape requeue`).
--
-- A failed job re-queued by an operator gets a fresh retry budget without rewriting its
-- history: attempts, attempt numbers, bytes_total and created_at keep counting everything
-- the job ever did (they are evidence), and the budget columns mark where the current
-- budget starts. The runner's attempt cap applies to attempts − budget_attempts, its
-- bandwidth budget to bytes_total − budget_bytes, its total time budget to the time since
-- COALESCE(budget_since, created_at). All three are 0 / NULL until the first requeue.
ALTER TABLE jobs
    ADD COLUMN budget_attempts integer     NOT NULL DEFAULT 0 CHECK (budget_attempts >= 0),
    ADD COLUMN budget_bytes    bigint      NOT NULL DEFAULT 0 CHECK (budget_bytes >= 0),
    ADD COLUMN budget_since    timestamptz;

-- What operators did to a job, who and when: independent of attempts (a note is not an
-- execution), appended only.
CREATE TABLE job_notes (
    id                bigserial   PRIMARY KEY,
    job_key           text        NOT NULL REFERENCES jobs (key) ON DELETE CASCADE,
    action            text        NOT NULL,         -- e.g. 'requeue'
    actor             text        NOT NULL,         -- the operator (-by, default $USER)
    note              text        NOT NULL DEFAULT '',
    previous_state    text        NOT NULL,
    previous_category text,
    attempts_before   integer     NOT NULL,         -- jobs.attempts when the action ran
    created_at        timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX job_notes_job_key_idx ON job_notes (job_key, id);

-- +goose Down
DROP TABLE job_notes;
ALTER TABLE jobs DROP COLUMN budget_since, DROP COLUMN budget_bytes, DROP COLUMN budget_attempts;
