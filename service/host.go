package service

import (
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// maxHostEcho is how much of a refused Host header the 421 answer repeats.
const maxHostEcho = 200

// hostEntry is one accepted Host: a name (lower case, no trailing dot; an IP in its
// canonical form) and a port ("" for any port).
type hostEntry struct{ name, port string }

// hostGuard refuses requests whose Host header names neither the listen address, nor a
// loopback name, nor an entry of Config.AllowedHosts: a page of another site whose name
// was made to resolve to this server (DNS rebinding) sends its own name as Host, and is
// refused before it reaches asynqmon or the job pages.
type hostGuard struct {
	allowed []hostEntry
	listen  atomic.Pointer[hostEntry] // the address listened on, after Start
	refused prometheus.Counter
}

func newHostGuard(cfg Config) (*hostGuard, error) {
	g := &hostGuard{refused: prometheus.NewCounter(prometheus.CounterOpts{
		Name: "idemscrape_http_host_refused_total",
		Help: "HTTP requests refused (421) because their Host header is neither the listen address, a loopback name nor one of Config.AllowedHosts (-http-allowed-hosts).",
	})}
	for _, h := range cfg.AllowedHosts {
		e, err := parseAllowedHost(h)
		if err != nil {
			return nil, err
		}
		g.allowed = append(g.allowed, e)
	}
	if name, port, ok := splitHost(cfg.HTTPAddr); ok {
		g.listen.Store(&hostEntry{name: name, port: port})
	}
	return g, nil
}

// listening records the address the listener got (the port picked for ":0").
func (g *hostGuard) listening(addr net.Addr) {
	if name, port, ok := splitHost(addr.String()); ok {
		g.listen.Store(&hostEntry{name: name, port: port})
	}
}

// CheckAllowedHosts checks the entries of Config.AllowedHosts: each a host name or IP
// address, optionally with a port (host:port, [IPv6]:port), without scheme, path or
// wildcard.
func CheckAllowedHosts(hosts []string) error {
	for _, h := range hosts {
		if _, err := parseAllowedHost(h); err != nil {
			return err
		}
	}
	return nil
}

func parseAllowedHost(h string) (hostEntry, error) {
	bad := func(why string) (hostEntry, error) {
		return hostEntry{}, fmt.Errorf("service: Config.AllowedHosts entry %q: %s", h, why)
	}
	switch {
	case strings.TrimSpace(h) == "":
		return bad("empty")
	case strings.Contains(h, "://") || strings.ContainsAny(h, "/?#@"):
		return bad("want a host name or IP, optionally :port, without scheme or path")
	case strings.ContainsAny(h, "* \t\r\n,"):
		return bad("want one host name or IP, no wildcard or space")
	}
	name, port, ok := splitHost(h)
	if !ok || name == "" {
		return bad("want host or host:port")
	}
	if port != "" {
		if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
			return bad("the port must be a number in 1..65535")
		}
	}
	return hostEntry{name: name, port: port}, nil
}

// splitHost splits a Host header or an address into its name and port ("" without one).
// The name is lower case without a trailing dot, an IP address in its canonical form
// (brackets of IPv6 removed). ok is false for what is no host at all.
func splitHost(h string) (name, port string, ok bool) {
	name = h
	if n, p, err := net.SplitHostPort(h); err == nil {
		name, port = n, p
	} else if strings.HasPrefix(h, "[") && strings.HasSuffix(h, "]") {
		name = h[1 : len(h)-1]
	} else if strings.Count(h, ":") == 1 {
		return "", "", false // "host:" and the like
	}
	name = strings.TrimSuffix(strings.ToLower(name), ".")
	if ip := net.ParseIP(name); ip != nil {
		name = ip.String()
	} else if strings.ContainsAny(name, "[]") {
		return "", "", false
	}
	return name, port, true
}

// allows reports whether a request's Host is accepted.
func (g *hostGuard) allows(host string) bool {
	name, port, ok := splitHost(host)
	if !ok || name == "" {
		return false
	}
	if name == "localhost" {
		return true
	}
	if ip := net.ParseIP(name); ip != nil && ip.IsLoopback() {
		return true
	}
	if l := g.listen.Load(); l != nil && name == l.name && (port == "" || port == l.port) {
		return true
	}
	for _, e := range g.allowed {
		if name == e.name && (e.port == "" || e.port == port) {
			return true
		}
	}
	return false
}

// handler wraps next with the Host check: a refused request gets 421 Misdirected Request
// and is counted.
func (g *hostGuard) handler(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if g.allows(r.Host) {
			next.ServeHTTP(w, r)
			return
		}
		g.refused.Inc()
		host := r.Host
		if len(host) > maxHostEcho {
			host = host[:maxHostEcho] + "…"
		}
		http.Error(w, fmt.Sprintf("misdirected request: Host %q is not allowed here (allowed: the listen address, localhost, "+
			"loopback addresses and Config.AllowedHosts, -http-allowed-hosts)", host), http.StatusMisdirectedRequest)
	})
}
