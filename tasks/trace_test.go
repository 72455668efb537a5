package tasks

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// TestRedactURLs: what a span may say of an error that quotes its request's URL: scheme,
// host and path; no userinfo, query or fragment.
func TestRedactURLs(t *testing.T) {
	in := `Get "http://127.0.0.1:8080/search?q=x&token=SECRETQ": proxyconnect tcp: dial tcp 127.0.0.1:9: connection refused; ` +
		`see https://user:pw@shop.example/p/1?sid=abc#frag and ws://h:1/ws?t=1`
	out := RedactURLs(in)
	for _, secret := range []string{"SECRETQ", "token", "sid=abc", "user:pw", "#frag", "t=1"} {
		assert.NotContains(t, out, secret)
	}
	assert.Contains(t, out, `Get "http://127.0.0.1:8080/search": proxyconnect tcp`)
	assert.Contains(t, out, "https://shop.example/p/1")
	assert.Contains(t, out, "ws://h:1/ws")
	assert.Equal(t, "no URL here", RedactURLs("no URL here"))
}
