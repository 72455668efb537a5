package main

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestFailpoints(t *testing.T) {
	t.Run("OffByDefault", func(t *testing.T) {
		fp, err := parseFailpoints("")
		require.NoError(t, err)
		assert.Empty(t, fp)
		assert.Nil(t, fp.afterPublish(), "no dispatcher failpoint unless enabled")
		assert.Nil(t, fp.committer(nil, nil), "no committer wrapper unless enabled")
		wf := fp.workflow(nil)
		assert.Nil(t, wf, "the workflow is not wrapped unless enabled")
	})
	t.Run("Parsed", func(t *testing.T) {
		fp, err := parseFailpoints("after_fetch:0.01, after_commit:0.5,after_xadd:1,dup_result:0,before_commit:1")
		require.NoError(t, err)
		assert.Equal(t, failpoints{FailAfterFetch: 0.01, FailAfterCommit: 0.5, FailAfterXadd: 1, FailDupResult: 0, FailBeforeCommit: 1}, fp)
		assert.True(t, fp.on(FailAfterXadd))
		assert.False(t, fp.on(FailDupResult), "probability 0 is off")
		assert.NotNil(t, fp.afterPublish())
	})
	t.Run("Refused", func(t *testing.T) {
		for name, s := range map[string]string{
			"Unknown":       "after_lunch:0.1",
			"NoProbability": "after_fetch",
			"OverOne":       "after_fetch:1.5",
			"Negative":      "after_commit:-0.1",
			"NotANumber":    "after_xadd:often",
		} {
			t.Run(name, func(t *testing.T) {
				_, err := parseFailpoints(s)
				assert.ErrorContains(t, err, EnvFailpoints)
			})
		}
	})
	t.Run("RetryScale", func(t *testing.T) {
		opt, err := retryPolicies("")
		require.NoError(t, err)
		assert.Nil(t, opt)
		opt, err = retryPolicies("0.02")
		require.NoError(t, err)
		assert.NotNil(t, opt)
		for _, bad := range []string{"0", "2", "-1", "x"} {
			_, err := retryPolicies(bad)
			assert.ErrorContains(t, err, EnvChaosRetryScale, bad)
		}
	})
}
