// Package profile gives a session one browser identity for its whole life: a coherent,
// realistic set of request headers (User-Agent, Accept, Accept-Language and, for Chrome
// and Edge, the User-Agent client hints) chosen when the session opens and kept for every
// request it makes, whether colly sends it over net/http or Chromium renders it.
//
// A Profile is plain data (strings, slices, a pointer to its client hints) that marshals
// to JSON, so a session can store the one it was given and keep it across a restart and
// across a bump of the built-in table. Pick chooses one for a new session, weighted like
// desktop browser shares, filtered by Options (browsers, locales, Chromium only); Named
// and All give the built-in ones. Headers and Apply are the net/http side,
// UserAgentOverride the Chromium side (Emulation.setUserAgentOverride).
//
// # What a profile keeps coherent
//
// Within one built-in profile the UA string's operating system is the client hints'
// platform (and navigator.platform), the UA's browser version is the brands' major
// version, the brand list is the one that Chrome (or Edge) of that major version really
// sends (its GREASE "Not…Brand" entry, version and order derived from the major version
// the way Chromium does), Accept is what that browser sends for a navigation, and
// Accept-Language is built from one locale the way that browser builds it (Chrome's
// q=0.9, 0.8, …; Firefox's 1/n steps). Firefox and Safari profiles have no client hints,
// as those browsers send none. The versions live in one table (table.go) so they are
// easy to bump; the client hints follow from the versions.
//
// # What a profile does not cover
//
//   - TLS and HTTP/2 fingerprints. Headers change what a request says, not how the
//     connection is made: Go's crypto/tls ClientHello (JA3/JA4), its HTTP/2 SETTINGS,
//     window sizes and pseudo-header order are Go's, whatever the User-Agent claims. A
//     server that checks them sees Go claiming to be Chrome. Only the render path, which
//     really is Chromium, has Chromium's TLS and HTTP/2.
//   - Header order and case. On HTTP/1.1 net/http writes Host and User-Agent first and
//     the other headers sorted by name, in canonical case; browsers have their own order
//     (and Chrome writes sec-ch-ua in lower case on HTTP/1.1 too).
//   - Accept-Encoding, in Headers and Apply. Go's transport adds "Accept-Encoding: gzip"
//     and decompresses the body only when it added the header itself, so a profile's
//     headers never set it. AcceptEncodingFor gives the browser's own ("gzip, deflate,
//     br, zstd"), for a client that decodes all of those: a sessions collector sends it
//     on every request of a session with a profile, and decodes each encoding under its
//     size cap.
//   - Request-dependent headers: Sec-Fetch-Site, Sec-Fetch-Mode, Sec-Fetch-Dest,
//     Sec-Fetch-User and Priority depend on what a request is (a top-level navigation, a
//     same-origin XHR, an image) and where it comes from, so a profile cannot fix them for
//     a session; a step that wants them sets them per request. Likewise Referer, Origin,
//     Cache-Control and cookies.
//   - High-entropy client hints (sec-ch-ua-full-version-list, -arch, -platform-version, …)
//     are sent by a browser only after a server asks for them (Accept-CH); Headers does not
//     send them, UserAgentOverride hands them to Chromium, which then answers such a
//     request itself.
//   - JavaScript-visible fingerprints beyond navigator.userAgent, navigator.userAgentData,
//     navigator.platform and navigator.languages (screen, fonts, WebGL, canvas, timezone):
//     the render path's Chromium shows its own.
//
// # Client hints and plain http
//
// Browsers send sec-ch-ua only to potentially trustworthy origins (https, wss, localhost
// and loopback addresses). Headers and Apply give the set for such a request; HeadersFor
// and ApplyFor take the request's URL and leave the client hints out for a plain-http
// origin, as Chrome does.
//
// # Using it with colly
//
// colly fills in User-Agent (from Collector.UserAgent) and "Accept: */*" before any
// OnRequest callback runs, and Apply keeps a header that is already set. So the session's
// collector should carry the profile itself: Collector.UserAgent = p.UserAgent and
// Collector.Headers = p.Headers() (colly copies Collector.Headers into a request that has
// none of its own); a step that passes its own header map gets p.Apply on it first.
//
// # Using it with Chromium
//
// Send p.UserAgentOverride() (Emulation.setUserAgentOverride) on every target before its
// first navigation. Chromium then sends the profile's User-Agent, Accept-Language and
// sec-ch-ua headers and reports the same values to the page's scripts; Accept is
// Chromium's own, which is the Chrome profiles' value. Chromium cannot hide that it is
// Blink, so the render path should use Chromium-family profiles only (Options.ChromiumOnly,
// Profile.Chromium); see UserAgentOverride for what a Firefox or Safari profile does there.
// A profile whose Chrome major version differs from the Chromium binary's is visible to
// scripts that probe features; keep the table's Chrome version near the binary's.
package profile
