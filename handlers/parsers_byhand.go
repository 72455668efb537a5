package handlers

import "slices"

// Parsers is a set of parsers built by hand, for a reparse (package reparse) run by a tool
// that has no proxy configuration; like *Registry, it is a reparse.ParserSource. The zero
// value is empty; Add fills it.
type Parsers struct {
	byKind map[string]map[int]ParserFunc // version 0: every version
	topics map[string]string
}

// Add registers parser as kind's version v; v = 0 makes it serve every version that has
// no parser of its own. topic is the kind's outbox topic ("" = the kind's name).
func (p *Parsers) Add(kind string, v int, topic string, parser ParserFunc) *Parsers {
	if p.byKind == nil {
		p.byKind, p.topics = map[string]map[int]ParserFunc{}, map[string]string{}
	}
	if p.byKind[kind] == nil {
		p.byKind[kind] = map[int]ParserFunc{}
	}
	p.byKind[kind][v] = parser
	if topic != "" {
		p.topics[kind] = topic
	}
	return p
}

// Parser implements reparse.ParserSource.
func (p *Parsers) Parser(kind string, v int) (ParserFunc, bool) {
	m := p.byKind[kind]
	if f, ok := m[v]; ok {
		return f, true
	}
	f, ok := m[0]
	return f, ok
}

// Topic implements reparse.ParserSource.
func (p *Parsers) Topic(kind string) string { return p.topics[kind] }

// ParserVersions returns the versions registered for kind explicitly (not 0), sorted.
func (p *Parsers) ParserVersions(kind string) []int {
	var out []int
	for v := range p.byKind[kind] {
		if v != 0 {
			out = append(out, v)
		}
	}
	slices.Sort(out)
	return out
}
