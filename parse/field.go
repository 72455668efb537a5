package parse

import (
	"bytes"
	"encoding/json"
	"fmt"
)

// FieldState is one of the three states of a Field.
type FieldState uint8

// Field states.
const (
	// StateMissing: the page did not have the field at all (its selector matched nothing). The
	// zero value of every Field.
	StateMissing FieldState = iota
	// StateEmpty: the page had the field and said it is empty (an element with no text, a
	// JSON null).
	StateEmpty
	// StatePresent: the page had the field with a value.
	StatePresent
)

// String returns "missing", "empty" or "present".
func (s FieldState) String() string {
	switch s {
	case StateMissing:
		return "missing"
	case StateEmpty:
		return "empty"
	case StatePresent:
		return "present"
	}
	return fmt.Sprintf("FieldState(%d)", uint8(s))
}

// Field is a value that keeps "missing", "explicitly empty" and "present" apart. The zero
// value is missing.
//
// JSON: declare it with `json:",omitzero"`. Missing is then omitted (IsZero reports it),
// empty is null, present is the value's own JSON (Present("") is "", distinct from null).
// Decoding gives back the same three states: an absent key leaves the field missing, null
// makes it empty, anything else present. Without omitzero a missing field is written as
// null and so comes back empty. Marshalling a present value whose JSON is null (a nil
// slice, map or pointer) fails instead of silently turning into empty.
type Field[T any] struct {
	state FieldState
	value T
}

// Missing returns a missing Field (the zero value).
func Missing[T any]() Field[T] { return Field[T]{} }

// Empty returns an explicitly empty Field.
func Empty[T any]() Field[T] { return Field[T]{state: StateEmpty} }

// Present returns a present Field holding v.
func Present[T any](v T) Field[T] { return Field[T]{state: StatePresent, value: v} }

// State returns the field's state.
func (f Field[T]) State() FieldState { return f.state }

// IsMissing reports whether the page did not have the field.
func (f Field[T]) IsMissing() bool { return f.state == StateMissing }

// IsEmpty reports whether the page had the field and it was empty.
func (f Field[T]) IsEmpty() bool { return f.state == StateEmpty }

// IsPresent reports whether the field holds a value.
func (f Field[T]) IsPresent() bool { return f.state == StatePresent }

// Get returns the value and whether the field is present; the zero T when it is not.
func (f Field[T]) Get() (T, bool) { return f.value, f.state == StatePresent }

// Or returns the value when present, def otherwise.
func (f Field[T]) Or(def T) T {
	if f.state == StatePresent {
		return f.value
	}
	return def
}

// IsZero reports whether the field is missing; it makes `json:",omitzero"` omit it.
func (f Field[T]) IsZero() bool { return f.state == StateMissing }

// String formats the field for logs and test failures: "<missing>", "<empty>" or the value.
func (f Field[T]) String() string {
	switch f.state {
	case StateMissing:
		return "<missing>"
	case StateEmpty:
		return "<empty>"
	}
	return fmt.Sprint(f.value)
}

var jsonNull = []byte("null")

// MarshalJSON writes null for missing and empty (omitzero omits missing before this is
// called) and the value's JSON when present.
func (f Field[T]) MarshalJSON() ([]byte, error) {
	if f.state != StatePresent {
		return jsonNull, nil
	}
	b, err := json.Marshal(f.value)
	if err != nil {
		return nil, err
	}
	if bytes.Equal(b, jsonNull) {
		return nil, fmt.Errorf("parse: a present Field[%T] marshals to null and would read back as empty", f.value)
	}
	return b, nil
}

// UnmarshalJSON reads null as empty and anything else as a present value. A key absent
// from the object never calls it, so the field stays missing.
func (f *Field[T]) UnmarshalJSON(b []byte) error {
	if bytes.Equal(bytes.TrimSpace(b), jsonNull) {
		var zero T
		f.state, f.value = StateEmpty, zero
		return nil
	}
	var v T
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	f.state, f.value = StatePresent, v
	return nil
}
