// Package retry holds the waiting every retry loop of idemscrape does: exponential backoff
// (with full or equal jitter), a jittered interval, a sleep that ends with its context, and
// random nonces for lease owners. One copy of each, so that the runner, the scheduler, the
// reconciler, the outbox and the lease keeper wait by the same rules.
package retry

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"math/rand/v2"
	"time"
)

// Ceiling is the exponential step of attempt (1-based): base·2^(attempt−1), capped at max.
// It stops doubling at max, long before overflowing.
func Ceiling(base, max time.Duration, attempt int) time.Duration {
	d := base
	for i := 1; i < attempt && d < max; i++ {
		d *= 2
	}
	return min(d, max)
}

// Full is exponential backoff with full jitter: uniform in [0, Ceiling(base, max, attempt)],
// drawn with rnd (uniform in [0, 1)). It spreads a fleet's retries widest.
func Full(base, max time.Duration, attempt int, rnd func() float64) time.Duration {
	return time.Duration(rnd() * float64(Ceiling(base, max, attempt)))
}

// Equal is exponential backoff with "equal jitter": half the step fixed, half random, so a
// fleet spreads out but never retries at once.
func Equal(base, max time.Duration, attempt int) time.Duration {
	half := Ceiling(base, max, attempt) / 2
	return half + time.Duration(rand.Int64N(int64(half)+1))
}

// Jitter varies d by up to ± frac (0 ≤ frac < 1), uniformly; frac 0 returns d.
func Jitter(d time.Duration, frac float64) time.Duration {
	if frac == 0 {
		return d
	}
	return time.Duration(float64(d) * (1 + frac*(2*rand.Float64()-1)))
}

// Sleep waits for d or until ctx is done, and reports whether the whole of d passed (for
// d ≤ 0: whether ctx is still live).
func Sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// Nonce returns n random bytes from crypto/rand as 2n hex digits: a lease owner's suffix,
// unique per delivery without coordination.
func Nonce(n int) string {
	b := make([]byte, n)
	_, _ = crand.Read(b)
	return hex.EncodeToString(b)
}
