package reparse

import (
	"flag"
	"fmt"
	"strings"
	"time"

	"github.com/idemscrape/idemscrape/store/inputs"
)

// Flags are the command-line flags of a reparse, shared by `idemscrape reparse` and a
// team's own binary (which has its own parsers):
//
//	fs := flag.NewFlagSet("reparse", flag.ExitOnError)
//	var rf reparse.Flags
//	rf.Register(fs)
//	_ = fs.Parse(os.Args[2:])
//	opts, err := rf.Options(time.Now())
//	// handle err
//	sum, err := reparse.Run(ctx, reparse.Config{Store: st, Redis: rdb,
//		KeyPrefix: prefix, Parsers: reg, Diff: os.Stdout}, opts)
type Flags struct {
	Kind          string
	ParserVersion int
	Window        string
	Since, Until  string
	Category      string
	States        string
	Keys          string
	ToVersion     int
	DryRun        bool
}

// Register defines the flags on fs.
func (f *Flags) Register(fs *flag.FlagSet) {
	fs.StringVar(&f.Kind, "kind", "", "select jobs of this kind")
	fs.IntVar(&f.ParserVersion, "parser-version", 0, "select jobs of this parser version (0: any)")
	fs.StringVar(&f.Window, "window", "", "select jobs of this collection window")
	fs.StringVar(&f.Since, "since", "", "select inputs saved at or after this time (RFC 3339, or a duration ago: 24h)")
	fs.StringVar(&f.Until, "until", "", "select inputs saved before this time (RFC 3339, or a duration ago)")
	fs.StringVar(&f.Category, "category", "", "select jobs whose last failure category is this (e.g. validation, parse_error)")
	fs.StringVar(&f.States, "state", "", "select jobs in these states, comma-separated (e.g. failed,complete)")
	fs.StringVar(&f.Keys, "keys", "", "select these job keys, comma-separated")
	fs.IntVar(&f.ToVersion, "to-version", 0, "parser version to run (0: each job's own; another version commits new jobs under that version's keys)")
	fs.BoolVar(&f.DryRun, "dry-run", false, "parse and print a field-level diff of old vs new records; write nothing")
}

// Options turns the flags into Options; durations in -since/-until count back from
// now. A reparse that selects nothing at all (no filter) is allowed: it means every saved
// input.
func (f *Flags) Options(now time.Time) (Options, error) {
	o := Options{Version: f.ToVersion, DryRun: f.DryRun, Selection: inputs.Selection{
		Kind: f.Kind, ParserVersion: f.ParserVersion, Window: f.Window, Category: f.Category,
		States: splitList(f.States), Keys: splitList(f.Keys)}}
	var err error
	if o.Selection.From, err = pointInTime("-since", f.Since, now); err != nil {
		return o, err
	}
	if o.Selection.To, err = pointInTime("-until", f.Until, now); err != nil {
		return o, err
	}
	switch {
	case f.ParserVersion < 0 || f.ToVersion < 0:
		return o, fmt.Errorf("-parser-version and -to-version must be >= 0")
	case !o.Selection.From.IsZero() && !o.Selection.To.IsZero() && !o.Selection.From.Before(o.Selection.To):
		return o, fmt.Errorf("-since %s is not before -until %s", f.Since, f.Until)
	}
	for _, s := range o.Selection.States {
		switch s {
		case "pending", "running", "retryable", "complete", "failed":
		default:
			return o, fmt.Errorf("-state %q: want pending, running, retryable, complete or failed", s)
		}
	}
	return o, nil
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

func pointInTime(name, v string, now time.Time) (time.Time, error) {
	if v == "" {
		return time.Time{}, nil
	}
	if d, err := time.ParseDuration(v); err == nil {
		if d < 0 {
			return time.Time{}, fmt.Errorf("%s %q: a duration ago must be positive", name, v)
		}
		return now.Add(-d), nil
	}
	t, err := time.Parse(time.RFC3339, v)
	if err != nil {
		return time.Time{}, fmt.Errorf("%s %q: want RFC 3339 (2026-04-23T00:00:00Z) or a duration ago (24h)", name, v)
	}
	return t, nil
}
