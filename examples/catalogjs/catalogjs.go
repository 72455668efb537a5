// Package catalogjs is an example job kind whose shop renders its prices with
// JavaScript: the product page's HTML has no price, a script fetches it (an XHR with the
// page's token) and writes it into the DOM. The unit searches with colly (the shop's
// session cookie), then renders the product page in Chromium on the same sticky session
// (sessions.StepContext.Render): one exit, one cookie jar, every guarantee of a colly
// step — guard, budget, replay from the first step after a lost session.
//
//	search   GET /search?q=<sku>        colly: sets the session cookie
//	product  render /js/product/<sku>   Chromium: name, currency, and the price JavaScript wrote
package catalogjs

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"regexp"
	"strings"

	"github.com/PuerkitoBio/goquery"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/tasks"
)

// Kind is the job kind name.
const Kind = "catalog.js"

// ProductStage is what the rendered page showed. PriceXHR is the price API's answer the
// render captured (the same price, as the shop sent it).
type ProductStage struct {
	Name, Price, Currency string
	PriceXHR              json.RawMessage `json:",omitempty"`
}

var skuPattern = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,64}$`)

// Unit is the workflow of one product.
func Unit(base, sku string) (*sessions.Unit, error) {
	if !skuPattern.MatchString(sku) {
		return nil, fmt.Errorf("catalogjs: bad sku %q", sku)
	}
	base = strings.TrimSuffix(base, "/")
	return &sessions.Unit{Name: Kind, Steps: []sessions.Step{
		{Name: "search", Safe: true, Run: func(_ context.Context, sc *sessions.StepContext) error {
			_, err := sc.Get(base + "/search?q=" + url.QueryEscape(sku))
			return err
		}},
		{Name: "product", Safe: true, Run: func(_ context.Context, sc *sessions.StepContext) error {
			r, err := sc.Render(base+"/js/product/"+url.PathEscape(sku), sessions.RenderOptions{
				WaitFor: "#price.ready", Capture: []string{"/api/price/"}})
			if err != nil {
				return err
			}
			doc, err := goquery.NewDocumentFromReader(strings.NewReader(r.HTML))
			if err != nil {
				return err
			}
			st := ProductStage{
				Name:     strings.Join(strings.Fields(doc.Find("h1.name").Text()), " "),
				Price:    strings.TrimSpace(doc.Find("#price").Text()),
				Currency: strings.TrimSpace(doc.Find("span.currency").Text()),
			}
			if len(r.Captured) > 0 {
				st.PriceXHR = r.Captured[0].Body
			}
			return sc.Staging.Put("product", st)
		}},
	}}, nil
}

// Workflow is the handlers.WorkflowFunc of the kind against the shop at base.
func Workflow(base string) handlers.WorkflowFunc {
	return func(job tasks.Payload) (*sessions.Unit, error) { return Unit(base, job.Spec.SourceID) }
}

// Parse is the handlers.ParserFunc of the kind: deterministic, it reads the staging only.
func Parse(job tasks.Payload, staged map[string]json.RawMessage) (handlers.Observation, error) {
	raw, ok := staged["product"]
	if !ok {
		return handlers.Observation{}, errors.New("catalogjs: nothing staged for product")
	}
	var p ProductStage
	if err := json.Unmarshal(raw, &p); err != nil {
		return handlers.Observation{}, fmt.Errorf("catalogjs: product stage: %w", err)
	}
	if p.Price == "" {
		return handlers.Observation{}, tasks.Fail(tasks.CategoryValidation, errors.New("catalogjs: the page showed no price: its script did not run to the end"))
	}
	return handlers.Observation{Data: catalog.Record{SKU: job.Spec.SourceID, Name: p.Name, Price: p.Price, Currency: p.Currency}}, nil
}
