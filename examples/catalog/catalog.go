// Package catalog is an example job kind: the price of one product in a shop whose price
// API needs a session cookie from the search page and a token from the product page, so the
// three requests must leave through one sticky exit. The demo and the tests scrape the
// fake shop of testutil with it.
//
//	search   GET /search?q=<sku>           sets the session cookie
//	product  GET /product/<sku>            name, currency, price token
//	price    GET /api/price/<sku>?token=T  price
//
// A shop behind an anti-bot challenge (testutil.FakeSiteConfig.Challenge) may answer any
// of these with a challenge page (IsChallenge) that sets a clearance cookie: the step then
// asks for the same URL once more on the same session, whose cookie jar now holds the
// clearance. A second challenge in a row fails the step as blocked. A shop that does not
// challenge sees no extra request.
package catalog

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"strings"

	"github.com/PuerkitoBio/goquery"
	"github.com/gocolly/colly/v2"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/tasks"
)

// Kind is the job kind name.
const Kind = "catalog"

// Staged values, one per step. Exit is what the shop says served the request; it lets
// tests prove that all three steps left through one exit.
type (
	SearchStage  struct{ ProductURL, Exit string }
	ProductStage struct{ Name, Currency, Token, Exit string }
	PriceStage   struct{ Price, Currency, Exit string }
)

// Record is the normalised observation.
type Record struct {
	SKU      string `json:"sku"`
	Name     string `json:"name"`
	Price    string `json:"price"`
	Currency string `json:"currency"`
}

var skuPattern = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,64}$`)

// Unit returns the three-step unit for sku on the shop at base (scheme://host:port).
func Unit(base, sku string) (*sessions.Unit, error) {
	if !skuPattern.MatchString(sku) {
		return nil, fmt.Errorf("catalog: bad sku %q", sku)
	}
	base = strings.TrimSuffix(base, "/")
	site := ""
	if u, err := url.Parse(base); err == nil {
		site = u.Host // a worker's session pool keeps sessions warm per shop
	}
	return &sessions.Unit{
		Name: Kind,
		Site: site,
		Steps: []sessions.Step{
			{Name: "search", Safe: true, Run: func(_ context.Context, sc *sessions.StepContext) error {
				resp, err := get(sc, base+"/search?q="+url.QueryEscape(sku))
				if err != nil {
					return err
				}
				doc, err := goquery.NewDocumentFromReader(bytes.NewReader(resp.Body))
				if err != nil {
					return err
				}
				href, ok := doc.Find(`a[href*="/product/"]`).First().Attr("href")
				if !ok {
					return parseErr("search page has no product link")
				}
				exit, _ := doc.Find("body").Attr("data-exit")
				return sc.Staging.Put("search", SearchStage{ProductURL: resp.Request.AbsoluteURL(href), Exit: exit})
			}},
			{Name: "product", Safe: true, Run: func(_ context.Context, sc *sessions.StepContext) error {
				var s SearchStage
				if _, err := sc.Staging.Get("search", &s); err != nil {
					return err
				}
				resp, err := get(sc, s.ProductURL)
				if err != nil {
					return err
				}
				doc, err := goquery.NewDocumentFromReader(bytes.NewReader(resp.Body))
				if err != nil {
					return err
				}
				token, _ := doc.Find(`meta[name="price-token"]`).Attr("content")
				exit, _ := doc.Find("body").Attr("data-exit")
				p := ProductStage{
					Name:     strings.Join(strings.Fields(doc.Find("h1.name").Text()), " "),
					Currency: strings.TrimSpace(doc.Find("span.currency").Text()),
					Token:    token, Exit: exit,
				}
				if p.Token == "" {
					return parseErr("product page has no price token")
				}
				return sc.Staging.Put("product", p)
			}},
			{Name: "price", Safe: true, Run: func(_ context.Context, sc *sessions.StepContext) error {
				var p ProductStage
				if _, err := sc.Staging.Get("product", &p); err != nil {
					return err
				}
				resp, err := get(sc, base+"/api/price/"+url.PathEscape(sku)+"?token="+url.QueryEscape(p.Token))
				if err != nil {
					return err
				}
				var body map[string]any
				if err := json.Unmarshal(resp.Body, &body); err != nil {
					return parseErr("price answer is not JSON")
				}
				price, _ := body["price"].(string)
				currency, _ := body["currency"].(string)
				exit, _ := body["exit"].(string)
				return sc.Staging.Put("price", PriceStage{Price: price, Currency: currency, Exit: exit})
			}},
		},
		Validate: Validate,
	}, nil
}

// Validate checks that every required field was found. A missing price (the shop renamed
// the field) is a schema change: the staging is quarantined, not committed.
func Validate(staged map[string]json.RawMessage) error {
	var (
		p  ProductStage
		pr PriceStage
	)
	if err := decode(staged, "product", &p); err != nil {
		return err
	}
	if err := decode(staged, "price", &pr); err != nil {
		return err
	}
	switch {
	case p.Name == "":
		return errors.New("product name missing")
	case pr.Price == "":
		return errors.New("price missing (schema change?)")
	case pr.Currency == "" || pr.Currency != p.Currency:
		return fmt.Errorf("currency %q on the price does not match %q on the page", pr.Currency, p.Currency)
	}
	return nil
}

// Workflow is the handlers.WorkflowFunc of the kind. A job names what it fetches: a
// SourceID job is the sku on the shop at base; a URL job is the product page its URL
// names, on the URL's own host (base is not used), so that a job's key and the page it is
// filled from always name the same host. A URL that is not a product page
// (…/product/<sku>) is refused.
func Workflow(base string) handlers.WorkflowFunc {
	return func(job tasks.Payload) (*sessions.Unit, error) {
		if job.Spec.URL == "" {
			return Unit(base, job.Spec.SourceID)
		}
		shop, sku, err := ProductURL(job.Spec.URL)
		if err != nil {
			return nil, err
		}
		return Unit(shop, sku)
	}
}

// ProductURL splits a product page's URL (scheme://host[:port][/prefix]/product/<sku>)
// into the shop's base URL and the sku.
func ProductURL(raw string) (shop, sku string, err error) {
	u, err := url.Parse(raw)
	if err != nil {
		return "", "", fmt.Errorf("catalog: URL: %w", err)
	}
	i := strings.LastIndex(u.Path, "/product/")
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || i < 0 {
		return "", "", fmt.Errorf("catalog: URL %q is not a product page (scheme://host/product/<sku>)", u.Redacted())
	}
	sku = u.Path[i+len("/product/"):]
	if !skuPattern.MatchString(sku) {
		return "", "", fmt.Errorf("catalog: bad sku %q in URL %q", sku, u.Redacted())
	}
	return u.Scheme + "://" + u.Host + u.Path[:i], sku, nil
}

// Parse is the handlers.ParserFunc of the kind. Deterministic: it only reads staging.
func Parse(job tasks.Payload, staged map[string]json.RawMessage) (handlers.Observation, error) {
	var (
		p  ProductStage
		pr PriceStage
	)
	if err := decode(staged, "product", &p); err != nil {
		return handlers.Observation{}, err
	}
	if err := decode(staged, "price", &pr); err != nil {
		return handlers.Observation{}, err
	}
	sku := job.Spec.SourceID
	if sku == "" {
		var err error
		if _, sku, err = ProductURL(job.Spec.URL); err != nil {
			return handlers.Observation{}, err
		}
	}
	return handlers.Observation{Data: Record{SKU: sku, Name: p.Name, Price: pr.Price, Currency: pr.Currency}}, nil
}

func decode(staged map[string]json.RawMessage, key string, v any) error {
	b, ok := staged[key]
	if !ok {
		return fmt.Errorf("staging has no %q", key)
	}
	return json.Unmarshal(b, v)
}

// challengeMarker is what marks a challenge page: a meta element in its head.
var challengeMarker = []byte(`<meta name="challenge"`)

// IsChallenge reports whether body is an anti-bot challenge page rather than the page
// asked for: HTML with <meta name="challenge" …> (as testutil.FakeSite serves in
// challenge mode).
func IsChallenge(body []byte) bool { return bytes.Contains(body, challengeMarker) }

// challenged reports whether resp is a challenge page: a 200 HTML answer IsChallenge
// recognises.
func challenged(resp *colly.Response) bool {
	return resp.StatusCode == http.StatusOK && resp.Headers != nil &&
		strings.Contains(resp.Headers.Get("Content-Type"), "html") && IsChallenge(resp.Body)
}

// get GETs rawURL on the step's session through the shop's challenge: a challenge page is
// answered by asking for the same URL once more on the same session (the collector's
// cookie jar has the clearance cookie it set). A second challenge in a row is an error of
// category blocked: the shop did not accept its own clearance. A 403 (a block, or a
// clearance of another exit) is blocked already, as the collector classifies it.
func get(sc *sessions.StepContext, rawURL string) (*colly.Response, error) {
	resp, err := sc.Get(rawURL)
	if err != nil || !challenged(resp) {
		return resp, err
	}
	resp, err = sc.Get(rawURL)
	if err != nil || !challenged(resp) {
		return resp, err
	}
	return nil, &sessions.FetchError{Category: tasks.CategoryBlocked, Status: resp.StatusCode,
		Err: errors.New("catalog: challenged again after the challenge's clearance cookie was set")}
}

func parseErr(msg string) error {
	return &sessions.FetchError{Category: tasks.CategoryParseError, Err: errors.New(msg)}
}
