package lua

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"
)

// Keys builds every Redis key idemscrape uses for a job. All keys of one job share the hash
// tag {<tag>}, so scripts touching several of them run on Redis Cluster. The tag is the job
// key itself when it holds no brace (every key tasks derives), otherwise a hash of it, since
// a brace inside the key would end the tag early.
type Keys struct {
	prefix string
}

// NewKeys returns a builder for keys under prefix. The prefix may not contain braces (it
// would become the hash tag of every key).
func NewKeys(prefix string) (Keys, error) {
	if strings.ContainsAny(prefix, "{}") {
		return Keys{}, fmt.Errorf("lua: key prefix %q may not contain '{' or '}'", prefix)
	}
	return Keys{prefix: prefix}, nil
}

// Tag returns the hash tag of job key, braces included.
func (k Keys) Tag(jobKey string) string {
	if strings.ContainsAny(jobKey, "{}") {
		sum := sha256.Sum256([]byte(jobKey))
		return "{" + hex.EncodeToString(sum[:12]) + "}"
	}
	return "{" + jobKey + "}"
}

// Lease is the lease of a job: STRING "<owner>" (a runner's Take) or "<token>:<owner>" (a
// Claim: the reconciler's rescue, reparse); PX = lease end. claim.lua says how the forms
// meet during a rolling deploy.
func (k Keys) Lease(jobKey string) string { return k.jobKey(jobKey, ":lease") }

// Fence is the last fencing token issued for a job. // STRING integer; PX = counter end
func (k Keys) Fence(jobKey string) string { return k.jobKey(jobKey, ":fence") }

// jobKey is prefix + Tag(jobKey) + suffix in one allocation (the lease hot path builds
// four of these per job).
func (k Keys) jobKey(jobKey, suffix string) string {
	if strings.ContainsAny(jobKey, "{}") {
		return k.prefix + k.Tag(jobKey) + suffix
	}
	return k.prefix + "{" + jobKey + "}" + suffix
}

// HostTag returns the hash tag of a destination host (host[:port], lower case), braces
// included: "{host:<host>}", or a hash of the host if it holds a brace.
func (k Keys) HostTag(host string) string {
	if strings.ContainsAny(host, "{}") {
		sum := sha256.Sum256([]byte(host))
		return "{host:" + hex.EncodeToString(sum[:12]) + "}"
	}
	return "{host:" + host + "}"
}

// HostTAT is a host's GCRA theoretical arrival time. // STRING integer, server µs
func (k Keys) HostTAT(host string) string { return k.prefix + k.HostTag(host) + ":tat" }

// HostNotBefore is the server time before which no worker sends to a host (Retry-After).
// // STRING integer, server µs
func (k Keys) HostNotBefore(host string) string { return k.prefix + k.HostTag(host) + ":notbefore" }

// Robots is the cached robots.txt of an origin (scheme://host[:port]). // STRING JSON
func (k Keys) Robots(origin string) string { return k.prefix + k.HostTag(origin) + ":robots" }

// RobotsLock is held by the one worker fetching an origin's robots.txt. // STRING owner, PX
func (k Keys) RobotsLock(origin string) string { return k.prefix + k.HostTag(origin) + ":robots-lock" }

// WindowBudget is the money budget of a kind's collection window, shared by the fleet
// (winbudget.lua). // HASH spent + one r:<owner> field per reservation; PX = unused for
// a day (restored from PostgreSQL after)
func (k Keys) WindowBudget(kind, window string) string {
	id := kind + "/" + window
	if strings.ContainsAny(id, "{}") {
		sum := sha256.Sum256([]byte(id))
		id = hex.EncodeToString(sum[:12])
	}
	return k.prefix + "{budget:" + id + "}"
}

// routeID is the hash-tag body of a routing key: id, or a hash of it if it holds a brace.
func routeID(id string) string {
	if strings.ContainsAny(id, "{}") {
		sum := sha256.Sum256([]byte(id))
		return hex.EncodeToString(sum[:12])
	}
	return id
}

// RouteTier is the lowest exit tier a destination (a host, or a kind's destination) has not
// blocked lately: a tier rank, set when a tier was blocked, gone after the escalation's
// TTL (handlers' routing). // STRING integer; PX = escalation end
func (k Keys) RouteTier(dest string) string { return k.prefix + "{route:" + routeID(dest) + "}:tier" }

// RouteNoPeers marks a provider that answered "no exit" for a country lately (handlers'
// routing). // STRING "1"; PX = until the provider is tried for the country again
func (k Keys) RouteNoPeers(provider, country string) string {
	return k.prefix + "{route:" + routeID(provider) + "}:nopeers:" + routeID(country)
}
