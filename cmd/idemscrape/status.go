package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/idemscrape/idemscrape/cmd/internal/quote"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/ops"
)

var statusCmd = command{
	name: "status", args: "KEY", npos: 1,
	summary: "Show a job: its row, the timeline of its attempts (worker, session, redacted proxy endpoint, outcome,\n" +
		"category, HTTP status, bytes, error), its result, its outbox event and the operators' notes.",
	setFlags: func(fs *flag.FlagSet) func(context.Context, *cli, []string) error {
		asJSON := fs.Bool("json", false, "print JSON (snake_case fields) instead of tables")
		budgets, budgetsErr := addBudgetsFlag(fs) // the window's money against its budget (jobs.go)
		return func(ctx context.Context, c *cli, pos []string) error {
			if err := budgetsErr(); err != nil {
				return err
			}
			key := pos[0]
			pool, err := c.db(ctx)
			if err != nil {
				return err
			}
			st, err := ops.New(pool).JobStatus(ctx, key, handlers.EventKey(key))
			if errors.Is(err, store.ErrJobNotFound) {
				return fmt.Errorf("no job with key %s", quote.Input(key))
			}
			if err != nil {
				return err
			}
			money, moneyJSON, err := windowMoney(ctx, ops.New(pool), st.Job, budgets)
			if err != nil {
				return err
			}
			if *asJSON {
				out := statusJSONOf(st)
				out.WindowMoney = moneyJSON
				return writeJSON(c.stdout, out)
			}
			return writeStatus(c.stdout, st, money)
		}
	},
}

const timeFormat = "2006-01-02T15:04:05.000Z"

func fmtTime(t time.Time) string { return t.UTC().Format(timeFormat) }

func fmtTimePtr(t *time.Time) string {
	if t == nil {
		return "-"
	}
	return fmtTime(*t)
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func duration(a store.Attempt) string {
	if a.FinishedAt == nil {
		return "running"
	}
	return a.FinishedAt.Sub(a.StartedAt).Round(time.Millisecond).String()
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// writeStatus writes the job's status; money is its window's money line ("": none).
func writeStatus(w io.Writer, st ops.Status, money string) error {
	j := st.Job
	source := "url " + j.URL
	if j.URL == "" {
		source = "source_id " + j.SourceID
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "job\t%s\n", j.Key)
	fmt.Fprintf(tw, "state\t%s\n", j.State)
	fmt.Fprintf(tw, "kind\t%s\n", j.Kind)
	fmt.Fprintf(tw, "source\t%s\n", source)
	fmt.Fprintf(tw, "country / window / parser\t%s / %s / v%d\n", j.Country, j.Window, j.ParserVersion)
	fmt.Fprintf(tw, "scope\t%s\n", dash(j.Scope))
	fmt.Fprintf(tw, "attempts / fence\t%d / %d\n", j.Attempts, j.Fence)
	fmt.Fprintf(tw, "last category\t%s\n", dash(j.LastCategory))
	fmt.Fprintf(tw, "next attempt\t%s\n", fmtTimePtr(j.NextAttemptAt))
	fmt.Fprintf(tw, "bytes, all attempts\t%d\n", j.BytesTotal)
	if money != "" {
		fmt.Fprintf(tw, "window money\t%s\n", money)
	}
	if b := st.Budget; b.Since != nil {
		fmt.Fprintf(tw, "retry budget\tfresh since %s: counts attempts after #%d, bytes after %d\n", fmtTime(*b.Since), b.Attempts, b.Bytes)
	}
	fmt.Fprintf(tw, "created\t%s\n", fmtTime(j.CreatedAt))
	fmt.Fprintf(tw, "updated\t%s\n", fmtTime(j.UpdatedAt))
	fmt.Fprintf(tw, "completed\t%s\n", fmtTimePtr(j.CompletedAt))
	if err := tw.Flush(); err != nil {
		return err
	}

	fmt.Fprintln(w, "\nattempts")
	if len(st.Attempts) == 0 {
		fmt.Fprintln(w, "  none yet")
	} else if err := writeTable(w, "  #\tSTART\tDURATION\tWORKER\tSESSION\tPROVIDER\tTIER\tENDPOINT\tFENCE\tOUTCOME\tCATEGORY\tSTATUS\tBYTES\tERROR", func(tw io.Writer) {
		for _, a := range st.Attempts {
			status := "-"
			if a.HTTPStatus != 0 {
				status = strconv.Itoa(a.HTTPStatus)
			}
			fmt.Fprintf(tw, "  %d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\t%s\t%d\t%s\n", a.AttemptNo, fmtTime(a.StartedAt), duration(a),
				dash(a.Worker), sessionText(a.SessionID, a.SessionUnits), dash(a.Provider), dash(a.Tier), dash(a.ProxyEndpoint), a.Fence, a.Outcome, dash(a.Category), status, a.Bytes,
				dash(oneLine(a.Error)))
		}
	}); err != nil {
		return err
	}

	fmt.Fprintln(w, "\nresult")
	if len(st.Results) == 0 {
		fmt.Fprintln(w, "  none")
	} else {
		if err := writeTable(w, "  OBSERVATION KEY\tPARSER\tFENCE\tFINGERPRINT\tCREATED", func(tw io.Writer) {
			for _, r := range st.Results {
				fmt.Fprintf(tw, "  %s\tv%d\t%d\t%s\t%s\n", r.ObservationKey, r.ParserVersion, r.Fence, dash(r.Fingerprint), fmtTime(r.CreatedAt))
			}
		}); err != nil {
			return err
		}
		for _, r := range st.Results {
			fmt.Fprintf(w, "  record %s:\n%s\n", r.ObservationKey, indentJSON(r.Data, "    "))
		}
	}

	if len(st.Quarantine) > 0 {
		fmt.Fprintln(w, "\nquarantined staging (what a cut attempt had staged; never merged)")
		for _, q := range st.Quarantine {
			fmt.Fprintf(w, "  attempt #%d, session %s, %s (%s), %s:\n%s\n", q.AttemptNo, dash(q.SessionID), q.Reason,
				ops.QuarantineWhy(q.Reason), fmtTime(q.CreatedAt), indentJSON(q.Staged, "    "))
		}
	}

	fmt.Fprintln(w, "\noutbox event")
	if st.Outbox == nil {
		fmt.Fprintf(w, "  none (%s)\n", st.EventKey)
	} else {
		sent := "not sent yet"
		if st.Outbox.SentAt != nil {
			sent = "sent " + fmtTime(*st.Outbox.SentAt)
		}
		fmt.Fprintf(w, "  %s  topic %s  created %s  %s\n", st.Outbox.EventKey, st.Outbox.Topic, fmtTime(st.Outbox.CreatedAt), sent)
	}

	if len(st.Notes) > 0 {
		fmt.Fprintln(w, "\nnotes")
		return writeTable(w, "  AT\tACTION\tBY\tFROM\tATTEMPTS BEFORE\tNOTE", func(tw io.Writer) {
			for _, n := range st.Notes {
				from := n.PreviousState
				if n.PreviousCategory != "" {
					from += " (" + n.PreviousCategory + ")"
				}
				fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%d\t%s\n", fmtTime(n.CreatedAt), n.Action, n.Actor, from, n.AttemptsBefore, dash(oneLine(n.Note)))
			}
		})
	}
	return nil
}

// writeTable writes one of status's tables to w: the header line, then the lines rows
// writes, in columns aligned as in the job's table.
func writeTable(w io.Writer, header string, rows func(tw io.Writer)) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, header)
	rows(tw)
	return tw.Flush()
}

// oneLine keeps a table row on one line.
func oneLine(s string) string {
	return strings.Join(strings.Fields(s), " ")
}

// The JSON form of `status`: snake_case, stable field names for scripts.
type (
	jobJSON struct {
		Key           string     `json:"key"`
		Kind          string     `json:"kind"`
		URL           string     `json:"url,omitempty"`
		SourceID      string     `json:"source_id,omitempty"`
		Country       string     `json:"country"`
		Window        string     `json:"window"`
		ParserVersion int        `json:"parser_version"`
		Scope         string     `json:"scope"`
		State         string     `json:"state"`
		Fence         int64      `json:"fence"`
		Attempts      int        `json:"attempts"`
		NextAttemptAt *time.Time `json:"next_attempt_at"`
		LastCategory  string     `json:"last_category"`
		BytesTotal    int64      `json:"bytes_total"`
		CreatedAt     time.Time  `json:"created_at"`
		UpdatedAt     time.Time  `json:"updated_at"`
		CompletedAt   *time.Time `json:"completed_at"`
		EventKey      string     `json:"event_key"`
	}
	attemptJSON struct {
		AttemptNo     int        `json:"attempt_no"`
		Fence         int64      `json:"fence"`
		Worker        string     `json:"worker"`
		SessionID     string     `json:"session_id"`
		SessionUnits  int        `json:"session_units"` // units its session served before (0: a new session)
		Country       string     `json:"country"`
		ProxyEndpoint string     `json:"proxy_endpoint"`
		Provider      string     `json:"provider"`
		Tier          string     `json:"tier"`
		StartedAt     time.Time  `json:"started_at"`
		FinishedAt    *time.Time `json:"finished_at"`
		DurationMS    *int64     `json:"duration_ms"`
		Outcome       string     `json:"outcome"`
		Category      string     `json:"category"`
		HTTPStatus    int        `json:"http_status"`
		Bytes         int64      `json:"bytes"`
		Error         string     `json:"error"`
	}
	statusJSON struct {
		Job        jobJSON           `json:"job"`
		Attempts   []attemptJSON     `json:"attempts"`
		Results    []ops.Result      `json:"results"`
		Outbox     *ops.OutboxEvent  `json:"outbox_event"`
		Notes      []ops.Note        `json:"notes"`
		Budget     ops.Budget        `json:"retry_budget"`
		Quarantine []ops.Quarantined `json:"quarantine"`
		// WindowMoney is the job's window against its kind's money budget; null when the
		// budget is not known here (-window-budget).
		WindowMoney *windowMoneyJSON `json:"window_money"`
	}
)

func statusJSONOf(st ops.Status) statusJSON {
	j := st.Job
	out := statusJSON{
		Job: jobJSON{Key: j.Key, Kind: j.Kind, URL: j.URL, SourceID: j.SourceID, Country: j.Country, Window: j.Window,
			ParserVersion: j.ParserVersion, Scope: j.Scope, State: string(j.State), Fence: j.Fence, Attempts: j.Attempts,
			NextAttemptAt: j.NextAttemptAt, LastCategory: j.LastCategory, BytesTotal: j.BytesTotal, CreatedAt: j.CreatedAt,
			UpdatedAt: j.UpdatedAt, CompletedAt: j.CompletedAt, EventKey: st.EventKey},
		Attempts: []attemptJSON{}, Results: st.Results, Outbox: st.Outbox, Notes: st.Notes, Budget: st.Budget,
		Quarantine: st.Quarantine,
	}
	if out.Quarantine == nil {
		out.Quarantine = []ops.Quarantined{}
	}
	if out.Results == nil {
		out.Results = []ops.Result{}
	}
	if out.Notes == nil {
		out.Notes = []ops.Note{}
	}
	for _, a := range st.Attempts {
		x := attemptJSON{AttemptNo: a.AttemptNo, Fence: a.Fence, Worker: a.Worker, SessionID: a.SessionID, SessionUnits: a.SessionUnits, Country: a.Country,
			ProxyEndpoint: a.ProxyEndpoint, Provider: a.Provider, Tier: a.Tier, StartedAt: a.StartedAt, FinishedAt: a.FinishedAt, Outcome: a.Outcome,
			Category: a.Category, HTTPStatus: a.HTTPStatus, Bytes: a.Bytes, Error: a.Error}
		if a.FinishedAt != nil {
			ms := a.FinishedAt.Sub(a.StartedAt).Milliseconds()
			x.DurationMS = &ms
		}
		out.Attempts = append(out.Attempts, x)
	}
	return out
}

// indentJSON indents a stored JSON document under prefix (as stored, when it does not
// parse).
func indentJSON(raw []byte, prefix string) string {
	var b bytes.Buffer
	if err := json.Indent(&b, raw, prefix, "  "); err != nil {
		return prefix + string(raw)
	}
	return prefix + b.String()
}

// sessionText is an attempt's session as the status table shows it: "abc123" for a new
// session, "abc123 (warm, unit 3)" for one from the worker's session pool.
func sessionText(id string, units int) string {
	if id == "" || units == 0 {
		return dash(id)
	}
	return fmt.Sprintf("%s (warm, unit %d)", id, units+1)
}
