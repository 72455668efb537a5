package job

import (
	"slices"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/nlnwa/whatwg-url/canonicalizer"
	whatwgerrors "github.com/nlnwa/whatwg-url/errors"
	"github.com/nlnwa/whatwg-url/url"
)

// defaultTrackingParams are the query parameter names DefaultNormalizer removes
// (compared case-insensitively). They identify the click or campaign, never the page.
var defaultTrackingParams = []string{
	"gclid", "fbclid", "msclkid", "dclid", "gbraid", "wbraid", "yclid",
	"mc_cid", "mc_eid", "_ga", "_gl", "igshid", "twclid", "ttclid", "li_fat_id",
}

// defaultTrackingPrefixes are the query parameter name prefixes DefaultNormalizer removes
// (compared case-insensitively).
var defaultTrackingPrefixes = []string{"utm_"}

// maxFixpointRounds bounds how often NormalizeURL re-normalises its own output.
const maxFixpointRounds = 3

// Normalizer canonicalises URLs and derives job keys. It is immutable after
// NewNormalizer returns and safe for concurrent use.
//
// The zero value is NOT usable (its methods panic); create one with NewNormalizer or use
// DefaultNormalizer. Two Normalizers with different tracking parameters may give the same
// URL different keys, so every component that derives keys for the same jobs must use the
// same configuration.
type Normalizer struct {
	parser   url.Parser
	names    map[string]struct{} // lower-case exact names to drop
	prefixes []string            // lower-case name prefixes to drop

	// Collected by options, folded into names/prefixes by NewNormalizer so that the
	// order of options does not matter.
	noDefaults  bool
	optNames    []string
	optPrefixes []string
}

// NormalizerOption configures a Normalizer created by NewNormalizer. Options are
// order-independent.
type NormalizerOption func(*Normalizer)

// WithTrackingParams adds query parameter names that NormalizeURL removes. Names are
// compared case-insensitively with the percent-decoded parameter name; empty names are
// ignored.
func WithTrackingParams(names ...string) NormalizerOption {
	return func(n *Normalizer) { n.optNames = append(n.optNames, names...) }
}

// WithTrackingPrefixes adds query parameter name prefixes (e.g. "utm_") whose parameters
// NormalizeURL removes. Prefixes are compared case-insensitively with the percent-decoded
// parameter name; empty prefixes are ignored (they would remove every parameter).
func WithTrackingPrefixes(prefixes ...string) NormalizerOption {
	return func(n *Normalizer) { n.optPrefixes = append(n.optPrefixes, prefixes...) }
}

// WithoutDefaultTrackingParams starts from an empty list instead of the default tracking
// names and prefixes (see DefaultNormalizer). Names and prefixes added with
// WithTrackingParams and WithTrackingPrefixes are still removed, whatever the option order.
func WithoutDefaultTrackingParams() NormalizerOption {
	return func(n *Normalizer) { n.noDefaults = true }
}

// NewNormalizer returns a ready-to-use Normalizer.
func NewNormalizer(opts ...NormalizerOption) *Normalizer {
	n := &Normalizer{
		// The canonicalizer's query sorting (WithSortQuery) is deliberately NOT used: it
		// re-serialises the query as application/x-www-form-urlencoded, which decodes %26
		// to "&", %3D to "=" and %2B to "+" (i.e. a space) and replaces invalid UTF-8 with
		// U+FFFD, so different URLs would share one key. normalizeQuery sorts the encoded
		// pairs instead. The canonical string is assembled from the parsed components
		// without the fragment, so WithRemoveFragment is a second line of defence only.
		parser: canonicalizer.New(canonicalizer.WithRemoveFragment()),
		names:  make(map[string]struct{}),
	}
	for _, opt := range opts {
		opt(n)
	}
	names, prefixes := n.optNames, n.optPrefixes
	if !n.noDefaults {
		names = append(slices.Clone(defaultTrackingParams), names...)
		prefixes = append(slices.Clone(defaultTrackingPrefixes), prefixes...)
	}
	for _, name := range names {
		if name != "" {
			n.names[strings.ToLower(name)] = struct{}{}
		}
	}
	for _, p := range prefixes {
		if p != "" && !slices.Contains(n.prefixes, strings.ToLower(p)) {
			n.prefixes = append(n.prefixes, strings.ToLower(p))
		}
	}
	n.optNames, n.optPrefixes = nil, nil
	return n
}

// DefaultNormalizer is the Normalizer used by Spec.Normalize, Spec.Key and Spec.Validate.
// It removes query parameters starting with "utm_" and those named gclid, fbclid, msclkid,
// dclid, gbraid, wbraid, yclid, mc_cid, mc_eid, _ga, _gl, igshid, twclid, ttclid and
// li_fat_id (all case-insensitive). Changing this list changes keys of URL specs, which is
// a breaking change.
var DefaultNormalizer = NewNormalizer()

func (n *Normalizer) mustBeInitialised() {
	if n == nil || n.parser == nil {
		panic("tasks: Normalizer used without NewNormalizer; use NewNormalizer or DefaultNormalizer")
	}
}

// NormalizeURL returns the canonical form of an absolute http or https URL, or a
// *FieldError with Field "URL". The error never contains the URL or any part of it that
// could hold credentials.
//
// Rejected: empty input; more than 2048 bytes (before or after canonicalisation); invalid
// UTF-8; any control character (C0, DEL, C1, NUL) or Unicode whitespace anywhere (the
// WHATWG parser would silently strip tabs and newlines, this rejects them instead); a
// scheme other than http or https, or no scheme; user info (user name or password);
// a missing or empty host. IP literal hosts are accepted.
//
// Canonical form: WHATWG URL parsing (lower-case scheme and host, IDNA to punycode,
// default port dropped, dot segments resolved, backslashes as slashes), fragment dropped,
// tracking parameters removed, empty query pairs dropped, query pairs stably sorted by
// their encoded name (repeated names keep their order), "?" dropped when the query is
// empty, and in path and query: hex digits of escapes upper-cased, escapes of unreserved
// characters (ALPHA / DIGIT / "-" / "." / "_" / "~") decoded, a "%" that starts no escape
// encoded as "%25". Escapes of reserved characters (%2F, %26, %3D, %2B, …) are kept, and
// "+" and "%20" stay distinct. A trailing dot in the host is kept (WHATWG keeps it).
//
// NormalizeURL is idempotent: whenever NormalizeURL(x) succeeds with y, NormalizeURL(y)
// returns y.
func (n *Normalizer) NormalizeURL(raw string) (string, error) {
	n.mustBeInitialised()
	cur, ferr := n.normalizeOnce(raw)
	if ferr != nil {
		return "", ferr
	}
	// One pass is meant to be a fixpoint, but the result is re-parsed by a third-party
	// WHATWG implementation whose serialisation is not guaranteed to be idempotent in
	// every corner (the WHATWG spec itself documents non-idempotent cases). Rather than
	// hand out a URL whose key would change when it comes back through NormalizeURL, run
	// to a fixpoint and refuse inputs that do not converge.
	for range maxFixpointRounds {
		next, ferr := n.normalizeOnce(cur)
		if ferr != nil {
			return "", &FieldError{Field: "URL", Reason: "canonical form is not stable: " + ferr.Reason}
		}
		if next == cur {
			return cur, nil
		}
		cur = next
	}
	return "", &FieldError{Field: "URL", Reason: "canonical form does not converge"}
}

// normalizeOnce is one pass of NormalizeURL without the fixpoint guarantee.
func (n *Normalizer) normalizeOnce(raw string) (string, *FieldError) {
	bad := func(format string, args ...any) (string, *FieldError) {
		return "", fieldErr("URL", format, args...)
	}
	if raw == "" {
		return bad("required unless SourceID is set")
	}
	if len(raw) > maxURLLen {
		return bad("%d bytes, want at most %d", len(raw), maxURLLen)
	}
	if !utf8.ValidString(raw) {
		return bad("not valid UTF-8")
	}
	for i, r := range raw {
		if unicode.IsControl(r) {
			return bad("control character %U at byte %d", r, i)
		}
		if unicode.IsSpace(r) {
			return bad("whitespace %U at byte %d (URLs are never trimmed or stripped)", r, i)
		}
	}
	scheme, ok := leadingScheme(raw)
	if !ok {
		return bad("missing scheme, want an absolute http or https URL")
	}
	if s := strings.ToLower(scheme); s != "http" && s != "https" {
		// "user:password@host" without a scheme reads as scheme "user": never echo a
		// scheme when the input has an "@" in it.
		if strings.Contains(raw, "@") || len(s) > 32 {
			return bad("scheme not allowed, want http or https")
		}
		return bad("scheme %q not allowed, want http or https", s)
	}

	u, err := n.parser.Parse(raw)
	if err != nil {
		// The WHATWG error text includes the input URL; only its fixed type text is used.
		if t := whatwgerrors.Type(err); t != "" {
			return bad("cannot be parsed: %s", t)
		}
		return bad("cannot be parsed")
	}
	if s := u.Scheme(); s != "http" && s != "https" {
		return bad("scheme not allowed, want http or https")
	}
	if u.Username() != "" || u.Password() != "" {
		return bad("user info (credentials) not allowed")
	}
	if u.Hostname() == "" {
		return bad("empty host")
	}

	path := normalizePercent(u.Pathname())
	if path == "" {
		path = "/"
	}
	out := u.Scheme() + "://" + u.Host() + path
	if q := n.normalizeQuery(u.Query()); q != "" {
		out += "?" + q
	}
	if len(out) > maxURLLen {
		return bad("canonical form is %d bytes, want at most %d", len(out), maxURLLen)
	}
	return out, nil
}

// leadingScheme returns the RFC 3986 scheme ALPHA *( ALPHA / DIGIT / "+" / "-" / "." )
// before the first ":", if s starts with one.
func leadingScheme(s string) (string, bool) {
	for i := 0; i < len(s); i++ {
		b := s[i]
		switch {
		case isASCIILetter(b):
		case i > 0 && (('0' <= b && b <= '9') || b == '+' || b == '-' || b == '.'):
		case i > 0 && b == ':':
			return s[:i], true
		default:
			return "", false
		}
	}
	return "", false
}

// normalizeQuery drops empty pairs and tracking parameters, normalises percent-encoding
// and stably sorts the pairs by encoded name. It works on the encoded query as serialised
// by the WHATWG parser, never on decoded values, so reserved escapes keep their meaning.
func (n *Normalizer) normalizeQuery(q string) string {
	if q == "" {
		return ""
	}
	type pair struct{ name, text string }
	var kept []pair
	for p := range strings.SplitSeq(q, "&") {
		if p == "" {
			continue
		}
		p = normalizePercent(p)
		name, _, _ := strings.Cut(p, "=")
		if n.isTracking(name) {
			continue
		}
		kept = append(kept, pair{name, p})
	}
	slices.SortStableFunc(kept, func(a, b pair) int { return strings.Compare(a.name, b.name) })
	var sb strings.Builder
	for i, p := range kept {
		if i > 0 {
			sb.WriteByte('&')
		}
		sb.WriteString(p.text)
	}
	return sb.String()
}

// isTracking reports whether the encoded query parameter name is configured for removal.
func (n *Normalizer) isTracking(encodedName string) bool {
	if len(n.names) == 0 && len(n.prefixes) == 0 {
		return false
	}
	name := strings.ToLower(formDecode(encodedName))
	if _, ok := n.names[name]; ok {
		return true
	}
	for _, p := range n.prefixes {
		if strings.HasPrefix(name, p) {
			return true
		}
	}
	return false
}

// formDecode decodes "+" as space and every valid %XX escape; it is used only to compare
// names, never to build the canonical URL.
func formDecode(s string) string {
	if !strings.ContainsAny(s, "%+") {
		return s
	}
	var sb strings.Builder
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '+':
			sb.WriteByte(' ')
		case c == '%' && i+2 < len(s) && isHex(s[i+1]) && isHex(s[i+2]):
			sb.WriteByte(unhex(s[i+1])<<4 | unhex(s[i+2]))
			i += 2
		default:
			sb.WriteByte(c)
		}
	}
	return sb.String()
}

// normalizePercent applies RFC 3986 §6.2.2.2 to an already-encoded path or query: escapes
// of unreserved characters are decoded, other escapes get upper-case hex digits, and a "%"
// that does not start an escape becomes "%25" (otherwise decoding a neighbour could turn
// it into a new escape, e.g. "%%414" would become "%A4" and change on the next pass).
func normalizePercent(s string) string {
	if !strings.Contains(s, "%") {
		return s
	}
	const upperHex = "0123456789ABCDEF"
	var sb strings.Builder
	sb.Grow(len(s))
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c != '%' {
			sb.WriteByte(c)
			continue
		}
		if i+2 < len(s) && isHex(s[i+1]) && isHex(s[i+2]) {
			v := unhex(s[i+1])<<4 | unhex(s[i+2])
			if isUnreserved(v) {
				sb.WriteByte(v)
			} else {
				sb.WriteByte('%')
				sb.WriteByte(upperHex[v>>4])
				sb.WriteByte(upperHex[v&15])
			}
			i += 2
			continue
		}
		sb.WriteString("%25")
	}
	return sb.String()
}

func isUnreserved(b byte) bool {
	return ('a' <= b && b <= 'z') || ('A' <= b && b <= 'Z') || ('0' <= b && b <= '9') ||
		b == '-' || b == '.' || b == '_' || b == '~'
}

func isHex(b byte) bool {
	return ('0' <= b && b <= '9') || ('a' <= b && b <= 'f') || ('A' <= b && b <= 'F')
}

func unhex(b byte) byte {
	switch {
	case '0' <= b && b <= '9':
		return b - '0'
	case 'a' <= b && b <= 'f':
		return b - 'a' + 10
	default:
		return b - 'A' + 10
	}
}
