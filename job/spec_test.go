package job_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/idemscrape/idemscrape/job"
)

// validSpec returns a fresh valid SourceID spec; tests mutate their own copy.
func validSpec() job.Spec {
	return job.Spec{
		Kind:          "catalog",
		SourceID:      "sku-42",
		Country:       "US",
		Window:        "2026-04-23",
		ParserVersion: 3,
	}
}

func TestSpecRejectsBadInput(t *testing.T) {
	t.Parallel()

	tests := []struct {
		name      string
		mutate    func(s *job.Spec)
		wantField string
		wantInErr string // extra text the error must contain, if any
		notInErr  string // text the error must not contain, if any
	}{
		{name: "EmptySpec", mutate: func(s *job.Spec) { *s = job.Spec{} }, wantField: "Kind"},
		{name: "KindUpperCase", mutate: func(s *job.Spec) { s.Kind = "Catalog" }, wantField: "Kind"},
		{name: "KindWithColon", mutate: func(s *job.Spec) { s.Kind = "catalog:v2" }, wantField: "Kind"},
		{name: "KindStartsWithDigit", mutate: func(s *job.Spec) { s.Kind = "1catalog" }, wantField: "Kind"},
		{name: "KindTooLong", mutate: func(s *job.Spec) { s.Kind = strings.Repeat("k", 65) }, wantField: "Kind"},
		{name: "KindTrailingSpace", mutate: func(s *job.Spec) { s.Kind = "catalog " }, wantField: "Kind"},
		{name: "NeitherURLNorSourceID", mutate: func(s *job.Spec) { s.SourceID = "" }, wantField: "URL", wantInErr: "SourceID"},
		{name: "BothURLAndSourceID", mutate: func(s *job.Spec) { s.URL = "https://example.com/" }, wantField: "URL", wantInErr: "both"},
		{name: "URLFTP", mutate: urlSpec("ftp://example.com/file"), wantField: "URL", wantInErr: `"ftp"`},
		{name: "URLJavaScript", mutate: urlSpec("javascript:alert(1)"), wantField: "URL", wantInErr: "scheme"},
		{name: "URLData", mutate: urlSpec("data:text/plain,hi"), wantField: "URL", wantInErr: "scheme"},
		{name: "URLRelative", mutate: urlSpec("/products/42"), wantField: "URL", wantInErr: "scheme"},
		{
			name: "URLWithPassword", mutate: urlSpec("https://admin:hunter2@example.com/"),
			wantField: "URL", wantInErr: "user info", notInErr: "hunter2",
		},
		{
			name: "URLWithPasswordNoScheme", mutate: urlSpec("admin:hunter2@example.com"),
			wantField: "URL", notInErr: "hunter2",
		},
		{name: "URLControlChar", mutate: urlSpec("https://example.com/a\x01b"), wantField: "URL", wantInErr: "control"},
		{name: "URLNewline", mutate: urlSpec("https://example.com/a\nb"), wantField: "URL", wantInErr: "control"},
		{name: "URL10KB", mutate: urlSpec("https://example.com/" + strings.Repeat("a", 10<<10)), wantField: "URL", wantInErr: "bytes"},
		{name: "SourceIDNUL", mutate: func(s *job.Spec) { s.SourceID = "sku\x0042" }, wantField: "SourceID"},
		{name: "SourceIDInvalidUTF8", mutate: func(s *job.Spec) { s.SourceID = "sku-\xff" }, wantField: "SourceID", wantInErr: "UTF-8"},
		{name: "SourceID10KB", mutate: func(s *job.Spec) { s.SourceID = strings.Repeat("x", 10<<10) }, wantField: "SourceID", wantInErr: "bytes"},
		{name: "SourceIDLeadingSpace", mutate: func(s *job.Spec) { s.SourceID = " sku-42" }, wantField: "SourceID", wantInErr: "space"},
		{name: "SourceIDTrailingSpace", mutate: func(s *job.Spec) { s.SourceID = "sku-42 " }, wantField: "SourceID", wantInErr: "space"},
		{name: "SourceIDTab", mutate: func(s *job.Spec) { s.SourceID = "sku\t42" }, wantField: "SourceID"},
		{name: "CountryEmpty", mutate: func(s *job.Spec) { s.Country = "" }, wantField: "Country"},
		{name: "CountryUnknownXX", mutate: func(s *job.Spec) { s.Country = "XX" }, wantField: "Country", wantInErr: `"XX"`},
		{name: "CountryUK", mutate: func(s *job.Spec) { s.Country = "UK" }, wantField: "Country", wantInErr: `did you mean "GB"?`},
		{name: "CountryLowerUK", mutate: func(s *job.Spec) { s.Country = "uk" }, wantField: "Country", wantInErr: `did you mean "GB"?`},
		{name: "CountryEU", mutate: func(s *job.Spec) { s.Country = "EU" }, wantField: "Country"},
		{name: "CountryThreeLetters", mutate: func(s *job.Spec) { s.Country = "usa" }, wantField: "Country"},
		{name: "CountryPadded", mutate: func(s *job.Spec) { s.Country = " US" }, wantField: "Country"},
		{name: "CountryNonASCII", mutate: func(s *job.Spec) { s.Country = "Ü" }, wantField: "Country"},
		{name: "ParserVersionZero", mutate: func(s *job.Spec) { s.ParserVersion = 0 }, wantField: "ParserVersion"},
		{name: "ParserVersionNegative", mutate: func(s *job.Spec) { s.ParserVersion = -1 }, wantField: "ParserVersion"},
		{name: "ParserVersionTooLarge", mutate: func(s *job.Spec) { s.ParserVersion = 1_000_001 }, wantField: "ParserVersion"},
		{name: "WindowEmpty", mutate: func(s *job.Spec) { s.Window = "" }, wantField: "Window", wantInErr: "required"},
		{name: "WindowWithSpace", mutate: func(s *job.Spec) { s.Window = "2026-04-23 15:00" }, wantField: "Window"},
		{name: "WindowTrailingSpace", mutate: func(s *job.Spec) { s.Window = "2026-04-23 " }, wantField: "Window", wantInErr: "space"},
		{name: "WindowTooLong", mutate: func(s *job.Spec) { s.Window = strings.Repeat("9", 41) }, wantField: "Window"},
		{name: "ScopeWithSlash", mutate: func(s *job.Spec) { s.Scope = "acme/eu" }, wantField: "Scope"},
		{name: "ScopeWithColon", mutate: func(s *job.Spec) { s.Scope = "acme:eu" }, wantField: "Scope"},
		{name: "ScopeTooLong", mutate: func(s *job.Spec) { s.Scope = strings.Repeat("s", 65) }, wantField: "Scope"},
		{name: "MetaControlChar", mutate: func(s *job.Spec) { s.Meta = map[string]string{"note": "a\x07b"} }, wantField: "Meta[note]", wantInErr: "control"},
		{name: "MetaInvalidUTF8", mutate: func(s *job.Spec) { s.Meta = map[string]string{"note": "\xc3"} }, wantField: "Meta[note]"},
		{name: "MetaValueTooLong", mutate: func(s *job.Spec) { s.Meta = map[string]string{"v": strings.Repeat("v", 1025)} }, wantField: "Meta[v]"},
		{name: "MetaKeyControlChar", mutate: func(s *job.Spec) { s.Meta = map[string]string{"a\nb": "x"} }, wantField: "Meta"},
		{name: "MetaKeyTooLong", mutate: func(s *job.Spec) { s.Meta = map[string]string{strings.Repeat("k", 65): "x"} }, wantField: "Meta"},
		{name: "MetaEmptyKey", mutate: func(s *job.Spec) { s.Meta = map[string]string{"": "x"} }, wantField: "Meta"},
		{name: "MetaTooManyEntries", mutate: func(s *job.Spec) { s.Meta = metaOfSize(33) }, wantField: "Meta"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			s := validSpec()
			tt.mutate(&s)

			norm, err := s.Normalize()
			if err == nil {
				t.Fatalf("Normalize() = %+v, want error for field %s", norm, tt.wantField)
			}
			if !errors.Is(err, job.ErrInvalidSpec) {
				t.Errorf("errors.Is(%v, ErrInvalidSpec) = false", err)
			}
			var fe *job.FieldError
			if !errors.As(err, &fe) {
				t.Fatalf("error %v (%T) is not a *FieldError", err, err)
			}
			if fe.Field != tt.wantField {
				t.Errorf("Field = %q, want %q (error: %v)", fe.Field, tt.wantField, err)
			}
			msg := err.Error()
			if !strings.Contains(msg, "field "+tt.wantField+":") {
				t.Errorf("error %q does not name field %s", msg, tt.wantField)
			}
			if tt.wantInErr != "" && !strings.Contains(msg, tt.wantInErr) {
				t.Errorf("error %q does not contain %q", msg, tt.wantInErr)
			}
			if tt.notInErr != "" && strings.Contains(msg, tt.notInErr) {
				t.Errorf("error %q contains %q", msg, tt.notInErr)
			}
			if len(msg) > 300 {
				t.Errorf("error is %d bytes; it must name the problem, not echo the input", len(msg))
			}

			// Validate and Key report the same error.
			if verr := s.Validate(); verr == nil || verr.Error() != msg {
				t.Errorf("Validate() = %v, want %q", verr, msg)
			}
			if key, kerr := s.Key(); kerr == nil || kerr.Error() != msg || key != "" {
				t.Errorf("Key() = %q, %v, want \"\", %q", key, kerr, msg)
			}
		})
	}
}

func urlSpec(u string) func(s *job.Spec) {
	return func(s *job.Spec) {
		s.SourceID = ""
		s.URL = u
	}
}

func metaOfSize(n int) map[string]string {
	m := make(map[string]string, n)
	for i := range n {
		m[fmt.Sprintf("k%d", i)] = "v"
	}
	return m
}

func TestSpecNormalize(t *testing.T) {
	t.Parallel()

	tests := []struct {
		name string
		in   job.Spec
		want job.Spec
	}{
		{
			name: "SourceIDCountryUpperCased",
			in:   job.Spec{Kind: "catalog", SourceID: "sku-42", Country: "us", Window: "2026-04-23", ParserVersion: 3},
			want: job.Spec{Kind: "catalog", SourceID: "sku-42", Country: "US", Window: "2026-04-23", ParserVersion: 3},
		},
		{
			name: "URLCanonicalised",
			in: job.Spec{
				Kind: "product.page", URL: "HTTPS://Shop.Example:443/p?b=2&utm_source=x&a=1#top",
				Country: "gB", Window: "2026-W17", ParserVersion: 1_000_000, Scope: "acme_eu-1.0",
			},
			want: job.Spec{
				Kind: "product.page", URL: "https://shop.example/p?a=1&b=2",
				Country: "GB", Window: "2026-W17", ParserVersion: 1_000_000, Scope: "acme_eu-1.0",
			},
		},
		{
			name: "PrintableUnicodeSourceIDAndMetaKept",
			in: job.Spec{
				Kind: "k", SourceID: "Artikel Nr. 42/ä", Country: "DE", Window: "2026-04-23T15:00+02:00", ParserVersion: 1,
				Meta: map[string]string{"attempt": "3", "note": "größer ✓"},
			},
			want: job.Spec{
				Kind: "k", SourceID: "Artikel Nr. 42/ä", Country: "DE", Window: "2026-04-23T15:00+02:00", ParserVersion: 1,
				Meta: map[string]string{"attempt": "3", "note": "größer ✓"},
			},
		},
		{
			name: "LimitsInclusive",
			in: job.Spec{
				Kind: "k" + strings.Repeat("a", 63), SourceID: strings.Repeat("s", 256), Country: "ZW",
				Window: strings.Repeat("w", 40), ParserVersion: 1, Scope: strings.Repeat("c", 64), Meta: metaOfSize(32),
			},
			want: job.Spec{
				Kind: "k" + strings.Repeat("a", 63), SourceID: strings.Repeat("s", 256), Country: "ZW",
				Window: strings.Repeat("w", 40), ParserVersion: 1, Scope: strings.Repeat("c", 64), Meta: metaOfSize(32),
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := tt.in.Normalize()
			if err != nil {
				t.Fatalf("Normalize() error: %v", err)
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("Normalize() mismatch (-want +got):\n%s", diff)
			}
			if err := tt.in.Validate(); err != nil {
				t.Errorf("Validate() = %v, want nil", err)
			}
			again, err := got.Normalize()
			if err != nil {
				t.Fatalf("Normalize(Normalize()) error: %v", err)
			}
			if diff := cmp.Diff(got, again); diff != "" {
				t.Errorf("Normalize not idempotent (-first +second):\n%s", diff)
			}
		})
	}
}

func TestSpecNormalizeCopiesMeta(t *testing.T) {
	t.Parallel()

	s := validSpec()
	s.Meta = map[string]string{"attempt": "1"}
	got, err := s.Normalize()
	if err != nil {
		t.Fatal(err)
	}
	s.Meta["attempt"] = "2"
	if got.Meta["attempt"] != "1" {
		t.Errorf("Normalize result shares its Meta map with the input")
	}
}

func TestCountryCodes(t *testing.T) {
	t.Parallel()

	var accepted []string
	for a := 'A'; a <= 'Z'; a++ {
		for b := 'A'; b <= 'Z'; b++ {
			upper := job.Spec{Kind: "k", SourceID: "x", Country: string([]rune{a, b}), Window: "w", ParserVersion: 1}
			lower := upper
			lower.Country = strings.ToLower(upper.Country)
			upperOK, lowerOK := upper.Validate() == nil, lower.Validate() == nil
			if upperOK != lowerOK {
				t.Errorf("%s accepted=%v but %s accepted=%v", upper.Country, upperOK, lower.Country, lowerOK)
			}
			if upperOK {
				accepted = append(accepted, upper.Country)
			}
		}
	}
	if len(accepted) != 249 {
		t.Errorf("accepted %d codes, want the 249 officially assigned ISO 3166-1 alpha-2 codes", len(accepted))
	}
	set := make(map[string]bool, len(accepted))
	for _, c := range accepted {
		set[c] = true
	}
	for _, c := range []string{"US", "GB", "DE", "FR", "JP", "CN", "BR", "IN", "AX", "BQ", "CW", "SS", "SX", "ZA"} {
		if !set[c] {
			t.Errorf("%s rejected, want accepted", c)
		}
	}
	for _, c := range []string{"UK", "EU", "EL", "XK", "XX", "AA", "ZZ", "QM", "AN", "YU", "CS", "TP", "SU"} {
		if set[c] {
			t.Errorf("%s accepted, want rejected (not an officially assigned code)", c)
		}
	}
}
