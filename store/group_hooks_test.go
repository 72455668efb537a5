package store

import (
	"runtime"
	"strings"
)

// Test-only views of a GroupCommitter's state, for tests that must wait for a state
// instead of sleeping until it has probably been reached.

// GroupClosing reports whether Close has been called on g: its commits take no new
// request, and the ones already queued are run before Close returns.
func GroupClosing(g *GroupCommitter) bool {
	b := g.commits
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.closed
}

// GroupLoopDrained reports whether a batcher's loop has taken every request of its closed
// queue and now waits only for the statements still in flight: its goroutine is parked in
// the loop's own wait on them (sync.WaitGroup.Wait called by (*batcher).loop, read from
// the goroutine dump). That is the point at which a Close that did not wait for the
// statements in flight would return. It looks at every batcher of the process: a test
// that uses it has no other committer closing meanwhile (Close closes a committer's
// commits before its starts, so the starts' loop of a committer whose commits are being
// closed is not parked there).
func GroupLoopDrained() bool {
	buf := make([]byte, 1<<16)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	for _, gr := range strings.Split(string(buf), "\n\n") {
		lines := strings.Split(gr, "\n")
		// A frame is a function line and a file line; the caller of Wait is 2 lines on.
		for i := 0; i+2 < len(lines); i++ {
			if strings.HasPrefix(lines[i], "sync.(*WaitGroup).Wait(") &&
				strings.Contains(lines[i+2], "/store.(*batcher[...]).loop") {
				return true
			}
		}
	}
	return false
}
