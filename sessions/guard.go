package sessions

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"

	whatwg "github.com/nlnwa/whatwg-url/url"

	"github.com/idemscrape/idemscrape/tasks"
)

// ErrForbiddenAddress: a URL's host is, or resolves to, an address a scraper must not
// reach (loopback, private, link-local, CGNAT, cloud metadata, multicast, reserved), or
// its port is not in the destination policy's allow-list.
var ErrForbiddenAddress = errors.New("sessions: forbidden destination address")

// strictPolicy is what a Guard without a Policy applies.
var strictPolicy = tasks.StrictDestinationPolicy()

// Resolver resolves host names; *net.Resolver implements it.
type Resolver interface {
	LookupNetIP(ctx context.Context, network, host string) ([]netip.Addr, error)
}

// Guard refuses job URLs that the destination policy refuses: a port outside the
// allow-list, a host that is a forbidden address in any spelling, localhost, or a name any
// of whose addresses is forbidden. It resolves names itself: behind a residential proxy
// the exit would resolve them inside someone's home network, where "router.local" or a
// rebinding name reaches a private device. The collector runs it on every hop, redirects
// and robots.txt included.
//
// The zero value applies the strict tasks.DestinationPolicy and uses net.DefaultResolver.
// Build it with NewGuard from the same policy value the Enqueuer uses.
//
// Limit: the proxy resolves the name again; a name that answers differently the second
// time (DNS rebinding) is out of the guard's reach.
type Guard struct {
	// Policy is the destination policy. Defaults to the strict tasks.DestinationPolicy.
	Policy *tasks.DestinationPolicy
	// Resolver resolves host names. Defaults to net.DefaultResolver.
	Resolver Resolver
}

// NewGuard returns a Guard that applies policy (nil: the strict default) and resolves with
// net.DefaultResolver.
func NewGuard(policy *tasks.DestinationPolicy) *Guard { return &Guard{Policy: policy} }

// LoopbackGuard is NewGuard(tasks.LoopbackPolicy()): loopback addresses and localhost on
// any port, for tests and the demo against local fakes.
func LoopbackGuard() *Guard { return NewGuard(tasks.LoopbackPolicy()) }

// ResolveError is a failed lookup of a destination's name. Its category is
// dns_not_found when the name does not exist, network otherwise (see CategoryOf).
type ResolveError struct {
	Host string
	Err  error
}

func (e *ResolveError) Error() string { return fmt.Sprintf("sessions: resolve %q: %v", e.Host, e.Err) }

func (e *ResolveError) Unwrap() error { return e.Err }

// NotFound reports whether the name does not exist (NXDOMAIN).
func (e *ResolveError) NotFound() bool {
	var de *net.DNSError
	return errors.As(e.Err, &de) && de.IsNotFound
}

// Check parses rawURL the way browsers do (so decimal, octal, hex and shortened IPv4
// forms become dotted quads) and applies the policy: port, literal address and localhost
// first, then every address of a name. A refusal wraps ErrForbiddenAddress; a failed
// lookup is a *ResolveError.
func (g *Guard) Check(ctx context.Context, rawURL string) error {
	policy := g.Policy
	if policy == nil {
		policy = strictPolicy
	}
	u, err := whatwg.Parse(rawURL)
	if err != nil {
		return fmt.Errorf("%w: unparsable URL", ErrForbiddenAddress)
	}
	host := u.Hostname()
	if host == "" {
		return fmt.Errorf("%w: URL has no host", ErrForbiddenAddress)
	}
	if err := policy.CheckURL(rawURL); err != nil {
		var fe *tasks.FieldError
		if errors.As(err, &fe) {
			return fmt.Errorf("%w: %q: %s", ErrForbiddenAddress, host, fe.Reason)
		}
		return fmt.Errorf("%w: %q", ErrForbiddenAddress, host)
	}
	if addr, err := netip.ParseAddr(strings.Trim(host, "[]")); err == nil {
		return g.checkAddr(policy, host, addr)
	}
	resolver := g.Resolver
	if resolver == nil {
		resolver = net.DefaultResolver
	}
	addrs, err := resolver.LookupNetIP(ctx, "ip", strings.TrimSuffix(host, "."))
	if err != nil {
		return &ResolveError{Host: host, Err: err}
	}
	if len(addrs) == 0 {
		return &ResolveError{Host: host, Err: errors.New("no addresses")}
	}
	for _, a := range addrs {
		if err := g.checkAddr(policy, host, a); err != nil {
			return err
		}
	}
	return nil
}

func (g *Guard) checkAddr(policy *tasks.DestinationPolicy, host string, addr netip.Addr) error {
	reason := policy.ForbiddenReason(addr)
	if reason == "" {
		return nil
	}
	return fmt.Errorf("%w: %q is %s (%s)", ErrForbiddenAddress, host, tasks.EmbeddedAddr(addr), reason)
}
