package job_test

import (
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/idemscrape/idemscrape/job"
)

func TestNormalizeURL(t *testing.T) {
	t.Parallel()

	tests := []struct {
		name string
		in   string
		want string
	}{
		{"AlreadyCanonical", "https://example.com/a/b?x=1", "https://example.com/a/b?x=1"},
		{"SchemeAndHostLowerCased", "HTTPS://WWW.Example.COM/Path", "https://www.example.com/Path"},
		{"PathCaseKept", "https://example.com/A/b", "https://example.com/A/b"},
		{"EmptyPathBecomesSlash", "https://example.com", "https://example.com/"},
		{"DefaultHTTPSPortDropped", "https://example.com:443/", "https://example.com/"},
		{"DefaultHTTPPortDropped", "http://example.com:80/", "http://example.com/"},
		{"LeadingZeroDefaultPortDropped", "https://example.com:0443/", "https://example.com/"},
		{"NonDefaultPortKept", "https://example.com:8443/", "https://example.com:8443/"},
		{"CrossDefaultPortKept", "http://example.com:443/", "http://example.com:443/"},
		{"FragmentDropped", "https://example.com/a#section-2", "https://example.com/a"},
		{"EmptyQueryDropped", "https://example.com/a?", "https://example.com/a"},
		{"EmptyQueryAndFragmentDropped", "https://example.com/a?#", "https://example.com/a"},
		{"EmptyPairsDropped", "https://example.com/?&a=1&&b=2&", "https://example.com/?a=1&b=2"},
		{"QuerySortedByKey", "https://example.com/?b=2&c=3&a=1", "https://example.com/?a=1&b=2&c=3"},
		{"RepeatedKeysKeepOrder", "https://example.com/?b=2&a=9&b=1&a=0", "https://example.com/?a=9&a=0&b=2&b=1"},
		{"NameWithoutValueKeptDistinct", "https://example.com/?a&a=", "https://example.com/?a&a="},
		{"TrackingPrefixRemoved", "https://example.com/?utm_source=x&UTM_MEDIUM=y&q=1", "https://example.com/?q=1"},
		{"TrackingNamesRemoved", "https://example.com/?gclid=1&FBCLID=2&msclkid=3&_ga=4&li_fat_id=5&q=1", "https://example.com/?q=1"},
		{"EncodedTrackingNameRemoved", "https://example.com/?utm%5Fsource=x&%67clid=1&q=1", "https://example.com/?q=1"},
		{"OnlyTrackingLeavesNoQuestionMark", "https://example.com/p?utm_campaign=spring&gclid=abc", "https://example.com/p"},
		{"TrackingLikeValueKept", "https://example.com/?ref=gclid", "https://example.com/?ref=gclid"},
		{"EscapeHexUpperCased", "https://example.com/a%c3%a4?q=%c3%a4", "https://example.com/a%C3%A4?q=%C3%A4"},
		{"UnreservedEscapesDecoded", "https://example.com/%7e%41%2d%2E%5f%30?%7Eq=%61", "https://example.com/~A-._0?~q=a"},
		{"EscapedSlashKept", "https://example.com/a%2fb", "https://example.com/a%2Fb"},
		{"ReservedQueryEscapesKept", "https://example.com/?q=%26%3d%2b%23", "https://example.com/?q=%26%3D%2B%23"},
		{"PlusAndPercent20Distinct", "https://example.com/?a=x+y&b=x%20y", "https://example.com/?a=x+y&b=x%20y"},
		{"LonePercentEncoded", "https://example.com/50%?off=50%", "https://example.com/50%25?off=50%25"},
		{"LonePercentNeverMakesEscape", "https://example.com/%%414", "https://example.com/%25A4"},
		{"InvalidUTF8EscapeKept", "https://example.com/?q=%ff", "https://example.com/?q=%FF"},
		{"NonASCIIPathAndQueryEncoded", "https://example.com/ä?ö=ü", "https://example.com/%C3%A4?%C3%B6=%C3%BC"},
		{"IDNHostToPunycode", "https://BÜCHER.example/", "https://xn--bcher-kva.example/"},
		{"PunycodeHostKept", "https://xn--bcher-kva.example/", "https://xn--bcher-kva.example/"},
		{"TrailingDotKept", "HTTP://EXAMPLE.COM./", "http://example.com./"},
		{"DotSegmentsResolved", "https://example.com/a/./b/../c", "https://example.com/a/c"},
		{"EncodedDotSegmentsResolved", "https://example.com/a/%2e%2E/c", "https://example.com/c"},
		{"BackslashesAreSlashes", `https://example.com\a\b`, "https://example.com/a/b"},
		{"IPv4Literal", "http://192.168.0.1:8080/", "http://192.168.0.1:8080/"},
		{"IPv4ShorthandCanonical", "http://0x7f.1/", "http://127.0.0.1/"},
		{"IPv6Literal", "https://[2001:DB8::0:1]:443/x", "https://[2001:db8::1]/x"},
		{"EmptyCredentialsDropped", "https://@example.com/", "https://example.com/"},
		{"SingleQuoteEncoded", "https://example.com/?q='", "https://example.com/?q=%27"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := job.DefaultNormalizer.NormalizeURL(tt.in)
			if err != nil {
				t.Fatalf("NormalizeURL(%q) error: %v", tt.in, err)
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("NormalizeURL(%q) mismatch (-want +got):\n%s", tt.in, diff)
			}
			again, err := job.DefaultNormalizer.NormalizeURL(got)
			if err != nil || again != got {
				t.Errorf("NormalizeURL not idempotent: %q -> %q, %v", got, again, err)
			}
		})
	}
}

func TestNormalizeURLRejects(t *testing.T) {
	t.Parallel()

	tests := []struct {
		name       string
		in         string
		wantReason string // substring of the error
	}{
		{"Empty", "", "required"},
		{"TooLong", "https://example.com/" + strings.Repeat("a", 2048), "at most 2048"},
		{"TooLongEvenIfCanonicalIsShort", "https://example.com/?utm_source=" + strings.Repeat("a", 2048), "at most 2048"},
		{"CanonicalTooLong", "https://example.com/" + strings.Repeat("ä", 700), "canonical form is 4220 bytes"},
		{"InvalidUTF8", "https://example.com/\xff", "UTF-8"},
		{"Tab", "https://example.com/a\tb", "control"},
		{"Newline", "https://exa\nmple.com/", "control"},
		{"NUL", "https://example.com/\x00", "control"},
		{"DEL", "https://example.com/\x7f", "control"},
		{"C1", "https://example.com/\u0085", "control"},
		{"Space", "https://example.com/a b", "whitespace"},
		{"LeadingSpace", " https://example.com/", "whitespace"},
		{"NoBreakSpace", "https://example.com/\u00a0", "whitespace"},
		{"FTP", "ftp://example.com/", `scheme "ftp"`},
		{"File", "file:///etc/passwd", `scheme "file"`},
		{"Mailto", "mailto:a@example.com", "scheme not allowed"},
		{"Websocket", "wss://example.com/", `scheme "wss"`},
		{"Relative", "/a/b", "missing scheme"},
		{"SchemeRelative", "//example.com/a", "missing scheme"},
		{"HostOnly", "example.com", "missing scheme"},
		{"UserInfo", "https://user:secret@example.com/", "user info"},
		{"UserOnly", "https://user@example.com/", "user info"},
		{"PasswordOnly", "https://:secret@example.com/", "user info"},
		{"NoHost", "https://", "host"},
		{"NoHostWithPath", "http:///", "host"},
		{"BadPort", "https://example.com:99999/", "port"},
		{"BadIPv6", "https://[::1/", "IPv6"},
		{"ForbiddenHostCodePoint", "https://exa<mple.com/", "cannot be parsed"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := job.DefaultNormalizer.NormalizeURL(tt.in)
			if err == nil {
				t.Fatalf("NormalizeURL(%q) = %q, want error", tt.in, got)
			}
			var fe *job.FieldError
			if !errors.As(err, &fe) || fe.Field != "URL" {
				t.Fatalf("NormalizeURL(%q) error %v (%T), want *FieldError for URL", tt.in, err, err)
			}
			if !errors.Is(err, job.ErrInvalidSpec) {
				t.Errorf("errors.Is(%v, ErrInvalidSpec) = false", err)
			}
			if !strings.Contains(err.Error(), tt.wantReason) {
				t.Errorf("error %q does not contain %q", err, tt.wantReason)
			}
			if strings.Contains(err.Error(), "secret") {
				t.Errorf("error %q leaks the password", err)
			}
		})
	}
}

func TestNormalizerOptions(t *testing.T) {
	t.Parallel()

	const in = "https://example.com/?utm_source=a&gclid=b&sid=c&ref_x=d&Q=e"
	tests := []struct {
		name string
		opts []job.NormalizerOption
		want string
	}{
		{"Defaults", nil, "https://example.com/?Q=e&ref_x=d&sid=c"},
		{"ExtraName", []job.NormalizerOption{job.WithTrackingParams("SID")}, "https://example.com/?Q=e&ref_x=d"},
		{"ExtraPrefix", []job.NormalizerOption{job.WithTrackingPrefixes("REF_")}, "https://example.com/?Q=e&sid=c"},
		{"WithoutDefaults", []job.NormalizerOption{job.WithoutDefaultTrackingParams()},
			"https://example.com/?Q=e&gclid=b&ref_x=d&sid=c&utm_source=a"},
		{"WithoutDefaultsAfterExtra", []job.NormalizerOption{job.WithTrackingParams("sid"), job.WithoutDefaultTrackingParams()},
			"https://example.com/?Q=e&gclid=b&ref_x=d&utm_source=a"},
		{"EmptyNameAndPrefixIgnored", []job.NormalizerOption{job.WithTrackingParams(""), job.WithTrackingPrefixes("")},
			"https://example.com/?Q=e&ref_x=d&sid=c"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := job.NewNormalizer(tt.opts...).NormalizeURL(in)
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("mismatch (-want +got):\n%s", diff)
			}
		})
	}
}

func TestNormalizerZeroValuePanics(t *testing.T) {
	t.Parallel()

	defer func() {
		if recover() == nil {
			t.Error("zero Normalizer did not panic")
		}
	}()
	var n job.Normalizer
	_, _ = n.NormalizeURL("https://example.com/")
}

func TestNormalizerConcurrentUse(t *testing.T) {
	t.Parallel()

	const want = "https://xn--bcher-kva.example/?a=1&b=2"
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for range 16 {
		wg.Go(func() {
			for range 50 {
				got, err := job.DefaultNormalizer.NormalizeURL("https://bücher.example/?b=2&utm_x=1&a=1#f")
				if err != nil || got != want {
					errs <- errors.New("got " + got)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// FuzzNormalize checks that NormalizeURL never panics and is idempotent: whenever it
// accepts x with canonical form y, it accepts y and returns y unchanged.
func FuzzNormalize(f *testing.F) {
	seeds := []string{
		"https://example.com/",
		"HTTP://EXAMPLE.COM.",
		"https://example.com:443/a?b=1#frag",
		"http://example.com:80",
		"https://bücher.example/straße?ä=ö",
		"https://xn--bcher-kva.example/",
		"https://ex%41mple.com/",
		"https://example.com/a%2fb%2Fc",
		"https://example.com/%7e%7E~",
		"https://example.com/?b=2&a=1&b=1&a=0",
		"https://example.com/?",
		"https://example.com/#",
		"https://example.com/?#",
		"http://[::1]:8080/",
		"http://[2001:DB8::0:1]/",
		"http://0x7f.1/",
		`https:\\example.com\a\..\b`,
		"https://example.com/a/./b/../../c/..",
		"https://example.com/a/%2e%2E/b/.%2e",
		"https://example.com/?q=a+b&q=a%20b&q=a%2Bb",
		"https://example.com/?q='\"<>`{}",
		"https://example.com/?utm_source=x&gclid=y&q=1",
		"https://example.com/%%414?%%414=50%",
		"https://example.com/?%ff=%c3%a4&&=&==",
		"http:example.com",
		"https://user:pw@example.com/",
		"javascript:alert(1)",
	}
	for _, s := range seeds {
		f.Add(s)
	}
	n := job.DefaultNormalizer
	f.Fuzz(func(t *testing.T, raw string) {
		first, err := n.NormalizeURL(raw)
		if err != nil {
			var fe *job.FieldError
			if !errors.As(err, &fe) || fe.Field != "URL" || !errors.Is(err, job.ErrInvalidSpec) {
				t.Fatalf("NormalizeURL(%q) error %v (%T), want *FieldError for URL", raw, err, err)
			}
			return
		}
		second, err := n.NormalizeURL(first)
		if err != nil {
			t.Fatalf("NormalizeURL(%q) = %q, but NormalizeURL(%q) failed: %v", raw, first, first, err)
		}
		if second != first {
			t.Fatalf("not idempotent:\n input  %q\n first  %q\n second %q", raw, first, second)
		}
	})
}
