package service_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/url"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/PuerkitoBio/goquery"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
)

// levelCounter is a slog.Handler that counts records at ERROR and above.
type levelCounter struct {
	mu     *sync.Mutex
	errors *[]string
}

func newLevelCounter() levelCounter { return levelCounter{mu: &sync.Mutex{}, errors: new([]string)} }

func (h levelCounter) Enabled(context.Context, slog.Level) bool { return true }
func (h levelCounter) Handle(_ context.Context, r slog.Record) error {
	if r.Level >= slog.LevelError {
		h.mu.Lock()
		*h.errors = append(*h.errors, r.Message)
		h.mu.Unlock()
	}
	return nil
}
func (h levelCounter) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h levelCounter) WithGroup(string) slog.Handler      { return h }
func (h levelCounter) logged() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), *h.errors...)
}

// TestJobPagesBadBytes400: a /jobs filter or a /jobs/{key} holding a NUL byte or bytes
// that are not UTF-8 is the request's mistake: 400 naming the parameter, no ERROR logged
// (PostgreSQL refuses such text, which read as "the job store did not answer", a 500 and an
// ERROR line per request).
func TestJobPagesBadBytes400(t *testing.T) {
	logs := newLevelCounter()
	b := setup(t, setupOpts{noDisp: true, logger: slog.New(logs)})

	for _, tc := range []struct {
		path, names string
	}{
		{"/jobs?kind=cat%00alog", "/jobs?kind="},
		{"/jobs?kind=%FF%FE", "/jobs?kind="},
		{"/jobs?window=2026-04-23%00", "/jobs?window="},
		{"/jobs?window=%C3", "/jobs?window="},
		{"/jobs?category=%00", "/jobs?category="},
		{"/jobs?category=parse%E2%82", "/jobs?category="},
		{"/jobs?prefix=catalog:%00", "/jobs?prefix="},
		{"/jobs?prefix=%80catalog", "/jobs?prefix="},
		{"/jobs?state=any&kind=catalog&window=%ED%A0%80", "/jobs?window="},
		{"/jobs/catalog:sku-1%00", "/jobs/{key}"},
		{"/jobs/%FF%FEcatalog", "/jobs/{key}"},
		{"/jobs/catalog%C0%AF", "/jobs/{key}"},
	} {
		t.Run(tc.path, func(t *testing.T) {
			code, body := b.do(t, "GET", tc.path, nil)
			assert.Equal(t, http.StatusBadRequest, code, body)
			assert.True(t, strings.HasPrefix(body, tc.names), "names the parameter: %q", body)
			assert.NotContains(t, body, "did not answer")
		})
	}
	assert.Empty(t, logs.logged(), "a bad request is not the store's failure: no ERROR line")

	// Good values next to them still answer.
	code, body := b.do(t, "GET", "/jobs?kind=catalog&window=2026-04-23&prefix=caf%C3%A9", nil)
	require.Equal(t, http.StatusOK, code, body)
	code, _ = b.do(t, "GET", "/jobs/caf%C3%A9", nil)
	require.Equal(t, http.StatusNotFound, code)
}

// TestDeferredJobShown: with Config.WindowBudgets, a runnable job of a window whose money
// budget is spent says "deferred: window budget spent (x of y)" on its page (it showed
// only "pending" and "No attempt yet"), /jobs?deferred=1 lists such jobs, /windows shows
// each window's spend against its budget, and a staging quarantined by a budget stop is not
// labelled a lost session. Without budgets, ?deferred=1 is a 400 that says why.
func TestDeferredJobShown(t *testing.T) {
	ctx := context.Background()
	b := setup(t, setupOpts{noDisp: true, budgets: map[string]store.Cost{catalog.Kind: {Micros: 50, Currency: "USD"}}})
	const winA, winB = "2026-04-23", "2026-04-24"
	job := func(src, win string, state tasks.JobState, cat tasks.Category, micros int64) string {
		t.Helper()
		spec := tasks.Spec{Kind: catalog.Kind, SourceID: src, Country: "US", Window: win, ParserVersion: 1}
		key := catalog.Kind + ":" + src + ":US:" + win + ":v1"
		recordJob(t, b.st, key, spec)
		if state == tasks.StatePending {
			return key
		}
		startAttempt(t, b.st, key, 1, "sess-"+src)
		p := store.AttemptFinishParams{Key: key, Token: 1, Category: string(cat), Error: "x", Bytes: 10,
			Cost: store.Cost{Micros: micros, Currency: "USD"}}
		if state == tasks.StateFailed {
			require.NoError(t, b.st.JobFail(ctx, p))
		} else {
			p.NextAttemptAt = time.Now().Add(time.Hour)
			require.NoError(t, b.st.JobMarkRetryable(ctx, p))
		}
		return key
	}
	failA := job("a-fail", winA, tasks.StateFailed, tasks.CategoryParseError, 40)
	retryA := job("a-retry", winA, tasks.StateRetryable, tasks.CategoryThrottled, 30)
	pendA := job("a-pending", winA, tasks.StatePending, "", 0)
	failB := job("b-fail", winB, tasks.StateFailed, tasks.CategoryBudgetExceeded, 5)
	pendB := job("b-pending", winB, tasks.StatePending, "", 0)

	page := func(t *testing.T, path string) *goquery.Document {
		t.Helper()
		code, body := b.do(t, "GET", path, nil)
		require.Equal(t, http.StatusOK, code, body)
		doc, err := goquery.NewDocumentFromReader(strings.NewReader(body))
		require.NoError(t, err)
		return doc
	}
	money := func(t *testing.T, key string) string {
		t.Helper()
		return strings.TrimSpace(page(t, "/jobs/"+url.PathEscape(key)).Find("#window-budget").Text())
	}
	assert.Equal(t, "deferred: window budget spent (0.000070 USD of 0.000050 USD)", money(t, pendA))
	assert.Equal(t, "deferred: window budget spent (0.000070 USD of 0.000050 USD)", money(t, retryA))
	assert.Equal(t, "0.000005 USD spent of 0.000050 USD", money(t, pendB))
	assert.Equal(t, "0.000070 USD spent of 0.000050 USD", money(t, failA), "failed for another reason")

	list := func(t *testing.T, query string) []string {
		t.Helper()
		var keys []string
		page(t, "/jobs"+query).Find("#jobs tr td:first-child code").Each(func(_ int, s *goquery.Selection) { keys = append(keys, s.Text()) })
		sort.Strings(keys)
		return keys
	}
	sorted := func(k ...string) []string { sort.Strings(k); return k }
	assert.Equal(t, sorted(pendA, retryA), list(t, "?deferred=1"))
	assert.Equal(t, []string{failA}, list(t, "?deferred=1&state=failed"))
	assert.Equal(t, sorted(failA, retryA, failB), list(t, ""), "without the filter, as before")
	assert.Equal(t, 1, page(t, "/jobs").Find(`#filter input[name=deferred]`).Length(), "the form offers the filter")
	assert.Contains(t, page(t, "/jobs").Find("#deferred-note").Text(), "2 job(s) deferred", "the default list counts them")

	due := time.Date(2026, 4, 23, 6, 0, 0, 0, time.UTC)
	for i, w := range []string{winA, winB} {
		require.NoError(t, b.st.WindowBegin(ctx, store.WindowParams{Template: "daily", Window: w, Kind: catalog.Kind,
			Due: due.Add(time.Duration(i) * 24 * time.Hour), Force: true}))
	}
	rows := page(t, "/windows").Find("#windows tr.window")
	require.Equal(t, 2, rows.Length())
	assert.Equal(t, "0.000005 USD of 0.000050 USD", strings.TrimSpace(rows.Eq(0).Find("td.money").Text()))
	spentCell := rows.Eq(1).Find("td.money")
	assert.Equal(t, "0.000070 USD of 0.000050 USD spent", strings.TrimSpace(spentCell.Text()))
	href, _ := spentCell.Find("a").Attr("href")
	assert.Equal(t, "/jobs?kind=catalog&window=2026-04-23&deferred=1", href)

	// A staging a budget stopped is not a lost session.
	require.NoError(t, b.st.QuarantineInsert(ctx, store.QuarantineParams{Key: failB, AttemptNo: 1, SessionID: "sess-b-fail",
		Reason: string(tasks.CategoryBudgetExceeded), Detail: "byte cap", Staged: json.RawMessage(`{"half":1}`)}))
	code, body := b.do(t, "GET", "/jobs/"+url.PathEscape(failB), nil)
	require.Equal(t, http.StatusOK, code)
	assert.NotContains(t, body, "lost its session")
	assert.Contains(t, body, "stopped by a budget")

	// Without budgets, the filter can not be run: a 400 that says why.
	nb := setup(t, setupOpts{noDisp: true})
	code, body = nb.do(t, "GET", "/jobs?deferred=1", nil)
	assert.Equal(t, http.StatusBadRequest, code)
	assert.Contains(t, body, "no window budget is known here")
}
