package sessions_test

import (
	"context"
	"fmt"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/testutil"
)

// TestResumeBytesFigures measures, at the wire (the proxy's own count of what it exchanged
// with its client), what catalog units cost with 10 % of requests cut, against the same
// units uncut: with every cut losing the exit and with half of them exit-alive, each with
// resumes and without (the replay rule alone). The cuts are drawn per URL (CutDrawsByURL),
// so every configuration meets the same cuts where it sends the same requests. It prints figures and asserts nothing; set
// IDEMSCRAPE_RESUME_FIGURES=1 to run it.
func TestResumeBytesFigures(t *testing.T) {
	if os.Getenv("IDEMSCRAPE_RESUME_FIGURES") == "" {
		t.Skip("figures only: IDEMSCRAPE_RESUME_FIGURES=1")
	}
	const units = 1000
	measure := func(t *testing.T, disc, alive float64, maxResumes int) (wire int64, restarts, resumes int) {
		e := setup(t, testutil.FakeProxyConfig{Seed: 41, DisconnectProb: disc, CutExitAlive: alive, CutDrawsByURL: true}, testutil.FakeSiteConfig{Seed: 41, StrictExit: true, Products: units})
		var err error
		e.provider, err = e.provider.WithExitHeader("X-Exit")
		require.NoError(t, err)
		cfg := e.runCfg()
		cfg.MaxResumes = maxResumes
		cfg.MaxSessionRestarts = 50
		cfg.Collector.IgnoreRobotsTxt = true
		for i := 1; i <= units; i++ {
			u, err := catalog.Unit(e.site.URL, fmt.Sprintf("sku-%d", i))
			require.NoError(t, err)
			res, err := u.Run(context.Background(), cfg)
			require.NoError(t, err)
			restarts += res.Restarts
			resumes += res.Resumes
		}
		from, to := e.proxy.ClientBytes()
		return from + to, restarts, resumes
	}
	base, _, _ := measure(t, 0, 0, 0)
	for _, c := range []struct {
		alive float64
		max   int
	}{{0, -1}, {0, 0}, {0.5, -1}, {0.5, 0}, {1, 0}} {
		w, rs, rm := measure(t, 0.10, c.alive, c.max)
		t.Logf("exit-alive %.1f, max resumes %2d: %.3fx the uncut bytes (%d vs %d B), %d restarts, %d resumes", c.alive, c.max, float64(w)/float64(base), w, base, rs, rm)
	}
}
