package handlers_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestExampleFetchesTheURL: the example kind fetches the page a URL job names, on the
// URL's own host, not the shop it was configured with (-catalog-base): the job's key and
// the page its record is filled from name the same host. A URL that is not a product page
// is refused before anything is fetched.
func TestExampleFetchesTheURL(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	other := testutil.NewFakeSite(t, testutil.FakeSiteConfig{Seed: 4242})
	reg := r.registry(t, nil) // the catalog kind, configured with r.site as its shop

	urlJob := func(raw string) (string, *asynq.Task) {
		spec, err := tasks.Spec{Kind: catalog.Kind, URL: raw, Country: "US", Window: "2026-04-23", ParserVersion: 1}.Normalize()
		require.NoError(t, err)
		key, err := spec.Key()
		require.NoError(t, err)
		_, err = r.st.JobsRecord(ctx, []tasks.JobRecord{{Key: key, Spec: spec}})
		require.NoError(t, err)
		payload, err := json.Marshal(tasks.Payload{Key: key, Spec: spec})
		require.NoError(t, err)
		return key, asynq.NewTask(catalog.Kind, payload)
	}

	key, task := urlJob(other.URL + "/product/sku-3")
	require.NoError(t, reg.ProcessTask(ctx, task))
	requireState(t, r.st, key, tasks.StateComplete)
	var data []byte
	require.NoError(t, r.st.Pool().QueryRow(ctx, `SELECT data FROM results WHERE job_key = $1`, key).Scan(&data))
	var rec catalog.Record
	require.NoError(t, json.Unmarshal(data, &rec))
	want, _ := other.Product("sku-3")
	configured, _ := r.site.Product("sku-3")
	require.NotEqual(t, want.Name+want.Price, configured.Name+configured.Price, "the two shops differ")
	assert.Equal(t, catalog.Record{SKU: "sku-3", Name: want.Name, Price: want.Price, Currency: want.Currency}, rec,
		"filled from the URL's shop")
	assert.Equal(t, 1, other.Hits("/product/sku-3"))
	assert.Zero(t, r.site.TotalHits()-r.site.RobotsHits(), "the configured shop is not asked")

	for _, bad := range []string{other.URL + "/category/shoes", other.URL + "/product/bad%20sku"} {
		_, err := catalog.Workflow(r.site.URL)(tasks.Payload{Spec: tasks.Spec{Kind: catalog.Kind, URL: bad}})
		require.Error(t, err, bad)
		assert.Contains(t, err.Error(), "catalog:")
	}
	shop, sku, err := catalog.ProductURL("https://shop.invalid/eu/product/sku-1?ref=x")
	require.NoError(t, err)
	assert.Equal(t, "https://shop.invalid/eu", shop)
	assert.Equal(t, "sku-1", sku)
}
