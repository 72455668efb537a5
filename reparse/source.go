package reparse

import (
	"fmt"
	"slices"
	"strings"

	"github.com/idemscrape/idemscrape/handlers"
)

// ParserSource gives a reparse the parsers and topics of the kinds it may meet.
// *handlers.Registry is one (a team's own binary passes the registry its worker builds);
// *handlers.Parsers is one built by hand, for a tool that has no proxy configuration.
type ParserSource interface {
	// Parser returns kind's parser for parser version v.
	Parser(kind string, v int) (handlers.ParserFunc, bool)
	// Topic returns the outbox topic of kind's events ("" means the kind's name).
	Topic(kind string) string
}

var (
	_ ParserSource = (*handlers.Registry)(nil)
	_ ParserSource = (*handlers.Parsers)(nil)
)

// VersionError: a reparse to a parser version other than a job's own found no parser
// registered for that version explicitly (a parser that serves every version runs each
// job's own version only: "-to-version 7" is more likely a typo than a wish to write
// version 7 jobs with it). Nothing is written for such a job.
type VersionError struct {
	Kind       string
	Version    int
	Registered []int // the kind's explicitly registered versions
}

func (e *VersionError) Error() string {
	have := "none: its parser only reparses each job's own version"
	if len(e.Registered) > 0 {
		have = strings.Trim(fmt.Sprint(e.Registered), "[]")
	}
	return fmt.Sprintf("reparse: kind %q has no parser registered for version %d (registered versions: %s)", e.Kind, e.Version, have)
}

// CheckVersion reports whether src may reparse kind's jobs as parser version v when v is
// not their own version: src must have a parser registered for v explicitly. A source that
// does not list its versions (no ParserVersions(kind) []int method, as *handlers.Registry
// and *handlers.Parsers have) is taken at its word (Parser(kind, v)). It returns a
// *VersionError otherwise. Run applies it to every job it would commit under another
// version, and up front when the selection names the kind.
func CheckVersion(src ParserSource, kind string, v int) error {
	lister, ok := src.(interface{ ParserVersions(kind string) []int })
	if !ok {
		if _, ok := src.Parser(kind, v); ok {
			return nil
		}
		return &VersionError{Kind: kind, Version: v}
	}
	vs := lister.ParserVersions(kind)
	if slices.Contains(vs, v) {
		return nil
	}
	return &VersionError{Kind: kind, Version: v, Registered: vs}
}
