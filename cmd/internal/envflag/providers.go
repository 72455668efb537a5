package envflag

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"

	"github.com/idemscrape/idemscrape/internal/secretenv"
	"github.com/idemscrape/idemscrape/sessions"
)

// A providers file (the worker's -providers FILE, $IDEMSCRAPE_PROVIDERS_FILE) lists the
// proxy accounts in one reviewable place, instead of the numbered variables
// IDEMSCRAPE_PROXY_*_2 … _9 (examples/providers.yaml, docs/DEPLOY.md):
//
//	providers:
//	  - name: oxylabs-us            # optional: the format's name; unique
//	    format: oxylabs             # brightdata | oxylabs | decodo | iproyal | soax
//	    gateway: pr.oxylabs.io:7777 # optional host:port (default: the format's)
//	    user_env: OXYLABS_USER      # or user: <account id>, or user_file: <path>
//	    password_file: /run/secrets/oxylabs  # or password_env: <variable name>
//	    tier: residential           # datacenter | residential | mobile (default residential)
//	    price: 8.40 USD/GB          # optional
//	    price_countries: {DE: 9.10} # optional, needs price; same currency
//	    priority: 1                 # optional: lower first; on every provider or none
//
// Secrets are never in the file: a password only through password_env (the name of an
// environment variable) or password_file (a file holding it, as Docker and Kubernetes
// mount secrets; relative to the providers file). Every error names the file, the line,
// the provider and the field, never a user or password value. Each provider is the one
// the equivalent IDEMSCRAPE_PROXY_* variables make (sessions.ProvidersFromEnv).

// EnvProvidersFile names the worker's providers file when -providers is not given.
const EnvProvidersFile = "IDEMSCRAPE_PROVIDERS_FILE"

// maxProvidersFile bounds a providers file: a list of accounts, not a document.
const maxProvidersFile = 1 << 20

// ProvidersFileError is one invalid setting of a providers file. It never holds a user or
// password value.
type ProvidersFileError struct {
	Path     string // the file as given
	Line     int    // 1-based; 0 when it is about the file as a whole
	Provider string // `provider 2 "oxylabs-eu"` (1-based, and its name when it has one); "" for the top level
	Field    string // the YAML field; "" when none
	Reason   string
}

// Error is "providers file <path>: line <n>: provider <i> "<name>": field <f>: <reason>",
// without the parts that are unknown.
func (e *ProvidersFileError) Error() string {
	var b strings.Builder
	b.WriteString("providers file " + e.Path)
	if e.Line > 0 {
		b.WriteString(": line " + strconv.Itoa(e.Line))
	}
	if e.Provider != "" {
		b.WriteString(": " + e.Provider)
	}
	if e.Field != "" {
		b.WriteString(": field " + e.Field)
	}
	return b.String() + ": " + e.Reason
}

// Providers is the worker's proxy accounts, in the order they are used: from the
// providers file at path (LoadProviders) when path is not "", else from the
// IDEMSCRAPE_PROXY_* variables (sessions.ProvidersFromEnv). A file and the variables
// together are an error naming the variables set (a variable the file itself names in
// user_env or password_env excepted): one way, so that nobody has to guess which wins.
func Providers(path string) ([]*sessions.Provider, error) {
	if path == "" {
		return sessions.ProvidersFromEnv()
	}
	ps, referenced, err := loadProviders(path, os.LookupEnv, secretenv.ReadFile)
	if err != nil {
		return nil, err
	}
	var set []string
	for _, name := range proxyVariables() {
		if v, ok := os.LookupEnv(name); ok && v != "" && !referenced[name] {
			set = append(set, "$"+name)
		}
	}
	if len(set) > 0 {
		return nil, fmt.Errorf("-providers %s ($%s) and the proxy variables %s are both set: configure the proxy accounts one way, "+
			"the file (any number of accounts) or the variables (one account; the numbered ones _2 … _%d for more)",
			path, EnvProvidersFile, strings.Join(set, ", "), sessions.MaxEnvProviders)
	}
	return ps, nil
}

// proxyVariables are the variables sessions.ProvidersFromEnv reads (and the one past its
// last account, which it refuses).
func proxyVariables() []string {
	base := []string{sessions.EnvProvider, sessions.EnvUser, sessions.EnvPassword, sessions.EnvZone, sessions.EnvGateway,
		sessions.EnvName, sessions.EnvPrice, sessions.EnvPriceCountries, sessions.EnvTier}
	var out []string
	for n := 1; n <= sessions.MaxEnvProviders+1; n++ {
		suffix := ""
		if n > 1 {
			suffix = "_" + strconv.Itoa(n)
		}
		for _, b := range base {
			out = append(out, b+suffix)
		}
		out = append(out, sessions.EnvPassword+suffix+secretenv.FileSuffix)
	}
	return out
}

// LoadProviders reads and checks the providers file at path (see Providers) and returns
// its providers in the order they are used: by priority when the file sets it, else in
// the file's order. Environment variables named in it are read with os.LookupEnv.
func LoadProviders(path string) ([]*sessions.Provider, error) {
	ps, _, err := loadProviders(path, os.LookupEnv, secretenv.ReadFile)
	return ps, err
}

// loadProviders is LoadProviders reading variables with lookupEnv and secret files with
// readSecret; it also returns the variables the file names.
func loadProviders(path string, lookupEnv func(string) (string, bool), readSecret func(string) (string, error)) ([]*sessions.Provider, map[string]bool, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, &ProvidersFileError{Path: path, Reason: unwrapPathErr(err).Error()}
	}
	defer func() { _ = f.Close() }()
	b, err := io.ReadAll(io.LimitReader(f, maxProvidersFile+1))
	if err != nil {
		return nil, nil, &ProvidersFileError{Path: path, Reason: unwrapPathErr(err).Error()}
	}
	if len(b) > maxProvidersFile {
		return nil, nil, &ProvidersFileError{Path: path, Reason: fmt.Sprintf("more than %d bytes: not a providers file?", maxProvidersFile)}
	}
	p := &providersParser{path: path, dir: filepath.Dir(path), lookupEnv: lookupEnv, readSecret: readSecret, referenced: map[string]bool{}}
	ps, err := p.parse(b)
	if err != nil {
		return nil, nil, err
	}
	return ps, p.referenced, nil
}

func unwrapPathErr(err error) error {
	var pe *os.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}

// providersParser reads one providers file.
type providersParser struct {
	path, dir  string
	lookupEnv  func(string) (string, bool)
	readSecret func(string) (string, error) // secretenv.ReadFile
	referenced map[string]bool              // the variables named by user_env and password_env
}

// providerEntry is one provider of the file as read, with the lines of its fields.
type providerEntry struct {
	index int               // 1-based
	line  int               // of the entry
	label string            // `provider 2 "name"`
	vals  map[string]string // scalar fields
	lines map[string]int    // field → line of its value
	// countries: price_countries, upper-case code → amount, and each one's line.
	countries     map[string]string
	countryLines  map[string]int
	countriesLine int
}

// providerFields are the fields of a provider; a field set in the entry that is not here
// is refused.
var providerFields = map[string]bool{
	"name": true, "format": true, "gateway": true, "zone": true,
	"user": true, "user_env": true, "user_file": true, "password_env": true, "password_file": true,
	"tier": true, "price": true, "price_countries": true, "priority": true,
}

var yamlLineError = regexp.MustCompile(`^yaml: line (\d+): (.*)$`)

func (p *providersParser) fail(line int, e *providerEntry, field, format string, args ...any) error {
	err := &ProvidersFileError{Path: p.path, Line: line, Field: field, Reason: fmt.Sprintf(format, args...)}
	if e != nil {
		err.Provider = e.label
	}
	return err
}

func (p *providersParser) parse(b []byte) ([]*sessions.Provider, error) {
	var doc yaml.Node
	if err := yaml.Unmarshal(b, &doc); err != nil {
		if m := yamlLineError.FindStringSubmatch(err.Error()); m != nil {
			line, _ := strconv.Atoi(m[1])
			return nil, p.fail(line, nil, "", "not YAML: %s", m[2])
		}
		return nil, p.fail(0, nil, "", "not YAML: %s", strings.TrimPrefix(err.Error(), "yaml: "))
	}
	if doc.Kind == 0 || len(doc.Content) == 0 {
		return nil, p.fail(0, nil, "", `empty: want "providers:" and a list of accounts (examples/providers.yaml)`)
	}
	root := deref(doc.Content[0])
	if root.Kind != yaml.MappingNode {
		return nil, p.fail(root.Line, nil, "", `want a mapping with one field, providers (a list of accounts)`)
	}
	var list *yaml.Node
	for i := 0; i+1 < len(root.Content); i += 2 {
		k, v := root.Content[i], deref(root.Content[i+1])
		if k.Value != "providers" {
			return nil, p.fail(k.Line, nil, k.Value, "unknown field: the file has one field, providers")
		}
		if list != nil {
			return nil, p.fail(k.Line, nil, k.Value, "given twice")
		}
		list = v
	}
	switch {
	case list == nil:
		return nil, p.fail(root.Line, nil, "providers", "missing: list the proxy accounts under providers:")
	case list.Kind != yaml.SequenceNode:
		return nil, p.fail(list.Line, nil, "providers", "want a list of accounts (each starting with \"- \")")
	case len(list.Content) == 0:
		return nil, p.fail(list.Line, nil, "providers", "empty: list at least one account")
	}
	entries := make([]*providerEntry, 0, len(list.Content))
	for i, n := range list.Content {
		e, err := p.readEntry(i+1, deref(n))
		if err != nil {
			return nil, err
		}
		entries = append(entries, e)
	}
	return p.build(entries)
}

// deref follows a YAML alias to the node it names.
func deref(n *yaml.Node) *yaml.Node {
	for n.Kind == yaml.AliasNode && n.Alias != nil {
		n = n.Alias
	}
	return n
}

// readEntry reads the fields of provider index (1-based) at node n.
func (p *providersParser) readEntry(index int, n *yaml.Node) (*providerEntry, error) {
	e := &providerEntry{index: index, line: n.Line, label: fmt.Sprintf("provider %d", index),
		vals: map[string]string{}, lines: map[string]int{}}
	if n.Kind != yaml.MappingNode {
		return nil, p.fail(n.Line, e, "", "want a mapping of fields (format, user…, password_env or password_file, …)")
	}
	// The name first, so that every error of the entry can name it.
	for i := 0; i+1 < len(n.Content); i += 2 {
		if v := deref(n.Content[i+1]); n.Content[i].Value == "name" && v.Kind == yaml.ScalarNode && v.Value != "" {
			e.label = fmt.Sprintf("provider %d %q", index, v.Value)
		}
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], deref(n.Content[i+1])
		field := k.Value
		switch {
		case k.Kind != yaml.ScalarNode:
			return nil, p.fail(k.Line, e, "", "a field name must be a plain word")
		case field == "password" || field == "pass" || field == "secret":
			// Never repeat the value: it is a secret written where it must not be.
			return nil, p.fail(k.Line, e, field, "a secret is never written in the providers file: give password_env (the name of "+
				"an environment variable holding it) or password_file (a file holding it)")
		case !providerFields[field]:
			return nil, p.fail(k.Line, e, field, "unknown field: want %s", strings.Join(sortedFieldNames(), ", "))
		}
		if _, dup := e.lines[field]; dup || (field == "price_countries" && e.countriesLine > 0) {
			return nil, p.fail(k.Line, e, field, "given twice")
		}
		if field == "price_countries" {
			if err := p.readCountries(e, v); err != nil {
				return nil, err
			}
			continue
		}
		if v.Kind != yaml.ScalarNode {
			return nil, p.fail(v.Line, e, field, "want a single value, not a list or mapping")
		}
		if v.Tag == "!!null" || strings.TrimSpace(v.Value) == "" {
			return nil, p.fail(v.Line, e, field, "empty: give a value or leave the field out")
		}
		e.vals[field], e.lines[field] = strings.TrimSpace(v.Value), v.Line
	}
	return e, nil
}

func sortedFieldNames() []string {
	out := make([]string, 0, len(providerFields))
	for f := range providerFields {
		out = append(out, f)
	}
	slices.Sort(out)
	return out
}

// readCountries reads price_countries: a mapping of country code to amount per GB.
func (p *providersParser) readCountries(e *providerEntry, v *yaml.Node) error {
	e.countriesLine = v.Line
	if v.Kind != yaml.MappingNode || len(v.Content) == 0 {
		return p.fail(v.Line, e, "price_countries", `want a mapping of country code to price per GB, e.g. {DE: 9.10, BR: 12}`)
	}
	e.countries, e.countryLines = map[string]string{}, map[string]int{}
	for i := 0; i+1 < len(v.Content); i += 2 {
		k, a := v.Content[i], deref(v.Content[i+1])
		cc := strings.ToUpper(strings.TrimSpace(k.Value))
		field := "price_countries." + k.Value
		switch {
		case k.Kind != yaml.ScalarNode || !countryCode.MatchString(cc):
			return p.fail(k.Line, e, field, "not a country code (ISO 3166-1 alpha-2, e.g. DE)")
		case e.countryLines[cc] > 0:
			return p.fail(k.Line, e, field, "%s is given twice (line %d)", cc, e.countryLines[cc])
		case a.Kind != yaml.ScalarNode || a.Tag == "!!null" || strings.TrimSpace(a.Value) == "":
			return p.fail(a.Line, e, field, `want an amount per GB, e.g. 9.10 (or "9.10 USD/GB")`)
		}
		e.countries[cc], e.countryLines[cc] = strings.TrimSpace(a.Value), a.Line
	}
	return nil
}

var (
	countryCode = regexp.MustCompile(`^[A-Z]{2}$`)
	// zoneName is sessions.BrightData's rule for a zone (not a secret: it may be shown).
	zoneName = regexp.MustCompile(`^[A-Za-z0-9_.+]{1,128}$`)
	// envName is a portable environment variable name.
	envName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
)

// formats are the presets a provider's format names.
var formats = map[string]func(user, pass, zone string) (*sessions.Provider, error){
	"brightdata": func(user, pass, zone string) (*sessions.Provider, error) {
		return sessions.BrightData(user, zone, pass)
	},
	"oxylabs": func(user, pass, _ string) (*sessions.Provider, error) { return sessions.Oxylabs(user, pass) },
	"decodo":  func(user, pass, _ string) (*sessions.Provider, error) { return sessions.Decodo(user, pass) },
	"iproyal": func(user, pass, _ string) (*sessions.Provider, error) { return sessions.IPRoyal(user, pass) },
	"soax":    func(user, pass, _ string) (*sessions.Provider, error) { return sessions.SOAX(user, pass) },
}

// build makes the providers of the entries and orders them.
func (p *providersParser) build(entries []*providerEntry) ([]*sessions.Provider, error) {
	out := make([]*sessions.Provider, len(entries))
	names := map[string]*providerEntry{}
	for i, e := range entries {
		pr, err := p.provider(e)
		if err != nil {
			return nil, err
		}
		if other, dup := names[pr.Name()]; dup {
			line, field := e.lines["name"], "name"
			if line == 0 {
				line, field = e.lines["format"], "format"
			}
			return nil, p.fail(line, e, field, "the name %s is also %s's (line %d): set name to tell the accounts apart",
				pr.Name(), other.label, other.line)
		}
		names[pr.Name()] = e
		out[i] = pr
	}
	order, err := p.order(entries)
	if err != nil {
		return nil, err
	}
	sorted := make([]*sessions.Provider, len(out))
	for i, j := range order {
		sorted[i] = out[j]
	}
	return sorted, nil
}

// order is the entries' indexes in the order their providers are used: by priority
// (lower first) when every entry sets it, in the file's order when none does.
func (p *providersParser) order(entries []*providerEntry) ([]int, error) {
	prio := make([]int, len(entries))
	var with, without *providerEntry
	byPrio := map[int]*providerEntry{}
	for i, e := range entries {
		v, ok := e.vals["priority"]
		if !ok {
			without = e
			continue
		}
		with = e
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 1000 {
			return nil, p.fail(e.lines["priority"], e, "priority", "%q: want a whole number from 1 to 1000 (lower is used first)", v)
		}
		if other, dup := byPrio[n]; dup {
			return nil, p.fail(e.lines["priority"], e, "priority", "%d is also %s's (line %d): give each account its own", n, other.label, other.lines["priority"])
		}
		byPrio[n], prio[i] = e, n
	}
	if with != nil && without != nil {
		return nil, p.fail(without.line, without, "priority", "missing, but %s sets it (line %d): set priority on every account or on none (none: the file's order)",
			with.label, with.lines["priority"])
	}
	idx := make([]int, len(entries))
	for i := range idx {
		idx[i] = i
	}
	slices.SortStableFunc(idx, func(a, b int) int { return prio[a] - prio[b] })
	return idx, nil
}

// provider builds the provider of one entry as providerFromEnv would from the equivalent
// variables: the format's preset, then gateway, name, tier and price.
func (p *providersParser) provider(e *providerEntry) (*sessions.Provider, error) {
	format, ok := e.vals["format"]
	if !ok {
		return nil, p.fail(e.line, e, "format", "missing: want one of brightdata, decodo, iproyal, oxylabs, soax")
	}
	preset, ok := formats[format]
	if !ok {
		return nil, p.fail(e.lines["format"], e, "format", "%q: want one of brightdata, decodo, iproyal, oxylabs, soax", format)
	}
	zone, hasZone := e.vals["zone"]
	switch {
	case format == "brightdata" && !hasZone:
		return nil, p.fail(e.line, e, "zone", "missing: a brightdata account needs its zone")
	case format != "brightdata" && hasZone:
		return nil, p.fail(e.lines["zone"], e, "zone", "only a brightdata account has a zone")
	case hasZone && !zoneName.MatchString(zone):
		return nil, p.fail(e.lines["zone"], e, "zone", "%q: want letters, digits, '_', '.', '+' (at most 128)", zone)
	}
	user, err := p.secret(e, "user", true)
	if err != nil {
		return nil, err
	}
	pass, err := p.secret(e, "password", false)
	if err != nil {
		return nil, err
	}
	pr, err := preset(user.value, pass.value, zone)
	if err != nil {
		// A user the preset refuses (brightdata: its customer id's characters); the
		// message of sessions names no value.
		return nil, p.fail(user.line, e, user.field, "refused by the %s format: %s", format, strings.TrimPrefix(err.Error(), "sessions: "))
	}
	if gw, ok := e.vals["gateway"]; ok {
		if pr, err = pr.WithGateway(gw); err != nil {
			// Not repeated: a gateway written with credentials in it would show them.
			return nil, p.fail(e.lines["gateway"], e, "gateway", "want host:port, without a scheme or credentials (e.g. pr.oxylabs.io:7777)")
		}
	}
	if name, ok := e.vals["name"]; ok {
		if pr, err = pr.WithName(name); err != nil {
			return nil, p.fail(e.lines["name"], e, "name", "%q: want lower-case letters, digits, '_', '.', '-' (at most 63, starting with a letter or digit)", name)
		}
	}
	if t, ok := e.vals["tier"]; ok {
		tier, err := sessions.ParseTier(t)
		if err == nil {
			pr, err = pr.WithTier(tier)
		}
		if err != nil {
			return nil, p.fail(e.lines["tier"], e, "tier", "%q: want datacenter, residential or mobile", t)
		}
	}
	price, err := p.price(e)
	if err != nil {
		return nil, err
	}
	if pr, err = pr.WithPrice(price); err != nil {
		return nil, p.fail(e.lines["price"], e, "price", "%s", strings.TrimPrefix(err.Error(), "sessions: "))
	}
	return pr, nil
}

// secretValue is a credential read for an entry: its value (never shown) and the field
// and line it came from.
type secretValue struct {
	value, field string
	line         int
}

// secret reads the credential what ("user" or "password") of e from the one field that
// gives it: <what>_env (a variable's name), <what>_file (a path) or, when inline is
// allowed (an account id, not a secret), <what> itself. Errors name the field, the
// variable or the path, never the value.
func (p *providersParser) secret(e *providerEntry, what string, inline bool) (secretValue, error) {
	var given []string
	fields := []string{what + "_env", what + "_file"}
	if inline {
		fields = append([]string{what}, fields...)
	}
	for _, f := range fields {
		if _, ok := e.vals[f]; ok {
			given = append(given, f)
		}
	}
	switch len(given) {
	case 0:
		return secretValue{}, p.fail(e.line, e, strings.Join(fields, " | "), "missing: give the account's %s one way", what)
	case 1:
	default:
		return secretValue{}, p.fail(e.lines[given[1]], e, given[1], "the %s is given by field %s already: give it one way", what, given[0])
	}
	field := given[0]
	v, line := e.vals[field], e.lines[field]
	s := secretValue{field: field, line: line}
	switch field {
	case what:
		s.value = v
	case what + "_env":
		// The errors do not repeat the name: were it the secret itself, written in the
		// wrong place, it would be shown. The line says which it is.
		if !envName.MatchString(v) {
			return s, p.fail(line, e, field, "not the name of an environment variable (letters, digits, '_'): the secret goes in the environment, its variable's name here")
		}
		val, ok := p.lookupEnv(v)
		if !ok || val == "" {
			return s, p.fail(line, e, field, "the environment variable it names is not set (or is empty)")
		}
		p.referenced[v] = true
		s.value = val
	case what + "_file":
		path := v
		if !filepath.IsAbs(path) {
			path = filepath.Join(p.dir, path)
		}
		val, err := p.readSecret(path)
		if err != nil {
			// secretenv names the path; so does the line (relative paths are relative
			// to the providers file's directory).
			reason := strings.ReplaceAll(strings.TrimPrefix(err.Error(), "secret file "+path), path, "")
			return s, p.fail(line, e, field, "the file it names%s (a relative path is relative to the providers file)", reason)
		}
		s.value = val
	}
	if strings.ContainsAny(s.value, ":\r\n\x00") {
		return s, p.fail(line, e, field, "the %s contains ':' or a control character, which no proxy account's %s does", what, what)
	}
	return s, nil
}

// price reads price and price_countries as sessions.ParsePrice and Price.WithCountries do.
func (p *providersParser) price(e *providerEntry) (sessions.Price, error) {
	def, ok := e.vals["price"]
	if !ok {
		if e.countriesLine > 0 {
			return sessions.Price{}, p.fail(e.countriesLine, e, "price_countries", "needs price (the default price and its currency) too")
		}
		return sessions.Price{}, nil
	}
	price, err := sessions.ParsePrice(def)
	if err != nil {
		return sessions.Price{}, p.fail(e.lines["price"], e, "price", "%s", strings.TrimPrefix(err.Error(), "sessions: "))
	}
	if len(e.countries) == 0 {
		return price, nil
	}
	price.ByCountry = make(map[string]int64, len(e.countries))
	for cc, amount := range e.countries {
		field, line := "price_countries."+cc, e.countryLines[cc]
		if !strings.Contains(amount, "/") {
			// An amount in the default price's currency, as IDEMSCRAPE_PROXY_PRICE_COUNTRIES.
			cp, err := sessions.ParsePrice(amount + " " + price.Currency + "/GB")
			if err != nil {
				return sessions.Price{}, p.fail(line, e, field, "%q: want an amount per GB with up to 6 decimals, e.g. 9.10 (or \"9.10 %s/GB\")", amount, price.Currency)
			}
			price.ByCountry[cc] = cp.MicrosPerGB
			continue
		}
		cp, err := sessions.ParsePrice(amount)
		switch {
		case err != nil:
			return sessions.Price{}, p.fail(line, e, field, "%s", strings.TrimPrefix(err.Error(), "sessions: "))
		case cp.Currency != price.Currency:
			return sessions.Price{}, p.fail(line, e, field, "%q is in %s, the default price in %s: one currency per account", amount, cp.Currency, price.Currency)
		}
		price.ByCountry[cc] = cp.MicrosPerGB
	}
	return price, nil
}
