package profile_test

import (
	"encoding/json"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/sessions/profile"
)

// What each browser really sends as Accept on a top-level navigation, written out here
// independently of the package's table.
var navigationAccept = map[string]string{
	profile.Chrome:  "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,image/apng,*/*;q=0.8,application/signed-exchange;v=b3;q=0.7",
	profile.Edge:    "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,image/apng,*/*;q=0.8,application/signed-exchange;v=b3;q=0.7",
	profile.Firefox: "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8",
	profile.Safari:  "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8",
}

// uaOS reads the operating system a UA string names.
func uaOS(ua string) string {
	switch {
	case strings.Contains(ua, "(Windows NT 10.0; Win64; x64"):
		return profile.Windows
	case strings.Contains(ua, "(Macintosh; Intel Mac OS X 10"):
		return profile.MacOS
	case strings.Contains(ua, "(X11; Linux x86_64"):
		return profile.Linux
	}
	return "unknown"
}

var (
	edgeRE    = regexp.MustCompile(`AppleWebKit/537\.36 \(KHTML, like Gecko\) Chrome/(\d+)\.0\.0\.0 Safari/537\.36 Edg/(\d+)\.0\.0\.0$`)
	chromeRE  = regexp.MustCompile(`AppleWebKit/537\.36 \(KHTML, like Gecko\) Chrome/(\d+)\.0\.0\.0 Safari/537\.36$`)
	firefoxRE = regexp.MustCompile(`; rv:(\d+\.\d+)\) Gecko/20100101 Firefox/(\d+\.\d+)$`)
	safariRE  = regexp.MustCompile(`\) AppleWebKit/605\.1\.15 \(KHTML, like Gecko\) Version/(\d+\.\d+) Safari/605\.1\.15$`)
	greaseRE  = regexp.MustCompile(`^Not[ ():\-./;=?_]A[ ():\-./;=?_]Brand$`)
)

// uaBrowser reads the browser and its version (major for Chrome and Edge, full for
// Firefox and Safari) from a UA string; for Chrome and Edge also the Chrome/ token's major.
func uaBrowser(t *testing.T, ua string) (browser, version, chromeMajor string) {
	t.Helper()
	if m := edgeRE.FindStringSubmatch(ua); m != nil {
		return profile.Edge, m[2], m[1]
	}
	if m := chromeRE.FindStringSubmatch(ua); m != nil {
		return profile.Chrome, m[1], m[1]
	}
	if m := firefoxRE.FindStringSubmatch(ua); m != nil {
		require.Equal(t, m[1], m[2], "Firefox's rv: and Firefox/ tokens differ in %q", ua)
		return profile.Firefox, m[2], ""
	}
	if m := safariRE.FindStringSubmatch(ua); m != nil {
		return profile.Safari, m[1], ""
	}
	t.Fatalf("no known browser in UA %q", ua)
	return "", "", ""
}

func major(v string) string {
	head, _, _ := strings.Cut(v, ".")
	return head
}

func TestBuiltInProfilesAreCoherent(t *testing.T) {
	all := profile.All()
	require.Len(t, all, 8, "Chrome on Windows/macOS/Linux, Edge on Windows, Firefox on Windows/Linux/macOS, Safari on macOS")
	navigatorPlatform := map[string]string{profile.Windows: "Win32", profile.MacOS: "MacIntel", profile.Linux: "Linux x86_64"}
	nameOS := map[string]string{"win": profile.Windows, "mac": profile.MacOS, "linux": profile.Linux}
	ownBrand := map[string]string{profile.Chrome: "Google Chrome", profile.Edge: "Microsoft Edge"}
	seen := map[string]bool{}

	for _, p := range all {
		t.Run(p.Name, func(t *testing.T) {
			require.False(t, seen[p.Name], "duplicate name")
			seen[p.Name] = true

			browser, version, chromeMajor := uaBrowser(t, p.UserAgent)
			assert.Equal(t, p.Browser, browser, "the UA's browser is the profile's")
			nb, no, _ := strings.Cut(p.Name, "-")
			assert.Equal(t, p.Browser, nb, "the name starts with the browser")
			assert.Equal(t, p.OS, nameOS[no], "the name ends with the OS")
			assert.Equal(t, p.OS, uaOS(p.UserAgent), "the UA's OS is the profile's")
			assert.Equal(t, navigatorPlatform[p.OS], p.NavigatorPlatform, "navigator.platform fits the OS")
			assert.Equal(t, navigationAccept[p.Browser], p.Accept, "Accept is the browser's navigation Accept")
			assert.True(t, p.UpgradeInsecureRequests)
			assert.Equal(t, profile.DefaultLocale, p.Locale)
			assert.Equal(t, []string{"en-US", "en"}, p.Languages)
			if p.Browser == profile.Firefox {
				assert.Equal(t, "en-US,en;q=0.5", p.AcceptLanguage)
			} else {
				assert.Equal(t, "en-US,en;q=0.9", p.AcceptLanguage)
			}
			h := p.Headers()

			if !p.Chromium() {
				assert.Contains(t, []string{profile.Firefox, profile.Safari}, p.Browser)
				assert.Nil(t, p.Hints, "Firefox and Safari send no client hints")
				for k := range h {
					assert.False(t, strings.HasPrefix(strings.ToLower(k), "sec-ch-"), "%s on a %s profile", k, p.Browser)
				}
				assert.Equal(t, p.Version, version, "the UA's version is the profile's")
				return
			}

			assert.Contains(t, []string{profile.Chrome, profile.Edge}, p.Browser)
			require.NotNil(t, p.Hints, "a Chromium-family profile has client hints")
			c := p.Hints
			assert.Equal(t, major(p.Version), version, "the UA's major version is the profile's")
			assert.Equal(t, version, chromeMajor, "Edge's Chrome/ token is its own major")
			assert.Equal(t, p.OS, c.Platform, "sec-ch-ua-platform is the UA's OS")
			assert.False(t, c.Mobile)
			assert.Empty(t, c.Model)
			assert.NotEmpty(t, c.PlatformVersion)
			assert.Contains(t, []string{"x86", "arm"}, c.Architecture)
			assert.Equal(t, "64", c.Bitness)
			assert.Equal(t, []string{"Desktop"}, c.FormFactors)

			require.Len(t, c.Brands, 3, "GREASE, Chromium and the browser's own brand")
			require.Len(t, c.FullVersionList, 3)
			versions := map[string]string{}
			grease := 0
			for i, b := range c.Brands {
				full := c.FullVersionList[i]
				assert.Equal(t, b.Brand, full.Brand, "both lists in the same order")
				assert.Equal(t, b.Version, major(full.Version), "%s: the full version's major is the brand's", b.Brand)
				assert.NotContains(t, b.Brand, "Headless")
				if greaseRE.MatchString(b.Brand) {
					grease++
					assert.Contains(t, []string{"8", "99", "24"}, b.Version, "GREASE version")
					assert.Equal(t, b.Version+".0.0.0", full.Version)
					continue
				}
				versions[b.Brand] = b.Version
			}
			assert.Equal(t, 1, grease, "exactly one GREASE brand in %v", c.Brands)
			assert.Equal(t, map[string]string{"Chromium": version, ownBrand[p.Browser]: version}, versions,
				"Chromium and the browser's brand carry the UA's major version")
			assert.Equal(t, p.Version, c.FullVersionList[slicesIndex(c.FullVersionList, ownBrand[p.Browser])].Version,
				"the own brand's full version is the profile's")
			assert.Equal(t, `"`+p.OS+`"`, h.Get("Sec-Ch-Ua-Platform"))
		})
	}
}

func slicesIndex(bs []profile.Brand, brand string) int {
	for i, b := range bs {
		if b.Brand == brand {
			return i
		}
	}
	return -1
}

// formatBrands writes a brand list as Chrome writes sec-ch-ua (test-side, so a mistake
// in the package's formatter does not hide here).
func formatBrands(bs []profile.Brand) string {
	parts := make([]string, len(bs))
	for i, b := range bs {
		parts[i] = strconv.Quote(b.Brand) + ";v=" + strconv.Quote(b.Version)
	}
	return strings.Join(parts, ", ")
}

func TestHeaders(t *testing.T) {
	for _, p := range profile.All() {
		t.Run(p.Name, func(t *testing.T) {
			h := p.Headers()
			want := http.Header{
				"User-Agent":                {p.UserAgent},
				"Accept":                    {p.Accept},
				"Accept-Language":           {p.AcceptLanguage},
				"Upgrade-Insecure-Requests": {"1"},
			}
			if p.Chromium() {
				want["Sec-Ch-Ua"] = []string{formatBrands(p.Hints.Brands)}
				want["Sec-Ch-Ua-Mobile"] = []string{"?0"}
				want["Sec-Ch-Ua-Platform"] = []string{`"` + p.Hints.Platform + `"`}
			}
			assert.Empty(t, cmp.Diff(want, h), "(-want +got)")
			assert.Empty(t, h.Values("Accept-Encoding"), "Go's transport owns Accept-Encoding")
			for k := range h {
				assert.False(t, strings.HasPrefix(k, "Sec-Fetch-"), "%s depends on the request, not the profile", k)
			}
			again := p.Headers()
			h.Set("User-Agent", "changed")
			assert.Equal(t, p.UserAgent, again.Get("User-Agent"), "each call returns a new map")
		})
	}
	assert.Empty(t, profile.Profile{}.Headers(), "the zero Profile sets nothing")
}

func TestHeadersForLeavesClientHintsOffPlainHTTP(t *testing.T) {
	p, ok := profile.Named("chrome-win")
	require.True(t, ok)
	for _, tc := range []struct {
		url   string
		hints bool
	}{
		{"https://shop.example/p/1", true},
		{"wss://shop.example/socket", true},
		{"http://shop.example/p/1", false},
		{"HTTP://SHOP.EXAMPLE/", false},
		{"http://10.0.0.1/", false},
		{"http://127.0.0.1:8080/", true},
		{"http://[::1]:8080/", true},
		{"http://localhost/", true},
		{"http://app.localhost/", true},
	} {
		t.Run(tc.url, func(t *testing.T) {
			u, err := url.Parse(tc.url)
			require.NoError(t, err)
			h := p.HeadersFor(u)
			assert.Equal(t, p.UserAgent, h.Get("User-Agent"), "the rest of the profile is sent either way")
			assert.Equal(t, "1", h.Get("Upgrade-Insecure-Requests"))
			for _, k := range []string{"Sec-Ch-Ua", "Sec-Ch-Ua-Mobile", "Sec-Ch-Ua-Platform"} {
				assert.Equal(t, tc.hints, h.Get(k) != "", "%s on %s", k, tc.url)
			}
			applied := http.Header{}
			p.ApplyFor(applied, u)
			assert.Empty(t, cmp.Diff(h, applied), "ApplyFor sets HeadersFor (-HeadersFor +applied)")
		})
	}
	assert.Empty(t, cmp.Diff(p.Headers(), p.HeadersFor(nil)), "a nil URL is treated as secure")
}

func TestApply(t *testing.T) {
	p, ok := profile.Named("edge-win")
	require.True(t, ok)

	t.Run("FillsAnEmptyHeader", func(t *testing.T) {
		h := http.Header{}
		p.Apply(h)
		assert.Empty(t, cmp.Diff(p.Headers(), h), "(-want +got)")
	})
	t.Run("StepHeaderWins", func(t *testing.T) {
		h := http.Header{}
		h.Set("User-Agent", "step-ua")
		h.Set("Accept", "application/json")
		h.Set("X-Step", "1")
		p.Apply(h)
		assert.Equal(t, []string{"step-ua"}, h.Values("User-Agent"), "the step's User-Agent is kept, not added to")
		assert.Equal(t, []string{"application/json"}, h.Values("Accept"))
		assert.Equal(t, []string{"1"}, h.Values("X-Step"))
		assert.Equal(t, p.AcceptLanguage, h.Get("Accept-Language"), "the headers the step did not set come from the profile")
		assert.Equal(t, p.Headers().Get("Sec-Ch-Ua"), h.Get("Sec-Ch-Ua"))
	})
	t.Run("NilValueSuppresses", func(t *testing.T) {
		h := http.Header{"Upgrade-Insecure-Requests": nil}
		p.Apply(h)
		assert.Nil(t, h["Upgrade-Insecure-Requests"], "a key set to nil keeps the profile's header off")
	})
	t.Run("KeyInAnyCase", func(t *testing.T) {
		h := http.Header{"sec-ch-ua": {`"Custom";v="1"`}}
		p.Apply(h)
		assert.NotContains(t, h, "Sec-Ch-Ua", "a raw lower-case key counts as set")
		assert.Equal(t, []string{`"Custom";v="1"`}, h["sec-ch-ua"]) //nolint:staticcheck // the raw, non-canonical key is the point
	})
}

// chromiumAcceptLanguage builds Accept-Language from a comma-separated language list the
// way Chromium does with an acceptLanguage override (HttpUtil::GenerateAcceptLanguageHeader:
// the first bare, then q=0.9, 0.8, …, never below 0.1).
func chromiumAcceptLanguage(list string) string {
	q := 10
	var out []string
	for _, l := range strings.Split(list, ",") {
		l = strings.TrimSpace(l)
		if q == 10 {
			out = append(out, l)
		} else {
			out = append(out, l+";q=0."+strconv.Itoa(q))
		}
		if q > 1 {
			q--
		}
	}
	return strings.Join(out, ",")
}

func TestUserAgentOverrideMatchesHeaders(t *testing.T) {
	for _, p := range profile.All() {
		for _, locale := range []string{"en-US", "de-DE", "fr"} {
			p, err := p.WithLocale(locale)
			require.NoError(t, err)
			t.Run(p.String(), func(t *testing.T) {
				h := p.Headers()
				o := p.UserAgentOverride()
				assert.Equal(t, h.Get("User-Agent"), o.UserAgent)
				assert.Equal(t, p.NavigatorPlatform, o.Platform)
				assert.Equal(t, strings.Join(p.Languages, ","), o.AcceptLanguage)
				if !p.Chromium() {
					assert.Nil(t, o.UserAgentMetadata, "no client hints for %s", p.Browser)
					return
				}
				assert.Equal(t, h.Get("Accept-Language"), chromiumAcceptLanguage(o.AcceptLanguage),
					"Chromium builds the profile's Accept-Language from the override")
				m := o.UserAgentMetadata
				require.NotNil(t, m)
				brands := make([]profile.Brand, len(m.Brands))
				for i, b := range m.Brands {
					brands[i] = profile.Brand{Brand: b.Brand, Version: b.Version}
				}
				assert.Equal(t, h.Get("Sec-Ch-Ua"), formatBrands(brands), "same brands, same order")
				require.Len(t, m.FullVersionList, len(m.Brands))
				for i, b := range m.FullVersionList {
					assert.Equal(t, m.Brands[i].Brand, b.Brand)
					assert.Equal(t, m.Brands[i].Version, major(b.Version))
				}
				assert.Equal(t, h.Get("Sec-Ch-Ua-Platform"), `"`+m.Platform+`"`)
				assert.Equal(t, h.Get("Sec-Ch-Ua-Mobile"), map[bool]string{false: "?0", true: "?1"}[m.Mobile])
				assert.Equal(t, p.Hints.PlatformVersion, m.PlatformVersion)
				assert.Equal(t, p.Hints.Architecture, m.Architecture)
				assert.Equal(t, "", m.Model)

				m.Brands[0].Brand = "changed"
				m.FormFactors[0] = "changed"
				assert.NotEqual(t, "changed", p.Hints.Brands[0].Brand, "the override shares nothing with the profile")
				assert.Equal(t, []string{"Desktop"}, p.Hints.FormFactors)
			})
		}
	}
}

// TestUserAgentOverrideWireForm checks the JSON Chromium receives for
// Emulation.setUserAgentOverride: the parameter names of the DevTools protocol.
func TestUserAgentOverrideWireForm(t *testing.T) {
	p, ok := profile.Named("chrome-mac")
	require.True(t, ok)
	raw, err := json.Marshal(p.UserAgentOverride())
	require.NoError(t, err)
	var got map[string]any
	require.NoError(t, json.Unmarshal(raw, &got))
	assert.Equal(t, p.UserAgent, got["userAgent"])
	assert.Equal(t, "en-US,en", got["acceptLanguage"])
	assert.Equal(t, "MacIntel", got["platform"])
	md, ok := got["userAgentMetadata"].(map[string]any)
	require.True(t, ok, "userAgentMetadata in %s", raw)
	assert.Equal(t, "macOS", md["platform"])
	assert.Equal(t, p.Hints.PlatformVersion, md["platformVersion"])
	assert.Equal(t, "arm", md["architecture"])
	assert.Equal(t, "", md["model"])
	assert.Equal(t, false, md["mobile"])
	assert.Len(t, md["brands"], 3)
	assert.Len(t, md["fullVersionList"], 3)

	ff, ok := profile.Named("firefox-win")
	require.True(t, ok)
	raw, err = json.Marshal(ff.UserAgentOverride())
	require.NoError(t, err)
	assert.NotContains(t, string(raw), "userAgentMetadata", "no client hints for Firefox")
}

func TestWithLocale(t *testing.T) {
	for _, tc := range []struct {
		name, locale, wantLocale, want string
	}{
		{"chrome-win", "de-DE", "de-DE", "de-DE,de;q=0.9,en-US;q=0.8,en;q=0.7"},
		{"chrome-win", "en-GB", "en-GB", "en-GB,en;q=0.9"},
		{"chrome-win", "EN-gb", "en-GB", "en-GB,en;q=0.9"},
		{"edge-win", "fr", "fr", "fr,en-US;q=0.9,en;q=0.8"},
		{"firefox-linux", "de", "de", "de,en-US;q=0.7,en;q=0.3"}, // Firefox's German build default
		{"firefox-win", "de-DE", "de-DE", "de-DE,de;q=0.8,en-US;q=0.5,en;q=0.3"},
		{"firefox-mac", "en-US", "en-US", "en-US,en;q=0.5"},
		{"safari-mac", "de-DE", "de-DE", "de-DE,de;q=0.9"},
		{"safari-mac", "ja-JP", "ja-JP", "ja-JP,ja;q=0.9"},
	} {
		t.Run(tc.name+"/"+tc.locale, func(t *testing.T) {
			p, ok := profile.Named(tc.name)
			require.True(t, ok)
			got, err := p.WithLocale(tc.locale)
			require.NoError(t, err)
			assert.Equal(t, tc.wantLocale, got.Locale)
			assert.Equal(t, tc.want, got.AcceptLanguage)
			assert.Equal(t, tc.want, got.Headers().Get("Accept-Language"))
			assert.Equal(t, "en-US", p.Locale, "WithLocale leaves its receiver alone")
		})
	}
	p, _ := profile.Named("chrome-win")
	de, err := p.WithLocale("de-DE")
	require.NoError(t, err)
	de.Hints.Brands[0].Brand = "changed"
	de.Hints.FormFactors[0] = "changed"
	assert.NotEqual(t, "changed", p.Hints.Brands[0].Brand, "WithLocale's profile shares nothing with its receiver")
	assert.Equal(t, []string{"Desktop"}, p.Hints.FormFactors)

	_, err = p.WithLocale("de_DE")
	require.Error(t, err)
	assert.Contains(t, err.Error(), `"de_DE"`)
}

func TestNamedAndAll(t *testing.T) {
	for _, p := range profile.All() {
		got, ok := profile.Named(p.Name)
		require.True(t, ok, p.Name)
		assert.Empty(t, cmp.Diff(p, got), "(-All +Named)")
	}
	_, ok := profile.Named("opera-win")
	assert.False(t, ok)

	all := profile.All()
	all[0].Hints.Brands[0].Brand = "changed"
	all[0].Languages[0] = "changed"
	again := profile.All()
	assert.NotEqual(t, "changed", again[0].Hints.Brands[0].Brand, "a returned profile shares nothing with the table")
	assert.NotEqual(t, "changed", again[0].Languages[0])
}

func TestProfileSurvivesJSON(t *testing.T) {
	for _, p := range profile.All() {
		p, err := p.WithLocale("pt-BR")
		require.NoError(t, err)
		raw, err := json.Marshal(p)
		require.NoError(t, err)
		var back profile.Profile
		require.NoError(t, json.Unmarshal(raw, &back))
		assert.Empty(t, cmp.Diff(p, back), "%s (-stored +loaded)", p.Name)
		assert.Empty(t, cmp.Diff(p.Headers(), back.Headers()))
	}
}
