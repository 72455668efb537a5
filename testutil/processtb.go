package testutil

import (
	"fmt"
	"os"
	"sync"
	"testing"
)

// ProcessTB is a testing.TB for commands (cmd/chaos, cmd/benchcompare) that run the fakes
// and throwaway servers of this package outside `go test`. Logs go to stderr; Cleanup
// functions run, last registered first, when Close is called; Fatal* (and Skip*, which a
// command can not honour) panic with a FatalError that the command recovers (RecoverFatal,
// deferred after Close, so it runs first); Close then runs the cleanups, so that every
// throwaway server is still stopped and the command exits non-zero.
//
// testing.TB has an unexported method, so the interface must be embedded; it is left nil,
// and every method this package's helpers call is implemented below (a new call in
// testutil that is not would panic at once, in every command's own test).
type ProcessTB struct {
	testing.TB // nil; see the type's doc

	name     string
	dir      string
	mu       sync.Mutex
	cleanups []func()
	failed   bool
}

// FatalError is what ProcessTB's Fatal and Skip methods panic with.
type FatalError struct{ Msg string }

func (e FatalError) Error() string { return e.Msg }

// NewProcessTB returns a ProcessTB named name with its own temporary directory (removed by
// Close).
func NewProcessTB(name string) (*ProcessTB, error) {
	dir, err := os.MkdirTemp("", "idemscrape-"+name+"-")
	if err != nil {
		return nil, err
	}
	return &ProcessTB{name: name, dir: dir}, nil
}

// Close runs the cleanups, last registered first, and removes the temporary directory.
func (t *ProcessTB) Close() {
	t.mu.Lock()
	cs := t.cleanups
	t.cleanups = nil
	t.mu.Unlock()
	for i := len(cs) - 1; i >= 0; i-- {
		cs[i]()
	}
	_ = os.RemoveAll(t.dir)
}

func (t *ProcessTB) Helper()      {}
func (t *ProcessTB) Name() string { return t.name }

func (t *ProcessTB) Cleanup(f func()) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.cleanups = append(t.cleanups, f)
}

func (t *ProcessTB) TempDir() string {
	d, err := os.MkdirTemp(t.dir, "t")
	if err != nil {
		t.Fatalf("%s: temp dir: %v", t.name, err)
	}
	return d
}

func (t *ProcessTB) Setenv(key, value string) { _ = os.Setenv(key, value) }

func (t *ProcessTB) Logf(format string, args ...any) { fmt.Fprintf(os.Stderr, format+"\n", args...) }
func (t *ProcessTB) Log(args ...any)                 { fmt.Fprintln(os.Stderr, args...) }

func (t *ProcessTB) Fail() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.failed = true
}

func (t *ProcessTB) Failed() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.failed
}

func (t *ProcessTB) Errorf(format string, args ...any) { t.Fail(); t.Logf(format, args...) }
func (t *ProcessTB) Error(args ...any)                 { t.Fail(); t.Log(args...) }

func (t *ProcessTB) Fatalf(format string, args ...any) {
	t.Fail()
	panic(FatalError{fmt.Sprintf(format, args...)})
}
func (t *ProcessTB) Fatal(args ...any) { t.Fatalf("%s", fmt.Sprint(args...)) }
func (t *ProcessTB) FailNow()          { t.Fatalf("FailNow") }

// A command has nothing to skip to: a skip is a failure that says so.
func (t *ProcessTB) Skipf(format string, args ...any) { t.Fatalf("skip: "+format, args...) }
func (t *ProcessTB) Skip(args ...any)                 { t.Fatalf("skip: %s", fmt.Sprint(args...)) }
func (t *ProcessTB) SkipNow()                         { t.Fatalf("skip") }
func (t *ProcessTB) Skipped() bool                    { return false }

// RecoverFatal, deferred by a command after NewProcessTB, turns a ProcessTB failure
// (the FatalError panic of Fatal or Skip) into *err, "setup: <message>"; any other panic
// goes on. Defer it after Close: deferred calls run last first, so it recovers the panic,
// then Close runs the cleanups:
//
//	defer tb.Close()
//	defer testutil.RecoverFatal(&err)
func RecoverFatal(err *error) {
	r := recover()
	if r == nil {
		return
	}
	fe, ok := r.(FatalError)
	if !ok {
		panic(r)
	}
	*err = fmt.Errorf("setup: %s", fe.Msg)
}
