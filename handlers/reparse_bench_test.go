package handlers_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/parse"
	"github.com/idemscrape/idemscrape/reparse"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/inputs"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

const benchInputs = 10_000

// benchVersion is the parser version the next Commit iteration reparses to (each one needs
// new jobs to commit, across -count runs too).
var benchVersion atomic.Int64

func init() { benchVersion.Store(100) }

var benchWords = strings.Fields(`tent stove lantern compact waterproof ultralight durable steel canvas nylon
	alpine trail summit camp river forest cedar granite basin ridge meadow harbor sturdy breathable
	insulated folding portable classic premium rugged`)

// benchPage is a product page of 6–9 KB: a shop's shared template (navigation, footer,
// stylesheets) around one product's name, price, description and specifications.
func benchPage(rng *rand.Rand, i int) string {
	var b strings.Builder
	word := func() string { return benchWords[rng.IntN(len(benchWords))] }
	name := fmt.Sprintf("%s %s %d", strings.ToUpper(word()[:1])+word()[1:], word(), i)
	fmt.Fprintf(&b, "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>%s | Outdoor Shop</title>\n", name)
	for j := range 12 {
		fmt.Fprintf(&b, "<link rel=\"stylesheet\" href=\"/static/css/bundle-%d.css?v=20260423\">\n", j)
	}
	b.WriteString("</head>\n<body class=\"product-page\">\n<header><nav class=\"main-nav\"><ul>\n")
	for j := range 24 {
		fmt.Fprintf(&b, "  <li class=\"nav-item\"><a class=\"nav-link\" href=\"/c/%d\">Category %d</a></li>\n", j, j)
	}
	b.WriteString("</ul></nav></header>\n<main>\n<div class=\"product\" itemscope itemtype=\"https://schema.org/Product\">\n")
	fmt.Fprintf(&b, "<h1 class=\"name\" itemprop=\"name\">%s</h1>\n", name)
	fmt.Fprintf(&b, "<p class=\"sku\">sku-%d</p>\n<span class=\"currency\">EUR</span>\n", i)
	fmt.Fprintf(&b, "<span class=\"price\">%d,%02d\u00a0€</span>\n", 10+rng.IntN(900), rng.IntN(100))
	b.WriteString("<div class=\"description\" itemprop=\"description\">\n")
	for range 4 + rng.IntN(4) {
		b.WriteString("<p>")
		for range 30 + rng.IntN(20) {
			b.WriteString(word() + " ")
		}
		b.WriteString("</p>\n")
	}
	b.WriteString("</div>\n<table class=\"specs\">\n")
	for range 10 {
		fmt.Fprintf(&b, "<tr><th>%s</th><td>%d %s</td></tr>\n", word(), rng.IntN(1000), word())
	}
	b.WriteString("</table>\n</div>\n</main>\n<footer><ul class=\"links\">\n")
	for j := range 20 {
		fmt.Fprintf(&b, "  <li><a href=\"/help/%d\">Help topic %d</a></li>\n", j, j)
	}
	b.WriteString("</ul><p class=\"legal\">© 2026 Outdoor Shop GmbH. All prices include VAT.</p></footer>\n</body></html>\n")
	return b.String()
}

type benchRecord struct {
	Name  parse.Field[string]      `json:"name,omitzero"`
	SKU   parse.Field[string]      `json:"sku,omitzero"`
	Price parse.Field[parse.Price] `json:"price,omitzero"`
}

// benchParse is the kind's parser: goquery over the staged page.
func benchParse(job tasks.Payload, staged map[string]json.RawMessage) (handlers.Observation, error) {
	var page string
	if err := json.Unmarshal(staged["page"], &page); err != nil {
		return handlers.Observation{}, err
	}
	e, err := parse.NewExtractorHTML([]byte(page), "https://shop.example/p/"+job.Spec.SourceID)
	if err != nil {
		return handlers.Observation{}, err
	}
	rec := benchRecord{Name: e.Text("name", "h1.name"), SKU: e.Text("sku", "p.sku"),
		Price: e.Price("price", "span.price", "", parse.PriceOptions{})}
	if err := e.Require("name", "sku", "price"); err != nil {
		return handlers.Observation{}, err
	}
	return handlers.Observation{Data: rec}, e.Err()
}

type benchReparseRig struct {
	st     *store.PG
	ns     *testutil.RedisNS
	staged []map[string]json.RawMessage
	jobs   []tasks.Payload
	raw    int64 // raw bytes saved (staged data + bodies)
}

// newBenchReparseRig records benchInputs failed jobs, each with a saved input: the staged
// page and the page's response body.
func newBenchReparseRig(b *testing.B) *benchReparseRig {
	ctx := context.Background()
	r := &benchReparseRig{st: store.New(testutil.PG(b)), ns: testutil.Redis(b)}
	rng := rand.New(rand.NewPCG(1, 2))
	recs := make([]tasks.JobRecord, benchInputs)
	bodies := make([]string, benchInputs)
	for i := range benchInputs {
		spec, err := tasks.Spec{Kind: "bench", SourceID: fmt.Sprintf("sku-%d", i), Country: "DE", Window: "2026-04-23", ParserVersion: 1}.Normalize()
		if err != nil {
			b.Fatal(err)
		}
		key, _ := spec.Key()
		recs[i] = tasks.JobRecord{Key: key, Spec: spec}
		r.jobs = append(r.jobs, tasks.Payload{Key: key, Spec: spec})
		bodies[i] = benchPage(rng, i)
		page, _ := json.Marshal(bodies[i])
		r.staged = append(r.staged, map[string]json.RawMessage{"page": page})
	}
	for i := 0; i < len(recs); i += 1000 {
		if _, err := r.st.JobsRecord(ctx, recs[i:min(i+1000, len(recs))]); err != nil {
			b.Fatal(err)
		}
	}
	// The jobs failed on parsing under fence 1 (setup only: the runner's path is tested).
	if _, err := r.st.Pool().Exec(ctx, `
WITH a AS (INSERT INTO attempts (job_key, attempt_no, fence, outcome, category) SELECT key, 1, 1, 'failed', 'parse_error' FROM jobs)
UPDATE jobs SET state = 'failed', fence = 1, attempts = 1, last_category = 'parse_error'`); err != nil {
		b.Fatal(err)
	}
	in := inputs.New(r.st.Pool())
	var wg sync.WaitGroup
	var mu sync.Mutex
	errs := make(chan error, 8)
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < benchInputs; i += 8 {
				res, err := in.Save(ctx, inputs.SaveParams{Key: recs[i].Key, Fence: 1, Kind: "bench", ParserVersion: 1,
					Outcome: "parse_error", Staged: r.staged[i],
					Responses: []inputs.Response{{URL: "https://shop.example/p/sku", Status: 200, FetchedAt: time.Now(), Body: []byte(bodies[i])}}})
				if err != nil {
					errs <- err
					return
				}
				mu.Lock()
				r.raw += res.RawBytes
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		b.Fatal(err)
	}
	return r
}

// BenchmarkReparse: records/s reparsing benchInputs saved inputs (read from PostgreSQL,
// decompressed, parsed, diffed, and — Commit — committed as new parser-version jobs) vs
// parsing the same staged bodies in a bare loop; and bytes stored per saved input vs raw.
func BenchmarkReparse(b *testing.B) {
	r := newBenchReparseRig(b)
	ctx := context.Background()
	u, err := inputs.New(r.st.Pool()).Usage(ctx)
	if err != nil {
		b.Fatal(err)
	}
	var rel int64
	if err := r.st.Pool().QueryRow(ctx, `SELECT pg_total_relation_size('input_blobs') + pg_total_relation_size('saved_inputs') + pg_total_relation_size('saved_responses')`).Scan(&rel); err != nil {
		b.Fatal(err)
	}
	report := func(b *testing.B, records int, d time.Duration) {
		b.ReportMetric(float64(records)/d.Seconds(), "records/s")
		b.ReportMetric(float64(u.StoredBytes)/float64(u.Inputs), "stored_B/input")
		b.ReportMetric(float64(r.raw)/float64(u.Inputs), "raw_B/input")
		b.ReportMetric(float64(u.StoredBytes)/float64(r.raw), "stored/raw")
		b.ReportMetric(float64(rel)/float64(r.raw), "tables/raw")
	}
	parsers := new(handlers.Parsers).Add("bench", 0, "", benchParse)
	bare := func(b *testing.B, workers int) {
		var records int
		start := time.Now()
		for b.Loop() {
			parseAll(r, workers)
			records += len(r.staged)
		}
		report(b, records, time.Since(start))
	}
	// Pairs: the bare loop and a dry-run reparse alternate within one benchmark, so that
	// both meet the same load; ratio = reparse records/s ÷ bare records/s.
	b.Run("PairedDryRunVsBare", func(b *testing.B) {
		var tBare, tDry time.Duration
		var n int
		for b.Loop() {
			t0 := time.Now()
			parseAll(r, reparse.DefaultConcurrency)
			t1 := time.Now()
			sum, err := reparse.Run(ctx, reparse.Config{Store: r.st, Parsers: parsers, Logger: discardLogger()},
				reparse.Options{Selection: inputs.Selection{Kind: "bench", ParserVersion: 1}, DryRun: true})
			if err != nil || sum.Reparsed != benchInputs {
				b.Fatalf("%v: %s", err, sum)
			}
			tBare, tDry, n = tBare+t1.Sub(t0), tDry+time.Since(t1), n+benchInputs
		}
		b.ReportMetric(float64(n)/tBare.Seconds(), "bare_records/s")
		b.ReportMetric(float64(n)/tDry.Seconds(), "reparse_records/s")
		b.ReportMetric(tBare.Seconds()/tDry.Seconds(), "ratio")
	})
	b.Run("BareLoop", func(b *testing.B) { bare(b, 1) })
	b.Run("BareLoopParallel", func(b *testing.B) { bare(b, reparse.DefaultConcurrency) })
	b.Run("DryRun", func(b *testing.B) {
		var records int
		start := time.Now()
		for b.Loop() {
			sum, err := reparse.Run(ctx, reparse.Config{Store: r.st, Parsers: parsers, Logger: discardLogger()},
				reparse.Options{Selection: inputs.Selection{Kind: "bench", ParserVersion: 1}, DryRun: true})
			if err != nil || sum.Reparsed != benchInputs {
				b.Fatalf("%v: %s", err, sum)
			}
			records += sum.Reparsed
		}
		report(b, records, time.Since(start))
	})
	b.Run("Commit", func(b *testing.B) {
		var records int
		start := time.Now()
		for b.Loop() {
			version := int(benchVersion.Add(1)) // a new version each time: new jobs to commit
			// Registered explicitly: a parser for every version reparses each job's own
			// version only (reparse.CheckVersion).
			committing := new(handlers.Parsers).Add("bench", version, "", benchParse)
			sum, err := reparse.Run(ctx, reparse.Config{Store: r.st, Redis: r.ns.Client, KeyPrefix: r.ns.Prefix,
				Parsers: committing, By: "bench", Logger: discardLogger()},
				reparse.Options{Selection: inputs.Selection{Kind: "bench", ParserVersion: 1}, Version: version})
			if err != nil || sum.Committed != benchInputs {
				b.Fatalf("%v: %s %v", err, sum, sum.Errs)
			}
			records += sum.Committed
		}
		report(b, records, time.Since(start))
	})
}

// parseAll is the bare loop: the kind's parser over every staged input, on workers
// goroutines, and the record encoded.
func parseAll(r *benchReparseRig, workers int) {
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < len(r.staged); i += workers {
				obs, err := benchParse(r.jobs[i], r.staged[i])
				if err != nil {
					panic(err)
				}
				if _, err := json.Marshal(obs.Data); err != nil {
					panic(err)
				}
			}
		}()
	}
	wg.Wait()
}
