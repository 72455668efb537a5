package parse_test

import (
	"encoding/json"
	"fmt"
	"os"

	"github.com/idemscrape/idemscrape/parse"
)

// A parser for the fake shop's product page (the examples/catalog kind), with the price
// from the shop's price API: fields keep missing apart from empty, required fields are
// validated, and the schema fingerprint is compared with the ones recorded for the kind.
func ExampleExtractor() {
	page, _ := os.ReadFile("testdata/fakeshop_product.html")
	api, _ := os.ReadFile("testdata/fakeshop_price.json")

	e, err := parse.NewExtractorHTML(page, "http://127.0.0.1:8080/product/sku-3")
	if err != nil {
		panic(err)
	}
	var rec struct {
		SKU      parse.Field[string]      `json:"sku,omitzero"`
		Name     parse.Field[string]      `json:"name,omitzero"`
		Rating   parse.Field[string]      `json:"rating,omitzero"`
		Price    parse.Field[parse.Price] `json:"price,omitzero"`
		Currency parse.Field[string]      `json:"-"`
	}
	rec.SKU = e.Text("sku", "p.sku")
	rec.Name = e.Text("name", "h1.name")
	rec.Rating = e.Text("rating", "span.rating") // the shop has none: missing, omitted
	rec.Currency = e.Text("currency", "span.currency")
	if err := e.Require("sku", "name", "currency"); err != nil {
		fmt.Println(err) // a *parse.ValidationError naming field and selector
		return
	}

	var price struct {
		Price parse.Field[string] `json:"price"`
	}
	_ = json.Unmarshal(api, &price)
	if err := parse.Validate(parse.Need("price", "$.price", price.Price)); err != nil {
		fmt.Println(err)
		return
	}
	amount, _ := price.Price.Get()
	p, err := parse.ParsePrice(amount, parse.PriceOptions{Currency: rec.Currency.Or("")})
	if err != nil {
		fmt.Println(err)
		return
	}
	rec.Price = parse.Present(p)

	out, _ := json.Marshal(rec)
	fmt.Println(string(out))

	got := e.Fingerprint()
	fpJSON, _ := json.Marshal(got)
	fmt.Println(string(fpJSON))

	// The product page without its name, against two recorded fingerprints.
	var broken parse.Fingerprint
	for _, sc := range got.Selectors {
		if sc.Selector == "h1.name" {
			sc.Count = 0
		}
		broken.Add(sc)
	}
	report, surprising := parse.Drift([]parse.Fingerprint{got, got}, broken)
	fmt.Println(surprising, report)
	// Output:
	// {"sku":"sku-3","name":"Silent Tent 465","price":{"kind":"exact","currency":"USD","amount":"817.89","minor":81789}}
	// {"selectors":[{"selector":"h1.name","count":1,"required":true},{"selector":"p.sku","count":1,"required":true},{"selector":"span.currency","count":1,"required":true},{"selector":"span.rating","count":0}]}
	// true schema drift: "h1.name" matched 0 nodes, 1–1 in all 2 recorded (required)
}

// The ambiguous "1.234": the page's locale, or else the currency, decides.
func ExampleParsePrice() {
	for _, in := range []string{"1.234,56 €", "$1,234.56", "JPY 1,234", "1 234,56 zł", "CHF 1'234.50", "€10–12", "from £9", "Free", "1.234 €", "KWD 1.234"} {
		p, err := parse.ParsePrice(in, parse.PriceOptions{Currency: "USD"})
		if err != nil {
			fmt.Println(err)
			continue
		}
		fmt.Printf("%-14q %-18s minor=%d\n", in, p, p.Minor)
	}
	_, err := parse.ParsePrice("$1,234.56", parse.PriceOptions{})
	fmt.Println(err)
	// Output:
	// "1.234,56 €"   EUR 1234.56        minor=123456
	// "$1,234.56"    USD 1234.56        minor=123456
	// "JPY 1,234"    JPY 1234           minor=1234
	// "1 234,56 zł"  PLN 1234.56        minor=123456
	// "CHF 1'234.50" CHF 1234.50        minor=123450
	// "€10–12"       EUR 10.00–12.00    minor=1000
	// "from £9"      from GBP 9.00      minor=900
	// "Free"         Free USD           minor=0
	// "1.234 €"      EUR 1234.00        minor=123400
	// "KWD 1.234"    KWD 1.234          minor=1234
	// parse: price "$1,234.56": ambiguous currency symbol "$" (one of USD, ARS, AUD, CAD, CLP, COP, HKD, MXN, NZD, SGD, TWD, UYU): set PriceOptions.Currency
}
