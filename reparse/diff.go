package reparse

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"sort"
	"strconv"
)

// DiffRecords returns the field-level difference of two JSON records, one line per field
// ("  path: old → new", "+ path: new", "- path: old"), paths sorted; "" when they are
// equal. Objects are compared by key, arrays by index; a nil record is an empty one.
func DiffRecords(old, cur json.RawMessage) string {
	a, b := flatRecord(old), flatRecord(cur)
	paths := make([]string, 0, len(a)+len(b))
	for p := range a {
		paths = append(paths, p)
	}
	for p := range b {
		if _, ok := a[p]; !ok {
			paths = append(paths, p)
		}
	}
	sort.Strings(paths)
	var out bytes.Buffer
	for _, p := range paths {
		x, inA := a[p]
		y, inB := b[p]
		switch {
		case inA && inB && x != y:
			fmt.Fprintf(&out, "  %s: %s → %s\n", p, x, y)
		case inA && !inB:
			fmt.Fprintf(&out, "- %s: %s\n", p, x)
		case !inA && inB:
			fmt.Fprintf(&out, "+ %s: %s\n", p, y)
		}
	}
	return out.String()
}

// sameRecords reports whether DiffRecords(old, cur) is "".
func sameRecords(old, cur json.RawMessage) bool {
	return maps.Equal(flatRecord(old), flatRecord(cur))
}

// flatRecord is a record's leaves by path (see flatten).
func flatRecord(b json.RawMessage) map[string]string {
	out := map[string]string{}
	flatten("", decodeAny(b), out)
	return out
}

func decodeAny(b json.RawMessage) any {
	if len(b) == 0 {
		return nil
	}
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil {
		return string(b)
	}
	return v
}

// flatten writes every leaf of v under its path ("name", "offers[0].price"); an empty
// object or array is a leaf ("{}", "[]").
func flatten(path string, v any, out map[string]string) {
	switch x := v.(type) {
	case map[string]any:
		if len(x) == 0 && path != "" {
			out[path] = "{}"
		}
		for k, val := range x {
			p := k
			if path != "" {
				p = path + "." + k
			}
			flatten(p, val, out)
		}
	case []any:
		if len(x) == 0 {
			out[path] = "[]"
		}
		for i, val := range x {
			flatten(path+"["+strconv.Itoa(i)+"]", val, out)
		}
	case nil:
		if path != "" {
			out[path] = "null"
		}
	default:
		if path == "" {
			path = "."
		}
		switch x := x.(type) {
		case json.Number: // as json.Marshal writes it
			out[path] = string(x)
		case bool:
			out[path] = strconv.FormatBool(x)
		default:
			b, _ := json.Marshal(x)
			out[path] = string(b)
		}
	}
}
