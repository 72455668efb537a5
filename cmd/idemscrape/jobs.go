package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/idemscrape/idemscrape/cmd/internal/quote"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/ops"
)

// envWindowBudgets gives the kinds' window money budgets to the commands that show them
// (status, jobs, windows), as the repeatable -window-budget flag does.
const envWindowBudgets = "IDEMSCRAPE_WINDOW_BUDGETS"

// budgetsFlag is -window-budget KIND=AMOUNT, repeatable: the kinds' money budgets per
// collection window, as the workers are configured (handlers.WithWindowBudget, the worker's
// -window-budget). PostgreSQL records what attempts cost, not the budgets.
type budgetsFlag map[string]store.Cost

func (b budgetsFlag) String() string {
	parts := make([]string, 0, len(b))
	for _, k := range sortedKeys(b) {
		parts = append(parts, k+"="+b[k].String())
	}
	return strings.Join(parts, ",")
}

// Set reads one KIND=AMOUNT ("catalog=25.50 USD"), or several separated by commas.
func (b budgetsFlag) Set(v string) error {
	for _, one := range strings.Split(v, ",") {
		if strings.TrimSpace(one) == "" {
			continue
		}
		kind, amount, ok := strings.Cut(one, "=")
		kind = strings.TrimSpace(kind)
		if !ok || kind == "" {
			return fmt.Errorf("%s is not KIND=AMOUNT (e.g. catalog=25.50 USD)", quote.Input(one))
		}
		micros, cur, err := sessions.ParseAmount(amount)
		if err != nil {
			return fmt.Errorf("kind %s: %w", quote.Input(kind), err)
		}
		if micros <= 0 {
			return fmt.Errorf("kind %s: budget %s must be above 0", quote.Input(kind), quote.Input(strings.TrimSpace(amount)))
		}
		b[kind] = store.Cost{Micros: micros, Currency: cur}
	}
	return nil
}

// addBudgetsFlag defines -window-budget on fs, filled from $IDEMSCRAPE_WINDOW_BUDGETS
// first; the returned func reports a bad variable (a usage error naming it).
func addBudgetsFlag(fs *flag.FlagSet) (budgetsFlag, func() error) {
	b := budgetsFlag{}
	envErr := func() error { return nil }
	if v := os.Getenv(envWindowBudgets); v != "" {
		if err := b.Set(v); err != nil {
			envErr = func() error { return usageError{fmt.Sprintf("$%s: %v", envWindowBudgets, err)} }
		}
	}
	fs.Var(b, "window-budget", "a kind's money budget per collection window, KIND=AMOUNT (e.g. \"catalog=25.50 USD\"), as the workers\n"+
		"are configured (repeatable; env "+envWindowBudgets+", comma-separated): shows spend against budget and finds deferred jobs")
	return b, envErr
}

// selectorFlags are the job selectors `jobs` and `requeue` share with /jobs. windowSet
// tells -window "" (the jobs without a window) from no -window (any window).
type selectorFlags struct {
	kind, state, category, window, prefix, since *string
	windowSet                                    *bool
}

// givenString is a string flag that remembers whether it was given, even as "".
type givenString struct {
	v   string
	set bool
}

func (g *givenString) String() string {
	if g == nil {
		return ""
	}
	return g.v
}

func (g *givenString) Set(v string) error { g.v, g.set = v, true; return nil }

func addSelectorFlags(fs *flag.FlagSet, stateHelp string) selectorFlags {
	window := &givenString{}
	fs.Var(window, "window", "only jobs of this collection window, a `string` (-window \"\": only jobs without one)")
	return selectorFlags{
		kind:      fs.String("kind", "", "only jobs of this kind"),
		state:     fs.String("state", "", stateHelp),
		category:  fs.String("category", "", "only jobs whose last failure has this category (e.g. budget_exceeded, parse_error)"),
		window:    &window.v,
		windowSet: &window.set,
		prefix:    fs.String("prefix", "", "only jobs whose key starts with this (literally)"),
		since:     fs.String("since", "", "only jobs updated at or after this: an RFC 3339 time, or a duration back from now (36h)"),
	}
}

// selector reads the flags into an ops.Selector, a mistake as a usage error naming the
// flag.
func (f selectorFlags) selector(now time.Time) (ops.Selector, error) {
	for _, x := range []struct{ name, v string }{
		{"-kind", *f.kind}, {"-state", *f.state}, {"-category", *f.category}, {"-window", *f.window},
		{"-prefix", *f.prefix}, {"-since", *f.since},
	} {
		if err := checkText(x.name, x.v); err != nil {
			return ops.Selector{}, usageError{err.Error()}
		}
	}
	states, err := ops.ParseStates(*f.state)
	if err != nil {
		return ops.Selector{}, usageError{"-state: " + err.Error()}
	}
	since, err := ops.ParseSince(*f.since, now)
	if err != nil {
		return ops.Selector{}, usageError{"-since: " + err.Error()}
	}
	return ops.Selector{Kind: *f.kind, States: states, Category: *f.category, Window: *f.window,
		WindowGiven: *f.windowSet, KeyPrefix: *f.prefix, Since: since}, nil
}

// describe names the selectors set, for messages ("-kind catalog -window 2026-04-23";
// -window "" when given so).
func (f selectorFlags) describe(extra ...string) string {
	var parts []string
	for _, x := range []struct {
		name, v string
		given   bool
	}{
		{"-window", *f.window, *f.windowSet}, {"-kind", *f.kind, false}, {"-state", *f.state, false},
		{"-category", *f.category, false}, {"-prefix", *f.prefix, false}, {"-since", *f.since, false},
	} {
		if x.v != "" || x.given {
			parts = append(parts, x.name+" "+quote.Input(x.v))
		}
	}
	return strings.Join(append(parts, extra...), " ")
}

var jobsCmd = command{
	name: "jobs", npos: 0,
	summary: "List jobs (key, kind, state, attempts, last category, updated, next attempt), most recently updated first,\n" +
		"with the filters of the worker's /jobs page: failed and retryable by default. -deferred lists the runnable jobs\n" +
		"of windows whose money budget is spent (needs the budgets: -window-budget or $" + envWindowBudgets + ").",
	setFlags: func(fs *flag.FlagSet) func(context.Context, *cli, []string) error {
		sf := addSelectorFlags(fs, "only jobs in these states, comma-separated, or any (default failed,retryable; with -deferred pending,retryable)")
		deferred := fs.Bool("deferred", false, "only jobs of windows whose money budget is spent (deferred, or failed with -state failed)")
		budgets, budgetsErr := addBudgetsFlag(fs)
		limit := fs.Int("limit", 100, "at most this many jobs")
		asJSON := fs.Bool("json", false, "print a JSON array (snake_case fields)")
		return func(ctx context.Context, c *cli, _ []string) error {
			if err := budgetsErr(); err != nil {
				return err
			}
			if *limit < 1 {
				return usageError{fmt.Sprintf("-limit %d must be >= 1", *limit)}
			}
			sel, err := sf.selector(time.Now())
			if err != nil {
				return err
			}
			sel.Deferred, sel.Budgets = *deferred, budgets
			if err := sel.Validate(); err != nil {
				if *deferred && len(budgets) == 0 {
					return usageError{"-deferred: " + err.Error() + ": give -window-budget KIND=AMOUNT (or $" + envWindowBudgets + ")"}
				}
				return usageError{err.Error()}
			}
			pool, err := c.db(ctx)
			if err != nil {
				return err
			}
			db := ops.New(pool)
			jobs, err := db.JobSelect(ctx, sel, *limit)
			if err != nil {
				return err
			}
			if *asJSON {
				if jobs == nil {
					jobs = []ops.ProblemJob{}
				}
				return json.NewEncoder(c.stdout).Encode(jobs)
			}
			total := int64(len(jobs))
			if len(jobs) == *limit {
				if total, err = db.JobSelectCount(ctx, sel); err != nil {
					return err
				}
			}
			if err := writeTable(c.stdout, "KEY\tKIND\tSTATE\tATTEMPTS\tCATEGORY\tUPDATED\tNEXT ATTEMPT", func(tw io.Writer) {
				for _, j := range jobs {
					fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%s\n", j.Key, j.Kind, j.State, j.Attempts, dash(j.Category),
						fmtTime(j.UpdatedAt), fmtTimePtr(j.NextAttemptAt))
				}
			}); err != nil {
				return err
			}
			fmt.Fprintf(c.stdout, "%d of %d matching job(s)\n", len(jobs), total)
			return nil
		}
	},
}

// windowSpendsOf reads what each window's attempts cost, for `windows` and `status`.
func windowSpendsOf(ctx context.Context, db *ops.Store, ws []store.Window) (map[[2]string]ops.WindowSpend, error) {
	kinds, names := make([]string, len(ws)), make([]string, len(ws))
	for i, w := range ws {
		kinds[i], names[i] = w.Kind, w.Window
	}
	return db.WindowSpends(ctx, kinds, names)
}

// moneyText is a window's spend against the kind's budget: "1.200000 USD of 25.500000 USD"
// ("spent" appended when nothing is left), the spend alone without a budget, "-" when
// nothing was spent and no budget is known.
func moneyText(spend ops.WindowSpend, budget store.Cost, hasBudget bool) (string, bool) {
	var parts []string
	exhausted := false
	if hasBudget {
		st := ops.WindowBudgetState{Budget: budget, Spent: spend.Of(budget.Currency)}
		exhausted = st.Exhausted()
		parts = append(parts, st.Spent.String()+" of "+budget.String())
	}
	curs := make([]string, 0, len(spend))
	for cur := range spend {
		if !hasBudget || cur != budget.Currency {
			curs = append(curs, cur)
		}
	}
	sort.Strings(curs)
	for _, cur := range curs {
		parts = append(parts, spend.Of(cur).String())
	}
	if len(parts) == 0 {
		return "-", false
	}
	s := strings.Join(parts, " + ")
	if exhausted {
		s += " (spent)"
	}
	return s, exhausted
}

// windowMoneyJSON is `status -json`'s window_money: the job's window against its kind's
// money budget.
type windowMoneyJSON struct {
	SpentMicros  int64  `json:"spent_micros"`  // what the window's recorded attempts cost, in Currency
	BudgetMicros int64  `json:"budget_micros"` // the kind's budget per window (-window-budget)
	Currency     string `json:"currency"`
	BudgetSpent  bool   `json:"budget_spent"` // nothing is left: no new attempt of the window starts
	Text         string `json:"text"`         // as the table shows it
}

// windowMoney is the status line of the job's window against its kind's money budget
// (budgets): "deferred: window budget spent (x of y)" for a runnable job of a spent window,
// "x of y spent" otherwise; "" (and nil) when the kind's budget is not known here.
func windowMoney(ctx context.Context, db *ops.Store, job store.Job, budgets budgetsFlag) (string, *windowMoneyJSON, error) {
	budget, ok := budgets[job.Kind]
	if !ok {
		return "", nil, nil
	}
	spends, err := db.WindowSpends(ctx, []string{job.Kind}, []string{job.Window})
	if err != nil {
		return "", nil, err
	}
	spend := spends[[2]string{job.Kind, job.Window}]
	ws := ops.WindowBudgetState{Budget: budget, Spent: spend.Of(budget.Currency)}
	text := ws.Deferral(job.State, job.LastCategory)
	if text == "" {
		text = fmt.Sprintf("%s of %s spent", ws.Spent, budget)
		if ws.Exhausted() {
			text += ": nothing left, no new attempt of the window starts"
		}
	}
	return text, &windowMoneyJSON{SpentMicros: ws.Spent.Micros, BudgetMicros: budget.Micros, Currency: budget.Currency,
		BudgetSpent: ws.Exhausted(), Text: text}, nil
}
