package handlers_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/PuerkitoBio/goquery"
	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/parse"
	"github.com/idemscrape/idemscrape/reparse"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store/inputs"
	"github.com/idemscrape/idemscrape/store/ops"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// The "shop" kind scrapes the fake shop like examples/catalog, but stages what the parser
// needs raw — the product page's HTML and the price API's JSON — so that a parser version
// can be run again over saved inputs.
const shopKind = "shop"

type shopRecord struct {
	SKU   string      `json:"sku"`
	Name  string      `json:"name"`
	Price parse.Price `json:"price"`
	Label string      `json:"label,omitempty"` // parser v2 only
}

func shopWorkflow(base string) handlers.WorkflowFunc {
	return func(job tasks.Payload) (*sessions.Unit, error) {
		sku := job.Spec.SourceID
		html := func(b []byte) (*goquery.Document, error) { return goquery.NewDocumentFromReader(bytes.NewReader(b)) }
		return &sessions.Unit{Name: shopKind, Steps: []sessions.Step{
			{Name: "search", Safe: true, Run: func(_ context.Context, sc *sessions.StepContext) error {
				resp, err := sc.Get(base + "/search?q=" + url.QueryEscape(sku))
				if err != nil {
					return err
				}
				doc, err := html(resp.Body)
				if err != nil {
					return err
				}
				href, _ := doc.Find(`a[href*="/product/"]`).First().Attr("href")
				return sc.Staging.Put("product_url", resp.Request.AbsoluteURL(href))
			}},
			{Name: "product", Safe: true, Run: func(_ context.Context, sc *sessions.StepContext) error {
				var u string
				if _, err := sc.Staging.Get("product_url", &u); err != nil {
					return err
				}
				resp, err := sc.Get(u)
				if err != nil {
					return err
				}
				doc, err := html(resp.Body)
				if err != nil {
					return err
				}
				token, _ := doc.Find(`meta[name="price-token"]`).Attr("content")
				if err := sc.Staging.Put("token", token); err != nil {
					return err
				}
				return sc.Staging.Put("product_html", string(resp.Body))
			}},
			{Name: "price", Safe: true, Run: func(_ context.Context, sc *sessions.StepContext) error {
				var token string
				if _, err := sc.Staging.Get("token", &token); err != nil {
					return err
				}
				resp, err := sc.Get(base + "/api/price/" + url.PathEscape(sku) + "?token=" + url.QueryEscape(token))
				if err != nil {
					return err
				}
				return sc.Staging.Put("price", json.RawMessage(resp.Body))
			}},
		}}, nil
	}
}

// shopParser reads the staged page and price. acceptAmount makes it read the renamed
// field ("amount", the fake site's schema change) when "price" is absent; label adds
// the field of parser v2. It returns its schema fingerprint even when validation fails.
func shopParser(acceptAmount, label bool) handlers.ParserFunc {
	return func(job tasks.Payload, staged map[string]json.RawMessage) (handlers.Observation, error) {
		var page, pageURL string
		if err := json.Unmarshal(staged["product_html"], &page); err != nil {
			return handlers.Observation{}, fmt.Errorf("staged product_html: %w", err)
		}
		_ = json.Unmarshal(staged["product_url"], &pageURL)
		e, err := parse.NewExtractorHTML([]byte(page), pageURL)
		if err != nil {
			return handlers.Observation{}, err
		}
		name := e.Text("name", "h1.name")
		currency := e.Text("currency", "span.currency")
		reqErr := e.Require("name", "currency")
		fp := e.Fingerprint()
		var api struct {
			Price  parse.Field[string] `json:"price"`
			Amount parse.Field[string] `json:"amount"`
		}
		if err := json.Unmarshal(staged["price"], &api); err != nil {
			return handlers.Observation{}, fmt.Errorf("price API: %w", err)
		}
		fp.Add(parse.SelectorCount{Selector: "$.price", Count: present(api.Price), Required: !acceptAmount})
		fp.Add(parse.SelectorCount{Selector: "$.amount", Count: present(api.Amount)})
		obs := handlers.Observation{Schema: &fp}
		price, sel := api.Price, "$.price"
		if acceptAmount && !price.IsPresent() {
			price, sel = api.Amount, "$.amount"
		}
		if err := errors.Join(reqErr, parse.Validate(parse.Need("price", sel, price))); err != nil {
			return obs, err
		}
		amount, _ := price.Get()
		cur, _ := currency.Get()
		p, err := parse.ParsePrice(amount, parse.PriceOptions{Currency: cur})
		if err != nil {
			return obs, err
		}
		rec := shopRecord{SKU: job.Spec.SourceID, Name: name.Or(""), Price: p}
		if label {
			rec.Label = rec.Name + " — " + p.String()
		}
		obs.Data = rec
		return obs, nil
	}
}

func present[T any](f parse.Field[T]) int {
	if f.IsMissing() {
		return 0
	}
	return 1
}

// shopRegistry returns a runner with the shop kind's parser v1 (strict: "price" required).
func (r *rig) shopRegistry(t *testing.T, opts ...handlers.KindOption) *handlers.Registry {
	t.Helper()
	reg, err := handlers.NewRegistry(handlers.Config{
		Store: r.st, Redis: r.ns.Client, Provider: r.prov, KeyPrefix: r.ns.Prefix,
		Collector: sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), RequestTimeout: 5 * time.Second},
		Logger:    slog.New(slog.NewTextHandler(testWriter{t}, nil)),
		Rand:      func() float64 { return 0.5 },
	})
	require.NoError(t, err)
	t.Cleanup(reg.Close)
	require.NoError(t, reg.Register(shopKind, shopWorkflow(r.site.URL), shopParser(false, false), opts...))
	return reg
}

// shopJob records a shop job of parser version v for sku.
func (r *rig) shopJob(t *testing.T, sku string, v int) (string, *asynq.Task) {
	t.Helper()
	return r.jobOf(t, shopKind, sku, "US", v)
}

func TestSchemaDriftQuarantined(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	reg := r.shopRegistry(t, handlers.WithParserVersion(1))
	for _, sku := range []string{"sku-1", "sku-2", "sku-3"} {
		key, task := r.shopJob(t, sku, 1)
		require.NoError(t, reg.ProcessTask(ctx, task))
		requireState(t, r.st, key, tasks.StateComplete)
	}

	r.site.SetSchemaChange(true) // the price API renames "price" to "amount"
	key, task := r.shopJob(t, "sku-4", 1)
	dec := decisionOf(reg.ProcessTask(ctx, task))
	require.True(t, dec.Skip, "validation is terminal: %s", dec.ErrorMsg)

	requireJob(t, r.st, key, tasks.StateFailed, tasks.CategoryValidation)
	assert.Zero(t, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM results WHERE job_key = $1`, key), "no result")
	assert.Zero(t, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM outbox WHERE event_key = $1`, handlers.EventKey(key)), "no event")
	atts, err := r.st.AttemptList(ctx, key)
	require.NoError(t, err)
	require.Len(t, atts, 1)
	a := atts[0]
	assert.Equal(t, string(tasks.CategoryValidation), a.Category)
	// The drift is named, selector by selector, with the recorded range (the three
	// committed pages had one distinct fingerprint).
	assert.Contains(t, a.Error, `schema drift: "$.amount" matched 1 nodes, 0–0 in all 1 recorded`)
	assert.Contains(t, a.Error, `"$.price" matched 0 nodes, 1–1 in all 1 recorded (required)`)
	assert.Contains(t, a.Error, `required field "price" (selector "$.price") is missing`)

	var reason string
	var staged []byte
	require.NoError(t, r.st.Pool().QueryRow(ctx, `SELECT reason, staged FROM quarantine WHERE job_key = $1`, key).Scan(&reason, &staged))
	assert.True(t, strings.HasPrefix(reason, "validation: "), reason)
	assert.Contains(t, reason, "schema drift")
	assert.Contains(t, string(staged), `amount`, "the staging the parser refused is kept for review")

	// The committed parses' fingerprints were not widened by the refused one: the next
	// changed page is refused the same way.
	key5, task5 := r.shopJob(t, "sku-5", 1)
	require.True(t, decisionOf(reg.ProcessTask(ctx, task5)).Skip)
	atts, err = r.st.AttemptList(ctx, key5)
	require.NoError(t, err)
	assert.Contains(t, atts[0].Error, "in all 1 recorded")
}

func TestParserVersionUnknownRetryable(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	old := r.shopRegistry(t, handlers.WithParserVersion(1))
	key, task := r.shopJob(t, "sku-1", 2)

	dec := decisionOf(old.ProcessTask(ctx, task))
	require.True(t, dec.Retry, "refused retryably: %s", dec.ErrorMsg)
	assert.False(t, dec.Counted, "not counted against asynq's MaxRetry")
	assert.GreaterOrEqual(t, dec.Delay, 30*time.Second)
	assert.Zero(t, r.site.TotalHits(), "refused before anything was fetched")

	requireJob(t, r.st, key, tasks.StateRetryable, handlers.CategoryParserVersion)
	atts, err := r.st.AttemptList(ctx, key)
	require.NoError(t, err)
	require.Len(t, atts, 1)
	assert.Equal(t, string(handlers.CategoryParserVersion), atts[0].Category)
	assert.Contains(t, atts[0].Error, `kind "shop" parser version 2 is not registered`)
	assert.Contains(t, atts[0].Error, "it has [1]")
	budget, err := ops.New(r.st.Pool()).BudgetGet(ctx, key)
	require.NoError(t, err)
	assert.Equal(t, 1, budget.Attempts, "the refused attempt is out of the job's budget")

	// A newer worker (rolling deploy) has version 2 and takes the job.
	newer := r.shopRegistry(t, handlers.WithParserVersion(1))
	require.NoError(t, newer.AddParser(shopKind, 2, shopParser(true, true)))
	assert.Equal(t, []int{1, 2}, newer.ParserVersions(shopKind))
	require.NoError(t, newer.ProcessTask(ctx, task))
	requireState(t, r.st, key, tasks.StateComplete)
	var pv int
	require.NoError(t, r.st.Pool().QueryRow(ctx, `SELECT parser_version FROM results WHERE job_key = $1`, key).Scan(&pv))
	assert.Equal(t, 2, pv)

	// Registration rules.
	require.ErrorContains(t, newer.AddParser(shopKind, 2, shopParser(true, true)), "registered twice")
	plain := r.registry(t, nil) // catalog, registered without a version: one parser for all
	require.ErrorContains(t, plain.AddParser("catalog", 3, shopParser(true, true)), "without WithParserVersion")
	_, ok := plain.Parser("catalog", 7)
	assert.True(t, ok, "a parser registered without a version serves every version")
	_, ok = newer.Parser(shopKind, 3)
	assert.False(t, ok)
}

func TestSavedInputPolicy(t *testing.T) {
	ctx := context.Background()
	type counts struct{ inputs, responses int }
	count := func(t *testing.T, r *rig) counts {
		return counts{
			inputs:    testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM saved_inputs`),
			responses: testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM saved_responses`),
		}
	}
	policy := func(t *testing.T, s string) handlers.KindOption {
		p, err := inputs.ParsePolicy(s)
		require.NoError(t, err)
		return handlers.WithSavedInputs(p)
	}
	// savedInput requires key to have exactly one saved input, and returns it.
	savedInput := func(t *testing.T, r *rig, key string) inputs.Saved {
		t.Helper()
		saved, err := inputs.New(r.st.Pool()).List(ctx, key)
		require.NoError(t, err)
		require.Len(t, saved, 1)
		return saved[0]
	}

	t.Run("Never", func(t *testing.T) {
		r := newRig(t, rigOpts{})
		reg := r.shopRegistry(t, policy(t, "never"))
		_, task := r.shopJob(t, "sku-1", 1)
		require.NoError(t, reg.ProcessTask(ctx, task))
		assert.Equal(t, counts{}, count(t, r))
		assert.Zero(t, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM input_blobs`))
	})

	t.Run("Always", func(t *testing.T) {
		r := newRig(t, rigOpts{})
		reg := r.shopRegistry(t, policy(t, "always"))
		key, task := r.shopJob(t, "sku-1", 1)
		require.NoError(t, reg.ProcessTask(ctx, task))
		s := savedInput(t, r, key)
		assert.Equal(t, inputs.OutcomeParsed, s.Outcome)
		assert.False(t, s.Truncated)
		// The result and the saved input (hence its attempt, same fence) carry one fingerprint.
		var fp string
		var fence int64
		require.NoError(t, r.st.Pool().QueryRow(ctx, `SELECT response_fingerprint, fence FROM results WHERE job_key = $1`, key).Scan(&fp, &fence))
		assert.Equal(t, fp, s.Fingerprint)
		assert.Equal(t, fence, s.Fence)
		assert.Equal(t, inputs.Fingerprint(s.Staged), s.Fingerprint)
		var staged map[string]json.RawMessage
		require.NoError(t, json.Unmarshal(s.Staged, &staged))
		assert.Contains(t, staged, "product_html")
		// Every step's response, in order, with what matters and nothing secret.
		require.Len(t, s.Responses, 3)
		paths := []string{"/search", "/product/sku-1", "/api/price/sku-1"}
		atts, err := r.st.AttemptList(ctx, key)
		require.NoError(t, err)
		for i, resp := range s.Responses {
			assert.Contains(t, resp.URL, r.site.URL+paths[i])
			assert.Equal(t, 200, resp.Status)
			assert.True(t, resp.Stored)
			assert.NotEmpty(t, resp.Body)
			assert.NotEmpty(t, resp.Header.Get("Content-Type"))
			assert.Empty(t, resp.Header.Values("Set-Cookie"))
			assert.Equal(t, atts[0].SessionID, resp.SessionID)
			assert.False(t, resp.FetchedAt.IsZero())
		}
		var page string
		require.NoError(t, json.Unmarshal(staged["product_html"], &page))
		assert.Equal(t, page, string(s.Responses[1].Body), "the body the parser consumed")
		assert.NotContains(t, string(s.Staged)+fmt.Sprint(s.Responses), canary, "no proxy credential anywhere")
	})

	t.Run("OnFailure", func(t *testing.T) {
		r := newRig(t, rigOpts{})
		reg := r.shopRegistry(t, policy(t, "on_failure"))
		_, task := r.shopJob(t, "sku-1", 1)
		require.NoError(t, reg.ProcessTask(ctx, task))
		assert.Equal(t, counts{}, count(t, r), "a success keeps nothing")
		r.site.SetSchemaChange(true)
		key, task := r.shopJob(t, "sku-2", 1)
		require.True(t, decisionOf(reg.ProcessTask(ctx, task)).Skip)
		s := savedInput(t, r, key)
		assert.Equal(t, string(tasks.CategoryValidation), s.Outcome)
		assert.Contains(t, string(s.Staged), "amount", "the refused staging, for a reparse")
		assert.Len(t, s.Responses, 3)
	})

	t.Run("Sample", func(t *testing.T) {
		r := newRig(t, rigOpts{})
		reg := r.shopRegistry(t, policy(t, "sample(0.5)"))
		want := map[string]bool{}
		var in, out int
		for i := 1; i <= 8; i++ {
			key, task := r.shopJob(t, fmt.Sprintf("sku-%d", i), 1)
			require.NoError(t, reg.ProcessTask(ctx, task))
			want[key] = inputs.Sampled(key, 0.5)
			if want[key] {
				in++
			} else {
				out++
			}
		}
		require.Positive(t, in, "precondition: the sample holds some keys")
		require.Positive(t, out, "precondition: the sample leaves some keys out")
		for key, sampled := range want {
			n := testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM saved_inputs WHERE job_key = $1`, key)
			assert.Equal(t, map[bool]int{true: 1, false: 0}[sampled], n, key)
		}
		// A failure is kept whether or not its key is sampled.
		r.site.SetSchemaChange(true)
		for i := 9; i <= 30; i++ {
			key, task := r.shopJob(t, fmt.Sprintf("sku-%d", i), 1)
			if inputs.Sampled(key, 0.5) {
				continue
			}
			require.True(t, decisionOf(reg.ProcessTask(ctx, task)).Skip)
			assert.Equal(t, 1, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM saved_inputs WHERE job_key = $1`, key))
			return
		}
		t.Fatal("no unsampled key among sku-9 … sku-30")
	})

	t.Run("CapHonoured", func(t *testing.T) {
		r := newRig(t, rigOpts{})
		const maxBytes = 200 // less than the staged data and the pages; more than the price JSON
		reg := r.shopRegistry(t, policy(t, fmt.Sprintf("always,max=%d", maxBytes)))
		key, task := r.shopJob(t, "sku-1", 1)
		require.NoError(t, reg.ProcessTask(ctx, task))
		s := savedInput(t, r, key)
		assert.True(t, s.Truncated)
		assert.Nil(t, s.Staged, "staged data over the cap is not kept")
		require.Len(t, s.Responses, 3, "every response is recorded, stored or not")
		var kept, left int
		for _, resp := range s.Responses {
			if resp.Stored {
				kept += resp.Size
			} else {
				left++
				assert.Nil(t, resp.Body)
			}
		}
		assert.LessOrEqual(t, kept, maxBytes)
		assert.Positive(t, kept, "the price JSON fits")
		assert.Positive(t, left)
	})
}

// TestReparseNoNetwork: parser fixes applied to what was already fetched, with the fake
// proxy and site stopped.
func TestReparseNoNetwork(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	always, err := inputs.ParsePolicy("always")
	require.NoError(t, err)
	reg := r.shopRegistry(t, handlers.WithParserVersion(1), handlers.WithSavedInputs(always))
	var failedKeys []string
	for i := 1; i <= 4; i++ {
		_, task := r.shopJob(t, fmt.Sprintf("sku-%d", i), 1)
		require.NoError(t, reg.ProcessTask(ctx, task))
	}
	r.site.SetSchemaChange(true)
	for i := 5; i <= 6; i++ {
		key, task := r.shopJob(t, fmt.Sprintf("sku-%d", i), 1)
		require.True(t, decisionOf(reg.ProcessTask(ctx, task)).Skip)
		failedKeys = append(failedKeys, key)
	}
	hits := r.site.TotalHits()
	r.site.Close()
	r.proxy.Close()

	results := func() int { return testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM results`) }
	events := func() int { return testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM outbox`) }
	require.Equal(t, 4, results())
	require.Equal(t, 4, events())
	cfg := reparse.Config{Store: r.st, Redis: r.ns.Client, KeyPrefix: r.ns.Prefix, By: "reparse-test", BatchSize: 2,
		Logger: slog.New(slog.NewTextHandler(testWriter{t}, nil))}
	var progress []reparse.Summary
	cfg.Progress = func(s reparse.Summary) { progress = append(progress, s) }

	// 1. The same version, fixed (it reads the renamed field): the failed jobs complete under
	// their own keys. A job a worker holds is left alone.
	cfg.Parsers = new(handlers.Parsers).Add(shopKind, 1, "", shopParser(true, false))
	sel := inputs.Selection{Kind: shopKind, Category: string(tasks.CategoryValidation)}
	leases, err := lua.NewLeases(r.ns.Client, r.ns.Prefix)
	require.NoError(t, err)
	busy, err := leases.Claim(ctx, failedKeys[1], "live-worker", time.Minute, 0)
	require.NoError(t, err)
	sum, err := reparse.Run(ctx, cfg, reparse.Options{Selection: sel})
	require.NoError(t, err)
	assert.Equal(t, 2, sum.Selected)
	assert.Equal(t, 1, sum.Committed, sum.String())
	assert.Equal(t, 1, sum.Busy, sum.String())
	assert.Equal(t, 2, sum.Changed, "neither had a record")
	assert.NotEmpty(t, progress)
	requireState(t, r.st, failedKeys[1], tasks.StateFailed, "the held job was not touched")
	require.NoError(t, leases.Release(ctx, busy))

	// (The completed job left the selection: complete jobs have no failure category.)
	sum, err = reparse.Run(ctx, cfg, reparse.Options{Selection: sel})
	require.NoError(t, err)
	assert.Equal(t, 1, sum.Selected, sum.String())
	assert.Equal(t, 1, sum.Committed, sum.String())
	for _, key := range failedKeys {
		requireState(t, r.st, key, tasks.StateComplete)
		assert.Equal(t, 1, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM outbox WHERE event_key = $1`, handlers.EventKey(key)))
		notes, err := ops.New(r.st.Pool()).NoteListByJob(ctx, key)
		require.NoError(t, err)
		require.Len(t, notes, 1)
		assert.Equal(t, "reparse-test", notes[0].Actor)
		assert.Contains(t, notes[0].Note, "reparse: parser v1")
		atts, err := r.st.AttemptList(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, "reparse/reparse-test", atts[len(atts)-1].Worker)
		assert.Zero(t, atts[len(atts)-1].Bytes, "no bytes moved")
	}
	require.Equal(t, 6, results())
	require.Equal(t, 6, events())

	// 2. A new version over every v1 job: a dry run diffs and writes nothing...
	cfg.Parsers = new(handlers.Parsers).Add(shopKind, 1, "", shopParser(true, false)).Add(shopKind, 2, "", shopParser(true, true))
	v1 := inputs.Selection{Kind: shopKind, ParserVersion: 1}
	var diff bytes.Buffer
	dry := cfg
	dry.Redis, dry.Diff = nil, &diff
	sum, err = reparse.Run(ctx, dry, reparse.Options{Selection: v1, Version: 2, DryRun: true})
	require.NoError(t, err)
	assert.Equal(t, 6, sum.Changed, sum.String())
	assert.Zero(t, sum.Committed)
	assert.Contains(t, diff.String(), "+ label: ")
	assert.Contains(t, diff.String(), "(parser v1 → v2")
	assert.Equal(t, 6, results())

	// ...then commits six new jobs under version 2's keys, one event each.
	sum, err = reparse.Run(ctx, cfg, reparse.Options{Selection: v1, Version: 2})
	require.NoError(t, err)
	assert.Equal(t, 6, sum.Committed, sum.String())
	assert.Zero(t, sum.Errors, sum.Errs)
	assert.Equal(t, 12, results())
	assert.Equal(t, 12, events())
	assert.Equal(t, 6, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM jobs WHERE parser_version = 2 AND state = 'complete'`))
	assert.Equal(t, 6, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM results WHERE parser_version = 2 AND data ? 'label'`))
	assert.Equal(t, 6, testutil.Count(t, r.st.Pool(),
		`SELECT count(*) FROM saved_inputs s JOIN jobs j ON j.key = s.job_key WHERE j.parser_version = 2`),
		"the new jobs' attempts link the same inputs, for the next reparse")

	// 3. Again: nothing is added.
	for _, o := range []reparse.Options{{Selection: v1, Version: 2}, {Selection: sel}} {
		sum, err = reparse.Run(ctx, cfg, o)
		require.NoError(t, err)
		assert.Zero(t, sum.Committed, sum.String())
		assert.Equal(t, sum.Selected, sum.AlreadyDone, sum.String())
	}
	assert.Equal(t, 12, results())
	assert.Equal(t, 12, events())
	assert.Equal(t, hits, r.site.TotalHits(), "no request reached the site")
}

func TestDiffRecords(t *testing.T) {
	old := json.RawMessage(`{"name":"Tent","price":{"amount":"1.00","minor":100},"tags":["a","b"],"gone":1}`)
	cur := json.RawMessage(`{"name":"Tent","price":{"amount":"1.50","minor":150},"tags":["a"],"label":"x"}`)
	assert.Equal(t, `- gone: 1
+ label: "x"
  price.amount: "1.00" → "1.50"
  price.minor: 100 → 150
- tags[1]: "b"
`, reparse.DiffRecords(old, cur))
	assert.Empty(t, reparse.DiffRecords(old, old))
}
