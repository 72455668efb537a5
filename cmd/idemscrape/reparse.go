package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/idemscrape/idemscrape/cmd/internal/quote"
	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/reparse"
	"github.com/idemscrape/idemscrape/store"
)

// builtinParsers are the parsers this binary has: the example kind of cmd/worker. A team's
// own binary passes its Registry to reparse.Run instead (see docs/PARSERS.md).
// cmd/worker registers catalog.Parse without WithParserVersion (one parser for every
// version), so here too it serves each job's own version and no version explicitly: a
// -to-version other than the selected jobs' own is refused (reparse.CheckVersion)
// rather than writing jobs of a version no parser was written for.
func builtinParsers() *handlers.Parsers {
	return new(handlers.Parsers).Add(catalog.Kind, 0, "", catalog.Parse)
}

// hasParser reports whether parsers has a parser for kind, for any version.
func hasParser(parsers *handlers.Parsers, kind string) bool {
	_, ok := parsers.Parser(kind, 0)
	return ok || len(parsers.ParserVersions(kind)) > 0
}

var reparseCmd = command{
	name: "reparse",
	summary: "Run a parser version over saved inputs with no network: select jobs (by kind, parser version, window,\n" +
		"time range, failure category, state, keys), parse each job's latest saved input, and with -dry-run print a\n" +
		"field-level diff of old vs new records; otherwise commit through the fenced commit and the outbox like a\n" +
		"fresh run (the job's own key for its own version — a failed job is re-queued by a note, then completed; a\n" +
		"new key for another version), holding each job's lease so it never races a worker. A second reparse adds\n" +
		"nothing. -to-version N other than the jobs' own needs a parser registered for N, else it is refused before\n" +
		"anything is written. This binary knows the built-in kind \"catalog\" (its parser reparses each job's own\n" +
		"version only); a team's own binary calls reparse.Run.",
	setFlags: func(fs *flag.FlagSet) func(context.Context, *cli, []string) error {
		var rf reparse.Flags
		rf.Register(fs)
		by := fs.String("by", os.Getenv("USER"), "who reparses (recorded on attempts and on the notes of re-queued jobs)")
		prefix := fs.String("key-prefix", env("IDEMSCRAPE_KEY_PREFIX", handlers.DefaultKeyPrefix), "prefix of the lease keys in Redis (the workers')")
		asJSON := fs.Bool("json", false, "print the summary as JSON")
		quiet := fs.Bool("quiet", false, "no progress lines on stderr")
		return func(ctx context.Context, c *cli, _ []string) error {
			opts, err := rf.Options(time.Now())
			if err != nil {
				return usageError{err.Error()}
			}
			parsers := builtinParsers()
			if k := opts.Selection.Kind; k != "" && !hasParser(parsers, k) {
				// Every job would end parser_version_unavailable: refused, as a usage error.
				return usageError{fmt.Sprintf("-kind %s: this binary has no parser for the kind (it has: %s). "+
					"A kind is reparsed by a binary that registers its parser: your own worker binary's reparse "+
					"command, calling reparse.Run with the handlers.Registry its kinds are registered on "+
					"(docs/PARSERS.md, \"Your own parsers\")", quote.Input(k), catalog.Kind)}
			}
			if !opts.DryRun && opts.Version > 0 && opts.Selection.ParserVersion != opts.Version {
				// Before anything is read or written: a typo must not create jobs, results and
				// events of a version nobody wrote a parser for.
				kind := cmp.Or(opts.Selection.Kind, catalog.Kind) // the only kind this binary has
				if err := reparse.CheckVersion(parsers, kind, opts.Version); err != nil {
					return usageError{"-to-version: " + err.Error()}
				}
			}
			pool, err := c.db(ctx)
			if err != nil {
				return err
			}
			cfg := reparse.Config{Store: store.New(pool), KeyPrefix: *prefix, Parsers: parsers, By: *by}
			if opts.DryRun {
				cfg.Diff = c.stdout
			} else {
				rc, err := redisConfig()
				if err != nil {
					return err
				}
				rdb := rc.NewClient()
				defer rdb.Close()
				cfg.Redis = rdb
			}
			if !*quiet {
				cfg.Progress = func(s reparse.Summary) { fmt.Fprintf(c.stderr, "reparse: %s\n", s) }
			}
			sum, err := reparse.Run(ctx, cfg, opts)
			var ve *reparse.VersionError
			if errors.As(err, &ve) {
				return usageError{"-to-version: " + err.Error()}
			}
			if *asJSON {
				if jerr := writeJSON(c.stdout, sum); jerr != nil {
					return jerr
				}
			} else {
				mode := ""
				if opts.DryRun {
					mode = " (dry run: nothing written)"
				}
				fmt.Fprintf(c.stdout, "reparse%s: %s\n", mode, sum)
				for _, e := range sum.Errs {
					fmt.Fprintf(c.stdout, "  error: %s\n", e)
				}
				for _, e := range sum.FailingExamples {
					fmt.Fprintf(c.stdout, "  still failing: %s\n", e)
				}
			}
			if err != nil {
				return err
			}
			if sum.Errors > 0 {
				return exitError{1}
			}
			return nil
		}
	},
}
