package main

import (
	"flag"
	"regexp"
	"sort"
	"strconv"
	"strings"

	"github.com/idemscrape/idemscrape/cmd/internal/envflag"
	"github.com/idemscrape/idemscrape/internal/secretenv"
	"github.com/idemscrape/idemscrape/service"
	"github.com/idemscrape/idemscrape/sessions"
)

// flagEnv is how envflag ends a flag's usage: " ($IDEMSCRAPE_NAME)".
var flagEnv = regexp.MustCompile(`\(\$(` + envPrefix + `[A-Z0-9_]+)\)$`)

// readElsewhere are IDEMSCRAPE_* variables the worker does not read but other binaries,
// the tests or the demo of this repository do: a shared environment may hold them, so
// they are not reported.
var readElsewhere = []string{
	// cmd/scheduler
	"SCHEDULER_CONFIG", "SCHEDULER_HTTP_ADDR", "SCHEDULER_ID", "NO_SCHEDULER", "NO_RECONCILER",
	// cmd/idemscrape
	"QUEUE", "WINDOW_BUDGETS",
	// cmd/demo, tests, benchmarks
	"DEMO_UI", "PG_BIN", "PROMTOOL", "SOAK", "GROWTH_ROWS", "SWEEP_BIG_ROWS", "RESUME_FIGURES",
}

// readElsewherePrefixes are prefixes of such variables (testutil's IDEMSCRAPE_TEST_*).
var readElsewherePrefixes = []string{envPrefix + "TEST_"}

// knownEnv is every IDEMSCRAPE_* variable the worker reads (each flag's, the secrets, the
// chaos settings) and those read elsewhere in the repository.
func knownEnv(fs *flag.FlagSet) map[string]bool {
	known := map[string]bool{}
	fs.VisitAll(func(f *flag.Flag) {
		if m := flagEnv.FindStringSubmatch(f.Usage); m != nil {
			known[m[1]] = true
		}
	})
	withFile := func(names ...string) {
		for _, n := range names {
			known[n], known[n+secretenv.FileSuffix] = true, true
		}
	}
	withFile(service.EnvBasicAuthPassword, envPrefix+envflag.PGPasswordEnv, envPrefix+envflag.RedisPasswordEnv)
	known[service.EnvBasicAuthUser] = true
	known[EnvFailpoints], known[EnvChaosRetryScale] = true, true
	known[envflag.EnvProvidersFile] = true
	known[envPrefix+"CHROMIUM"] = true // sessions: the browser's executable
	proxy := []string{sessions.EnvProvider, sessions.EnvUser, sessions.EnvPassword, sessions.EnvZone, sessions.EnvGateway,
		sessions.EnvName, sessions.EnvPrice, sessions.EnvPriceCountries, sessions.EnvTier, sessions.EnvExitHeader}
	for n := 1; n <= sessions.MaxEnvProviders+1; n++ {
		suffix := ""
		if n > 1 {
			suffix = "_" + strconv.Itoa(n)
		}
		for _, p := range proxy {
			known[p+suffix] = true
		}
		known[sessions.EnvPassword+suffix+secretenv.FileSuffix] = true
	}
	for _, n := range readElsewhere {
		known[envPrefix+n] = true
	}
	return known
}

// unknownEnvVar is an IDEMSCRAPE_* variable of the environment nobody reads, and the known
// one closest to it.
type unknownEnvVar struct {
	Name, Closest string
}

// unknownEnv returns the IDEMSCRAPE_* variables of environ (os.Environ's form) that are
// neither read by the worker nor elsewhere in the repository, sorted, each with the
// closest known name. Values are never looked at.
func unknownEnv(environ []string, fs *flag.FlagSet) []unknownEnvVar {
	known := knownEnv(fs)
	names := make([]string, 0, len(known))
	for n := range known {
		names = append(names, n)
	}
	sort.Strings(names)
	var out []unknownEnvVar
	for _, kv := range environ {
		name, _, _ := strings.Cut(kv, "=")
		if !strings.HasPrefix(name, envPrefix) || known[name] || hasAnyPrefix(name, readElsewherePrefixes) {
			continue
		}
		out = append(out, unknownEnvVar{Name: name, Closest: closest(name, names)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

func hasAnyPrefix(s string, prefixes []string) bool {
	for _, p := range prefixes {
		if strings.HasPrefix(s, p) {
			return true
		}
	}
	return false
}

// closest is the name of names at the least edit distance from s (the first of those, in
// order).
func closest(s string, names []string) string {
	best, bestD := "", -1
	for _, n := range names {
		if d := editDistance(s, n); bestD < 0 || d < bestD {
			best, bestD = n, d
		}
	}
	return best
}

// editDistance is the Levenshtein distance of a and b (bytes: the names are ASCII).
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
