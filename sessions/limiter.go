package sessions

import (
	"context"
	"time"
)

// HostLimiter paces requests per destination host. A bound collector calls Wait before
// every hop (redirects and robots.txt fetches included) and Pause when a host answered 429
// or 503 with Retry-After. handlers implements it fleet-wide on Redis (lua.HostLimits).
type HostLimiter interface {
	// Wait blocks until a request to host (host[:port], lower case) may be sent. It
	// returns ctx's error when ctx ends first, and a *FetchError of category throttled
	// (RetryAfter set) when the wait would be longer than the limiter allows a job to hold
	// its lease idle.
	Wait(ctx context.Context, host string) error
	// Pause asks every worker to send nothing to host for d. Best effort: it must not
	// block long, and a failure only loses the shared back-off.
	Pause(ctx context.Context, host string, d time.Duration)
}
