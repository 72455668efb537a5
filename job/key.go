package job

import (
	"crypto/sha256"
	"encoding/hex"
	"strconv"
	"strings"
)

// keyEncodingVersion is the first netstring of the hashed encoding. Changing anything
// about the encoding requires a new version string (and a CHANGELOG entry): see doc.go.
const keyEncodingVersion = "idemscrape-key-v1"

// Key validates and normalises s (see Normalize) and returns its job key. The key depends
// only on Kind, URL or SourceID, Country, Window, ParserVersion and Scope of the
// normalised spec, never on Meta; two specs that normalise to the same fields get the
// same key, and specs that differ in any of those fields get different keys (up to
// 128-bit hash collisions in the hash form). The format is described in the package
// documentation and is a compatibility promise.
func (n *Normalizer) Key(s Spec) (string, error) {
	ns, err := n.Normalize(s)
	if err != nil {
		return "", err
	}
	return deriveKey(ns), nil
}

// deriveKey computes the key of an already normalised spec.
func deriveKey(s Spec) string {
	if k, ok := naturalKey(s); ok {
		return k
	}
	h := sha256.Sum256(canonicalEncoding(s))
	return s.Kind + ":" + hex.EncodeToString(h[:16])
}

// naturalKey returns kind:sourceid:COUNTRY:window:vN[:scope] when every component is
// made of [A-Za-z0-9._-] (so the key splits back unambiguously on ":"), the spec uses a
// SourceID and the result is at most 128 bytes.
func naturalKey(s Spec) (string, bool) {
	if s.URL != "" || !isSafe(s.SourceID) || !isSafe(s.Window) {
		return "", false
	}
	// Kind, Country and Scope are always safe once validated.
	parts := []string{s.Kind, s.SourceID, s.Country, s.Window, "v" + strconv.Itoa(s.ParserVersion)}
	if s.Scope != "" {
		parts = append(parts, s.Scope)
	}
	k := strings.Join(parts, ":")
	if len(k) > naturalKeyMaxLength {
		return "", false
	}
	return k, true
}

func isSafe(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if !isSafeByte(s[i]) {
			return false
		}
	}
	return true
}

// canonicalEncoding is the hashed representation of a normalised spec: the netstrings
// ("<decimal length>:<bytes>,") of keyEncodingVersion, Kind, URL, SourceID, Country,
// Window, decimal ParserVersion and Scope, concatenated in that order.
func canonicalEncoding(s Spec) []byte {
	fields := [...]string{
		keyEncodingVersion, s.Kind, s.URL, s.SourceID, s.Country, s.Window,
		strconv.Itoa(s.ParserVersion), s.Scope,
	}
	size := 0
	for _, f := range fields {
		size += len(f) + 6 // length digits (at most 4: fields are bounded), ':' and ','
	}
	b := make([]byte, 0, size)
	for _, f := range fields {
		b = strconv.AppendInt(b, int64(len(f)), 10)
		b = append(b, ':')
		b = append(b, f...)
		b = append(b, ',')
	}
	return b
}
