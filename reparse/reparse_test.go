package reparse_test

import (
	"context"
	"encoding/json"
	"flag"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/reparse"
	"github.com/idemscrape/idemscrape/tasks"
)

// The tests that reparse jobs through PostgreSQL and Redis use the worker rig of package
// handlers: handlers/reparse_test.go. These cover what needs neither.

func TestFlagsOptions(t *testing.T) {
	now := time.Date(2026, 4, 23, 12, 0, 0, 0, time.UTC)
	parse := func(args ...string) (reparse.Options, error) {
		fs := flag.NewFlagSet("reparse", flag.ContinueOnError)
		var f reparse.Flags
		f.Register(fs)
		require.NoError(t, fs.Parse(args))
		return f.Options(now)
	}
	o, err := parse("-kind", "shop", "-parser-version", "1", "-since", "24h", "-until", "2026-04-23T06:00:00Z",
		"-state", "failed, complete", "-keys", "a,,b", "-to-version", "2", "-dry-run")
	require.NoError(t, err)
	assert.Equal(t, "shop", o.Selection.Kind)
	assert.Equal(t, 1, o.Selection.ParserVersion)
	assert.Equal(t, now.Add(-24*time.Hour), o.Selection.From)
	assert.Equal(t, time.Date(2026, 4, 23, 6, 0, 0, 0, time.UTC), o.Selection.To)
	assert.Equal(t, []string{"failed", "complete"}, o.Selection.States)
	assert.Equal(t, []string{"a", "b"}, o.Selection.Keys)
	assert.Equal(t, 2, o.Version)
	assert.True(t, o.DryRun)

	for _, bad := range [][]string{
		{"-since", "yesterday"},
		{"-since", "-1h"},
		{"-since", "1h", "-until", "2h"},
		{"-state", "done"},
		{"-to-version", "-1"},
	} {
		_, err := parse(bad...)
		assert.Error(t, err, bad)
	}
}

func TestCheckVersion(t *testing.T) {
	parser := func(tasks.Payload, map[string]json.RawMessage) (handlers.Observation, error) {
		return handlers.Observation{}, nil
	}
	src := new(handlers.Parsers).Add("shop", 0, "", parser).Add("shop", 2, "", parser)
	require.NoError(t, reparse.CheckVersion(src, "shop", 2))
	err := reparse.CheckVersion(src, "shop", 7)
	var ve *reparse.VersionError
	require.ErrorAs(t, err, &ve)
	assert.Equal(t, []int{2}, ve.Registered)
	assert.EqualError(t, err, `reparse: kind "shop" has no parser registered for version 7 (registered versions: 2)`)
	assert.ErrorContains(t, reparse.CheckVersion(new(handlers.Parsers).Add("shop", 0, "", parser), "shop", 1),
		"registered versions: none")
}

func TestRunRequires(t *testing.T) {
	ctx := context.Background()
	_, err := reparse.Run(ctx, reparse.Config{}, reparse.Options{DryRun: true})
	assert.ErrorContains(t, err, "Store and Parsers are required")
}
