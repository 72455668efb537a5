package main

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if a goroutine they started outlives them, and
// removes the binaries built for them (builtBinaries).
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.Cleanup(func(int) {
		if binsDir != "" {
			_ = os.RemoveAll(binsDir)
		}
	}))
}
