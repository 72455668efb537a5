//go:build chaos_nofence && !chaos_nofencepred

package store

import (
	"fmt"
	"os"
)

// A deliberately BROKEN build (tag chaos_nofence), for cmd/chaos's
// TestChaosCatchesMissingFence only: the commit checks neither the job's fence nor its
// state, so a worker that wakes after another took its job over commits anyway.
const commitFence = ``

func init() {
	fmt.Fprintln(os.Stderr, "BROKEN BUILD (chaos_nofence): the commit does not check the fence; for cmd/chaos tests only")
}
