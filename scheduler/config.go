package scheduler

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"time"

	"github.com/robfig/cron/v3"
	"go.yaml.in/yaml/v3"

	"github.com/idemscrape/idemscrape/store/inputs"
	"github.com/idemscrape/idemscrape/store/outbox"
	"github.com/idemscrape/idemscrape/tasks"
)

// Catch-up policies of a template (File.Templates[i].CatchUp).
const (
	// CatchUpLast: on start, enqueue the window of the most recent scheduled time before
	// now once (a no-op when that window was already enqueued: its keys exist).
	CatchUpLast = "last"
	// CatchUpNone: on start, wait for the next scheduled time.
	CatchUpNone = "none"
)

// Config file defaults.
const (
	DefaultTimezone          = "UTC"
	DefaultCatchUp           = CatchUpLast
	DefaultMaxLease          = 35 * time.Minute // handlers.DefaultLeaseMax (30 min) + margin
	DefaultReconcileInterval = 30 * time.Second
	// DefaultOrphanInterval is how often the reconciler looks for asynq tasks left active
	// by a dead asynq server (reconciler_orphans.go): asynq's heartbeat interval.
	DefaultOrphanInterval     = 5 * time.Second
	DefaultBatchSize          = 1000
	DefaultOutboxLagThreshold = 5 * time.Minute
	DefaultOutboxRetention    = 7 * 24 * time.Hour
	DefaultInboxRetention     = 30 * 24 * time.Hour
	// DefaultSavedInputRetention is how long saved inputs (store/inputs) are kept.
	DefaultSavedInputRetention = 30 * 24 * time.Hour
	DefaultPruneBatch          = 1000
	// DefaultJobRetention is how long a terminal job (complete or failed) is kept after
	// its last change, with everything recorded under its key: attempts, results,
	// quarantine, notes, saved inputs. The longest retention: nothing outlives a result.
	DefaultJobRetention = 90 * 24 * time.Hour
	// MinJobRetention is the shortest job_retention accepted.
	MinJobRetention = 24 * time.Hour
	// DefaultWindowRetentionMargin is how much longer than job_retention the window ledger
	// (schedule_windows) is kept by default: window_retention defaults to job_retention
	// plus this.
	DefaultWindowRetentionMargin = 48 * time.Hour
	// DefaultQuarantineRetention is how long quarantined staging (the staged data of
	// abandoned sessions, the bulk of what a job leaves behind) is kept, whatever the
	// job's state.
	DefaultQuarantineRetention = 7 * 24 * time.Hour
	// MinQuarantineRetention is the shortest quarantine_retention accepted.
	MinQuarantineRetention = time.Hour
	// DefaultRequeueChangedPerSweep bounds the runnable jobs that changed or came due that
	// one sweep checks (the rest wait for the next sweep, from where this one stopped).
	DefaultRequeueChangedPerSweep = 10_000
	// DefaultRequeueScanPerSweep is how many other runnable jobs one sweep checks, moving
	// through them all in key order across sweeps (a task deleted by hand is found again).
	DefaultRequeueScanPerSweep = 1000
)

// File is the scheduler's YAML configuration (see examples/scheduler.yaml). Unknown fields
// are refused. LoadFile parses and validates it.
type File struct {
	// Templates are the periodic jobs.
	Templates []Template `yaml:"templates"`
	// Kinds maps a job kind to its queue and longest lease. A kind not listed uses a queue
	// named after the kind and Reconciler.DefaultMaxLease.
	Kinds map[string]KindConfig `yaml:"kinds"`
	// Reconciler configures the sweeps.
	Reconciler ReconcilerFile `yaml:"reconciler"`

	dir string // directory of the file, for relative source files
}

// Template is one periodic job template: every tick of Cron expands Sources × Countries
// into job specs of Kind whose Window is the tick's window.
type Template struct {
	// Name identifies the template in logs, metrics and errors. Required, unique,
	// [A-Za-z0-9._-]{1,64}.
	Name string `yaml:"name"`
	// Cron is a cron expression: 5 fields (minute hour dom month dow), or 6 with seconds
	// first, or a descriptor (@hourly, @daily, @weekly, @monthly, @yearly; @every is
	// refused: windows need wall-clock ticks). It may start with CRON_TZ=<zone>. It matches
	// wall times of Timezone: one a spring-forward gap skips fires at the gap's end with its
	// own window, one that occurs twice fires once (both real hours for a schedule that
	// matches every hour); see wallclock.go.
	Cron string `yaml:"cron"`
	// Timezone is the IANA zone of the cron expression and of the window. Defaults to
	// CRON_TZ when the expression has one, otherwise UTC. Both given must agree.
	Timezone string `yaml:"timezone"`
	// Window is the window rule: daily, hourly, weekly, monthly, minutely or secondly.
	// Required.
	Window WindowRule `yaml:"window"`
	// Kind is the job kind, [a-z][a-z0-9_.-]{0,63}. Required.
	Kind string `yaml:"kind"`
	// Sources are the sources of every tick. At least one is required.
	Sources Sources `yaml:"sources"`
	// Countries are the requested exit countries (ISO 3166-1 alpha-2). At least one.
	Countries []string `yaml:"countries"`
	// ParserVersion of every job, >= 1. Required.
	ParserVersion int `yaml:"parser_version"`
	// Scope (customer / data product), optional.
	Scope string `yaml:"scope"`
	// CatchUp is "last" or "none". Defaults to "last".
	CatchUp string `yaml:"catchup"`
	// RetryUntil is how long after its scheduled time a window whose tick failed is tried
	// again (with backoff) before it is given up as a gap (idemscrape_scheduler_window_gaps,
	// `idemscrape windows -gaps`, filled by `idemscrape windows -fill`); the last try is at
	// the deadline itself, and the template's later windows are ticked meanwhile. Defaults
	// to the time until the template's next scheduled tick. With job_retention it bounds
	// how long one window is ticked (see ReconcilerFile.JobRetention).
	RetryUntil time.Duration `yaml:"retry_until"`

	sched    *wallSchedule // the expression on the zone's wall clock (wallclock.go)
	loc      *time.Location
	filePath string // Sources.File resolved against the config file's directory
}

// Sources are the sources of a template: URLs, source ids, and a file read again on every
// tick (one source per line; a line starting with http:// or https:// is a URL, any other
// non-blank line not starting with '#' is a source id).
type Sources struct {
	URLs []string `yaml:"urls"`
	IDs  []string `yaml:"ids"`
	File string   `yaml:"file"`
}

// KindConfig is the per-kind part of the configuration.
type KindConfig struct {
	// Queue is the asynq queue of the kind's tasks. Defaults to the kind's name. Every
	// enqueuer of a kind must use the same queue (asynq checks task ids per queue).
	Queue string `yaml:"queue"`
	// MaxLease is the longest lease a worker takes for the kind: a running attempt older
	// than this is examined by the reconciler. Defaults to Reconciler.DefaultMaxLease.
	MaxLease time.Duration `yaml:"max_lease"`
}

// ReconcilerFile configures the reconciler in the YAML file.
type ReconcilerFile struct {
	// Disabled turns the reconciler off in this process. Defaults to false.
	Disabled bool `yaml:"disabled"`
	// Interval between sweeps (jittered ±10 %). Defaults to DefaultReconcileInterval.
	Interval time.Duration `yaml:"interval"`
	// OrphanInterval between the passes that give back the active asynq tasks of dead asynq
	// servers (jittered ±10 %; reconciler_orphans.go). Defaults to DefaultOrphanInterval.
	OrphanInterval time.Duration `yaml:"orphan_interval"`
	// BatchSize is the page size of every scan. Defaults to DefaultBatchSize.
	BatchSize int `yaml:"batch_size"`
	// DefaultMaxLease is the longest lease of kinds without kinds.<kind>.max_lease.
	// Defaults to DefaultMaxLease.
	DefaultMaxLease time.Duration `yaml:"default_max_lease"`
	// OutboxLagThreshold: unsent outbox rows older than this are reported. Defaults to
	// DefaultOutboxLagThreshold.
	OutboxLagThreshold time.Duration `yaml:"outbox_lag_threshold"`
	// OutboxRetention: sent outbox rows older than this are deleted. Defaults to
	// DefaultOutboxRetention.
	OutboxRetention time.Duration `yaml:"outbox_retention"`
	// InboxRetention: consumer inbox rows older than this are deleted. It must exceed the
	// longest time an event can be replayed. Defaults to DefaultInboxRetention.
	InboxRetention time.Duration `yaml:"inbox_retention"`
	// SavedInputRetention: saved inputs (store/inputs: the staged data and raw responses a
	// reparse replays) created longer ago than this are deleted, and so are the bodies
	// nothing references any more and no save used for as long. At least
	// inputs.MinRetention (2h). Defaults to DefaultSavedInputRetention.
	SavedInputRetention time.Duration `yaml:"saved_input_retention"`
	// JobRetention: terminal jobs (complete, failed) last changed longer ago than this are
	// deleted with their attempts, results, quarantine, notes and saved inputs. A key
	// enqueued again after that is a new job, so no template may tick one window for this
	// long (from its first tick to its last tick's retry_until: a weekly window with a daily
	// cron needs more than 6 days), and a window first ticked longer ago is never ticked
	// again (store.ErrWindowExpired) unless filled with force. At least MinJobRetention and
	// at least every other retention here except window_retention (a result is kept
	// longest; a consumer's inbox must not take a new job's event for a replay of the pruned
	// one's). Defaults to DefaultJobRetention.
	JobRetention time.Duration `yaml:"job_retention"`
	// WindowRetention: schedule_windows rows (the window ledger) due longer ago than this
	// are deleted. Longer than job_retention: a window is recorded for as long as any of its
	// jobs can be, so a tick of a window whose jobs may have been pruned is refused, and a
	// window due longer ago than this, without a record, is ticked only by a forced fill.
	// Defaults to job_retention + DefaultWindowRetentionMargin.
	WindowRetention time.Duration `yaml:"window_retention"`
	// QuarantineRetention: quarantined staging older than this is deleted, whatever the
	// job's state. At least MinQuarantineRetention, at most JobRetention. Defaults to
	// DefaultQuarantineRetention.
	QuarantineRetention time.Duration `yaml:"quarantine_retention"`
	// PruneBatch bounds the rows deleted per statement. Defaults to DefaultPruneBatch.
	PruneBatch int `yaml:"prune_batch"`
	// RequeueChangedPerSweep bounds the runnable jobs that changed or came due since the
	// last sweep that one sweep checks for a missing asynq task. Defaults to
	// DefaultRequeueChangedPerSweep.
	RequeueChangedPerSweep int `yaml:"requeue_changed_per_sweep"`
	// RequeueScanPerSweep is how many of the other runnable jobs one sweep checks, in key
	// order, resuming where the last sweep stopped. After Redis lost its data every
	// runnable job is checked in one sweep instead. Defaults to DefaultRequeueScanPerSweep.
	RequeueScanPerSweep int `yaml:"requeue_scan_per_sweep"`
}

// ConfigError reports one invalid setting. Section is `template "<name>"` (or
// "templates[<i>]" for a template without a usable name), `kinds "<kind>"`, "reconciler"
// or "file"; Field is the YAML field name.
type ConfigError struct {
	Section string
	Field   string
	Reason  string
}

// Error returns "scheduler: <section>: field <field>: <reason>".
func (e *ConfigError) Error() string {
	return "scheduler: " + e.Section + ": field " + e.Field + ": " + e.Reason
}

// ErrInvalidConfig is matched (errors.Is) by every *ConfigError.
var ErrInvalidConfig = errors.New("scheduler: invalid config")

// Is reports whether target is ErrInvalidConfig.
func (e *ConfigError) Is(target error) bool { return target == ErrInvalidConfig }

// LoadFile reads, parses and validates the configuration at path. Relative source files
// are resolved against the directory of path.
func LoadFile(path string) (*File, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("scheduler: read config: %w", err)
	}
	return ParseFile(b, filepath.Dir(path), tasks.DefaultNormalizer)
}

// ParseFile parses and validates a YAML configuration. dir resolves relative source files;
// n validates the sources (nil: tasks.DefaultNormalizer). Unknown fields are refused with
// an error naming the template and the field.
func ParseFile(b []byte, dir string, n *tasks.Normalizer) (*File, error) {
	var root yaml.Node
	if err := yaml.Unmarshal(b, &root); err != nil {
		return nil, &ConfigError{Section: "file", Field: "-", Reason: err.Error()}
	}
	if err := checkKnownFields(&root); err != nil {
		return nil, err
	}
	f := &File{dir: dir}
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(f); err != nil && !errors.Is(err, io.EOF) {
		return nil, &ConfigError{Section: "file", Field: "-", Reason: err.Error()}
	}
	if err := f.Validate(n); err != nil {
		return nil, err
	}
	return f, nil
}

// checkKnownFields walks the document and refuses a mapping key that names no field, so
// the error can name the template it is in (yaml's own error only gives a line).
func checkKnownFields(root *yaml.Node) error {
	if root.Kind == 0 || len(root.Content) == 0 {
		return nil
	}
	doc := root.Content[0]
	return walkKnown(doc, reflect.TypeOf(File{}), "file", "")
}

func walkKnown(n *yaml.Node, t reflect.Type, section, prefix string) error {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.Struct:
		if n.Kind != yaml.MappingNode || t == reflect.TypeOf(time.Duration(0)) {
			return nil
		}
		fields := map[string]reflect.Type{}
		for i := 0; i < t.NumField(); i++ {
			if tag, _, _ := strings.Cut(t.Field(i).Tag.Get("yaml"), ","); tag != "" && tag != "-" {
				fields[tag] = t.Field(i).Type
			}
		}
		if t == reflect.TypeOf(Template{}) {
			for i := 0; i+1 < len(n.Content); i += 2 {
				if n.Content[i].Value == "name" && n.Content[i+1].Value != "" {
					section = fmt.Sprintf("template %q", n.Content[i+1].Value)
				}
			}
		}
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			ft, ok := fields[k.Value]
			if !ok {
				return &ConfigError{Section: section, Field: prefix + k.Value,
					Reason: fmt.Sprintf("unknown field (line %d)", k.Line)}
			}
			sec, pre := section, prefix+k.Value+"."
			if t == reflect.TypeOf(File{}) {
				sec, pre = k.Value, ""
			}
			if err := walkKnown(v, ft, sec, pre); err != nil {
				return err
			}
		}
	case reflect.Slice:
		if n.Kind != yaml.SequenceNode {
			return nil
		}
		for i, c := range n.Content {
			if err := walkKnown(c, t.Elem(), fmt.Sprintf("%s[%d]", section, i), prefix); err != nil {
				return err
			}
		}
	case reflect.Map:
		if n.Kind != yaml.MappingNode {
			return nil
		}
		for i := 0; i+1 < len(n.Content); i += 2 {
			if err := walkKnown(n.Content[i+1], t.Elem(), fmt.Sprintf("%s %q", section, n.Content[i].Value), prefix); err != nil {
				return err
			}
		}
	}
	return nil
}

// cronParser accepts 5 fields, 6 with seconds first, and descriptors.
var cronParser = cron.NewParser(cron.SecondOptional | cron.Minute | cron.Hour | cron.Dom | cron.Month | cron.Dow | cron.Descriptor)

// Validate checks every setting, fills in defaults and compiles the cron expressions. The
// first problem is returned as a *ConfigError naming the template (or section) and field.
func (f *File) Validate(n *tasks.Normalizer) error {
	if n == nil {
		n = tasks.DefaultNormalizer
	}
	seen := map[string]int{}
	for i := range f.Templates {
		t := &f.Templates[i]
		section := fmt.Sprintf("template %q", t.Name)
		if !safeName(t.Name, 64) {
			reason := "required, want [A-Za-z0-9._-]{1,64}"
			if t.Name != "" {
				reason = "want [A-Za-z0-9._-]{1,64}"
			}
			return &ConfigError{Section: fmt.Sprintf("templates[%d]", i), Field: "name", Reason: reason}
		}
		if j, dup := seen[t.Name]; dup {
			return &ConfigError{Section: section, Field: "name", Reason: fmt.Sprintf("duplicate: templates[%d] has the same name", j)}
		}
		seen[t.Name] = i
		if err := t.validate(n, f.dir); err != nil {
			var ce *ConfigError
			if errors.As(err, &ce) {
				ce.Section = section
			}
			return err
		}
	}
	for kind, kc := range f.Kinds {
		section := fmt.Sprintf("kinds %q", kind)
		if err := (tasks.Spec{Kind: kind}).Validate(); isKindError(err) {
			return &ConfigError{Section: section, Field: "(name)", Reason: "kind names must match [a-z][a-z0-9_.-]{0,63}"}
		}
		if kc.Queue != "" && !safeName(kc.Queue, 128) {
			return &ConfigError{Section: section, Field: "queue", Reason: "want [A-Za-z0-9._-]{1,128}"}
		}
		if kc.MaxLease < 0 {
			return &ConfigError{Section: section, Field: "max_lease", Reason: "negative"}
		}
	}
	r := &f.Reconciler
	for _, d := range []struct {
		name string
		v    *time.Duration
		def  time.Duration
	}{
		{"interval", &r.Interval, DefaultReconcileInterval},
		{"orphan_interval", &r.OrphanInterval, DefaultOrphanInterval},
		{"default_max_lease", &r.DefaultMaxLease, DefaultMaxLease},
		{"outbox_lag_threshold", &r.OutboxLagThreshold, DefaultOutboxLagThreshold},
		{"outbox_retention", &r.OutboxRetention, DefaultOutboxRetention},
		{"inbox_retention", &r.InboxRetention, DefaultInboxRetention},
		{"saved_input_retention", &r.SavedInputRetention, DefaultSavedInputRetention},
		{"job_retention", &r.JobRetention, DefaultJobRetention},
		{"quarantine_retention", &r.QuarantineRetention, DefaultQuarantineRetention},
	} {
		if *d.v < 0 {
			return &ConfigError{Section: "reconciler", Field: d.name, Reason: "negative"}
		}
		if *d.v == 0 {
			*d.v = d.def
		}
	}
	switch {
	case r.WindowRetention < 0:
		return &ConfigError{Section: "reconciler", Field: "window_retention", Reason: "negative"}
	case r.WindowRetention == 0:
		r.WindowRetention = r.JobRetention + DefaultWindowRetentionMargin
	}
	if r.SavedInputRetention < inputs.MinRetention {
		return &ConfigError{Section: "reconciler", Field: "saved_input_retention", Reason: fmt.Sprintf(
			"%v is below the minimum %v (a save refreshes a shared body's last use at most hourly, so a shorter retention could delete a body in use)",
			r.SavedInputRetention, inputs.MinRetention)}
	}
	for _, c := range []struct {
		name string
		v    *int
		def  int
		max  int
	}{{"batch_size", &r.BatchSize, DefaultBatchSize, 100_000}, {"prune_batch", &r.PruneBatch, DefaultPruneBatch, 100_000},
		{"requeue_changed_per_sweep", &r.RequeueChangedPerSweep, DefaultRequeueChangedPerSweep, 1_000_000},
		{"requeue_scan_per_sweep", &r.RequeueScanPerSweep, DefaultRequeueScanPerSweep, 1_000_000}} {
		if *c.v < 0 || *c.v > c.max {
			return &ConfigError{Section: "reconciler", Field: c.name, Reason: fmt.Sprintf("%d out of range, want 1..%d", *c.v, c.max)}
		}
		if *c.v == 0 {
			*c.v = c.def
		}
	}
	// A Redis loss is recovered by publishing again the rows sent within the dispatchers'
	// recover window: rows pruned sooner could not be.
	if r.OutboxRetention < outbox.DefaultRecoverWindow {
		return &ConfigError{Section: "reconciler", Field: "outbox_retention", Reason: fmt.Sprintf(
			"%v is shorter than the outbox dispatchers' Redis-loss recover window (outbox.DispatcherConfig.RecoverWindow, %v): sent rows pruned sooner could not be published again after a Redis loss",
			r.OutboxRetention, outbox.DefaultRecoverWindow)}
	}
	// An event can be published again (a lost mark, a Redis loss) as long as its outbox row
	// is kept: the inbox must still know it then.
	if r.InboxRetention <= r.OutboxRetention {
		return &ConfigError{Section: "reconciler", Field: "inbox_retention", Reason: fmt.Sprintf(
			"%v must exceed outbox_retention %v: an event can be published again while its outbox row is kept, and a consumer's inbox must still recognise it",
			r.InboxRetention, r.OutboxRetention)}
	}
	if err := r.validateRetention(); err != nil {
		return err
	}
	return f.validateWindowSpans()
}

// validateRetention checks the job and quarantine retentions against their minimums and
// against the other retentions, naming both settings.
func (r *ReconcilerFile) validateRetention() error {
	switch {
	case r.JobRetention < MinJobRetention:
		return &ConfigError{Section: "reconciler", Field: "job_retention", Reason: fmt.Sprintf(
			"%v is below the minimum %v", r.JobRetention, MinJobRetention)}
	case r.QuarantineRetention < MinQuarantineRetention:
		return &ConfigError{Section: "reconciler", Field: "quarantine_retention", Reason: fmt.Sprintf(
			"%v is below the minimum %v", r.QuarantineRetention, MinQuarantineRetention)}
	case r.QuarantineRetention > r.JobRetention:
		return &ConfigError{Section: "reconciler", Field: "quarantine_retention", Reason: fmt.Sprintf(
			"%v exceeds job_retention %v: a job's quarantine is deleted with the job", r.QuarantineRetention, r.JobRetention)}
	case r.WindowRetention <= r.JobRetention:
		return &ConfigError{Section: "reconciler", Field: "window_retention", Reason: fmt.Sprintf(
			"%v must exceed job_retention %v: the window ledger must outlive a window's jobs, or a window whose jobs were pruned would be ticked again and its jobs created anew",
			r.WindowRetention, r.JobRetention)}
	}
	for _, o := range []struct {
		name string
		v    time.Duration
		why  string
	}{
		{"inbox_retention", r.InboxRetention, "a key enqueued again after its job was pruned is a new job, and a consumer's inbox that still knew the pruned job's event would drop the new one's as a replay"},
		{"outbox_retention", r.OutboxRetention, "an event would outlive its result"},
		{"saved_input_retention", r.SavedInputRetention, "saved inputs are deleted with their job, so they could not be kept that long"},
	} {
		if r.JobRetention < o.v {
			return &ConfigError{Section: "reconciler", Field: "job_retention", Reason: fmt.Sprintf(
				"%v is shorter than %s %v: %s", r.JobRetention, o.name, o.v, o.why)}
		}
	}
	return nil
}

func isKindError(err error) bool {
	var fe *tasks.FieldError
	return errors.As(err, &fe) && fe.Field == "Kind"
}

// QueueFor returns the asynq queue of kind: kinds.<kind>.queue, or the kind's name.
func (f *File) QueueFor(kind string) string {
	if kc, ok := f.Kinds[kind]; ok && kc.Queue != "" {
		return kc.Queue
	}
	return kind
}

// MaxLeaseFor returns the longest lease of kind: kinds.<kind>.max_lease, or
// reconciler.default_max_lease.
func (f *File) MaxLeaseFor(kind string) time.Duration {
	if kc, ok := f.Kinds[kind]; ok && kc.MaxLease > 0 {
		return kc.MaxLease
	}
	if f.Reconciler.DefaultMaxLease > 0 {
		return f.Reconciler.DefaultMaxLease
	}
	return DefaultMaxLease
}

func safeName(s string, max int) bool {
	if s == "" || len(s) > max {
		return false
	}
	for i := 0; i < len(s); i++ {
		if !isSafeByte(s[i]) {
			return false
		}
	}
	return true
}

func isSafeByte(b byte) bool {
	return ('a' <= b && b <= 'z') || ('A' <= b && b <= 'Z') || ('0' <= b && b <= '9') || b == '.' || b == '_' || b == '-'
}

// specFields maps tasks.Spec field names to the template's YAML fields.
var specFields = map[string]string{
	"Kind": "kind", "URL": "sources.urls", "SourceID": "sources.ids", "Country": "countries",
	"Window": "window", "ParserVersion": "parser_version", "Scope": "scope",
}

// validate checks t, fills in its defaults and compiles its schedule, in three steps: the
// zone and cron expression (compileSchedule), the other fields, and the specs its inline
// sources and countries make (validateSpecs). Errors are *ConfigError without a Section
// (File.Validate names the template).
func (t *Template) validate(n *tasks.Normalizer, dir string) error {
	if err := t.compileSchedule(); err != nil {
		return err
	}
	if !t.Window.Valid() {
		return templateFail("window", "%q is not a window rule, want one of %v", string(t.Window), WindowRules)
	}
	if err := (tasks.Spec{Kind: t.Kind}).Validate(); isKindError(err) {
		var fe *tasks.FieldError
		errors.As(err, &fe)
		return templateFail("kind", "%s", fe.Reason)
	}
	switch t.CatchUp {
	case "":
		t.CatchUp = DefaultCatchUp
	case CatchUpLast, CatchUpNone:
	default:
		return templateFail("catchup", "%q, want %q or %q", t.CatchUp, CatchUpLast, CatchUpNone)
	}
	if t.ParserVersion < 1 {
		return templateFail("parser_version", "%d, want >= 1", t.ParserVersion)
	}
	if t.RetryUntil < 0 {
		return templateFail("retry_until", "%v, want a positive duration (or none: until the next tick)", t.RetryUntil)
	}
	if len(t.Countries) == 0 {
		return templateFail("countries", "at least one country is required")
	}
	if len(t.Sources.URLs) == 0 && len(t.Sources.IDs) == 0 && t.Sources.File == "" {
		return templateFail("sources", "at least one of urls, ids or file is required")
	}
	if t.Sources.File != "" {
		t.filePath = t.Sources.File
		if !filepath.IsAbs(t.filePath) && dir != "" {
			t.filePath = filepath.Join(dir, t.filePath)
		}
		if _, err := readSourceFile(t.filePath); err != nil {
			return templateFail("sources.file", "%v", err)
		}
	}
	return t.validateSpecs(n)
}

// templateFail is a *ConfigError on one field of a template (Section filled in by
// File.Validate).
func templateFail(field, format string, args ...any) error {
	return &ConfigError{Field: field, Reason: fmt.Sprintf(format, args...)}
}

// compileSchedule resolves the template's zone (Timezone, or the expression's CRON_TZ= /
// TZ= prefix; both given must agree; UTC by default), parses the cron expression in it
// and sets t.sched, t.loc and t.Timezone.
func (t *Template) compileSchedule() error {
	spec := strings.TrimSpace(t.Cron)
	if spec == "" {
		return templateFail("cron", "required")
	}
	zone := t.Timezone
	if strings.HasPrefix(spec, "CRON_TZ=") || strings.HasPrefix(spec, "TZ=") {
		_, rest, _ := strings.Cut(spec, "=")
		tz, expr, ok := strings.Cut(rest, " ")
		if !ok || strings.TrimSpace(expr) == "" {
			return templateFail("cron", "CRON_TZ=<zone> must be followed by an expression")
		}
		if zone != "" && zone != tz {
			return templateFail("timezone", "%q disagrees with the cron expression's CRON_TZ=%s", zone, tz)
		}
		zone, spec = tz, strings.TrimSpace(expr)
	}
	if zone == "" {
		zone = DefaultTimezone
	}
	loc, err := time.LoadLocation(zone)
	if err != nil || zone == "Local" {
		return templateFail("timezone", "unknown time zone %q (want an IANA name such as Europe/Berlin)", zone)
	}
	if strings.HasPrefix(spec, "@every") {
		return templateFail("cron", "@every is not allowed: windows need ticks on the wall clock (use a cron expression)")
	}
	sched, err := cronParser.Parse(spec)
	if err != nil {
		return templateFail("cron", "%v", err)
	}
	ss, ok := sched.(*cron.SpecSchedule)
	if !ok {
		return templateFail("cron", "unsupported schedule %T", sched)
	}
	ss.Location = loc
	if ss.Next(time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)).IsZero() {
		return templateFail("cron", "the expression never fires")
	}
	t.sched, t.loc, t.Timezone = newWallSchedule(ss, loc, t.Window), loc, zone
	return nil
}

// validateSpecs checks that every inline source and country makes a valid spec with n;
// the window is checked with a sample tick. The source file's lines are not: a bad line is
// skipped and counted at the tick (TickReport.Invalid).
func (t *Template) validateSpecs(n *tasks.Normalizer) error {
	win, _ := t.Window.Window(time.Date(2026, 4, 23, 14, 0, 0, 0, time.UTC), t.loc)
	probe := tasks.Spec{Kind: t.Kind, SourceID: "probe", Window: win, ParserVersion: t.ParserVersion, Scope: t.Scope}
	for i, c := range t.Countries {
		p := probe
		p.Country = c
		if _, err := n.Normalize(p); err != nil {
			return specFail(err, fmt.Sprintf("countries[%d]", i))
		}
	}
	probe.Country = t.Countries[0]
	for i, u := range t.Sources.URLs {
		p := probe
		p.SourceID, p.URL = "", u
		if _, err := n.Normalize(p); err != nil {
			return specFail(err, fmt.Sprintf("sources.urls[%d]", i))
		}
	}
	for i, id := range t.Sources.IDs {
		p := probe
		p.SourceID = id
		if _, err := n.Normalize(p); err != nil {
			return specFail(err, fmt.Sprintf("sources.ids[%d]", i))
		}
	}
	return nil
}

// specFail turns a spec validation error into a ConfigError on the YAML field it came from.
func specFail(err error, sourceField string) error {
	var fe *tasks.FieldError
	if !errors.As(err, &fe) {
		return &ConfigError{Field: sourceField, Reason: err.Error()}
	}
	field := specFields[fe.Field]
	switch {
	case fe.Field == "URL" || fe.Field == "SourceID" || fe.Field == "Country":
		field = sourceField
	case field == "":
		field = fe.Field
	}
	return &ConfigError{Field: field, Reason: fe.Reason}
}

// maxSourceFileLines bounds a source file, so a wrong path (a log file) fails loudly.
const maxSourceFileLines = 1_000_000

// readSourceFile reads a source file: one source per line, URLs (http:// or https://) or
// source ids; blank lines and lines starting with '#' are skipped.
func readSourceFile(path string) ([]source, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []source
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 64<<10)
	for line := 1; sc.Scan(); line++ {
		s := strings.TrimSpace(sc.Text())
		if s == "" || strings.HasPrefix(s, "#") {
			continue
		}
		if len(out) >= maxSourceFileLines {
			return nil, fmt.Errorf("%s: more than %d sources", path, maxSourceFileLines)
		}
		lower := strings.ToLower(s)
		if strings.HasPrefix(lower, "http://") || strings.HasPrefix(lower, "https://") {
			out = append(out, source{url: s, line: line})
		} else {
			out = append(out, source{id: s, line: line})
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return out, nil
}

// source is one URL or source id of a template.
type source struct {
	url, id string
	line    int // line in the source file, 0 for inline sources
}

// spanSampleFires and spanSampleDays bound the fires windowSpan examines.
const (
	spanSampleFires = 20_000
	spanSampleDays  = 400
)

// windowSpan is the longest time t ticks one window on schedule: from a window's first
// fire to its last, plus retry_until. It is measured over a year of fires from 2026
// (every month and DST change); a template firing more often than the sample holds is
// taken to tick its windows from their start to their end (ruleSpan).
func (t *Template) windowSpan() time.Duration {
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	end := start.AddDate(0, 0, spanSampleDays)
	first := map[string]time.Time{}
	var span time.Duration
	n := 0
	f := t.sched.nextFire(start, nil)
	for ; !f.IsZero() && f.At.Before(end) && n < spanSampleFires; f = t.sched.nextFire(f.At, &f) {
		n++
		if at, ok := first[f.Window]; ok {
			span = max(span, f.At.Sub(at))
		} else {
			first[f.Window] = f.At
		}
	}
	if n == spanSampleFires {
		span = max(span, t.Window.ruleSpan())
	}
	return span + t.RetryUntil
}

// ruleSpan is the longest a window of rule r lasts (a day of 25 hours, a month of 31 days
// and one).
func (r WindowRule) ruleSpan() time.Duration {
	switch r {
	case Secondly:
		return time.Second
	case Minutely:
		return time.Minute
	case Hourly:
		return time.Hour
	case Daily:
		return 25 * time.Hour
	case Weekly:
		return 7*24*time.Hour + time.Hour
	case Monthly:
		return 31*24*time.Hour + time.Hour
	}
	return 0
}

// validateWindowSpans refuses a template that ticks one window for as long as
// job_retention or longer: once the window's first jobs were pruned, a later tick would
// create them again (fetched, committed and published again under the same event keys,
// after consumers' inboxes forgot them).
func (f *File) validateWindowSpans() error {
	jr := f.Reconciler.JobRetention
	for i := range f.Templates {
		t := &f.Templates[i]
		if span := t.windowSpan(); span >= jr {
			return &ConfigError{Section: "reconciler", Field: "job_retention", Reason: fmt.Sprintf(
				"%v is not longer than the %v over which template %q ticks one %s window (cron %q, from the window's first tick to its last tick's retry_until %v): once the window's first jobs are pruned a later tick would create them again, fetched, committed and published again under the same event keys; raise job_retention above %v or tick the template once per window",
				jr, span, t.Name, t.Window, t.Cron, t.RetryUntil, span)}
		}
	}
	return nil
}
