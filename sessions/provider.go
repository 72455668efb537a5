package sessions

import (
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/idemscrape/idemscrape/internal/secretenv"
)

// credentials returns proxy secrets. It is a closure on purpose: fmt prints a func as an
// address under every verb (even through reflection on unexported fields, where Format
// methods are not called) and encoding/json skips it, so no printed form of a struct that
// holds one can reveal what it captured.
type credentials func() (user, pass string)

func newCredentials(user, pass string) credentials {
	return func() (string, string) { return user, pass }
}

// redacted is what every printable form of a secret shows.
const redacted = "[REDACTED]"

// Provider builds sticky-session credentials for one residential proxy account.
//
// The username and password templates may use these placeholders:
//
//	{user} {pass}   the account's user / password (or customer id, package id)
//	{country}       requested country, lower case ("us"); {COUNTRY} upper case ("US")
//	{session}       the session id (8 characters [a-z0-9])
//	{minutes} {seconds} {lifetime}  session lifetime: whole minutes, whole seconds,
//	                and "<n><unit>" with the largest exact unit of s, m, h, d ("30m").
//	                Each is rounded UP to its unit (90 s is 2 minutes), so the provider
//	                keeps the exit at least as long as our session lasts; minutes are
//	                capped at MaxProviderMinutes.
//
// A part in square brackets is dropped when a placeholder inside it is empty, e.g.
// "[-country-{country}]" for a session without a requested country.
//
// Credentials live in memory only. Provider never prints them: String, GoString, Format,
// LogValue and MarshalJSON all redact.
type Provider struct {
	name        string
	gateway     string // host:port
	userTmpl    string
	passTmpl    string
	user, pass  template // userTmpl and passTmpl, parsed once
	maxLifetime time.Duration
	exitHeader  string // response header naming the exit ("" = the provider sends none)
	price       Price  // what its traffic costs (WithPrice; zero: no price)
	tier        Tier   // the exits it sells (WithTier; "": residential)
	creds       credentials
	cuts        *cutStats // how often a cut left the exit alive (resume.go); shared by copies
}

// Provider defaults and limits.
const (
	// DefaultSessionLifetime is the sticky-session lifetime when none is asked for.
	DefaultSessionLifetime = 10 * time.Minute
	// MaxStickyLifetime is the longest sticky session idemscrape asks any provider for.
	MaxStickyLifetime = 60 * time.Minute
	// MaxProviderMinutes is the largest minute count the minute-based formats accept
	// (Oxylabs sesstime, Decodo sessionduration: 1440).
	MaxProviderMinutes = 1440
)

var (
	templateVar   = regexp.MustCompile(`\{(user|pass|country|COUNTRY|session|minutes|seconds|lifetime)\}`)
	anyBraces     = regexp.MustCompile(`\{[^}]*\}`)
	optionalGroup = regexp.MustCompile(`\[([^\[\]]*)\]`)
	safeAccount   = regexp.MustCompile(`^[A-Za-z0-9_.+]{1,128}$`)
)

// NewProvider returns a provider with explicit templates (see Provider). gateway is the
// proxy's host:port; maxLifetime caps session lifetimes (0 means MaxStickyLifetime).
func NewProvider(name, gateway, userTemplate, passTemplate, user, pass string, maxLifetime time.Duration) (*Provider, error) {
	if name == "" {
		return nil, errors.New("sessions: provider name is empty")
	}
	if _, port, err := net.SplitHostPort(gateway); err != nil || port == "" || strings.ContainsAny(gateway, "@/") {
		return nil, fmt.Errorf("sessions: provider %s: gateway must be host:port without credentials", name)
	}
	for field, tmpl := range map[string]string{"username template": userTemplate, "password template": passTemplate} {
		if tmpl == "" {
			return nil, fmt.Errorf("sessions: provider %s: %s is empty", name, field)
		}
		for _, v := range anyBraces.FindAllString(tmpl, -1) {
			if !templateVar.MatchString(v) {
				return nil, fmt.Errorf("sessions: provider %s: %s has unknown placeholder %s", name, field, v)
			}
		}
	}
	if user == "" || pass == "" {
		return nil, fmt.Errorf("sessions: provider %s: user and password are required", name)
	}
	if strings.ContainsAny(user+pass, ":\r\n\x00") {
		return nil, fmt.Errorf("sessions: provider %s: user or password contains ':' or a control character", name)
	}
	if maxLifetime <= 0 || maxLifetime > MaxStickyLifetime {
		maxLifetime = MaxStickyLifetime
	}
	return &Provider{
		name: name, gateway: gateway, userTmpl: userTemplate, passTmpl: passTemplate,
		user: parseTemplate(userTemplate), pass: parseTemplate(passTemplate),
		maxLifetime: maxLifetime, creds: newCredentials(user, pass), cuts: &cutStats{},
	}, nil
}

// The documented formats of the presets (see FACTS.md in the design notes). Gateways are
// the providers' public endpoints; WithGateway points a preset elsewhere (tests, regions).
const (
	brightDataGateway = "brd.superproxy.io:33335"
	oxylabsGateway    = "pr.oxylabs.io:7777"
	decodoGateway     = "gate.decodo.com:7000"
	iproyalGateway    = "geo.iproyal.com:12321"
	soaxGateway       = "proxy.soax.com:5000"
)

// BrightData: username brd-customer-<ID>-zone-<ZONE>[-country-us]-session-<id>.
func BrightData(customerID, zone, password string) (*Provider, error) {
	if !safeAccount.MatchString(customerID) || !safeAccount.MatchString(zone) {
		return nil, errors.New("sessions: brightdata: customer id and zone must be [A-Za-z0-9_.+]")
	}
	return NewProvider("brightdata", brightDataGateway,
		"brd-customer-{user}-zone-"+zone+"[-country-{country}]-session-{session}", "{pass}",
		customerID, password, 0)
}

// Oxylabs: username customer-<USER>[-cc-US]-sessid-<id>-sesstime-<minutes> (≤ 1440).
func Oxylabs(user, password string) (*Provider, error) {
	return NewProvider("oxylabs", oxylabsGateway,
		"customer-{user}[-cc-{COUNTRY}]-sessid-{session}-sesstime-{minutes}", "{pass}", user, password, 0)
}

// Decodo: username user-<USER>[-country-us]-session-<id>-sessionduration-<minutes> (1–1440).
func Decodo(user, password string) (*Provider, error) {
	return NewProvider("decodo", decodoGateway,
		"user-{user}[-country-{country}]-session-{session}-sessionduration-{minutes}", "{pass}", user, password, 0)
}

// IPRoyal: plain username; password <PASS>[_country-us]_session-<id>_lifetime-<n><unit>.
func IPRoyal(user, password string) (*Provider, error) {
	return NewProvider("iproyal", iproyalGateway,
		"{user}", "{pass}[_country-{country}]_session-{session}_lifetime-{lifetime}", user, password, 0)
}

// SOAX: username package-<ID>[-country-us]-sessionid-<id>-sessionlength-<seconds>.
func SOAX(packageID, password string) (*Provider, error) {
	return NewProvider("soax", soaxGateway,
		"package-{user}[-country-{country}]-sessionid-{session}-sessionlength-{seconds}", "{pass}", packageID, password, 0)
}

// WithGateway returns a copy of p that connects to gateway (host:port) instead.
func (p *Provider) WithGateway(gateway string) (*Provider, error) {
	user, pass := p.creds()
	np, err := NewProvider(p.name, gateway, p.userTmpl, p.passTmpl, user, pass, p.maxLifetime)
	if err != nil {
		return nil, err
	}
	np.exitHeader, np.price, np.tier = p.exitHeader, p.price, p.tier
	return np, nil
}

// WithExitHeader returns a copy of p whose sessions verify their exit: the first response
// of a session that carries header name fixes the session's exit, and a later response
// naming another exit ends the session as session_lost (ErrExitChanged), so the unit
// replays on another session instead of mixing two exits.
//
// Exit integrity needs a per-response exit signal. None of the presets sets one: their
// documented gateways do not name the exit on every proxied response (some offer a
// separate lookup endpoint, which would cost a request per step). Without it a silent
// re-assignment of the exit goes unnoticed by idemscrape, and attempt evidence says
// "exit not verified". Set it where the provider, or the destination (as the test fake
// site's X-Exit), names the exit in a response header.
func (p *Provider) WithExitHeader(name string) (*Provider, error) {
	name = strings.TrimSpace(name)
	if name == "" || strings.ContainsAny(name, " :\r\n\t") {
		return nil, fmt.Errorf("sessions: provider %s: exit header %q is not a header name", p.name, name)
	}
	np := *p
	np.exitHeader = http.CanonicalHeaderKey(name)
	return &np, nil
}

// ExitHeader is the response header that names a session's exit, "" if the provider has
// none (see WithExitHeader).
func (p *Provider) ExitHeader() string { return p.exitHeader }

// Environment variables read by ProviderFromEnv.
const (
	EnvProvider = "IDEMSCRAPE_PROXY_PROVIDER" // brightdata | oxylabs | decodo | iproyal | soax
	EnvUser     = "IDEMSCRAPE_PROXY_USER"     // account user, customer id or package id
	EnvPassword = "IDEMSCRAPE_PROXY_PASSWORD" // never logged; or a file named by IDEMSCRAPE_PROXY_PASSWORD_FILE
	EnvZone     = "IDEMSCRAPE_PROXY_ZONE"     // brightdata only
	EnvGateway  = "IDEMSCRAPE_PROXY_GATEWAY"  // optional host:port override
	// and EnvPrice, EnvPriceCountries (price.go): what the traffic costs, optional
)

// ProviderFromEnv builds a preset from the environment (see the Env* constants). Errors
// name the variable, never its value.
func ProviderFromEnv() (*Provider, error) { return providerFromEnv("") }

// EnvExitHeader optionally names the response header that names a session's exit
// (Provider.WithExitHeader): with it every response is checked against the session's first
// exit, and after a dropped connection a unit continues on its session once the exit is
// proven unchanged instead of replaying from its first step.
const EnvExitHeader = "IDEMSCRAPE_PROXY_EXIT_HEADER"

// EnvName optionally names a provider (ProvidersFromEnv: two accounts of one preset need
// different names, which label metrics and logs).
const EnvName = "IDEMSCRAPE_PROXY_NAME"

// MaxEnvProviders is how many accounts ProvidersFromEnv reads (the first, then _2 … _9).
const MaxEnvProviders = 9

// ProvidersFromEnv builds the worker's providers in failover order: the first from the
// Env* variables, then one per suffix _2, _3, … (IDEMSCRAPE_PROXY_PROVIDER_2,
// IDEMSCRAPE_PROXY_USER_2, IDEMSCRAPE_PROXY_PASSWORD_2 or its _FILE, _ZONE_2, _GATEWAY_2,
// _PRICE_2, _PRICE_COUNTRIES_2, _TIER_2, _NAME_2) for as long as IDEMSCRAPE_PROXY_PROVIDER_<n> is
// set. Names must differ (IDEMSCRAPE_PROXY_NAME_<n> renames one). Errors name the
// variable, never its value.
func ProvidersFromEnv() ([]*Provider, error) {
	first, err := providerFromEnv("")
	if err != nil {
		return nil, err
	}
	out := []*Provider{first}
	seen := map[string]string{first.Name(): EnvProvider}
	last := 1 // the accounts are 1.._last_, without gaps
	for n := 2; n <= MaxEnvProviders; n++ {
		suffix := "_" + strconv.Itoa(n)
		set := os.Getenv(EnvProvider+suffix) != ""
		for _, v := range []string{EnvUser + suffix, EnvPassword + suffix, EnvPassword + suffix + "_FILE", EnvGateway + suffix,
			EnvZone + suffix, EnvName + suffix, EnvPrice + suffix, EnvPriceCountries + suffix, EnvTier + suffix, EnvExitHeader + suffix} {
			if !set && os.Getenv(v) != "" {
				return nil, fmt.Errorf("sessions: %s is set but %s is not", v, EnvProvider+suffix)
			}
		}
		if !set {
			continue
		}
		if n != last+1 {
			return nil, fmt.Errorf("sessions: %s is set but %s is not: number the accounts without gaps", EnvProvider+suffix, EnvProvider+"_"+strconv.Itoa(last+1))
		}
		last = n
		p, err := providerFromEnv(suffix)
		if err != nil {
			return nil, err
		}
		if other, dup := seen[p.Name()]; dup {
			return nil, fmt.Errorf("sessions: %s and %s both make a provider named %s: set %s to tell them apart", other, EnvProvider+suffix, p.Name(), EnvName+suffix)
		}
		seen[p.Name()] = EnvProvider + suffix
		out = append(out, p)
	}
	if os.Getenv(EnvProvider+"_"+strconv.Itoa(MaxEnvProviders+1)) != "" {
		return nil, fmt.Errorf("sessions: %s is set: at most %d accounts are read", EnvProvider+"_"+strconv.Itoa(MaxEnvProviders+1), MaxEnvProviders)
	}
	return out, nil
}

// providerFromEnv is ProviderFromEnv for the variables ending in suffix ("" or "_<n>").
func providerFromEnv(suffix string) (*Provider, error) {
	env := func(name string) string { return os.Getenv(name + suffix) }
	name, user := env(EnvProvider), env(EnvUser)
	pass, _, err := secretenv.Lookup(EnvPassword + suffix)
	if err != nil {
		return nil, fmt.Errorf("sessions: %w", err)
	}
	if user == "" || pass == "" {
		return nil, fmt.Errorf("sessions: %s and %s (or %s_FILE) must be set", EnvUser+suffix, EnvPassword+suffix, EnvPassword+suffix)
	}
	var p *Provider
	switch name {
	case "brightdata":
		p, err = BrightData(user, env(EnvZone), pass)
	case "oxylabs":
		p, err = Oxylabs(user, pass)
	case "decodo":
		p, err = Decodo(user, pass)
	case "iproyal":
		p, err = IPRoyal(user, pass)
	case "soax":
		p, err = SOAX(user, pass)
	default:
		return nil, fmt.Errorf("sessions: %s must be one of brightdata, oxylabs, decodo, iproyal, soax", EnvProvider+suffix)
	}
	if err != nil {
		return nil, err
	}
	if gw := env(EnvGateway); gw != "" {
		if p, err = p.WithGateway(gw); err != nil {
			return nil, fmt.Errorf("sessions: %s: %s", EnvGateway+suffix, strings.TrimPrefix(err.Error(), "sessions: "))
		}
	}
	if n := env(EnvName); n != "" {
		if p, err = p.WithName(n); err != nil {
			return nil, fmt.Errorf("sessions: %s: %s", EnvName+suffix, strings.TrimPrefix(err.Error(), "sessions: "))
		}
	}
	if h := env(EnvExitHeader); h != "" {
		if p, err = p.WithExitHeader(h); err != nil {
			return nil, fmt.Errorf("sessions: %s: %s", EnvExitHeader+suffix, strings.TrimPrefix(err.Error(), "sessions: "))
		}
	}
	if t := env(EnvTier); t != "" {
		tier, err := ParseTier(t)
		if err != nil {
			return nil, fmt.Errorf("sessions: %s: %s", EnvTier+suffix, strings.TrimPrefix(err.Error(), "sessions: "))
		}
		p.tier = tier // p is this function's own copy
	}
	price, err := priceFromEnv(env, suffix)
	if err != nil {
		return nil, err
	}
	return p.WithPrice(price)
}

var providerName = regexp.MustCompile(`^[a-z0-9][a-z0-9_.-]{0,62}$`)

// WithName returns a copy of p named name (lower-case letters, digits, '_', '.', '-'):
// two accounts of one preset need different names.
func (p *Provider) WithName(name string) (*Provider, error) {
	if !providerName.MatchString(name) {
		return nil, fmt.Errorf("sessions: provider name %q: lower-case letters, digits, '_', '.', '-', at most 63", name)
	}
	np := *p
	np.name = name
	return &np, nil
}

// Name is the provider's name, e.g. "oxylabs".
func (p *Provider) Name() string { return p.name }

// Gateway is the proxy endpoint, host:port. It carries no credentials.
func (p *Provider) Gateway() string { return p.gateway }

// MaxLifetime is the longest session lifetime this provider is asked for.
func (p *Provider) MaxLifetime() time.Duration { return p.maxLifetime }

// credentialsFor fills the templates for one session.
func (p *Provider) credentialsFor(country, sessionID string, lifetime time.Duration) (user, pass string) {
	accountUser, accountPass := p.creds()
	var vars templateVars
	vars[varUser], vars[varPass] = accountUser, accountPass
	vars[varCountry], vars[varCOUNTRY] = strings.ToLower(country), strings.ToUpper(country)
	vars[varSession] = sessionID
	vars[varMinutes] = strconv.FormatInt(min(ceilUnits(lifetime, time.Minute), MaxProviderMinutes), 10)
	vars[varSeconds] = strconv.FormatInt(ceilUnits(lifetime, time.Second), 10)
	vars[varLifetime] = lifetimeString(lifetime)
	return p.user.fill(&vars), p.pass.fill(&vars)
}

// The placeholders of a template, in templateVar's order.
const (
	varUser = iota
	varPass
	varCountry
	varCOUNTRY
	varSession
	varMinutes
	varSeconds
	varLifetime
	numVars
)

var varIndex = map[string]int{"user": varUser, "pass": varPass, "country": varCountry, "COUNTRY": varCOUNTRY,
	"session": varSession, "minutes": varMinutes, "seconds": varSeconds, "lifetime": varLifetime}

// templateVars are one session's values, by placeholder.
type templateVars [numVars]string

// template is a username or password template parsed once (NewProvider), so that filling
// it for a session is a walk over its parts: with the two regular expressions run on every
// session, template filling was 4 % of a worker's CPU (protocol-only profile, c = 20). It
// gives what the expressions gave: each optional part ("[...]", innermost brackets) is
// dropped when a placeholder inside it is empty, else kept without its brackets; then every
// placeholder is replaced by its value (values are not scanned again).
type template []templatePart

// templatePart is a literal text (v < 0) or a placeholder (v = its index), optional when
// it lies inside group > 0 (the parts of one "[...]" share its number).
type templatePart struct {
	lit   string
	v     int
	group int
}

func parseTemplate(tmpl string) template {
	var out template
	split := func(s string, group int) {
		last := 0
		for _, m := range templateVar.FindAllStringSubmatchIndex(s, -1) {
			if m[0] > last {
				out = append(out, templatePart{lit: s[last:m[0]], v: -1, group: group})
			}
			out = append(out, templatePart{v: varIndex[s[m[2]:m[3]]], group: group})
			last = m[1]
		}
		if last < len(s) || (group > 0 && last == 0) {
			// An empty group is kept as a part, so that it renders as "" like the others.
			out = append(out, templatePart{lit: s[last:], v: -1, group: group})
		}
	}
	last, group := 0, 0
	for _, m := range optionalGroup.FindAllStringSubmatchIndex(tmpl, -1) {
		split(tmpl[last:m[0]], 0)
		group++
		split(tmpl[m[2]:m[3]], group)
		last = m[1]
	}
	split(tmpl[last:], 0)
	return out
}

// fill renders the template with vars.
func (t template) fill(vars *templateVars) string {
	n := 0
	for _, p := range t {
		n += len(p.lit)
		if p.v >= 0 {
			n += len(vars[p.v])
		}
	}
	var b strings.Builder
	b.Grow(n)
	for i := 0; i < len(t); {
		if g := t[i].group; g > 0 {
			j := i
			keep := true
			for ; j < len(t) && t[j].group == g; j++ {
				if t[j].v >= 0 && vars[t[j].v] == "" {
					keep = false
				}
			}
			if keep {
				t[i:j].write(&b, vars)
			}
			i = j
			continue
		}
		t[i:i+1].write(&b, vars)
		i++
	}
	return b.String()
}

func (t template) write(b *strings.Builder, vars *templateVars) {
	for _, p := range t {
		if p.v >= 0 {
			b.WriteString(vars[p.v])
		} else {
			b.WriteString(p.lit)
		}
	}
}

// ceilUnits is d in whole units, rounded up, at least 1: the provider's session must
// outlive ours, never end before it.
func ceilUnits(d, unit time.Duration) int64 {
	return max(1, int64((d+unit-1)/unit))
}

// lifetimeString renders d, rounded up to whole seconds, with the largest unit that
// divides it exactly: 30m, 2h, 1d, 90s.
func lifetimeString(d time.Duration) string {
	s := ceilUnits(d, time.Second)
	switch {
	case s%86400 == 0:
		return strconv.FormatInt(s/86400, 10) + "d"
	case s%3600 == 0:
		return strconv.FormatInt(s/3600, 10) + "h"
	case s%60 == 0:
		return strconv.FormatInt(s/60, 10) + "m"
	}
	return strconv.FormatInt(s, 10) + "s"
}

// basicAuth is the Proxy-Authorization value for user and pass.
func basicAuth(user, pass string) string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+pass))
}

// String implements fmt.Stringer without credentials.
func (p Provider) String() string { return fmt.Sprintf("sessions.Provider{%s %s}", p.name, p.gateway) }

// GoString implements fmt.GoStringer without credentials.
func (p Provider) GoString() string { return p.String() }

// Format implements fmt.Formatter so that every verb, %+v and %#v included, redacts.
func (p Provider) Format(f fmt.State, _ rune) { _, _ = io.WriteString(f, p.String()) }

// LogValue implements slog.LogValuer without credentials.
func (p Provider) LogValue() slog.Value {
	return slog.GroupValue(slog.String("name", p.name), slog.String("gateway", p.gateway))
}

// MarshalJSON implements json.Marshaler without credentials.
func (p Provider) MarshalJSON() ([]byte, error) {
	return fmt.Appendf(nil, `{"name":%q,"gateway":%q,"credentials":%q}`, p.name, p.gateway, redacted), nil
}
