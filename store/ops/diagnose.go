package ops

import (
	"fmt"
	"sort"

	"github.com/idemscrape/idemscrape/store"
)

// Diagnosis thresholds: a cause is named when its share passes its threshold.
const (
	// DiagnoseMinAttemptsPerJob is the attempts per completed job above which the duplicate
	// rate is said to rise even when no single cause passes its threshold.
	DiagnoseMinAttemptsPerJob = 1.5
	// DiagnoseLeaseShare: attempts that lost their lease (superseded or lease_expired), of
	// all attempts.
	DiagnoseLeaseShare = 0.05
	// DiagnoseReplayShare: replays deduplicated downstream, of events sent.
	DiagnoseReplayShare = 0.01
	// DiagnoseTimeoutShare: retries caused by timeouts, of all attempts.
	DiagnoseTimeoutShare = 0.05
)

// timeoutCategories are the failure categories that mean "it took too long".
var timeoutCategories = []string{"timeout", "interrupted"}

// Diagnose names the likely causes of duplicate work in st, most specific first: leases
// too short, late acknowledgements downstream, overlapping schedulers, timeouts. It
// returns nil when there is no duplicate work worth a diagnosis.
func Diagnose(st store.Stats) []string {
	var out []string
	lost := st.SupersededAttempts + st.LeaseExpiredAttempts
	if st.Attempts > 0 && float64(lost)/float64(st.Attempts) >= DiagnoseLeaseShare {
		out = append(out, fmt.Sprintf("leases too short: %d of %d attempts lost their lease (%d superseded, %d lease_expired); "+
			"lengthen the kind's lease (measured duration plus margin) or renew more often", lost, st.Attempts,
			st.SupersededAttempts, st.LeaseExpiredAttempts))
	}
	if st.OutboxReplaysDeduplicated > 0 && float64(st.OutboxReplaysDeduplicated) >= DiagnoseReplayShare*float64(max(st.OutboxSent, 1)) {
		out = append(out, fmt.Sprintf("late acks: consumers recognised %d replayed outbox events (%d sent); "+
			"handlers outlive the consumer's MinIdle, or dispatchers die between XADD and marking the row sent",
			st.OutboxReplaysDeduplicated, st.OutboxSent))
	}
	if st.DuplicateResultsRejected > 0 {
		out = append(out, fmt.Sprintf("overlapping schedulers: %d result writes found their observation already stored; "+
			"two schedulers or templates produce the same observation under different job keys (check windows and parser versions)",
			st.DuplicateResultsRejected))
	}
	var timeouts int64
	for _, c := range timeoutCategories {
		timeouts += st.RetriesCausedByCategory[c]
	}
	if st.Attempts > 0 && float64(timeouts)/float64(st.Attempts) >= DiagnoseTimeoutShare {
		out = append(out, fmt.Sprintf("timeouts: %d retries were caused by timeouts; raise the per-request deadline or the kind's timeout, "+
			"or check the proxy exits", timeouts))
	}
	if len(out) == 0 && st.AttemptsPerCompletedJob >= DiagnoseMinAttemptsPerJob {
		cause, n := topCause(st.RetriesCausedByCategory)
		out = append(out, fmt.Sprintf("duplicate rate rising: %.2f attempts per completed job; the top cause of retries is %q (%d)",
			st.AttemptsPerCompletedJob, cause, n))
	}
	return out
}

// topCause returns the category that caused the most retries (ties: the first by name).
func topCause(m map[string]int64) (string, int64) {
	names := make([]string, 0, len(m))
	for k := range m {
		names = append(names, k)
	}
	sort.Strings(names)
	best, n := "", int64(0)
	for _, k := range names {
		if m[k] > n {
			best, n = k, m[k]
		}
	}
	return best, n
}
