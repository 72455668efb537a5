package sessions

import (
	"context"
	"net"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestWireReadAfterRaisePassedAgain: between a raise of the run's cap and the read that
// asked for it, another connection of the run (a render's, a parallel request) reads past
// the new cap. The read asks again instead of slicing its buffer with a negative bound (a
// panic in the transport's goroutine, which ended the worker). Here the hook itself plays
// that other connection: the first raise grants 1,500 and then moves the run to 2,002.
func TestWireReadAfterRaisePassedAgain(t *testing.T) {
	calls := 0
	var run *wireOwner
	run = runOwner(context.Background(), 1000, "", func(_ context.Context, moved int64) (int64, string) {
		calls++
		if calls == 1 {
			run.add(2002-moved, false) // the other connection's read, landed meanwhile
			return 1500, ""
		}
		return moved + 4096, ""
	})
	run.add(1001, false) // past the cap

	client, server := net.Pipe()
	defer client.Close()
	defer server.Close()
	go func() { _, _ = server.Write(make([]byte, 64)) }()
	wc := &wireConn{Conn: client}
	wc.owner.Store(run.child())

	buf := make([]byte, 4096)
	var n int
	require.NotPanics(t, func() {
		var err error
		n, err = wc.Read(buf)
		require.NoError(t, err)
	})
	assert.Equal(t, 64, n)
	assert.Equal(t, 2, calls, "asked again once the raised cap was passed")
	left, ok := run.left()
	require.True(t, ok)
	assert.GreaterOrEqual(t, left, int64(0))
}
