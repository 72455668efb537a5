package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
)

// SchemaFingerprintsRecent returns up to limit schema fingerprints recorded for a kind's
// parser version (SchemaFingerprintRecord), the most recently seen first, as the JSON
// they were recorded with.
func (s *PG) SchemaFingerprintsRecent(ctx context.Context, kind string, version, limit int) ([]json.RawMessage, error) {
	if limit < 1 {
		return nil, fmt.Errorf("store: SchemaFingerprintsRecent: limit %d must be >= 1", limit)
	}
	rows, err := s.pool.Query(ctx, `
SELECT fingerprint FROM schema_fingerprints
WHERE kind = $1 AND parser_version = $2
ORDER BY last_seen DESC, sha256
LIMIT $3`, kind, version, limit)
	if err != nil {
		return nil, fmt.Errorf("store: schema fingerprints of %q v%d: %w", kind, version, err)
	}
	defer rows.Close()
	var out []json.RawMessage
	for rows.Next() {
		var fp []byte
		if err := rows.Scan(&fp); err != nil {
			return nil, fmt.Errorf("store: schema fingerprints of %q v%d: %w", kind, version, err)
		}
		out = append(out, fp)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("store: schema fingerprints of %q v%d: %w", kind, version, err)
	}
	return out, nil
}

// SchemaFingerprintRecord records that a committed parse of a kind's parser version had the
// schema fingerprint fp (its JSON, a JSON object): a new fingerprint is inserted, a known
// one's last_seen refreshed. One statement.
func (s *PG) SchemaFingerprintRecord(ctx context.Context, kind string, version int, fp json.RawMessage) error {
	switch {
	case kind == "":
		return errors.New("store: SchemaFingerprintRecord: kind is empty")
	case version < 1:
		return fmt.Errorf("store: SchemaFingerprintRecord %q: parser version %d must be >= 1", kind, version)
	case !json.Valid(fp) || len(fp) == 0 || fp[0] != '{':
		return fmt.Errorf("store: SchemaFingerprintRecord %q v%d: fingerprint is not a JSON object", kind, version)
	}
	// The key is the sha256 of jsonb's own text of it: the same schema gets one row
	// whatever key order or spacing its writer used.
	_, err := s.pool.Exec(ctx, `
INSERT INTO schema_fingerprints (kind, parser_version, sha256, fingerprint)
VALUES ($1, $2, sha256(convert_to($3::jsonb::text, 'UTF8')), $3::jsonb)
ON CONFLICT (kind, parser_version, sha256) DO UPDATE SET last_seen = now()`, kind, version, string(fp))
	if err != nil {
		return fmt.Errorf("store: record schema fingerprint of %q v%d: %w", kind, version, err)
	}
	return nil
}
