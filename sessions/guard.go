package sessions

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"

	whatwg "github.com/nlnwa/whatwg-url/url"
)

// ErrForbiddenAddress: a URL's host is, or resolves to, an address a scraper must not
// reach (loopback, private, link-local, CGNAT, cloud metadata, multicast, reserved).
var ErrForbiddenAddress = errors.New("sessions: forbidden destination address")

// forbidden are the ranges the guard refuses, beyond what netip's predicates cover.
var forbidden = []netip.Prefix{
	netip.MustParsePrefix("0.0.0.0/8"),       // "this network"
	netip.MustParsePrefix("100.64.0.0/10"),   // CGNAT (also Alibaba metadata 100.100.100.200)
	netip.MustParsePrefix("192.0.0.0/24"),    // IETF protocol assignments
	netip.MustParsePrefix("192.0.2.0/24"),    // TEST-NET-1
	netip.MustParsePrefix("198.18.0.0/15"),   // benchmarking
	netip.MustParsePrefix("198.51.100.0/24"), // TEST-NET-2
	netip.MustParsePrefix("203.0.113.0/24"),  // TEST-NET-3
	netip.MustParsePrefix("240.0.0.0/4"),     // reserved, broadcast
	netip.MustParsePrefix("64:ff9b:1::/48"),  // local-use NAT64
	netip.MustParsePrefix("100::/64"),        // discard-only
	netip.MustParsePrefix("2001:db8::/32"),   // documentation
	netip.MustParsePrefix("fec0::/10"),       // deprecated site-local
}

// Resolver resolves host names; *net.Resolver implements it.
type Resolver interface {
	LookupNetIP(ctx context.Context, network, host string) ([]netip.Addr, error)
}

// Guard refuses job URLs whose host is, or resolves to, a forbidden address. It resolves
// names itself: behind a residential proxy the exit would resolve them inside someone's
// home network, where "router.local" or a rebinding name reaches a private device.
// The zero value refuses every forbidden range and uses net.DefaultResolver.
//
// Limit: the proxy resolves the name again; a name that answers differently the second
// time (DNS rebinding) is out of the guard's reach.
type Guard struct {
	// Allow lists ranges that are allowed even though forbidden (tests allow loopback).
	Allow []netip.Prefix
	// Resolver resolves host names. Defaults to net.DefaultResolver.
	Resolver Resolver
}

// Check parses rawURL the way browsers do (so decimal, octal, hex and shortened IPv4
// forms become dotted quads), then refuses it if its host is a forbidden address or a
// name any of whose addresses is forbidden.
func (g *Guard) Check(ctx context.Context, rawURL string) error {
	u, err := whatwg.Parse(rawURL)
	if err != nil {
		return fmt.Errorf("%w: unparsable URL", ErrForbiddenAddress)
	}
	host := u.Hostname()
	if host == "" {
		return fmt.Errorf("%w: URL has no host", ErrForbiddenAddress)
	}
	if addr, err := netip.ParseAddr(strings.Trim(host, "[]")); err == nil {
		return g.checkAddr(host, addr)
	}
	resolver := g.Resolver
	if resolver == nil {
		resolver = net.DefaultResolver
	}
	addrs, err := resolver.LookupNetIP(ctx, "ip", strings.TrimSuffix(host, "."))
	if err != nil {
		return fmt.Errorf("sessions: resolve %q: %w", host, err)
	}
	if len(addrs) == 0 {
		return fmt.Errorf("sessions: resolve %q: no addresses", host)
	}
	for _, a := range addrs {
		if err := g.checkAddr(host, a); err != nil {
			return err
		}
	}
	return nil
}

func (g *Guard) checkAddr(host string, addr netip.Addr) error {
	addr = addr.Unmap() // ::ffff:127.0.0.1 is 127.0.0.1
	// Addresses embedded in IPv6 transition prefixes reach the embedded IPv4 host.
	if addr.Is6() {
		b := addr.As16()
		switch {
		case netip.MustParsePrefix("64:ff9b::/96").Contains(addr): // NAT64
			addr = netip.AddrFrom4([4]byte{b[12], b[13], b[14], b[15]})
		case netip.MustParsePrefix("2002::/16").Contains(addr): // 6to4
			addr = netip.AddrFrom4([4]byte{b[2], b[3], b[4], b[5]})
		case netip.MustParsePrefix("::/96").Contains(addr) && !addr.IsUnspecified() && !addr.IsLoopback(): // IPv4-compatible
			addr = netip.AddrFrom4([4]byte{b[12], b[13], b[14], b[15]})
		}
	}
	for _, p := range g.Allow {
		if p.Contains(addr) {
			return nil
		}
	}
	reason := ""
	switch {
	case addr.IsLoopback():
		reason = "loopback"
	case addr.IsPrivate():
		reason = "private"
	case addr.IsLinkLocalUnicast():
		reason = "link-local (cloud metadata lives here)"
	case addr.IsMulticast(), addr.IsLinkLocalMulticast(), addr.IsInterfaceLocalMulticast():
		reason = "multicast"
	case addr.IsUnspecified():
		reason = "unspecified"
	default:
		for _, p := range forbidden {
			if p.Contains(addr) {
				reason = "reserved range " + p.String()
				break
			}
		}
	}
	if reason == "" {
		return nil
	}
	return fmt.Errorf("%w: %q is %s (%s)", ErrForbiddenAddress, host, addr, reason)
}
