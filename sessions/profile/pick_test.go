package profile_test

import (
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/sessions/profile"
)

func picks(t *testing.T, rnd *rand.Rand, o profile.Options, n int) []profile.Profile {
	t.Helper()
	out := make([]profile.Profile, n)
	for i := range out {
		p, err := profile.Pick(rnd, o)
		require.NoError(t, err)
		out[i] = p
	}
	return out
}

func TestPick(t *testing.T) {
	t.Run("DeterministicForASeed", func(t *testing.T) {
		o := profile.Options{Locales: []string{"en-US", "de-DE", "fr-FR"}}
		a := picks(t, rand.New(rand.NewPCG(7, 11)), o, 200)
		b := picks(t, rand.New(rand.NewPCG(7, 11)), o, 200)
		c := picks(t, rand.New(rand.NewPCG(8, 11)), o, 200)
		assert.Equal(t, a, b, "the same seed gives the same profiles")
		assert.NotEqual(t, a, c, "another seed gives others")
	})

	t.Run("SpreadsLikeDesktopShares", func(t *testing.T) {
		byName := map[string]int{}
		byBrowser := map[string]int{}
		for _, p := range picks(t, rand.New(rand.NewPCG(1, 2)), profile.Options{}, 1000) {
			byName[p.Name]++
			byBrowser[p.Browser]++
		}
		for _, b := range []string{profile.Chrome, profile.Edge, profile.Firefox, profile.Safari} {
			assert.Positive(t, byBrowser[b], "%s never picked in 1,000: %v", b, byBrowser)
		}
		for _, p := range profile.All() {
			assert.Positive(t, byName[p.Name], "%s never picked in 1,000: %v", p.Name, byName)
		}
		// Weighted, not uniform: Chrome has three of eight profiles (37.5% uniform) but
		// about two thirds of desktop use; Chrome on Windows leads, Firefox on Linux trails.
		assert.Greater(t, byBrowser[profile.Chrome], 550, "Chrome's share: %v", byBrowser)
		assert.Greater(t, byBrowser[profile.Edge], byBrowser[profile.Firefox], "%v", byBrowser)
		for name, n := range byName {
			if name != "chrome-win" {
				assert.Greater(t, byName["chrome-win"], n, "chrome-win is the most common: %v", byName)
			}
		}
		assert.Less(t, byName["firefox-linux"], 50, "%v", byName)
	})

	t.Run("ChromiumOnly", func(t *testing.T) {
		byBrowser := map[string]int{}
		for _, p := range picks(t, rand.New(rand.NewPCG(3, 4)), profile.Options{ChromiumOnly: true}, 1000) {
			assert.True(t, p.Chromium(), "%s is not Chromium-family", p.Name)
			assert.NotNil(t, p.Hints)
			byBrowser[p.Browser]++
		}
		assert.Positive(t, byBrowser[profile.Chrome])
		assert.Positive(t, byBrowser[profile.Edge])
		assert.Len(t, byBrowser, 2, "%v", byBrowser)

		for _, p := range picks(t, rand.New(rand.NewPCG(3, 4)), profile.Options{ChromiumOnly: true, Browsers: []string{"edge", "firefox"}}, 100) {
			assert.Equal(t, profile.Edge, p.Browser, "ChromiumOnly and Browsers both apply")
		}
	})

	t.Run("Browsers", func(t *testing.T) {
		byBrowser := map[string]int{}
		for _, p := range picks(t, rand.New(rand.NewPCG(5, 6)), profile.Options{Browsers: []string{"Firefox", "safari"}}, 1000) {
			byBrowser[p.Browser]++
		}
		assert.Positive(t, byBrowser[profile.Firefox], "letter case of a browser name is ignored: %v", byBrowser)
		assert.Positive(t, byBrowser[profile.Safari])
		assert.Len(t, byBrowser, 2, "%v", byBrowser)
	})

	t.Run("Locales", func(t *testing.T) {
		for _, p := range picks(t, rand.New(rand.NewPCG(9, 9)), profile.Options{Locales: []string{"de-DE"}}, 100) {
			assert.Equal(t, "de-DE", p.Locale)
			assert.True(t, strings.HasPrefix(p.AcceptLanguage, "de-DE,de;q="), "%s: %q", p.Name, p.AcceptLanguage)
			assert.Equal(t, "de-DE", p.Languages[0])
		}
		byLocale := map[string]int{}
		for _, p := range picks(t, rand.New(rand.NewPCG(9, 9)), profile.Options{Locales: []string{"en-GB", "ja", "pt-br"}}, 300) {
			byLocale[p.Locale]++
			assert.True(t, strings.HasPrefix(p.AcceptLanguage, p.Locale), "%s: %q", p.Locale, p.AcceptLanguage)
		}
		assert.Equal(t, 3, len(byLocale), "every locale chosen: %v", byLocale)
		assert.Positive(t, byLocale["pt-BR"], "locales come out in canonical case: %v", byLocale)

		for _, p := range picks(t, rand.New(rand.NewPCG(9, 9)), profile.Options{}, 50) {
			assert.Equal(t, profile.DefaultLocale, p.Locale, "no locales means en-US")
		}
	})

	t.Run("NilRand", func(t *testing.T) {
		p, err := profile.Pick(nil, profile.Options{ChromiumOnly: true})
		require.NoError(t, err)
		assert.True(t, p.Chromium())
	})
}

func TestOptionsValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		o    profile.Options
		want []string // substrings of the error; none: valid
	}{
		{name: "Zero", o: profile.Options{}},
		{name: "ChromiumOnly", o: profile.Options{ChromiumOnly: true}},
		{name: "AnyCase", o: profile.Options{Browsers: []string{"Chrome", "EDGE"}, Locales: []string{"DE-de", "fr", "es-419"}}},
		{name: "UnknownBrowser", o: profile.Options{Browsers: []string{"chrome", "opera"}},
			want: []string{`unknown browser "opera"`, "chrome, edge, firefox, safari"}},
		{name: "MalformedLocale", o: profile.Options{Locales: []string{"en-US", "de_DE"}},
			want: []string{`locale "de_DE"`}},
		{name: "EmptyLocale", o: profile.Options{Locales: []string{""}},
			want: []string{`locale ""`}},
		{name: "WordLocale", o: profile.Options{Locales: []string{"english"}},
			want: []string{`locale "english"`}},
		{name: "EveryProblemNamed", o: profile.Options{Browsers: []string{"netscape", "lynx"}, Locales: []string{"x"}},
			want: []string{`"netscape"`, `"lynx"`, `locale "x"`}},
		{name: "ChromiumOnlyLeavesNothing", o: profile.Options{ChromiumOnly: true, Browsers: []string{"firefox", "safari"}},
			want: []string{"ChromiumOnly", `["firefox" "safari"]`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.o.Validate()
			_, pickErr := profile.Pick(rand.New(rand.NewPCG(1, 1)), tc.o)
			if len(tc.want) == 0 {
				assert.NoError(t, err)
				assert.NoError(t, pickErr)
				return
			}
			require.Error(t, err)
			for _, w := range tc.want {
				assert.Contains(t, err.Error(), w)
			}
			require.Error(t, pickErr, "Pick refuses invalid options")
			assert.Equal(t, err.Error(), pickErr.Error())
		})
	}
}
