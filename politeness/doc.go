// Package politeness is what keeps a fleet of idemscrape workers polite to a destination:
// robots.txt, per-host rate limits and Retry-After pauses, and their configuration. All of
// it is fleet-wide, not per process: the state lives in Redis, so a hundred workers ask a
// host no more than one well-behaved client would.
//
//   - robots.txt (RobotsCache): fetched once per origin (scheme://host[:port]) for the whole
//     fleet, by one worker at a time under a fetch lock, and cached in Redis for the file's
//     TTL (Cache-Control, clamped to [RobotsConfig.MinTTL, RobotsConfig.TTL]), with a short
//     in-memory copy per process. The fetch goes through the session of the request that
//     needed it (Via), and its bytes are the fleet's (RobotsConfig.OnFetch), never the job's.
//     The lock is a short lease renewed while the fetch runs, and the others wait for it at
//     most a quarter of their request's time (RobotsConfig.LockWaitMax): a holder that stops
//     frees it within the wait, and the first waiting worker fetches instead; a live holder
//     still fetching then ends the waiting request as network (retryable).
//     Status handling follows RFC 9309: a disallowed path is terminal (robots_disallowed), a
//     robots.txt answering 5xx or 429 disallows everything for a while, retryably
//     (destination_error).
//   - Host rate limits (Limits, Limiter): a host with a Limit is paced by one token bucket
//     (GCRA) in Redis shared by every worker, on the Redis server's clock: one EVALSHA of
//     lua's hostlimit.lua before every request to it. A host without a limit costs no round
//     trip. Limits come from LimitsConfig.HostLimits (per host), a kind's own limit, or
//     LimitsConfig.DefaultHostLimit.
//   - Retry-After (HostLimiter.Pause): a 429 or 503 with Retry-After from a host pauses that
//     host in Redis (lua's hostpause.lua) for every worker, for at most MaxHostPause; every
//     limiter of a limited host honours the pause, even for slots already handed out.
//
// A runner's attempt uses them through its session's collector (sessions.CollectorConfig:
// Robots, Limiter; handlers.Registry sets both). Before every hop — the first request,
// each redirect, a render's navigation — the collector checks the URL against the
// RobotsCache (fetching robots.txt through the same session if no worker has it), then
// waits in Limiter.Wait for the host's slot, under the job's context: losing the lease or
// shutting down ends the wait at once. A slot further away than HostWaitMax is not waited
// for: the attempt ends as throttled with that distance as its Retry-After (HostWaitError),
// and the runner retries it once the slot is due, without charging the job. When a
// response is a 429/503 with Retry-After, the collector calls Limiter.Pause, and every
// worker's next request to the host waits for the pause's end. What politeness refuses
// ends the request with an *Error, which sessions classifies like any failed request.
//
// The Redis scripts (hostlimit.lua, hostpause.lua, unlock.lua for the robots.txt fetch
// lock) and their thin wrappers stay in package lua with every other script, whose tests
// check each script's header and its keys' cluster slots; the keys (lua.Keys: HostTAT,
// HostNotBefore, Robots, RobotsLock) share the host's hash tag.
//
// Not here: the exit-integrity check (a session whose responses come from another exit
// than its first one ends as session_lost) is about sessions, not about the destination,
// and stays in package sessions, as do the SSRF guard and the byte budgets.
package politeness
