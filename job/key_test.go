package job_test

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"regexp"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/idemscrape/idemscrape/job"
)

var hashKeyRE = regexp.MustCompile(`^[a-z][a-z0-9_.-]*:[0-9a-f]{32}$`)

func mustKey(t *testing.T, s job.Spec) string {
	t.Helper()
	k, err := s.Key()
	if err != nil {
		t.Fatalf("Key(%+v) error: %v", s, err)
	}
	return k
}

func withURL(u string) job.Spec {
	return job.Spec{Kind: "catalog", URL: u, Country: "US", Window: "2026-04-23", ParserVersion: 3}
}

// assertDistinctKeys reports every two specs, named by their labels, that share a key.
func assertDistinctKeys(t *testing.T, specs map[string]job.Spec) {
	t.Helper()
	seen := make(map[string]string, len(specs))
	for label, s := range specs {
		k := mustKey(t, s)
		if other, dup := seen[k]; dup {
			t.Errorf("%s and %s share key %q", label, other, k)
		}
		seen[k] = label
	}
}

func TestKeyStable(t *testing.T) {
	t.Parallel()

	// Each group lists spellings of one logical job; all must share one key.
	groups := []struct {
		name  string
		specs []job.Spec
	}{
		{
			name: "URLSpellings",
			specs: []job.Spec{
				withURL("https://shop.example/~p/42?color=red&size=m"),
				withURL("https://shop.example/~p/42?size=m&color=red"),                                  // permuted query
				withURL("HTTPS://SHOP.Example/~p/42?color=red&size=m"),                                  // scheme and host case
				withURL("https://shop.example:443/~p/42?color=red&size=m"),                              // default port
				withURL("https://shop.example/~p/42?color=red&size=m#reviews"),                          // fragment
				withURL("https://shop.example/~p/42?utm_source=news&color=red&gclid=x&size=m&fbclid=y"), // tracking
				withURL("https://shop.example/%7ep/42?color=red&size=m"),                                // %7e
				withURL("https://shop.example/%7Ep/4%32?color=%72ed&size=m"),                            // %7E, escaped digit/letter
				withURL("https://shop.example/a/../~p/./42?color=red&size=m&"),                          // dot segments, empty pair
			},
		},
		{
			name: "HTTPDefaultPort",
			specs: []job.Spec{
				withURL("http://shop.example/x"),
				withURL("http://shop.example:80/x"),
				withURL("HTTP://shop.example:080/x#y"),
			},
		},
		{
			name: "IDNHost",
			specs: []job.Spec{
				withURL("https://bücher.example/x"),
				withURL("https://BÜCHER.example/x"),
				withURL("https://xn--bcher-kva.example/x"),
				withURL("https://XN--BCHER-KVA.example/x"),
			},
		},
		{
			name: "CountryCase",
			specs: []job.Spec{
				{Kind: "catalog", SourceID: "sku-42", Country: "US", Window: "2026-04-23", ParserVersion: 3},
				{Kind: "catalog", SourceID: "sku-42", Country: "us", Window: "2026-04-23", ParserVersion: 3},
				{Kind: "catalog", SourceID: "sku-42", Country: "uS", Window: "2026-04-23", ParserVersion: 3},
			},
		},
		{
			name: "MetaIgnoredNaturalForm",
			specs: []job.Spec{
				{Kind: "catalog", SourceID: "sku-42", Country: "US", Window: "2026-04-23", ParserVersion: 3},
				{Kind: "catalog", SourceID: "sku-42", Country: "US", Window: "2026-04-23", ParserVersion: 3,
					Meta: map[string]string{"attempt": "3", "delivery_id": "abc"}},
				{Kind: "catalog", SourceID: "sku-42", Country: "US", Window: "2026-04-23", ParserVersion: 3,
					Meta: map[string]string{"attempt": "4", "delivery_id": "def", "enqueued_at": "2026-04-23T10:00:00Z"}},
				{Kind: "catalog", SourceID: "sku-42", Country: "US", Window: "2026-04-23", ParserVersion: 3,
					Meta: map[string]string{}},
			},
		},
		{
			name: "MetaIgnoredHashForm",
			specs: []job.Spec{
				withURL("https://shop.example/p"),
				func() job.Spec {
					s := withURL("https://shop.example/p")
					s.Meta = map[string]string{"attempt": "3", "delivery_id": "abc"}
					return s
				}(),
			},
		},
	}
	for _, g := range groups {
		t.Run(g.name, func(t *testing.T) {
			t.Parallel()
			want := mustKey(t, g.specs[0])
			for i, s := range g.specs[1:] {
				if diff := cmp.Diff(want, mustKey(t, s)); diff != "" {
					t.Errorf("spec %d %+v: key differs from spec 0 (-want +got):\n%s", i+1, s, diff)
				}
			}
		})
	}
}

func TestKeyDistinct(t *testing.T) {
	t.Parallel()

	base := job.Spec{Kind: "catalog", SourceID: "sku-42", Country: "US", Window: "2026-04-23", ParserVersion: 3}
	variant := func(f func(*job.Spec)) job.Spec {
		s := base
		f(&s)
		return s
	}
	specs := map[string]job.Spec{
		"Base":               base,
		"Country":            variant(func(s *job.Spec) { s.Country = "GB" }),
		"Window":             variant(func(s *job.Spec) { s.Window = "2026-04-24" }),
		"WindowPeriod":       variant(func(s *job.Spec) { s.Window = "2026-W17" }),
		"WindowHour":         variant(func(s *job.Spec) { s.Window = "2026-04-23T15" }),
		"WindowWithColon":    variant(func(s *job.Spec) { s.Window = "2026-04-23T15:00" }),
		"ParserVersion":      variant(func(s *job.Spec) { s.ParserVersion = 4 }),
		"ParserVersion30":    variant(func(s *job.Spec) { s.ParserVersion = 30 }),
		"Scope":              variant(func(s *job.Spec) { s.Scope = "acme" }),
		"OtherScope":         variant(func(s *job.Spec) { s.Scope = "globex" }),
		"Kind":               variant(func(s *job.Spec) { s.Kind = "reviews" }),
		"SourceID":           variant(func(s *job.Spec) { s.SourceID = "sku-43" }),
		"SourceIDCase":       variant(func(s *job.Spec) { s.SourceID = "SKU-42" }),
		"SourceIDWithColon":  variant(func(s *job.Spec) { s.SourceID = "sku:42" }),
		"SourceIDWithSpace":  variant(func(s *job.Spec) { s.SourceID = "sku 42" }),
		"SourceIDLooksLikeV": variant(func(s *job.Spec) { s.SourceID = "sku-42:US:2026-04-23:v3" }),
		"URL":                variant(func(s *job.Spec) { s.SourceID = ""; s.URL = "https://shop.example/sku-42" }),
		"URLOtherCountry":    variant(func(s *job.Spec) { s.SourceID = ""; s.URL = "https://shop.example/sku-42"; s.Country = "CA" }),
		"URLScope":           variant(func(s *job.Spec) { s.SourceID = ""; s.URL = "https://shop.example/sku-42"; s.Scope = "acme" }),
		"URLParserVersion":   variant(func(s *job.Spec) { s.SourceID = ""; s.URL = "https://shop.example/sku-42"; s.ParserVersion = 4 }),
		"URLWindow":          variant(func(s *job.Spec) { s.SourceID = ""; s.URL = "https://shop.example/sku-42"; s.Window = "2026-W17" }),
		"URLKind":            variant(func(s *job.Spec) { s.SourceID = ""; s.URL = "https://shop.example/sku-42"; s.Kind = "reviews" }),
	}
	assertDistinctKeys(t, specs)
}

// TestKeyDistinctURLs pins spellings that a server may treat differently: they must not be
// merged into one job.
func TestKeyDistinctURLs(t *testing.T) {
	t.Parallel()

	urls := []string{
		"https://shop.example/a/b",
		"https://shop.example/a%2Fb", // escaped slash is not a path separator
		"https://shop.example/A/b",   // path is case-sensitive
		"http://shop.example/a/b",    // scheme
		"https://shop.example./a/b",  // WHATWG keeps the trailing dot
		"https://shop.example:8443/a/b",
		"https://shop.example/a/b?q=x+y",
		"https://shop.example/a/b?q=x%20y",
		"https://shop.example/a/b?q=x%2By",
		"https://shop.example/a/b?q=x&y",
		"https://shop.example/a/b?q=x%26y",
		"https://shop.example/a/b?q",
		"https://shop.example/a/b?q=",
		"https://shop.example/a/b?a=1&a=2",
		"https://shop.example/a/b?a=2&a=1", // order of repeated keys is kept
		"https://shop.example/a/b?ref=1",   // not a tracking parameter
	}
	specs := make(map[string]job.Spec, len(urls))
	for _, u := range urls {
		specs[fmt.Sprintf("URL %q", u)] = withURL(u)
	}
	if len(specs) != len(urls) {
		t.Fatal("a URL is listed twice")
	}
	assertDistinctKeys(t, specs)
}

func TestKeyFormat(t *testing.T) {
	t.Parallel()

	tests := []struct {
		name string
		spec job.Spec
		want string // exact key, or "hash" for kind:<32 hex>
	}{
		{
			name: "Natural",
			spec: job.Spec{Kind: "catalog", SourceID: "sku-42", Country: "US", Window: "2026-04-23", ParserVersion: 3},
			want: "catalog:sku-42:US:2026-04-23:v3",
		},
		{
			name: "NaturalLowerCountry",
			spec: job.Spec{Kind: "catalog", SourceID: "sku-42", Country: "us", Window: "2026-04-23", ParserVersion: 3},
			want: "catalog:sku-42:US:2026-04-23:v3",
		},
		{
			name: "NaturalWithScope",
			spec: job.Spec{Kind: "catalog", SourceID: "sku-42", Country: "US", Window: "2026-W17", ParserVersion: 12, Scope: "acme"},
			want: "catalog:sku-42:US:2026-W17:v12:acme",
		},
		{
			name: "NaturalExactly128Bytes",
			spec: job.Spec{Kind: "catalog", SourceID: strings.Repeat("s", 128-len("catalog::US:2026-04-23:v3")), Country: "US", Window: "2026-04-23", ParserVersion: 3},
			want: "catalog:" + strings.Repeat("s", 128-len("catalog::US:2026-04-23:v3")) + ":US:2026-04-23:v3",
		},
		{
			name: "HashWhen129Bytes",
			spec: job.Spec{Kind: "catalog", SourceID: strings.Repeat("s", 129-len("catalog::US:2026-04-23:v3")), Country: "US", Window: "2026-04-23", ParserVersion: 3},
			want: "hash",
		},
		{name: "HashForURL", spec: withURL("https://shop.example/sku-42"), want: "hash"},
		{
			name: "HashForColonInSourceID",
			spec: job.Spec{Kind: "catalog", SourceID: "sku:42", Country: "US", Window: "2026-04-23", ParserVersion: 3},
			want: "hash",
		},
		{
			name: "HashForSpaceInSourceID",
			spec: job.Spec{Kind: "catalog", SourceID: "sku 42", Country: "US", Window: "2026-04-23", ParserVersion: 3},
			want: "hash",
		},
		{
			name: "HashForUnicodeSourceID",
			spec: job.Spec{Kind: "catalog", SourceID: "skü-42", Country: "US", Window: "2026-04-23", ParserVersion: 3},
			want: "hash",
		},
		{
			name: "HashForColonInWindow",
			spec: job.Spec{Kind: "catalog", SourceID: "sku-42", Country: "US", Window: "2026-04-23T15:00", ParserVersion: 3},
			want: "hash",
		},
		{
			name: "HashForPlusInWindow",
			spec: job.Spec{Kind: "catalog", SourceID: "sku-42", Country: "US", Window: "2026-04-23T15+02", ParserVersion: 3},
			want: "hash",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got := mustKey(t, tt.spec)
			parts := strings.Split(got, ":")
			if tt.want == "hash" {
				if !hashKeyRE.MatchString(got) || parts[0] != tt.spec.Kind {
					t.Errorf("key %q, want %s:<32 lower-case hex>", got, tt.spec.Kind)
				}
				return
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("key mismatch (-want +got):\n%s", diff)
			}
			if len(parts) < 5 || len(got) > 128 {
				t.Errorf("natural key %q has %d components and %d bytes, want >= 5 and <= 128", got, len(parts), len(got))
			}
		})
	}
}

// TestKeyHashEncoding pins the hash form to the encoding documented in doc.go. If it
// fails, existing keys would change: that is a breaking change, not a test to update.
func TestKeyHashEncoding(t *testing.T) {
	t.Parallel()

	netstrings := func(fields ...string) []byte {
		var b []byte
		for _, f := range fields {
			b = fmt.Appendf(b, "%d:%s,", len(f), f)
		}
		return b
	}
	documented := func(kind string, fields ...string) string {
		sum := sha256.Sum256(netstrings(append([]string{"idemscrape-key-v1", kind}, fields...)...))
		return kind + ":" + hex.EncodeToString(sum[:16])
	}

	tests := []struct {
		name   string
		spec   job.Spec
		want   string
		golden string
	}{
		{
			name: "URL",
			spec: job.Spec{Kind: "catalog", URL: "HTTPS://Shop.Example/p?b=2&a=1#x", Country: "us", Window: "2026-04-23", ParserVersion: 3, Scope: "acme"},
			// kind, URL, SourceID, Country, Window, ParserVersion, Scope
			want:   documented("catalog", "https://shop.example/p?a=1&b=2", "", "US", "2026-04-23", "3", "acme"),
			golden: "catalog:735211f5f0f9c40929b361b46a621511",
		},
		{
			name:   "SourceIDWithColon",
			spec:   job.Spec{Kind: "catalog", SourceID: "sku:42", Country: "DE", Window: "2026-04-23T15:00", ParserVersion: 1},
			want:   documented("catalog", "", "sku:42", "DE", "2026-04-23T15:00", "1", ""),
			golden: "catalog:18d5778ca4dbee4e76ac2fa485d1d88f",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got := mustKey(t, tt.spec)
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("key differs from the documented encoding (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(tt.golden, got); diff != "" {
				t.Errorf("key differs from the golden value (-want +got):\n%s", diff)
			}
		})
	}
}

func TestNormalizerKeyMatchesSpecKey(t *testing.T) {
	t.Parallel()

	s := withURL("https://shop.example/p?utm_source=x")
	viaSpec := mustKey(t, s)
	viaDefault, err := job.DefaultNormalizer.Key(s)
	if err != nil {
		t.Fatal(err)
	}
	if viaSpec != viaDefault {
		t.Errorf("Spec.Key() = %q, DefaultNormalizer.Key() = %q", viaSpec, viaDefault)
	}
	// A Normalizer that keeps utm_ parameters sees a different URL, hence a different key.
	keeping, err := job.NewNormalizer(job.WithoutDefaultTrackingParams()).Key(s)
	if err != nil {
		t.Fatal(err)
	}
	if keeping == viaSpec {
		t.Errorf("key %q does not depend on the tracking configuration", keeping)
	}
}
