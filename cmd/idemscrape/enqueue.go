package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/hibiken/asynq"

	"github.com/idemscrape/idemscrape/cmd/internal/quote"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/tasks"
)

var migrateCmd = command{
	name: "migrate", summary: "Apply the pending database migrations (safe to run from many processes at once).",
	setFlags: func(fs *flag.FlagSet) func(context.Context, *cli, []string) error {
		return func(ctx context.Context, c *cli, _ []string) error {
			pool, err := connect(ctx)
			if err != nil {
				return err
			}
			defer pool.Close()
			applied, err := store.Migrate(ctx, pool, slog.New(slog.NewTextHandler(c.stderr, nil)))
			if err != nil {
				return err
			}
			fmt.Fprintf(c.stdout, "applied %d migration(s): %v\n", len(applied), applied)
			return nil
		}
	},
}

// specFlags registers the flags of one spec.
func specFlags(fs *flag.FlagSet, s *tasks.Spec) {
	fs.StringVar(&s.Kind, "kind", "", "job kind (workflow type)")
	fs.StringVar(&s.URL, "url", "", "source URL (or -source-id)")
	fs.StringVar(&s.SourceID, "source-id", "", "source record id (or -url)")
	fs.StringVar(&s.Country, "country", "", "exit country, ISO 3166-1 alpha-2, e.g. US (required: a job is for the exits of one country; there is no \"any exit\" value)")
	fs.StringVar(&s.Window, "window", "", "collection window in the kind's format, e.g. 2026-04-23 (daily), 2026-04-23T14, 2026-W17, 2026-04 (required)")
	fs.IntVar(&s.ParserVersion, "parser-version", 0, "parser version, 1 or more (required)")
	fs.StringVar(&s.Scope, "scope", "", "customer / data product scope (optional)")
}

var keyCmd = command{
	name: "key", summary: "Print the job key of a spec without storing anything.",
	setFlags: func(fs *flag.FlagSet) func(context.Context, *cli, []string) error {
		var s tasks.Spec
		specFlags(fs, &s)
		return func(_ context.Context, c *cli, _ []string) error {
			key, err := s.Key()
			if err != nil {
				return flagSpecError(err, s)
			}
			fmt.Fprintln(c.stdout, key)
			return nil
		}
	},
}

var enqueueCmd = command{
	name: "enqueue",
	summary: "Record jobs and enqueue their tasks: one spec from the flags, or JSON lines from -f FILE (- for stdin),\n" +
		"one spec a line with the fields kind, url | source_id, country, window, parser_version, scope.\n" +
		"Each line is checked before it is stored; bad lines are reported by number and field and not stored, the good ones are.\n" +
		"A file is stored in batches of -batch lines (one PostgreSQL statement, the tasks enqueued side by side), with a\n" +
		"progress line on stderr; if it stops midway it says which lines are stored, and running the same file again\n" +
		"resumes it (stored lines are recognised as duplicates).\n" +
		"Tasks go to the kind's queue (tasks.QueueFor) unless -queue or IDEMSCRAPE_QUEUE names one ([A-Za-z0-9._-]{1,128}).\n" +
		"A kind must be known (built in, a job of it stored, or a worker serving its queue) unless -allow-unknown-kind,\n" +
		"and a window must be a real date in the kind's format (" + windowFormsText + ";\n" +
		"any format for a kind whose stored jobs use another, or for an unknown kind allowed).",
	setFlags: func(fs *flag.FlagSet) func(context.Context, *cli, []string) error {
		var s tasks.Spec
		specFlags(fs, &s)
		file := fs.String("f", "", "read JSON-lines specs from `FILE` (- for stdin) instead of the spec flags")
		// Not the variable's value as the default: -h would print whatever it holds.
		queue := fs.String("queue", "", "asynq queue of new jobs, [A-Za-z0-9._-]{1,128} (default: $IDEMSCRAPE_QUEUE, else the kind's, where cmd/worker listens; a job keeps the queue it was created with)")
		asJSON := fs.Bool("json", false, "print one JSON object per spec (with -f, per refused line too: outcome \"refused\") instead of text")
		allowUnknown := fs.Bool("allow-unknown-kind", false, "enqueue a kind no worker serves and no stored job has (its window is then only checked for its characters)")
		allowLoopback := fs.Bool("allow-loopback", false, "allow source URLs on 127.0.0.0/8, ::1 and localhost (local development and tests only, like the worker's -allow-loopback)")
		// Both are checked as they are parsed, so that a bad value is a usage error before
		// any database is reached.
		batch, progress := new(int), new(time.Duration)
		*batch, *progress = defaultBatch, time.Second
		fs.Func("batch", fmt.Sprintf("with -f: specs stored per batch (1 to %d) (default %d)", maxBatch, defaultBatch), func(v string) error {
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 || n > maxBatch {
				return fmt.Errorf("%s must be a whole number from 1 to %d", quote.Input(v), maxBatch)
			}
			*batch = n
			return nil
		})
		fs.Func("progress", "with -f: at most one progress line on stderr per `INTERVAL` (0: one per batch); none for a file of one batch (default 1s)", func(v string) error {
			d, err := time.ParseDuration(v)
			if err != nil || d < 0 {
				return fmt.Errorf("%s must be a duration of 0 or more, e.g. 1s or 500ms", quote.Input(v))
			}
			*progress = d
			return nil
		})
		return func(ctx context.Context, c *cli, _ []string) error {
			fileOnly := map[string]bool{"f": true, "queue": true, "json": true, "batch": true, "progress": true,
				"allow-unknown-kind": true, "allow-loopback": true}
			if *queue == "" {
				*queue = os.Getenv("IDEMSCRAPE_QUEUE")
			}
			if *queue != "" {
				// Before anything is stored: a job keeps its queue for life.
				if err := checkQueue(*queue); err != nil {
					return usageError{"-queue ($IDEMSCRAPE_QUEUE): " + err.Error()}
				}
			}
			// Every setting before the database: a bad IDEMSCRAPE_REDIS is a usage error
			// (exit 2) whether or not PostgreSQL answers.
			if _, err := redisConfig(); err != nil {
				return err
			}
			dest := tasks.StrictDestinationPolicy()
			if *allowLoopback {
				dest = tasks.LoopbackPolicy()
			}
			newRun := func() *enqueueRun {
				r := &enqueueRun{c: c, queue: *queue, asJSON: *asJSON, batch: *batch, progress: *progress, dest: dest}
				r.kindCheck = &kindChecker{allowUnknown: *allowUnknown, queue: *queue, lookup: r.lookupKind}
				return r
			}
			if *file == "" {
				var set []string
				fs.Visit(func(f *flag.Flag) {
					if f.Name == "batch" || f.Name == "progress" {
						set = append(set, "-"+f.Name)
					}
				})
				if len(set) > 0 {
					return usageError{"flag(s) " + strings.Join(set, " ") + " apply to -f FILE only"}
				}
				if err := checkSpec(s, dest); err != nil {
					return flagSpecError(err, s)
				}
				r := newRun()
				defer r.close()
				msg, err := r.kindCheck.check(ctx, s, flagField)
				if err != nil {
					return err
				}
				if msg != "" {
					return usageError{"invalid spec: " + msg}
				}
				if _, err := r.enqueue(ctx, []tasks.Spec{s}, []int{0}); err != nil {
					return r.reportOne(err)
				}
				r.warnUnserved()
				return nil
			}
			set := ""
			fs.Visit(func(f *flag.Flag) {
				if !fileOnly[f.Name] {
					set += " -" + f.Name
				}
			})
			if set != "" {
				return usageError{"-f reads the specs from a file: the spec flag(s)" + set + " can not be combined with it"}
			}
			r := newRun()
			defer r.close()
			return r.file(ctx, *file)
		}
	},
}

// defaultBatch and maxBatch bound `enqueue -f -batch`: a batch is one PostgreSQL statement
// (its rows in arrays) and, at most, that many task enqueues; 500 keeps a statement well
// under a second and a failure's lost work small.
const (
	defaultBatch = 500
	maxBatch     = 100_000
)

// enqueueConcurrency is how many asynq task enqueues of a batch run side by side
// (tasks.EnqueuerConfig.Concurrency). asynq's Client has no pipeline API, and sending its
// enqueue script ourselves in a pipeline would tie this command to asynq's internal key
// layout and message encoding, which change between versions. Its own EnqueueContext on up
// to 16 connections of the client's pool (asynq's default holds 10 per CPU) overlaps the
// round trips instead of paying them one after the other, and keeps every check asynq and
// tasks.Enqueuer make (task id = job key, conflicts inspected, the recorded queue).
const enqueueConcurrency = 16

// lineError is one refused line of a JSON-lines file.
type lineError struct {
	line int
	msg  string
}

// specLine is one JSON line: a spec in snake_case.
type specLine struct {
	Kind          string `json:"kind"`
	URL           string `json:"url"`
	SourceID      string `json:"source_id"`
	Country       string `json:"country"`
	Window        string `json:"window"`
	ParserVersion int    `json:"parser_version"`
	Scope         string `json:"scope"`
}

// jsonField is the JSON-lines name of each tasks.Spec field (FieldError.Field).
var jsonField = map[string]string{
	"Kind": "kind", "URL": "url", "SourceID": "source_id", "Country": "country", "Window": "window",
	"ParserVersion": "parser_version", "Scope": "scope",
}

// flagField is the flag of each tasks.Spec field.
var flagField = map[string]string{
	"Kind": "-kind", "URL": "-url", "SourceID": "-source-id", "Country": "-country", "Window": "-window",
	"ParserVersion": "-parser-version", "Scope": "-scope",
}

// checkSpec validates s as Enqueue would (normalisation, key, destination policy), so that
// nothing reaches the store unless it would be accepted.
func checkSpec(s tasks.Spec, dest *tasks.DestinationPolicy) error {
	norm, err := s.Normalize()
	if err != nil {
		return err
	}
	if _, err := norm.Key(); err != nil {
		return err
	}
	if norm.URL != "" {
		return dest.CheckURL(norm.URL)
	}
	return nil
}

// fieldMessage renders a spec error of s with the field named as names maps it, and the
// byte a reason points at spelled as every CLI error spells one (quote.Byte).
func fieldMessage(err error, names map[string]string, s tasks.Spec) string {
	var fe *tasks.FieldError
	if errors.As(err, &fe) {
		name := names[fe.Field]
		if name == "" {
			name = fe.Field
		}
		reason := byteReason(fe.Reason, specField(s, fe.Field))
		if fe.Field == "URL" && strings.Contains(reason, "URL or SourceID") {
			// Neither or both of the two: the message names both, as the user spells them.
			name = names["URL"] + " / " + names["SourceID"]
			reason = strings.Replace(reason, "URL or SourceID", names["URL"]+" or "+names["SourceID"], 1)
		}
		return fmt.Sprintf("field %s: %s", name, reason)
	}
	return err.Error()
}

// jsonKind is the JSON name of a Go reflect kind in a type error.
func jsonKind(k string) string {
	switch k {
	case "int", "int64", "float64":
		return "number"
	case "struct", "map":
		return "object"
	}
	return k
}

func flagSpecError(err error, s tasks.Spec) error {
	return usageError{"invalid spec: " + fieldMessage(err, flagField, s)}
}

// specField is the text of s's field named as tasks.FieldError names it ("" for another).
func specField(s tasks.Spec, field string) string {
	switch field {
	case "Kind":
		return s.Kind
	case "URL":
		return s.URL
	case "SourceID":
		return s.SourceID
	case "Country":
		return s.Country
	case "Window":
		return s.Window
	case "Scope":
		return s.Scope
	}
	return ""
}

// tasks' reasons that point at a byte of the value, by offset ("byte 3 not allowed",
// "control character U+001B at byte 3"), or at none ("not valid UTF-8").
var (
	byteAtRE = regexp.MustCompile(`^byte (\d+)( not allowed.*)$`)
	charAtRE = regexp.MustCompile(`^(control|non-printable) character U\+[0-9A-F]+ at byte (\d+)(.*)$`)
)

// byteReason rewrites a tasks.FieldError reason about value v so that the byte it points
// at reads as quote.Byte spells it: `byte 3 ("\xff") not allowed`, `control character at
// byte 3 ("\x1b")`, `not valid UTF-8 at byte 3 ("\xff")`. Any other reason is as it was.
func byteReason(reason, v string) string {
	at := func(s string) (int, bool) {
		n, err := strconv.Atoi(s)
		return n, err == nil && n < len(v)
	}
	if m := byteAtRE.FindStringSubmatch(reason); m != nil {
		if n, ok := at(m[1]); ok {
			return quote.Byte(v, n) + m[2]
		}
	}
	if m := charAtRE.FindStringSubmatch(reason); m != nil {
		if n, ok := at(m[2]); ok {
			return m[1] + " character at " + quote.Byte(v, n) + m[3]
		}
	}
	if reason == "not valid UTF-8" {
		if why := quote.CheckUTF8(v); why != "" {
			return why
		}
	}
	return reason
}

// maxSpecLine bounds one JSON line of `enqueue -f`: a longer line is refused alone (its
// line number reported), the others are read on.
const maxSpecLine = 1 << 20

// readLine reads one line (without its newline) of at most max bytes; a longer line is
// read to its end and discarded, tooLong set. err is io.EOF after the last line.
func readLine(br *bufio.Reader, max int) (line []byte, tooLong bool, err error) {
	for {
		chunk, isPrefix, err := br.ReadLine()
		if !tooLong {
			if len(line)+len(chunk) > max {
				tooLong, line = true, nil
			} else {
				line = append(line, chunk...)
			}
		}
		if err != nil || !isPrefix {
			return line, tooLong, err
		}
	}
}

// checkKeys checks the keys of the JSON object line and returns what is wrong ("" when
// nothing is, or the line is not an object: the decoder says why). encoding/json matches
// keys without regard to case (Unicode folding included) and keeps the last of two, so
// `{"kind":"a","KIND":"b"}` would silently be kind b: every key must be one of the fields
// exactly, and given once.
func checkKeys(line []byte) string {
	dec := json.NewDecoder(bytes.NewReader(line))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return ""
	}
	seen := map[string]bool{}
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return ""
		}
		k, ok := t.(string)
		if !ok {
			return ""
		}
		if !specFields[k] {
			return fmt.Sprintf("unknown field %s (fields, lower case: kind, url, source_id, country, window, parser_version, scope)", quote.Input(k))
		}
		if seen[k] {
			return fmt.Sprintf("field %s is given twice", k)
		}
		seen[k] = true
		var skip json.RawMessage
		if err := dec.Decode(&skip); err != nil {
			return ""
		}
	}
	return ""
}

// specFields are the keys of a JSON spec line.
var specFields = map[string]bool{"kind": true, "url": true, "source_id": true, "country": true, "window": true, "parser_version": true, "scope": true}

// parseSpecLine decodes and checks one line (a URL against dest); msg names the field that
// is wrong.
func parseSpecLine(line []byte, dest *tasks.DestinationPolicy) (tasks.Spec, string) {
	if msg := checkKeys(line); msg != "" {
		return tasks.Spec{}, msg
	}
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.DisallowUnknownFields()
	var l specLine
	if err := dec.Decode(&l); err != nil {
		var te *json.UnmarshalTypeError
		var se *json.SyntaxError
		switch {
		case errors.As(err, &te) && te.Field == "":
			// The line itself is not an object (an array, a string, a number).
			return tasks.Spec{}, fmt.Sprintf("a JSON %s, not a spec: each line is one JSON object, e.g. "+
				`{"kind":"catalog","source_id":"sku-1","country":"US","window":"2026-04-23","parser_version":1}`, te.Value)
		case errors.As(err, &te):
			return tasks.Spec{}, fmt.Sprintf("field %s: must be a JSON %s, not %s", te.Field, jsonKind(te.Type.Kind().String()), te.Value)
		case errors.As(err, &se):
			return tasks.Spec{}, fmt.Sprintf("not a JSON object: %v", err)
		case strings.HasPrefix(err.Error(), "json: unknown field "):
			return tasks.Spec{}, fmt.Sprintf("%s (fields: kind, url, source_id, country, window, parser_version, scope)",
				strings.TrimPrefix(err.Error(), "json: "))
		default:
			return tasks.Spec{}, fmt.Sprintf("not a JSON object: %v", err)
		}
	}
	if dec.More() {
		if bytes.ContainsRune(line, '\r') {
			// A file whose lines end in CR alone (classic Mac) reads as one line.
			return tasks.Spec{}, "more than one JSON value on the line, separated by a carriage return (CR): " +
				"lines must end in LF or CRLF, not CR alone (convert the file, e.g. tr '\\r' '\\n')"
		}
		return tasks.Spec{}, "more than one JSON value on the line (one spec per line)"
	}
	s := tasks.Spec{Kind: l.Kind, URL: l.URL, SourceID: l.SourceID, Country: l.Country, Window: l.Window,
		ParserVersion: l.ParserVersion, Scope: l.Scope}
	// The line is valid UTF-8, but an escape of half a surrogate pair ("\ud800") decodes to
	// U+FFFD: refused, as invalid UTF-8 is.
	if !bytes.ContainsRune(line, utf8.RuneError) {
		for name, v := range map[string]string{"kind": s.Kind, "url": s.URL, "source_id": s.SourceID, "country": s.Country, "window": s.Window, "scope": s.Scope} {
			if strings.ContainsRune(v, utf8.RuneError) {
				return tasks.Spec{}, fmt.Sprintf("field %s: an escape of half a surrogate pair (\\uD800-\\uDFFF alone) is not text", name)
			}
		}
	}
	if err := checkSpec(s, dest); err != nil {
		return tasks.Spec{}, fieldMessage(err, jsonField, s)
	}
	return s, ""
}

// newEnqueuer returns an Enqueuer on IDEMSCRAPE_REDIS (or IDEMSCRAPE_REDIS_CLUSTER) with an Inspector (an archived task
// holding a key is repaired) and the queue override, and a func that closes both clients.
func newEnqueuer(ctx context.Context, c *cli, queue string) (*tasks.Enqueuer, *asynq.Inspector, func(), error) {
	return newEnqueuerWith(ctx, c, tasks.EnqueuerConfig{Queue: queue})
}

// newEnqueuerWith is newEnqueuer with the rest of cfg (its Inspector is set here).
func newEnqueuerWith(ctx context.Context, c *cli, cfg tasks.EnqueuerConfig) (*tasks.Enqueuer, *asynq.Inspector, func(), error) {
	rc, err := redisConfig()
	if err != nil {
		return nil, nil, nil, err
	}
	pool, err := c.db(ctx)
	if err != nil {
		return nil, nil, nil, err
	}
	redisOpt := rc.AsynqConnOpt()
	client := asynq.NewClient(redisOpt)
	insp := asynq.NewInspector(redisOpt)
	// EnqueuerConfig.Redis: a spec whose job exists and whose task asynq holds is found so
	// by one HGET, pipelined with the batch's others (one round trip a batch), instead of
	// asynq's enqueue script, its id conflict and an inspection of the task (6 Redis
	// commands and 3 round trips a spec): re-running a file costs less than its first run,
	// and a requeue's enqueue as little.
	rdb := rc.NewClient()
	closeAll := func() {
		_ = insp.Close()
		_ = client.Close()
		_ = rdb.Close()
	}
	cfg.Inspector, cfg.Redis = insp, rdb
	enq, err := tasks.NewEnqueuer(client, store.New(pool), &cfg)
	if err != nil {
		closeAll()
		return nil, nil, nil, err
	}
	return enq, insp, closeAll, nil
}

// warnUnserved warns about each queue the specs went to that no asynq server (worker)
// listens on: the jobs are stored and queued, and wait until a worker serves the queue.
func warnUnserved(c *cli, insp *asynq.Inspector, specs []tasks.Spec, queue string) {
	servers, err := insp.Servers()
	if err != nil {
		return // a warning only; the enqueue itself succeeded
	}
	served := map[string]bool{}
	for _, s := range servers {
		for q := range s.Queues {
			served[q] = true
		}
	}
	warned := map[string]bool{}
	for _, s := range specs {
		q := queue
		if q == "" {
			q = tasks.QueueFor(s.Kind)
		}
		if served[q] || warned[q] {
			continue
		}
		warned[q] = true
		fmt.Fprintf(c.stderr, "warning: no worker serves queue %q (kind %s): the jobs wait until one does. "+
			"A worker serves the queues of the kinds it registered (cmd/worker -queues); asynqmon's Servers page lists what each serves.\n", q, s.Kind)
	}
}
