package main

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"

	"github.com/idemscrape/idemscrape/cmd/internal/quote"
	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/tasks"
)

// windowForms are the window formats of the scheduler's window rules (scheduler.WindowRule):
// what every kind's windows look like unless the kind's jobs show another format. An
// hourly, minutely or secondly window may end in the UTC offset of a repeated (fall-back)
// hour. Each is also parsed as a time, so that 2026-13-45 is refused.
var windowForms = []struct {
	rule   string
	re     *regexp.Regexp
	layout string // time layout of the part before any offset; "" for weekly
}{
	{"daily", regexp.MustCompile(`^\d{4}-\d\d-\d\d$`), "2006-01-02"},
	{"hourly", regexp.MustCompile(`^(\d{4}-\d\d-\d\dT\d\d)([+-]\d\d:\d\d)?$`), "2006-01-02T15"},
	{"minutely", regexp.MustCompile(`^(\d{4}-\d\d-\d\dT\d\d:\d\d)([+-]\d\d:\d\d)?$`), "2006-01-02T15:04"},
	{"secondly", regexp.MustCompile(`^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)([+-]\d\d:\d\d)?$`), "2006-01-02T15:04:05"},
	{"weekly", regexp.MustCompile(`^(\d{4})-W(\d\d)$`), ""},
	{"monthly", regexp.MustCompile(`^\d{4}-\d\d$`), "2006-01"},
}

// windowFormsText lists the formats for messages and help.
const windowFormsText = "daily 2026-04-23, hourly 2026-04-23T14, weekly 2026-W17, monthly 2026-04, " +
	"minutely 2026-04-23T14:05, secondly 2026-04-23T14:05:09"

// windowRule returns the rule whose format w is, and whether w is a real date or week of
// it ("" and false when w is in none of the formats).
func windowRule(w string) (rule string, valid bool) {
	for _, f := range windowForms {
		m := f.re.FindStringSubmatch(w)
		if m == nil {
			continue
		}
		if f.rule == "weekly" {
			year, _ := strconv.Atoi(m[1])
			week, _ := strconv.Atoi(m[2])
			// The last ISO week of a year is the week of its 28 December.
			_, last := time.Date(year, 12, 28, 0, 0, 0, 0, time.UTC).ISOWeek()
			return f.rule, week >= 1 && week <= last
		}
		part := m[0]
		if len(m) > 2 {
			part = m[1]
			if off := m[2]; off != "" {
				if _, err := time.Parse("-07:00", off); err != nil {
					return f.rule, false
				}
			}
		}
		_, err := time.Parse(f.layout, part)
		return f.rule, err == nil
	}
	return "", false
}

// kindInfo is what enqueue knows of a kind before it stores a job of it.
type kindInfo struct {
	known    bool // built in, has jobs, or a worker serves its queue
	anyShape bool // its windows are free-form (a stored job's window is in no rule's format)
}

// kindChecker checks the kind and window of each spec before anything is stored: a kind
// no worker serves, that has no job and that this binary does not know is most likely
// mistyped, and a window that is no date in the kind's format would be a job nobody asked
// for. Each kind is looked up once per run.
type kindChecker struct {
	allowUnknown bool
	queue        string // -queue: the queue the new jobs go to ("" the kind's)
	lookup       func(ctx context.Context, kind, queue string) (kindInfo, error)
	kinds        map[string]kindInfo
	reported     map[string]bool // unknown kinds already explained in full
}

// check returns what is wrong with s's kind or window ("" when nothing is), with the
// field named as names maps it.
func (k *kindChecker) check(ctx context.Context, s tasks.Spec, names map[string]string) (string, error) {
	info, ok := k.kinds[s.Kind]
	if !ok {
		var err error
		if info, err = k.lookup(ctx, s.Kind, k.queue); err != nil {
			return "", err
		}
		if k.kinds == nil {
			k.kinds = map[string]kindInfo{}
		}
		k.kinds[s.Kind] = info
	}
	if !info.known && !k.allowUnknown {
		if k.reported[s.Kind] {
			return fmt.Sprintf("field %s: unknown kind %s (see above)", names["Kind"], quote.Input(s.Kind)), nil
		}
		if k.reported == nil {
			k.reported = map[string]bool{}
		}
		k.reported[s.Kind] = true
		return fmt.Sprintf("field %s: unknown kind %s: no job of it is stored, no worker serves its queue and this binary does not know it "+
			"(a typo?); -allow-unknown-kind enqueues it anyway", names["Kind"], quote.Input(s.Kind)), nil
	}
	if info.anyShape || (!info.known && k.allowUnknown) {
		return "", nil // the kind's windows have no format this binary knows
	}
	rule, valid := windowRule(s.Window)
	switch {
	case rule == "":
		return fmt.Sprintf("field %s: %s is not a window of kind %s: want one of %s", names["Window"], quote.Input(s.Window), s.Kind, windowFormsText), nil
	case !valid:
		return fmt.Sprintf("field %s: %s is in the %s format but no such date or week exists", names["Window"], quote.Input(s.Window), rule), nil
	}
	return "", nil
}

// lookupKind is kindChecker.lookup on the database and Redis: a kind is known when this
// binary has it, when a job of it is stored, or when an asynq server (a worker) serves the
// queue its jobs go to. Its windows are free-form when a stored job's window is in none of
// the rules' formats.
func (r *enqueueRun) lookupKind(ctx context.Context, kind, queue string) (kindInfo, error) {
	pool, err := r.c.db(ctx)
	if err != nil {
		return kindInfo{}, err
	}
	var window string
	err = pool.QueryRow(ctx, `SELECT "window" FROM jobs WHERE kind = $1 LIMIT 1`, kind).Scan(&window)
	switch {
	case err == nil:
		rule, _ := windowRule(window)
		return kindInfo{known: true, anyShape: rule == ""}, nil
	case !errors.Is(err, pgx.ErrNoRows):
		return kindInfo{}, fmt.Errorf("look up kind %s: %w", quote.Input(kind), err)
	}
	if kind == catalog.Kind || r.kindCheck.allowUnknown {
		return kindInfo{known: kind == catalog.Kind}, nil
	}
	rc, err := redisConfig()
	if err != nil {
		return kindInfo{}, err
	}
	insp := asynq.NewInspector(rc.AsynqConnOpt())
	defer func() { _ = insp.Close() }()
	servers, err := insp.Servers()
	if err != nil {
		return kindInfo{}, redisHint(fmt.Errorf("look up the workers serving kind %s (asynq servers): %w", quote.Input(kind), err), rc)
	}
	if queue == "" {
		queue = tasks.QueueFor(kind)
	}
	for _, s := range servers {
		if _, ok := s.Queues[queue]; ok {
			return kindInfo{known: true}, nil
		}
	}
	return kindInfo{}, nil
}
