//go:build chaos_nofencepred

package store

import (
	"fmt"
	"os"
)

// A deliberately BROKEN build (tag chaos_nofencepred), for cmd/chaos's
// TestChaosCatchesMissingFence only: the commit keeps its state check but not the fence
// predicate, so a worker that wakes while another attempt holds its job running commits
// over that attempt (the state check alone can not refuse it).
const commitFence = ` AND j.state = 'running'`

func init() {
	fmt.Fprintln(os.Stderr, "BROKEN BUILD (chaos_nofencepred): the commit checks the job's state but not its fence; for cmd/chaos tests only")
}
