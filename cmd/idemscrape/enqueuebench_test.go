package main

import (
	"context"
	"fmt"
	"io"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/idemscrape/idemscrape/testutil"
)

// BenchmarkEnqueueFile20k: `idemscrape enqueue -f` of a file of 20,000 new specs, in
// process, against the test PostgreSQL and Redis (default flags). Each iteration's file has
// keys of its own (its window), so every spec is created. Self-contained (run() and
// testutil only), so that the same file measures an older tree.
func BenchmarkEnqueueFile20k(b *testing.B) {
	const n = 20_000
	pool := testutil.PG(b)
	ns := testutil.Redis(b)
	u, err := url.Parse(testutil.PGAdminDSN())
	if err != nil {
		b.Fatal(err)
	}
	u.Path = "/" + pool.Config().ConnConfig.Database
	for _, kv := range os.Environ() {
		if name, _, _ := strings.Cut(kv, "="); strings.HasPrefix(name, "IDEMSCRAPE_") && !strings.HasPrefix(name, "IDEMSCRAPE_TEST_") {
			b.Setenv(name, "")
			_ = os.Unsetenv(name)
		}
	}
	b.Setenv("IDEMSCRAPE_PG", u.String())
	b.Setenv("IDEMSCRAPE_REDIS", ns.Addr)
	dir := b.TempDir()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		var sb strings.Builder
		for j := range n {
			fmt.Fprintf(&sb, `{"kind":%q,"source_id":"src-%d","country":"US","window":"w%d","parser_version":1}`+"\n", ns.Queue, j, i)
		}
		file := filepath.Join(dir, fmt.Sprintf("specs-%d.jsonl", i))
		if err := os.WriteFile(file, []byte(sb.String()), 0o600); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		if code := run(context.Background(), []string{"enqueue", "-allow-unknown-kind", "-f", file}, nil, io.Discard, io.Discard); code != 0 {
			b.Fatalf("enqueue -f: exit %d", code)
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds(), "specs/s")
}
