package job_test

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestLeafDeps: the job vocabulary and the parsing helpers build without the queue, Redis,
// tracing or a browser, so that naming a job or testing a parser costs none of them.
func TestLeafDeps(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "github.com/idemscrape/idemscrape/job", "github.com/idemscrape/idemscrape/parse").CombinedOutput()
	require.NoError(t, err, "%s", out)
	for _, dep := range strings.Fields(string(out)) {
		for _, banned := range []string{"github.com/hibiken/asynq", "github.com/redis/go-redis", "go.opentelemetry.io/", "github.com/chromedp/"} {
			require.Falsef(t, strings.HasPrefix(dep, banned), "job or parse depends on %s", dep)
		}
	}
}
