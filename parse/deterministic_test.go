package parse_test

import (
	"flag"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var update = flag.Bool("update", false, "rewrite testdata/*.golden.json from the current parsers")

// TestParseDeterministic parses each stored sample 100 times sequentially and 100 times
// in parallel and wants byte-identical output every time, equal to the golden file (so a
// change across processes, e.g. from map iteration order, fails too).
func TestParseDeterministic(t *testing.T) {
	ss, err := samples()
	require.NoError(t, err)
	require.NotEmpty(t, ss)
	for _, s := range ss {
		t.Run(s.name, func(t *testing.T) {
			want, err := s.parse()
			require.NoError(t, err)
			golden := filepath.Join("testdata", s.name+".golden.json")
			if *update {
				require.NoError(t, os.WriteFile(golden, append(want, '\n'), 0o644))
			}
			g, err := os.ReadFile(golden)
			require.NoError(t, err, "run go test ./parse/ -run TestParseDeterministic -update")
			require.Equal(t, string(g), string(want)+"\n", "output differs from %s", golden)

			t.Run("Sequential", func(t *testing.T) {
				for i := range 100 {
					got, err := s.parse()
					require.NoError(t, err)
					require.Equal(t, string(want), string(got), "run %d", i)
				}
			})
			t.Run("Parallel", func(t *testing.T) {
				outs := make([][]byte, 100)
				var wg sync.WaitGroup
				for i := range outs {
					wg.Go(func() {
						b, err := s.parse()
						if err != nil {
							b = []byte("error: " + err.Error())
						}
						outs[i] = b
					})
				}
				wg.Wait()
				for i, got := range outs {
					assert.Equal(t, string(want), string(got), "goroutine %d", i)
				}
			})
		})
	}
}
