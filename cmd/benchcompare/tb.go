package main

import (
	"fmt"
	"os"
	"sync"
	"testing"
)

// toolTB lets the testutil fakes (FakeSite, FakeProxy), which take a testing.TB, run in
// this binary. It implements only what they call (Helper, Cleanup, Fatalf and friends);
// any other testing.TB method panics on the nil embedded interface, which a change in
// testutil would show at once.
type toolTB struct {
	testing.TB // nil: unimplemented methods panic

	mu       sync.Mutex
	cleanups []func()
}

// fatalError is what Fatal* panics with; main recovers it after running the cleanups.
type fatalError struct{ msg string }

func (t *toolTB) Helper()                           {}
func (t *toolTB) Name() string                      { return "benchcompare" }
func (t *toolTB) Logf(format string, args ...any)   { fmt.Fprintf(os.Stderr, format+"\n", args...) }
func (t *toolTB) Log(args ...any)                   { fmt.Fprintln(os.Stderr, args...) }
func (t *toolTB) Errorf(format string, args ...any) { t.Logf(format, args...) }
func (t *toolTB) Fatalf(format string, args ...any) { panic(fatalError{fmt.Sprintf(format, args...)}) }
func (t *toolTB) Fatal(args ...any)                 { panic(fatalError{fmt.Sprint(args...)}) }
func (t *toolTB) Cleanup(f func())                  { t.mu.Lock(); t.cleanups = append(t.cleanups, f); t.mu.Unlock() }
func (t *toolTB) Skipf(format string, args ...any)  { t.Fatalf("skip: "+format, args...) }
func (t *toolTB) Setenv(key, value string)          { _ = os.Setenv(key, value) }
func (t *toolTB) Failed() bool                      { return false }
func (t *toolTB) Error(args ...any)                 { t.Log(args...) }
func (t *toolTB) Skip(args ...any)                  { t.Fatal(args...) }
func (t *toolTB) SkipNow()                          { t.Fatal("skip") }
func (t *toolTB) FailNow()                          { t.Fatal("FailNow") }
func (t *toolTB) Fail()                             {}
func (t *toolTB) Skipped() bool                     { return false }
func (t *toolTB) TempDir() string {
	d, _ := os.MkdirTemp("", "benchcompare")
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}
func (t *toolTB) runCleanups() {
	t.mu.Lock()
	fs := t.cleanups
	t.cleanups = nil
	t.mu.Unlock()
	for i := len(fs) - 1; i >= 0; i-- {
		fs[i]()
	}
}
