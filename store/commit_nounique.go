//go:build chaos_nounique

package store

import (
	"fmt"
	"os"
)

// A deliberately BROKEN build (tag chaos_nounique), for cmd/chaos's
// TestChaosCatchesMissingFence only: every commit's result gets an observation key of its
// own (the committing token appended), so the unique index no longer rejects a second
// result for the same observation.
const commitResultKey = `i.obs_key || ':' || i.token::text`

func init() {
	fmt.Fprintln(os.Stderr, "BROKEN BUILD (chaos_nounique): results bypass the unique observation key; for cmd/chaos tests only")
}
