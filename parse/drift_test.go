package parse_test

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/parse"
)

func fp(scs ...parse.SelectorCount) parse.Fingerprint {
	var f parse.Fingerprint
	for _, sc := range scs {
		f.Add(sc)
	}
	return f
}

func sc(sel string, n int) parse.SelectorCount { return parse.SelectorCount{Selector: sel, Count: n} }

func req(sel string, n int) parse.SelectorCount {
	return parse.SelectorCount{Selector: sel, Count: n, Required: true}
}

func list(sel string, n int) parse.SelectorCount {
	return parse.SelectorCount{Selector: sel, Count: n, List: true}
}

func TestFingerprintAdd(t *testing.T) {
	f := fp(sc("b", 1), sc("a", 2), req("b", 0), list("c", 3))
	assert.Equal(t, []parse.SelectorCount{
		{Selector: "a", Count: 2},
		{Selector: "b", Count: 1, Required: true},
		{Selector: "c", Count: 3, List: true},
	}, f.Selectors, "sorted; a repeated selector keeps the larger count and both flags")
	b, err := json.Marshal(f)
	require.NoError(t, err)
	assert.Equal(t, `{"selectors":[{"selector":"a","count":2},{"selector":"b","count":1,"required":true},{"selector":"c","count":3,"list":true}]}`, string(b))
}

func TestDrift(t *testing.T) {
	history := []parse.Fingerprint{
		fp(req("h1.name", 1), req("span.price", 1), sc("span.badge", 0), list("li.review", 3), sc("img", 2)),
		fp(req("h1.name", 1), req("span.price", 1), sc("span.badge", 1), list("li.review", 7), sc("img", 4)),
	}
	for _, tt := range []struct {
		name       string
		recorded   []parse.Fingerprint
		got        parse.Fingerprint
		surprising bool
		changes    []parse.SelectorDrift
		summary    string
	}{
		{
			name:     "NoHistoryNothingToCompare",
			recorded: nil,
			got:      fp(req("h1.name", 0)),
		},
		{
			name:     "WithinRange",
			recorded: history,
			got:      fp(req("h1.name", 1), req("span.price", 1), sc("span.badge", 1), list("li.review", 5), sc("img", 3)),
		},
		{
			name:       "RequiredSelectorVanished",
			recorded:   history,
			got:        fp(sc("h1.name", 1), sc("span.price", 0), sc("span.badge", 0), list("li.review", 3), sc("img", 2)),
			surprising: true,
			changes: []parse.SelectorDrift{{Selector: "span.price", Got: 0, Min: 1, Max: 1, Seen: 2, Required: true,
				Surprising: true, Reason: "matched 0 nodes, 1–1 in all 2 recorded (required)"}},
			summary: `schema drift: "span.price" matched 0 nodes, 1–1 in all 2 recorded (required)`,
		},
		{
			name:       "CountOutsideRange",
			recorded:   history,
			got:        fp(req("h1.name", 2), req("span.price", 1), sc("span.badge", 0), list("li.review", 3), sc("img", 9)),
			surprising: true,
			changes: []parse.SelectorDrift{
				{Selector: "h1.name", Got: 2, Min: 1, Max: 1, Seen: 2, Required: true, Surprising: true,
					Reason: "matched 2 nodes, 1–1 in all 2 recorded (required)"},
				{Selector: "img", Got: 9, Min: 2, Max: 4, Seen: 2, Surprising: true,
					Reason: "matched 9 nodes, 2–4 in all 2 recorded"},
			},
			summary: `schema drift: "h1.name" matched 2 nodes, 1–1 in all 2 recorded (required); "img" matched 9 nodes, 2–4 in all 2 recorded`,
		},
		{
			name:     "ListLengthVariesFreely",
			recorded: history,
			got:      fp(req("h1.name", 1), req("span.price", 1), sc("span.badge", 0), list("li.review", 40), sc("img", 2)),
			changes: []parse.SelectorDrift{{Selector: "li.review", Got: 40, Min: 3, Max: 7, Seen: 2, List: true,
				Reason: "matched 40 nodes, 3–7 in all 2 recorded (list)"}},
		},
		{
			name:       "ListVanished",
			recorded:   history,
			got:        fp(req("h1.name", 1), req("span.price", 1), sc("span.badge", 0), list("li.review", 0), sc("img", 2)),
			surprising: true,
			changes: []parse.SelectorDrift{{Selector: "li.review", Got: 0, Min: 3, Max: 7, Seen: 2, List: true, Surprising: true,
				Reason: "matched 0 nodes, 3–7 in all 2 recorded (list)"}},
			summary: `schema drift: "li.review" matched 0 nodes, 3–7 in all 2 recorded (list)`,
		},
		{
			name:     "OptionalSometimesAbsentMayBeZero",
			recorded: history,
			got:      fp(req("h1.name", 1), req("span.price", 1), sc("span.badge", 0), list("li.review", 3), sc("img", 2)),
		},
		{
			name:     "RequiredThatWasOnceZeroIsNotSurprising",
			recorded: []parse.Fingerprint{fp(req("span.price", 1)), fp(req("span.price", 0))},
			got:      fp(req("span.price", 0)),
		},
		{
			name:     "NewAndUnqueriedSelectorsListedNotSurprising",
			recorded: history,
			got:      fp(req("h1.name", 1), req("span.price", 1), sc("span.badge", 0), list("li.review", 3), sc("span.stock", 1)),
			changes: []parse.SelectorDrift{
				{Selector: "img", Got: -1, Min: 2, Max: 4, Seen: 2, Reason: "not queried by this parse"},
				{Selector: "span.stock", Got: 1, Reason: "new selector (matched 1 nodes; no recorded fingerprint queried it)"},
			},
		},
		{
			name:       "RangeOnlyOverFingerprintsThatQueried",
			recorded:   append([]parse.Fingerprint{fp(req("h1.name", 1))}, history...),
			got:        fp(req("h1.name", 1), req("span.price", 0), sc("span.badge", 0), list("li.review", 3), sc("img", 2)),
			surprising: true,
			changes: []parse.SelectorDrift{{Selector: "span.price", Got: 0, Min: 1, Max: 1, Seen: 2, Required: true,
				Surprising: true, Reason: "matched 0 nodes, 1–1 in those 2 recorded (required)"}},
			summary: `schema drift: "span.price" matched 0 nodes, 1–1 in those 2 recorded (required)`,
		},
	} {
		t.Run(tt.name, func(t *testing.T) {
			rep, surprising := parse.Drift(tt.recorded, tt.got)
			assert.Equal(t, tt.surprising, surprising)
			assert.Equal(t, len(tt.recorded), rep.Recorded)
			assert.Equal(t, tt.changes, rep.Changes)
			assert.Equal(t, tt.summary, rep.String())
			assert.Equal(t, tt.surprising, len(rep.Surprising()) > 0)
			again, _ := parse.Drift(tt.recorded, tt.got)
			assert.Equal(t, rep, again, "deterministic")
		})
	}
}

// TestDriftFakeShopSchemaChange: the fake shop's schema toggle (price renamed amount) is a
// surprising drift against fingerprints recorded from the normal schema.
func TestDriftFakeShopSchemaChange(t *testing.T) {
	ss, err := samples()
	require.NoError(t, err)
	fps := map[string]parse.Fingerprint{}
	for _, s := range ss {
		b, err := s.parse()
		require.NoError(t, err)
		var p parsed
		require.NoError(t, json.Unmarshal(b, &p))
		fps[s.name] = p.Fingerprint
	}
	recorded := []parse.Fingerprint{fps["fakeshop"], fps["fakeshop"]}

	_, surprising := parse.Drift(recorded, fps["fakeshop"])
	assert.False(t, surprising, "the same schema")

	rep, surprising := parse.Drift(recorded, fps["fakeshop_schema_change"])
	assert.True(t, surprising)
	assert.Equal(t, `schema drift: "$.price" matched 0 nodes, 1–1 in all 2 recorded (required)`, rep.String())

	rep, surprising = parse.Drift(recorded, fps["fakeshop_search_as_product"])
	assert.True(t, surprising, "a different page entirely")
	assert.Len(t, rep.Surprising(), 4)
}

func TestDriftError(t *testing.T) {
	recorded := []parse.Fingerprint{fp(req("span.price", 1))}
	rep, _ := parse.Drift(recorded, fp(req("span.price", 1)))
	require.NoError(t, rep.Err())
	rep, _ = parse.Drift(recorded, fp(req("span.price", 0)))
	err := rep.Err()
	var de *parse.DriftError
	require.ErrorAs(t, err, &de)
	assert.Equal(t, rep, de.Report)
	assert.Equal(t, `parse: schema drift: "span.price" matched 0 nodes, 1–1 in all 1 recorded (required)`, err.Error())
}
