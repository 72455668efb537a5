package politeness

import (
	"strings"
	"time"

	"github.com/idemscrape/idemscrape/tasks"
)

// Error is why politeness ended a request before it was sent: robots.txt disallows it, the
// robots.txt is unreachable for now, the host's fleet-wide slot is too far away, or the
// shared state in Redis could not be read. Category decides the attempt's fate as for any
// failed request; sessions turns an Error into a *sessions.FetchError with the same
// category, status, Retry-After and cause, so the runner never sees the difference.
type Error struct {
	Category   tasks.Category
	Status     int           // the robots.txt's status (5xx, 429), 0 if none
	RetryAfter time.Duration // when the host's slot is due (throttled), 0 if not known
	Err        error         // cause
}

func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString("politeness: ")
	b.WriteString(string(e.Category))
	if e.Err != nil {
		b.WriteString(": ")
		b.WriteString(e.Err.Error())
	}
	return b.String()
}

func (e *Error) Unwrap() error { return e.Err }
