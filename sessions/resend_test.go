package sessions_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestThrottleResend: a GET answered 429 with a Retry-After within ThrottleWaitMax is sent
// again on the same session (same exit) once it passed, at most ThrottleRetries times; a
// longer Retry-After, a POST, a setting of -1 or a context that ends during the wait give
// the 429 back at once, as before.
func TestThrottleResend(t *testing.T) {
	e := setup(t, testutil.FakeProxyConfig{Seed: 5}, testutil.FakeSiteConfig{Seed: 5})
	bound := func(t *testing.T, ctx context.Context, cfg sessions.CollectorConfig) *sessions.Bound {
		s, err := e.provider.NewSession("US", 0, time.Now())
		require.NoError(t, err)
		cfg.Guard = sessions.LoopbackGuard()
		cfg.IgnoreRobotsTxt = true
		b, err := sessions.NewCollector(ctx, s, &cfg)
		require.NoError(t, err)
		t.Cleanup(b.Close)
		return b
	}
	url := e.site.URL + "/search?q=sku-1"

	t.Run("ShortRetryAfterResent", func(t *testing.T) {
		b := bound(t, context.Background(), sessions.CollectorConfig{})
		first, err := b.Get(url)
		require.NoError(t, err)
		e.site.Throttle(2, time.Second)
		resp, err := b.Get(url)
		require.NoError(t, err, "sent again twice, then answered")
		assert.Equal(t, 200, resp.StatusCode)
		assert.EqualValues(t, 2, b.Resent())
		assert.Equal(t, first.Headers.Get("X-Exit"), resp.Headers.Get("X-Exit"), "the same session, the same exit")
	})
	t.Run("RetriesBounded", func(t *testing.T) {
		b := bound(t, context.Background(), sessions.CollectorConfig{ThrottleRetries: 1})
		e.site.Throttle(2, time.Second)
		_, err := b.Get(url)
		assert.Equal(t, tasks.CategoryThrottled, sessions.CategoryOf(err))
		assert.EqualValues(t, 1, b.Resent())
		e.site.Throttle(0, 0)
	})
	t.Run("NotResent", func(t *testing.T) {
		for name, tc := range map[string]struct {
			cfg    sessions.CollectorConfig
			after  time.Duration
			method string
		}{
			"LongRetryAfter": {after: 3 * time.Second, method: "GET"},
			"Off":            {cfg: sessions.CollectorConfig{ThrottleWaitMax: -1}, after: time.Second, method: "GET"},
			"Post":           {after: time.Second, method: "POST"},
		} {
			t.Run(name, func(t *testing.T) {
				b := bound(t, context.Background(), tc.cfg)
				e.site.Throttle(1, tc.after)
				_, err := b.Fetch(tc.method, url, nil, nil)
				var fe *sessions.FetchError
				require.ErrorAs(t, err, &fe)
				assert.Equal(t, tasks.CategoryThrottled, fe.Category)
				assert.Equal(t, tc.after, fe.RetryAfter)
				assert.Zero(t, b.Resent())
			})
		}
	})
	t.Run("ContextEndsTheWait", func(t *testing.T) {
		// The job's context ends while the re-send waits: the limiter hears the 429's
		// Retry-After (it pauses the host) just before the wait begins, and cancels then.
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		b := bound(t, ctx, sessions.CollectorConfig{ThrottleWaitMax: time.Hour, Limiter: cancelOnPause{cancel}})
		e.site.Throttle(1, time.Hour)
		_, err := b.Get(url) // an hour's Retry-After: a wait that ignored the context would hang here
		// The 429, given back when the job's context ends (or the request cut, if the
		// cancellation reached its body first): never a re-send.
		assert.Contains(t, []tasks.Category{tasks.CategoryThrottled, tasks.CategoryInterrupted}, sessions.CategoryOf(err))
		assert.Zero(t, b.Resent())
		e.site.Throttle(0, 0)
	})
}

// cancelOnPause is a politeness.HostLimiter whose Pause (a 429's Retry-After) ends the job's context.
type cancelOnPause struct{ cancel context.CancelFunc }

func (cancelOnPause) Wait(context.Context, string) error             { return nil }
func (l cancelOnPause) Pause(context.Context, string, time.Duration) { l.cancel() }
