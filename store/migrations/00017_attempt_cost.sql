-- +goose NO TRANSACTION
-- +goose Up
-- What each attempt cost (issue 24): its bytes at its proxy's price, in integer micro-units
-- of the price's currency (1 USD = 1,000,000), never a float. The worker computes it from
-- its provider's configured price per GB (sessions.Price) when it records the attempt's
-- end (commit, failure, or the evidence of a superseded attempt); an attempt written as
-- lost by its successor costs 0 until its worker reports. An attempt of a worker without a
-- price has cost 0 and no currency. idemscrape stats adds them up: cost per completed job,
-- totals by kind, window and proxy endpoint, and waste by category.
--
-- On a live database, as 00016: statement by statement, columns added with constant
-- defaults (no rewrite), checks NOT VALID and validated afterwards.
ALTER TABLE attempts ADD COLUMN IF NOT EXISTS cost_micros bigint NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS currency text;
ALTER TABLE attempts DROP CONSTRAINT IF EXISTS attempts_cost_valid;
ALTER TABLE attempts ADD CONSTRAINT attempts_cost_valid
    CHECK (cost_micros >= 0 AND (currency IS NULL OR currency ~ '^[A-Z]{3}$')
        AND (cost_micros = 0 OR currency IS NOT NULL)) NOT VALID;
ALTER TABLE attempts VALIDATE CONSTRAINT attempts_cost_valid;
-- The running attempt's owner (issue 23): the lease owner of the delivery that started it,
-- unique per start. A start whose reply was lost (the connection failed after it was sent)
-- is recognised by it: the fence alone can not tell, since the runner's token is issued by
-- the start itself.
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS attempt_owner text NOT NULL DEFAULT '';

-- +goose Down
ALTER TABLE jobs DROP COLUMN IF EXISTS attempt_owner;
ALTER TABLE attempts DROP CONSTRAINT IF EXISTS attempts_cost_valid;
ALTER TABLE attempts DROP COLUMN IF EXISTS currency, DROP COLUMN IF EXISTS cost_micros;
