package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"

	"github.com/idemscrape/idemscrape/cmd/internal/quote"
	"github.com/idemscrape/idemscrape/scheduler"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/ops"
)

var statsCmd = command{
	name: "stats",
	summary: "Show the six duplicate-work measures (attempts per completed job, jobs completed after lease recovery,\n" +
		"duplicate result writes rejected, outbox events deduplicated downstream, bytes per logical job, failure\n" +
		"categories by retries caused), the reconciler's maintenance counters, and a diagnosis when the duplicate\n" +
		"rate rises; what the proxy traffic cost (per completed job, by kind, window and endpoint, and the waste by\n" +
		"category) where workers have a price (IDEMSCRAPE_PROXY_PRICE); attempts, bytes and cost by provider and tier;\n" +
		"the tables' sizes and what retention deletes next (with the scheduler's -config, or the\n" +
		"default retentions). Computed from PostgreSQL alone.",
	setFlags: func(fs *flag.FlagSet) func(context.Context, *cli, []string) error {
		asJSON := fs.Bool("json", false, "print JSON (snake_case fields) instead of tables")
		config := fs.String("config", env("IDEMSCRAPE_SCHEDULER_CONFIG", ""), "the scheduler's YAML configuration, for its retentions (default: the default retentions; env IDEMSCRAPE_SCHEDULER_CONFIG)")
		return func(ctx context.Context, c *cli, _ []string) error {
			rc, err := reconcilerSettings(*config)
			if err != nil {
				return err
			}
			pool, err := c.db(ctx)
			if err != nil {
				return err
			}
			pg := store.New(pool)
			st, err := pg.StatsGet(ctx)
			if err != nil {
				return err
			}
			sto := storage{JobRetention: rc.JobRetention.String(), QuarantineRetention: rc.QuarantineRetention.String()}
			if sto.Tables, err = pg.TableSizes(ctx); err != nil {
				return err
			}
			if err := countUnanalysed(ctx, pool, sto.Tables); err != nil {
				return err
			}
			if sto.RetentionDue, err = pg.RetentionDue(ctx, rc.JobRetention, rc.QuarantineRetention, rc.WindowRetention); err != nil {
				return err
			}
			costs, err := pg.StatsCost(ctx)
			if err != nil {
				return err
			}
			providers, err := pg.StatsByProvider(ctx)
			if err != nil {
				return err
			}
			if providers == nil {
				providers = []store.ProviderStats{}
			}
			bySession, err := pg.StatsBySession(ctx)
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
					Costs      []store.CostStats     `json:"costs"`
					ByProvider []store.ProviderStats `json:"by_provider"`
					BySession  []store.SessionStats  `json:"by_session"`
					Diagnosis  []string              `json:"diagnosis"`
					Storage    storage               `json:"storage"`
				}{st, costs, providers, bySession, diag, sto})
			}
			if err := writeStats(c.stdout, st, diag); err != nil {
				return err
			}
			if err := writeCosts(c.stdout, costs, providers); err != nil {
				return err
			}
			if err := writeProviders(c.stdout, providers); err != nil {
				return err
			}
			if err := writeSessions(c.stdout, bySession); err != nil {
				return err
			}
			return writeStorage(c.stdout, sto)
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
	return byValue(m, func(n int64) string { return fmt.Sprint(n) })
}

// byValue renders a category map as "a <show(3)>, b <show(1)>", largest first; "-" when
// empty.
func byValue(m map[string]int64, show func(int64) string) string {
	if len(m) == 0 {
		return "-"
	}
	keys := sortedKeys(m)
	sort.SliceStable(keys, func(i, j int) bool { return m[keys[i]] > m[keys[j]] })
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = categoryName(k) + " " + show(m[k])
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

// storage is the storage part of stats: table sizes and what retention deletes next.
type storage struct {
	Tables              []store.TableSize      `json:"tables"`
	JobRetention        string                 `json:"job_retention"`
	QuarantineRetention string                 `json:"quarantine_retention"`
	RetentionDue        store.RetentionPreview `json:"retention_due"`
}

// reconcilerSettings reads the reconciler's settings from the scheduler's configuration
// file, or the defaults without one.
func reconcilerSettings(path string) (scheduler.ReconcilerFile, error) {
	if path == "" {
		f, err := scheduler.ParseFile([]byte("{}"), "", nil)
		if err != nil {
			return scheduler.ReconcilerFile{}, err
		}
		return f.Reconciler, nil
	}
	f, err := scheduler.LoadFile(path)
	if err != nil {
		return scheduler.ReconcilerFile{}, fmt.Errorf("-config %s ($IDEMSCRAPE_SCHEDULER_CONFIG): %w", quote.Input(path), err)
	}
	return f.Reconciler, nil
}

func writeStorage(w io.Writer, s storage) error {
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "TABLE\tROWS (EST.)\tSIZE")
	for _, t := range s.Tables {
		fmt.Fprintf(tw, "%s\t%d\t%s\n", t.Table, t.Rows, humanBytes(t.Bytes))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(w, "\nretention deletes next: %d terminal jobs with all their rows (job_retention %s), %d quarantine rows (quarantine_retention %s), %d schedule windows\n",
		s.RetentionDue.TerminalJobs, retentionText(s.JobRetention), s.RetentionDue.Quarantine, retentionText(s.QuarantineRetention), s.RetentionDue.Windows)
	return nil
}

// humanBytes renders n bytes as B, kB, MB, GB (powers of 1024).
func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	v, suffix := float64(n)/unit, "kB"
	for _, s := range []string{"MB", "GB", "TB"} {
		if v < unit {
			break
		}
		v, suffix = v/unit, s
	}
	return fmt.Sprintf("%.1f %s", v, suffix)
}

// money writes micro-units of currency as an amount, e.g. "0.000021 USD".
func money(micros int64, currency string) string {
	return store.Cost{Micros: micros, Currency: currency}.String()
}

// byAmount renders a cost map as "a 0.000021 USD, b …", largest first.
func byAmount(m map[string]int64, currency string) string {
	return byValue(m, func(n int64) string { return money(n, currency) })
}

// writeCosts prints one table per currency: total, per completed job, useful and wasted,
// and the sums by kind, window and proxy endpoint; then which attempts it counted: the
// charged ones (with a cost), the provider table's CHARGED, out of its ATTEMPTS (ps).
func writeCosts(w io.Writer, costs []store.CostStats, ps []store.ProviderStats) error {
	fmt.Fprintln(w)
	if len(costs) == 0 {
		fmt.Fprintln(w, "cost: none recorded (no worker has a price: IDEMSCRAPE_PROXY_PRICE, e.g. \"8.40 USD/GB\")")
		return nil
	}
	for _, c := range costs {
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintf(tw, "COST (%s)\tVALUE\n", c.Currency)
		fmt.Fprintf(tw, "total\t%s over %d charged attempts\n", money(c.TotalMicros, c.Currency), c.Attempts)
		fmt.Fprintf(tw, "per completed job\t%s (%d jobs, all their attempts)\n", money(c.PerCompletedJobMicros, c.Currency), c.CompletedJobs)
		fmt.Fprintf(tw, "useful\t%s\n", money(c.UsefulMicros, c.Currency))
		fmt.Fprintf(tw, "waste, by category\t%s\n", byAmount(c.Waste, c.Currency))
		fmt.Fprintf(tw, "by kind\t%s\n", byAmount(c.ByKind, c.Currency))
		fmt.Fprintf(tw, "by window\t%s\n", byAmount(c.ByWindow, c.Currency))
		fmt.Fprintf(tw, "by proxy endpoint\t%s\n", byAmount(c.ByProxyEndpoint, c.Currency))
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	var recorded, charged int64
	for _, p := range ps {
		recorded, charged = recorded+p.Attempts, charged+p.Charged
	}
	fmt.Fprintf(w, "charged attempts are those with a cost: %d of the %d recorded (CHARGED and ATTEMPTS by provider below); "+
		"the other %d cost nothing (proxy refusals, attempts lost before their worker reported, workers without a price)\n",
		charged, recorded, recorded-charged)
	return nil
}

// writeProviders prints the attempts by provider and tier: accounts or tiers sharing a
// gateway address apart; all recorded attempts (ATTEMPTS) and those with a cost (CHARGED,
// what the cost section counts). Cost per completed attempt is in whole micro-units.
func writeProviders(w io.Writer, ps []store.ProviderStats) error {
	fmt.Fprintln(w)
	if len(ps) == 0 {
		fmt.Fprintln(w, "by provider: no attempts")
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "PROVIDER\tTIER\tATTEMPTS\tCHARGED\tCOMPLETE\tLOST\tBYTES\tCOST\tPER COMPLETE")
	for _, p := range ps {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%d\t%s\t%s\n", dash(p.Provider), dash(p.Tier), p.Attempts, p.Charged, p.Complete, p.Lost,
			p.Bytes, costList(p.Costs, false), costList(p.Costs, true))
	}
	return tw.Flush()
}

// writeSessions prints the attempts on new and on warm (pooled) sessions: bytes per
// attempt and block rate, what the session pool saves.
func writeSessions(w io.Writer, ss []store.SessionStats) error {
	fmt.Fprintln(w)
	if len(ss) == 0 {
		fmt.Fprintln(w, "by session: no attempts")
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SESSION\tATTEMPTS\tCOMPLETE\tBLOCKED\tBLOCK RATE\tBYTES\tBYTES/ATTEMPT")
	for _, s := range ss {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%.1f %%\t%d\t%d\n", s.Session, s.Attempts, s.Complete, s.Blocked,
			100*s.BlockRate, s.Bytes, s.BytesPerAttempt)
	}
	return tw.Flush()
}

// costList renders a provider's costs (or its costs per completed attempt) as
// "0.000021 USD, 0.000003 EUR"; "-" when none.
func costList(cs []store.ProviderCost, perComplete bool) string {
	if len(cs) == 0 {
		return "-"
	}
	parts := make([]string, len(cs))
	for i, c := range cs {
		n := c.Micros
		if perComplete {
			n = c.PerCompleteMicros
		}
		parts[i] = money(n, c.Currency)
	}
	return strings.Join(parts, ", ")
}
