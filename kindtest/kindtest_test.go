package kindtest_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemscrape/idemscrape"
	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/job"
	"github.com/idemscrape/idemscrape/kindtest"
	"github.com/idemscrape/idemscrape/testutil"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestRunThroughFaults: the catalog kind through a proxy whose exits drop 15 % of
// requests: every SKU's record is right, lost sessions were replayed on new ones with their
// staging quarantined, and the proxy password is in no outcome.
func TestRunThroughFaults(t *testing.T) {
	site := testutil.NewFakeSite(t, testutil.FakeSiteConfig{Seed: 9})
	// 15 % of requests dropped: a unit is lost about half the time, so over 20 units some
	// are (a miss ~1e-6), and none exhausts 100 replays.
	env := kindtest.New(t, kindtest.Config{Proxy: testutil.FakeProxyConfig{Seed: 9, DisconnectProb: 0.15}, MaxSessionRestarts: 100})
	k := idemscrape.Kind{Workflow: catalog.Workflow(site.URL), Parse: catalog.Parse}
	restarts, quarantined := 0, 0
	skus := site.SKUs()
	require.GreaterOrEqual(t, len(skus), 20)
	for _, sku := range skus[:20] {
		out := env.Run(t, k, idemscrape.Spec{Kind: catalog.Kind, SourceID: sku, Country: "US", Window: "w1", ParserVersion: 1})
		require.NoError(t, out.Err, sku)
		assert.Empty(t, out.Category)
		want, ok := site.Product(sku)
		require.True(t, ok)
		rec, ok := out.Observation.Data.(catalog.Record)
		require.True(t, ok, "%T", out.Observation.Data)
		assert.Equal(t, catalog.Record{SKU: sku, Name: want.Name, Price: want.Price, Currency: want.Currency}, rec)
		assert.Len(t, out.Quarantined, out.Run.Restarts, "one quarantined staging per lost session")
		restarts += out.Run.Restarts
		quarantined += len(out.Quarantined)
		b, err := json.Marshal(out)
		require.NoError(t, err)
		assert.NotContains(t, string(b), kindtest.Password())
	}
	assert.Positive(t, restarts, "15 %% of requests dropped: some sessions were lost")
	assert.Equal(t, restarts, quarantined)
	assert.Positive(t, env.Proxy.Bytes())
}

// TestRunCategories: a parser error and a country without exits come back with the
// categories the runner would record.
func TestRunCategories(t *testing.T) {
	site := testutil.NewFakeSite(t, testutil.FakeSiteConfig{Seed: 3})
	env := kindtest.New(t, kindtest.Config{Proxy: testutil.FakeProxyConfig{Seed: 3, UnavailableCountries: []string{"DE"}}})
	k := idemscrape.Kind{Workflow: catalog.Workflow(site.URL), Parse: func(idemscrape.Job, map[string]json.RawMessage) (idemscrape.Observation, error) {
		return idemscrape.Observation{}, assert.AnError
	}}
	out := env.Run(t, k, idemscrape.Spec{Kind: catalog.Kind, SourceID: "sku-1", Country: "US", Window: "w1", ParserVersion: 1})
	require.ErrorIs(t, out.Err, assert.AnError)
	assert.Equal(t, job.CategoryParseError, out.Category)

	k.Parse = func(idemscrape.Job, map[string]json.RawMessage) (idemscrape.Observation, error) {
		return idemscrape.Observation{}, job.Fail(job.CategoryBlocked, assert.AnError)
	}
	out = env.Run(t, k, idemscrape.Spec{Kind: catalog.Kind, SourceID: "sku-1", Country: "US", Window: "w1", ParserVersion: 1})
	assert.Equal(t, job.CategoryBlocked, out.Category, "a job.Fail category is kept, as the runner keeps it")
	k.Parse = func(idemscrape.Job, map[string]json.RawMessage) (idemscrape.Observation, error) { panic("boom") }
	out = env.Run(t, k, idemscrape.Spec{Kind: catalog.Kind, SourceID: "sku-1", Country: "US", Window: "w1", ParserVersion: 1})
	assert.Equal(t, job.CategoryPanic, out.Category)

	out = env.Run(t, idemscrape.Kind{Workflow: catalog.Workflow(site.URL), Parse: catalog.Parse},
		idemscrape.Spec{Kind: catalog.Kind, SourceID: "sku-1", Country: "DE", Window: "w1", ParserVersion: 1})
	require.Error(t, out.Err)
	assert.Equal(t, job.CategoryExitUnavailable, out.Category, "%v", out.Err)
	assert.False(t, strings.Contains(out.Err.Error(), kindtest.Password()))
}
