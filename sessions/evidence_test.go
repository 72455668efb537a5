package sessions_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// countingServer is a local destination that counts every request it gets.
type countingServer struct {
	*httptest.Server
	hits atomic.Int64
}

func newCountingServer(t *testing.T, h http.HandlerFunc) *countingServer {
	t.Helper()
	cs := &countingServer{}
	cs.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		cs.hits.Add(1)
		h(w, r)
	}))
	t.Cleanup(cs.Close)
	return cs
}

func portOf(t *testing.T, rawURL string) uint16 {
	t.Helper()
	u, err := url.Parse(rawURL)
	require.NoError(t, err)
	p, err := strconv.ParseUint(u.Port(), 10, 16)
	require.NoError(t, err)
	return uint16(p)
}

func fetchCategory(t *testing.T, err error) tasks.Category {
	t.Helper()
	var fe *sessions.FetchError
	require.ErrorAs(t, err, &fe)
	return fe.Category
}

func TestGuardPortsAndRedirects(t *testing.T) {
	ctx := context.Background()
	e := setup(t, testutil.FakeProxyConfig{Seed: 11}, testutil.FakeSiteConfig{Seed: 11})
	target := newCountingServer(t, func(w http.ResponseWriter, _ *http.Request) { _, _ = fmt.Fprint(w, "secret") })
	front := newCountingServer(t, func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/redirect":
			http.Redirect(w, r, target.URL+"/admin", http.StatusFound)
		default:
			_, _ = fmt.Fprint(w, "ok")
		}
	})
	// Loopback allowed, but only on the front server's port: the policy's port list is
	// what is under test.
	policy := tasks.LoopbackPolicy()
	policy.AnyPortOnAllowed = false
	policy.Ports = []uint16{portOf(t, front.URL)}

	bound := func(t *testing.T, g *sessions.Guard) *sessions.Bound {
		t.Helper()
		sess, err := e.provider.NewSession("US", 0, time.Now())
		require.NoError(t, err)
		b, err := sessions.NewCollector(ctx, sess, &sessions.CollectorConfig{Guard: g, RequestTimeout: 5 * time.Second})
		require.NoError(t, err)
		t.Cleanup(b.Close)
		return b
	}

	t.Run("AllowedPort", func(t *testing.T) {
		b := bound(t, sessions.NewGuard(policy))
		res, err := b.Get(front.URL + "/ok")
		require.NoError(t, err)
		assert.Equal(t, "ok", string(res.Body))
		assert.Equal(t, http.StatusOK, b.LastStatus())
	})

	t.Run("PortRefused", func(t *testing.T) {
		b := bound(t, sessions.NewGuard(policy))
		before := e.proxy.Requests()
		_, err := b.Get(target.URL + "/admin")
		require.Error(t, err)
		assert.Equal(t, tasks.CategoryForbiddenAddress, fetchCategory(t, err))
		assert.ErrorContains(t, err, "port "+strconv.Itoa(int(portOf(t, target.URL))))
		assert.Zero(t, target.hits.Load(), "not even robots.txt reached the refused port")
		assert.Equal(t, before, e.proxy.Requests(), "nothing left through the proxy")
	})

	t.Run("RedirectToRefusedPort", func(t *testing.T) {
		b := bound(t, sessions.NewGuard(policy))
		frontBefore := front.hits.Load()
		_, err := b.Get(front.URL + "/redirect")
		require.Error(t, err)
		assert.Equal(t, tasks.CategoryForbiddenAddress, fetchCategory(t, err))
		assert.ErrorContains(t, err, "port "+strconv.Itoa(int(portOf(t, target.URL))))
		assert.Greater(t, front.hits.Load(), frontBefore, "the first hop was allowed")
		assert.Zero(t, target.hits.Load(), "the redirect hop was refused")
	})

	t.Run("StrictGuardRefusesLoopbackAndPortsBeforeDNS", func(t *testing.T) {
		resolved := 0
		g := &sessions.Guard{Resolver: resolverFunc(func(string) ([]netip.Addr, error) {
			resolved++
			return []netip.Addr{netip.MustParseAddr("93.184.215.14")}, nil
		})}
		b := bound(t, g)
		_, err := b.Get(front.URL + "/ok")
		assert.Equal(t, tasks.CategoryForbiddenAddress, fetchCategory(t, err))
		assert.ErrorContains(t, err, "loopback")
		require.ErrorIs(t, g.Check(ctx, "http://shop.example.com:6379/"), sessions.ErrForbiddenAddress)
		require.ErrorIs(t, g.Check(ctx, "http://localhost/"), sessions.ErrForbiddenAddress)
		assert.Zero(t, resolved, "refused by what the URL says, before any lookup")
		require.NoError(t, g.Check(ctx, "https://shop.example.com/"))
		require.NoError(t, g.Check(ctx, "http://shop.example.com:8080/"))
	})

	t.Run("LoopbackGuardAnyPort", func(t *testing.T) {
		require.NoError(t, sessions.LoopbackGuard().Check(ctx, target.URL))
		require.NoError(t, sessions.NewGuard(tasks.LoopbackPolicy()).Check(ctx, "http://localhost:1234/"))
		require.ErrorIs(t, sessions.LoopbackGuard().Check(ctx, "http://example.com:6379/"), sessions.ErrForbiddenAddress)
	})
}

type resolverFunc func(host string) ([]netip.Addr, error)

func (f resolverFunc) LookupNetIP(_ context.Context, _, host string) ([]netip.Addr, error) {
	return f(host)
}

// oneStep is a unit of one safe step.
func oneStep(run func(ctx context.Context, sc *sessions.StepContext) error) *sessions.Unit {
	return &sessions.Unit{Name: "one", Steps: []sessions.Step{{Name: "fetch", Safe: true, Run: run}}}
}

func TestRunEvidenceOnError(t *testing.T) {
	ctx := context.Background()
	e := setup(t, testutil.FakeProxyConfig{Seed: 12}, testutil.FakeSiteConfig{Seed: 12})

	t.Run("FailedRunKeepsSessionBytesStatus", func(t *testing.T) {
		u := oneStep(func(_ context.Context, sc *sessions.StepContext) error {
			_, err := sc.Get(e.site.URL + "/no-such-page")
			return err
		})
		res, err := u.Run(ctx, e.runCfg())
		require.Error(t, err)
		assert.Equal(t, tasks.CategoryNotFound, sessions.CategoryOf(err))
		require.NotNil(t, res.Session, "a failed attempt names its session")
		require.Len(t, res.Sessions, 1)
		assert.Equal(t, res.Sessions[0], res.Session.ID)
		assert.Equal(t, e.proxy.Addr, res.Session.Endpoint)
		assert.Positive(t, res.Bytes)
		assert.Equal(t, http.StatusNotFound, res.LastStatus)
		assert.Nil(t, res.Staged)
	})

	t.Run("ReplayedFailureNamesLastSession", func(t *testing.T) {
		e.proxy.SetDisconnectProb(1)
		defer e.proxy.SetDisconnectProb(0)
		u := oneStep(func(_ context.Context, sc *sessions.StepContext) error {
			_, err := sc.Get(e.site.URL + "/")
			return err
		})
		res, err := u.Run(ctx, e.runCfg())
		require.Error(t, err)
		require.Len(t, res.Sessions, sessions.DefaultMaxSessionRestarts+1)
		require.NotNil(t, res.Session)
		assert.Equal(t, res.Sessions[len(res.Sessions)-1], res.Session.ID, "the last session used")
	})

	t.Run("SuccessRecordsLastStatus", func(t *testing.T) {
		u := oneStep(func(_ context.Context, sc *sessions.StepContext) error {
			_, err := sc.Get(e.site.URL + "/")
			return err
		})
		res, err := u.Run(ctx, e.runCfg())
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, res.LastStatus)
		assert.Equal(t, res.Sessions[0], res.Session.ID)
	})
}

func TestContextEndClassification(t *testing.T) {
	e := setup(t, testutil.FakeProxyConfig{Seed: 13}, testutil.FakeSiteConfig{Seed: 13})
	leaseLost := errors.New("lease lost: token 7 superseded")

	t.Run("CancelledBetweenSteps", func(t *testing.T) {
		ctx, cancel := context.WithCancelCause(context.Background())
		defer cancel(nil)
		u := &sessions.Unit{Name: "two", Steps: []sessions.Step{
			{Name: "first", Safe: true, Run: func(_ context.Context, sc *sessions.StepContext) error {
				_, err := sc.Get(e.site.URL + "/")
				cancel(leaseLost)
				return err
			}},
			{Name: "second", Safe: true, Run: func(context.Context, *sessions.StepContext) error {
				t.Error("a step ran after the context was cancelled")
				return nil
			}},
		}}
		res, err := u.Run(ctx, e.runCfg())
		assert.Equal(t, tasks.CategoryInterrupted, sessions.CategoryOf(err))
		assert.ErrorIs(t, err, leaseLost, "the cause is kept")
		assert.ErrorContains(t, err, "lease lost")
		assert.Zero(t, res.Restarts, "an interrupted run is not replayed")
	})

	t.Run("CancelledMidRequest", func(t *testing.T) {
		arrived := make(chan struct{})
		var arrivedOnce sync.Once
		release := make(chan struct{})
		defer close(release)
		slow := newCountingServer(t, func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/robots.txt" {
				http.NotFound(w, r)
				return
			}
			arrivedOnce.Do(func() { close(arrived) })
			select {
			case <-release:
			case <-r.Context().Done():
			}
		})
		ctx, cancel := context.WithCancelCause(context.Background())
		defer cancel(nil)
		go func() {
			select {
			case <-arrived:
				cancel(leaseLost)
			case <-release:
			}
		}()
		u := oneStep(func(_ context.Context, sc *sessions.StepContext) error {
			_, err := sc.Get(slow.URL + "/wait")
			return err
		})
		res, err := u.Run(ctx, e.runCfg())
		assert.Equal(t, tasks.CategoryInterrupted, sessions.CategoryOf(err), "got %v", err)
		assert.ErrorIs(t, err, leaseLost)
		assert.Zero(t, res.Restarts)
		assert.NotNil(t, res.Session)
	})

	t.Run("DeadlineIsTimeout", func(t *testing.T) {
		ctx, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
		defer cancel()
		u := oneStep(func(context.Context, *sessions.StepContext) error { return nil })
		_, err := u.Run(ctx, e.runCfg())
		assert.Equal(t, tasks.CategoryTimeout, sessions.CategoryOf(err))
	})

	t.Run("CategoryOfPlainErrors", func(t *testing.T) {
		assert.Equal(t, tasks.CategoryInterrupted, sessions.CategoryOf(fmt.Errorf("x: %w", context.Canceled)))
		assert.Equal(t, tasks.CategoryTimeout, sessions.CategoryOf(fmt.Errorf("x: %w", context.DeadlineExceeded)))
	})
}

func TestDNSFailureCategories(t *testing.T) {
	ctx := context.Background()
	e := setup(t, testutil.FakeProxyConfig{Seed: 14}, testutil.FakeSiteConfig{Seed: 14})
	cases := []struct {
		name string
		err  error
		want tasks.Category
	}{
		{"NXDOMAIN", &net.DNSError{Err: "no such host", Name: "gone.example", IsNotFound: true}, tasks.CategoryDNSNotFound},
		{"Temporary", &net.DNSError{Err: "server misbehaving", Name: "flaky.example", IsTemporary: true}, tasks.CategoryNetwork},
		{"Timeout", &net.DNSError{Err: "i/o timeout", Name: "slow.example", IsTimeout: true}, tasks.CategoryNetwork},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := e.runCfg()
			lookups := 0
			cfg.Collector.Guard = &sessions.Guard{Resolver: resolverFunc(func(string) ([]netip.Addr, error) {
				lookups++
				return nil, tc.err
			})}
			before := e.proxy.Requests()
			u := oneStep(func(_ context.Context, sc *sessions.StepContext) error {
				_, err := sc.Get("https://shop.example.com/p/1")
				return err
			})
			res, err := u.Run(ctx, cfg)
			require.Error(t, err)
			assert.Equal(t, tc.want, sessions.CategoryOf(err), "got %v", err)
			var re *sessions.ResolveError
			assert.ErrorAs(t, err, &re)
			assert.Zero(t, res.Restarts, "a DNS failure is not a session loss")
			assert.Positive(t, lookups)
			assert.Equal(t, before, e.proxy.Requests(), "nothing reached the proxy")
		})
	}
}

func TestBudgetStopsMidResponse(t *testing.T) {
	const (
		bigSize  = 16 << 20
		maxBytes = 256 << 10
	)
	e := setup(t, testutil.FakeProxyConfig{Seed: 15}, testutil.FakeSiteConfig{Seed: 15, BigSize: bigSize})
	cfg := e.runCfg()
	cfg.MaxBytes = maxBytes
	cfg.Collector.MaxBodyBytes = 2 * bigSize // the size cap is not what stops it
	u := &sessions.Unit{Name: "big", Steps: []sessions.Step{
		{Name: "search", Safe: true, Run: func(_ context.Context, sc *sessions.StepContext) error {
			_, err := sc.Get(e.site.URL + "/")
			if err == nil {
				err = sc.Staging.Put("search", "ok")
			}
			return err
		}},
		{Name: "big", Safe: true, Run: func(_ context.Context, sc *sessions.StepContext) error {
			_, err := sc.Get(e.site.URL + "/big")
			return err
		}},
	}}
	res, err := u.Run(context.Background(), cfg)
	require.Error(t, err)
	assert.Equal(t, tasks.CategoryBudgetExceeded, sessions.CategoryOf(err), "got %v", err)
	assert.ErrorIs(t, err, sessions.ErrBudgetExceeded)
	assert.Greater(t, res.Bytes, int64(maxBytes), "Result.Bytes reports what was moved")
	assert.LessOrEqual(t, res.Bytes, int64(maxBytes+1), "the read stopped at the budget, well before the page ended")
	assert.Zero(t, res.Restarts, "a spent budget is not replayed")
	assert.Len(t, res.Sessions, 1)
	require.Len(t, e.quarantined, 1, "the staging of the stopped run is quarantined")
	assert.Equal(t, tasks.CategoryBudgetExceeded, e.quarantined[0].Reason)
	assert.Equal(t, "big", e.quarantined[0].Step)

	t.Logf("budget %d bytes, moved %d of a %d-byte page", maxBytes, res.Bytes, bigSize)

	t.Run("EarlierSessionsCount", func(t *testing.T) {
		// Each session fetches the home page; the first then reports its session lost,
		// so the unit replays on a second one. The budget covers one session's bytes
		// and a half: only counting both sessions stops the replay.
		replayOnce := func() *sessions.Unit {
			first := true
			return oneStep(func(_ context.Context, sc *sessions.StepContext) error {
				if _, err := sc.Get(e.site.URL + "/"); err != nil {
					return err
				}
				if first {
					first = false
					return &sessions.FetchError{Category: tasks.CategorySessionLost, Err: errors.New("device gone")}
				}
				return nil
			})
		}
		probe, err := oneStep(func(_ context.Context, sc *sessions.StepContext) error {
			_, err := sc.Get(e.site.URL + "/")
			return err
		}).Run(context.Background(), e.runCfg())
		require.NoError(t, err)
		one := probe.Bytes // robots.txt and the home page on one session

		cfg := e.runCfg()
		cfg.MaxBytes = one * 3 / 2
		res, err := replayOnce().Run(context.Background(), cfg)
		assert.Equal(t, tasks.CategoryBudgetExceeded, sessions.CategoryOf(err), "got %v", err)
		assert.Equal(t, 1, res.Restarts)
		assert.Len(t, res.Sessions, 2)
		assert.Greater(t, res.Bytes, cfg.MaxBytes)

		cfg.MaxBytes = one * 3 // enough for both sessions
		res, err = replayOnce().Run(context.Background(), cfg)
		require.NoError(t, err)
		assert.Equal(t, 1, res.Restarts)
	})

	t.Run("Unlimited", func(t *testing.T) {
		cfg := e.runCfg()
		cfg.Collector.MaxBodyBytes = 2 * bigSize
		res, err := u.Run(context.Background(), cfg)
		require.NoError(t, err)
		assert.Greater(t, res.Bytes, int64(bigSize))
	})
}
