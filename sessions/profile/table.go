package profile

import (
	"strconv"
	"strings"
)

// The versions of the built-in profiles, as of December 2026. Bump them here: every
// profile's User-Agent, brand list and full-version list follow from these constants.
//
// Chrome's is the stable release (Debian's chromium package carries the same version;
// keep it near the render path's Chromium). Edge ships on the same Chromium major; its
// own build number differs from Chromium's. The Chrome and Edge UA strings carry only the
// major version ("156.0.0.0", UA reduction); the full versions appear only in the
// high-entropy client hints a server must ask for.
const (
	chromeVersion  = "156.0.8078.129" // Chrome (and the Chromium under Edge) full version
	edgeVersion    = "156.0.4341.62"  // Microsoft Edge full version
	firefoxVersion = "158.0"          // Firefox (UA "rv:" and "Firefox/" tokens)
	safariVersion  = "27.1"           // Safari ("Version/" token); WebKit's token is frozen

	// sec-ch-ua-platform-version per OS, as Chrome reports it: Windows 11 24H2 and later
	// report 19.0.0; macOS its real version (the UA stays frozen at 10_15_7), which
	// matches the Safari release; Linux the kernel release.
	windowsPlatformVersion = "19.0.0"
	macOSPlatformVersion   = "27.1.0"
	linuxPlatformVersion   = "6.8.0"
)

// specs are the built-in profiles. weight is a rough share of desktop page views in
// late 2026 (Chrome about two thirds, most of it on Windows; Edge about an eighth; Safari
// about a tenth; Firefox about a twentieth), which Pick uses as relative odds.
var specs = []spec{
	{name: "chrome-win", browser: Chrome, os: Windows, weight: 46},
	{name: "chrome-mac", browser: Chrome, os: MacOS, weight: 14},
	{name: "chrome-linux", browser: Chrome, os: Linux, weight: 4},
	{name: "edge-win", browser: Edge, os: Windows, weight: 13},
	{name: "firefox-win", browser: Firefox, os: Windows, weight: 4},
	{name: "firefox-mac", browser: Firefox, os: MacOS, weight: 1},
	{name: "firefox-linux", browser: Firefox, os: Linux, weight: 1},
	{name: "safari-mac", browser: Safari, os: MacOS, weight: 9},
}

// spec is one built-in profile before a locale is chosen.
type spec struct {
	name    string
	browser string // Chrome, Edge, Firefox or Safari
	os      string // Windows, MacOS or Linux
	weight  int    // relative odds in Pick
}

// What each browser sends as Accept on a top-level navigation. Edge sends Chrome's.
// Firefox dropped image/avif and image/webp from its navigation Accept in version 128;
// Safari sends the same value.
const (
	chromiumAccept = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,image/apng,*/*;q=0.8,application/signed-exchange;v=b3;q=0.7"
	firefoxAccept  = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
	safariAccept   = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
)

// osInfo is what one operating system puts into each browser's UA string and hints.
type osInfo struct {
	chromiumToken     string // the parenthesised UA part of Chrome, Edge and Safari
	firefoxToken      string // Firefox's, before "; rv:"
	navigatorPlatform string // navigator.platform
	platformVersion   string // sec-ch-ua-platform-version
	architecture      string // sec-ch-ua-arch
}

var oses = map[string]osInfo{
	Windows: {
		chromiumToken:     "Windows NT 10.0; Win64; x64",
		firefoxToken:      "Windows NT 10.0; Win64; x64",
		navigatorPlatform: "Win32",
		platformVersion:   windowsPlatformVersion,
		architecture:      "x86",
	},
	MacOS: {
		// Every browser froze the macOS version in its UA; Chrome on Apple silicon still
		// says "Intel" in the UA and "arm" in sec-ch-ua-arch.
		chromiumToken:     "Macintosh; Intel Mac OS X 10_15_7",
		firefoxToken:      "Macintosh; Intel Mac OS X 10.15",
		navigatorPlatform: "MacIntel",
		platformVersion:   macOSPlatformVersion,
		architecture:      "arm",
	},
	Linux: {
		chromiumToken:     "X11; Linux x86_64",
		firefoxToken:      "X11; Linux x86_64",
		navigatorPlatform: "Linux x86_64",
		platformVersion:   linuxPlatformVersion,
		architecture:      "x86",
	},
}

// build returns the profile of s for locale (already canonical). Every call returns
// fresh slices, so no caller can change the built-in table through a returned profile.
func (s spec) build(locale string) Profile {
	o := oses[s.os]
	p := Profile{
		Name:                    s.name,
		Browser:                 s.browser,
		OS:                      s.os,
		NavigatorPlatform:       o.navigatorPlatform,
		UpgradeInsecureRequests: true, // all four send it on navigations
	}
	switch s.browser {
	case Chrome, Edge:
		full, brand := chromeVersion, "Google Chrome"
		if s.browser == Edge {
			full, brand = edgeVersion, "Microsoft Edge"
		}
		major := majorOf(full)
		p.Version = full
		p.UserAgent = "Mozilla/5.0 (" + o.chromiumToken + ") AppleWebKit/537.36 (KHTML, like Gecko) Chrome/" +
			strconv.Itoa(major) + ".0.0.0 Safari/537.36"
		if s.browser == Edge {
			p.UserAgent += " Edg/" + strconv.Itoa(major) + ".0.0.0"
		}
		p.Accept = chromiumAccept
		brands, fullList := chromiumBrands(major, brand, full, chromeVersion)
		p.Hints = &ClientHints{
			Brands:          brands,
			FullVersionList: fullList,
			Platform:        s.os,
			PlatformVersion: o.platformVersion,
			Architecture:    o.architecture,
			Bitness:         "64",
			FormFactors:     []string{"Desktop"},
		}
	case Firefox:
		p.Version = firefoxVersion
		p.UserAgent = "Mozilla/5.0 (" + o.firefoxToken + "; rv:" + firefoxVersion + ") Gecko/20100101 Firefox/" + firefoxVersion
		p.Accept = firefoxAccept
	case Safari:
		p.Version = safariVersion
		p.UserAgent = "Mozilla/5.0 (" + o.chromiumToken + ") AppleWebKit/605.1.15 (KHTML, like Gecko) Version/" + safariVersion + " Safari/605.1.15"
		p.Accept = safariAccept
	}
	p.setLocale(locale)
	return p
}

// majorOf returns the leading number of a dotted version ("156.0.8078.129" → 156).
func majorOf(v string) int {
	head, _, _ := strings.Cut(v, ".")
	n, err := strconv.Atoi(head)
	if err != nil {
		panic("profile: the version table has a version without a major number: " + v)
	}
	return n
}

// GREASE, the way Chromium builds its brand list (the UA-CH spec's "create arbitrary
// brands"): the major version seeds the placeholder brand's two characters, its version
// and the order of the three entries, so every Chrome of one major version sends the
// same list, and Edge of that major version the same with its own brand.
var (
	greaseChars    = []string{" ", "(", ":", "-", ".", "/", ")", ";", "=", "?", "_"}
	greaseVersions = []string{"8", "99", "24"}
	// greaseOrders[seed%6] gives the positions of the placeholder, Chromium and the
	// browser's own brand.
	greaseOrders = [6][3]int{{0, 1, 2}, {0, 2, 1}, {1, 0, 2}, {1, 2, 0}, {2, 0, 1}, {2, 1, 0}}
)

// chromiumBrands returns the brand list (major versions) and the full-version list of a
// Chromium-family browser of the given major version, in the order it sends them.
func chromiumBrands(major int, brand, fullVersion, chromiumFullVersion string) (brands, fullList []Brand) {
	n := len(greaseChars)
	grease := "Not" + greaseChars[major%n] + "A" + greaseChars[(major+1)%n] + "Brand"
	greaseVersion := greaseVersions[major%len(greaseVersions)]
	order := greaseOrders[major%len(greaseOrders)]
	m := strconv.Itoa(major)

	brands = make([]Brand, 3)
	brands[order[0]] = Brand{Brand: grease, Version: greaseVersion}
	brands[order[1]] = Brand{Brand: "Chromium", Version: m}
	brands[order[2]] = Brand{Brand: brand, Version: m}
	fullList = make([]Brand, 3)
	fullList[order[0]] = Brand{Brand: grease, Version: greaseVersion + ".0.0.0"}
	fullList[order[1]] = Brand{Brand: "Chromium", Version: chromiumFullVersion}
	fullList[order[2]] = Brand{Brand: brand, Version: fullVersion}
	return brands, fullList
}
