-- +goose NO TRANSACTION
-- +goose Up
-- The attempt row is written once, when the attempt ends (issue 23). While an attempt runs,
-- the jobs row alone describes it: the start raises the fence and records the running
-- attempt's worker, session, proxy endpoint and start time in these columns (attempt_no is
-- jobs.attempts, the country jobs.country). The commit, or the failure record, inserts the
-- attempt row in the same statement as its other writes. An attempt that never ends (its
-- worker was killed, or stopped until its lease expired) gets its row, outcome 'lost', from
-- whoever raises the fence next: the next start, or the reconciler's rescue, copied from
-- these columns. A superseded worker that wakes and reports turns 'lost' into
-- 'superseded' and adds its bytes. Invariant (idemscrape audit): once a job is terminal it
-- has exactly one attempt row per start, attempt numbers 1..jobs.attempts.
--
-- Rows written before this migration keep their form: an attempt still 'running' is ended
-- by its own (old) worker, or turned 'lost' by the next start or rescue (ON CONFLICT).
-- Columns are added bare with constant defaults (no rewrite); checks NOT VALID, then
-- validated without blocking writes. Each statement can run again.
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS attempt_worker text NOT NULL DEFAULT '',
    ADD COLUMN IF NOT EXISTS attempt_session text NOT NULL DEFAULT '',
    ADD COLUMN IF NOT EXISTS attempt_endpoint text NOT NULL DEFAULT '',
    ADD COLUMN IF NOT EXISTS attempt_started_at timestamptz;
-- +goose StatementBegin
DO $$ BEGIN
    -- host:port of the proxy gateway only, as attempts.proxy_endpoint: a credential is
    -- refused by the database.
    IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conname = 'jobs_attempt_endpoint_bare') THEN
        ALTER TABLE jobs ADD CONSTRAINT jobs_attempt_endpoint_bare CHECK (attempt_endpoint !~ '[@/]') NOT VALID;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conname = 'attempts_outcome_lost') THEN
        ALTER TABLE attempts ADD CONSTRAINT attempts_outcome_lost
            CHECK (outcome IN ('running', 'complete', 'retryable', 'failed', 'superseded', 'lost')) NOT VALID;
    END IF;
    ALTER TABLE attempts DROP CONSTRAINT IF EXISTS attempts_outcome_check;
    -- A saved input is written before its attempt row now: it belongs to the job (and goes
    -- with it), not to an attempts row.
    IF EXISTS (SELECT 1 FROM pg_constraint WHERE conname = 'saved_inputs_job_key_fence_fkey') THEN
        ALTER TABLE saved_inputs DROP CONSTRAINT saved_inputs_job_key_fence_fkey;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conname = 'saved_inputs_job_key_fkey') THEN
        ALTER TABLE saved_inputs ADD CONSTRAINT saved_inputs_job_key_fkey
            FOREIGN KEY (job_key) REFERENCES jobs (key) ON DELETE CASCADE NOT VALID;
    END IF;
END $$;
-- +goose StatementEnd
ALTER TABLE jobs VALIDATE CONSTRAINT jobs_attempt_endpoint_bare;
ALTER TABLE attempts VALIDATE CONSTRAINT attempts_outcome_lost;
ALTER TABLE saved_inputs VALIDATE CONSTRAINT saved_inputs_job_key_fkey;
-- The attempts running now (started by a worker of the previous version): their jobs rows
-- describe them, as a start of this version writes them.
UPDATE jobs j SET attempt_worker = a.worker, attempt_session = a.session_id,
    attempt_endpoint = a.proxy_endpoint, attempt_started_at = a.started_at
FROM attempts a
WHERE j.state = 'running' AND a.job_key = j.key AND a.fence = j.fence AND j.attempt_started_at IS NULL;

-- +goose Down
-- +goose StatementBegin
DO $$ BEGIN
    ALTER TABLE saved_inputs DROP CONSTRAINT IF EXISTS saved_inputs_job_key_fkey;
    IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conname = 'saved_inputs_job_key_fence_fkey') THEN
        ALTER TABLE saved_inputs ADD CONSTRAINT saved_inputs_job_key_fence_fkey
            FOREIGN KEY (job_key, fence) REFERENCES attempts (job_key, fence) ON DELETE CASCADE NOT VALID;
    END IF;
    UPDATE attempts SET outcome = 'superseded' WHERE outcome = 'lost';
    ALTER TABLE attempts DROP CONSTRAINT IF EXISTS attempts_outcome_lost;
    IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conname = 'attempts_outcome_check') THEN
        ALTER TABLE attempts ADD CONSTRAINT attempts_outcome_check
            CHECK (outcome IN ('running', 'complete', 'retryable', 'failed', 'superseded')) NOT VALID;
    END IF;
END $$;
-- +goose StatementEnd
ALTER TABLE jobs DROP CONSTRAINT IF EXISTS jobs_attempt_endpoint_bare,
    DROP COLUMN IF EXISTS attempt_started_at, DROP COLUMN IF EXISTS attempt_endpoint,
    DROP COLUMN IF EXISTS attempt_session, DROP COLUMN IF EXISTS attempt_worker;
