package handlers_test

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/handlers"
)

// TestThrottleResend: with the collector's default ThrottleWaitMax, a 429 with Retry-After
// 1 s in the middle of a unit is waited out on the same session: the job completes in one
// attempt, not replayed, its bytes those of the three requests plus the 429, and
// idemscrape_throttle_resends_total counts the re-send.
func TestThrottleResend(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	metrics := prometheus.NewRegistry()
	reg := r.registry(t, func(c *handlers.Config) {
		c.Collector.ThrottleWaitMax = 0 // the default
		c.Registerer = metrics
	})
	base, task := r.job(t, "sku-7")
	require.NoError(t, reg.ProcessTask(ctx, task))
	r.site.Throttle(1, time.Second)
	key, task := r.job(t, "sku-8")
	require.NoError(t, reg.ProcessTask(ctx, task))
	atts, err := r.st.AttemptList(ctx, key)
	require.NoError(t, err)
	require.Len(t, atts, 1, "one attempt")
	baseAtts, err := r.st.AttemptList(ctx, base)
	require.NoError(t, err)
	assert.Less(t, atts[0].Bytes, baseAtts[0].Bytes*3/2, "not replayed: three requests and a 429, not six")
	n := 0.0
	for _, m := range metricFamily(t, metrics, "idemscrape_throttle_resends_total") {
		n += m.GetCounter().GetValue()
	}
	assert.Equal(t, 1.0, n)
}
