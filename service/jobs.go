package service

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"sort"
	"time"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/ops"
	"github.com/idemscrape/idemscrape/tasks"
)

// pageTimeout bounds the queries of one page.
const pageTimeout = 5 * time.Second

// The job pages read through store/ops, the operator's read-only queries (the CLI's
// `status` shows the same).
type (
	outboxRow  = ops.OutboxEvent // the outbox event of a job
	jobListRow = ops.ProblemJob  // one row of /jobs
)

// windowListLimit is how many schedule windows /windows lists.
const windowListLimit = 200

// attemptView is one attempt on the timeline.
type attemptView struct {
	store.Attempt
	Duration string
}

type jobPage struct {
	Job        store.Job
	Attempts   []attemptView
	Results    []resultView
	EventKey   string
	Outbox     *outboxRow
	Notes      []ops.Note
	Budget     ops.Budget
	Left       *leftView         // nil: the kind is not registered here
	Window     *windowBudgetView // nil: the kind has no window budget here and its window spent nothing
	Quarantine []quarantineView
}

// windowBudgetView is the job's collection window against its money budget.
type windowBudgetView struct {
	Spent    []store.Cost // what the window's recorded attempts cost, per currency
	Budget   *store.Cost  // nil: no window budget configured for the kind (Config.WindowBudgets)
	Deferral string       // "deferred: window budget spent (x of y)", or the failure it caused, or ""
}

// resultView is one result with its record, indented.
type resultView struct {
	ops.Result
	Record string
}

// quarantineView is one quarantined staging with its data, indented, and what set it
// aside.
type quarantineView struct {
	ops.Quarantined
	Record string
	Why    string
}

type listPage struct {
	Jobs     []jobListRow
	Limit    int
	Filter   listFilter
	Budgets  bool  // window budgets are configured: the deferred filter can be used
	Deferred int64 // on the default list: how many runnable jobs spent window budgets hold back
	// DeferredUncounted: the count did not answer within deferredCountTimeout.
	DeferredUncounted bool
}

// deferredCountTimeout bounds the default /jobs list's count of deferred jobs.
const deferredCountTimeout = 2 * time.Second

// listFilter is /jobs' query, as given (the form shows it again).
type listFilter struct {
	Kind, State, Category, Window, Prefix, Since string
	Deferred                                     bool
}

// Any reports whether the list is filtered beyond its default.
func (f listFilter) Any() bool { return f != listFilter{} }

// windowRow is one row of /windows: a recorded schedule window and its jobs by state.
type windowRow struct {
	store.Window
	Jobs ops.WindowJobs
	Gap  bool // the window's tick failed: its jobs may be missing (idemscrape windows -fill)
	// Spent is what the window's recorded attempts cost (in the budget's currency first),
	// Budget the kind's money budget per window (nil: none configured here), Exhausted
	// whether it is spent (its runnable jobs are deferred or failed).
	Spent     []store.Cost
	Budget    *store.Cost
	Exhausted bool
}

func (s *Service) serveJob(w http.ResponseWriter, r *http.Request) {
	key := r.PathValue("key")
	if err := ops.CheckText("the key", key); err != nil {
		// No job is stored under it, and PostgreSQL would refuse the lookup: the request's
		// mistake, not the store's (no ERROR logged).
		http.Error(w, "/jobs/{key}: "+err.Error(), http.StatusBadRequest)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	db := ops.New(s.cfg.Store.Pool())
	st, err := db.JobStatus(ctx, key, handlers.EventKey(key))
	if errors.Is(err, store.ErrJobNotFound) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		w.WriteHeader(http.StatusNotFound)
		_ = pages.ExecuteTemplate(w, "notfound", key)
		return
	}
	if err != nil {
		s.pageError(w, r, err)
		return
	}
	p := jobPage{Job: st.Job, EventKey: st.EventKey, Outbox: st.Outbox, Notes: st.Notes, Budget: st.Budget}
	for _, a := range st.Attempts {
		v := attemptView{Attempt: a, Duration: "running"}
		if a.FinishedAt != nil {
			v.Duration = a.FinishedAt.Sub(a.StartedAt).Round(time.Millisecond).String()
		}
		p.Attempts = append(p.Attempts, v)
	}
	for _, res := range st.Results {
		p.Results = append(p.Results, resultView{Result: res, Record: pretty(res.Data)})
	}
	for _, q := range st.Quarantine {
		p.Quarantine = append(p.Quarantine, quarantineView{Quarantined: q, Record: pretty(q.Staged), Why: ops.QuarantineWhy(q.Reason)})
	}
	if cfg, ok := s.cfg.Registry.RetryBudget(st.Job.Kind); ok {
		p.Left = budgetLeft(st, cfg)
	}
	if p.Window, err = s.windowBudget(ctx, db, st.Job); err != nil {
		s.pageError(w, r, err)
		return
	}
	render(w, "job", p)
}

// pretty indents a JSON document for the page (html/template escapes it): the stored
// record as it is.
func pretty(raw json.RawMessage) string {
	var b bytes.Buffer
	if err := json.Indent(&b, raw, "", "  "); err != nil {
		return string(raw)
	}
	return b.String()
}

// leftView is what a job's current retry budget has left (see ops.Budget): attempts,
// bytes through the proxy, and until when attempts may start.
type leftView struct {
	Attempts, MaxAttempts int
	Bytes, MaxBytes       int64
	Until                 time.Time
}

func budgetLeft(st ops.Status, cfg handlers.RetryConfig) *leftView {
	since := st.Job.CreatedAt
	if st.Budget.Since != nil {
		since = *st.Budget.Since
	}
	return &leftView{
		Attempts: max(cfg.MaxAttempts-(st.Job.Attempts-st.Budget.Attempts), 0), MaxAttempts: cfg.MaxAttempts,
		Bytes: max(cfg.BandwidthBudget-(st.Job.BytesTotal-st.Budget.Bytes), 0), MaxBytes: cfg.BandwidthBudget,
		Until: since.Add(cfg.TotalBudget),
	}
}

// windowBudget is the job's window against the kind's money budget (Config.WindowBudgets)
// and what its window's recorded attempts cost; nil when there is neither.
func (s *Service) windowBudget(ctx context.Context, db *ops.Store, job store.Job) (*windowBudgetView, error) {
	spends, err := db.WindowSpends(ctx, []string{job.Kind}, []string{job.Window})
	if err != nil {
		return nil, err
	}
	spend := spends[[2]string{job.Kind, job.Window}]
	budget, ok := s.cfg.WindowBudgets[job.Kind]
	if !ok && len(spend) == 0 {
		return nil, nil
	}
	v := &windowBudgetView{}
	for _, cur := range sortedKeys(spend) {
		if !ok || cur != budget.Currency {
			v.Spent = append(v.Spent, spend.Of(cur))
		}
	}
	if ok {
		b := budget
		v.Budget = &b
		ws := ops.WindowBudgetState{Budget: budget, Spent: spend.Of(budget.Currency)}
		v.Spent = append([]store.Cost{ws.Spent}, v.Spent...)
		v.Deferral = ws.Deferral(job.State, job.LastCategory)
	}
	return v, nil
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// serveJobList is /jobs: the failed and retryable jobs, or those of the filter in the
// query (kind, state: a comma-separated list or "any", category, window, prefix: of the
// key, since: updated at or after, an RFC 3339 time or a duration back from now, deferred:
// only jobs whose window's money budget is spent, see Config.WindowBudgets). A filter that
// can not be run is a 400 that names it.
func (s *Service) serveJobList(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	lf := listFilter{Kind: q.Get("kind"), State: q.Get("state"), Category: q.Get("category"), Window: q.Get("window"),
		Prefix: q.Get("prefix"), Since: q.Get("since")}
	switch d := q.Get("deferred"); d {
	case "", "0", "false", "off":
	default:
		lf.Deferred = true
	}
	for _, p := range []struct{ name, v string }{
		{"kind", lf.Kind}, {"state", lf.State}, {"category", lf.Category}, {"window", lf.Window}, {"prefix", lf.Prefix},
		{"since", lf.Since}, {"deferred", q.Get("deferred")},
	} {
		// Checked before anything else reads them: a value PostgreSQL can not hold is the
		// request's mistake, never "the job store did not answer".
		if err := ops.CheckText(p.name, p.v); err != nil {
			http.Error(w, "/jobs?"+p.name+"=: "+err.Error(), http.StatusBadRequest)
			return
		}
	}
	states, err := ops.ParseStates(lf.State)
	if err != nil {
		http.Error(w, "/jobs?state=: "+err.Error(), http.StatusBadRequest)
		return
	}
	since, err := ops.ParseSince(lf.Since, time.Now())
	if err != nil {
		http.Error(w, "/jobs?since=: "+err.Error(), http.StatusBadRequest)
		return
	}
	sel := ops.Selector{Kind: lf.Kind, States: states, Category: lf.Category, Window: lf.Window, KeyPrefix: lf.Prefix,
		Since: since, Deferred: lf.Deferred, Budgets: s.cfg.WindowBudgets}
	if err := sel.Validate(); err != nil {
		http.Error(w, "/jobs: "+err.Error(), http.StatusBadRequest)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	db := ops.New(s.cfg.Store.Pool())
	jobs, err := db.JobSelect(ctx, sel, s.cfg.JobListLimit)
	if err != nil {
		s.pageError(w, r, err)
		return
	}
	page := listPage{Jobs: jobs, Limit: s.cfg.JobListLimit, Filter: lf, Budgets: len(s.cfg.WindowBudgets) > 0}
	if !lf.Any() && page.Budgets {
		// The default list is what needs a look; a job a spent window budget holds back is
		// pending without an attempt, so it is counted here with a link to the list. The
		// count sums the attempts of every window with runnable jobs: bounded, and the page
		// is shown without it rather than not at all.
		cctx, ccancel := context.WithTimeout(ctx, deferredCountTimeout)
		page.Deferred, err = db.JobSelectCount(cctx, ops.Selector{Deferred: true, Budgets: s.cfg.WindowBudgets})
		ccancel()
		if err != nil {
			s.log.WarnContext(r.Context(), "/jobs: deferred jobs not counted", "err", err)
			page.Deferred, page.DeferredUncounted = 0, true
		}
	}
	render(w, "list", page)
}

// serveWindows is /windows: the schedule windows the schedulers recorded, newest first
// per template, with their jobs by state. A window whose tick failed is marked a gap; a
// window that was due and has no row at all is listed by `idemscrape windows -gaps`, which
// knows the templates' schedules.
func (s *Service) serveWindows(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	wins, err := s.cfg.Store.WindowsList(ctx, store.WindowsListParams{Limit: windowListLimit})
	if err != nil {
		s.pageError(w, r, err)
		return
	}
	kinds, names := make([]string, len(wins)), make([]string, len(wins))
	for i, x := range wins {
		kinds[i], names[i] = x.Kind, x.Window
	}
	db := ops.New(s.cfg.Store.Pool())
	counts, err := db.WindowJobCounts(ctx, kinds, names)
	if err != nil {
		s.pageError(w, r, err)
		return
	}
	spends, err := db.WindowSpends(ctx, kinds, names)
	if err != nil {
		s.pageError(w, r, err)
		return
	}
	rows := make([]windowRow, len(wins))
	for i, x := range wins {
		k := [2]string{x.Kind, x.Window}
		rows[i] = windowRow{Window: x, Jobs: counts[k], Gap: x.State == store.WindowFailed}
		spend := spends[k]
		budget, ok := s.cfg.WindowBudgets[x.Kind]
		if ok {
			b := budget
			rows[i].Budget = &b
			rows[i].Spent = []store.Cost{spend.Of(budget.Currency)}
			rows[i].Exhausted = ops.WindowBudgetState{Budget: budget, Spent: spend.Of(budget.Currency)}.Exhausted()
		}
		for _, cur := range sortedKeys(spend) {
			if !ok || cur != budget.Currency {
				rows[i].Spent = append(rows[i].Spent, spend.Of(cur))
			}
		}
	}
	render(w, "windows", struct {
		Windows []windowRow
		Limit   int
	}{rows, windowListLimit})
}

func (s *Service) pageError(w http.ResponseWriter, r *http.Request, err error) {
	s.log.ErrorContext(r.Context(), "job page failed", "path", r.URL.Path, "err", err)
	http.Error(w, "the job store did not answer; see the worker's log", http.StatusInternalServerError)
}

func render(w http.ResponseWriter, name string, data any) {
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	_ = pages.ExecuteTemplate(w, name, data)
}

func jobURL(key string) string { return "/jobs/" + url.PathEscape(key) }

func fmtTime(t any) string {
	switch v := t.(type) {
	case time.Time:
		return v.UTC().Format("2006-01-02 15:04:05.000 UTC")
	case *time.Time:
		if v == nil {
			return "—"
		}
		return v.UTC().Format("2006-01-02 15:04:05.000 UTC")
	}
	return fmt.Sprint(t)
}

// queueOf is the asynq queue of job's task: the one recorded with the job, else its
// kind's (tasks.QueueFor, as the enqueuers and the worker default to).
func queueOf(job store.Job) string {
	if job.Queue != "" {
		return job.Queue
	}
	return tasks.QueueFor(job.Kind)
}

// taskURL is asynqmon's page of job's task (its ID is the job key, tasks.Enqueuer). The
// link goes one way: asynqmon's pages can not link back, but they show the task's payload,
// which holds the key (the job page is /jobs/<key>).
func taskURL(job store.Job) string {
	return DefaultMonitoringPath + "/queues/" + url.PathEscape(queueOf(job)) + "/tasks/" + url.PathEscape(job.Key)
}

func orDash(s string) string {
	if s == "" {
		return "—"
	}
	return s
}

var pages = template.Must(template.New("pages").Funcs(template.FuncMap{
	"jobURL": jobURL, "time": fmtTime, "orDash": orDash, "taskURL": taskURL, "queueOf": queueOf,
}).Parse(`
{{define "head"}}<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{{.}} · idemscrape</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f3f3f3}
.complete{color:#176f2c}.failed{color:#b00020}.retryable{color:#a15c00}.superseded{color:#666}.running{color:#0b57d0}
code{font-size:13px}
pre.record{margin:0;white-space:pre-wrap;font-size:12px}
nav a{margin-right:1em}
</style></head><body>
<nav><a href="/jobs">failed &amp; retryable jobs</a><a href="/windows">windows</a><a href="/monitoring/">queues (asynqmon)</a><a href="/metrics">metrics</a></nav>
{{end}}

{{define "notfound"}}{{template "head" "job not found"}}
<h1>No job with key <code>{{.}}</code></h1>
</body></html>
{{end}}

{{define "job"}}{{template "head" .Job.Key}}
<h1>Job <code id="job-key">{{.Job.Key}}</code></h1>
<table id="job">
<tr><th>state</th><td class="{{.Job.State}}" id="job-state">{{.Job.State}}</td></tr>
<tr><th>kind</th><td>{{.Job.Kind}}</td></tr>
<tr><th>source</th><td>{{if .Job.URL}}{{.Job.URL}}{{else}}{{.Job.SourceID}}{{end}}</td></tr>
<tr><th>country · window · parser</th><td>{{.Job.Country}} · {{.Job.Window}} · v{{.Job.ParserVersion}}</td></tr>
<tr><th>scope</th><td>{{orDash .Job.Scope}}</td></tr>
<tr><th>attempts · fence</th><td>{{.Job.Attempts}} · {{.Job.Fence}}</td></tr>
<tr><th>last category</th><td>{{orDash .Job.LastCategory}}</td></tr>
<tr><th>next attempt</th><td>{{time .Job.NextAttemptAt}}</td></tr>
<tr><th>bytes, all attempts</th><td>{{.Job.BytesTotal}}</td></tr>
{{with .Window}}<tr><th>window money</th><td id="window-budget">{{if .Deferral}}<strong class="retryable">{{.Deferral}}</strong>{{else}}{{range $i, $c := .Spent}}{{if $i}} + {{end}}{{$c}}{{else}}nothing{{end}} spent{{with .Budget}} of {{.}}{{end}}{{end}}</td></tr>{{end}}
{{with .Left}}<tr><th>retry budget left</th><td id="budget-left">{{.Attempts}} of {{.MaxAttempts}} attempts · {{.Bytes}} of {{.MaxBytes}} bytes · until {{time .Until}}</td></tr>{{end}}
<tr><th>created · updated · completed</th><td>{{time .Job.CreatedAt}} · {{time .Job.UpdatedAt}} · {{time .Job.CompletedAt}}</td></tr>
<tr><th>asynq task</th><td>{{if or (eq (print .Job.State) "complete") (eq (print .Job.State) "failed")}}none: asynq deletes a job's task once it ends{{else}}<a id="asynq-task" href="{{taskURL .Job}}">{{queueOf .Job}} · {{.Job.Key}}</a> (asynqmon; its lists show a task ID only up to its first "-"){{end}}</td></tr>
</table>

<h2>Attempts</h2>
{{if .Attempts}}<table id="attempts">
<tr><th>#</th><th>started</th><th>duration</th><th>worker</th><th>session</th><th>proxy endpoint</th><th>fence</th><th>outcome</th><th>category</th><th>HTTP</th><th>bytes</th><th>error</th></tr>
{{range .Attempts}}<tr class="attempt">
<td>{{.AttemptNo}}</td><td>{{time .StartedAt}}</td><td>{{.Duration}}</td><td>{{orDash .Worker}}</td><td><code>{{orDash .SessionID}}</code></td>
<td>{{orDash .ProxyEndpoint}}</td><td>{{.Fence}}</td><td class="{{.Outcome}}">{{.Outcome}}</td><td class="category">{{orDash .Category}}</td>
<td>{{if .HTTPStatus}}{{.HTTPStatus}}{{else}}—{{end}}</td><td>{{.Bytes}}</td><td>{{orDash .Error}}</td></tr>
{{end}}</table>{{else}}<p>No attempt yet.</p>{{end}}

<h2>Result</h2>
{{if .Results}}<table id="results">
<tr><th>observation key</th><th>parser version</th><th>response fingerprint</th><th>created</th></tr>
{{range .Results}}<tr><td><code>{{.ObservationKey}}</code></td><td>v{{.ParserVersion}}</td><td><code>{{orDash .Fingerprint}}</code></td><td>{{time .CreatedAt}}</td></tr>
<tr><td colspan="4"><pre class="record">{{.Record}}</pre></td></tr>
{{end}}</table>{{else}}<p>No result.</p>{{end}}

{{if .Quarantine}}<h2>Quarantined staging</h2>
<p>What a unit had staged when its attempt was cut, set aside and never merged with what a later run staged. The reason says what cut it: a lost session (the unit replays from step 1 on another session: a warm one of the worker's session pool, else a new one), a budget, a validation failure.</p>
<table id="quarantine">
<tr><th>attempt</th><th>session</th><th>reason</th><th>created</th></tr>
{{range .Quarantine}}<tr><td>{{.AttemptNo}}</td><td><code>{{orDash .SessionID}}</code></td><td title="{{.Why}}">{{.Reason}}: {{.Why}}</td><td>{{time .CreatedAt}}</td></tr>
<tr><td colspan="4"><pre class="record">{{.Record}}</pre></td></tr>
{{end}}</table>{{end}}

<h2>Operator notes</h2>
{{if .Notes}}<table id="notes">
<tr><th>at</th><th>action</th><th>by</th><th>from</th><th>attempts before</th><th>note</th></tr>
{{range .Notes}}<tr><td>{{time .CreatedAt}}</td><td>{{.Action}}</td><td>{{.Actor}}</td><td>{{.PreviousState}}{{with .PreviousCategory}} ({{.}}){{end}}</td><td>{{.AttemptsBefore}}</td><td>{{orDash .Note}}</td></tr>
{{end}}</table>{{else}}<p>None.</p>{{end}}

<h2>Outbox event</h2>
{{with .Outbox}}<table id="outbox">
<tr><th>event key</th><td><code>{{.EventKey}}</code></td></tr>
<tr><th>topic</th><td>{{.Topic}}</td></tr>
<tr><th>created</th><td>{{time .CreatedAt}}</td></tr>
<tr><th>sent</th><td id="outbox-sent">{{if .SentAt}}sent {{time .SentAt}}{{else}}not sent yet{{end}}</td></tr>
</table>{{else}}<p>No outbox event <code>{{.EventKey}}</code>.</p>{{end}}
</body></html>
{{end}}

{{define "list"}}{{template "head" "jobs"}}
<h1>{{if .Filter.Any}}Jobs{{else}}Failed and retryable jobs{{end}}</h1>
<form id="filter" method="get" action="/jobs">
<label>kind <input name="kind" value="{{.Filter.Kind}}" size="10"></label>
<label>state <input name="state" value="{{.Filter.State}}" size="16" placeholder="failed,retryable"></label>
<label>category <input name="category" value="{{.Filter.Category}}" size="14"></label>
<label>window <input name="window" value="{{.Filter.Window}}" size="12"></label>
<label>key prefix <input name="prefix" value="{{.Filter.Prefix}}" size="24"></label>
<label>since <input name="since" value="{{.Filter.Since}}" size="12" placeholder="24h"></label>
{{if .Budgets}}<label><input type="checkbox" name="deferred" value="1"{{if .Filter.Deferred}} checked{{end}}> deferred (window budget spent)</label>{{end}}
<button type="submit">filter</button> <a href="/jobs">reset</a>
</form>
{{if .Deferred}}<p id="deferred-note" class="retryable"><a href="/jobs?deferred=1">{{.Deferred}} job(s) deferred</a>: their window's money budget is spent (<a href="/windows">windows</a>).</p>
{{else if .DeferredUncounted}}<p id="deferred-note">Jobs deferred by a spent window budget were not counted in time: <a href="/jobs?deferred=1">list them</a>.</p>{{end}}
<p>The {{.Limit}} most recently updated, newest first. State: a comma-separated list, or <code>any</code> (deferred: pending and retryable unless given).
Since: an RFC 3339 time or a duration back from now. The same filters: <code>idemscrape jobs</code>; re-queue failed ones with <code>idemscrape requeue</code> and the same selectors.</p>
{{if .Jobs}}<table id="jobs">
<tr><th>key</th><th>kind</th><th>state</th><th>attempts</th><th>category</th><th>updated</th><th>next attempt</th></tr>
{{range .Jobs}}<tr><td><a href="{{jobURL .Key}}"><code>{{.Key}}</code></a></td><td>{{.Kind}}</td><td class="{{.State}}">{{.State}}</td>
<td>{{.Attempts}}</td><td class="category">{{orDash .Category}}</td><td>{{time .UpdatedAt}}</td><td>{{time .NextAttemptAt}}</td></tr>
{{end}}</table>{{else}}<p>None.</p>{{end}}
</body></html>
{{end}}

{{define "windows"}}{{template "head" "windows"}}
<h1>Schedule windows</h1>
<p>The {{.Limit}} latest recorded windows, newest first per template. A <span class="failed">gap</span> is a window whose tick failed
past its retries: fill it with <code>idemscrape windows -fill TEMPLATE WINDOW</code>. Windows that were due and have no row at all are
listed by <code>idemscrape windows -gaps</code>, which knows the schedules. Spent is what the window's recorded attempts cost; the budget,
a kind's money budget per window as this worker is configured (none: —). A spent budget defers or fails the window's remaining jobs.</p>
{{if .Windows}}<table id="windows">
<tr><th>template</th><th>window</th><th>kind</th><th>due</th><th>tick</th><th>tries</th><th>specs · enqueued</th><th>pending</th><th>running</th><th>retryable</th><th>complete</th><th>failed</th><th>gap</th><th>spent · budget</th></tr>
{{range .Windows}}<tr class="window">
<td>{{.Template}}</td><td><a href="/jobs?kind={{.Kind}}&amp;window={{.Window.Window}}&amp;state=any">{{.Window.Window}}</a></td><td>{{.Kind}}</td><td>{{time .Due}}</td>
<td class="{{.State}}">{{.State}}{{if .LastError}}: {{.LastError}}{{end}}</td><td>{{.Tries}}</td><td>{{.Specs}} · {{.Enqueued}}</td>
<td>{{.Jobs.Pending}}</td><td>{{.Jobs.Running}}</td><td>{{.Jobs.Retryable}}</td><td class="complete">{{.Jobs.Complete}}</td>
<td class="failed">{{.Jobs.Failed}}</td><td class="gap">{{if .Gap}}<span class="failed">gap</span>{{else}}—{{end}}</td>
<td class="money{{if .Exhausted}} failed{{end}}">{{range $i, $c := .Spent}}{{if $i}} + {{end}}{{$c}}{{else}}—{{end}}{{with .Budget}} of {{.}}{{end}}{{if .Exhausted}} <a href="/jobs?kind={{.Kind}}&amp;window={{.Window.Window}}&amp;deferred=1">spent</a>{{end}}</td></tr>
{{end}}</table>{{else}}<p>No window recorded yet (the scheduler records each due window before it enqueues it).</p>{{end}}
</body></html>
{{end}}
`))
