package sessions_test

import (
	"bytes"
	"compress/flate"
	"compress/gzip"
	"compress/zlib"
	"context"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/andybalholm/brotli"
	"github.com/klauspost/compress/zstd"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/sessions/profile"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// encode compresses b with coding enc ("deflate-raw": raw deflate, as some servers send
// for deflate).
func encode(t *testing.T, enc string, b []byte) []byte {
	t.Helper()
	var out bytes.Buffer
	var w interface {
		Write([]byte) (int, error)
		Close() error
	}
	switch enc {
	case "gzip":
		w = gzip.NewWriter(&out)
	case "deflate":
		w = zlib.NewWriter(&out)
	case "deflate-raw":
		fw, err := flate.NewWriter(&out, flate.BestSpeed)
		require.NoError(t, err)
		w = fw
	case "br":
		w = brotli.NewWriterLevel(&out, 1)
	case "zstd":
		zw, err := zstd.NewWriter(&out, zstd.WithEncoderLevel(zstd.SpeedFastest))
		require.NoError(t, err)
		w = zw
	default:
		t.Fatalf("unknown coding %s", enc)
	}
	_, err := w.Write(b)
	require.NoError(t, err)
	require.NoError(t, w.Close())
	return out.Bytes()
}

// TestProfileAcceptEncoding: a session with a browser profile offers what that browser
// sends (Accept-Encoding: gzip, deflate, br, zstd for Chrome, Edge, Firefox and Safari on
// the loopback shop), one without a profile gzip only; br, zstd, deflate (zlib and raw)
// and gzip bodies are decoded; a decompression bomb of each coding is cut at the
// collector's body cap (body_too_large) after reading only the start of the compressed
// stream, which is what the wire count holds: compressed bytes, not decoded ones.
func TestProfileAcceptEncoding(t *testing.T) {
	const maxBody = 1 << 20
	rng := rand.New(rand.NewPCG(46, 3))
	words := []string{"price", "sku", "widget", "catalog", "red", "blue", "size", "in stock", "ships", "today"}
	var text bytes.Buffer
	for text.Len() < 256<<10 {
		text.WriteString(words[rng.IntN(len(words))])
		text.WriteByte(' ')
	}
	plain := text.Bytes()
	zeros := make([]byte, 64<<20) // 64 times the body cap once decoded
	codings := []string{"br", "zstd", "deflate", "deflate-raw", "gzip"}
	bodies, bombs := map[string][]byte{}, map[string][]byte{}
	for _, enc := range codings {
		bodies[enc], bombs[enc] = encode(t, enc, plain), encode(t, enc, zeros)
	}
	var (
		mu   sync.Mutex
		seen = map[string]string{} // ?s= → the Accept-Encoding it came with
	)
	site := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen[r.URL.Query().Get("s")] = r.Header.Get("Accept-Encoding")
		mu.Unlock()
		enc := strings.TrimPrefix(r.URL.Path, "/enc/")
		src := bodies
		if e, ok := strings.CutPrefix(r.URL.Path, "/bomb/"); ok {
			enc, src = e, bombs
		}
		b, ok := src[enc]
		if !ok {
			_, _ = w.Write([]byte("ok"))
			return
		}
		w.Header().Set("Content-Encoding", strings.TrimSuffix(enc, "-raw"))
		_, _ = w.Write(b)
	}))
	t.Cleanup(site.Close)
	e := setup(t, testutil.FakeProxyConfig{Seed: 46}, testutil.FakeSiteConfig{Seed: 46})
	collector := func(t *testing.T, p *profile.Profile) *sessions.Bound {
		t.Helper()
		s, err := e.provider.NewSession("US", time.Hour, time.Now())
		require.NoError(t, err)
		s.Profile = p
		b, err := sessions.NewCollector(context.Background(), s,
			&sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), MaxBodyBytes: maxBody, IgnoreRobotsTxt: true, RequestTimeout: 10 * time.Second})
		require.NoError(t, err)
		t.Cleanup(b.Close)
		return b
	}
	browserSends := map[string]string{
		profile.Chrome: "gzip, deflate, br, zstd", profile.Edge: "gzip, deflate, br, zstd",
		profile.Firefox: "gzip, deflate, br, zstd", profile.Safari: "gzip, deflate, br, zstd",
	}

	for _, p := range profile.All() {
		t.Run(p.Name, func(t *testing.T) {
			b := collector(t, &p)
			_, err := b.Get(site.URL + "/hello?s=" + p.Name)
			require.NoError(t, err)
			mu.Lock()
			got := seen[p.Name]
			mu.Unlock()
			assert.Equal(t, browserSends[p.Browser], got, "the Accept-Encoding %s sends", p.Browser)
			for _, enc := range codings {
				res, err := b.Get(site.URL + "/enc/" + enc)
				require.NoError(t, err, enc)
				assert.True(t, bytes.Equal(plain, res.Body), "%s: decoded (%d bytes, want %d)", enc, len(res.Body), len(plain))
			}
		})
	}

	t.Run("NoProfile", func(t *testing.T) {
		b := collector(t, nil)
		_, err := b.Get(site.URL + "/hello?s=none")
		require.NoError(t, err)
		mu.Lock()
		assert.Equal(t, "gzip", seen["none"], "gzip only, as before")
		mu.Unlock()
		res, err := b.Get(site.URL + "/enc/gzip")
		require.NoError(t, err)
		assert.True(t, bytes.Equal(plain, res.Body), "gzip decoded")
	})

	t.Run("WireBytesAreCompressed", func(t *testing.T) {
		chrome, ok := profile.Named("chrome-win")
		require.True(t, ok)
		for _, enc := range codings {
			b := collector(t, &chrome)
			_, err := b.Get(site.URL + "/enc/" + enc)
			require.NoError(t, err, enc)
			t.Logf("%s: %d bytes on the wire for %d on the wire of the body (%d decoded)", enc, b.Bytes(), len(bodies[enc]), len(plain))
			assert.Greater(t, b.Bytes(), int64(len(bodies[enc])), "%s: the compressed body is counted", enc)
			assert.Less(t, b.Bytes(), int64(len(bodies[enc])+2048), "%s: the compressed body, its headers and the request: not the decoded size", enc)
		}
	})

	for _, enc := range codings {
		t.Run("Bomb/"+enc, func(t *testing.T) {
			chrome, ok := profile.Named("chrome-win")
			require.True(t, ok)
			b := collector(t, &chrome)
			_, err := b.Get(site.URL + "/bomb/" + enc)
			require.Error(t, err)
			assert.ErrorIs(t, err, sessions.ErrBodyTooLarge)
			assert.Equal(t, tasks.CategoryBodyTooLarge, sessions.CategoryOf(err), "%s bomb: %v", enc, err)
			t.Logf("%s bomb: %d bytes compressed, %d decoded; %d read off the wire before the cap", enc, len(bombs[enc]), len(zeros), b.Bytes())
			assert.LessOrEqual(t, b.Bytes(), int64(len(bombs[enc])+4096), "%s: no more than the compressed stream was read", enc)
		})
	}
}

// catalogBodies fetches the catalog flow of sku (search, product page, price API) from
// site directly, offering acceptEncoding, and returns the body bytes the shop sent, as
// sent (compressed).
func catalogBodies(t *testing.T, site, sku, acceptEncoding string) int64 {
	t.Helper()
	jar, err := cookiejar.New(nil)
	require.NoError(t, err)
	c := &http.Client{Jar: jar, Transport: &http.Transport{DisableCompression: true}, Timeout: 10 * time.Second}
	var total int64
	get := func(u string) string {
		req, err := http.NewRequest(http.MethodGet, u, nil)
		require.NoError(t, err)
		req.Header.Set("Accept-Encoding", acceptEncoding)
		resp, err := c.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		raw, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode, u)
		total += int64(len(raw))
		dec, release, _, err := sessions.DecodeBody(resp.Header, bytes.NewReader(raw))
		require.NoError(t, err)
		defer release()
		plain, err := io.ReadAll(dec)
		require.NoError(t, err)
		return string(plain)
	}
	get(site + "/search?q=" + sku)
	page := get(site + "/product/" + sku)
	m := regexp.MustCompile(`name="price-token" content="([^"]+)"`).FindStringSubmatch(page)
	require.Len(t, m, 2, "the product page has its price token")
	get(site + "/api/price/" + sku + "?token=" + url.QueryEscape(m[1]))
	return total
}

// TestCatalogBrotliBytes measures what br saves over gzip on the fake shop's catalog
// pages (search, product page, price API): the same shop compressing with br
// (FakeSiteConfig.Encodings) and with gzip. The catalog unit runs through the proxy on a
// session with a Chrome profile (which offers both); the body bytes of the flow under
// br are at most 0.85 times those under gzip, and the proxy's bytes with the shop for
// the run are fewer too.
func TestCatalogBrotliBytes(t *testing.T) {
	skus := []string{"sku-1", "sku-2", "sku-3", "sku-4", "sku-5"}
	measure := func(enc string) (body, shop, client int64) {
		e := setup(t, testutil.FakeProxyConfig{Seed: 47}, testutil.FakeSiteConfig{Seed: 47, Encodings: []string{enc}})
		cfg := e.runCfg()
		cfg.Collector.IgnoreRobotsTxt = true
		cfg.Profiles = &profile.Options{Browsers: []string{profile.Chrome}, Locales: []string{"en-US"}}
		for _, sku := range skus {
			body += catalogBodies(t, e.site.URL, sku, "gzip, deflate, br, zstd")
			unit, err := catalog.Unit(e.site.URL, sku)
			require.NoError(t, err)
			res, err := unit.Run(context.Background(), cfg)
			require.NoError(t, err, "%s %s", enc, sku)
			shop += e.proxy.BytesFor(res.Session.ID)
			client += res.Bytes
		}
		return body, shop, client
	}
	brBody, brShop, brClient := measure("br")
	gzBody, gzShop, gzClient := measure("gzip")
	t.Logf("catalog flow of %d SKUs: body bytes br %d, gzip %d (%.3f); proxy↔shop br %d, gzip %d (%.3f); worker↔proxy br %d, gzip %d (%.3f)",
		len(skus), brBody, gzBody, float64(brBody)/float64(gzBody), brShop, gzShop, float64(brShop)/float64(gzShop),
		brClient, gzClient, float64(brClient)/float64(gzClient))
	assert.LessOrEqual(t, float64(brBody), 0.85*float64(gzBody), "br bodies at most 0.85 × gzip's")
	assert.Less(t, brShop, gzShop, "fewer bytes through the proxy")
}
