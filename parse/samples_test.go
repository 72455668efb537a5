package parse_test

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/idemscrape/idemscrape/parse"
)

// Page URLs the samples in testdata were (notionally) fetched from.
const (
	fakeShopProductURL = "http://127.0.0.1:8080/product/sku-3"
	shopDEURL          = "https://www.Example.de/produkte/kaffee/muehle-200?ref=1"
)

// catalogRecord is what the examples/catalog kind records, with parse's field states.
type catalogRecord struct {
	SKU      parse.Field[string]      `json:"sku,omitzero"`
	Name     parse.Field[string]      `json:"name,omitzero"`
	Currency parse.Field[string]      `json:"currency,omitzero"`
	Price    parse.Field[parse.Price] `json:"price,omitzero"`
}

// parseCatalog is a parser for the fake shop (testutil.FakeSite): the product page and
// the price API's JSON. The fingerprint is returned even when validation fails, so that
// the caller can compare it with the recorded ones.
func parseCatalog(productHTML, priceJSON []byte, pageURL string) (catalogRecord, parse.Fingerprint, error) {
	var rec catalogRecord
	e, err := parse.NewExtractorHTML(productHTML, pageURL)
	if err != nil {
		return rec, parse.Fingerprint{}, err
	}
	rec.SKU = e.Text("sku", "p.sku")
	rec.Name = e.Text("name", "h1.name")
	rec.Currency = e.Text("currency", "span.currency")
	e.Attr("token", `meta[name="price-token"]`, "content")
	reqErr := e.Require("sku", "name", "currency", "token")
	fp := e.Fingerprint()
	if err := e.Err(); err != nil {
		return rec, fp, err
	}
	if reqErr != nil {
		return rec, fp, reqErr
	}

	// The price API is JSON: an absent key stays missing, null is empty.
	var api struct {
		Price    parse.Field[string] `json:"price"`
		Currency parse.Field[string] `json:"currency"`
	}
	if err := json.Unmarshal(priceJSON, &api); err != nil {
		return rec, fp, fmt.Errorf("price API: %w", err)
	}
	fp.Add(parse.SelectorCount{Selector: "$.price", Count: present(api.Price), Required: true})
	fp.Add(parse.SelectorCount{Selector: "$.currency", Count: present(api.Currency), Required: true})
	if err := parse.Validate(parse.Need("price", "$.price", api.Price), parse.Need("currency", "$.currency", api.Currency)); err != nil {
		return rec, fp, err
	}
	cur, _ := rec.Currency.Get()
	if apiCur, _ := api.Currency.Get(); apiCur != cur {
		return rec, fp, fmt.Errorf("currency %q of the price API differs from %q on the page", apiCur, cur)
	}
	amount, _ := api.Price.Get()
	p, err := parse.ParsePrice(amount, parse.PriceOptions{Currency: cur})
	if err != nil {
		return rec, fp, err
	}
	rec.Price = parse.Present(p)
	return rec, fp, nil
}

// present is 1 for a field the JSON had (null included), 0 for an absent one.
func present[T any](f parse.Field[T]) int {
	if f.IsMissing() {
		return 0
	}
	return 1
}

// deRecord is the record of testdata/shop_de.html.
type deRecord struct {
	Name     parse.Field[string]      `json:"name,omitzero"`
	Price    parse.Field[parse.Price] `json:"price,omitzero"`
	OldPrice parse.Field[parse.Price] `json:"old_price,omitzero"`
	Delivery parse.Field[string]      `json:"delivery,omitzero"`
	Rating   parse.Field[string]      `json:"rating,omitzero"`
	Updated  parse.Field[string]      `json:"updated,omitzero"`
	ShipDate parse.Field[string]      `json:"ship_date,omitzero"`
	Next     parse.Field[string]      `json:"next,omitzero"`
	Variants parse.Field[[]string]    `json:"variants,omitzero"`
}

// berlinSummer is a fixed zone (CEST), so that the test does not depend on the tz database.
var berlinSummer = time.FixedZone("CEST", 2*3600)

func parseDE(body []byte, pageURL string) (deRecord, parse.Fingerprint, error) {
	var rec deRecord
	e, err := parse.NewExtractorHTML(body, pageURL)
	if err != nil {
		return rec, parse.Fingerprint{}, err
	}
	opts := parse.PriceOptions{Decimal: ','}
	rec.Name = e.Text("name", "h1.name")
	rec.Price = e.Price("price", "span.price", "", opts)
	rec.OldPrice = e.Price("old_price", "span.old-price", "", opts)
	rec.Delivery = e.Text("delivery", "span.delivery")
	rec.Rating = e.Text("rating", "span.rating")
	rec.Updated = e.Time("updated", "time.updated", "datetime", parse.TimeOptions{})
	rec.ShipDate = e.Time("ship_date", "span.ship-date", "", parse.TimeOptions{Zone: berlinSummer})
	rec.Next = e.URL("next", "a.next", "href")
	rec.Variants = e.Texts("variants", "ul.variants li")
	reqErr := e.Require("name", "price")
	fp := e.Fingerprint()
	if err := e.Err(); err != nil {
		return rec, fp, err
	}
	return rec, fp, reqErr
}

// parsed is what a sample's parse produces, as one JSON document.
type parsed struct {
	Record      any               `json:"record"`
	Fingerprint parse.Fingerprint `json:"fingerprint"`
	Error       string            `json:"error,omitempty"`
}

// sample is one stored input and its parser.
type sample struct {
	name  string
	parse func() ([]byte, error)
}

// samples loads every stored sample in testdata with its parser; the output is the JSON
// of the record, the fingerprint and the error text.
func samples() ([]sample, error) {
	var product, price, changed, search, de []byte
	for _, f := range []struct {
		name string
		dst  *[]byte
	}{
		{"fakeshop_product.html", &product},
		{"fakeshop_price.json", &price},
		{"fakeshop_price_schema_change.json", &changed},
		{"fakeshop_search.html", &search},
		{"shop_de.html", &de},
	} {
		b, err := os.ReadFile(filepath.Join("testdata", f.name))
		if err != nil {
			return nil, err
		}
		*f.dst = b
	}
	out := func(rec any, fp parse.Fingerprint, err error) ([]byte, error) {
		p := parsed{Record: rec, Fingerprint: fp}
		if err != nil {
			p.Error = err.Error()
		}
		return json.Marshal(p)
	}
	return []sample{
		{"fakeshop", func() ([]byte, error) { return out(parseCatalog(product, price, fakeShopProductURL)) }},
		{"fakeshop_schema_change", func() ([]byte, error) { return out(parseCatalog(product, changed, fakeShopProductURL)) }},
		{"fakeshop_search_as_product", func() ([]byte, error) { return out(parseCatalog(search, price, fakeShopProductURL)) }},
		{"shop_de", func() ([]byte, error) { return out(parseDE(de, shopDEURL)) }},
	}, nil
}
