package job

import "errors"

// Category classifies why an attempt did not complete. It drives the retry policy
// (handlers) and is recorded on the attempt and on the job (last_category). The values are
// stable strings: they are stored in PostgreSQL and used as metric labels.
type Category string

// Failure categories. Fetch categories are assigned by package sessions, the others by
// the runner.
const (
	// CategoryProxyAuth: the proxy refused the credentials or username format (407), or
	// the account (402 Payment Required: no balance left). An account incident, not the
	// job's failure: retried, uncounted; the provider's breaker keeps work off it until a
	// probe authenticates (handlers/incident.go).
	CategoryProxyAuth Category = "proxy_auth"
	// CategoryExitUnavailable: the provider has no exit for the requested country or
	// session (502/522/525 from the proxy, provider error headers).
	CategoryExitUnavailable Category = "exit_unavailable"
	// CategorySessionLost: the sticky session's device went away mid-unit (connection
	// reset, EOF, proxy 502 on a session that worked).
	CategorySessionLost Category = "session_lost"
	// CategoryThrottled: the destination answered 429 or 503; Retry-After is honoured.
	CategoryThrottled Category = "throttled"
	// CategoryTimeout: a deadline passed (request timeout, unit deadline).
	CategoryTimeout Category = "timeout"
	// CategoryInterrupted: the attempt's context was cancelled — its lease was lost or the
	// worker is shutting down — before a deadline passed. Not the destination's fault; the
	// error wraps context.Cause, which says why.
	CategoryInterrupted Category = "interrupted"
	// CategoryDNSNotFound: the destination's name does not exist (NXDOMAIN: a
	// *net.DNSError with IsNotFound). Terminal: retrying an unknown name is a retry storm.
	CategoryDNSNotFound Category = "dns_not_found"
	// CategoryNetwork: a transient network failure that is not the session's: a temporary
	// or timed-out DNS lookup (of the destination or of the proxy gateway), or the
	// destination refusing or resetting the connection. Retryable.
	CategoryNetwork Category = "network"
	// CategoryDestinationError: the destination answered another 5xx.
	CategoryDestinationError Category = "destination_error"
	// CategoryNotFound: the destination answered 404 or 410. Terminal.
	CategoryNotFound Category = "not_found"
	// CategoryBlocked: the destination answered 401 or 403, or another 4xx.
	CategoryBlocked Category = "blocked"
	// CategoryRobotsDisallowed: robots.txt disallows the URL. Terminal.
	CategoryRobotsDisallowed Category = "robots_disallowed"
	// CategoryForbiddenAddress: the URL's host is, or resolves to, a loopback, private,
	// link-local, CGNAT, metadata or multicast address, or its port is not in the
	// destination policy's allow-list (SSRF guard, see DestinationPolicy). Terminal.
	CategoryForbiddenAddress Category = "forbidden_address"
	// CategoryBodyTooLarge: a response exceeded the size cap (decompressed). Terminal.
	CategoryBodyTooLarge Category = "body_too_large"
	// CategoryUnsafeStepIncomplete: a unit failed after an unsafe step ran; replaying it
	// could repeat a side effect. Terminal, for review.
	CategoryUnsafeStepIncomplete Category = "unsafe_step_incomplete"
	// CategoryParseError: the parser could not read the response.
	CategoryParseError Category = "parse_error"
	// CategoryValidation: the staged observation failed validation.
	CategoryValidation Category = "validation"
	// CategoryLeaseBusy: another worker holds the job's lease. Not a failure.
	CategoryLeaseBusy Category = "lease_busy"
	// CategoryLeaseLost: the attempt's lease expired or was taken while it ran; it wrote
	// nothing and the job is retried.
	CategoryLeaseLost Category = "lease_lost"
	// CategorySuperseded: a newer attempt took the job over; this one wrote nothing.
	CategorySuperseded Category = "superseded"
	// CategoryBudgetExceeded: the job's attempt, time or bandwidth budget is spent (the
	// bandwidth budget also stops a run mid-response: sessions.RunConfig.MaxBytes).
	CategoryBudgetExceeded Category = "budget_exceeded"
	// CategoryPanic: user code panicked; the attempt is recorded and the job retryable.
	CategoryPanic Category = "panic"
	// CategoryInternal: anything unclassified (database or Redis errors, bugs).
	CategoryInternal Category = "internal"
)

// Failure is an error that carries its failure category. Steps, parsers and validators
// return one (see Fail) to choose the retry policy of their failure — e.g. a parser that
// meets a page it knows is incomplete returns Fail(CategoryDestinationError, err) to have
// it retried instead of failed as a parse error. The runner and the workflow unit honour
// it wherever it is wrapped; the error text stays the wrapped error's.
type Failure struct {
	cat Category
	err error
}

// Fail returns err with category c (a Failure). A nil err gets a generic text.
func Fail(c Category, err error) error {
	if err == nil {
		err = errors.New(string(c))
	}
	return &Failure{cat: c, err: err}
}

// Category returns the failure's category.
func (f *Failure) Category() Category { return f.cat }

func (f *Failure) Error() string { return f.err.Error() }

// Unwrap returns the wrapped error.
func (f *Failure) Unwrap() error { return f.err }

// CategoryFrom returns the category of the first error in err's chain that has a
// Category() Category method (a Failure, or a package's own categorised error).
func CategoryFrom(err error) (Category, bool) {
	var c interface{ Category() Category }
	if errors.As(err, &c) {
		return c.Category(), true
	}
	return "", false
}
