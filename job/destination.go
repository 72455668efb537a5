package job

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	whatwgerrors "github.com/nlnwa/whatwg-url/errors"
	"github.com/nlnwa/whatwg-url/url"
)

// DefaultDestinationPorts are the destination ports a DestinationPolicy allows when its
// Ports list is empty: the web's usual ones.
var DefaultDestinationPorts = []uint16{80, 443, 8080, 8443}

// forbiddenPrefixes are the ranges a DestinationPolicy refuses beyond what netip's
// predicates (loopback, private, link-local, multicast, unspecified) cover.
var forbiddenPrefixes = []netip.Prefix{
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

var (
	nat64Prefix        = netip.MustParsePrefix("64:ff9b::/96")
	sixToFourPrefix    = netip.MustParsePrefix("2002::/16")
	v4CompatiblePrefix = netip.MustParsePrefix("::/96")
)

// metadataHosts are cloud metadata names that reach the instance's metadata service from
// inside a cloud network, whatever they resolve to elsewhere.
var metadataHosts = []string{"metadata.google.internal", "metadata.goog", "metadata"}

// DestinationPolicy says which destinations a job may fetch. One value serves both ends:
// the Enqueuer checks a spec's URL with CheckURL before anything is stored, and the fetch
// guard (sessions.NewGuard) checks every hop — redirects and robots.txt included — with
// CheckURL, then resolves names and checks every address with CheckAddr.
//
// The zero value is the strict policy every production binary uses: ports
// DefaultDestinationPorts; no loopback, private (RFC 1918, ULA), link-local (cloud
// metadata 169.254.169.254 lives there), unspecified, multicast, CGNAT, documentation or
// reserved address, in any spelling the WHATWG URL parser accepts (decimal
// "http://2130706433/", octal, hex, short forms, IPv4-mapped, IPv4-compatible, NAT64 and
// 6to4 IPv6); no "localhost", "*.localhost" or cloud metadata name. LoopbackPolicy is the
// one explicit relaxation, for tests and the demo.
//
// A DestinationPolicy is read-only once in use and safe for concurrent use.
type DestinationPolicy struct {
	// Ports is the allow-list of destination ports (the URL's explicit port, else its
	// scheme's default). Defaults to DefaultDestinationPorts when empty.
	Ports []uint16
	// Allow lists address ranges that are allowed although forbidden. Defaults to none.
	Allow []netip.Prefix
	// AllowLocalhost accepts the names "localhost" and "*.localhost"; their resolved
	// addresses must still pass CheckAddr (i.e. be inside Allow). Defaults to false.
	AllowLocalhost bool
	// AnyPortOnAllowed exempts from the port allow-list the URLs whose host is a literal
	// address inside Allow, or localhost when AllowLocalhost is set, so that tests reach
	// local fakes on random ports. Other hosts keep the allow-list. Defaults to false.
	AnyPortOnAllowed bool
}

// StrictDestinationPolicy returns the default policy (the zero value): see
// DestinationPolicy.
func StrictDestinationPolicy() *DestinationPolicy { return &DestinationPolicy{} }

// LoopbackPolicy returns the strict policy relaxed to loopback: 127.0.0.0/8, ::1 and
// localhost are allowed, on any port (other hosts keep the strict rules). It is the one call tests and the demo make to reach
// fakes on this machine; never use it in a deployment.
func LoopbackPolicy() *DestinationPolicy {
	return &DestinationPolicy{
		Allow:            []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("::1/128")},
		AllowLocalhost:   true,
		AnyPortOnAllowed: true,
	}
}

// Validate checks the policy: ports are 1..65535 and prefixes valid.
func (p *DestinationPolicy) Validate() error {
	for _, port := range p.Ports {
		if port == 0 {
			return fmt.Errorf("tasks: DestinationPolicy.Ports: port 0 is not a port")
		}
	}
	for i, a := range p.Allow {
		if !a.IsValid() {
			return fmt.Errorf("tasks: DestinationPolicy.Allow[%d] is not a valid prefix", i)
		}
	}
	return nil
}

// PortAllowed reports whether port is in the allow-list.
func (p *DestinationPolicy) PortAllowed(port uint16) bool {
	ports := p.Ports
	if len(ports) == 0 {
		ports = DefaultDestinationPorts
	}
	return slices.Contains(ports, port)
}

// destinationParser is a plain WHATWG parser: CheckURL must see the host exactly as a
// browser (and Go's HTTP client after WHATWG canonicalisation) would.
var destinationParser = url.NewParser()

// CheckURL refuses rawURL (an absolute http or https URL) when its port is not allowed,
// its host is a literal forbidden address in any spelling, or its host is localhost or a
// cloud metadata name. It does no I/O: names are checked by what they are, not by what
// they resolve to (the fetch guard resolves them and calls CheckAddr).
//
// The error is a *FieldError on field "URL" (errors.Is ErrInvalidSpec) whose text names
// the refused address or port but never the URL's user info, path or query.
func (p *DestinationPolicy) CheckURL(rawURL string) error {
	u, err := destinationParser.Parse(rawURL)
	if err != nil {
		if t := whatwgerrors.Type(err); t != "" {
			return fieldErr("URL", "cannot be parsed: %s", t)
		}
		return fieldErr("URL", "cannot be parsed")
	}
	scheme := u.Scheme()
	var port uint16
	switch scheme {
	case "http":
		port = 80
	case "https":
		port = 443
	default:
		return fieldErr("URL", "scheme not allowed, want http or https")
	}
	if ps := u.Port(); ps != "" {
		n, err := strconv.ParseUint(ps, 10, 16)
		if err != nil {
			return fieldErr("URL", "port is not a number in 1..65535")
		}
		port = uint16(n)
	}
	host := u.Hostname()
	if host == "" {
		return fieldErr("URL", "empty host")
	}
	if addr, err := netip.ParseAddr(strings.Trim(host, "[]")); err == nil {
		addr = addr.WithZone("")
		if p.AnyPortOnAllowed && p.allowed(EmbeddedAddr(addr)) {
			return nil
		}
		if reason := p.ForbiddenReason(addr); reason != "" {
			return fieldErr("URL", "destination %s is %s", addr, reason)
		}
		if !p.PortAllowed(port) {
			return fieldErr("URL", "destination port %d is not allowed (allowed: %s)", port, p.portList())
		}
		return nil
	}
	name := strings.TrimSuffix(strings.ToLower(host), ".")
	if name == "localhost" || strings.HasSuffix(name, ".localhost") {
		switch {
		case !p.AllowLocalhost:
			return fieldErr("URL", "destination host is localhost (loopback)")
		case p.AnyPortOnAllowed || p.PortAllowed(port):
			return nil
		}
		return fieldErr("URL", "destination port %d is not allowed (allowed: %s)", port, p.portList())
	}
	if slices.Contains(metadataHosts, name) {
		return fieldErr("URL", "destination host is a cloud metadata name")
	}
	if !p.PortAllowed(port) {
		return fieldErr("URL", "destination port %d is not allowed (allowed: %s)", port, p.portList())
	}
	return nil
}

// CheckAddr returns nil when addr (a resolved destination address) is allowed, else a
// *FieldError on field "URL" naming the address and why it is refused.
func (p *DestinationPolicy) CheckAddr(addr netip.Addr) error {
	if reason := p.ForbiddenReason(addr); reason != "" {
		return fieldErr("URL", "destination %s is %s", addr.WithZone(""), reason)
	}
	return nil
}

// ForbiddenReason returns why addr is refused ("loopback", "private", …), or "" when the
// policy allows it. IPv4-mapped, IPv4-compatible, NAT64 and 6to4 addresses are judged by
// the IPv4 address they embed.
func (p *DestinationPolicy) ForbiddenReason(addr netip.Addr) string {
	addr = EmbeddedAddr(addr.WithZone(""))
	if p.allowed(addr) {
		return ""
	}
	switch {
	case !addr.IsValid():
		return "not a valid address"
	case addr.IsLoopback():
		return "loopback"
	case addr.IsPrivate():
		return "private"
	case addr.IsLinkLocalUnicast():
		return "link-local (cloud metadata lives here)"
	case addr.IsMulticast(), addr.IsLinkLocalMulticast(), addr.IsInterfaceLocalMulticast():
		return "multicast"
	case addr.IsUnspecified():
		return "unspecified"
	}
	for _, pf := range forbiddenPrefixes {
		if pf.Contains(addr) {
			return "in reserved range " + pf.String()
		}
	}
	return ""
}

func (p *DestinationPolicy) allowed(addr netip.Addr) bool {
	for _, pf := range p.Allow {
		if pf.Contains(addr) {
			return true
		}
	}
	return false
}

func (p *DestinationPolicy) portList() string {
	ports := p.Ports
	if len(ports) == 0 {
		ports = DefaultDestinationPorts
	}
	s := make([]string, len(ports))
	for i, port := range ports {
		s[i] = strconv.Itoa(int(port))
	}
	return strings.Join(s, ", ")
}

// EmbeddedAddr returns the IPv4 address an IPv6 transition address reaches (IPv4-mapped
// ::ffff:a.b.c.d, IPv4-compatible ::a.b.c.d, NAT64 64:ff9b::/96, 6to4 2002::/16), or
// addr itself.
func EmbeddedAddr(addr netip.Addr) netip.Addr {
	addr = addr.Unmap()
	if !addr.Is6() {
		return addr
	}
	b := addr.As16()
	switch {
	case nat64Prefix.Contains(addr):
		return netip.AddrFrom4([4]byte{b[12], b[13], b[14], b[15]})
	case sixToFourPrefix.Contains(addr):
		return netip.AddrFrom4([4]byte{b[2], b[3], b[4], b[5]})
	case v4CompatiblePrefix.Contains(addr) && !addr.IsUnspecified() && !addr.IsLoopback():
		return netip.AddrFrom4([4]byte{b[12], b[13], b[14], b[15]})
	}
	return addr
}
