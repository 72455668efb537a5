package testutil

import (
	"bytes"
	"compress/gzip"
	"crypto/tls"
	"encoding/binary"
	"encoding/json"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var (
	fsExitRe   = regexp.MustCompile(`<body data-exit="([0-9.]+)">`)
	fsLinkRe   = regexp.MustCompile(`href="(/product/[^"]+)"`)
	fsTokenRe  = regexp.MustCompile(`<meta name="price-token" content="([0-9a-f]+)">`)
	fsNameRe   = regexp.MustCompile(`<h1 class="name">([^<]+)</h1>`)
	fsCurrency = regexp.MustCompile(`<span class="currency">([A-Z]{3})</span>`)
)

// fsJarClient is a plain client with its own cookie jar; proxy may be nil.
func fsJarClient(t *testing.T, proxy *url.URL, tlsCfg *tls.Config) *http.Client {
	t.Helper()
	jar, err := cookiejar.New(nil)
	require.NoError(t, err)
	tr := &http.Transport{TLSClientConfig: tlsCfg}
	if proxy != nil {
		tr.Proxy = http.ProxyURL(proxy)
	}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Jar: jar, Transport: tr, Timeout: 10 * time.Second}
}

// fsScrape runs the search → product → price chain for sku and returns the three bodies
// and the exit each step was served to.
func fsScrape(t *testing.T, c *http.Client, base, sku string) (price map[string]string, exits []string) {
	t.Helper()
	status, hdr, body, err := fpGet(c, base+"/search?q="+sku)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, status)
	exits = append(exits, fsExitRe.FindStringSubmatch(body)[1])
	assert.Equal(t, exits[0], hdr.Get("X-Exit"))
	link := fsLinkRe.FindStringSubmatch(body)
	require.NotNil(t, link, body)

	status, _, body, err = fpGet(c, base+link[1])
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, status, body)
	exits = append(exits, fsExitRe.FindStringSubmatch(body)[1])
	token := fsTokenRe.FindStringSubmatch(body)
	require.NotNil(t, token, body)

	status, _, body, err = fpGet(c, base+"/api/price/"+sku+"?token="+token[1])
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, status, body)
	require.NoError(t, json.Unmarshal([]byte(body), &price))
	exits = append(exits, price["exit"])
	return price, exits
}

func TestFakeSite(t *testing.T) {
	t.Run("CookieTokenPriceChain", func(t *testing.T) {
		s := NewFakeSite(t, FakeSiteConfig{Seed: 1})
		c := fsJarClient(t, nil, nil)
		want, ok := s.Product("sku-7")
		require.True(t, ok)

		_, _, body, err := fpGet(c, s.URL+"/search?q=sku-7")
		require.NoError(t, err)
		_, _, body, err = fpGet(c, s.URL+fsLinkRe.FindStringSubmatch(body)[1])
		require.NoError(t, err)
		assert.Equal(t, want.Name, fsNameRe.FindStringSubmatch(body)[1])
		assert.Equal(t, "USD", fsCurrency.FindStringSubmatch(body)[1])

		price, exits := fsScrape(t, c, s.URL, "sku-7")
		assert.Equal(t, map[string]string{"sku": "sku-7", "price": want.Price, "currency": "USD", "exit": "127.0.0.1"}, price)
		assert.Equal(t, []string{"127.0.0.1", "127.0.0.1", "127.0.0.1"}, exits)
		assert.Regexp(t, `^[0-9]+\.[0-9]{2}$`, want.Price)

		u, _ := url.Parse(s.URL)
		sid := c.Jar.Cookies(u)[0].Value
		assert.Equal(t, "127.0.0.1", s.ExitOfSID(sid))
		assert.Equal(t, "", s.ExitOfSID("nope"))
	})

	t.Run("MissingCookieOrTokenRefused", func(t *testing.T) {
		s := NewFakeSite(t, FakeSiteConfig{})
		c := fsJarClient(t, nil, nil)
		_, _, body, err := fpGet(c, s.URL+"/search?q=sku-3")
		require.NoError(t, err)
		_, _, body, err = fpGet(c, s.URL+fsLinkRe.FindStringSubmatch(body)[1])
		require.NoError(t, err)
		token := fsTokenRe.FindStringSubmatch(body)[1]
		_, _, body, err = fpGet(c, s.URL+"/product/sku-4")
		require.NoError(t, err)
		otherToken := fsTokenRe.FindStringSubmatch(body)[1]

		noJar := &http.Client{Timeout: 10 * time.Second}
		status, _, body, err := fpGet(noJar, s.URL+"/product/sku-3")
		require.NoError(t, err)
		assert.Equal(t, http.StatusForbidden, status, "product without cookie")
		assert.Contains(t, body, `data-exit="127.0.0.1"`)

		req, _ := http.NewRequest(http.MethodGet, s.URL+"/product/sku-3", nil)
		req.AddCookie(&http.Cookie{Name: "sid", Value: "forged"})
		resp, err := noJar.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, http.StatusForbidden, resp.StatusCode, "unknown sid")

		for name, target := range map[string]string{
			"no token":           "/api/price/sku-3",
			"wrong token":        "/api/price/sku-3?token=" + flipFirst(token),
			"token of other sku": "/api/price/sku-3?token=" + otherToken,
		} {
			status, _, body, err := fpGet(c, s.URL+target)
			require.NoError(t, err)
			assert.Equal(t, http.StatusForbidden, status, name)
			assert.JSONEq(t, `{"error":"forbidden","exit":"127.0.0.1"}`, body, name)
		}
		status, _, _, err = fpGet(noJar, s.URL+"/api/price/sku-3?token="+token)
		require.NoError(t, err)
		assert.Equal(t, http.StatusForbidden, status, "token without cookie")
		status, _, _, err = fpGet(c, s.URL+"/api/price/sku-3?token="+token)
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, status)

		c2 := fsJarClient(t, nil, nil)
		_, _, _, err = fpGet(c2, s.URL+"/search?q=sku-3")
		require.NoError(t, err)
		status, _, _, err = fpGet(c2, s.URL+"/api/price/sku-3?token="+token)
		require.NoError(t, err)
		assert.Equal(t, http.StatusForbidden, status, "another session's token")

		status, _, _, err = fpGet(c, s.URL+"/product/sku-999")
		require.NoError(t, err)
		assert.Equal(t, http.StatusNotFound, status)
	})

	t.Run("ThroughProxyEveryStepNamesItsExit", func(t *testing.T) {
		for _, useTLS := range []bool{false, true} {
			s := NewFakeSite(t, FakeSiteConfig{Seed: 5, TLS: useTLS, StrictExit: true})
			p := NewFakeProxy(t, FakeProxyConfig{Seed: 5, Format: ProxyFormatGeneric, User: "acme", Password: "pw"})
			proxyURL, err := url.Parse(p.URL())
			require.NoError(t, err)
			proxyURL.User = url.UserPassword("acme-country-us-session-chain001", "pw")
			var tlsCfg *tls.Config
			if useTLS {
				require.True(t, strings.HasPrefix(s.URL, "https://"))
				tlsCfg = &tls.Config{RootCAs: s.CertPool()}
			} else {
				assert.Nil(t, s.CertPool())
			}
			price, exits := fsScrape(t, fsJarClient(t, proxyURL, tlsCfg), s.URL, "sku-12")
			exit := p.ExitOf("chain001")
			require.NotEmpty(t, exit)
			assert.Equal(t, []string{exit, exit, exit}, exits, "tls=%v", useTLS)
			want, _ := s.Product("sku-12")
			assert.Equal(t, want.Price, price["price"])
		}
	})

	t.Run("StrictExitRefusesAnotherExit", func(t *testing.T) {
		s := NewFakeSite(t, FakeSiteConfig{StrictExit: true})
		p := NewFakeProxy(t, FakeProxyConfig{Format: ProxyFormatGeneric, User: "acme", Password: "pw"})
		proxyURL, _ := url.Parse(p.URL())
		proxyURL.User = url.UserPassword("acme-session-strict01", "pw")
		c := fsJarClient(t, proxyURL, nil)
		_, _, body, err := fpGet(c, s.URL+"/search?q=sku-1")
		require.NoError(t, err)
		link := fsLinkRe.FindStringSubmatch(body)[1]

		// Same cookie jar, new session id: the exit changes, the sid no longer works.
		other := *proxyURL
		other.User = url.UserPassword("acme-session-strict02", "pw")
		c2 := fsJarClient(t, &other, nil)
		c2.Jar = c.Jar
		status, _, _, err := fpGet(c2, s.URL+link)
		require.NoError(t, err)
		assert.Equal(t, http.StatusForbidden, status)
		require.NotEqual(t, p.ExitOf("strict01"), p.ExitOf("strict02"))
		status, _, _, err = fpGet(c, s.URL+link)
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, status, "the original exit still may")
	})

	t.Run("ThrottleAndUnavailableCarryRetryAfter", func(t *testing.T) {
		s := NewFakeSite(t, FakeSiteConfig{UnavailableRetryAfter: 7 * time.Second})
		c := &http.Client{Timeout: 10 * time.Second}
		s.Throttle(2, 2500*time.Millisecond)
		s.SetUnavailable(1)
		for i, want := range []struct {
			status int
			retry  string
		}{{429, "3"}, {429, "3"}, {503, "7"}, {200, ""}} {
			status, hdr, body, err := fpGet(c, s.URL+"/search?q=sku-1")
			require.NoError(t, err)
			assert.Equal(t, want.status, status, "request %d", i)
			assert.Equal(t, want.retry, hdr.Get("Retry-After"), "request %d", i)
			assert.Contains(t, body, `data-exit="127.0.0.1"`)
			if i == 0 {
				// robots.txt is exempt and does not use up the throttle.
				status, _, _, err := fpGet(c, s.URL+"/robots.txt")
				require.NoError(t, err)
				assert.Equal(t, http.StatusOK, status)
			}
		}
		assert.Equal(t, 4, s.Hits("/search"), "throttled requests are hits too")
	})

	t.Run("SchemaChangeRenamesPrice", func(t *testing.T) {
		s := NewFakeSite(t, FakeSiteConfig{Seed: 3})
		c := fsJarClient(t, nil, nil)
		want, _ := s.Product("sku-9")
		price, _ := fsScrape(t, c, s.URL, "sku-9")
		assert.Equal(t, want.Price, price["price"])
		s.SetSchemaChange(true)
		price, _ = fsScrape(t, c, s.URL, "sku-9")
		assert.Equal(t, want.Price, price["amount"])
		_, has := price["price"]
		assert.False(t, has)
		s.SetSchemaChange(false)
		price, _ = fsScrape(t, c, s.URL, "sku-9")
		assert.Equal(t, want.Price, price["price"])
	})

	t.Run("GzipBombIsOneGiBOfZeros", func(t *testing.T) {
		s := NewFakeSite(t, FakeSiteConfig{})
		req, _ := http.NewRequest(http.MethodGet, s.URL+"/bomb", nil)
		req.Header.Set("Accept-Encoding", "gzip") // set by hand: the transport leaves the body compressed
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		assert.Equal(t, "gzip", resp.Header.Get("Content-Encoding"))
		assert.Equal(t, "127.0.0.1", resp.Header.Get("X-Exit"))
		raw, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		assert.Less(t, len(raw), 2<<20, "the payload is small")
		assert.Greater(t, len(raw), 512<<10)
		assert.Equal(t, uint32(FakeSiteBombSize), binary.LittleEndian.Uint32(raw[len(raw)-4:]), "gzip ISIZE")

		zr, err := gzip.NewReader(bytes.NewReader(raw))
		require.NoError(t, err)
		head := make([]byte, 4<<20)
		_, err = io.ReadFull(zr, head)
		require.NoError(t, err)
		assert.Equal(t, make([]byte, len(head)), head, "it inflates to zeros")
	})

	t.Run("BigRobotsPrivateSlow", func(t *testing.T) {
		s := NewFakeSite(t, FakeSiteConfig{SlowDelay: time.Hour})
		c := &http.Client{Timeout: 10 * time.Second}
		_, hdr, body, err := fpGet(c, s.URL+"/big")
		require.NoError(t, err)
		assert.Len(t, body, DefaultFakeSiteBigSize)
		assert.True(t, strings.HasPrefix(body, "exit=127.0.0.1\nxxx"))
		assert.Equal(t, "127.0.0.1", hdr.Get("X-Exit"))

		status, _, body, err := fpGet(c, s.URL+"/robots.txt")
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, status)
		assert.Contains(t, body, "Disallow: /private/\n")
		assert.Contains(t, body, "# exit: 127.0.0.1")
		assert.Equal(t, 1, s.RobotsHits())

		_, _, body, err = fpGet(c, s.URL+"/private/x")
		require.NoError(t, err)
		assert.Contains(t, body, `data-exit="127.0.0.1"`)
		assert.Equal(t, 1, s.Hits("/private/x"))

		short := &http.Client{Timeout: 50 * time.Millisecond}
		_, _, _, err = fpGet(short, s.URL+"/slow")
		require.Error(t, err, "an hour-long /slow outlasts the client's timeout")
		s.SetSlow(time.Hour)
		_, _, _, err = fpGet(short, s.URL+"/search?q=sku-1")
		require.Error(t, err, "SetSlow delays every answer")
		s.SetSlow(0)
		// Not the 50 ms client: a busy box may take that long for any answer.
		status, _, _, err = fpGet(c, s.URL+"/search?q=sku-1")
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, status)
		assert.Equal(t, 6, s.TotalHits())

		custom := NewFakeSite(t, FakeSiteConfig{Robots: "User-agent: *\nDisallow: /\n", BigSize: 10})
		_, _, body, err = fpGet(c, custom.URL+"/robots.txt")
		require.NoError(t, err)
		assert.True(t, strings.HasPrefix(body, "User-agent: *\nDisallow: /\n"))
		_, _, body, err = fpGet(c, custom.URL+"/big")
		require.NoError(t, err)
		assert.Equal(t, "exit=127.0", body)
	})

	t.Run("SameSeedSameCatalog", func(t *testing.T) {
		a := NewFakeSite(t, FakeSiteConfig{Seed: 11, Products: 20})
		b := NewFakeSite(t, FakeSiteConfig{Seed: 11, Products: 20})
		other := NewFakeSite(t, FakeSiteConfig{Seed: 12, Products: 20})
		require.Len(t, a.SKUs(), 20)
		differ, names := 0, map[string]bool{}
		for _, sku := range a.SKUs() {
			pa, _ := a.Product(sku)
			pb, _ := b.Product(sku)
			po, _ := other.Product(sku)
			assert.Equal(t, pa, pb)
			if pa != po {
				differ++
			}
			names[pa.Name] = true
		}
		assert.Greater(t, differ, 15, "another seed, another catalog")
		assert.Greater(t, len(names), 15, "names vary")
		_, ok := a.Product("sku-21")
		assert.False(t, ok)
		pa, _ := fsScrape(t, fsJarClient(t, nil, nil), a.URL, "sku-20")
		pb, _ := fsScrape(t, fsJarClient(t, nil, nil), b.URL, "sku-20")
		assert.Equal(t, pa, pb)
	})
}

// flipFirst changes the first hex digit of a token, so the result is never the token
// itself (a fixed prefix such as "00" is the token 1 time in 256).
func flipFirst(token string) string {
	first := byte('0')
	if token[0] == '0' {
		first = '1'
	}
	return string(first) + token[1:]
}

// fsChallengeMarker is what marks the challenge page.
const fsChallengeMarker = `<meta name="challenge" content="1">`

// fsSessionClient is a client with its own cookie jar through p on sticky session id.
func fsSessionClient(t *testing.T, p *FakeProxy, id string) *http.Client {
	t.Helper()
	proxyURL, err := url.Parse(p.URL())
	require.NoError(t, err)
	proxyURL.User = url.UserPassword("acme-session-"+id, "pw")
	return fsJarClient(t, proxyURL, nil)
}

// TestFakeSiteChallenge: challenge mode. A session's first request gets the challenge
// page and its clearance cookie, the same URL again is served, and so is every later
// request of the session; the cookie copied to another exit gets 403; robots.txt is never
// challenged; ChallengeBlockEvery turns every k-th challenge into a block; the gate comes
// before Throttle and after a blocked tier; without Challenge nothing is challenged.
func TestFakeSiteChallenge(t *testing.T) {
	t.Run("ChallengeThenServedOnTheSameExitOnly", func(t *testing.T) {
		s := NewFakeSite(t, FakeSiteConfig{Seed: 4, Challenge: true, StrictExit: true})
		p := NewFakeProxy(t, FakeProxyConfig{Seed: 4, Format: ProxyFormatGeneric, User: "acme", Password: "pw"})
		c := fsSessionClient(t, p, "chal01")

		status, hdr, body, err := fpGet(c, s.URL+"/search?q=sku-2")
		require.NoError(t, err)
		exit := p.ExitOf("chal01")
		require.NotEmpty(t, exit)
		assert.Equal(t, http.StatusOK, status)
		assert.Contains(t, body, fsChallengeMarker)
		assert.Len(t, body, DefaultFakeSiteChallengeSize)
		assert.Equal(t, strconv.Itoa(DefaultFakeSiteChallengeSize), hdr.Get("Content-Length"))
		assert.Contains(t, body, `<body data-exit="`+exit+`">`)
		assert.NotContains(t, body, `href="/product/`)
		require.Len(t, hdr.Values("Set-Cookie"), 1, "the clearance only: no sid before the shop answers")
		assert.Regexp(t, `^clearance=[0-9a-f]{32}; Path=/; HttpOnly$`, hdr.Get("Set-Cookie"))
		assert.Equal(t, 1, s.Challenges())

		// The jar holds the clearance: the same URL again is served.
		status, _, body, err = fpGet(c, s.URL+"/search?q=sku-2")
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, status)
		assert.NotContains(t, body, fsChallengeMarker)
		link := fsLinkRe.FindStringSubmatch(body)
		require.NotNil(t, link, body)
		// And so is the rest of the chain, without another challenge.
		price, exits := fsScrape(t, c, s.URL, "sku-2")
		want, _ := s.Product("sku-2")
		assert.Equal(t, want.Price, price["price"])
		assert.Equal(t, []string{exit, exit, exit}, exits)
		assert.Equal(t, 1, s.Challenges())

		// Another exit with a copy of the session's cookies (clearance and sid): blocked.
		u, _ := url.Parse(s.URL)
		c2 := fsSessionClient(t, p, "chal02")
		c2.Jar.SetCookies(u, c.Jar.Cookies(u))
		require.NotEqual(t, exit, p.ExitOf("chal02"))
		status, _, body, err = fpGet(c2, s.URL+link[1])
		require.NoError(t, err)
		assert.Equal(t, http.StatusForbidden, status)
		assert.Contains(t, body, `<p class="blocked">blocked: clearance does not match your address</p>`)
		assert.NotContains(t, body, fsChallengeMarker)
		assert.Equal(t, 1, s.ClearanceMismatches())
		assert.Equal(t, 1, s.Challenges())

		// robots.txt is exempt, with no clearance and with a foreign one.
		for _, rc := range []*http.Client{fsSessionClient(t, p, "chal03"), c2} {
			status, _, body, err = fpGet(rc, s.URL+"/robots.txt")
			require.NoError(t, err)
			assert.Equal(t, http.StatusOK, status)
			assert.Contains(t, body, "Disallow: /private/\n")
		}
		assert.Equal(t, 1, s.Challenges())
		assert.Equal(t, 1, s.ClearanceMismatches())
		assert.Zero(t, s.ChallengeBlocks())
		// Every request is a hit: 2 searches, the chain's 3, the foreign one, 2 robots.
		assert.Equal(t, 8, s.TotalHits())
		assert.Equal(t, 3, s.Hits("/search"))
	})

	t.Run("UnknownClearanceIsChallenged", func(t *testing.T) {
		s := NewFakeSite(t, FakeSiteConfig{Challenge: true, ChallengeSize: 3000})
		req, _ := http.NewRequest(http.MethodGet, s.URL+"/", nil)
		req.AddCookie(&http.Cookie{Name: "clearance", Value: "forged"})
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, resp.StatusCode)
		assert.Contains(t, string(body), fsChallengeMarker)
		assert.Len(t, body, 3000, "ChallengeSize")
		assert.Equal(t, 1, s.Challenges())
		assert.Zero(t, s.ClearanceMismatches())
	})

	t.Run("EveryKthChallengeBlocks", func(t *testing.T) {
		s := NewFakeSite(t, FakeSiteConfig{Challenge: true, ChallengeBlockEvery: 2})
		p := NewFakeProxy(t, FakeProxyConfig{Format: ProxyFormatGeneric, User: "acme", Password: "pw"})
		a, b := fsSessionClient(t, p, "blk01"), fsSessionClient(t, p, "blk02")

		status, _, body, err := fpGet(a, s.URL+"/search?q=sku-1")
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, status)
		assert.Contains(t, body, fsChallengeMarker, "1st challenge")

		status, hdr, body, err := fpGet(b, s.URL+"/search?q=sku-1")
		require.NoError(t, err)
		assert.Equal(t, http.StatusForbidden, status, "2nd challenge: a block")
		assert.Contains(t, body, `<p class="blocked">`)
		assert.NotContains(t, body, fsChallengeMarker)
		assert.Empty(t, hdr.Values("Set-Cookie"), "a block sets no clearance")
		assert.Equal(t, 1, s.ChallengeBlocks())
		assert.Equal(t, 1, s.Challenges())

		status, _, body, err = fpGet(b, s.URL+"/search?q=sku-1")
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, status)
		assert.Contains(t, body, fsChallengeMarker, "3rd challenge")
		status, _, body, err = fpGet(b, s.URL+"/search?q=sku-1")
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, status)
		assert.NotContains(t, body, fsChallengeMarker, "cleared")

		status, _, body, err = fpGet(a, s.URL+"/search?q=sku-1")
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, status)
		assert.NotContains(t, body, fsChallengeMarker, "the first session's clearance holds")
		assert.Equal(t, 2, s.Challenges())
		assert.Equal(t, 1, s.ChallengeBlocks())
		assert.Zero(t, s.ClearanceMismatches())
	})

	t.Run("GateOrder", func(t *testing.T) {
		s := NewFakeSite(t, FakeSiteConfig{Challenge: true})
		p := NewFakeProxy(t, FakeProxyConfig{Format: ProxyFormatGeneric, User: "acme", Password: "pw", Tier: "datacenter"})
		c := fsSessionClient(t, p, "order01")

		// The challenge comes first and does not use up the throttle.
		s.Throttle(1, time.Second)
		status, _, body, err := fpGet(c, s.URL+"/search?q=sku-1")
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, status)
		assert.Contains(t, body, fsChallengeMarker)
		status, hdr, _, err := fpGet(c, s.URL+"/search?q=sku-1")
		require.NoError(t, err)
		assert.Equal(t, http.StatusTooManyRequests, status, "the cleared request meets the throttle")
		assert.Equal(t, "1", hdr.Get("Retry-After"))
		status, _, _, err = fpGet(c, s.URL+"/search?q=sku-1")
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, status)

		// A blocked tier answers before the challenge, uncounted.
		s.SetBlockedTier("datacenter")
		status, _, body, err = fpGet(fsSessionClient(t, p, "order02"), s.URL+"/search?q=sku-1")
		require.NoError(t, err)
		assert.Equal(t, http.StatusForbidden, status)
		assert.Contains(t, body, "datacenter traffic is not allowed")
		assert.Equal(t, 1, s.Blocked("datacenter"))
		assert.Equal(t, 1, s.Challenges())
		assert.Equal(t, 3, s.TotalHits())
	})

	t.Run("OffNeverChallenges", func(t *testing.T) {
		s := NewFakeSite(t, FakeSiteConfig{ChallengeBlockEvery: 1, ChallengeSize: 100})
		p := NewFakeProxy(t, FakeProxyConfig{Format: ProxyFormatGeneric, User: "acme", Password: "pw"})
		c := fsSessionClient(t, p, "off01")
		status, hdr, body, err := fpGet(c, s.URL+"/search?q=sku-1")
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, status)
		assert.NotContains(t, body, fsChallengeMarker)
		assert.NotContains(t, strings.Join(hdr.Values("Set-Cookie"), "\n"), "clearance=")
		price, _ := fsScrape(t, c, s.URL, "sku-1")
		want, _ := s.Product("sku-1")
		assert.Equal(t, want.Price, price["price"])
		// A clearance cookie from elsewhere means nothing to it.
		u, _ := url.Parse(s.URL)
		c2 := fsSessionClient(t, p, "off02")
		c2.Jar.SetCookies(u, append(c.Jar.Cookies(u), &http.Cookie{Name: "clearance", Value: "x"}))
		status, _, _, err = fpGet(c2, s.URL+"/search?q=sku-1")
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, status)
		assert.Zero(t, s.Challenges())
		assert.Zero(t, s.ChallengeBlocks())
		assert.Zero(t, s.ClearanceMismatches())
	})
}

// TestNextHit: the channel closes at the path's next request, not at another path's, and
// every waiter of the path is woken.
func TestNextHit(t *testing.T) {
	s := NewFakeSite(t, FakeSiteConfig{Seed: 1})
	a, b := s.NextHit("/robots.txt"), s.NextHit("/robots.txt")
	other := s.NextHit("/search")
	resp, err := http.Get(s.URL + "/robots.txt")
	require.NoError(t, err)
	_ = resp.Body.Close()
	for _, ch := range []<-chan struct{}{a, b} {
		select {
		case <-ch:
		case <-time.After(10 * time.Second):
			t.Fatal("a waiter of /robots.txt was not woken by its request")
		}
	}
	select {
	case <-other:
		t.Fatal("a request for /robots.txt closed /search's channel")
	default:
	}
	select {
	case <-s.NextHit("/robots.txt"):
		t.Fatal("a new channel closed before a new request")
	default:
	}
}
