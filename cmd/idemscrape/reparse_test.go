package main

import (
	"bytes"
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/reparse"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/inputs"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestReparseCLI: `idemscrape reparse` over a catalog job that failed and kept its input.
func TestReparseCLI(t *testing.T) {
	ctx := context.Background()
	bin, pool, ns, st := cliFixture(t)

	// A catalog job that failed on parsing (say, a bug since fixed), with its saved input.
	spec, err := tasks.Spec{Kind: catalog.Kind, SourceID: "sku-7", Country: "US", Window: "2026-04-23", ParserVersion: 1}.Normalize()
	require.NoError(t, err)
	key, err := spec.Key()
	require.NoError(t, err)
	recordFailedJob(ctx, t, st, key, spec, "w")
	staged := map[string]json.RawMessage{
		"product": json.RawMessage(`{"Name":"Silent Tent","Currency":"USD","Token":"t","Exit":"127.0.0.1"}`),
		"price":   json.RawMessage(`{"Price":"19.99","Currency":"USD","Exit":"127.0.0.1"}`),
	}
	_, err = inputs.New(pool).Save(ctx, inputs.SaveParams{Key: key, Fence: 1, Kind: catalog.Kind, ParserVersion: 1,
		Outcome: "parse_error", Staged: staged})
	require.NoError(t, err)

	run := func(t *testing.T, args ...string) cliRun {
		t.Helper()
		return runCLI(t, bin, []string{"IDEMSCRAPE_PG=" + dsnOf(t, pool), "IDEMSCRAPE_REDIS=" + ns.Addr, "IDEMSCRAPE_KEY_PREFIX=" + ns.Prefix, "USER=tester"}, "", args...)
	}
	results := func() int { return testutil.Count(t, pool, `SELECT count(*) FROM results`) }

	r := run(t, "reparse", "-since", "yesterday")
	assert.Equal(t, 2, r.code)
	assert.Contains(t, r.stderr, "-since")

	r = run(t, "reparse", "-dry-run", "-kind", catalog.Kind, "-category", "parse_error")
	require.Equal(t, 0, r.code, r.stderr)
	assert.Contains(t, r.stdout, key+" (parser v1 → v1")
	assert.Contains(t, r.stdout, `+ price: "19.99"`)
	assert.Contains(t, r.stdout, "reparse (dry run: nothing written): selected 1, reparsed 1 (changed 1, unchanged 0), committed 0")
	assert.Zero(t, results())

	// A version no parser is registered for (a typo): refused before anything is written.
	jobs := func() int { return testutil.Count(t, pool, `SELECT count(*) FROM jobs`) }
	for _, args := range [][]string{{"-kind", catalog.Kind, "-state", "failed"}, {}} {
		r = run(t, append([]string{"reparse", "-to-version", "7"}, args...)...)
		assert.Equal(t, 2, r.code, r.stdout+r.stderr)
		assert.Contains(t, r.stderr, `kind "catalog" has no parser registered for version 7 (registered versions: none`)
		assert.Equal(t, 1, jobs())
		assert.Zero(t, results())
		assert.Zero(t, testutil.Count(t, pool, `SELECT count(*) FROM outbox`))
		job, err := st.JobGet(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, tasks.StateFailed, job.State)
	}

	r = run(t, "reparse", "-kind", catalog.Kind, "-state", "failed", "-json")
	require.Equal(t, 0, r.code, r.stderr)
	var sum reparse.Summary
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &sum), r.stdout)
	assert.Equal(t, 1, sum.Committed)
	assert.Contains(t, r.stderr, "reparse: selected 1", "progress on stderr")
	job, err := st.JobGet(ctx, key)
	require.NoError(t, err)
	assert.Equal(t, tasks.StateComplete, job.State)
	assert.Equal(t, 1, results())
	assert.Equal(t, 1, testutil.Count(t, pool, `SELECT count(*) FROM outbox WHERE event_key = $1`, handlers.EventKey(key)))

	// The job is complete now; a second reparse of it adds nothing.
	r = run(t, "reparse", "-keys", key, "-quiet")
	require.Equal(t, 0, r.code, r.stderr)
	assert.Contains(t, r.stdout, "committed 0, already done 1")
	assert.Equal(t, 1, results())

	// A job whose saved input still does not parse: the summary says which and why.
	spec8 := spec
	spec8.SourceID = "sku-8"
	key8, err := spec8.Key()
	require.NoError(t, err)
	recordFailedJob(ctx, t, st, key8, spec8, "w")
	_, err = inputs.New(pool).Save(ctx, inputs.SaveParams{Key: key8, Fence: 1, Kind: catalog.Kind, ParserVersion: 1,
		Outcome: "parse_error", Staged: map[string]json.RawMessage{"product": staged["product"]}})
	require.NoError(t, err)
	r = run(t, "reparse", "-dry-run", "-keys", key8)
	require.Equal(t, 0, r.code, r.stderr)
	assert.Contains(t, r.stdout, "  still failing: "+key8+": ")
	assert.Contains(t, r.stdout, `staging has no "price"`)
}

// TestReparseUnknownKindRefused: `reparse -kind K` for a kind this binary has no parser
// for is a usage error (exit 2) saying where the kind must be registered, before anything
// is read or written — not a run whose every job ends parser_version_unavailable (exit 0).
func TestReparseUnknownKindRefused(t *testing.T) {
	ctx := context.Background()
	pool := testutil.PG(t)
	ns := testutil.Redis(t)
	cliEnv(t, dsnOf(t, pool), ns.Addr)
	st := store.New(pool)
	spec, err := tasks.Spec{Kind: "shop", SourceID: "sku-1", Country: "US", Window: "2026-04-23", ParserVersion: 1}.Normalize()
	require.NoError(t, err)
	key, err := spec.Key()
	require.NoError(t, err)
	recordFailedJob(ctx, t, st, key, spec, "w")
	_, err = inputs.New(pool).Save(ctx, inputs.SaveParams{Key: key, Fence: 1, Kind: "shop", ParserVersion: 1,
		Outcome: "parse_error", Staged: map[string]json.RawMessage{"p": json.RawMessage(`{}`)}})
	require.NoError(t, err)
	for _, args := range [][]string{{"-kind", "shop"}, {"-kind", "shop", "-dry-run"}} {
		var stderr bytes.Buffer
		stdout, code := runInProcess(nil, &stderr, append([]string{"reparse"}, args...)...)
		assert.Equal(t, 2, code, stdout+stderr.String())
		assert.Contains(t, stderr.String(), `-kind "shop": this binary has no parser for the kind`)
		assert.Contains(t, stderr.String(), "reparse.Run")
		assert.NotContains(t, stdout, "parser_version_unavailable")
	}
	assert.Equal(t, 1, testutil.Count(t, pool, `SELECT count(*) FROM attempts`), "nothing written")
}
