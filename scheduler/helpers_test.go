package scheduler_test

import (
	"os"
	"strings"
	"syscall"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/scheduler"
)

func writeFile(path, content string) error { return os.WriteFile(path, []byte(content), 0o600) }

func removeFile(path string) error { return os.Remove(path) }

func metricOf(t *testing.T, r *scheduler.Reconciler, action string) prometheus.Collector {
	t.Helper()
	mfs, err := r.Gatherer().Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != "idemscrape_reconciler_actions_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "action" && l.GetValue() == strings.TrimPrefix(action, "reconciler_") {
					return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "x"}, func() float64 { return m.GetCounter().GetValue() })
				}
			}
		}
	}
	t.Fatalf("no metric for action %s", action)
	return nil
}

var syscallKill = syscall.SIGKILL
