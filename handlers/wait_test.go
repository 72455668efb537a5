package handlers

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"
)

// Tests in this package assert on what happened — counts, orderings, states, the limiter's
// own clock — never on how fast the box was: the suite runs on loaded 2-core machines (load
// 9–22, another copy of the suite alongside). Where a test must wait for something to
// happen, it waits up to WaitTimeout, a fail-safe against a hang and not a speed
// requirement, and its failure says so, with the load it saw. These helpers are exported
// (in a _test file, like export_test.go) for the external test package.

// WaitTimeout bounds every wait for something that is bound to happen.
const WaitTimeout = 2 * time.Minute

// Load1 returns the 1-minute load average from /proc/loadavg, or "unknown".
func Load1() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	if f := strings.Fields(string(b)); len(f) > 0 {
		return f[0]
	}
	return "unknown"
}

// NotHappened is the failure message of a wait that ran out: what did not happen, within
// how long, under which load — not that an invariant broke.
func NotHappened(what string, within time.Duration) string {
	return fmt.Sprintf("%s did not happen within %v (load %s)", what, within, Load1())
}

// WaitUntil polls cond every tick, in the test's goroutine (cond may use require), until
// it holds; if WaitTimeout passes first the test fails with NotHappened(what).
func WaitUntil(t testing.TB, what string, tick time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(WaitTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal(NotHappened(what, WaitTimeout))
		}
		time.Sleep(tick)
	}
}
