package retry

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func TestCeiling(t *testing.T) {
	for _, c := range []struct {
		attempt int
		want    time.Duration
	}{{0, time.Second}, {1, time.Second}, {2, 2 * time.Second}, {4, 8 * time.Second}, {5, 10 * time.Second}, {1000, 10 * time.Second}} {
		assert.Equal(t, c.want, Ceiling(time.Second, 10*time.Second, c.attempt), "attempt %d", c.attempt)
	}
}

func TestJitterBounds(t *testing.T) {
	for range 1000 {
		f := Full(time.Second, time.Minute, 3, func() float64 { return 0.999999 })
		assert.LessOrEqual(t, f, 4*time.Second)
		e := Equal(time.Second, time.Minute, 3)
		assert.GreaterOrEqual(t, e, 2*time.Second)
		assert.LessOrEqual(t, e, 4*time.Second)
		j := Jitter(10*time.Second, 0.1)
		assert.GreaterOrEqual(t, j, 9*time.Second)
		assert.LessOrEqual(t, j, 11*time.Second)
	}
	assert.Equal(t, time.Duration(0), Full(time.Second, time.Minute, 3, func() float64 { return 0 }))
	assert.Equal(t, 7*time.Second, Jitter(7*time.Second, 0))
}

func TestSleep(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	assert.True(t, Sleep(ctx, time.Millisecond))
	assert.True(t, Sleep(ctx, 0))
	cancel()
	assert.False(t, Sleep(ctx, time.Hour), "a cancelled context ends the sleep")
	assert.False(t, Sleep(ctx, 0))
}

func TestNonce(t *testing.T) {
	a, b := Nonce(6), Nonce(6)
	assert.Len(t, a, 12)
	assert.NotEqual(t, a, b)
}
