package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"

	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/ops"
)

var statsCmd = command{
	name: "stats", db: true,
	summary: "Show the six duplicate-work measures (attempts per completed job, jobs completed after lease recovery,\n" +
		"duplicate result writes rejected, outbox events deduplicated downstream, bytes per logical job, failure\n" +
		"categories by retries caused), the reconciler's maintenance counters, and a diagnosis when the duplicate\n" +
		"rate rises. Computed from PostgreSQL alone.",
	setFlags: func(fs *flag.FlagSet) func(context.Context, *cli, []string) error {
		asJSON := fs.Bool("json", false, "print JSON (snake_case fields) instead of tables")
		return func(ctx context.Context, c *cli, _ []string) error {
			st, err := store.New(c.pool).StatsGet(ctx)
			if err != nil {
				return err
			}
			diag := ops.Diagnose(st)
			if *asJSON {
				if diag == nil {
					diag = []string{}
				}
				return writeJSON(c.stdout, struct {
					store.Stats
					Diagnosis []string `json:"diagnosis"`
				}{st, diag})
			}
			return writeStats(c.stdout, st, diag)
		}
	},
}

// categoryName shows StatsNoCategory readably.
func categoryName(c string) string {
	if c == store.StatsNoCategory {
		return "(none)"
	}
	return c
}

// byCount renders a category map as "a 3, b 1", largest first.
func byCount(m map[string]int64) string {
	if len(m) == 0 {
		return "-"
	}
	keys := sortedKeys(m)
	sort.SliceStable(keys, func(i, j int) bool { return m[keys[i]] > m[keys[j]] })
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s %d", categoryName(k), m[k])
	}
	return strings.Join(parts, ", ")
}

func writeStats(w io.Writer, st store.Stats, diag []string) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "MEASURE\tVALUE")
	fmt.Fprintf(tw, "attempts per completed job\t%.2f\n", st.AttemptsPerCompletedJob)
	fmt.Fprintf(tw, "jobs completed after lease recovery\t%d\n", st.CompletedAfterTakeover)
	fmt.Fprintf(tw, "duplicate result writes rejected\t%d\n", st.DuplicateResultsRejected)
	fmt.Fprintf(tw, "outbox events deduplicated downstream\t%d\n", st.OutboxReplaysDeduplicated)
	fmt.Fprintf(tw, "bytes per logical job\t%.0f\n", st.BytesPerLogicalJob)
	fmt.Fprintf(tw, "retries caused, by failure category\t%s\n", byCount(st.RetriesCausedByCategory))
	if err := tw.Flush(); err != nil {
		return err
	}

	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "CONTEXT\tVALUE")
	fmt.Fprintf(tw, "jobs by state\t%s\n", byCount(st.JobsByState))
	fmt.Fprintf(tw, "attempts\t%d (superseded %d, lease_expired %d)\n", st.Attempts, st.SupersededAttempts, st.LeaseExpiredAttempts)
	fmt.Fprintf(tw, "failed jobs, by category\t%s\n", byCount(st.FailuresByCategory))
	fmt.Fprintf(tw, "outbox events\tsent %d, unsent %d\n", st.OutboxSent, st.OutboxUnsent)
	fmt.Fprintf(tw, "quarantined stagings\t%d\n", st.Quarantined)
	if err := tw.Flush(); err != nil {
		return err
	}

	fmt.Fprintln(w)
	if len(st.Maintenance) == 0 {
		fmt.Fprintln(w, "maintenance: none recorded")
	} else {
		tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "MAINTENANCE\tCOUNT")
		for _, k := range sortedKeys(st.Maintenance) {
			fmt.Fprintf(tw, "%s\t%d\n", k, st.Maintenance[k])
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}

	fmt.Fprintln(w)
	if len(diag) == 0 {
		fmt.Fprintln(w, "diagnosis: no duplicate work to explain")
	}
	for _, d := range diag {
		fmt.Fprintln(w, "diagnosis: "+d)
	}
	return nil
}
