-- +goose NO TRANSACTION
-- +goose Up
-- 1. What the running attempt reserved of its window's money budget (issue 37): the most it
-- may cost, in micro-units of attempt_currency, recorded by its start. An attempt written
-- as lost by whoever raised the fence past it (a takeover's start, the reconciler's rescue)
-- carries this as its cost: a killed worker never reports what its attempt spent, and the
-- reservation is the upper bound the attempt was capped at (its window's Redis total
-- charges the same amount when the reservation lapses). The worker's own report, if it
-- comes later (store.PG.AttemptSupersede), replaces it by the real cost. 0 and NULL: no
-- window budget (nothing reserved).
--
-- On a live database, as 00016: columns added with constant defaults (no rewrite), the
-- check NOT VALID and validated afterwards.
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS attempt_reserved_micros bigint NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS attempt_currency text;
ALTER TABLE jobs DROP CONSTRAINT IF EXISTS jobs_attempt_reserved_valid;
ALTER TABLE jobs ADD CONSTRAINT jobs_attempt_reserved_valid
    CHECK (attempt_reserved_micros >= 0 AND (attempt_currency IS NULL OR attempt_currency ~ '^[A-Z]{3}$')
        AND (attempt_reserved_micros = 0 OR attempt_currency IS NOT NULL)) NOT VALID;
ALTER TABLE jobs VALIDATE CONSTRAINT jobs_attempt_reserved_valid;

-- 2. The provider (its configured name) and tier each attempt ran on (issue 37): two accounts
-- or tiers on one gateway address were one proxy_endpoint, merged in stats and status. The
-- start records them on the running attempt's jobs row, as the endpoint; the attempt's
-- row copies them whoever writes it (its worker, a takeover's start, the rescue). '' for
-- attempts of workers before this migration.
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS attempt_provider text NOT NULL DEFAULT '',
    ADD COLUMN IF NOT EXISTS attempt_tier text NOT NULL DEFAULT '';
ALTER TABLE attempts ADD COLUMN IF NOT EXISTS provider text NOT NULL DEFAULT '',
    ADD COLUMN IF NOT EXISTS tier text NOT NULL DEFAULT '';

-- +goose Down
ALTER TABLE attempts DROP COLUMN IF EXISTS tier, DROP COLUMN IF EXISTS provider;
ALTER TABLE jobs DROP COLUMN IF EXISTS attempt_tier, DROP COLUMN IF EXISTS attempt_provider;
ALTER TABLE jobs DROP CONSTRAINT IF EXISTS jobs_attempt_reserved_valid;
ALTER TABLE jobs DROP COLUMN IF EXISTS attempt_currency, DROP COLUMN IF EXISTS attempt_reserved_micros;
