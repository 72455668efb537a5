package testutil

import (
	"fmt"
	"os"
	"testing"
)

// ProcessTB lets a program (cmd/demo, cmd/fakes) use the fakes outside a test: it keeps
// their cleanups for Cleanup to run when the program ends, and turns their failures into
// messages on stderr (Fatalf: after running the cleanups, exit status 1). The fakes call
// Fatalf only while they start (an invalid configuration).
type ProcessTB struct {
	testing.TB
	name     string
	cleanups []func()
}

// NewProcessTB returns a ProcessTB whose messages start with name.
func NewProcessTB(name string) *ProcessTB { return &ProcessTB{name: name} }

func (p *ProcessTB) Helper()          {}
func (p *ProcessTB) Cleanup(f func()) { p.cleanups = append(p.cleanups, f) }
func (p *ProcessTB) Errorf(f string, a ...any) {
	fmt.Fprintf(os.Stderr, p.name+": "+f+"\n", a...)
}
func (p *ProcessTB) Fatalf(f string, a ...any) {
	fmt.Fprintf(os.Stderr, p.name+": "+f+"\n", a...)
	p.RunCleanups()
	os.Exit(1)
}

// TempDir is a new temporary directory, removed by RunCleanups.
func (p *ProcessTB) TempDir() string {
	d, err := os.MkdirTemp("", p.name+"-")
	if err != nil {
		p.Fatalf("temporary directory: %v", err)
	}
	p.Cleanup(func() { _ = os.RemoveAll(d) })
	return d
}

// RunCleanups runs the cleanups registered so far, last first.
func (p *ProcessTB) RunCleanups() {
	for i := len(p.cleanups) - 1; i >= 0; i-- {
		p.cleanups[i]()
	}
	p.cleanups = nil
}
