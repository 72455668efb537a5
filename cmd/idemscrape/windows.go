package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/hibiken/asynq"

	"github.com/idemscrape/idemscrape/cmd/internal/quote"
	"github.com/idemscrape/idemscrape/scheduler"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/ops"
	"github.com/idemscrape/idemscrape/tasks"
)

var windowsCmd = command{
	name: "windows", args: "[TEMPLATE WINDOW]", npos: -1,
	summary: "The scheduler's windows (template × window: due, state, tries, specs enqueued, what its attempts cost against\n" +
		"the kind's money budget per window (-window-budget), last error), newest first.\n" +
		"-gaps lists, from the scheduler's configuration (-config), every due window that was never enqueued and is no\n" +
		"longer being retried (exit 1 when there is one); -fill TEMPLATE WINDOW enqueues one window now: jobs that exist\n" +
		"are found, not enqueued again, so a fill is safe beside running schedulers and safe to repeat. A window whose\n" +
		"jobs may have been pruned (first ticked longer ago than job_retention, or due longer ago than window_retention\n" +
		"without a record) is refused: -force fills it anyway, creating its pruned jobs again as new jobs (fetched,\n" +
		"committed and published again under the same event keys). -config is read and validated whenever it is given.\n" +
		"Every time is printed in UTC (RFC 3339, Z).",
	setFlags: func(fs *flag.FlagSet) func(context.Context, *cli, []string) error {
		config := fs.String("config", env("IDEMSCRAPE_SCHEDULER_CONFIG", ""), "the scheduler's YAML configuration (for -gaps and -fill; read and validated whenever given; env IDEMSCRAPE_SCHEDULER_CONFIG)")
		gaps := fs.Bool("gaps", false, "list the gaps: due windows never enqueued (needs -config)")
		fill := fs.Bool("fill", false, "enqueue the window TEMPLATE WINDOW given as the two arguments (needs -config)")
		force := fs.Bool("force", false, "with -fill: fill a window whose jobs may have been pruned, creating them again as new jobs")
		template := fs.String("template", "", "only this template")
		limit := fs.Int("limit", 100, "at most this many windows (without -gaps)")
		allowLoopback := fs.Bool("allow-loopback", false, "allow loopback source URLs when filling (demos and tests only)")
		asJSON := fs.Bool("json", false, "print JSON")
		budgets, budgetsErr := addBudgetsFlag(fs)
		return func(ctx context.Context, c *cli, pos []string) error {
			if err := budgetsErr(); err != nil {
				return err
			}
			switch {
			case *gaps && *fill:
				return usageError{"-gaps and -fill can not be combined"}
			case *force && !*fill:
				return usageError{"-force only goes with -fill"}
			case *fill && len(pos) != 2:
				return usageError{"-fill needs two arguments: TEMPLATE WINDOW"}
			case !*fill && len(pos) != 0:
				return usageError{fmt.Sprintf("unexpected argument(s) %s (only -fill takes TEMPLATE WINDOW)", quoteAll(pos))}
			case (*gaps || *fill) && *config == "":
				return usageError{"-gaps and -fill need the scheduler's configuration: -config FILE (or IDEMSCRAPE_SCHEDULER_CONFIG)"}
			case *limit < 1:
				return usageError{fmt.Sprintf("-limit %d must be >= 1", *limit)}
			}
			// A configuration given is read and validated before anything else, even when
			// only listing: a mistyped path or a broken file is said, not silently unused.
			var file *scheduler.File
			if *config != "" {
				f, err := scheduler.LoadFile(*config)
				if err != nil {
					return usageError{fmt.Sprintf("-config %s ($IDEMSCRAPE_SCHEDULER_CONFIG): %v", quote.Input(*config), err)}
				}
				file = f
			}
			pool, err := c.db(ctx)
			if err != nil {
				return err
			}
			st := store.New(pool)
			if !*gaps && !*fill {
				ws, err := st.WindowsList(ctx, store.WindowsListParams{Template: *template, Limit: *limit})
				if err != nil {
					return err
				}
				spends, err := windowSpendsOf(ctx, ops.New(pool), ws)
				if err != nil {
					return err
				}
				return printWindows(c, ws, spends, budgets, *asJSON)
			}
			s, closeAll, err := newScheduler(ctx, c, file, *allowLoopback)
			if err != nil {
				return err
			}
			defer closeAll()
			if *fill {
				fillFn := s.Fill
				if *force {
					fillFn = s.ForceFill
				}
				rep, err := fillFn(ctx, pos[0], pos[1])
				if err != nil {
					return err
				}
				if *asJSON {
					return json.NewEncoder(c.stdout).Encode(rep.Outcomes)
				}
				fmt.Fprintf(c.stdout, "filled %s/%s (due %s): %d specs, outcomes %v, %d invalid sources\n",
					rep.Template, rep.Window, utcTime(rep.At), rep.Specs, rep.Outcomes, rep.Invalid)
				return nil
			}
			gs, err := s.Gaps(ctx)
			if err != nil {
				return err
			}
			var out []scheduler.Gap
			for _, g := range gs {
				if *template == "" || g.Template == *template {
					g.Due = g.Due.UTC() // in UTC as every other time (a template's zone would give its offset)
					out = append(out, g)
				}
			}
			if *asJSON {
				if out == nil {
					out = []scheduler.Gap{}
				}
				if err := json.NewEncoder(c.stdout).Encode(out); err != nil {
					return err
				}
			} else {
				tw := tabwriter.NewWriter(c.stdout, 2, 8, 2, ' ', 0)
				fmt.Fprintln(tw, "TEMPLATE\tWINDOW\tDUE\tKIND")
				for _, g := range out {
					fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", g.Template, g.Window, utcTime(g.Due), g.Kind)
				}
				_ = tw.Flush()
				fmt.Fprintf(c.stdout, "%d gap(s); fill one with: idemscrape windows -config %s -fill TEMPLATE WINDOW\n", len(out), *config)
			}
			if len(out) > 0 {
				return exitError{1}
			}
			return nil
		}
	},
}

// utcTime is how `windows` prints a time: RFC 3339 in UTC (2026-04-23T04:00:00Z), whatever
// zone it was computed in (a template's schedule has its own).
func utcTime(t time.Time) string { return t.UTC().Format(time.RFC3339) }

// newScheduler builds a scheduler (never started) for Gaps and Fill.
func newScheduler(ctx context.Context, c *cli, file *scheduler.File, allowLoopback bool) (*scheduler.Scheduler, func(), error) {
	rc, err := redisConfig()
	if err != nil {
		return nil, nil, err
	}
	pool, err := c.db(ctx)
	if err != nil {
		return nil, nil, err
	}
	opt := rc.AsynqConnOpt()
	client := asynq.NewClient(opt)
	insp := asynq.NewInspector(opt)
	rdb := rc.NewClient()
	closeAll := func() {
		_ = insp.Close()
		_ = client.Close()
		_ = rdb.Close()
	}
	dest := tasks.StrictDestinationPolicy()
	if allowLoopback {
		dest = tasks.LoopbackPolicy()
	}
	s, err := scheduler.New(scheduler.Config{File: file, Client: client, Redis: rdb, Store: store.New(pool),
		Inspector: insp, Destinations: dest})
	if err != nil {
		closeAll()
		return nil, nil, err
	}
	return s, closeAll, nil
}

// windowJSON is one window of `windows -json`.
type windowJSON struct {
	Template   string     `json:"template"`
	Window     string     `json:"window"`
	Kind       string     `json:"kind"`
	Due        time.Time  `json:"due"`
	State      string     `json:"state"`
	Tries      int        `json:"tries"`
	Specs      int        `json:"specs"`
	Enqueued   int        `json:"enqueued"`
	EnqueuedAt *time.Time `json:"enqueued_at,omitempty"`
	LastError  string     `json:"last_error,omitempty"`
	// Spent is what the window's recorded attempts cost, per currency; BudgetMicros the
	// kind's money budget per window (-window-budget; absent: unknown here), in Currency;
	// BudgetSpent whether nothing is left of it.
	Spent        []windowSpentJSON `json:"spent"`
	BudgetMicros *int64            `json:"budget_micros,omitempty"`
	Currency     string            `json:"currency,omitempty"`
	BudgetSpent  bool              `json:"budget_spent"`
}

// windowSpentJSON is what a window's attempts cost in one currency.
type windowSpentJSON struct {
	Currency string `json:"currency"`
	Micros   int64  `json:"micros"`
}

func printWindows(c *cli, ws []store.Window, spends map[[2]string]ops.WindowSpend, budgets budgetsFlag, asJSON bool) error {
	if asJSON {
		out := make([]windowJSON, 0, len(ws))
		for _, w := range ws {
			x := windowJSON{Template: w.Template, Window: w.Window, Kind: w.Kind, Due: w.Due.UTC(), State: w.State,
				Tries: w.Tries, Specs: w.Specs, Enqueued: w.Enqueued, LastError: w.LastError,
				Spent: []windowSpentJSON{}}
			if w.EnqueuedAt != nil {
				at := w.EnqueuedAt.UTC()
				x.EnqueuedAt = &at
			}
			spend := spends[[2]string{w.Kind, w.Window}]
			for _, cur := range sortedKeys(spend) {
				x.Spent = append(x.Spent, windowSpentJSON{Currency: cur, Micros: spend[cur]})
			}
			if b, ok := budgets[w.Kind]; ok {
				x.BudgetMicros, x.Currency = &b.Micros, b.Currency
				x.BudgetSpent = ops.WindowBudgetState{Budget: b, Spent: spend.Of(b.Currency)}.Exhausted()
			}
			out = append(out, x)
		}
		return json.NewEncoder(c.stdout).Encode(out)
	}
	tw := tabwriter.NewWriter(c.stdout, 2, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "TEMPLATE\tWINDOW\tDUE\tSTATE\tTRIES\tSPECS\tENQUEUED\tSPENT / BUDGET\tLAST ERROR")
	for _, w := range ws {
		b, ok := budgets[w.Kind]
		money, _ := moneyText(spends[[2]string{w.Kind, w.Window}], b, ok)
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%d\t%d\t%s\t%s\n", w.Template, w.Window, utcTime(w.Due), w.State,
			w.Tries, w.Specs, w.Enqueued, money, w.LastError)
	}
	return tw.Flush()
}
