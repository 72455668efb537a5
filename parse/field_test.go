package parse_test

import (
	"encoding/json"
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/parse"
)

type fieldRecord struct {
	Name  parse.Field[string]      `json:"name,omitzero"`
	Price parse.Field[parse.Price] `json:"price,omitzero"`
	Tags  parse.Field[[]string]    `json:"tags,omitzero"`
	Stock parse.Field[int]         `json:"stock,omitzero"`
}

// TestMissingVersusEmpty: the three states stay apart through extraction and a JSON round
// trip.
func TestMissingVersusEmpty(t *testing.T) {
	t.Run("States", func(t *testing.T) {
		var zero parse.Field[string]
		assert.Equal(t, parse.StateMissing, zero.State(), "the zero value is missing")
		assert.True(t, parse.Missing[string]().IsMissing())
		assert.True(t, parse.Empty[string]().IsEmpty())
		assert.True(t, parse.Present("").IsPresent(), "an empty string can be a present value")
		v, ok := parse.Present("x").Get()
		assert.True(t, ok)
		assert.Equal(t, "x", v)
		_, ok = parse.Empty[string]().Get()
		assert.False(t, ok)
		assert.Equal(t, "d", parse.Missing[string]().Or("d"))
		assert.Equal(t, "<missing>", parse.Missing[int]().String())
		assert.Equal(t, "<empty>", parse.Empty[int]().String())
		assert.Equal(t, "7", parse.Present(7).String())
		assert.Equal(t, "missing", parse.StateMissing.String())
	})

	t.Run("JSONRoundTrip", func(t *testing.T) {
		for _, tt := range []struct {
			name string
			rec  fieldRecord
			json string
		}{
			{name: "AllMissing", rec: fieldRecord{}, json: `{}`},
			{name: "AllEmpty", rec: fieldRecord{Name: parse.Empty[string](), Price: parse.Empty[parse.Price](),
				Tags: parse.Empty[[]string](), Stock: parse.Empty[int]()},
				json: `{"name":null,"price":null,"tags":null,"stock":null}`},
			{name: "PresentZeroValues", rec: fieldRecord{Name: parse.Present(""), Tags: parse.Present([]string{}), Stock: parse.Present(0)},
				json: `{"name":"","tags":[],"stock":0}`},
			{name: "Mixed", rec: fieldRecord{Name: parse.Present("Lamp"), Price: parse.Present(exact("JPY", "1234", 1234)), Stock: parse.Empty[int]()},
				json: `{"name":"Lamp","price":{"kind":"exact","currency":"JPY","amount":"1234","minor":1234},"stock":null}`},
		} {
			t.Run(tt.name, func(t *testing.T) {
				b, err := json.Marshal(tt.rec)
				require.NoError(t, err)
				assert.JSONEq(t, tt.json, string(b))
				var back fieldRecord
				require.NoError(t, json.Unmarshal(b, &back))
				assert.Equal(t, tt.rec.Name.State(), back.Name.State(), "name")
				assert.Equal(t, tt.rec.Price.State(), back.Price.State(), "price")
				assert.Equal(t, tt.rec.Tags.State(), back.Tags.State(), "tags")
				assert.Equal(t, tt.rec.Stock.State(), back.Stock.State(), "stock")
				b2, err := json.Marshal(back)
				require.NoError(t, err)
				assert.Equal(t, string(b), string(b2))
			})
		}
	})

	t.Run("WithoutOmitzeroMissingBecomesNull", func(t *testing.T) {
		// Documented: the omitzero option is what keeps missing apart in JSON.
		b, err := json.Marshal(struct {
			A parse.Field[string] `json:"a"`
		}{})
		require.NoError(t, err)
		assert.Equal(t, `{"a":null}`, string(b))
	})

	t.Run("PresentNullRefused", func(t *testing.T) {
		_, err := json.Marshal(fieldRecord{Tags: parse.Present[[]string](nil)})
		require.Error(t, err, "a present nil slice would read back as empty")
		assert.Contains(t, err.Error(), "marshals to null")
	})

	t.Run("BadJSONValue", func(t *testing.T) {
		var r fieldRecord
		err := json.Unmarshal([]byte(`{"stock":"many"}`), &r)
		var ute *json.UnmarshalTypeError
		require.True(t, errors.As(err, &ute), "%v", err)
	})

	t.Run("Extracted", func(t *testing.T) {
		e, err := parse.NewExtractorHTML([]byte(`<div>
			<span class="a">text</span>
			<span class="b"> &nbsp;&#8203; </span>
			<img class="c" alt="">
			<img class="d">
			<ul class="e"><li> </li><li></li></ul>
		</div>`), "https://shop.example/p/1")
		require.NoError(t, err)
		assert.Equal(t, parse.Present("text"), e.Text("a", "span.a"))
		assert.Equal(t, parse.Empty[string](), e.Text("b", "span.b"), "white space and zero-width only")
		assert.Equal(t, parse.Missing[string](), e.Text("z", "span.z"), "no such node")
		assert.Equal(t, parse.Empty[string](), e.Attr("c", "img.c", "alt"), "attribute present, empty")
		assert.Equal(t, parse.Missing[string](), e.Attr("d", "img.d", "alt"), "attribute absent")
		assert.Equal(t, parse.Missing[string](), e.Attr("z", "img.z", "alt"), "node absent")
		assert.Equal(t, parse.Empty[[]string](), e.Texts("e", "ul.e li"))
		assert.Equal(t, parse.Missing[[]string](), e.Texts("z", "ul.z li"))
		assert.Equal(t, parse.Missing[parse.Price](), e.Price("z", "span.z", "", parse.PriceOptions{}))
		assert.Equal(t, parse.Empty[parse.Price](), e.Price("b", "span.b", "", parse.PriceOptions{}))
		require.NoError(t, e.Err())
	})
}

// TestRequiredFieldsValidated: errors name each field that is not present, its state
// and the selector it was looked for with.
func TestRequiredFieldsValidated(t *testing.T) {
	t.Run("Validate", func(t *testing.T) {
		require.NoError(t, parse.Validate())
		require.NoError(t, parse.Validate(parse.Need("name", "h1", parse.Present("x")), parse.Need("n", "$.n", parse.Present(""))))
		err := parse.Validate(
			parse.Need("name", "h1.name", parse.Present("x")),
			parse.Need("price", "$.price", parse.Missing[string]()),
			parse.Need("stock", "span.stock", parse.Empty[int]()),
		)
		var ve *parse.ValidationError
		require.True(t, errors.As(err, &ve), "%v", err)
		assert.Equal(t, []parse.RequiredError{
			{Field: "price", Selector: "$.price", State: parse.StateMissing},
			{Field: "stock", Selector: "span.stock", State: parse.StateEmpty},
		}, ve.Fields)
		var re parse.RequiredError
		require.True(t, errors.As(err, &re))
		assert.Equal(t, "price", re.Field, "the first one")
		assert.Equal(t, `parse: validation: required field "price" (selector "$.price") is missing; `+
			`required field "stock" (selector "span.stock") is empty`, err.Error())
	})

	t.Run("Extractor", func(t *testing.T) {
		e, err := parse.NewExtractorHTML([]byte(`<h1 class="name">Lamp</h1><span class="price"></span>`), "https://shop.example/")
		require.NoError(t, err)
		e.Text("name", "h1.name")
		e.Price("price", "span.price", "", parse.PriceOptions{Currency: "EUR"})
		e.Text("sku", "p.sku")
		err = e.Require("name", "price", "sku", "never")
		var ve *parse.ValidationError
		require.True(t, errors.As(err, &ve), "%v", err)
		assert.Equal(t, []parse.RequiredError{
			{Field: "price", Selector: "span.price", State: parse.StateEmpty},
			{Field: "sku", Selector: "p.sku", State: parse.StateMissing},
			{Field: "never", Selector: "", State: parse.StateMissing},
		}, ve.Fields)
		fp := e.Fingerprint()
		for _, sel := range []string{"h1.name", "span.price", "p.sku"} {
			sc, ok := fp.Lookup(sel)
			require.True(t, ok, sel)
			assert.True(t, sc.Required, "%s is marked required in the fingerprint", sel)
		}
	})

	t.Run("UnreadableValueIsMissingWithError", func(t *testing.T) {
		e, err := parse.NewExtractorHTML([]byte(`<span class="price">call us</span><time datetime="yesterday">x</time><a href="mailto:x@example.com">m</a>`), "https://shop.example/")
		require.NoError(t, err)
		assert.True(t, e.Price("price", "span.price", "", parse.PriceOptions{Currency: "EUR"}).IsMissing())
		assert.True(t, e.Time("updated", "time", "datetime", parse.TimeOptions{}).IsMissing())
		assert.True(t, e.URL("contact", "a", "href").IsMissing())
		err = e.Err()
		require.Error(t, err)
		assert.Contains(t, err.Error(), `parse: field "price" (selector "span.price"): parse: price "call us": no amount`)
		assert.ErrorIs(t, err, parse.ErrRelativeTime)
		assert.Contains(t, err.Error(), `field "contact" (selector "a")`)
		assert.NotContains(t, err.Error(), "x@example.com", "a URL with @ is not echoed")
		var ve *parse.ValidationError
		require.True(t, errors.As(e.Require("price", "updated"), &ve))
		assert.Len(t, ve.Fields, 2)
	})

	t.Run("FakeShopSchemaChange", func(t *testing.T) {
		ss, err := samples()
		require.NoError(t, err)
		for _, s := range ss {
			if s.name != "fakeshop_schema_change" {
				continue
			}
			b, err := s.parse()
			require.NoError(t, err)
			var p struct{ Error string }
			require.NoError(t, json.Unmarshal(b, &p))
			assert.Equal(t, `parse: validation: required field "price" (selector "$.price") is missing`, p.Error)
			return
		}
		t.Fatal("sample fakeshop_schema_change not found")
	})
}
