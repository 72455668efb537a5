// Package sessions binds scraping work to sticky residential-proxy sessions.
//
// A Provider turns one proxy account into per-session credentials in the provider's
// documented format. A Session is one sticky exit: random id, country, creation time,
// lifetime, and the redacted endpoint (host:port). NewCollector returns a colly collector
// bound to one session — its own transport and cookie jar, a size cap that holds for
// decompressed bodies, robots.txt respected, timeouts, the SSRF guard on every request and
// redirect. A Unit is an ordered list of steps that run on one session and write to
// staging; on session loss the staging is quarantined and the whole unit replays on a new
// session, so an observation never mixes two sessions. After a cut a safe step first runs
// again on the same session, kept only when the exit is proven unchanged or the unit's
// state is portable (resume.go), so an observation never mixes two exits either.
//
// Politeness lives in package politeness; a collector applies it on every hop: with
// CollectorConfig.Robots (a politeness.RobotsCache in Redis) robots.txt is fetched once per
// host for a whole fleet, through the session that needed it, and checked on every hop;
// CollectorConfig.Limiter (a politeness.HostLimiter) paces every hop per host and hears
// every Retry-After. A request politeness refuses ends with a FetchError of the category
// politeness chose.
//
// Exit integrity is sessions' own, not politeness: with Provider.WithExitHeader a session
// learns its exit on its first response and a response from another exit ends it as
// session_lost (the provider re-assigned it silently).
//
// Credentials: the proxy password reaches the wire only as a Proxy-Authorization header
// (on CONNECT through ProxyConnectHeader, on plain-HTTP forwarding added per request). It
// is never in a URL, never in colly's request context, and every printable form of
// Provider and Session redacts it.
package sessions

import (
	"crypto/rand"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/idemscrape/idemscrape/sessions/profile"
)

// Session is one sticky residential session. Its exported fields are safe to log and
// store; the credentials are unexported and redacted in every printable form.
type Session struct {
	ID          string        // 8 characters [a-z0-9]: valid for every preset's format
	Provider    string        // provider name
	Country     string        // requested exit country, upper case ("" = any)
	Created     time.Time     // when the session was created
	MaxLifetime time.Duration // the lifetime asked of the provider; no new step after it
	Endpoint    string        // proxy gateway host:port, no credentials
	// Profile is the client the session presents for its whole life (RunConfig.Profiles):
	// the headers of every colly request and the user agent, languages and client hints of
	// every rendered page. nil: the collector's UserAgent, as configured.
	Profile *profile.Profile

	creds      credentials // user/pass as sent to the proxy for this session
	exitHeader string      // the provider's exit header, "" if none
}

const sessionIDAlphabet = "abcdefghijklmnopqrstuvwxyz0123456789"

// newSessionID returns 8 random characters of [a-z0-9] (41 bits).
func newSessionID() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	for i := range b {
		b[i] = sessionIDAlphabet[int(b[i])%len(sessionIDAlphabet)]
	}
	return string(b)
}

// NewSession starts a sticky session for country ("" = any) with the given lifetime
// (0 = DefaultSessionLifetime, capped at the provider's maximum).
func (p *Provider) NewSession(country string, lifetime time.Duration, now time.Time) (*Session, error) {
	if lifetime < 0 {
		return nil, fmt.Errorf("sessions: lifetime %v is negative", lifetime)
	}
	if lifetime == 0 {
		lifetime = DefaultSessionLifetime
	}
	lifetime = min(lifetime, p.maxLifetime)
	if country != "" && (len(country) != 2 || !isLetters(country)) {
		return nil, fmt.Errorf("sessions: country %q is not an ISO 3166-1 alpha-2 code", country)
	}
	id := newSessionID()
	user, pass := p.credentialsFor(country, id, lifetime)
	return &Session{
		ID: id, Provider: p.name, Country: toUpper(country), Created: now,
		MaxLifetime: lifetime, Endpoint: p.gateway,
		creds: newCredentials(user, pass), exitHeader: p.exitHeader,
	}, nil
}

// Expired reports whether the session is past its lifetime at now. An expired session is
// never used for a new step.
func (s *Session) Expired(now time.Time) bool { return !now.Before(s.Created.Add(s.MaxLifetime)) }

// proxyAuthorization is the header value that authenticates this session at the proxy.
func (s *Session) proxyAuthorization() string { return basicAuth(s.creds()) }

// String implements fmt.Stringer without credentials.
func (s Session) String() string {
	return fmt.Sprintf("sessions.Session{id=%s provider=%s country=%s endpoint=%s}", s.ID, s.Provider, s.Country, s.Endpoint)
}

// GoString implements fmt.GoStringer without credentials.
func (s Session) GoString() string { return s.String() }

// Format implements fmt.Formatter so that every verb redacts.
func (s Session) Format(f fmt.State, _ rune) { _, _ = io.WriteString(f, s.String()) }

// LogValue implements slog.LogValuer without credentials.
func (s Session) LogValue() slog.Value {
	return slog.GroupValue(slog.String("id", s.ID), slog.String("provider", s.Provider),
		slog.String("country", s.Country), slog.String("endpoint", s.Endpoint))
}

// MarshalJSON implements json.Marshaler without credentials.
func (s Session) MarshalJSON() ([]byte, error) {
	return fmt.Appendf(nil, `{"id":%q,"provider":%q,"country":%q,"created":%q,"max_lifetime":%q,"endpoint":%q}`,
		s.ID, s.Provider, s.Country, s.Created.Format(time.RFC3339Nano), s.MaxLifetime.String(), s.Endpoint), nil
}

func isLetters(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i] | 0x20
		if c < 'a' || c > 'z' {
			return false
		}
	}
	return true
}

func toUpper(s string) string {
	b := []byte(s)
	for i, c := range b {
		if c >= 'a' && c <= 'z' {
			b[i] = c - 0x20
		}
	}
	return string(b)
}
