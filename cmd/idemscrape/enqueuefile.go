package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/hibiken/asynq"

	"github.com/idemscrape/idemscrape/cmd/internal/quote"
	"github.com/idemscrape/idemscrape/tasks"
)

// enqueueResult is one line of `enqueue -json`: a spec's outcome, or (with -f) a refused
// line's, outcome "refused" with no key or state and the reason in error.
type enqueueResult struct {
	Line    int    `json:"line,omitempty"`
	Key     string `json:"key,omitempty"`
	Outcome string `json:"outcome"`
	State   string `json:"state,omitempty"`
	Error   string `json:"error,omitempty"`
}

// outcomeRefused is the outcome of a refused line of `enqueue -f -json`.
const outcomeRefused = "refused"

// enqueueRun is one `idemscrape enqueue`: the Enqueuer (made at the first batch) and, for
// -f, the counts its progress lines and its report of a failure give.
type enqueueRun struct {
	c        *cli
	queue    string
	asJSON   bool
	batch    int           // -batch
	progress time.Duration // -progress
	dest     *tasks.DestinationPolicy
	// kindCheck refuses an unknown kind and a window not in the kind's format.
	kindCheck *kindChecker

	enq      *tasks.Enqueuer
	insp     *asynq.Inspector
	closeAll func()
	kinds    map[string]bool // the kinds enqueued (warnUnserved)

	// stored, duplicates: specs in place, new (created, requeued, repaired) or found so
	// (already queued, complete, failed); specs counts the good lines, refused the bad.
	specs, stored, duplicates, refused int
	// firstSpec, lastSpec: the line numbers of the first and the last spec of the batches
	// that are all in place (0: none yet).
	firstSpec, lastSpec int
	// refusedOut (-json): the refused lines not printed yet. They go to stdout with the
	// results of the batch they were read with, in line order.
	refusedOut []enqueueResult
}

func (r *enqueueRun) close() {
	if r.closeAll != nil {
		r.closeAll()
	}
}

// enqueue stores one batch and prints its results (for a failed batch, those of the specs
// in place). A failure after the batch was validated is a *tasks.BatchError.
func (r *enqueueRun) enqueue(ctx context.Context, specs []tasks.Spec, lines []int) ([]tasks.Result, error) {
	if r.enq == nil {
		enq, insp, closeAll, err := newEnqueuerWith(ctx, r.c, tasks.EnqueuerConfig{Queue: r.queue, Concurrency: enqueueConcurrency,
			Destinations: r.dest})
		if err != nil {
			return nil, err
		}
		r.enq, r.insp, r.kinds, r.closeAll = enq, insp, map[string]bool{}, closeAll
	}
	for _, s := range specs {
		r.kinds[s.Kind] = true
	}
	res, err := r.enq.EnqueueMany(ctx, specs)
	var be *tasks.BatchError
	if errors.As(err, &be) {
		res = be.Results
	} else if err != nil {
		return nil, err
	}
	// The batch's results in one write (stdout is unbuffered: 500 lines would be 500),
	// with -json the lines refused while it was read among them, in line order.
	var buf bytes.Buffer
	out := json.NewEncoder(&buf)
	refused := r.refusedOut
	r.refusedOut = nil
	refusedBefore := func(line int) error {
		for ; len(refused) > 0 && (line <= 0 || refused[0].Line < line); refused = refused[1:] {
			if err := out.Encode(refused[0]); err != nil {
				return err
			}
		}
		return nil
	}
	for i, x := range res {
		if x.Outcome != 0 && r.asJSON {
			if err := refusedBefore(lines[i]); err != nil {
				return nil, err
			}
		}
		switch x.Outcome {
		case 0:
			continue // not in place: the failure report names its line
		case tasks.Created, tasks.Requeued, tasks.Repaired:
			r.stored++
		default:
			r.duplicates++
		}
		if r.asJSON {
			if err := out.Encode(enqueueResult{Line: lines[i], Key: x.Key, Outcome: x.Outcome.String(), State: string(x.State)}); err != nil {
				return nil, err
			}
			continue
		}
		if lines[i] > 0 {
			fmt.Fprintf(&buf, "line %d: ", lines[i])
		}
		fmt.Fprintf(&buf, "%s %s (state %s)\n", x.Outcome, x.Key, x.State)
	}
	if err := refusedBefore(0); err != nil {
		return nil, err
	}
	if _, werr := r.c.stdout.Write(buf.Bytes()); werr != nil && err == nil {
		return res, outputError{werr} // the batch is in place; its results could not be printed
	}
	return res, err
}

// outputError: a batch's results could not be written to stdout (the batch is stored).
type outputError struct{ err error }

func (e outputError) Error() string { return "write the results to stdout: " + e.err.Error() }
func (e outputError) Unwrap() error { return e.err }

// warnUnserved warns about the queues of the kinds enqueued that no worker serves.
func (r *enqueueRun) warnUnserved() {
	if r.insp == nil {
		return
	}
	specs := make([]tasks.Spec, 0, len(r.kinds))
	for _, k := range sortedKeys(r.kinds) {
		specs = append(specs, tasks.Spec{Kind: k})
	}
	warnUnserved(r.c, r.insp, specs, r.queue)
}

// file enqueues the JSON lines of file batch by batch: each batch's jobs rows in one
// statement, then its tasks side by side (tasks.EnqueuerConfig.Concurrency), its results
// printed, and a progress line on stderr when the file has more than one batch. A batch
// that fails stops the run with a report of the lines in place and how to resume.
func (r *enqueueRun) file(ctx context.Context, file string) error {
	sr, closeFile, err := openSpecs(r.c, file)
	if err != nil {
		return err
	}
	sr.dest = r.dest
	sr.check = func(s tasks.Spec) (string, error) { return r.kindCheck.check(ctx, s, jsonField) }
	defer closeFile()
	// With -json a refused line is a JSON line on stdout like a spec's (printed with its
	// batch's results, or when the run ends); without, a text line on stderr.
	// Lines left here are those of a run that stops on an error (the end of a good run
	// prints them itself): that error is the one reported.
	defer func() { _ = r.flushRefused() }()
	bad := func(b lineError) {
		r.refused++
		if r.asJSON {
			r.refusedOut = append(r.refusedOut, enqueueResult{Line: b.line, Outcome: outcomeRefused, Error: b.msg})
			return
		}
		fmt.Fprintf(r.c.stderr, "line %d: %s\n", b.line, b.msg)
	}
	// Progress: at most one line per -progress interval after a batch, and one at the end
	// of a file of more than one batch (unless the last line said it all already).
	lastProgress, printedAt, sent := time.Now(), -1, 0
	progress := func() {
		r.printProgress(sr)
		lastProgress, printedAt = time.Now(), sr.n
	}
	for {
		specs, lines, err := sr.next(r.batch, bad)
		if err != nil {
			// The input could not be read on: the batches before are in place, this one's
			// specs were not sent.
			r.report(err, nil, sr, lines, nil)
			return exitError{1}
		}
		if len(specs) > 0 {
			res, err := r.enqueue(ctx, specs, lines)
			var be *tasks.BatchError
			var oe outputError
			switch {
			case errors.As(err, &oe):
				// Stored, but stdout is gone (a closed pipe): stop, this batch in place.
				r.report(err, nil, sr, lines, res)
				return exitError{1}
			case errors.As(err, &be):
				r.report(err, be, sr, lines, res)
				return exitError{1}
			case err != nil && r.firstSpec == 0:
				// Nothing stored yet: a bad setting, or Redis unreachable from the start.
				return err
			case err != nil:
				r.report(err, nil, sr, lines, nil)
				return exitError{1}
			}
			sent++
			r.specs += len(specs)
			if r.firstSpec == 0 {
				r.firstSpec = lines[0]
			}
			r.lastSpec = lines[len(lines)-1]
		}
		if sr.eof {
			if (sent > 1 || printedAt >= 0) && printedAt != sr.n {
				progress()
			}
			break
		}
		if time.Since(lastProgress) >= r.progress {
			progress()
		}
	}
	if r.specs == 0 && r.refused == 0 {
		return fmt.Errorf("-f %s: no specs", file)
	}
	r.warnUnserved()
	if r.refused > 0 {
		if err := r.flushRefused(); err != nil {
			return err
		}
		fmt.Fprintf(r.c.stderr, "idemscrape enqueue: %d line(s) refused, %d stored%s\n", r.refused, r.specs, r.refusedWhere())
		return exitError{1}
	}
	return nil
}

// flushRefused prints the refused lines (-json) not printed yet.
func (r *enqueueRun) flushRefused() error {
	if len(r.refusedOut) == 0 {
		return nil
	}
	var buf bytes.Buffer
	out := json.NewEncoder(&buf)
	for _, x := range r.refusedOut {
		if err := out.Encode(x); err != nil {
			return err
		}
	}
	r.refusedOut = nil
	if _, err := r.c.stdout.Write(buf.Bytes()); err != nil {
		return outputError{err}
	}
	return nil
}

// refusedWhere says where the refused lines are reported when that is not just above.
func (r *enqueueRun) refusedWhere() string {
	if r.asJSON {
		return ` (on stdout, outcome "refused")`
	}
	return ""
}

func (r *enqueueRun) printProgress(sr *specReader) {
	fmt.Fprintf(r.c.stderr, "progress: %d lines read, %d stored, %d duplicates, %d refused\n",
		sr.n, r.stored, r.duplicates, r.refused)
}

// lineSpan is the spec lines first..last (lines between them without a spec — blank,
// comments, refused — are no part of it); open: and every line after last, to the end of
// the input.
type lineSpan struct {
	first, last int
	open        bool
}

func (s lineSpan) String() string {
	switch {
	case s.open:
		return fmt.Sprintf("line %d onwards", s.first)
	case s.first == s.last:
		return fmt.Sprintf("line %d", s.first)
	}
	return fmt.Sprintf("lines %d-%d", s.first, s.last)
}

// maxSpans bounds the spans a failure report lists (stdout names every line in place).
const maxSpans = 12

func joinSpans(spans []lineSpan) string {
	var parts []string
	for i, s := range spans {
		if i == maxSpans-1 && len(spans) > maxSpans {
			parts = append(parts, fmt.Sprintf("%d more span(s) up to %s", len(spans)-i, spans[len(spans)-1]))
			break
		}
		parts = append(parts, s.String())
	}
	return strings.Join(parts, ", ")
}

// report tells, after a failure at the batch of lines (res its results, Outcome 0 for a
// spec not in place; nil when none of it is known to be), which lines are in place — jobs
// row and task, or the job found complete or failed —, which are not, and how to resume:
// the same file again, whose lines in place are recognised as duplicates.
func (r *enqueueRun) report(err error, be *tasks.BatchError, sr *specReader, lines []int, res []tasks.Result) {
	var in, out []lineSpan
	if r.firstSpec > 0 {
		in = append(in, lineSpan{first: r.firstSpec, last: r.lastSpec})
	}
	prevIn := len(in) > 0
	for i, line := range lines {
		ok := res != nil && res[i].Outcome != 0
		switch {
		case ok && prevIn:
			in[len(in)-1].last = line
		case ok:
			in = append(in, lineSpan{first: line, last: line})
		case !prevIn && len(out) > 0:
			out[len(out)-1].last = line
		default:
			out = append(out, lineSpan{first: line, last: line})
		}
		prevIn = ok
	}
	if !sr.eof {
		// The lines after the last one read are not enqueued either.
		if len(out) > 0 && !prevIn {
			out[len(out)-1].open = true
		} else {
			out = append(out, lineSpan{first: sr.n + 1, open: true})
		}
	}
	failedAt := sr.n + 1
	if len(out) > 0 {
		failedAt = out[0].first
	}
	w := r.c.stderr
	fmt.Fprintf(w, "idemscrape enqueue: stopped at line %d: %v\n", failedAt, err)
	if len(in) > 0 {
		fmt.Fprintf(w, "  stored (jobs row and task in place, or the job already complete or failed): %s\n", joinSpans(in))
	} else {
		fmt.Fprintf(w, "  stored: no line\n")
	}
	if len(out) > 0 {
		fmt.Fprintf(w, "  not enqueued: %s\n", joinSpans(out))
	}
	if be != nil && be.Recorded && len(lines) > 0 {
		fmt.Fprintf(w, "  (the jobs rows of lines %d-%d are recorded: those not enqueued wait as pending jobs without a task)\n",
			lines[0], lines[len(lines)-1])
	}
	if r.refused > 0 {
		where := "reported above"
		if r.asJSON {
			where = `reported on stdout with outcome "refused"`
		}
		fmt.Fprintf(w, "  (%d refused line(s), %s, are not stored in any case)\n", r.refused, where)
	}
	fmt.Fprintf(w, "  to resume, run the same file again: the lines stored are recognised as duplicates (already_queued,\n"+
		"  already_complete, already_failed) and not enqueued twice; the others are stored (created, or requeued)\n")
}

// specReader reads the JSON lines of `enqueue -f`, a batch at a time.
type specReader struct {
	br   *bufio.Reader
	name string
	n    int  // lines read
	eof  bool // the input has ended
	dest *tasks.DestinationPolicy
	// check, when set, checks a spec's kind and window (kindChecker): a message for a
	// refused line, an error when they could not be checked.
	check func(tasks.Spec) (string, error)
}

// openSpecs opens file (- for stdin) and returns a reader and the func that closes it.
func openSpecs(c *cli, file string) (*specReader, func(), error) {
	var rd io.Reader = c.stdin
	closeFile := func() {}
	if file != "-" {
		f, err := os.Open(file)
		if err != nil {
			return nil, nil, fmt.Errorf("-f: %w", err)
		}
		rd, closeFile = f, func() { _ = f.Close() }
	}
	return &specReader{br: bufio.NewReaderSize(rd, 64*1024), name: file}, closeFile, nil
}

// next reads and checks lines until it has max specs or the input ends; blank lines and
// lines starting with # are skipped, each bad line is passed to bad. On a read error it
// returns the specs read before it and the error.
func (r *specReader) next(max int, bad func(lineError)) (specs []tasks.Spec, lines []int, err error) {
	for len(specs) < max && !r.eof {
		raw, tooLong, err := readLine(r.br, maxSpecLine)
		if err != nil && !errors.Is(err, io.EOF) {
			return specs, lines, fmt.Errorf("-f %s: line %d: %w", r.name, r.n+1, err)
		}
		if errors.Is(err, io.EOF) {
			r.eof = true
			if len(raw) == 0 && !tooLong {
				break
			}
		}
		r.n++
		if r.n == 1 {
			raw = bytes.TrimPrefix(raw, []byte("\xef\xbb\xbf")) // a UTF-8 byte order mark
		}
		line := bytes.TrimSpace(raw)
		switch {
		case tooLong:
			bad(lineError{r.n, fmt.Sprintf("longer than %d bytes: not a spec", maxSpecLine)})
		case len(line) == 0 || line[0] == '#':
		case !utf8.Valid(line):
			bad(lineError{r.n, quote.CheckUTF8(string(line)) + ": specs are UTF-8 text"})
		default:
			s, msg := parseSpecLine(line, r.dest)
			if msg == "" && r.check != nil {
				var err error
				if msg, err = r.check(s); err != nil {
					return specs, lines, fmt.Errorf("line %d: %w", r.n, err)
				}
			}
			if msg != "" {
				bad(lineError{r.n, msg})
				break
			}
			specs = append(specs, s)
			lines = append(lines, r.n)
		}
	}
	return specs, lines, nil
}

// reportOne is the error of a single enqueue (the spec flags): when its jobs row was
// recorded but its task could not be enqueued (Redis failed), it says what is stored and
// what happens to it, as a file's report does, and exits 1.
func (r *enqueueRun) reportOne(err error) error {
	var be *tasks.BatchError
	if !errors.As(err, &be) || len(be.Results) != 1 {
		return err
	}
	if be.Recorded {
		if rc, rerr := redisConfig(); rerr == nil {
			err = redisHint(err, rc)
		}
	}
	w := r.c.stderr
	fmt.Fprintf(w, "idemscrape enqueue: %v\n", err)
	res := be.Results[0]
	switch {
	case res.Outcome != 0:
		fmt.Fprintf(w, "  stored: %s is in place (%s, state %s)\n", res.Key, res.Outcome, res.State)
	case be.Recorded:
		fmt.Fprintf(w, "  stored: the jobs row of %s (state %s); not enqueued: its task.\n"+
			"  Run the same enqueue again to enqueue it (reported as requeued); otherwise the scheduler's reconciler\n"+
			"  enqueues it (it enqueues runnable jobs that have no task).\n", res.Key, res.State)
	default:
		fmt.Fprintf(w, "  stored: not known (the jobs statement failed, or its answer was lost and it may have committed)\n"+
			"  for %s. Run the same enqueue again: a stored job is recognised, a missing one is stored.\n", res.Key)
	}
	return exitError{1}
}
