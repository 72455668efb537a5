package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestJobsListRunnableActive: runnable jobs in activity order (the later of the last
// change and the due time), paged by cursor, up to a bound; other states never.
func TestJobsListRunnableActive(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	s := store.New(pool)
	_, err := pool.Exec(ctx, `
INSERT INTO jobs (key, kind, source_id, country, "window", parser_version, state, updated_at, next_attempt_at, completed_at)
VALUES ('a', 'catalog', 'a', 'US', 'w', 1, 'pending',   '2026-04-23T10:00:00Z', NULL, NULL),
       ('b', 'catalog', 'b', 'US', 'w', 1, 'retryable', '2026-04-23T09:00:00Z', '2026-04-23T11:00:00Z', NULL),
       ('c', 'catalog', 'c', 'US', 'w', 1, 'pending',   '2026-04-23T10:00:00Z', NULL, NULL),
       ('d', 'catalog', 'd', 'US', 'w', 1, 'retryable', '2026-04-23T09:00:00Z', '2026-04-23T13:00:00Z', NULL),
       ('e', 'catalog', 'e', 'US', 'w', 1, 'complete',  '2026-04-23T10:30:00Z', NULL, '2026-04-23T10:30:00Z')`)
	require.NoError(t, err)
	at := func(s string) time.Time { v, err := time.Parse(time.RFC3339, s); require.NoError(t, err); return v }
	keys := func(js []store.Job) (out []string) {
		for _, j := range js {
			out = append(out, j.Key)
		}
		return out
	}
	until := at("2026-04-23T12:00:00Z") // d comes due after it
	page, next, err := s.JobsListRunnableActive(ctx, store.ActivityCursor{At: at("2026-04-23T00:00:00Z")}, until, 2)
	require.NoError(t, err)
	assert.Equal(t, []string{"a", "c"}, keys(page), "10:00 a, 10:00 c (by key), then b due at 11:00")
	assert.Equal(t, store.ActivityCursor{Key: "c", At: at("2026-04-23T10:00:00Z")}, store.ActivityCursor{Key: next.Key, At: next.At.UTC()})
	page, next, err = s.JobsListRunnableActive(ctx, next, until, 2)
	require.NoError(t, err)
	assert.Equal(t, []string{"b"}, keys(page), "b's activity is its due time; d is not due; e is complete")
	assert.True(t, next.At.Equal(at("2026-04-23T11:00:00Z")))
	page, _, err = s.JobsListRunnableActive(ctx, next, until, 2)
	require.NoError(t, err)
	assert.Empty(t, page)
	_, _, err = s.JobsListRunnableActive(ctx, store.ActivityCursor{}, until, -1)
	assert.ErrorContains(t, err, "Limit")
}
