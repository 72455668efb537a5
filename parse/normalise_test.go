package parse_test

import (
	"errors"
	"strings"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/job"
	"github.com/idemscrape/idemscrape/parse"
)

func TestWhitespace(t *testing.T) {
	for _, tt := range []struct{ name, in, want string }{
		{"Empty", "", ""},
		{"AlreadyNormal", "a b", "a b"},
		{"TrimAndCollapse", " \t a \n\n b \r\n", "a b"},
		{"NoBreakSpaces", "1\u00a0234\u202f567\u2009€", "1 234 567 €"},
		{"IdeographicSpace", "東京\u3000駅", "東京 駅"},
		{"LineAndParagraphSeparators", "a\u2028b\u2029c\u0085d", "a b c d"},
		{"ZeroWidthRemoved", "Kaf\u200bfee\u2060\ufeff\u00ad", "Kaffee"},
		{"ZeroWidthBetweenSpaces", "a \u200b b", "a b"},
		{"OnlyInvisible", " \u200b\u00a0\ufeff ", ""},
		{"JoinersKept", "👨\u200d👩\u200d👧 می\u200cخواهم", "👨\u200d👩\u200d👧 می\u200cخواهم"},
		{"ControlRemoved", "a\x00b\x1bc\u009f", "abc"},
		{"InvalidUTF8", "a\xffb", "a\ufffdb"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got := parse.Whitespace(tt.in)
			assert.Equal(t, tt.want, got)
			assert.Equal(t, got, parse.Whitespace(got), "idempotent")
		})
	}
}

// FuzzWhitespace: Whitespace never panics, is idempotent, returns valid UTF-8 with no
// leading, trailing or doubled space and no other white space or control character.
func FuzzWhitespace(f *testing.F) {
	for _, s := range []string{"", " a  b ", "\u00a0\u202f\u200b", "a\xffb", "\xe2\x80", "👨\u200d👩", "\t\n\r\v\f", "\u0085\u2028"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		once := parse.Whitespace(s)
		if twice := parse.Whitespace(once); twice != once {
			t.Fatalf("not idempotent: %q ⇒ %q ⇒ %q", s, once, twice)
		}
		if !utf8.ValidString(once) {
			t.Fatalf("invalid UTF-8 out of %q: %q", s, once)
		}
		if strings.HasPrefix(once, " ") || strings.HasSuffix(once, " ") || strings.Contains(once, "  ") {
			t.Fatalf("space not trimmed or collapsed: %q", once)
		}
		for _, r := range once {
			if r != ' ' && (unicode.IsSpace(r) || unicode.IsControl(r) || r == '\u200b' || r == '\ufeff') {
				t.Fatalf("%U left in %q", r, once)
			}
		}
	})
}

func TestTimestamp(t *testing.T) {
	berlin := time.FixedZone("CET", 3600)
	for _, tt := range []struct {
		name string
		in   string
		opts parse.TimeOptions
		want string
		err  string
	}{
		{name: "RFC3339Offset", in: "2026-04-23T10:15:00+02:00", want: "2026-04-23T08:15:00Z"},
		{name: "RFC3339Z", in: "2026-04-23T10:15:00Z", want: "2026-04-23T10:15:00Z"},
		{name: "Fraction", in: "2026-04-23T10:15:00.250-05:00", want: "2026-04-23T15:15:00.25Z"},
		{name: "HTTPDateGMT", in: "Thu, 23 Apr 2026 10:15:00 GMT", want: "2026-04-23T10:15:00Z"},
		{name: "RFC1123Z", in: "Thu, 23 Apr 2026 10:15:00 +0200", want: "2026-04-23T08:15:00Z"},
		{name: "PageZoneWinsOverDefault", in: "2026-04-23 10:15:00+02:00", opts: parse.TimeOptions{Zone: time.UTC}, want: "2026-04-23T08:15:00Z"},
		{name: "DefaultZone", in: "23.04.2026 10:15", opts: parse.TimeOptions{Zone: berlin}, want: "2026-04-23T09:15:00Z"},
		{name: "DateOnlyDefaultZone", in: "2026-04-23", opts: parse.TimeOptions{Zone: berlin}, want: "2026-04-22T23:00:00Z"},
		{name: "LongDate", in: "April 23, 2026", opts: parse.TimeOptions{Zone: time.UTC}, want: "2026-04-23T00:00:00Z"},
		{name: "WhitespaceNormalised", in: " 23\u00a0April\n2026 ", opts: parse.TimeOptions{Zone: time.UTC}, want: "2026-04-23T00:00:00Z"},
		{name: "OwnLayout", in: "04/23/2026", opts: parse.TimeOptions{Layouts: []string{"01/02/2006"}, Zone: time.UTC}, want: "2026-04-23T00:00:00Z"},
		{name: "NoZoneRefused", in: "2026-04-23 10:15", err: "states no zone and TimeOptions.Zone is not set"},
		{name: "AmbiguousAbbreviationRefused", in: "Thu, 23 Apr 2026 10:15:00 PST", err: `zone abbreviation "PST" is ambiguous`},
		{name: "DayMonthOrderNotGuessed", in: "03/04/2026", opts: parse.TimeOptions{Zone: time.UTC}, err: "matches none of"},
		{name: "HoursAgo", in: "2 hours ago", err: "relative time refused"},
		{name: "Yesterday", in: "Yesterday", err: "relative time refused"},
		{name: "Gestern", in: "gestern, 14:30", err: "relative time refused"},
		{name: "Garbage", in: "soon™", err: `parse: timestamp "soon™": matches none of`},
		{name: "Empty", in: "  ", err: "empty"},
		{name: "YearOutOfRangeInUTC", in: "0000-01-01T00:00:00+23:59", err: "year -1 in UTC is outside RFC 3339's 0000–9999"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parse.Timestamp(tt.in, tt.opts)
			if tt.err != "" {
				require.Error(t, err, "got %s", got)
				assert.Contains(t, err.Error(), tt.err)
				if strings.Contains(tt.err, "relative") {
					assert.True(t, errors.Is(err, parse.ErrRelativeTime))
				}
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
			again, err := parse.Timestamp(got, parse.TimeOptions{})
			require.NoError(t, err)
			assert.Equal(t, got, again, "idempotent")
		})
	}
}

func TestURL(t *testing.T) {
	const page = "https://Shop.Example:443/a/b/page.html?x=1#frag"
	for _, tt := range []struct{ name, ref, want, err string }{
		{name: "Relative", ref: "../c/d?utm_source=x&z=2&a=1#top", want: "https://shop.example/a/c/d?a=1&z=2"},
		{name: "RootRelative", ref: "/p/1", want: "https://shop.example/p/1"},
		{name: "SchemeRelative", ref: "//CDN.example/img.png", want: "https://cdn.example/img.png"},
		{name: "Absolute", ref: "HTTP://Other.example:80/%7Euser", want: "http://other.example/~user"},
		{name: "AttributeWhitespace", ref: "\n  /p/1\t ", want: "https://shop.example/p/1"},
		{name: "NewlineInside", ref: "/p/\n1", want: "https://shop.example/p/1"},
		{name: "QueryOnly", ref: "?page=2", want: "https://shop.example/a/b/page.html?page=2"},
		{name: "FragmentOnly", ref: "#reviews", want: "https://shop.example/a/b/page.html?x=1"},
		{name: "Javascript", ref: "javascript:void(0)", err: `parse: URL "javascript:void(0)" on page`},
		{name: "Mailto", ref: "mailto:a@example.com", err: "(redacted: contains @)"},
		{name: "UserInfo", ref: "https://user:secret@example.com/", err: "user info"},
		{name: "Empty", ref: "  ", err: "empty reference"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parse.URL(page, tt.ref)
			if tt.err != "" {
				require.Error(t, err, "got %s", got)
				assert.Contains(t, err.Error(), tt.err)
				assert.NotContains(t, err.Error(), "secret")
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
			again, err := parse.URL(got, got)
			require.NoError(t, err)
			assert.Equal(t, got, again, "idempotent")
		})
	}
	t.Run("OwnNormalizer", func(t *testing.T) {
		n := job.NewNormalizer(job.WithTrackingParams("ref"))
		got, err := parse.URLWith(n, page, "/p?ref=home&id=2")
		require.NoError(t, err)
		assert.Equal(t, "https://shop.example/p?id=2", got)
	})
}

// FuzzTimestamp: Timestamp never panics and its output reads back unchanged.
func FuzzTimestamp(f *testing.F) {
	for _, s := range []string{"2026-04-23T10:15:00+02:00", "Thu, 23 Apr 2026 10:15:00 GMT", "23.04.2026 10:15",
		"2 hours ago", "2026-04-23", "Mon, 2 Jan 2006 15:04:05 GMT+3", "0000-01-01T00:00:00+23:59"} {
		f.Add(s)
	}
	zone := time.FixedZone("X", -9*3600-30*60)
	f.Fuzz(func(t *testing.T, s string) {
		got, err := parse.Timestamp(s, parse.TimeOptions{Zone: zone})
		if err != nil {
			return
		}
		again, err := parse.Timestamp(got, parse.TimeOptions{})
		if err != nil || again != got {
			t.Fatalf("%q ⇒ %q ⇒ %q, %v", s, got, again, err)
		}
	})
}

// FuzzURL: URL never panics, and a URL it returns resolves to itself.
func FuzzURL(f *testing.F) {
	for _, s := range []string{"../c/d?utm_source=x&z=2&a=1#top", "//CDN.example/x", "?q=%zz", "/a/%2e%2E/b", "\\\\host\\p", "http://[::1]:80/"} {
		f.Add("https://Shop.Example/a/b/page.html?x=1", s)
	}
	f.Fuzz(func(t *testing.T, page, ref string) {
		got, err := parse.URL(page, ref)
		if err != nil {
			return
		}
		again, err := parse.URL(got, got)
		if err != nil || again != got {
			t.Fatalf("URL(%q, %q) = %q, then %q, %v", page, ref, got, again, err)
		}
	})
}
