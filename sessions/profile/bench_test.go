package profile_test

import (
	"math/rand/v2"
	"net/http"
	"testing"

	"github.com/idemscrape/idemscrape/sessions/profile"
)

// BenchmarkApply is the per-request cost of the profile on the colly path: Apply on a
// request header that already has a step's header.
func BenchmarkApply(b *testing.B) {
	p, _ := profile.Named("chrome-win")
	b.ReportAllocs()
	for b.Loop() {
		h := http.Header{"X-Step": {"1"}}
		p.Apply(h)
	}
}

// BenchmarkPick is the per-session cost of choosing a profile.
func BenchmarkPick(b *testing.B) {
	rnd := rand.New(rand.NewPCG(1, 2))
	o := profile.Options{Locales: []string{"en-US", "de-DE"}}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := profile.Pick(rnd, o); err != nil {
			b.Fatal(err)
		}
	}
}
