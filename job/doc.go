// Package job defines job identity: the Spec of one logical scraping job, its
// validation and normalisation, and the stable key derived from it.
//
// A job runs at least once and takes effect exactly once because every delivery of the
// same logical job carries the same key. The key is derived only from the fields that
// define one expected observation (Spec.Kind, Spec.URL or Spec.SourceID, Spec.Country,
// Spec.Window, Spec.ParserVersion, Spec.Scope), after normalisation, and never from
// volatile values (Spec.Meta: attempt number, delivery id, enqueue time, …).
//
// # Key format (compatibility promise)
//
// Keys are stored in job rows and used as idempotency keys, so the format below is part of
// the public contract. Any change that gives an existing spec a different key — in this
// format, in URL canonicalisation, in the default tracking parameter list or in the
// country list — is a breaking change that CHANGELOG.md must call out.
//
// Natural form, used when the spec has a SourceID (never for a URL), SourceID and Window
// both consist only of [A-Za-z0-9._-], and the whole key is at most 128 bytes:
//
//	kind:sourceid:COUNTRY:window:vN          e.g. catalog:sku-42:US:2026-04-23:v3
//	kind:sourceid:COUNTRY:window:vN:scope    e.g. catalog:sku-42:US:2026-04-23:v3:acme
//
// N is ParserVersion in decimal without leading zeros. No component contains ":", so a
// natural key always has 5 or 6 colon-separated components and splits back uniquely.
//
// Hash form, used otherwise (always for a URL spec):
//
//	kind:<32 lower-case hex digits>          e.g. catalog:735211f5f0f9c40929b361b46a621511
//
// (that example is the key of Kind "catalog", URL "https://shop.example/p?a=1&b=2",
// Country "US", Window "2026-04-23", ParserVersion 3, Scope "acme").
//
// The hex digits are the first 16 bytes of SHA-256 over the concatenated netstrings
// ("<decimal byte length>:<bytes>,") of, in order: the literal "idemscrape-key-v1", Kind,
// canonical URL (or ""), SourceID (or ""), upper-case Country, Window, ParserVersion in
// decimal, Scope (or ""). A hash key has exactly 2 components, so it never equals a
// natural key. A future encoding would use a new version literal.
//
// # URL canonicalisation
//
// See Normalizer.NormalizeURL. Equivalent spellings of one URL (host case, IDN in Unicode
// or punycode, default port, fragment, query order, tracking parameters, escape case,
// escaped unreserved characters) give one key; URLs that a server may treat differently
// (%2F vs "/", %26 vs "&", "+" vs %20, trailing dot in the host) keep different keys.
package job
