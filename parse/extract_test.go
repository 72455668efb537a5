package parse_test

import (
	"strings"
	"testing"

	"github.com/PuerkitoBio/goquery"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/parse"
)

func TestExtractor(t *testing.T) {
	const page = `<html><body>
		<a class="p" href="/p/2?utm_medium=x">two</a><a class="p" href="/p/3">three</a>
		<time datetime="2026-04-23T10:00:00+02:00">today</time>
		<span class="price">$12.50</span>
	</body></html>`

	t.Run("HappyPath", func(t *testing.T) {
		e, err := parse.NewExtractorHTML([]byte(page), "https://shop.example/list?page=1")
		require.NoError(t, err)
		assert.Equal(t, parse.Present("https://shop.example/p/2"), e.URL("first", "a.p", "href"))
		assert.Equal(t, 2, e.Count("a.p"))
		assert.Equal(t, parse.Present([]string{"two", "three"}), e.Texts("names", "a.p"))
		assert.Equal(t, parse.Present("2026-04-23T08:00:00Z"), e.Time("at", "time", "datetime", parse.TimeOptions{}))
		assert.Equal(t, parse.Present(exact("USD", "12.50", 1250)), e.Price("price", "span.price", "", parse.PriceOptions{Currency: "USD"}))
		require.NoError(t, e.Err())
		assert.Equal(t, parse.Fingerprint{Selectors: []parse.SelectorCount{
			{Selector: "a.p", Count: 2, List: true}, // queried as one value and as a list
			{Selector: "span.price", Count: 1},
			{Selector: "time", Count: 1},
		}}, e.Fingerprint())
	})

	t.Run("MicrodataPriceInAttribute", func(t *testing.T) {
		e, err := parse.NewExtractorHTML([]byte(`<div itemprop="offers"><meta itemprop="price" content="1234.5"><meta itemprop="priceCurrency" content="EUR"></div>`), "https://shop.example/")
		require.NoError(t, err)
		cur := e.Attr("currency", `meta[itemprop="priceCurrency"]`, "content")
		got := e.Price("price", `meta[itemprop="price"]`, "content", parse.PriceOptions{Currency: cur.Or("")})
		assert.Equal(t, parse.Present(exact("EUR", "1234.50", 123450)), got)
		require.NoError(t, e.Require("price", "currency"))
	})

	t.Run("URLKeepsInnerSpaces", func(t *testing.T) {
		e, err := parse.NewExtractorHTML([]byte(`<a href="  /a  b c ">x</a><a class="empty" href="">y</a>`), "https://shop.example/")
		require.NoError(t, err)
		assert.Equal(t, parse.Present("https://shop.example/a%20%20b%C2%A0c"), e.URL("link", "a", "href"))
		assert.Equal(t, parse.Empty[string](), e.URL("empty", "a.empty", "href"))
		require.NoError(t, e.Err())
	})

	t.Run("ListOfLinks", func(t *testing.T) {
		const list = `<ul>
			<li><a class="p" href="/p/1?utm_source=x"><img src="1.jpg"></a><a class="p" href=" /p/1 ">one</a></li>
			<li><a class="p" href="p/2">two</a></li>
			<li><a class="p">no link</a><a class="p" href="">empty</a></li>
			<li><a class="mail" href="mailto:shop@example.com">mail</a><a class="mail" href="/contact">contact</a></li>
		</ul><img class="i" data-src="a.jpg"><img class="i" data-src=" b.jpg ">`
		e, err := parse.NewExtractorHTML([]byte(list), "https://shop.example/list/?page=2")
		require.NoError(t, err)
		assert.Equal(t, parse.Present([]string{"https://shop.example/p/1", "https://shop.example/p/1", "https://shop.example/list/p/2"}),
			e.URLs("links", "a.p", "href"), "document order, duplicates kept, nodes without the attribute and empty values left out")
		assert.Equal(t, parse.Present([]string{"a.jpg", "b.jpg"}), e.Attrs("images", "img.i", "data-src"))
		assert.Equal(t, parse.Missing[[]string](), e.Attrs("none", "a.absent", "href"), "no node")
		assert.Equal(t, parse.Missing[[]string](), e.Attrs("noattr", "img.i", "alt"), "no node has the attribute")
		assert.Equal(t, parse.Empty[[]string](), e.URLs("empty", `a.p[href=""]`, "href"))
		require.NoError(t, e.Err())
		assert.Contains(t, e.Fingerprint().Selectors, parse.SelectorCount{Selector: "a.p", Count: 5, List: true})

		got := e.URLs("mail", "a.mail", "href")
		assert.True(t, got.IsMissing(), "one unresolvable link fails the field, as URL")
		err = e.Err()
		require.Error(t, err)
		assert.Contains(t, err.Error(), `field "mail"`)
		assert.Contains(t, err.Error(), "value 1 of 2")
		assert.NotContains(t, err.Error(), "shop@example.com", "a URL with an @ is never in an error")
		require.Error(t, e.Require("mail"))
	})

	t.Run("InvalidSelectorIsAnError", func(t *testing.T) {
		e, err := parse.NewExtractorHTML([]byte(page), "https://shop.example/")
		require.NoError(t, err)
		assert.True(t, e.Text("name", "h1[").IsMissing())
		assert.Equal(t, 0, e.Count("::nope"))
		err = e.Err()
		require.Error(t, err)
		assert.Contains(t, err.Error(), `parse: field "name": invalid selector "h1["`)
		assert.Contains(t, err.Error(), `invalid selector "::nope"`)
		assert.Empty(t, e.Fingerprint().Selectors, "an invalid selector is not recorded as matching 0")
	})

	t.Run("OverASelection", func(t *testing.T) {
		doc, err := goquery.NewDocumentFromReader(strings.NewReader(`<div id="a"><b>1</b></div><div id="b"><b>2</b><b>3</b></div>`))
		require.NoError(t, err)
		e := parse.NewExtractor(doc.Find("#b"), "https://shop.example/")
		assert.Equal(t, parse.Present("2"), e.Text("b", "b"), "only under the given root")
		assert.Equal(t, 2, e.Count("b"))
	})

	t.Run("FingerprintIsACopy", func(t *testing.T) {
		e, err := parse.NewExtractorHTML([]byte(page), "https://shop.example/")
		require.NoError(t, err)
		e.Text("p", "a.p")
		f := e.Fingerprint()
		f.Selectors[0].Count = 99
		assert.Equal(t, 2, e.Fingerprint().Selectors[0].Count)
	})
}
