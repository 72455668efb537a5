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
--
-- On a live database: every statement runs on its own (no transaction around the file), so
-- no two tables are held locked together; columns are added bare with constant defaults (no
-- rewrite), checks NOT VALID and validated afterwards (no scan under an exclusive lock).
-- Each ALTER still waits for its brief exclusive lock behind any long reader (a pg_dump, a
-- long report), and job statements queue behind it meanwhile: run it when none is running,
-- or give the migrating role a lock_timeout (ALTER ROLE … SET lock_timeout = '5s') so that
-- it fails instead and can simply run again (every statement is idempotent). Not SET here:
-- the setting would stay on a pooled connection if a statement failed before a RESET.
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS attempt_worker text NOT NULL DEFAULT '',
    ADD COLUMN IF NOT EXISTS attempt_session text NOT NULL DEFAULT '',
    ADD COLUMN IF NOT EXISTS attempt_endpoint text NOT NULL DEFAULT '',
    ADD COLUMN IF NOT EXISTS attempt_started_at timestamptz;
-- host:port of the proxy gateway only, as attempts.proxy_endpoint: a credential is refused
-- by the database.
ALTER TABLE jobs DROP CONSTRAINT IF EXISTS jobs_attempt_endpoint_bare;
ALTER TABLE jobs ADD CONSTRAINT jobs_attempt_endpoint_bare CHECK (attempt_endpoint !~ '[@/]') NOT VALID;
ALTER TABLE attempts DROP CONSTRAINT IF EXISTS attempts_outcome_lost;
ALTER TABLE attempts ADD CONSTRAINT attempts_outcome_lost
    CHECK (outcome IN ('running', 'complete', 'retryable', 'failed', 'superseded', 'lost')) NOT VALID;
ALTER TABLE attempts DROP CONSTRAINT IF EXISTS attempts_outcome_check;
-- A saved input is written before its attempt row now: it belongs to the job (and goes with
-- it), not to an attempts row.
ALTER TABLE saved_inputs DROP CONSTRAINT IF EXISTS saved_inputs_job_key_fence_fkey;
ALTER TABLE saved_inputs DROP CONSTRAINT IF EXISTS saved_inputs_job_key_fkey;
ALTER TABLE saved_inputs ADD CONSTRAINT saved_inputs_job_key_fkey
    FOREIGN KEY (job_key) REFERENCES jobs (key) ON DELETE CASCADE NOT VALID;
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
-- The previous version writes the attempt row at the start and updates it at the end: the
-- attempts running now get their row back (from the jobs row) before the columns go, or
-- their workers' finishes and the reconciler (which lists running attempts by their rows)
-- would miss them; a 'lost' row becomes what that version wrote (a takeover's 'superseded',
-- a rescue's 'retryable').
INSERT INTO attempts (job_key, attempt_no, fence, worker, session_id, country, proxy_endpoint, started_at)
SELECT key, attempts, fence, attempt_worker, attempt_session, country, attempt_endpoint, COALESCE(attempt_started_at, updated_at)
FROM jobs WHERE state = 'running' AND attempts > 0
ON CONFLICT DO NOTHING;
UPDATE attempts SET outcome = CASE WHEN category = 'lease_expired' THEN 'retryable' ELSE 'superseded' END
WHERE outcome = 'lost' OR (outcome = 'superseded' AND category = 'lease_expired');
ALTER TABLE saved_inputs DROP CONSTRAINT IF EXISTS saved_inputs_job_key_fkey;
ALTER TABLE saved_inputs DROP CONSTRAINT IF EXISTS saved_inputs_job_key_fence_fkey;
ALTER TABLE saved_inputs ADD CONSTRAINT saved_inputs_job_key_fence_fkey
    FOREIGN KEY (job_key, fence) REFERENCES attempts (job_key, fence) ON DELETE CASCADE NOT VALID;
ALTER TABLE attempts DROP CONSTRAINT IF EXISTS attempts_outcome_check;
ALTER TABLE attempts ADD CONSTRAINT attempts_outcome_check
    CHECK (outcome IN ('running', 'complete', 'retryable', 'failed', 'superseded')) NOT VALID;
ALTER TABLE attempts DROP CONSTRAINT IF EXISTS attempts_outcome_lost;
ALTER TABLE jobs DROP CONSTRAINT IF EXISTS jobs_attempt_endpoint_bare,
    DROP COLUMN IF EXISTS attempt_started_at, DROP COLUMN IF EXISTS attempt_endpoint,
    DROP COLUMN IF EXISTS attempt_session, DROP COLUMN IF EXISTS attempt_worker;
