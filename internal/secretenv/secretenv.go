// Package secretenv reads secrets from the environment the way container platforms hand
// them over: the value itself in NAME, or a file holding it named by NAME_FILE (Docker and
// Kubernetes secrets are mounted as files). Errors name the variables and the file, never
// the value.
package secretenv

import (
	"errors"
	"fmt"
	"os"
	"strings"
)

// FileSuffix is what a variable's name ends with when it names a file holding the secret.
const FileSuffix = "_FILE"

// MaxSize bounds a secret file: a password or token, not a document.
const MaxSize = 64 << 10

// Lookup returns the secret of the variable name: $name, or the contents of the file
// $name_FILE names (one trailing newline removed, as editors and `echo` add one). set is
// false when neither is set. Both set, an unreadable, empty or oversized file are errors.
func Lookup(name string) (value string, set bool, err error) {
	v, hasValue := os.LookupEnv(name)
	path, hasFile := os.LookupEnv(name + FileSuffix)
	if hasValue && v == "" {
		hasValue = false
	}
	if hasFile && path == "" {
		hasFile = false
	}
	switch {
	case hasValue && hasFile:
		return "", false, fmt.Errorf("$%s and $%s%s are both set: give the secret one way", name, name, FileSuffix)
	case hasFile:
		s, err := ReadFile(path)
		if err != nil {
			return "", false, fmt.Errorf("$%s%s: %w", name, FileSuffix, err)
		}
		return s, true, nil
	case hasValue:
		return v, true, nil
	}
	return "", false, nil
}

// ReadFile reads a secret file: its contents without one trailing newline ("\n" or
// "\r\n"). An empty file, a file over MaxSize or one that is not a regular file is an
// error naming the path.
func ReadFile(path string) (string, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return "", fmt.Errorf("secret file %s: %w", path, unwrapPath(err))
	}
	if !fi.Mode().IsRegular() {
		return "", fmt.Errorf("secret file %s is not a regular file", path)
	}
	if fi.Size() > MaxSize {
		return "", fmt.Errorf("secret file %s holds %d bytes (more than %d: not a secret?)", path, fi.Size(), MaxSize)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("secret file %s: %w", path, unwrapPath(err))
	}
	s := strings.TrimSuffix(strings.TrimSuffix(string(b), "\n"), "\r")
	if s == "" {
		return "", fmt.Errorf("secret file %s is empty", path)
	}
	return s, nil
}

// unwrapPath drops the *PathError's own copy of the path (the message names it already).
func unwrapPath(err error) error {
	var pe *os.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}
