-- +goose NO TRANSACTION
-- +goose Up
-- Warm sessions (issue 40): how many units the attempt's session had served before the
-- attempt's unit ran on it. 0: a new session (and every attempt of workers before this
-- migration, and lost attempts, whose worker never reported); n > 0: a warm session from
-- the worker's session pool, on its (n+1)-th unit. stats compares bytes and block rates of
-- warm and new sessions from it.
--
-- On a live database, as 00016 and 00019: the column is added with a constant default (no
-- rewrite), the check NOT VALID and validated afterwards (a scan that takes no exclusive
-- lock). Idempotent.
ALTER TABLE attempts ADD COLUMN IF NOT EXISTS session_units integer NOT NULL DEFAULT 0;
ALTER TABLE attempts DROP CONSTRAINT IF EXISTS attempts_session_units_check;
ALTER TABLE attempts ADD CONSTRAINT attempts_session_units_check CHECK (session_units >= 0) NOT VALID;
ALTER TABLE attempts VALIDATE CONSTRAINT attempts_session_units_check;

-- +goose Down
ALTER TABLE attempts DROP CONSTRAINT IF EXISTS attempts_session_units_check;
ALTER TABLE attempts DROP COLUMN IF EXISTS session_units;
