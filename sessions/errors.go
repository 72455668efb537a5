package sessions

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/gocolly/colly/v2"

	"github.com/idemscrape/idemscrape/politeness"
	"github.com/idemscrape/idemscrape/tasks"
)

// FetchError is a classified failure of one request or unit. Its text never contains
// credentials: it is built from the category, status, step and a cause that went through
// redaction.
type FetchError struct {
	Category   tasks.Category
	Status     int           // HTTP status (proxy's or destination's), 0 if none
	RetryAfter time.Duration // from Retry-After on 429/503, 0 if absent
	Step       string        // unit step, "" outside a unit
	Err        error         // cause
}

func (e *FetchError) Error() string {
	var b strings.Builder
	b.WriteString("sessions: ")
	b.WriteString(string(e.Category))
	if e.Step != "" {
		b.WriteString(" at step ")
		b.WriteString(e.Step)
	}
	if e.Status != 0 {
		fmt.Fprintf(&b, " (status %d)", e.Status)
	}
	if e.RetryAfter > 0 {
		fmt.Fprintf(&b, " retry after %v", e.RetryAfter)
	}
	if e.Err != nil {
		b.WriteString(": ")
		b.WriteString(e.Err.Error())
	}
	return b.String()
}

func (e *FetchError) Unwrap() error { return e.Err }

// CategoryOf returns the category of err: the FetchError's if there is one, else a
// politeness.Error's, else a tasks.Failure's (tasks.Fail), else
// CategoryTimeout for deadlines, CategoryInterrupted for cancellation, else
// CategoryInternal.
func CategoryOf(err error) tasks.Category {
	var fe *FetchError
	if errors.As(err, &fe) {
		return fe.Category
	}
	var pe *politeness.Error
	if errors.As(err, &pe) {
		return pe.Category
	}
	if c, ok := tasks.CategoryFrom(err); ok {
		return c
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return tasks.CategoryTimeout
	}
	if errors.Is(err, context.Canceled) {
		return tasks.CategoryInterrupted
	}
	return tasks.CategoryInternal
}

// ErrBodyTooLarge: a response body exceeded the collector's cap after decompression.
var ErrBodyTooLarge = errors.New("sessions: response body exceeds the size cap")

// proxyStatusError is returned by the transport when the proxy itself refused a request.
type proxyStatusError struct {
	status int
	header http.Header
}

func (e *proxyStatusError) Error() string {
	msg := fmt.Sprintf("proxy answered %d %s", e.status, http.StatusText(e.status))
	if code := providerErrorCode(e.header); code != "" {
		msg += " (" + code + ")"
	}
	return msg
}

// providerErrorCode extracts a provider's error code: RFC 9209 Proxy-Status, Bright
// Data's x-brd-err-code, its legacy x-luminati-error. Values are provider codes, never
// credentials, but they are cut short and stripped of anything but [A-Za-z0-9_.=;: -].
func providerErrorCode(h http.Header) string {
	for _, name := range []string{"Proxy-Status", "X-Brd-Err-Code", "X-Luminati-Error"} {
		if v := h.Get(name); v != "" {
			return name + ": " + sanitizeHeader(v)
		}
	}
	return ""
}

func sanitizeHeader(v string) string {
	if len(v) > 120 {
		v = v[:120]
	}
	return strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', strings.ContainsRune("_.=;: -", r):
			return r
		}
		return -1
	}, v)
}

// classifyProxyStatus maps the proxy's own refusal to a category. started tells whether
// the session already served a request (then a 502 means its device went away).
func classifyProxyStatus(status int, started bool) tasks.Category {
	switch {
	case status == http.StatusProxyAuthRequired, status == http.StatusPaymentRequired:
		// 407: the credentials; 402: the account's balance. Either is the account's
		// failure, an incident (handlers), not the job's.
		return tasks.CategoryProxyAuth
	case started && status == http.StatusBadGateway:
		return tasks.CategorySessionLost
	default: // 502 on first use, 522, 525, other provider errors
		return tasks.CategoryExitUnavailable
	}
}

// classify turns an error from the collector (transport, colly) into a FetchError.
// started tells whether the session already served a request in this unit.
func classify(err error, started bool) *FetchError {
	var fe *FetchError
	if errors.As(err, &fe) {
		return fe
	}
	var polite *politeness.Error
	if errors.As(err, &polite) { // robots.txt or the host limit held the request back
		return &FetchError{Category: polite.Category, Status: polite.Status, RetryAfter: polite.RetryAfter, Err: polite.Err}
	}
	if c, ok := tasks.CategoryFrom(err); ok { // a step's own tasks.Fail
		return &FetchError{Category: c, Err: err}
	}
	var (
		pe *proxyStatusError
		re *ResolveError
		de *net.DNSError
	)
	switch {
	case errors.As(err, &pe):
		if c := proxyDNSCategory(pe.header); c != "" {
			return &FetchError{Category: c, Status: pe.status, Err: pe}
		}
		return &FetchError{Category: classifyProxyStatus(pe.status, started), Status: pe.status, Err: pe}
	case errors.Is(err, ErrBudgetExceeded):
		var be *budgetExceededError
		if errors.As(err, &be) {
			return &FetchError{Category: tasks.CategoryBudgetExceeded, Err: be}
		}
		return &FetchError{Category: tasks.CategoryBudgetExceeded, Err: ErrBudgetExceeded}
	case errors.Is(err, ErrBodyTooLarge):
		var btl *bodyTooLargeError
		if errors.As(err, &btl) {
			return &FetchError{Category: tasks.CategoryBodyTooLarge, Err: btl}
		}
		return &FetchError{Category: tasks.CategoryBodyTooLarge, Err: ErrBodyTooLarge}
	case errors.Is(err, ErrForbiddenAddress):
		return &FetchError{Category: tasks.CategoryForbiddenAddress, Err: scrub(err)}
	case errors.Is(err, colly.ErrRobotsTxtBlocked):
		return &FetchError{Category: tasks.CategoryRobotsDisallowed, Err: colly.ErrRobotsTxtBlocked}
	case errors.As(err, &re):
		// The guard's lookup of the destination: a name that does not exist is terminal,
		// anything else (SERVFAIL, timeout) transient.
		// re itself is kept (it holds a host name and a *net.DNSError, never a URL).
		if re.NotFound() {
			return &FetchError{Category: tasks.CategoryDNSNotFound, Err: re}
		}
		return &FetchError{Category: tasks.CategoryNetwork, Err: re}
	case errors.As(err, &de):
		// The transport resolves only the proxy gateway's name: whatever the answer, it is
		// not the job's fault, so even NXDOMAIN is retryable here (a wrong gateway is a
		// configuration incident for the operator, not a terminal failure of every job).
		return &FetchError{Category: tasks.CategoryNetwork, Err: scrub(err)}
	case errors.Is(err, context.Canceled):
		return &FetchError{Category: tasks.CategoryInterrupted, Err: scrub(err)}
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, os.ErrDeadlineExceeded), isTimeout(err):
		return &FetchError{Category: tasks.CategoryTimeout, Err: scrub(err)}
	case errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF), errors.Is(err, syscall.ECONNRESET),
		errors.Is(err, syscall.EPIPE), errors.Is(err, syscall.ECONNABORTED):
		return &FetchError{Category: tasks.CategorySessionLost, Err: scrub(err)}
	case errors.Is(err, syscall.ECONNREFUSED):
		// The gateway itself is unreachable: no exit at all.
		return &FetchError{Category: tasks.CategoryExitUnavailable, Err: scrub(err)}
	}
	return &FetchError{Category: tasks.CategoryInternal, Err: scrub(err)}
}

// proxyDNSCategory reads an RFC 9209 Proxy-Status header for the proxy's own DNS failure
// on the destination's name: error=dns_error with rcode NXDOMAIN is dns_not_found, other
// dns_error and dns_timeout are network. "" when the header says something else.
func proxyDNSCategory(h http.Header) tasks.Category {
	v := strings.ToLower(h.Get("Proxy-Status"))
	switch {
	case v == "":
		return ""
	case strings.Contains(v, "error=dns_error"):
		if strings.Contains(v, "rcode=nxdomain") || strings.Contains(v, `rcode="nxdomain"`) {
			return tasks.CategoryDNSNotFound
		}
		return tasks.CategoryNetwork
	case strings.Contains(v, "error=dns_timeout"):
		return tasks.CategoryNetwork
	}
	return ""
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// scrub keeps an error's text but drops its chain: wrapped values (URLs, requests) are not
// carried along to where they could be printed with more detail than the text shows. The
// text itself never contains credentials, since no URL or header we build carries them.
func scrub(err error) error {
	if err == nil {
		return nil
	}
	return &scrubbed{msg: err.Error(), timeout: isTimeout(err)}
}

type scrubbed struct {
	msg     string
	timeout bool
}

func (s *scrubbed) Error() string { return s.msg }

// Timeout lets callers still see a timeout as one.
func (s *scrubbed) Timeout() bool { return s.timeout }

// classifyStatus maps a destination's answer to a FetchError, or nil for success.
func classifyStatus(status int, header http.Header, now time.Time) *FetchError {
	switch {
	case status < 400:
		return nil
	case status == http.StatusTooManyRequests || status == http.StatusServiceUnavailable:
		return &FetchError{Category: tasks.CategoryThrottled, Status: status, RetryAfter: retryAfter(header.Get("Retry-After"), now)}
	case status == http.StatusNotFound || status == http.StatusGone:
		return &FetchError{Category: tasks.CategoryNotFound, Status: status}
	case status >= 500:
		return &FetchError{Category: tasks.CategoryDestinationError, Status: status}
	}
	return &FetchError{Category: tasks.CategoryBlocked, Status: status}
}

// maxRetryAfter caps what a destination can ask for.
const maxRetryAfter = 24 * time.Hour

// retryAfter parses Retry-After: delay-seconds or an HTTP date.
func retryAfter(v string, now time.Time) time.Duration {
	if v == "" {
		return 0
	}
	if secs, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64); err == nil {
		switch {
		case secs < 0:
			return 0
		case secs > int64(maxRetryAfter/time.Second): // also keeps the multiplication below from overflowing
			return maxRetryAfter
		}
		return time.Duration(secs) * time.Second
	}
	if t, err := http.ParseTime(v); err == nil {
		return max(0, min(t.Sub(now), maxRetryAfter))
	}
	return 0
}
