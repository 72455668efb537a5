package job

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Limits enforced by Normalizer.Normalize. They bound the size of a job row and of the
// key's canonical encoding; raising one is compatible, lowering one is a breaking change.
const (
	maxKindLen          = 64
	maxURLLen           = 2048
	maxSourceIDLen      = 256
	maxWindowLen        = 40
	maxScopeLen         = 64
	maxParserVersion    = 1_000_000
	maxMetaEntries      = 32
	maxMetaKeyLen       = 64
	maxMetaValueLen     = 1024
	naturalKeyMaxLength = 128
)

// Spec describes one logical job: the fields that define one expected observation.
//
// Only Kind, URL or SourceID, Country, Window, ParserVersion and Scope enter the job key;
// Meta never does. A Spec is a plain value: the zero value is invalid, and every method
// works on a copy, so a Spec may be shared between goroutines as long as nobody mutates
// its Meta map concurrently.
type Spec struct {
	// Kind is the workflow type, e.g. "catalog". It must match [a-z][a-z0-9_.-]{0,63}.
	Kind string
	// URL is the source URL (http or https). Exactly one of URL and SourceID is set.
	// Normalize replaces it with its canonical form (see Normalizer.NormalizeURL).
	URL string
	// SourceID is the source record id, e.g. "sku-42": printable UTF-8 of at most 256
	// bytes without leading or trailing space. Exactly one of URL and SourceID is set.
	SourceID string
	// Country is the requested country as an ISO 3166-1 alpha-2 code. Input is
	// case-insensitive; Normalize upper-cases it. Required: a job is always for the exits
	// of one country (it is part of the key), there is no "any country" value.
	Country string
	// Window is the collection window, e.g. "2026-04-23", "2026-W17" or
	// "2026-04-23T15". Required; it must match [A-Za-z0-9._:+-]{1,40}.
	Window string
	// ParserVersion is the version of the parser that turns the fetched page into data,
	// between 1 and 1_000_000. Bumping it makes every job a new job.
	ParserVersion int
	// Scope is the customer or data product the observation is for. Optional; it must
	// match [A-Za-z0-9._-]{0,64}.
	Scope string
	// Meta holds volatile, free-form values (request id, enqueue time, priority hints).
	// It is NEVER part of the key. At most 32 entries; keys are 1–64 bytes, values at most
	// 1024 bytes; both valid UTF-8 without control characters.
	Meta map[string]string
}

// ErrInvalidSpec is matched (via errors.Is) by every validation error of this package.
var ErrInvalidSpec = errors.New("tasks: invalid spec")

// FieldError reports which field of a Spec is wrong and why. errors.Is(err,
// ErrInvalidSpec) is true for every *FieldError.
//
// Field is the Go field name ("Kind", "URL", "SourceID", "Country", "Window",
// "ParserVersion", "Scope", "Meta") or "Meta[key]" for one Meta entry. Reason names the
// problem without repeating the offending value, so the error is safe to log even when a
// URL carried credentials.
type FieldError struct {
	Field  string
	Reason string
}

// Error returns "tasks: invalid spec: field <Field>: <Reason>".
func (e *FieldError) Error() string {
	return ErrInvalidSpec.Error() + ": field " + e.Field + ": " + e.Reason
}

// Is reports whether target is ErrInvalidSpec.
func (e *FieldError) Is(target error) bool {
	return target == ErrInvalidSpec
}

func fieldErr(field, format string, args ...any) *FieldError {
	return &FieldError{Field: field, Reason: fmt.Sprintf(format, args...)}
}

// Normalize validates s with DefaultNormalizer and returns its canonical copy.
// See Normalizer.Normalize.
func (s Spec) Normalize() (Spec, error) {
	return DefaultNormalizer.Normalize(s)
}

// Key returns the job key of s computed with DefaultNormalizer. See Normalizer.Key.
func (s Spec) Key() (string, error) {
	return DefaultNormalizer.Key(s)
}

// Validate returns the error Normalize would return for s (nil when s is valid).
func (s Spec) Validate() error {
	_, err := s.Normalize()
	return err
}

// Normalize validates every field of s and returns a canonical copy: URL in canonical
// form, Country upper-case, Meta copied (a new map, so later changes to s.Meta do not
// leak into the result). Nothing is trimmed or silently repaired: leading or trailing
// space in Kind, SourceID, Window or Scope is an error. On failure the error is a
// *FieldError naming the first invalid field, in the order Kind, URL/SourceID, Country,
// Window, ParserVersion, Scope, Meta (entries in key order).
//
// Normalize is idempotent: normalising its result again returns an equal Spec.
func (n *Normalizer) Normalize(s Spec) (Spec, error) {
	return n.normalize(s, n.NormalizeURL)
}

// errNotCanonical: the spec's URL is valid but not in canonical form.
var errNotCanonical = errors.New("tasks: URL not in canonical form")

// canonicalURL returns u when it is its own canonical form, checked with ONE pass of the
// normaliser: u == normalizeOnce(u) makes u a fixpoint, so NormalizeURL(u) == u (the
// first pass gives u, the second confirms it). Otherwise it returns errNotCanonical or
// the pass's error, and the caller normalises in full.
func (n *Normalizer) canonicalURL(u string) (string, error) {
	got, ferr := n.normalizeOnce(u)
	if ferr != nil {
		return "", ferr
	}
	if got != u {
		return "", errNotCanonical
	}
	return u, nil
}

// keyOfCanonical returns the key of s when s is valid and its URL already canonical,
// which is what an enqueuer writes, at about half the cost of Key (one URL pass instead
// of two); ok is false when s needs the full path (Key), which gives the same key or the
// same error Normalize would.
func (n *Normalizer) keyOfCanonical(s Spec) (key string, ok bool) {
	ns, err := n.normalize(s, n.canonicalURL)
	if err != nil {
		return "", false
	}
	return deriveKey(ns), true
}

// normalize is Normalize with the URL normalised by url.
func (n *Normalizer) normalize(s Spec, url func(string) (string, error)) (Spec, error) {
	n.mustBeInitialised()
	if err := checkKind(s.Kind); err != nil {
		return Spec{}, err
	}
	switch {
	case s.URL == "" && s.SourceID == "":
		return Spec{}, fieldErr("URL", "exactly one of URL or SourceID is required, got neither")
	case s.URL != "" && s.SourceID != "":
		return Spec{}, fieldErr("URL", "exactly one of URL or SourceID is allowed, got both")
	case s.URL != "":
		u, err := url(s.URL)
		if err != nil {
			return Spec{}, err
		}
		s.URL = u
	default:
		if err := checkSourceID(s.SourceID); err != nil {
			return Spec{}, err
		}
	}
	c, reason := normalizeCountry(s.Country)
	if reason != "" {
		return Spec{}, fieldErr("Country", "%s", reason)
	}
	s.Country = c
	if err := checkPattern("Window", s.Window, 1, maxWindowLen, isWindowByte, "[A-Za-z0-9._:+-]"); err != nil {
		return Spec{}, err
	}
	if s.ParserVersion == 0 {
		return Spec{}, fieldErr("ParserVersion", "required (the zero value is no version), want 1..%d", maxParserVersion)
	}
	if s.ParserVersion < 1 || s.ParserVersion > maxParserVersion {
		return Spec{}, fieldErr("ParserVersion", "%d out of range, want 1..%d", s.ParserVersion, maxParserVersion)
	}
	if err := checkPattern("Scope", s.Scope, 0, maxScopeLen, isSafeByte, "[A-Za-z0-9._-]"); err != nil {
		return Spec{}, err
	}
	if err := checkMeta(s.Meta); err != nil {
		return Spec{}, err
	}
	s.Meta = maps.Clone(s.Meta)
	return s, nil
}

func checkKind(k string) error {
	if k == "" {
		return fieldErr("Kind", "required, want [a-z][a-z0-9_.-]{0,63}")
	}
	if len(k) > maxKindLen {
		return fieldErr("Kind", "%d bytes, want at most %d", len(k), maxKindLen)
	}
	if k[0] < 'a' || k[0] > 'z' {
		return fieldErr("Kind", "must start with a lower-case ASCII letter")
	}
	for i := 1; i < len(k); i++ {
		b := k[i]
		if !(('a' <= b && b <= 'z') || ('0' <= b && b <= '9') || b == '_' || b == '.' || b == '-') {
			return fieldErr("Kind", "byte %d not allowed, want [a-z][a-z0-9_.-]{0,63}", i)
		}
	}
	return nil
}

func checkSourceID(id string) error {
	if len(id) > maxSourceIDLen {
		return fieldErr("SourceID", "%d bytes, want at most %d", len(id), maxSourceIDLen)
	}
	if !utf8.ValidString(id) {
		return fieldErr("SourceID", "not valid UTF-8")
	}
	for i, r := range id {
		if !unicode.IsPrint(r) {
			return fieldErr("SourceID", "non-printable character %U at byte %d", r, i)
		}
	}
	if strings.HasPrefix(id, " ") || strings.HasSuffix(id, " ") {
		return fieldErr("SourceID", "leading or trailing space (values are never trimmed)")
	}
	return nil
}

// checkPattern checks that v is minLen..maxLen bytes, each accepted by ok. class is the
// character class quoted in the error.
func checkPattern(field, v string, minLen, maxLen int, ok func(byte) bool, class string) error {
	if len(v) < minLen {
		return fieldErr(field, "required, want %s{%d,%d}", class, minLen, maxLen)
	}
	if len(v) > maxLen {
		return fieldErr(field, "%d bytes, want at most %d", len(v), maxLen)
	}
	for i := 0; i < len(v); i++ {
		if !ok(v[i]) {
			if v[i] == ' ' && (i == 0 || i == len(v)-1) {
				return fieldErr(field, "leading or trailing space (values are never trimmed)")
			}
			return fieldErr(field, "byte %d not allowed, want %s{%d,%d}", i, class, minLen, maxLen)
		}
	}
	return nil
}

// isSafeByte reports whether b may appear in a component of a natural-form key.
func isSafeByte(b byte) bool {
	return ('a' <= b && b <= 'z') || ('A' <= b && b <= 'Z') || ('0' <= b && b <= '9') ||
		b == '.' || b == '_' || b == '-'
}

func isWindowByte(b byte) bool {
	return isSafeByte(b) || b == ':' || b == '+'
}

func checkMeta(m map[string]string) error {
	if len(m) > maxMetaEntries {
		return fieldErr("Meta", "%d entries, want at most %d", len(m), maxMetaEntries)
	}
	for _, k := range slices.Sorted(maps.Keys(m)) {
		if reason := metaTextProblem(k, maxMetaKeyLen); reason != "" {
			// The key itself is broken, so it cannot be printed inside the field name.
			return fieldErr("Meta", "key: %s", reason)
		}
		if k == "" {
			return fieldErr("Meta", "empty key")
		}
		if reason := metaTextProblem(m[k], maxMetaValueLen); reason != "" {
			return fieldErr("Meta["+k+"]", "value: %s", reason)
		}
	}
	return nil
}

// metaTextProblem returns why s is not acceptable Meta text, or "" when it is.
func metaTextProblem(s string, maxLen int) string {
	if len(s) > maxLen {
		return fmt.Sprintf("%d bytes, want at most %d", len(s), maxLen)
	}
	if !utf8.ValidString(s) {
		return "not valid UTF-8"
	}
	for i, r := range s {
		if unicode.IsControl(r) {
			return fmt.Sprintf("control character %U at byte %d", r, i)
		}
	}
	return ""
}
