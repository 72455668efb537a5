package sessions

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
)

// regexpFill is how a template was filled before it was parsed once: the two regular
// expressions run on every session. TestTemplateFillSameAsRegexp holds the parsed
// templates to its answers.
func regexpFill(tmpl string, vars map[string]string) string {
	tmpl = optionalGroup.ReplaceAllStringFunc(tmpl, func(group string) string {
		inner := group[1 : len(group)-1]
		for _, m := range templateVar.FindAllStringSubmatch(inner, -1) {
			if vars[m[1]] == "" {
				return ""
			}
		}
		return inner
	})
	return templateVar.ReplaceAllStringFunc(tmpl, func(v string) string { return vars[v[1:len(v)-1]] })
}

func TestTemplateFillSameAsRegexp(t *testing.T) {
	templates := []string{
		"brd-customer-{user}-zone-z[-country-{country}]-session-{session}",
		"customer-{user}[-cc-{COUNTRY}]-sessid-{session}-sesstime-{minutes}",
		"user-{user}[-country-{country}]-session-{session}-sessionduration-{minutes}",
		"{pass}[_country-{country}]_session-{session}_lifetime-{lifetime}",
		"package-{user}[-country-{country}]-sessionid-{session}-sessionlength-{seconds}",
		"{user}", "plain", "[]", "a[]b", "[no placeholder]", "[{country}][{session}]",
		"x[a[{country}]b]y", "[unclosed-{country}", "closed]-{country}", "[[{country}]]",
		"{user}[-{country}-{session}]-end", "[{country}{COUNTRY}]", "{{user}}", "[-{country}]{country}[x]",
	}
	for _, country := range []string{"", "us", "DE"} {
		vars := map[string]string{"user": "acct", "pass": "secret", "country": strings.ToLower(country), "COUNTRY": strings.ToUpper(country),
			"session": "ab12cd34", "minutes": "10", "seconds": "600", "lifetime": "10m"}
		var tv templateVars
		for name, v := range vars {
			tv[varIndex[name]] = v
		}
		for _, tmpl := range templates {
			assert.Equal(t, regexpFill(tmpl, vars), parseTemplate(tmpl).fill(&tv), "template %q, country %q", tmpl, country)
		}
	}
}

// BenchmarkCredentialsFor: the templates of one session filled (the Oxylabs format), as
// parsed templates (Parsed, what NewSession does) and as the regular expressions did
// (Regexp, the reference).
func BenchmarkCredentialsFor(b *testing.B) {
	p, err := Oxylabs("acct", "secret")
	if err != nil {
		b.Fatal(err)
	}
	b.Run("Parsed", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_, _ = p.credentialsFor("US", "ab12cd34", DefaultSessionLifetime)
		}
	})
	b.Run("Regexp", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			vars := map[string]string{"user": "acct", "pass": "secret", "country": "us", "COUNTRY": "US",
				"session": "ab12cd34", "minutes": "10", "seconds": "600", "lifetime": "10m"}
			_, _ = regexpFill(p.userTmpl, vars), regexpFill(p.passTmpl, vars)
		}
	})
}
