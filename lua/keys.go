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

// Lease is the lease of a job. // HASH owner, token; PEXPIRE = lease end
func (k Keys) Lease(jobKey string) string { return k.prefix + k.Tag(jobKey) + ":lease" }

// Fence is the last fencing token issued for a job. // STRING integer
func (k Keys) Fence(jobKey string) string { return k.prefix + k.Tag(jobKey) + ":fence" }
