package parse

import (
	"strconv"
	"strings"
)

// Requirement is one required field as a parser saw it: its name in the record, where it
// was looked for (a CSS selector, a JSON path such as "$.price", …) and its state.
type Requirement struct {
	Field    string
	Selector string
	State    FieldState
}

// Need returns the Requirement that f, found by selector, be present.
func Need[T any](field, selector string, f Field[T]) Requirement {
	return Requirement{Field: field, Selector: selector, State: f.State()}
}

// RequiredError is one required field that is not present.
type RequiredError struct {
	Field    string
	Selector string
	// State is StateMissing or StateEmpty.
	State FieldState
}

// Error returns `required field "price" (selector "span.price") is missing`.
func (e RequiredError) Error() string {
	return "required field " + strconv.Quote(e.Field) + " (selector " + strconv.Quote(e.Selector) + ") is " + e.State.String()
}

// ValidationError lists the required fields that are not present, in the order they were
// required. Handlers map it to the failure category validation.
type ValidationError struct {
	Fields []RequiredError
}

// Error returns "parse: validation: " followed by each field's error, joined by "; ".
func (e *ValidationError) Error() string {
	parts := make([]string, len(e.Fields))
	for i, f := range e.Fields {
		parts[i] = f.Error()
	}
	return "parse: validation: " + strings.Join(parts, "; ")
}

// Unwrap returns each RequiredError, so errors.As(err, &parse.RequiredError{}) works.
func (e *ValidationError) Unwrap() []error {
	out := make([]error, len(e.Fields))
	for i, f := range e.Fields {
		out[i] = f
	}
	return out
}

// Validate returns a *ValidationError naming every requirement whose field is not
// present, or nil. Order follows the arguments.
func Validate(reqs ...Requirement) error {
	var bad []RequiredError
	for _, r := range reqs {
		if r.State != StatePresent {
			bad = append(bad, RequiredError(r))
		}
	}
	if bad == nil {
		return nil
	}
	return &ValidationError{Fields: bad}
}
