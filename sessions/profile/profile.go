package profile

import (
	"net"
	"net/http"
	"net/url"
	"strings"

	"github.com/chromedp/cdproto/emulation"
)

// Browser names, as Profile.Browser and Options.Browsers spell them.
const (
	Chrome  = "chrome"
	Edge    = "edge"
	Firefox = "firefox"
	Safari  = "safari"
)

// Operating systems, as Profile.OS and ClientHints.Platform spell them (the
// sec-ch-ua-platform values).
const (
	Windows = "Windows"
	MacOS   = "macOS"
	Linux   = "Linux"
)

// DefaultLocale is the locale of Named and All, and of Pick when Options.Locales is empty.
const DefaultLocale = "en-US"

// Profile is one browser identity: the headers a session sends on every request and the
// values Chromium reports when it renders for the session. The zero Profile sets nothing.
//
// A Profile is plain data; it marshals to JSON, so a session can store the profile it was
// given and keep exactly it (even after the built-in table is bumped). Profiles returned
// by this package share no memory with each other or with the built-in table.
type Profile struct {
	// Name is the built-in profile's name, browser and OS: "chrome-win", "edge-win",
	// "firefox-linux", "safari-mac", … It does not include the locale.
	Name string `json:"name"`
	// Browser is Chrome, Edge, Firefox or Safari.
	Browser string `json:"browser"`
	// Version is the browser's full version ("156.0.8078.129", "158.0", "27.1").
	Version string `json:"version"`
	// OS is Windows, MacOS or Linux: the operating system the UA string names.
	OS string `json:"os"`
	// Locale is the locale Accept-Language was built from ("en-US", "de-DE").
	Locale string `json:"locale"`

	// UserAgent is the User-Agent header and navigator.userAgent.
	UserAgent string `json:"userAgent"`
	// Accept is what the browser sends as Accept on a top-level navigation.
	Accept string `json:"accept"`
	// AcceptLanguage is the Accept-Language header, with the browser's own q-values.
	AcceptLanguage string `json:"acceptLanguage"`
	// Languages are the language tags AcceptLanguage lists, in order, without q-values:
	// navigator.languages, and what Chromium takes as its acceptLanguage override.
	Languages []string `json:"languages"`
	// NavigatorPlatform is navigator.platform: "Win32", "MacIntel" or "Linux x86_64".
	NavigatorPlatform string `json:"navigatorPlatform"`
	// UpgradeInsecureRequests says whether the browser sends "Upgrade-Insecure-Requests:
	// 1" on navigations (all four built-in browsers do).
	UpgradeInsecureRequests bool `json:"upgradeInsecureRequests"`

	// Hints are the User-Agent client hints of a Chromium-family profile (Chrome, Edge);
	// nil for Firefox and Safari, which send none.
	Hints *ClientHints `json:"hints,omitempty"`
}

// ClientHints are the User-Agent client hints of a Chromium-family browser (the
// Sec-CH-UA-* headers and navigator.userAgentData).
type ClientHints struct {
	// Brands is the sec-ch-ua list with major versions, in the order the browser sends
	// it, its GREASE "Not…Brand" entry included.
	Brands []Brand `json:"brands"`
	// FullVersionList is Brands with full versions (sec-ch-ua-full-version-list), in the
	// same order.
	FullVersionList []Brand `json:"fullVersionList"`
	// Platform is sec-ch-ua-platform, unquoted: "Windows", "macOS" or "Linux".
	Platform string `json:"platform"`
	// PlatformVersion is sec-ch-ua-platform-version, unquoted ("19.0.0" on Windows 11).
	PlatformVersion string `json:"platformVersion"`
	// Architecture is sec-ch-ua-arch, unquoted: "x86" or "arm".
	Architecture string `json:"architecture"`
	// Bitness is sec-ch-ua-bitness, unquoted: "64".
	Bitness string `json:"bitness"`
	// Model is sec-ch-ua-model: "" on desktops.
	Model string `json:"model"`
	// Mobile is sec-ch-ua-mobile (?1 when true).
	Mobile bool `json:"mobile"`
	// Wow64 is sec-ch-ua-wow64 (a 32-bit browser on 64-bit Windows).
	Wow64 bool `json:"wow64"`
	// FormFactors is sec-ch-ua-form-factors: ["Desktop"].
	FormFactors []string `json:"formFactors"`
}

// clone returns a copy of c that shares no slice with it.
func (c *ClientHints) clone() *ClientHints {
	d := *c
	d.Brands = append([]Brand(nil), c.Brands...)
	d.FullVersionList = append([]Brand(nil), c.FullVersionList...)
	d.FormFactors = append([]string(nil), c.FormFactors...)
	return &d
}

// Brand is one entry of a client-hints brand list.
type Brand struct {
	Brand   string `json:"brand"`
	Version string `json:"version"`
}

// Chromium reports whether p is a Chromium-family profile (Chrome, Edge): one that
// Chromium can present faithfully when it renders, client hints included.
func (p Profile) Chromium() bool { return p.Browser == Chrome || p.Browser == Edge }

// String returns the profile's name and locale, "chrome-win/en-US".
func (p Profile) String() string { return p.Name + "/" + p.Locale }

// Headers returns the headers the profile adds to every request to a potentially
// trustworthy origin (https, or a loopback host): User-Agent, Accept (a navigation's),
// Accept-Language, Upgrade-Insecure-Requests: 1, and for a Chromium-family profile
// sec-ch-ua, sec-ch-ua-mobile and sec-ch-ua-platform, formatted as Chrome sends them:
//
//	sec-ch-ua: "Not:A-Brand";v="8", "Chromium";v="156", "Google Chrome";v="156"
//	sec-ch-ua-mobile: ?0
//	sec-ch-ua-platform: "Windows"
//
// Never Accept-Encoding (Go's transport adds gzip, and decompresses only what it asked
// for; AcceptEncodingFor is the browser's, for a client that decodes it all), nor the
// request-dependent Sec-Fetch-*, Priority, Referer or Origin (see the
// package documentation). A field that is empty is left out, so the zero Profile returns
// an empty header. Each call returns a new map.
func (p Profile) Headers() http.Header {
	h := make(http.Header, 7)
	set := func(k, v string) {
		if v != "" {
			h.Set(k, v)
		}
	}
	set("User-Agent", p.UserAgent)
	set("Accept", p.Accept)
	set("Accept-Language", p.AcceptLanguage)
	if p.UpgradeInsecureRequests {
		h.Set("Upgrade-Insecure-Requests", "1")
	}
	if c := p.Hints; c != nil {
		set("Sec-Ch-Ua", brandList(c.Brands))
		h.Set("Sec-Ch-Ua-Mobile", sfBool(c.Mobile))
		set("Sec-Ch-Ua-Platform", sfString(c.Platform))
	}
	return h
}

// HeadersFor returns Headers for a request to u, leaving the client hints out when u's
// origin is not potentially trustworthy (plain http to a host other than localhost or a
// loopback address), as browsers send sec-ch-ua only to secure origins. A nil u is
// treated as secure.
func (p Profile) HeadersFor(u *url.URL) http.Header {
	h := p.Headers()
	if u != nil && !trustworthy(u) {
		for k := range h {
			if strings.HasPrefix(k, "Sec-Ch-Ua") {
				delete(h, k)
			}
		}
	}
	return h
}

// Apply sets each of the profile's Headers on h unless h already has that header: a
// step's explicit header wins. A header counts as present when its name is a key of h
// in any letter case, even with no values, so a step can keep a profile header off a
// request by setting its key to nil.
func (p Profile) Apply(h http.Header) { apply(h, p.Headers()) }

// ApplyFor is Apply with the headers of HeadersFor(u): no client hints on a request to
// a plain-http origin.
func (p Profile) ApplyFor(h http.Header, u *url.URL) { apply(h, p.HeadersFor(u)) }

func apply(h, profile http.Header) {
	for k, v := range profile {
		if !has(h, k) {
			h[k] = v
		}
	}
}

// has reports whether h has a key equal to k in any letter case (a caller may have
// written h["sec-ch-ua"] directly, bypassing canonicalisation).
func has(h http.Header, k string) bool {
	if _, ok := h[k]; ok {
		return true
	}
	for key := range h {
		if strings.EqualFold(key, k) {
			return true
		}
	}
	return false
}

// Accept-Encoding values the built-in browsers send. Chrome and Edge (since 123) and
// Firefox (since 126) offer br and zstd to potentially trustworthy origins only (https,
// localhost, loopback addresses) and "gzip, deflate" to plain-http ones; Safari (zstd since
// 26) offers its whole list to every origin.
const (
	encodingsSecure   = "gzip, deflate, br, zstd"
	encodingsInsecure = "gzip, deflate"
)

// AcceptEncodingFor returns the Accept-Encoding header the profile's browser sends on a
// request to u: "gzip, deflate, br, zstd" for each built-in browser, except Chrome, Edge
// and Firefox to a plain-http origin that is not potentially trustworthy (see
// HeadersFor), which get "gzip, deflate". A nil u is treated as secure; a profile of
// another browser (the zero Profile) returns "".
//
// It is not in Headers: a client that sends it must decode all four encodings (a sessions
// collector does, under its size cap; Go's transport decodes gzip only, and only when it
// set Accept-Encoding itself).
func (p Profile) AcceptEncodingFor(u *url.URL) string {
	switch p.Browser {
	case Chrome, Edge, Firefox:
		if u != nil && !trustworthy(u) {
			return encodingsInsecure
		}
		return encodingsSecure
	case Safari:
		return encodingsSecure
	}
	return ""
}

// UserAgentOverride returns the Emulation.setUserAgentOverride parameters that make
// Chromium present the profile on a target: userAgent (the User-Agent header and
// navigator.userAgent), acceptLanguage (Languages joined by commas; Chromium builds the
// Accept-Language header from it with Chrome's q-values, which gives AcceptLanguage for a
// Chromium-family profile) and platform (navigator.platform). For a Chromium-family
// profile it also sets userAgentMetadata (brands, fullVersionList, platform,
// platformVersion, architecture, bitness, model "", mobile, wow64, formFactors), from
// which Chromium sends the sec-ch-ua headers, answers Accept-CH requests for the
// high-entropy ones, and fills navigator.userAgentData; without it Chromium's default
// hints would name "HeadlessChrome" and the binary's own version.
//
// For a Firefox or Safari profile userAgentMetadata is nil, and Chromium then sends no
// client hints at all, as those browsers do; but the HTTP side is only approximate (the
// Accept header is Chromium's, and Accept-Language carries Chrome's q-values rather than
// Firefox's) and the page's scripts still run in Blink (navigator.userAgentData exists,
// navigator.vendor is "Google Inc.", the feature set is Chromium's), which a site that
// fingerprints scripts can see. The render path should use Chromium-family profiles only
// (Options.ChromiumOnly, Chromium).
//
// Each call returns new values; changing them does not change p.
func (p Profile) UserAgentOverride() *emulation.SetUserAgentOverrideParams {
	o := &emulation.SetUserAgentOverrideParams{
		UserAgent:      p.UserAgent,
		AcceptLanguage: strings.Join(p.Languages, ","),
		Platform:       p.NavigatorPlatform,
	}
	if c := p.Hints; c != nil {
		o.UserAgentMetadata = &emulation.UserAgentMetadata{
			Brands:          cdpBrands(c.Brands),
			FullVersionList: cdpBrands(c.FullVersionList),
			Platform:        c.Platform,
			PlatformVersion: c.PlatformVersion,
			Architecture:    c.Architecture,
			Model:           c.Model,
			Mobile:          c.Mobile,
			Bitness:         c.Bitness,
			Wow64:           c.Wow64,
			FormFactors:     append([]string(nil), c.FormFactors...),
		}
	}
	return o
}

func cdpBrands(bs []Brand) []*emulation.UserAgentBrandVersion {
	if bs == nil {
		return nil
	}
	out := make([]*emulation.UserAgentBrandVersion, len(bs))
	for i, b := range bs {
		out[i] = &emulation.UserAgentBrandVersion{Brand: b.Brand, Version: b.Version}
	}
	return out
}

// brandList formats a brand list as a structured-field list, the way Chrome sends
// sec-ch-ua: `"Chromium";v="156", "Google Chrome";v="156"`.
func brandList(bs []Brand) string {
	var b strings.Builder
	for i, br := range bs {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(sfString(br.Brand))
		b.WriteString(";v=")
		b.WriteString(sfString(br.Version))
	}
	return b.String()
}

// sfString is a structured-field string (RFC 8941): quoted, with \ and " escaped.
func sfString(s string) string {
	if s == "" {
		return ""
	}
	return `"` + sfEscaper.Replace(s) + `"`
}

var sfEscaper = strings.NewReplacer(`\`, `\\`, `"`, `\"`)

// sfBool is a structured-field boolean: ?1 or ?0.
func sfBool(v bool) string {
	if v {
		return "?1"
	}
	return "?0"
}

// trustworthy reports whether u's origin is potentially trustworthy in the sense of
// Secure Contexts: https or wss, or a host that is localhost (or under .localhost) or a
// loopback address.
func trustworthy(u *url.URL) bool {
	switch strings.ToLower(u.Scheme) {
	case "https", "wss":
		return true
	}
	host := strings.ToLower(strings.TrimSuffix(u.Hostname(), "."))
	if host == "localhost" || strings.HasSuffix(host, ".localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
