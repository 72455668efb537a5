package parse

import (
	"bytes"
	"errors"
	"fmt"
	"strings"

	"github.com/PuerkitoBio/goquery"
	"github.com/andybalholm/cascadia"
)

// Extractor reads fields out of one HTML document with goquery and records, while it
// does, the schema fingerprint (every selector queried and how many nodes it matched) and
// each field's state and selector, for Require. Conversion errors (an unreadable price,
// URL or timestamp) are collected in call order and returned by Err; the field is then
// missing.
//
// An Extractor is for one parse of one document and is not safe for concurrent use;
// parsing the same document with the same calls gives the same fields, fingerprint and
// errors, byte for byte.
type Extractor struct {
	root     *goquery.Selection
	page     string
	matchers map[string]cascadia.Selector
	fp       Fingerprint
	fields   []Requirement
	errs     []error
}

// NewExtractor returns an Extractor over root (usually doc.Selection); pageURL is the
// URL the document was fetched from, against which URL resolves links.
func NewExtractor(root *goquery.Selection, pageURL string) *Extractor {
	return &Extractor{root: root, page: pageURL, matchers: map[string]cascadia.Selector{}}
}

// NewExtractorHTML parses body as HTML and returns an Extractor over the document.
func NewExtractorHTML(body []byte, pageURL string) (*Extractor, error) {
	doc, err := goquery.NewDocumentFromReader(bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("parse: HTML of %s: %w", safeURL(pageURL), err)
	}
	return NewExtractor(doc.Selection, pageURL), nil
}

// find returns the nodes selector matches and records the count in the fingerprint. An
// invalid selector is an error (goquery would silently match nothing) and is not recorded.
func (e *Extractor) find(field, selector string, list bool) (*goquery.Selection, bool) {
	m, ok := e.matchers[selector]
	if !ok {
		var err error
		if m, err = cascadia.Compile(selector); err != nil {
			e.errs = append(e.errs, fmt.Errorf("parse: field %q: invalid selector %q: %w", field, selector, err))
			return nil, false
		}
		e.matchers[selector] = m
	}
	sel := e.root.FindMatcher(m)
	e.fp.Add(SelectorCount{Selector: selector, Count: sel.Length(), List: list})
	return sel, true
}

// record notes the field's state for Require and returns it.
func record[T any](e *Extractor, field, selector string, f Field[T]) Field[T] {
	e.fields = append(e.fields, Requirement{Field: field, Selector: selector, State: f.State()})
	return f
}

// Count returns how many nodes selector matches and records it in the fingerprint.
func (e *Extractor) Count(selector string) int {
	sel, ok := e.find("", selector, false)
	if !ok {
		return 0
	}
	return sel.Length()
}

// Text returns the white-space-normalised text (see Whitespace) of the first node
// selector matches: missing when it matches none, empty when the text is "".
func (e *Extractor) Text(field, selector string) Field[string] {
	sel, ok := e.find(field, selector, false)
	if !ok || sel.Length() == 0 {
		return record(e, field, selector, Missing[string]())
	}
	return record(e, field, selector, nonEmpty(Whitespace(sel.First().Text())))
}

// Texts returns the normalised texts of every node selector matches, in document order,
// leaving out empty ones: missing when it matches none, empty when all texts are "". The
// selector is recorded as a list (see Drift).
func (e *Extractor) Texts(field, selector string) Field[[]string] {
	sel, ok := e.find(field, selector, true)
	if !ok || sel.Length() == 0 {
		return record(e, field, selector, Missing[[]string]())
	}
	var out []string
	sel.Each(func(_ int, s *goquery.Selection) {
		if t := Whitespace(s.Text()); t != "" {
			out = append(out, t)
		}
	})
	if out == nil {
		return record(e, field, selector, Empty[[]string]())
	}
	return record(e, field, selector, Present(out))
}

// Attr returns the normalised value of attribute attr of the first node selector
// matches: missing when it matches none or that node has no such attribute, empty when
// the value is "".
func (e *Extractor) Attr(field, selector, attr string) Field[string] {
	return e.attr(field, selector, attr, Whitespace)
}

// attr is Attr with the value passed through norm.
func (e *Extractor) attr(field, selector, attr string, norm func(string) string) Field[string] {
	sel, ok := e.find(field, selector, false)
	if !ok || sel.Length() == 0 {
		return record(e, field, selector, Missing[string]())
	}
	v, has := sel.First().Attr(attr)
	if !has {
		return record(e, field, selector, Missing[string]())
	}
	return record(e, field, selector, nonEmpty(norm(v)))
}

// Attrs returns the normalised values of attribute attr of every node selector matches, in
// document order, leaving out nodes without it and empty values: missing when no node
// matched has the attribute, empty when every value is "". The selector is recorded as a
// list (see Drift).
func (e *Extractor) Attrs(field, selector, attr string) Field[[]string] {
	return e.attrs(field, selector, attr, Whitespace)
}

// attrs is Attrs with each value passed through norm.
func (e *Extractor) attrs(field, selector, attr string, norm func(string) string) Field[[]string] {
	sel, ok := e.find(field, selector, true)
	if !ok || sel.Length() == 0 {
		return record(e, field, selector, Missing[[]string]())
	}
	var out []string
	has := false
	sel.Each(func(_ int, s *goquery.Selection) {
		v, ok := s.Attr(attr)
		if !ok {
			return
		}
		has = true
		if v = norm(v); v != "" {
			out = append(out, v)
		}
	})
	switch {
	case !has:
		return record(e, field, selector, Missing[[]string]())
	case out == nil:
		return record(e, field, selector, Empty[[]string]())
	}
	return record(e, field, selector, Present(out))
}

// URLs returns attribute attr (e.g. "href") of every node selector matches — a list
// page's links — each resolved against the page URL and in canonical form (see URL), in
// document order, leaving out nodes without it and empty values; duplicates are kept
// (a product linked by its image and its title is there twice). Every value must resolve:
// one that does not ("mailto:", "javascript:") is an error (see Err) naming it, and the
// field is missing, as URL's. Select the links you mean (e.g. "a.product[href]").
func (e *Extractor) URLs(field, selector, attr string) Field[[]string] {
	f := e.attrs(field, selector, attr, func(v string) string { return strings.Trim(v, " \t\n\f\r") })
	vs, ok := f.Get()
	if !ok {
		return f
	}
	out := make([]string, len(vs))
	for i, v := range vs {
		u, err := URL(e.page, v)
		if err != nil {
			return fail(e, field, selector, Missing[[]string](), fmt.Errorf("value %d of %d: %w", i+1, len(vs), err))
		}
		out[i] = u
	}
	return Present(out)
}

// URL returns attribute attr (e.g. "href") of the first node selector matches, resolved
// against the page URL and in canonical form (see URL). An unresolvable value is an error
// (see Err) and the field is missing.
func (e *Extractor) URL(field, selector, attr string) Field[string] {
	// URL strips what HTML allows around a URL itself; Whitespace would also collapse
	// spaces inside it.
	f := e.attr(field, selector, attr, func(v string) string { return strings.Trim(v, " \t\n\f\r") })
	v, ok := f.Get()
	if !ok {
		return f
	}
	u, err := URL(e.page, v)
	if err != nil {
		return fail(e, field, selector, Missing[string](), err)
	}
	return Present(u)
}

// Price returns the price (see ParsePrice) in attribute attr of the first node selector
// matches, or in its text when attr is "" (e.g. Price(f, "span.price", "", o), or
// Price(f, `meta[itemprop="price"]`, "content", o) for microdata). An unreadable price is
// an error (see Err) and the field is missing.
func (e *Extractor) Price(field, selector, attr string, opts PriceOptions) Field[Price] {
	f := e.textOrAttr(field, selector, attr)
	v, ok := f.Get()
	if !ok {
		return Field[Price]{state: f.State()}
	}
	p, err := ParsePrice(v, opts)
	if err != nil {
		return fail(e, field, selector, Missing[Price](), err)
	}
	return Present(p)
}

// Time returns the timestamp (UTC RFC 3339, see Timestamp) in attribute attr of the first
// node selector matches, or in its text when attr is "" (e.g. Time(f, "time", "datetime",
// o)). An unreadable timestamp is an error (see Err) and the field is missing.
func (e *Extractor) Time(field, selector, attr string, opts TimeOptions) Field[string] {
	f := e.textOrAttr(field, selector, attr)
	v, ok := f.Get()
	if !ok {
		return f
	}
	ts, err := Timestamp(v, opts)
	if err != nil {
		return fail(e, field, selector, Missing[string](), err)
	}
	return Present(ts)
}

func (e *Extractor) textOrAttr(field, selector, attr string) Field[string] {
	if attr == "" {
		return e.Text(field, selector)
	}
	return e.Attr(field, selector, attr)
}

// fail records a conversion error for the field and marks it missing.
func fail[T any](e *Extractor, field, selector string, f Field[T], err error) Field[T] {
	e.errs = append(e.errs, fmt.Errorf("parse: field %q (selector %q): %w", field, selector, err))
	e.fields[len(e.fields)-1].State = f.State()
	return f
}

// Require returns a *ValidationError naming every listed field that is not present, with
// the selector it was looked for with (a field never extracted is reported missing with
// selector ""), and marks those selectors required in the fingerprint (see Drift). Call
// it after extracting, before Fingerprint.
func (e *Extractor) Require(fields ...string) error {
	reqs := make([]Requirement, 0, len(fields))
	for _, name := range fields {
		r := Requirement{Field: name}
		for _, f := range e.fields {
			if f.Field == name {
				r = f // the last extraction of the field wins
			}
		}
		if r.Selector != "" {
			if sc, ok := e.fp.Lookup(r.Selector); ok {
				sc.Required = true
				e.fp.Add(sc)
			}
		}
		reqs = append(reqs, r)
	}
	return Validate(reqs...)
}

// Fingerprint returns the schema fingerprint so far (a copy).
func (e *Extractor) Fingerprint() Fingerprint {
	return Fingerprint{Selectors: append([]SelectorCount{}, e.fp.Selectors...)}
}

// Err returns the conversion and selector errors so far, joined in call order, or nil.
func (e *Extractor) Err() error { return errors.Join(e.errs...) }

// nonEmpty is Present(s), or Empty when s is "".
func nonEmpty(s string) Field[string] {
	if s == "" {
		return Empty[string]()
	}
	return Present(s)
}
