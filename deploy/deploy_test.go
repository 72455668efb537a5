package deploy

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/scheduler"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/outbox"
	"github.com/idemscrape/idemscrape/testutil"
)

const (
	rulesFile      = "prometheus/alerts.yml"
	ruleTestsFile  = "prometheus/alerts_test.yml"
	dashboardFile  = "grafana/idemscrape.json"
	operationsFile = "../docs/OPERATIONS.md"
	runbookBase    = "https://github.com/idemscrape/idemscrape/blob/main/docs/OPERATIONS.md#"
)

// promtool returns the promtool to run: $IDEMSCRAPE_PROMTOOL, else the one on PATH. A
// missing promtool fails the test: a skipped rules test would let broken rules ship.
func promtool(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("IDEMSCRAPE_PROMTOOL"); p != "" {
		path, err := exec.LookPath(p)
		require.NoError(t, err, "IDEMSCRAPE_PROMTOOL=%q is not an executable promtool", p)
		return path
	}
	path, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatalf("promtool not found on PATH (%v). Install it with `.ci/run --test-deps` (Debian: takes promtool "+
			"out of the prometheus package, without installing the server), or take it from a Prometheus release "+
			"(https://prometheus.io/download/) or `go install github.com/prometheus/prometheus/cmd/promtool@latest`; "+
			"or point IDEMSCRAPE_PROMTOOL at it", err)
	}
	return path
}

func runPromtool(t *testing.T, args ...string) {
	t.Helper()
	cmd := exec.CommandContext(t.Context(), promtool(t), args...)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "promtool %s:\n%s", strings.Join(args, " "), out)
	t.Logf("promtool %s:\n%s", strings.Join(args, " "), out)
}

// rule is one rule of alerts.yml.
type rule struct {
	Alert       string            `yaml:"alert"`
	Record      string            `yaml:"record"`
	Expr        string            `yaml:"expr"`
	For         string            `yaml:"for"`
	Labels      map[string]string `yaml:"labels"`
	Annotations map[string]string `yaml:"annotations"`
}

func loadRules(t *testing.T) []rule {
	t.Helper()
	b, err := os.ReadFile(rulesFile)
	require.NoError(t, err)
	var f struct {
		Groups []struct {
			Name  string `yaml:"name"`
			Rules []rule `yaml:"rules"`
		} `yaml:"groups"`
	}
	require.NoError(t, yaml.Unmarshal(b, &f))
	var rules []rule
	for _, g := range f.Groups {
		assert.Equal(t, "idemscrape", g.Name, "rule group name")
		rules = append(rules, g.Rules...)
	}
	require.NotEmpty(t, rules, "%s has no rules", rulesFile)
	return rules
}

func TestAlertRules(t *testing.T) {
	t.Run("PromtoolCheck", func(t *testing.T) {
		runPromtool(t, "check", "rules", rulesFile)
	})

	t.Run("PromtoolUnitTests", func(t *testing.T) {
		runPromtool(t, "test", "rules", ruleTestsFile)
	})

	t.Run("EveryAlertFiresInATest", func(t *testing.T) {
		b, err := os.ReadFile(ruleTestsFile)
		require.NoError(t, err)
		var f struct {
			Tests []struct {
				AlertRuleTest []struct {
					Alertname string `yaml:"alertname"`
					ExpAlerts []any  `yaml:"exp_alerts"`
				} `yaml:"alert_rule_test"`
			} `yaml:"tests"`
		}
		require.NoError(t, yaml.Unmarshal(b, &f))
		fires, quiet := map[string]bool{}, 0
		for _, tc := range f.Tests {
			for _, a := range tc.AlertRuleTest {
				if len(a.ExpAlerts) > 0 {
					fires[a.Alertname] = true
				} else {
					quiet++
				}
			}
		}
		for _, r := range loadRules(t) {
			assert.True(t, fires[r.Alert], "alert %s has no test case in %s where it fires", r.Alert, ruleTestsFile)
		}
		assert.Positive(t, quiet, "%s has no case where an alert must not fire", ruleTestsFile)
	})

	t.Run("EveryAlertIsComplete", func(t *testing.T) {
		anchors := markdownAnchors(t, operationsFile)
		for _, r := range loadRules(t) {
			if !assert.NotEmpty(t, r.Alert, "recording rule %q: this file holds alerts only", r.Record) {
				continue
			}
			assert.NotEmpty(t, r.For, "alert %s: no for:", r.Alert)
			assert.Contains(t, []string{"critical", "warning", "info"}, r.Labels["severity"], "alert %s: severity", r.Alert)
			for _, a := range []string{"summary", "description", "runbook_url"} {
				assert.NotEmpty(t, r.Annotations[a], "alert %s: annotation %s", r.Alert, a)
			}
			anchor := "alert-" + strings.ToLower(r.Alert)
			assert.Equal(t, runbookBase+anchor, r.Annotations["runbook_url"], "alert %s: runbook_url", r.Alert)
			assert.True(t, anchors[anchor], "alert %s: %s has no section \"### Alert: %s\" (anchor #%s)",
				r.Alert, operationsFile, r.Alert, anchor)
		}
	})
}

// markdownAnchors returns the anchors GitHub gives the headings of a Markdown file.
func markdownAnchors(t *testing.T, path string) map[string]bool {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	heading := regexp.MustCompile(`(?m)^#{1,6}\s+(.+?)\s*$`)
	drop := regexp.MustCompile(`[^\p{L}\p{N}\s_-]`)
	anchors := map[string]bool{}
	for _, m := range heading.FindAllStringSubmatch(string(b), -1) {
		a := drop.ReplaceAllString(strings.ToLower(m[1]), "")
		anchors[strings.ReplaceAll(a, " ", "-")] = true
	}
	return anchors
}

// TestDashboardQueries has promtool parse every query of the dashboard, the Grafana
// variables replaced by values of their kind, as recording rules.
func TestDashboardQueries(t *testing.T) {
	queries := dashboardQueries(t)
	grafanaVar := regexp.MustCompile(`\$\{?(\w+)\}?`)
	intervals := map[string]string{"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}
	type recording struct {
		Record string `yaml:"record"`
		Expr   string `yaml:"expr"`
	}
	var recs []recording
	for _, q := range queries {
		if q.variable {
			continue // label_values(…) is Grafana's, not PromQL; its selector is checked in TestDashboardMetricsExist
		}
		expr := grafanaVar.ReplaceAllStringFunc(q.expr, func(v string) string {
			name := grafanaVar.FindStringSubmatch(v)[1]
			if d, ok := intervals[name]; ok {
				return d
			}
			return ".*"
		})
		recs = append(recs, recording{Record: fmt.Sprintf("dashboard:query_%d", len(recs)), Expr: expr})
	}
	require.NotEmpty(t, recs)
	out, err := yaml.Marshal(map[string]any{"groups": []any{map[string]any{"name": "dashboard", "rules": recs}}})
	require.NoError(t, err)
	path := filepath.Join(t.TempDir(), "dashboard_rules.yml")
	require.NoError(t, os.WriteFile(path, out, 0o600))
	runPromtool(t, "check", "rules", path)
}

// query is one PromQL expression of the dashboard: a panel target's, or a variable's.
type query struct {
	where    string // panel title or variable name
	expr     string
	variable bool
}

func loadDashboard(t *testing.T) map[string]any {
	t.Helper()
	b, err := os.ReadFile(dashboardFile)
	require.NoError(t, err)
	var d map[string]any
	require.NoError(t, json.Unmarshal(b, &d))
	return d
}

func dashboardQueries(t *testing.T) []query {
	t.Helper()
	d := loadDashboard(t)
	var qs []query
	templating, _ := d["templating"].(map[string]any)
	vars, _ := templating["list"].([]any)
	for _, v := range vars {
		v := v.(map[string]any)
		if v["type"] != "query" {
			continue
		}
		q, ok := v["query"].(string)
		if m, isMap := v["query"].(map[string]any); isMap {
			q, ok = m["query"].(string)
		}
		require.True(t, ok, "variable %v: query is not a string", v["name"])
		qs = append(qs, query{where: "variable " + v["name"].(string), expr: q, variable: true})
	}
	var walk func(panels []any)
	walk = func(panels []any) {
		for _, p := range panels {
			p := p.(map[string]any)
			title, _ := p["title"].(string)
			if p["type"] == "row" {
				nested, _ := p["panels"].([]any)
				walk(nested)
				continue
			}
			targets, _ := p["targets"].([]any)
			require.NotEmpty(t, targets, "panel %q has no queries", title)
			for _, tg := range targets {
				expr, _ := tg.(map[string]any)["expr"].(string)
				require.NotEmpty(t, expr, "panel %q: a target without expr", title)
				qs = append(qs, query{where: "panel " + title, expr: expr})
			}
		}
	}
	panels, _ := d["panels"].([]any)
	walk(panels)
	return qs
}

func TestDashboardStructure(t *testing.T) {
	d := loadDashboard(t)
	assert.Equal(t, "idemscrape", d["uid"])
	assert.GreaterOrEqual(t, d["schemaVersion"], 39.0)
	templating := d["templating"].(map[string]any)
	var dsVar bool
	for _, v := range templating["list"].([]any) {
		v := v.(map[string]any)
		if v["name"] == "DS_PROMETHEUS" && v["type"] == "datasource" && v["query"] == "prometheus" {
			dsVar = true
		}
	}
	assert.True(t, dsVar, "no datasource variable DS_PROMETHEUS of type prometheus")
	ids := map[float64]string{}
	var walk func(panels []any)
	walk = func(panels []any) {
		for _, p := range panels {
			p := p.(map[string]any)
			title, _ := p["title"].(string)
			id, _ := p["id"].(float64)
			if prev, dup := ids[id]; dup {
				t.Errorf("panels %q and %q share id %v", prev, title, id)
			}
			ids[id] = title
			if p["type"] == "row" {
				nested, _ := p["panels"].([]any)
				walk(nested)
				continue
			}
			// Every panel and query on the templated datasource, so that the dashboard works
			// on any Prometheus, imported or provisioned.
			assert.Equal(t, map[string]any{"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["datasource"], "panel %q datasource", title)
			for _, tg := range p["targets"].([]any) {
				assert.Equal(t, map[string]any{"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, tg.(map[string]any)["datasource"], "panel %q target datasource", title)
			}
		}
	}
	walk(d["panels"].([]any))
}

// metricDesc is what the components register under one metric name.
type metricDesc struct {
	labels    []string
	histogram bool
}

// recordingRegisterer registers on a real registry, so that conflicting registrations fail
// as they would in a worker, and keeps every collector to describe it afterwards.
type recordingRegisterer struct {
	*prometheus.Registry
	mu         sync.Mutex
	collectors []prometheus.Collector
}

func (r *recordingRegisterer) Register(c prometheus.Collector) error {
	if err := r.Registry.Register(c); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.collectors = append(r.collectors, c)
	return nil
}

func (r *recordingRegisterer) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}

var (
	descName   = regexp.MustCompile(`^Desc\{fqName: "([^"]+)"`)
	descLabels = regexp.MustCompile(`variableLabels: \{([^}]*)\}\}$`)
)

// registeredMetrics builds every component that registers idemscrape metrics, as the
// binaries do, and returns what they register by name. service.Service registers none of
// its own: it adds the Go and process collectors and passes its registry to
// outbox.NewDispatcher, which is built here.
func registeredMetrics(t *testing.T) map[string]metricDesc {
	t.Helper()
	pool := testutil.PG(t)
	ns := testutil.Redis(t)
	st := store.New(pool)
	quiet := slog.New(slog.DiscardHandler)
	rec := &recordingRegisterer{Registry: prometheus.NewRegistry()}

	prov, err := sessions.NewProvider("test", "127.0.0.1:9", "{user}-session-{session}", "{pass}", "user", "pass", 0)
	require.NoError(t, err)
	reg, err := handlers.NewRegistry(handlers.Config{Store: st, Redis: ns.Client, Provider: prov,
		KeyPrefix: ns.Prefix, Registerer: rec, Logger: quiet})
	require.NoError(t, err)
	t.Cleanup(reg.Close)

	client := asynq.NewClient(ns.AsynqOpt())
	t.Cleanup(func() { _ = client.Close() })
	file, err := scheduler.ParseFile([]byte("kinds:\n  catalog: {max_lease: 30m}\n"), "", nil)
	require.NoError(t, err)
	_, err = scheduler.New(scheduler.Config{File: file, Client: client, Redis: ns.Client, Store: st,
		Registerer: rec, Logger: quiet})
	require.NoError(t, err)
	maint, err := outbox.NewMaintainer(pool)
	require.NoError(t, err)
	_, err = scheduler.NewReconciler(scheduler.ReconcilerConfig{File: file, Store: st, Outbox: maint,
		Redis: ns.Client, Client: client, KeyPrefix: ns.Prefix, Registerer: rec, Logger: quiet})
	require.NoError(t, err)

	_, err = outbox.NewDispatcher(pool, ns.Client, &outbox.DispatcherConfig{Prefix: ns.Prefix, Registerer: rec, Logger: quiet})
	require.NoError(t, err)
	_, err = outbox.NewConsumer(ns.Client, &outbox.ConsumerConfig{Prefix: ns.Prefix, Topic: "catalog", Group: "deploy",
		Registerer: rec, Logger: quiet})
	require.NoError(t, err)

	metrics := map[string]metricDesc{}
	for _, c := range rec.collectors {
		// A Summary has a Histogram's method set; no component registers one.
		_, hist := c.(prometheus.Histogram)
		if _, vec := c.(*prometheus.HistogramVec); vec {
			hist = true
		}
		ch := make(chan *prometheus.Desc)
		go func() { c.Describe(ch); close(ch) }()
		for desc := range ch {
			s := desc.String()
			name := descName.FindStringSubmatch(s)
			labels := descLabels.FindStringSubmatch(s)
			require.NotNil(t, name, "unexpected Desc format %s", s)
			require.NotNil(t, labels, "unexpected Desc format %s", s)
			md := metricDesc{histogram: hist}
			if labels[1] != "" {
				md.labels = strings.Split(labels[1], ",")
			}
			metrics[name[1]] = md
		}
	}
	require.NotEmpty(t, metrics)
	return metrics
}

var (
	metricName = regexp.MustCompile(`idemscrape_[a-zA-Z0-9_:]*`)
	// A selector's braces: the metric name and its matchers.
	selector = regexp.MustCompile(`(idemscrape_[a-zA-Z0-9_:]*)\s*\{([^}]*)\}`)
	matcher  = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"`)
	byClause = regexp.MustCompile(`\bby\s*\(([^)]*)\)\s*\(`)
)

// targetLabels are added by Prometheus to every series it scrapes.
var targetLabels = []string{"job", "instance"}

// resolve finds the registered metric a series name in a query belongs to: the name
// itself, or a histogram's _bucket, _sum or _count series.
func resolve(metrics map[string]metricDesc, name string) (metricDesc, bool) {
	if md, ok := metrics[name]; ok {
		return md, !md.histogram // a histogram has no series under its bare name
	}
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		base, ok := strings.CutSuffix(name, suffix)
		if md, found := metrics[base]; ok && found && md.histogram {
			if suffix == "_bucket" {
				md.labels = append(slices.Clone(md.labels), "le")
			}
			return md, true
		}
	}
	return metricDesc{}, false
}

// checkQuery reports every idemscrape series the query names that the components do not
// register, and every label it selects or aggregates by that the series does not have.
// It returns the series names it found.
func checkQuery(metrics map[string]metricDesc, q query) (names []string, problems []string) {
	hasLabel := func(md metricDesc, l string) bool {
		return slices.Contains(md.labels, l) || slices.Contains(targetLabels, l)
	}
	for _, name := range metricName.FindAllString(q.expr, -1) {
		names = append(names, name)
		if _, ok := resolve(metrics, name); !ok {
			problems = append(problems, fmt.Sprintf("%s: %s is not registered by any component (%s)", q.where, name, q.expr))
		}
	}
	for _, sel := range selector.FindAllStringSubmatch(q.expr, -1) {
		md, ok := resolve(metrics, sel[1])
		if !ok {
			continue
		}
		for _, m := range matcher.FindAllStringSubmatch(sel[2], -1) {
			if !hasLabel(md, m[1]) {
				problems = append(problems, fmt.Sprintf("%s: %s has no label %s (it has %v)", q.where, sel[1], m[1], md.labels))
			}
		}
	}
	// sum by (a, b) (…): every series aggregated must carry a and b.
	for _, loc := range byClause.FindAllStringSubmatchIndex(q.expr, -1) {
		labels := strings.Split(q.expr[loc[2]:loc[3]], ",")
		body := balanced(q.expr[loc[1]-1:])
		for _, name := range metricName.FindAllString(body, -1) {
			md, ok := resolve(metrics, name)
			if !ok {
				continue
			}
			for _, l := range labels {
				if l = strings.TrimSpace(l); l != "" && !hasLabel(md, l) {
					problems = append(problems, fmt.Sprintf("%s: aggregates %s by %s, a label it does not have (it has %v)", q.where, name, l, md.labels))
				}
			}
		}
	}
	return names, problems
}

// balanced returns s up to the parenthesis that closes its first one, skipping quoted
// strings (regular expressions in matchers may hold parentheses).
func balanced(s string) string {
	depth, quoted := 0, false
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case quoted && c == '\\':
			i++
		case c == '"':
			quoted = !quoted
		case quoted:
		case c == '(':
			depth++
		case c == ')':
			depth--
			if depth == 0 {
				return s[:i+1]
			}
		}
	}
	return s
}

// TestDashboardMetricsExist checks every idemscrape metric, and every label selected or
// aggregated by, in the dashboard's queries and the alert rules against what the real
// components register.
func TestDashboardMetricsExist(t *testing.T) {
	metrics := registeredMetrics(t)

	queries := dashboardQueries(t)
	for _, r := range loadRules(t) {
		queries = append(queries, query{where: "alert " + r.Alert, expr: r.Expr})
	}

	used := map[string]bool{}
	var problems []string
	for _, q := range queries {
		names, p := checkQuery(metrics, q)
		if len(names) == 0 {
			problems = append(problems, fmt.Sprintf("%s: names no idemscrape metric (%s)", q.where, q.expr))
		}
		for _, n := range names {
			used[n] = true
		}
		problems = append(problems, p...)
	}
	assert.Empty(t, problems, "queries that do not match the registered metrics:\n%s", strings.Join(problems, "\n"))

	var names []string
	for n := range used {
		names = append(names, n)
	}
	sort.Strings(names)
	t.Logf("%d queries use %d series names: %s", len(queries), len(names), strings.Join(names, " "))
}

// TestCheckQuery shows that checkQuery catches what it is for, so that
// TestDashboardMetricsExist can fail.
func TestCheckQuery(t *testing.T) {
	metrics := map[string]metricDesc{
		"idemscrape_attempts_total": {labels: []string{"kind", "outcome", "category"}},
		"idemscrape_job_bytes":      {labels: []string{"kind"}, histogram: true},
	}
	for _, tc := range []struct {
		expr     string
		problems int
	}{
		{`sum by (kind) (rate(idemscrape_attempts_total{job=~"$job", outcome="complete"}[5m]))`, 0},
		{`histogram_quantile(0.9, sum by (kind, le) (rate(idemscrape_job_bytes_bucket{kind=~"(a|b)"}[5m])))`, 0},
		{`sum(rate(idemscrape_job_bytes_sum[5m])) / sum(rate(idemscrape_job_bytes_count[5m]))`, 0},
		{`rate(idemscrape_attempts_bogus_total[5m])`, 1}, // unknown metric
		{`idemscrape_job_bytes`, 1},                                                    // a histogram's bare name has no series
		{`rate(idemscrape_attempts_total_bucket[5m])`, 1},                              // not a histogram
		{`rate(idemscrape_attempts_total{provider="x"}[5m])`, 1},                       // no such label
		{`sum by (provider) (rate(idemscrape_attempts_total[5m]))`, 1},                 // aggregated by a missing label
		{`sum by (kind, le) (rate(idemscrape_job_bytes_sum[5m]))`, 1},                  // le only on _bucket
		{`sum by (kind) (rate(idemscrape_attempts_total{category=~"a(b|c)"}[5m]))`, 0}, // parentheses in a regexp
		{`rate(idemscrape_[5m])`, 1},                                                   // a bare prefix is reported, not skipped
	} {
		_, problems := checkQuery(metrics, query{where: "test", expr: tc.expr})
		assert.Len(t, problems, tc.problems, "%s: %v", tc.expr, problems)
	}
}
