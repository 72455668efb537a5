package profile_test

import (
	"net/url"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/idemscrape/idemscrape/sessions/profile"
)

// TestAcceptEncodingFor: each built-in browser's Accept-Encoding — br and zstd offered to
// potentially trustworthy origins, and by Chrome, Edge and Firefox only to those — and
// none in Headers.
func TestAcceptEncodingFor(t *testing.T) {
	secure := []*url.URL{nil, {Scheme: "https", Host: "shop.example"}, {Scheme: "http", Host: "127.0.0.1:8080"}, {Scheme: "http", Host: "localhost"}}
	insecure := &url.URL{Scheme: "http", Host: "shop.example"}
	for _, p := range profile.All() {
		for _, u := range secure {
			assert.Equal(t, "gzip, deflate, br, zstd", p.AcceptEncodingFor(u), "%s to %v", p.Name, u)
		}
		want := "gzip, deflate"
		if p.Browser == profile.Safari {
			want = "gzip, deflate, br, zstd"
		}
		assert.Equal(t, want, p.AcceptEncodingFor(insecure), "%s to %v", p.Name, insecure)
		assert.Empty(t, p.Headers().Values("Accept-Encoding"), "%s: not in Headers", p.Name)
	}
	assert.Empty(t, profile.Profile{}.AcceptEncodingFor(nil), "the zero Profile sets nothing")
}
