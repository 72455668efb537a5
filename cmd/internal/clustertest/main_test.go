package clustertest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"

	"go.uber.org/goleak"
)

// The binaries built for this package's tests, by name, in binsDir.
var (
	binsDir  string
	buildMu  sync.Mutex
	built    = map[string]string{}
	buildErr = map[string]error{}
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "idemscrape-clustertest-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "clustertest:", err)
		os.Exit(1)
	}
	binsDir = dir
	code := 0
	func() {
		defer os.RemoveAll(dir)
		code = m.Run()
		// Every test's cleanups (consumers, clients, processes) ran: nothing may be left.
		if code == 0 {
			// go-redis retries a failed dial (a node the test killed) in a goroutine that
			// notices its closed pool only after a one-second sleep.
			if err := goleak.Find(goleak.IgnoreAnyFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).tryDial")); err != nil {
				fmt.Fprintln(os.Stderr, "clustertest: leaked goroutines:", err)
				code = 1
			}
		}
	}()
	os.Exit(code)
}

// binary builds ./cmd/<name> once per test binary and returns its path.
func binary(tb testing.TB, name string) string {
	tb.Helper()
	buildMu.Lock()
	defer buildMu.Unlock()
	if p, ok := built[name]; ok {
		return p
	}
	if err, ok := buildErr[name]; ok {
		tb.Fatalf("go build ./cmd/%s: %v", name, err)
	}
	out := filepath.Join(binsDir, name)
	cmd := exec.Command("go", "build", "-o", out, "github.com/idemscrape/idemscrape/cmd/"+name)
	if b, err := cmd.CombinedOutput(); err != nil {
		buildErr[name] = fmt.Errorf("%w: %s", err, b)
		tb.Fatalf("go build ./cmd/%s: %v", name, buildErr[name])
	}
	built[name] = out
	return out
}
