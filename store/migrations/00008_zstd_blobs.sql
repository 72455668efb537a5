-- +goose Up
-- Saved-input blobs are written with zstd (store/inputs): it decodes about twice as fast
-- as gzip, which is most of what reading a saved input costs besides the parse. Blobs
-- written with gzip stay readable. Every existing row satisfies the wider check (it
-- passed the narrower one), so it is added NOT VALID: no scan of input_blobs under the
-- migration's exclusive lock; new rows are checked as before.
ALTER TABLE input_blobs DROP CONSTRAINT input_blobs_encoding_check;
ALTER TABLE input_blobs ADD CONSTRAINT input_blobs_encoding_check
    CHECK (encoding IN ('identity', 'gzip', 'zstd')) NOT VALID;

-- +goose Down
-- Refused while zstd blobs exist (the narrower check fails on them): prune or re-encode
-- them first.
ALTER TABLE input_blobs DROP CONSTRAINT input_blobs_encoding_check;
ALTER TABLE input_blobs ADD CONSTRAINT input_blobs_encoding_check
    CHECK (encoding IN ('identity', 'gzip'));
