package handlers_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/tasks"
)

// TestServiceComposition: the runner composes with a service's own task types — the
// middleware routes by kind, and ServerConfig wraps the host's own retry functions instead
// of replacing them.
func TestServiceComposition(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	reg := r.registry(t, nil)

	t.Run("MiddlewareRoutesByKind", func(t *testing.T) {
		var own []string
		next := asynq.HandlerFunc(func(_ context.Context, t *asynq.Task) error { own = append(own, t.Type()); return nil })
		h := reg.Middleware(next)
		require.NoError(t, h.ProcessTask(ctx, asynq.NewTask("email:send", nil)))
		key, task := r.job(t, "sku-7")
		require.NoError(t, h.ProcessTask(ctx, task))
		require.Equal(t, []string{"email:send"}, own, "only the service's own task reached next")
		requireState(t, r.st, key, tasks.StateComplete, "the catalog task ran through the runner")
	})

	t.Run("ServerConfigWrapsHostFuncs", func(t *testing.T) {
		hostErr := errors.New("smtp down")
		cfg := reg.ServerConfig(asynq.Config{
			RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return 42 * time.Second },
			IsFailure:      func(err error) bool { return !errors.Is(err, hostErr) },
		})
		require.Equal(t, 42*time.Second, cfg.RetryDelayFunc(1, hostErr, nil), "the host's delay for its own errors")
		require.False(t, cfg.IsFailure(hostErr), "the host's failure rule for its own errors")
		// The runner's decisions still win for the runner's errors: an undecodable payload
		// is retried late and uncounted.
		err := reg.ProcessTask(ctx, asynq.NewTask(catalog.Kind, []byte(`{"v":99}`)))
		require.Error(t, err)
		require.GreaterOrEqual(t, cfg.RetryDelayFunc(1, err, nil), time.Minute)
		require.False(t, cfg.IsFailure(err))
		bare := reg.ServerConfig(asynq.Config{})
		require.True(t, bare.IsFailure(hostErr), "without host funcs: asynq's defaults")

		// A task whose worker died with it (asynq's recoverer) is offered again soon, not
		// after asynq's backoff for its retry count (7 retries: over 40 minutes), while
		// the host's own task types keep the host's delay.
		ours, theirs := asynq.NewTask(catalog.Kind, nil), asynq.NewTask("email:send", nil)
		require.Greater(t, asynq.DefaultRetryDelayFunc(7, asynq.ErrLeaseExpired, ours), 30*time.Minute)
		require.Equal(t, handlers.LeaseExpiredRetryDelay, cfg.RetryDelayFunc(7, asynq.ErrLeaseExpired, ours))
		require.Equal(t, handlers.LeaseExpiredRetryDelay, bare.RetryDelayFunc(7, asynq.ErrLeaseExpired, ours))
		require.Equal(t, 42*time.Second, cfg.RetryDelayFunc(7, asynq.ErrLeaseExpired, theirs))
		require.Equal(t, handlers.LeaseExpiredRetryDelay, handlers.RetryDelay(7, fmt.Errorf("wrapped: %w", asynq.ErrLeaseExpired), ours))
	})

	t.Run("LeaseLengthOneField", func(t *testing.T) {
		_, err := handlers.NewRegistry(handlers.Config{Store: r.st, Redis: r.ns.Client, Provider: r.prov,
			LeaseLength: time.Minute, LeaseLengths: &handlers.LeaseLengthConfig{}})
		require.ErrorContains(t, err, "not both")
		reg2 := r.registry(t, func(c *handlers.Config) { c.LeaseLength = 15 * time.Second })
		key, task := r.job(t, "sku-8")
		require.NoError(t, reg2.ProcessTask(ctx, task))
		requireState(t, r.st, key, tasks.StateComplete)
	})

	t.Run("ParserChoosesCategoryWithFail", func(t *testing.T) {
		incomplete := func(tasks.Payload, map[string]json.RawMessage) (handlers.Observation, error) {
			return handlers.Observation{}, tasks.Fail(tasks.CategoryDestinationError, errors.New("page rendered without prices"))
		}
		reg3 := r.registryKind(t, catalog.Workflow(r.site.URL), incomplete)
		key, task := r.job(t, "sku-9")
		dec := decisionOf(reg3.ProcessTask(ctx, task))
		require.True(t, dec.Retry && dec.Counted, "retried, not failed as a parse error")
		requireJob(t, r.st, key, tasks.StateRetryable, tasks.CategoryDestinationError)
	})

	t.Run("StepChoosesCategoryWithFail", func(t *testing.T) {
		reg4 := registryWith(t, r, nil, func(u *sessions.Unit, _ string) {
			u.Steps[0].Run = func(context.Context, *sessions.StepContext) error {
				return fmt.Errorf("search: %w", tasks.Fail(tasks.CategoryNotFound, errors.New("product withdrawn")))
			}
		})
		key, task := r.job(t, "sku-10")
		require.ErrorIs(t, reg4.ProcessTask(ctx, task), asynq.SkipRetry)
		requireJob(t, r.st, key, tasks.StateFailed, tasks.CategoryNotFound)
	})
}
