package parse

import (
	"fmt"
	"slices"
	"strings"
)

// SelectorCount is how many nodes one selector matched in one parse.
type SelectorCount struct {
	// Selector is the CSS selector (or JSON path) as the parser wrote it.
	Selector string `json:"selector"`
	// Count is the number of nodes it matched.
	Count int `json:"count"`
	// Required is set when a required field is read through it.
	Required bool `json:"required,omitempty"`
	// List is set when it selects a list whose length varies from page to page.
	List bool `json:"list,omitempty"`
}

// Fingerprint is the schema fingerprint of one parse: every selector the parser queried
// and how many nodes it matched, sorted by selector, so equal parses give equal JSON.
type Fingerprint struct {
	Selectors []SelectorCount `json:"selectors"`
}

// Add records that selector matched count nodes, keeping Selectors sorted. Adding a
// selector again keeps the larger count and the union of the flags.
func (f *Fingerprint) Add(sc SelectorCount) {
	i, found := slices.BinarySearchFunc(f.Selectors, sc.Selector, func(a SelectorCount, s string) int {
		return strings.Compare(a.Selector, s)
	})
	if !found {
		f.Selectors = slices.Insert(f.Selectors, i, sc)
		return
	}
	cur := &f.Selectors[i]
	cur.Count = max(cur.Count, sc.Count)
	cur.Required = cur.Required || sc.Required
	cur.List = cur.List || sc.List
}

// Lookup returns the entry of selector.
func (f Fingerprint) Lookup(selector string) (SelectorCount, bool) {
	for _, sc := range f.Selectors {
		if sc.Selector == selector {
			return sc, true
		}
	}
	return SelectorCount{}, false
}

// SelectorDrift is how one selector's count compares with the recorded fingerprints.
type SelectorDrift struct {
	// Selector is the selector compared.
	Selector string `json:"selector"`
	// Got is this parse's count; -1 when this parse did not query the selector.
	Got int `json:"got"`
	// Min and Max are the range of counts over the recorded fingerprints that queried it.
	Min int `json:"min"`
	Max int `json:"max"`
	// Seen is how many recorded fingerprints queried it (0: a new selector).
	Seen int `json:"seen"`
	// Required and List are the selector's flags, from got or any recorded fingerprint.
	Required bool `json:"required,omitempty"`
	List     bool `json:"list,omitempty"`
	// Surprising says the change alone should quarantine the staging.
	Surprising bool `json:"surprising"`
	// Reason says what changed, e.g. "matched 0 nodes, 1–1 in all 12 recorded (required)".
	Reason string `json:"reason"`
}

// DriftReport lists the selectors whose count differs from what the recorded
// fingerprints allow, sorted by selector. Selectors within their range are not listed.
type DriftReport struct {
	// Recorded is the number of recorded fingerprints compared with.
	Recorded int `json:"recorded"`
	// Changes are the differences, surprising or not.
	Changes []SelectorDrift `json:"changes,omitempty"`
}

// Surprising returns the surprising changes.
func (r DriftReport) Surprising() []SelectorDrift {
	var out []SelectorDrift
	for _, c := range r.Changes {
		if c.Surprising {
			out = append(out, c)
		}
	}
	return out
}

// String names every surprising change, e.g. `schema drift: "span.price" matched 0 nodes,
// 1–1 in all 12 recorded (required)`; "" when there is none.
func (r DriftReport) String() string {
	var parts []string
	for _, c := range r.Surprising() {
		parts = append(parts, fmt.Sprintf("%q %s", c.Selector, c.Reason))
	}
	if parts == nil {
		return ""
	}
	return "schema drift: " + strings.Join(parts, "; ")
}

// DriftError is the error of a surprising drift: handlers quarantine the staging with
// category validation and record Error() (which names each surprising selector) on the
// attempt.
type DriftError struct {
	Report DriftReport
}

// Error returns "parse: " + Report.String().
func (e *DriftError) Error() string { return "parse: " + e.Report.String() }

// Err returns a *DriftError when the report has a surprising change, nil otherwise.
func (r DriftReport) Err() error {
	if len(r.Surprising()) == 0 {
		return nil
	}
	return &DriftError{Report: r}
}

// Drift compares got with the fingerprints recorded for the same kind (and parser
// version) and reports whether the change is surprising, i.e. whether the staging should
// be quarantined (category validation) instead of committed. The rule:
//
//   - a selector that was required, or that selects a list, and matched at least one node
//     in every recorded fingerprint that queried it, now matches 0: surprising;
//   - any other selector (not a list) whose count lies outside the [min, max] range of the
//     recorded fingerprints that queried it: surprising. A list's length may vary freely;
//     only its disappearing is surprising;
//   - a selector no recorded fingerprint queried (a new parser version) or one this parse
//     did not query: listed, not surprising;
//   - no recorded fingerprints at all: nothing to compare with, not surprising.
//
// Required and List count when set in got or in any recorded fingerprint. Drift is a
// pure function: the caller chooses which fingerprints to record (those of parses that
// were committed, so that an accepted change widens the range) and where to keep them.
func Drift(recorded []Fingerprint, got Fingerprint) (DriftReport, bool) {
	rep := DriftReport{Recorded: len(recorded)}
	if len(recorded) == 0 {
		return rep, false
	}
	type agg struct {
		min, max, seen int
		required, list bool
	}
	hist := map[string]*agg{}
	var names []string
	for _, fp := range recorded {
		for _, sc := range fp.Selectors {
			a := hist[sc.Selector]
			if a == nil {
				a = &agg{min: sc.Count, max: sc.Count}
				hist[sc.Selector] = a
				names = append(names, sc.Selector)
			}
			a.min, a.max, a.seen = min(a.min, sc.Count), max(a.max, sc.Count), a.seen+1
			a.required, a.list = a.required || sc.Required, a.list || sc.List
		}
	}
	for _, sc := range got.Selectors {
		if hist[sc.Selector] == nil {
			names = append(names, sc.Selector)
		}
	}
	slices.Sort(names)
	names = slices.Compact(names)

	surprising := false
	for _, name := range names {
		a := hist[name]
		sc, queried := got.Lookup(name)
		d := SelectorDrift{Selector: name, Got: sc.Count}
		switch {
		case a == nil:
			d.Required, d.List = sc.Required, sc.List
			d.Reason = fmt.Sprintf("new selector (matched %d nodes; no recorded fingerprint queried it)", sc.Count)
		case !queried:
			d.Got, d.Min, d.Max, d.Seen, d.Required, d.List = -1, a.min, a.max, a.seen, a.required, a.list
			d.Reason = "not queried by this parse"
		default:
			d.Min, d.Max, d.Seen = a.min, a.max, a.seen
			d.Required, d.List = a.required || sc.Required, a.list || sc.List
			switch {
			case sc.Count == 0 && a.min > 0 && (d.Required || d.List):
				d.Surprising = true
			case !d.List && (sc.Count < a.min || sc.Count > a.max):
				d.Surprising = true
			case d.List && (sc.Count < a.min || sc.Count > a.max):
				// A list's length varies: listed, not surprising.
			default:
				continue
			}
			which := "those"
			if a.seen == len(recorded) {
				which = "all"
			}
			d.Reason = fmt.Sprintf("matched %d nodes, %d–%d in %s %d recorded", sc.Count, a.min, a.max, which, a.seen)
			if d.Required {
				d.Reason += " (required)"
			}
			if d.List {
				d.Reason += " (list)"
			}
		}
		surprising = surprising || d.Surprising
		rep.Changes = append(rep.Changes, d)
	}
	return rep, surprising
}
