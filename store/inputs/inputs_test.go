package inputs_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/inputs"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// attempt records a job and starts an attempt under token; it returns the job key.
func attempt(t *testing.T, st *store.PG, sku string, token int64) string {
	t.Helper()
	ctx := context.Background()
	spec, err := tasks.Spec{Kind: "shop", SourceID: sku, Country: "US", Window: "2026-04-23", ParserVersion: 1}.Normalize()
	require.NoError(t, err)
	key, err := spec.Key()
	require.NoError(t, err)
	_, err = st.JobsRecord(ctx, []tasks.JobRecord{{Key: key, Spec: spec}})
	require.NoError(t, err)
	_, err = st.JobStart(ctx, store.AttemptStartParams{Key: key, Token: token, Worker: "test"})
	require.NoError(t, err)
	return key
}

// page is a product page of about 6 KB, as shops send them: a large shared template and
// a few product-specific values.
func page(sku string) []byte {
	var b bytes.Buffer
	b.WriteString(`<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>` + sku + ` | Shop</title>`)
	for i := range 40 {
		fmt.Fprintf(&b, `<link rel="stylesheet" href="/static/css/part-%d.css">`+"\n", i)
	}
	b.WriteString(`</head><body><nav class="top"><ul>`)
	for i := range 30 {
		fmt.Fprintf(&b, `<li class="nav-item"><a href="/category/%d">Category %d</a></li>`+"\n", i, i)
	}
	fmt.Fprintf(&b, `</ul></nav><main><h1 class="name">Product %s</h1><span class="price">$%d.99</span></main></body></html>`, sku, len(sku)*7)
	return b.Bytes()
}

func TestSave(t *testing.T) {
	ctx := context.Background()
	setup := func(t *testing.T) (*store.PG, *inputs.Store) {
		st := store.New(testutil.PG(t))
		return st, inputs.New(st.Pool())
	}
	usage := func(t *testing.T, in *inputs.Store) inputs.Usage {
		u, err := in.Usage(ctx)
		require.NoError(t, err)
		return u
	}

	t.Run("RoundTripAndIdenticalBodiesStoredOnce", func(t *testing.T) {
		st, in := setup(t)
		body := page("sku-1")
		staged := map[string]json.RawMessage{"html": json.RawMessage(`"x"`)}
		hdr := http.Header{"Content-Type": {"text/html"}, "Set-Cookie": {"sid=secret"}, "Etag": {`"e1"`}}
		at := time.Date(2026, 4, 23, 10, 0, 0, 0, time.UTC)
		var keys []string
		for i, sku := range []string{"sku-1", "sku-2"} {
			key := attempt(t, st, sku, int64(i+1))
			keys = append(keys, key)
			res, err := in.Save(ctx, inputs.SaveParams{Key: key, Fence: int64(i + 1), Kind: "shop", ParserVersion: 1,
				Outcome: inputs.OutcomeParsed, Staged: staged, SessionID: "s1",
				Responses: []inputs.Response{
					{URL: "http://shop/p", Status: 200, Header: hdr, FetchedAt: at, SessionID: "s1", Body: body},
					{URL: "http://shop/p2", Status: 200, Header: hdr, FetchedAt: at, SessionID: "s1", Body: body}, // same body twice
				}})
			require.NoError(t, err)
			require.True(t, res.Saved)
			require.Equal(t, inputs.Fingerprint([]byte(`{"html":"x"}`)), res.Fingerprint)
		}
		// Two saved inputs, four responses, but one staged blob and one body blob.
		u := usage(t, in)
		assert.Equal(t, int64(2), u.Inputs)
		assert.Equal(t, int64(2), u.Blobs, "identical bodies (and staged data) are stored once")
		assert.Equal(t, 4, testutil.Count(t, st.Pool(), `SELECT count(*) FROM saved_responses`))
		assert.Less(t, float64(u.StoredBytes), 0.3*float64(u.RawBytes), "HTML is stored compressed")

		got, err := in.List(ctx, keys[1])
		require.NoError(t, err)
		require.Len(t, got, 1)
		assert.JSONEq(t, `{"html":"x"}`, string(got[0].Staged))
		require.Len(t, got[0].Responses, 2)
		r := got[0].Responses[0]
		assert.Equal(t, body, r.Body)
		assert.True(t, r.Stored)
		assert.Equal(t, "GET", r.Method)
		assert.Equal(t, "text/html", r.Header.Get("Content-Type"))
		assert.Equal(t, `"e1"`, r.Header.Get("ETag"))
		assert.Empty(t, r.Header.Values("Set-Cookie"), "cookies are never kept")
		assert.True(t, r.FetchedAt.Equal(at))

		// A second save of the same attempt writes nothing.
		res, err := in.Save(ctx, inputs.SaveParams{Key: keys[1], Fence: 2, Kind: "shop", ParserVersion: 1, Outcome: "parsed", Staged: staged})
		require.NoError(t, err)
		assert.False(t, res.Saved)
		assert.Equal(t, int64(2), usage(t, in).Inputs)
	})

	t.Run("CapHonoured", func(t *testing.T) {
		st, in := setup(t)
		key := attempt(t, st, "sku-1", 1)
		small, big := []byte(strings.Repeat("s", 100)), []byte(strings.Repeat("b", 1000))
		staged := map[string]json.RawMessage{"v": json.RawMessage(`"` + strings.Repeat("v", 50) + `"`)}
		stagedLen := len(`{"v":"` + strings.Repeat("v", 50) + `"}`)
		res, err := in.Save(ctx, inputs.SaveParams{Key: key, Fence: 1, Kind: "shop", ParserVersion: 1, Outcome: "validation",
			Staged: staged, MaxBytes: int64(stagedLen + 150),
			Responses: []inputs.Response{{URL: "http://shop/big", Status: 200, Body: big}, {URL: "http://shop/small", Status: 200, Body: small}}})
		require.NoError(t, err)
		assert.True(t, res.Truncated)
		assert.Equal(t, int64(stagedLen+100), res.RawBytes, "staged data and the body that fits; not the big one")
		got, err := in.List(ctx, key)
		require.NoError(t, err)
		require.Len(t, got, 1)
		assert.NotNil(t, got[0].Staged)
		require.Len(t, got[0].Responses, 2, "a body left out is still recorded as a response")
		assert.False(t, got[0].Responses[0].Stored)
		assert.Equal(t, 1000, got[0].Responses[0].Size)
		assert.Nil(t, got[0].Responses[0].Body)
		assert.True(t, got[0].Responses[1].Stored)
		assert.Equal(t, small, got[0].Responses[1].Body)
		assert.True(t, got[0].Truncated)

		// Staged data over the cap is not kept either.
		key2 := attempt(t, st, "sku-2", 1)
		res, err = in.Save(ctx, inputs.SaveParams{Key: key2, Fence: 1, Kind: "shop", ParserVersion: 1, Outcome: "parsed",
			Staged: staged, MaxBytes: 10})
		require.NoError(t, err)
		assert.True(t, res.Truncated)
		got, err = in.List(ctx, key2)
		require.NoError(t, err)
		assert.Nil(t, got[0].Staged)
	})

	t.Run("BadInputRefusedNothingStored", func(t *testing.T) {
		st, in := setup(t)
		_, err := in.Save(ctx, inputs.SaveParams{Key: "", Fence: 1, Kind: "shop", ParserVersion: 1, Outcome: "parsed"})
		require.ErrorContains(t, err, "Key")
		// No attempt row: the foreign key refuses it, and the statement leaves no blob behind.
		_, err = in.Save(ctx, inputs.SaveParams{Key: "nojob", Fence: 1, Kind: "shop", ParserVersion: 1, Outcome: "parsed",
			Responses: []inputs.Response{{URL: "http://shop/", Status: 200, Body: page("x")}}})
		require.Error(t, err)
		assert.Equal(t, 0, testutil.Count(t, st.Pool(), `SELECT count(*) FROM input_blobs`))
	})

	t.Run("SelectLinkAndPrune", func(t *testing.T) {
		st, in := setup(t)
		var keys []string
		for i := range 5 {
			key := attempt(t, st, fmt.Sprintf("sku-%d", i), 1)
			keys = append(keys, key)
			_, err := in.Save(ctx, inputs.SaveParams{Key: key, Fence: 1, Kind: "shop", ParserVersion: 1, Outcome: "parsed",
				Staged:    map[string]json.RawMessage{"i": json.RawMessage(fmt.Sprint(i))},
				Responses: []inputs.Response{{URL: "http://shop/", Status: 200, Body: page(key)}}})
			require.NoError(t, err)
		}
		var seen []string
		after := ""
		for {
			batch, err := in.Select(ctx, inputs.Selection{Kind: "shop", ParserVersion: 1}, after, 2)
			require.NoError(t, err)
			for _, b := range batch {
				seen = append(seen, b.JobKey)
				staged, err := b.Staged()
				require.NoError(t, err)
				require.Contains(t, staged, "i")
			}
			if len(batch) < 2 {
				break
			}
			after = batch[len(batch)-1].JobKey
		}
		assert.ElementsMatch(t, keys, seen)
		none, err := in.Select(ctx, inputs.Selection{Kind: "other"}, "", 10)
		require.NoError(t, err)
		assert.Empty(t, none)

		// Link shares the blobs of another attempt's input.
		blobs := usage(t, in).Blobs
		_, err = st.JobStart(ctx, store.AttemptStartParams{Key: keys[0], Token: 5, Worker: "test"})
		require.NoError(t, err)
		require.NoError(t, in.Link(ctx, inputs.LinkParams{Key: keys[0], Fence: 5, ParserVersion: 2, Outcome: inputs.OutcomeParsed, FromKey: keys[0], FromFence: 1}))
		got, err := in.List(ctx, keys[0])
		require.NoError(t, err)
		require.Len(t, got, 2)
		assert.Equal(t, got[0].Staged, got[1].Staged)
		require.Len(t, got[1].Responses, 1)
		assert.Equal(t, blobs, usage(t, in).Blobs)

		// Prune: nothing is old enough yet; once it is, inputs go, then unreferenced blobs.
		_, err = in.Prune(ctx, inputs.PruneParams{Retention: time.Hour})
		require.ErrorContains(t, err, "below the minimum")
		res, err := in.Prune(ctx, inputs.PruneParams{Retention: inputs.MinRetention})
		require.NoError(t, err)
		assert.Equal(t, inputs.PruneResult{}, res)
		_, err = st.Pool().Exec(ctx, `UPDATE saved_inputs SET created_at = now() - interval '3 days' WHERE job_key <> $1`, keys[4])
		require.NoError(t, err)
		_, err = st.Pool().Exec(ctx, `UPDATE input_blobs SET last_used_at = now() - interval '3 days'`)
		require.NoError(t, err)
		total := inputs.PruneResult{}
		for {
			res, err := in.Prune(ctx, inputs.PruneParams{Retention: 24 * time.Hour, Limit: 2})
			require.NoError(t, err)
			total.Inputs += res.Inputs
			total.Blobs += res.Blobs
			if res.Done(2) {
				break
			}
		}
		assert.Equal(t, int64(5), total.Inputs, "all but keys[4]'s input (keys[0] had two)")
		u := usage(t, in)
		assert.Equal(t, int64(1), u.Inputs)
		assert.Equal(t, int64(2), u.Blobs, "keys[4]'s staged data and body stay: still referenced")
	})
}

func TestPolicy(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want inputs.Policy
		err  string
	}{
		{in: "never", want: inputs.Policy{Mode: inputs.Never}},
		{in: "always", want: inputs.Policy{Mode: inputs.Always}},
		{in: "on_failure", want: inputs.Policy{Mode: inputs.OnFailure}},
		{in: "sample(0.25)", want: inputs.Policy{Mode: inputs.Sample, Rate: 0.25}},
		{in: "sample(1),max=4096", want: inputs.Policy{Mode: inputs.Sample, Rate: 1, MaxBytes: 4096}},
		{in: "sample(0)", err: "must be in (0, 1]"},
		{in: "sample(1.5)", err: "must be in (0, 1]"},
		{in: "sample(x)", err: "rate"},
		{in: "sometimes", err: "want never"},
		{in: "always,max=-1", err: "negative"},
		{in: "always,cap=1", err: "max=BYTES"},
		{in: "always,max=0", err: "max=0"},
	} {
		t.Run(tc.in, func(t *testing.T) {
			p, err := inputs.ParsePolicy(tc.in)
			if tc.err != "" {
				require.ErrorContains(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, p)
			back, err := inputs.ParsePolicy(p.String())
			require.NoError(t, err)
			require.Equal(t, p, back, "String reads back")
		})
	}
	keys := make([]string, 2000)
	n := 0
	for i := range keys {
		keys[i] = fmt.Sprintf("shop:sku-%d:US:2026-04-23:v1", i)
		if inputs.Sampled(keys[i], 0.1) {
			n++
		}
	}
	assert.InDelta(t, 200, n, 60, "sample(0.1) keeps about a tenth")
	p := inputs.Policy{Mode: inputs.Sample, Rate: 0.1}
	for _, k := range keys {
		require.Equal(t, inputs.Sampled(k, 0.1), p.Keeps(k, false))
		require.True(t, p.Keeps(k, true), "failures are always kept")
	}
	assert.False(t, inputs.Policy{}.Enabled())
	assert.False(t, inputs.Policy{Mode: inputs.OnFailure}.Keeps("k", false))
	assert.True(t, inputs.Policy{Mode: inputs.OnFailure}.Keeps("k", true))
}

// TestPages: Pages yields what Select yields page after page — every matching job once,
// in key order, with its latest saved input that has staged data — across the boundary
// where it selects the next ids (pageSize × 10 at a time), and stops after the last page.
func TestPages(t *testing.T) {
	ctx := context.Background()
	st := store.New(testutil.PG(t))
	in := inputs.New(st.Pool())
	const jobs, pageSize = 47, 2 // ids selected 20 at a time: three selections, the last short
	var want []string
	latest := map[string]int64{} // job key -> fence of its latest saved input
	for i := range jobs {
		key := attempt(t, st, fmt.Sprintf("sku-%02d", i), 1)
		want = append(want, key)
		latest[key] = 1
		save := func(fence int64, v string) {
			_, err := in.Save(ctx, inputs.SaveParams{Key: key, Fence: fence, Kind: "shop", ParserVersion: 1, Outcome: "parsed",
				Staged: map[string]json.RawMessage{"v": json.RawMessage(`"` + v + `"`)}})
			require.NoError(t, err)
		}
		save(1, "old")
		if i%3 == 0 { // a second attempt with its own input: the latest one is read
			_, err := st.JobStart(ctx, store.AttemptStartParams{Key: key, Token: 2, Worker: "test"})
			require.NoError(t, err)
			save(2, "new")
			latest[key] = 2
		}
	}
	// A job of another kind is not selected.
	spec, err := tasks.Spec{Kind: "other", SourceID: "x", Country: "US", Window: "2026-04-23", ParserVersion: 1}.Normalize()
	require.NoError(t, err)
	okey, _ := spec.Key()
	_, err = st.JobsRecord(ctx, []tasks.JobRecord{{Key: okey, Spec: spec}})
	require.NoError(t, err)
	_, err = st.JobStart(ctx, store.AttemptStartParams{Key: okey, Token: 1, Worker: "test"})
	require.NoError(t, err)
	_, err = in.Save(ctx, inputs.SaveParams{Key: okey, Fence: 1, Kind: "other", ParserVersion: 1, Outcome: "parsed",
		Staged: map[string]json.RawMessage{"v": json.RawMessage(`1`)}})
	require.NoError(t, err)

	slices.Sort(want)
	var got []string
	fences := map[string]int64{}
	pages := 0
	for page, err := range in.Pages(ctx, inputs.Selection{Kind: "shop"}, pageSize) {
		require.NoError(t, err)
		require.LessOrEqual(t, len(page), pageSize)
		pages++
		for _, x := range page {
			got = append(got, x.JobKey)
			fences[x.JobKey] = x.SavedFence
			staged, err := x.Staged()
			require.NoError(t, err)
			wantV := `"old"`
			if x.SavedFence == 2 {
				wantV = `"new"`
			}
			require.JSONEq(t, wantV, string(staged["v"]), x.JobKey)
		}
	}
	require.Equal(t, want, got, "every job once, in key order")
	require.Equal(t, (jobs+pageSize-1)/pageSize, pages)
	require.Equal(t, latest, fences, "each job's latest saved input")
	for _, err := range in.Pages(ctx, inputs.Selection{}, 0) {
		require.ErrorContains(t, err, "page size 0")
	}
}
