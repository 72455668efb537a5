package main

import (
	"bytes"
	"context"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// tiny is a scenario with one of every fault, small enough for the unit tests. Its stale
// commit is cut on its way once (CutStale), so that the one judged is armed in its place.
func tiny() Config {
	return Config{Jobs: 30, Baseline: 5, FaultMixJobs: 5, Workers: 2, Concurrency: 5, Lease: 3 * time.Second,
		RandomKills: 1, AfterFetch: 1, AfterCommit: 1, AfterXadd: 1, BeforeCommit: 1, CutStale: 1, ArmAtStart: true, Pauses: 1, RedisWipes: 1, PGRounds: 2,
		ProxyFaults: true, DisconnectProb: 0.10, Canary: true, Challenge: true, StrictEvents: true, Seed: 5, Timeout: 10 * time.Minute}
}

func TestChaos(t *testing.T) {
	// The runs are independent (each its own redis-server, database, fakes and processes)
	// and mostly wait on their processes: they run in parallel with each other and with
	// TestChaosCatchesMissingFence's.
	t.Run("TinyScenarioPasses", func(t *testing.T) {
		t.Parallel()
		var out bytes.Buffer
		rep, err := run(context.Background(), tiny(), t, &out)
		require.NoError(t, err)
		rep.Print(&out)
		t.Log("\n" + out.String())
		assert.Empty(t, rep.Failed())
		assert.Empty(t, rep.Incomplete, "every fault fired and every job ended")
		names := map[string]bool{}
		for _, r := range rep.Invariants {
			names[r.Name] = true
			assert.Contains(t, []string{resultPass, resultInfo}, r.Result, r.Name)
		}
		for _, n := range []string{InvLost, InvDupResults, InvDupEffects, InvEffectsLost, InvEffectsWiped, InvReexec, InvXaddReplays,
			InvStale, InvStaleRefused, InvFences, InvAttemptRows, InvTwoSessions, InvBudget, InvCanary, InfoBytes, InfoBytesChaos} {
			assert.True(t, names[n], "invariant %q not checked", n)
		}
		// A stale commit reached PostgreSQL and was refused (the check reads PostgreSQL),
		// sent while another attempt held its job running: refused by the fence predicate.
		// The first was cut on its way: no verdict, not counted; another took its place.
		// (A pg_terminate_backend round may cut one more: each is armed again.)
		assert.Contains(t, lineOf(out.String(), InvStaleRefused), "1 refused of k = 1 ")
		assert.Contains(t, lineOf(out.String(), InvStaleRefused), "1 of 1 meant to be sent while another attempt held the job running were")
		assert.Regexp(t, `; [1-9]\d* ended in error, no verdict, not counted \([1-9]\d* of them meant to be sent while another attempt held the job running\): another armed in the place of each`,
			lineOf(out.String(), InvStaleRefused))
		// The faults were injected, not just configured.
		faults := map[string]string{}
		for _, f := range rep.Faults {
			faults[f.Name] = f.Observed
		}
		for name, want := range map[string]string{
			"failpoint after_fetch (SIGKILL)":                    "fired",
			"failpoint after_commit (SIGKILL)":                   "fired",
			"failpoint after_xadd (dispatcher SIGKILL)":          "fired",
			"redis-server killed, restarted empty":               "1",
			"failpoint before_commit (SIGSTOP until taken over)": "while another attempt held the job running, 1 of whose commits met it so",
		} {
			assert.Contains(t, faults[name], want, name)
			assert.NotRegexp(t, `^0 `, faults[name], "%s: nothing injected", name)
		}
		// The harness's cut (-cut-stale 1) or a pg_terminate_backend round that reached the
		// same commit first: either way a stale commit ended in error and another was armed.
		assert.Regexp(t, `; [01] cut on their way by the harness \(-cut-stale\), [1-9]\d* armed in place of one that ended in error$`,
			faults["failpoint before_commit (SIGSTOP until taken over)"])
		// The shop challenged (every new exit meets the challenge; how many attempts then
		// ran warm depends on the run, and the invariants above held either way).
		assert.Regexp(t, `^[1-9]\d* challenge pages served \(whole run\); \d+ of [1-9]\d* chaos-window attempts ended on a warm session \(\d+ lost attempts apart\)$`,
			faults["shop: bot challenge (clearance per exit)"])
	})

	t.Run("BrokenBuildFailsAndNamesTheInvariant", func(t *testing.T) {
		t.Parallel()
		// The workers run as a broken build that writes a second result row per job; the
		// command must exit 1 and name the invariant.
		cfg := Config{Jobs: 8, Workers: 1, Concurrency: 4, Lease: 3 * time.Second, Break: fpDupResult + ":1",
			Seed: 6, Timeout: 8 * time.Minute}
		var out bytes.Buffer
		code := runMain(context.Background(), cfg, &out)
		t.Log("\n" + out.String())
		assert.Equal(t, 1, code)
		assert.Contains(t, out.String(), "FAIL: "+InvDupResults)
		line := lineOf(out.String(), InvDupResults)
		assert.Contains(t, line, resultFail)
		assert.Contains(t, line, "catalog:sku-", "the offending job keys are named")
	})
}

// TestChaosCatchesMissingFence runs the workers as builds without PostgreSQL's last line
// of defence and shows that the harness fails and names the invariant. A stale commit (a
// worker stopped just before its commit statement) reaches PostgreSQL in every run: the
// first one while another attempt holds its job running under a higher fence (that attempt
// held at the shop meanwhile), where only the fence predicate refuses it, so a commit
// without its fence check (chaos_nofence) or with the state check alone (chaos_nofencepred)
// is accepted: a result under a fence below its job's. The second stale commit of a
// two-commit case is continued at the takeover (the job retryable) or, with -stale-wait,
// after another worker finished the job (complete), where the state check alone refuses
// it; with the fence and the state check both gone and results that bypass the unique
// index, it leaves a second result.
func TestChaosCatchesMissingFence(t *testing.T) {
	for _, tc := range []struct {
		name, tags    string
		seed          int64
		workers, kill int // kill: before_commit firings (each stops one worker)
		// staleWait keeps a stopped worker of the second round stopped until another
		// worker committed the job, so that its commit comes second.
		staleWait time.Duration
		want      []string
	}{
		{"NoFenceCheck", tagNoFence, 11, 2, 1, 0, []string{InvStale, InvStaleRefused}},
		{"NoFenceCheckNoUniqueIndex", tagNoFence + "," + tagNoUnique, 12, 3, 2, 4 * time.Minute, []string{InvStale, InvStaleRefused, InvDupResults}},
		{"StateCheckWithoutFence", tagNoFencePred, 13, 2, 1, 0, []string{InvStale, InvStaleRefused}},
		{"StateCheckWithoutFenceStaleWait", tagNoFencePred, 14, 3, 2, 4 * time.Minute, []string{InvStale, InvStaleRefused}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg := Config{Jobs: 12, Workers: tc.workers, Concurrency: 3, Lease: 3 * time.Second, BeforeCommit: tc.kill, ArmAtStart: true,
				StaleWait: tc.staleWait, BuildTags: tc.tags, Seed: tc.seed, Timeout: 8 * time.Minute}
			var out bytes.Buffer
			code := runMain(context.Background(), cfg, &out)
			t.Log("\n" + out.String())
			require.Equal(t, 1, code, "the harness must fail on a build without the guards")
			for _, inv := range tc.want {
				assert.Contains(t, out.String(), inv, inv)
				line := lineOf(out.String(), inv)
				assert.Contains(t, line, resultFail, "invariant %q", inv)
				assert.Contains(t, line, "catalog:sku-", "the offending job keys are named: %s", inv)
			}
			assert.Contains(t, lineOf(out.String(), "FAIL: "), InvStale)
			// The stale commit sent while another attempt held the job running was
			// accepted: its result's fence is below the job's.
			assert.Regexp(t, `[1-9]\d* results with result fence < job fence, e\.g\. catalog:sku-\S+ \(result fence \d+, job fence \d+\)`, lineOf(out.String(), InvStale))
			assert.Contains(t, lineOf(out.String(), InvStaleRefused), "1 of 1 meant to be sent while another attempt held the job running were")
		})
	}
}

// TestChaosCatchesFenceOnly runs the workers as the build whose commit lost its fence
// predicate alone (chaos_nofencepred: `j.fence = i.token` gone, the state check kept) and
// cuts the run's first stale commit on its way (CutStale: the harness holds the job's row
// lock and ends the commit's connection once it waits there), as a pg_terminate_backend
// round that meets the one stale commit only the fence can refuse does. That commit ends
// in error: it must not count as refused, and the stale commit armed in its place (while
// another attempt holds the job running again) is accepted by this build, so the run fails.
// The cut is made on a signal (the statement seen waiting on the lock), not on timing.
func TestChaosCatchesFenceOnly(t *testing.T) {
	t.Parallel() // with TestChaos's and TestChaosCatchesMissingFence's runs
	cfg := Config{Jobs: 12, Workers: 2, Concurrency: 3, Lease: 3 * time.Second, BeforeCommit: 1, CutStale: 1, ArmAtStart: true,
		BuildTags: tagNoFencePred, Seed: 15, Timeout: 8 * time.Minute}
	var out bytes.Buffer
	code := runMain(context.Background(), cfg, &out)
	t.Log("\n" + out.String())
	require.Equal(t, 1, code, "the harness must fail on a build without the fence predicate, its first stale commit cut")
	assert.Contains(t, lineOf(out.String(), "FAIL: "), InvStale)
	stale := lineOf(out.String(), InvStale)
	assert.Contains(t, stale, resultFail)
	assert.Regexp(t, `[1-9]\d* results with result fence < job fence, e\.g\. catalog:sku-\S+ \(result fence \d+, job fence \d+\)`, stale)
	refused := lineOf(out.String(), InvStaleRefused)
	assert.Contains(t, refused, resultFail)
	assert.Contains(t, refused, "0 refused of k = ", "the cut commit is not counted as refused")
	assert.Contains(t, refused, "1 of 1 meant to be sent while another attempt held the job running were")
	assert.Regexp(t, `; [1-9]\d* ended in error, no verdict, not counted`, refused)
	fault := lineOf(out.String(), "failpoint before_commit (SIGSTOP until taken over)")
	assert.Regexp(t, `1 cut on their way by the harness \(-cut-stale\), [1-9]\d* armed in place of one that ended in error`, fault)
}

func lineOf(s, prefix string) string {
	for _, l := range strings.Split(s, "\n") {
		if strings.HasPrefix(l, prefix) {
			return l
		}
	}
	return ""
}

func TestFlags(t *testing.T) {
	t.Run("ShortIsTheCIMix", func(t *testing.T) {
		c, err := parseFlags([]string{"-short"}, io.Discard)
		require.NoError(t, err)
		assert.Equal(t, Short(), c)
	})
	t.Run("DefaultIsTheFullMix", func(t *testing.T) {
		c, err := parseFlags(nil, io.Discard)
		require.NoError(t, err)
		assert.Equal(t, Full(), c)
		assert.Equal(t, 10000, c.Jobs)
		assert.True(t, c.StrictEvents, "events lost with Redis's data fail the run by default")
	})
	t.Run("StrictEventsCanBeRelaxed", func(t *testing.T) {
		c, err := parseFlags([]string{"-short", "-strict-events=false"}, io.Discard)
		require.NoError(t, err)
		assert.False(t, c.StrictEvents)
		c, err = parseFlags([]string{"-strict-events"}, io.Discard)
		require.NoError(t, err)
		assert.True(t, c.StrictEvents)
	})
	t.Run("FlagsOverrideTheMix", func(t *testing.T) {
		c, err := parseFlags([]string{"-short", "-jobs", "7", "-kills", "0", "-proxy-faults", "false", "-lease", "2s", "-challenge", "true"}, io.Discard)
		require.NoError(t, err)
		assert.True(t, c.Challenge)
		assert.False(t, Short().Challenge, "off unless asked")
		assert.Equal(t, 7, c.Jobs)
		assert.Equal(t, 0, c.RandomKills)
		assert.False(t, c.ProxyFaults)
		assert.Equal(t, 2*time.Second, c.Lease)
	})
	t.Run("Refused", func(t *testing.T) {
		for name, args := range map[string][]string{
			"UnknownBreak":   {"-break", "no_fence:1"},
			"UnknownTag":     {"-build-tags", "chaos_nofence,race"},
			"TwoCommits":     {"-build-tags", "chaos_nofence,chaos_nofencepred"},
			"StaleOneWorker": {"-before-commit", "1", "-workers", "1"},
			"CutNoStale":     {"-before-commit", "0", "-cut-stale", "1"},
			"ZeroJobs":       {"-jobs", "0"},
			"ShortLease":     {"-lease", "10ms"},
			"BadBool":        {"-canary", "maybe"},
			"StrayArg":       {"extra"},
		} {
			t.Run(name, func(t *testing.T) {
				_, err := parseFlags(args, io.Discard)
				assert.Error(t, err)
			})
		}
	})
	t.Run("BadBoolNamesTheFlag", func(t *testing.T) {
		_, err := parseFlags([]string{"-challenge", "maybe"}, io.Discard)
		assert.EqualError(t, err, `-challenge "maybe": want true or false`)
	})
}
