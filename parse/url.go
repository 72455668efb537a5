package parse

import (
	"errors"
	"fmt"
	"strings"

	whatwg "github.com/nlnwa/whatwg-url/url"

	"github.com/idemscrape/idemscrape/job"
)

// URL resolves ref (an href or src as written in the page) against the page's URL and
// returns the job.DefaultNormalizer canonical form, the same form job keys are built
// from. See URLWith.
func URL(page, ref string) (string, error) {
	return URLWith(job.DefaultNormalizer, page, ref)
}

// URLWith is URL with a given normaliser (use the one your job keys are built with).
//
// Resolution follows the WHATWG URL standard, as browsers do: leading and trailing ASCII
// white space of ref is stripped (HTML attribute values carry it), tabs and newlines
// inside it removed, backslashes read as slashes. The result must be an absolute http or
// https URL without user info (see job.Normalizer.NormalizeURL): "javascript:", "mailto:"
// and "data:" links are errors. The error never contains a URL that has an "@" in it (it
// could hold credentials).
func URLWith(n *job.Normalizer, page, ref string) (string, error) {
	ref = strings.Trim(ref, " \t\n\f\r")
	ref = strings.NewReplacer("\t", "", "\n", "", "\r", "").Replace(ref)
	if ref == "" {
		return "", fmt.Errorf("parse: URL: empty reference")
	}
	u, err := whatwg.ParseRef(page, ref)
	if err != nil {
		return "", fmt.Errorf("parse: URL %s on page %s: cannot be resolved", safeURL(ref), safeURL(page))
	}
	out, err := n.NormalizeURL(u.Href(true))
	if err != nil {
		var fe *job.FieldError
		if errors.As(err, &fe) {
			return "", fmt.Errorf("parse: URL %s on page %s: %s", safeURL(ref), safeURL(page), fe.Reason)
		}
		return "", fmt.Errorf("parse: URL %s on page %s: %w", safeURL(ref), safeURL(page), err)
	}
	return out, nil
}

// safeURL quotes u for an error unless it may carry credentials.
func safeURL(u string) string {
	if strings.Contains(u, "@") {
		return "(redacted: contains @)"
	}
	return quoteShort(u)
}
