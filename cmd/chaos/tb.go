package main

import (
	"fmt"
	"os"
	"sync"
	"testing"
)

// runTB is the testing.TB the harness hands to testutil (the fake site, the fake proxy,
// the throwaway redis-server) when it runs as a command rather than inside go test. Only
// the methods testutil calls are implemented; Fatalf panics with a fatalError that run
// recovers, so that cleanups still run and the command exits non-zero.
type runTB struct {
	testing.TB // nil: any method not implemented below panics, which would be a harness bug

	mu       sync.Mutex
	cleanups []func()
	dir      string
	failed   bool
}

// fatalError is what runTB.Fatalf panics with.
type fatalError struct{ msg string }

func (e fatalError) Error() string { return e.msg }

func newRunTB() (*runTB, error) {
	dir, err := os.MkdirTemp("", "idemscrape-chaos-")
	if err != nil {
		return nil, err
	}
	return &runTB{dir: dir}, nil
}

func (t *runTB) Helper()      {}
func (t *runTB) Name() string { return "chaos" }

func (t *runTB) Failed() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.failed
}

func (t *runTB) Cleanup(f func()) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.cleanups = append(t.cleanups, f)
}

func (t *runTB) TempDir() string {
	d, err := os.MkdirTemp(t.dir, "t")
	if err != nil {
		t.Fatalf("chaos: temp dir: %v", err)
	}
	return d
}

func (t *runTB) Logf(format string, args ...any) { fmt.Fprintf(os.Stderr, format+"\n", args...) }
func (t *runTB) Log(args ...any)                 { fmt.Fprintln(os.Stderr, args...) }

func (t *runTB) Errorf(format string, args ...any) {
	t.mu.Lock()
	t.failed = true
	t.mu.Unlock()
	t.Logf(format, args...)
}

func (t *runTB) Fatalf(format string, args ...any) {
	t.mu.Lock()
	t.failed = true
	t.mu.Unlock()
	panic(fatalError{fmt.Sprintf(format, args...)})
}

func (t *runTB) Fatal(args ...any) { t.Fatalf("%s", fmt.Sprint(args...)) }

// close runs the cleanups, last registered first, and removes the temporary directory.
func (t *runTB) close() {
	t.mu.Lock()
	cs := t.cleanups
	t.cleanups = nil
	t.mu.Unlock()
	for i := len(cs) - 1; i >= 0; i-- {
		cs[i]()
	}
	_ = os.RemoveAll(t.dir)
}
