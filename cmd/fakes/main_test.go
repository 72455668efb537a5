package main

import (
	"bytes"
	"errors"
	"flag"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/testutil"
)

// TestParseFlags: -challenge and -challenge-block-every reach the shop's configuration;
// values out of range are refused, naming the flag; the defaults leave challenges off.
func TestParseFlags(t *testing.T) {
	var out bytes.Buffer
	o, err := parseFlags(nil, &out)
	require.NoError(t, err)
	assert.Equal(t, testutil.FakeSiteConfig{Seed: 1, Products: 20}, o.siteConfig())
	assert.Empty(t, o.shopMode())

	o, err = parseFlags([]string{"-challenge", "-products", "5"}, &out)
	require.NoError(t, err)
	assert.Equal(t, testutil.FakeSiteConfig{Seed: 1, Products: 5, Challenge: true}, o.siteConfig())
	assert.Contains(t, o.shopMode(), "challenge mode")

	o, err = parseFlags([]string{"-challenge", "-challenge-block-every", "4", "-seed", "9"}, &out)
	require.NoError(t, err)
	assert.Equal(t, testutil.FakeSiteConfig{Seed: 9, Products: 20, Challenge: true, ChallengeBlockEvery: 4}, o.siteConfig())
	assert.Contains(t, o.shopMode(), "1 challenge in 4 a 403 block")
	assert.Empty(t, out.String())

	for msg, args := range map[string][]string{
		"-challenge-block-every needs -challenge":           {"-challenge-block-every", "3"},
		"-challenge-block-every -1: want 0 (never) or more": {"-challenge", "-challenge-block-every", "-1"},
		"-products 0: want at least 1":                      {"-products", "0"},
		"-disconnect 1.5: want a probability in 0..1":       {"-disconnect", "1.5"},
		`unexpected argument "extra"`:                       {"-challenge", "extra"},
	} {
		_, err := parseFlags(args, &out)
		var ue *usageError
		require.True(t, errors.As(err, &ue), "%v: %v", args, err)
		assert.Equal(t, msg, err.Error())
	}

	out.Reset()
	_, err = parseFlags([]string{"-h"}, &out)
	assert.ErrorIs(t, err, flag.ErrHelp)
	assert.Contains(t, out.String(), usage)
	assert.Contains(t, out.String(), "-challenge-block-every")
}
