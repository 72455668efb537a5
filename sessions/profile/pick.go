package profile

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"regexp"
	"strconv"
	"strings"
)

// Options restrict the profiles Pick chooses from (per kind of job, say). The zero
// Options allow every built-in profile with DefaultLocale.
type Options struct {
	// Browsers are the browsers allowed: Chrome, Edge, Firefox, Safari ("chrome",
	// "edge", "firefox", "safari"; letter case is ignored). Empty allows all.
	Browsers []string
	// Locales are the locales a profile's Accept-Language is built from, one chosen at
	// random per pick: a language ("de") or a language and region ("de-DE"); letter case
	// is ignored. Empty means DefaultLocale.
	Locales []string
	// ChromiumOnly allows only Chromium-family profiles (Chrome, Edge): the ones a
	// rendering Chromium can present faithfully.
	ChromiumOnly bool
}

// Validate reports every unknown browser and malformed locale by name, and options that
// leave no built-in profile to choose from.
func (o Options) Validate() error {
	var errs []error
	for _, b := range o.Browsers {
		if !knownBrowser(b) {
			errs = append(errs, fmt.Errorf("profile: unknown browser %q (known: %s, %s, %s, %s)", b, Chrome, Edge, Firefox, Safari))
		}
	}
	for _, l := range o.Locales {
		if _, ok := canonicalLocale(l); !ok {
			errs = append(errs, fmt.Errorf("profile: locale %q is not a language tag like \"de\" or \"de-DE\"", l))
		}
	}
	if len(errs) == 0 && len(o.candidates()) == 0 {
		errs = append(errs, fmt.Errorf("profile: no built-in profile is a Chromium-family browser among %q (ChromiumOnly allows only %s and %s)", o.Browsers, Chrome, Edge))
	}
	return errors.Join(errs...)
}

// Pick chooses a profile for a new session: a built-in profile that o allows, with odds
// like desktop browser shares (Chrome on Windows most often, Firefox on Linux rarely),
// and one of o.Locales chosen uniformly. The same rnd state gives the same profile; a nil
// rnd uses math/rand/v2's global source. Pick returns o.Validate's error if o is invalid.
func Pick(rnd *rand.Rand, o Options) (Profile, error) {
	if err := o.Validate(); err != nil {
		return Profile{}, err
	}
	intN := rand.IntN
	if rnd != nil {
		intN = rnd.IntN
	}
	cands := o.candidates()
	total := 0
	for _, s := range cands {
		total += s.weight
	}
	n := intN(total)
	chosen := cands[len(cands)-1]
	for _, s := range cands {
		if n < s.weight {
			chosen = s
			break
		}
		n -= s.weight
	}
	locale := DefaultLocale
	switch len(o.Locales) {
	case 0:
	case 1:
		locale, _ = canonicalLocale(o.Locales[0])
	default:
		locale, _ = canonicalLocale(o.Locales[intN(len(o.Locales))])
	}
	return chosen.build(locale), nil
}

// candidates returns the built-in specs o allows, in table order.
func (o Options) candidates() []spec {
	var out []spec
	for _, s := range specs {
		if o.ChromiumOnly && s.browser != Chrome && s.browser != Edge {
			continue
		}
		if len(o.Browsers) > 0 && !containsFold(o.Browsers, s.browser) {
			continue
		}
		out = append(out, s)
	}
	return out
}

// Named returns the built-in profile called name ("chrome-win", "safari-mac", …) with
// DefaultLocale, and whether there is one.
func Named(name string) (Profile, bool) {
	for _, s := range specs {
		if s.name == name {
			return s.build(DefaultLocale), true
		}
	}
	return Profile{}, false
}

// All returns every built-in profile with DefaultLocale, in the table's order.
func All() []Profile {
	out := make([]Profile, len(specs))
	for i, s := range specs {
		out[i] = s.build(DefaultLocale)
	}
	return out
}

// WithLocale returns p with its Accept-Language and Languages built from locale ("de",
// "de-DE") the way p's browser builds them, or an error naming a malformed locale.
func (p Profile) WithLocale(locale string) (Profile, error) {
	l, ok := canonicalLocale(locale)
	if !ok {
		return p, fmt.Errorf("profile: locale %q is not a language tag like \"de\" or \"de-DE\"", locale)
	}
	if p.Hints != nil {
		p.Hints = p.Hints.clone()
	}
	p.setLocale(l)
	return p, nil
}

// setLocale sets Locale, Languages and AcceptLanguage for a canonical locale, with new
// slices.
//
// The language lists follow each browser's defaults for a user of that locale: Chrome and
// Edge list the locale, its language, and for a language other than English en-US and en
// ("de-DE,de;q=0.9,en-US;q=0.8,en;q=0.7"); Firefox lists the same with its own q-values
// ("de-DE,de;q=0.8,en-US;q=0.5,en;q=0.3", "en-US,en;q=0.5"); Safari lists only the
// locale and its language ("de-DE,de;q=0.9").
func (p *Profile) setLocale(locale string) {
	lang, region, _ := strings.Cut(locale, "-")
	langs := []string{locale}
	if region != "" {
		langs = append(langs, lang)
	}
	if lang != "en" && p.Browser != Safari {
		langs = append(langs, "en-US", "en")
	}
	p.Locale = locale
	p.Languages = langs
	if p.Browser == Firefox {
		p.AcceptLanguage = firefoxAcceptLanguage(langs)
	} else {
		p.AcceptLanguage = chromiumAcceptLanguage(langs)
	}
}

// chromiumAcceptLanguage is Accept-Language the way Chromium (and Safari) writes it: the
// first language bare, then q=0.9, 0.8, … down to 0.1.
func chromiumAcceptLanguage(langs []string) string {
	var b strings.Builder
	q := 10
	for i, l := range langs {
		if i == 0 {
			b.WriteString(l)
		} else {
			b.WriteString("," + l + ";q=0." + strconv.Itoa(q))
		}
		if q > 1 {
			q--
		}
	}
	return b.String()
}

// firefoxAcceptLanguage is Accept-Language the way Firefox writes it: language i of n
// gets q = 1 - i/n, rounded to one decimal (two from ten languages on, unless the second
// is 0).
func firefoxAcceptLanguage(langs []string) string {
	var b strings.Builder
	n := len(langs)
	for i, l := range langs {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(l)
		q := 1 - float64(i)/float64(n)
		u := int((q + 0.005) * 100) // hundredths, as Firefox rounds them
		if u >= 100 {
			continue
		}
		if n < 10 || u%10 == 0 {
			b.WriteString(";q=0." + strconv.Itoa((u+5)/10))
		} else {
			fmt.Fprintf(&b, ";q=0.%02d", u)
		}
	}
	return b.String()
}

var localeRE = regexp.MustCompile(`^([A-Za-z]{2,3})(?:-([A-Za-z]{2}|[0-9]{3}))?$`)

// canonicalLocale returns a locale in canonical case ("de-de" → "de-DE", "PT" → "pt"),
// or false if it is not a language subtag optionally followed by a region subtag.
func canonicalLocale(s string) (string, bool) {
	m := localeRE.FindStringSubmatch(s)
	if m == nil {
		return "", false
	}
	if m[2] == "" {
		return strings.ToLower(m[1]), true
	}
	return strings.ToLower(m[1]) + "-" + strings.ToUpper(m[2]), true
}

func knownBrowser(b string) bool {
	return containsFold([]string{Chrome, Edge, Firefox, Safari}, b)
}

func containsFold(list []string, s string) bool {
	for _, x := range list {
		if strings.EqualFold(x, s) {
			return true
		}
	}
	return false
}
