package reparse

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/internal/retry"
	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/inputs"
	"github.com/idemscrape/idemscrape/store/ops"
	"github.com/idemscrape/idemscrape/tasks"
)

// Defaults of Config.
const (
	DefaultBatch       = 500
	DefaultConcurrency = 8
	// reparseLease is the lease a reparse holds on a job while it commits it: no network is
	// involved, so a short lease is ample; the fence protects the commit regardless.
	reparseLease = 30 * time.Second
	// reparseWriteTimeout bounds each write step of a job (record, re-queue, start and
	// commit) once a batch is being written: those run under a context that ignores the
	// caller's cancellation, so that an interrupted reparse never leaves a job half-way
	// (made runnable, not committed). It is shorter than reparseLease, so the put-back of a
	// job whose commit failed normally happens while the lease still keeps workers off it.
	reparseWriteTimeout = 15 * time.Second
	// detachedTimeout bounds the clean-up steps (lease releases, put-backs, links) that run
	// on a context detached from the caller's cancellation: the runner's value.
	detachedTimeout = 15 * time.Second
)

// detached returns a context that survives ctx's cancellation but not a hung connection.
func detached(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), detachedTimeout)
}

// Config configures Run.
type Config struct {
	// Store is the system of record. Required.
	Store *store.PG
	// Redis holds the leases. Required unless DryRun: reparse claims a job's lease before
	// it touches the job, exactly as a worker does, so it never races one.
	Redis redis.UniversalClient
	// KeyPrefix of the lease keys: the workers'. Defaults to handlers.DefaultKeyPrefix.
	KeyPrefix string
	// Parsers are the parsers to run. Required.
	Parsers ParserSource
	// Normalizer derives the keys of new parser versions' jobs. Defaults to
	// tasks.DefaultNormalizer; it must be the enqueuers'.
	Normalizer *tasks.Normalizer
	// By names who reparses, on the attempts (worker "reparse/<By>") and on the job notes of
	// failed jobs it re-queues. Defaults to $USER, else "reparse".
	By string
	// Concurrency is how many jobs are parsed at once, and then how many are written
	// (re-queued, started, committed) at once. Defaults to DefaultConcurrency.
	Concurrency int
	// BatchSize is how many saved inputs one read fetches. Defaults to DefaultBatch.
	BatchSize int
	// Diff receives the field-level diff of every changed record (DryRun), or nothing when
	// nil.
	Diff io.Writer
	// Progress is called after each batch with the totals so far. Optional.
	Progress func(Summary)
	// Logger. Defaults to slog.Default().
	Logger *slog.Logger

	// commitHook, when set (tests only, see SetCommitHook), runs before each commit.
	commitHook func(key string) error
}

// SetCommitHook is a test hook: it makes Run with cfg call hook before each commit, with
// the target job's key; an error hook returns is the commit's (a failure injected after
// the job was re-queued or recorded and started), and a hook that blocks holds the commit.
// Production code has no use for it.
func SetCommitHook(cfg *Config, hook func(key string) error) { cfg.commitHook = hook }

// Options choose what to reparse and how.
type Options struct {
	// Selection chooses the jobs (by kind, parser version, window, time range of the
	// saved input, last failure category, state, keys); each job's latest saved input with
	// staged data is parsed.
	Selection inputs.Selection
	// Version is the parser version to run; 0 runs each job's own version. The same version
	// commits under the job's own key (a job that failed — on parsing — completes; a
	// complete job is left alone); another version commits a new job under the key that
	// version derives (tasks key rules), so the old record stays.
	Version int
	// DryRun parses and diffs, writes nothing, needs no Redis.
	DryRun bool
}

// Summary counts what a reparse did.
type Summary struct {
	Selected  int `json:"selected"`  // saved inputs read
	Reparsed  int `json:"reparsed"`  // parsed without error
	Changed   int `json:"changed"`   // records that differ from the job's current one (or that it has none)
	Unchanged int `json:"unchanged"` // identical records
	Committed int `json:"committed"` // committed through the fenced commit (0 in a dry run)
	// AlreadyDone: the target job was already complete (the same version's complete job, or
	// a new version's job a previous reparse committed): nothing written.
	AlreadyDone int `json:"already_done"`
	// Busy: a worker holds the job's lease (it is running): left alone.
	Busy int `json:"busy"`
	// DuplicateResults: the job was committed (it is complete, with its event) but its
	// result row was rejected because the observation key already had one, e.g. a parser
	// whose ObservationKey does not depend on the parser version, run as a new version.
	// Not counted in Committed.
	DuplicateResults int `json:"duplicate_results"`
	// StillFailing counts the parses that failed, by category; FailingExamples holds the
	// first few ("<job key>: <the parse's error, category first>"), so that a failing parser version can be
	// fixed without a run of its own.
	StillFailing    map[string]int `json:"still_failing"`
	FailingExamples []string       `json:"failing_examples,omitempty"`
	// Errors counts jobs the reparse could not commit (database, Redis, key mismatch);
	// Errs holds the first few.
	Errors int      `json:"errors"`
	Errs   []string `json:"error_examples,omitempty"`
}

// String is a one-line summary.
func (s Summary) String() string {
	var fails []string
	for _, c := range slices.Sorted(maps.Keys(s.StillFailing)) {
		fails = append(fails, fmt.Sprintf("%s %d", c, s.StillFailing[c]))
	}
	failing := "0"
	if len(fails) > 0 {
		failing = strings.Join(fails, ", ")
	}
	return fmt.Sprintf("selected %d, reparsed %d (changed %d, unchanged %d), committed %d, already done %d, busy %d, duplicate results %d, still failing: %s, errors %d",
		s.Selected, s.Reparsed, s.Changed, s.Unchanged, s.Committed, s.AlreadyDone, s.Busy, s.DuplicateResults, failing, s.Errors)
}

// Run runs a parser version over saved inputs with no network: the staged data a job's
// attempt kept (handlers.WithSavedInputs) is parsed again, compared field by field with
// the job's current record, and — unless DryRun — committed through the same fenced commit
// and outbox as a fresh run. Before it touches a job it claims the job's lease (floor: the
// job's fence) like a worker: a job a worker holds is left alone (Busy), and a worker that
// comes later finds the lease busy, then the job complete. A failed job of the same
// version is re-queued first (ops.JobRequeue: a note records who, and "reparse"), then
// started and committed under the lease's token; a new version's job is recorded, started
// and committed the same way. A parse that fails writes nothing. The commit is idempotent:
// a second reparse finds the jobs complete and adds nothing.
//
// Run never leaves a job runnable that it made runnable: once a batch starts writing,
// each job's re-queue or record, start and commit run to their end whatever happens to ctx
// (each step bounded by a timeout), so a cancelled reparse stops between batches and
// returns ctx's error; a job whose commit fails after it was re-queued is put back to
// failed with its original category, and a new version's job it recorded is failed as
// internal, each with an attempt whose error says the reparse failed and why (a worker
// would otherwise fetch it again over the proxy). Another version than a job's own needs a
// parser registered for that version explicitly (CheckVersion), unless DryRun. A
// commit whose result row is refused as a duplicate (the observation key has one: a
// parser whose ObservationKey ignores the version) is counted in DuplicateResults.
func Run(ctx context.Context, cfg Config, opts Options) (Summary, error) {
	sum := Summary{StillFailing: map[string]int{}}
	if cfg.Store == nil || cfg.Parsers == nil {
		return sum, errors.New("reparse: Store and Parsers are required")
	}
	if !opts.DryRun && cfg.Redis == nil {
		return sum, errors.New("reparse: Redis is required unless DryRun (leases keep reparse from racing workers)")
	}
	if opts.Version < 0 {
		return sum, fmt.Errorf("reparse: Version %d must be >= 0", opts.Version)
	}
	if !opts.DryRun && opts.Version > 0 && opts.Selection.Kind != "" && opts.Selection.ParserVersion != opts.Version {
		// Refused before anything is read or written (jobs of version opts.Version itself
		// would pass the per-job check; the others would all be refused).
		if err := CheckVersion(cfg.Parsers, opts.Selection.Kind, opts.Version); err != nil {
			return sum, err
		}
	}
	if cfg.KeyPrefix == "" {
		cfg.KeyPrefix = handlers.DefaultKeyPrefix
	}
	if cfg.Normalizer == nil {
		cfg.Normalizer = tasks.DefaultNormalizer
	}
	if cfg.By == "" {
		cfg.By = cmp.Or(os.Getenv("USER"), "reparse")
	}
	if cfg.Concurrency <= 0 {
		cfg.Concurrency = DefaultConcurrency
	}
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = DefaultBatch
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	rp := &reparser{cfg: cfg, opts: opts, in: inputs.New(cfg.Store.Pool()), ops: ops.New(cfg.Store.Pool()), commitHook: cfg.commitHook}
	if !opts.DryRun {
		var err error
		if rp.leases, err = lua.NewLeases(cfg.Redis, cfg.KeyPrefix); err != nil {
			return sum, err
		}
		rp.group = cfg.Store.NewGroupCommitter(0, 0)
		defer rp.group.Close()
	}
	// The next batch is read while this one is parsed and committed.
	type page struct {
		batch []inputs.Input
		err   error
	}
	pages := make(chan page, 1)
	fctx, stopFetch := context.WithCancel(ctx)
	defer stopFetch()
	go func() {
		defer close(pages)
		for batch, err := range rp.in.Pages(fctx, opts.Selection, cfg.BatchSize) {
			select {
			case pages <- page{batch, err}:
			case <-fctx.Done():
				return
			}
		}
	}()
	for pg := range pages {
		if pg.err != nil {
			return sum, pg.err
		}
		items := make([]*reparseItem, len(pg.batch))
		var wg sync.WaitGroup
		next := make(chan int)
		for range min(cfg.Concurrency, len(items)) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range next {
					items[i] = rp.parse(pg.batch[i])
				}
			}()
		}
		for i := range items {
			next <- i
		}
		close(next)
		wg.Wait()
		if !opts.DryRun {
			rp.commitBatch(ctx, items)
		}
		for _, it := range items { // in key order, so the diff output is deterministic
			sum.add(it.o)
			if opts.DryRun && it.o.diff != "" && cfg.Diff != nil {
				fmt.Fprintf(cfg.Diff, "%s (parser v%d → v%d, key %s)\n%s", it.in.JobKey, it.in.ParserVersion, it.o.version, it.o.key, it.o.diff)
			}
		}
		if cfg.Progress != nil {
			cfg.Progress(sum)
		}
		if err := ctx.Err(); err != nil {
			return sum, err
		}
	}
	// The reader stops without a page when the context ends: report that, not success.
	return sum, ctx.Err()
}

type reparser struct {
	cfg    Config
	opts   Options
	in     *inputs.Store
	ops    *ops.Store
	leases *lua.Leases
	group  *store.GroupCommitter
	// commitHook, when set (tests only), runs before each commit; an error it returns is
	// the commit's.
	commitHook func(key string) error
}

// maxExamples bounds Summary.Errs and FailingExamples.
const maxExamples = 10

// reparseOutcome is what happened to one saved input.
type reparseOutcome struct {
	version int
	key     string
	parsed  bool
	changed bool
	failCat string // the parse's failure category
	diff    string
	result  string // committed, duplicate_result, already_done, busy, error, dry_run
	errText string
}

func (s *Summary) add(o reparseOutcome) {
	s.Selected++
	switch {
	case o.failCat != "":
		s.StillFailing[o.failCat]++
		if len(s.FailingExamples) < maxExamples {
			s.FailingExamples = append(s.FailingExamples, o.errText)
		}
		return
	case o.parsed:
		s.Reparsed++
		if o.changed {
			s.Changed++
		} else {
			s.Unchanged++
		}
	}
	switch o.result {
	case "committed":
		s.Committed++
	case "already_done":
		s.AlreadyDone++
	case "busy":
		s.Busy++
	case "duplicate_result":
		s.DuplicateResults++
	case "error":
		s.Errors++
	}
	if o.errText != "" && len(s.Errs) < maxExamples {
		s.Errs = append(s.Errs, o.errText)
	}
}

// reparseItem is one saved input going through a reparse.
type reparseItem struct {
	in   inputs.Input
	o    reparseOutcome
	job  tasks.Payload // the target job (its key: o.key)
	obs  handlers.Observation
	data json.RawMessage
}

// parse runs the chosen parser version over one job's saved input and diffs the record.
// It touches no database.
func (rp *reparser) parse(in inputs.Input) *reparseItem {
	it := &reparseItem{in: in}
	o := &it.o
	o.version = rp.opts.Version
	if o.version == 0 {
		o.version = in.ParserVersion
	}
	parser, ok := rp.cfg.Parsers.Parser(in.Kind, o.version)
	if !ok {
		o.failCat = string(handlers.CategoryParserVersion)
		o.errText = fmt.Sprintf("%s: %s: kind %q has no parser v%d in this binary", in.JobKey, o.failCat, in.Kind, o.version)
		return it
	}
	if !rp.opts.DryRun && o.version != in.ParserVersion {
		if err := CheckVersion(rp.cfg.Parsers, in.Kind, o.version); err != nil {
			o.result, o.errText = "error", fmt.Sprintf("%s: %v", in.JobKey, err)
			return it
		}
	}
	spec, err := rp.cfg.Normalizer.Normalize(tasks.Spec{Kind: in.Kind, URL: in.URL, SourceID: in.SourceID,
		Country: in.Country, Window: in.Window, ParserVersion: o.version, Scope: in.Scope})
	if err == nil {
		o.key, err = rp.cfg.Normalizer.Key(spec)
	}
	if err != nil {
		o.result, o.errText = "error", fmt.Sprintf("%s: spec of parser v%d: %v", in.JobKey, o.version, err)
		return it
	}
	if o.version == in.ParserVersion && o.key != in.JobKey {
		// The row's spec no longer derives its key (a normaliser change): committing would
		// write a second job. The operator must look at it.
		o.result, o.errText = "error", fmt.Sprintf("%s: its spec now derives key %q: not reparsed (normaliser changed?)", in.JobKey, o.key)
		return it
	}
	staged, err := in.Staged()
	if err != nil {
		o.result, o.errText = "error", err.Error()
		return it
	}
	it.job = tasks.Payload{Key: o.key, Spec: spec}
	var fe *sessions.FetchError
	if it.obs, it.data, fe = parseObservation(parser, it.job, staged); fe != nil {
		o.failCat = string(fe.Category)
		o.errText = fmt.Sprintf("%s: %v", in.JobKey, fe) // the error names its category
		return it
	}
	o.parsed = true
	old := in.Result
	if old == nil {
		old = json.RawMessage("{}")
	}
	if rp.opts.DryRun && rp.cfg.Diff != nil {
		// The diff is printed in a dry run only; otherwise "changed" is all that counts,
		// which needs no sorted, formatted diff.
		o.diff = DiffRecords(old, it.data)
		o.changed = in.Result == nil || o.diff != ""
	} else {
		o.changed = in.Result == nil || !sameRecords(old, it.data)
	}
	if rp.opts.DryRun {
		o.result = "dry_run"
	}
	return it
}

// parseObservation runs parser over staged and encodes the record, as the runner does
// (without the drift history: reparse judges records, not page schemas).
func parseObservation(parser handlers.ParserFunc, job tasks.Payload, staged map[string]json.RawMessage) (obs handlers.Observation, data json.RawMessage, fe *sessions.FetchError) {
	defer func() {
		if rec := recover(); rec != nil {
			fe = &sessions.FetchError{Category: tasks.CategoryPanic, Err: fmt.Errorf("panic: %v", rec)}
		}
	}()
	obs, err := parser(job, staged)
	if err != nil {
		return obs, nil, handlers.ParserFailure(err)
	}
	if obs.ObservationKey == "" {
		obs.ObservationKey = job.Key
	}
	if data, err = json.Marshal(obs.Data); err != nil {
		return obs, nil, &sessions.FetchError{Category: tasks.CategoryParseError, Err: fmt.Errorf("encode observation: %w", err)}
	}
	if store.JSONHasNUL(data) {
		return obs, nil, &sessions.FetchError{Category: tasks.CategoryValidation, Err: errors.New("the record contains a NUL character")}
	}
	return obs, data, nil
}

// commitBatch makes the reparsed observations of one batch take effect, each under its
// target job's lease and fence, exactly like a worker's attempt: read the targets (one
// statement), claim their leases (one pipelined round trip; floor = the job's fence; a
// held lease means a worker runs the job: Busy), read them again now that no worker can
// start them, record the missing ones (one statement) and re-queue the failed ones (one
// statement each, with a note), then start and commit each through the group committer
// (which batches concurrent starts and commits into one statement each), link the new
// attempts to the inputs they consumed (one statement), and release the leases.
func (rp *reparser) commitBatch(ctx context.Context, items []*reparseItem) {
	var todo []*reparseItem
	seen := map[string]bool{}
	for _, it := range items {
		switch {
		case !it.o.parsed || it.o.result != "":
		case seen[it.o.key]:
			it.o.result, it.o.errText = "error", fmt.Sprintf("%s: another selected job derives the same key %q", it.in.JobKey, it.o.key)
		default:
			seen[it.o.key] = true
			todo = append(todo, it)
		}
	}
	if len(todo) == 0 {
		return
	}
	fail := func(it *reparseItem, err error) {
		it.o.result, it.o.errText = "error", fmt.Sprintf("%s: %v", it.o.key, err)
	}
	failAll := func(its []*reparseItem, err error) {
		for _, it := range its {
			fail(it, err)
		}
	}
	keysOf := func(its []*reparseItem) []string {
		keys := make([]string, len(its))
		for i, it := range its {
			keys[i] = it.o.key
		}
		return keys
	}
	states, err := rp.in.JobStates(ctx, keysOf(todo))
	if err != nil {
		failAll(todo, err)
		return
	}
	var claim []*reparseItem
	for _, it := range todo {
		if states[it.o.key].State == string(tasks.StateComplete) {
			it.o.result = "already_done"
			continue
		}
		claim = append(claim, it)
	}
	owner := "reparse/" + rp.cfg.By + "/" + retry.Nonce(6)
	reqs := make([]lua.ClaimRequest, len(claim))
	for i, it := range claim {
		reqs[i] = lua.ClaimRequest{Key: it.o.key, Owner: owner, TTL: reparseLease, Floor: states[it.o.key].Fence}
	}
	leases, errs := rp.leases.ClaimMany(ctx, reqs)
	type held struct {
		it    *reparseItem
		lease lua.Lease
	}
	var hs []held
	for i, it := range claim {
		switch {
		case errors.Is(errs[i], lua.ErrLeaseHeld):
			it.o.result = "busy"
		case errs[i] != nil:
			fail(it, errs[i])
		default:
			hs = append(hs, held{it, leases[i]})
		}
	}
	if len(hs) == 0 {
		return
	}
	release := func(ls []lua.Lease) {
		rctx, cancel := detached(ctx)
		defer cancel()
		_ = rp.leases.ReleaseMany(rctx, ls)
	}
	// Holding the leases, only a worker that finished between our first read and our claim
	// can have moved a job: read them again.
	its := make([]*reparseItem, len(hs))
	for i, h := range hs {
		its[i] = h.it
	}
	if states, err = rp.in.JobStates(ctx, keysOf(its)); err != nil {
		failAll(its, err)
		ls := make([]lua.Lease, len(hs))
		for i, h := range hs {
			ls[i] = h.lease
		}
		release(ls)
		return
	}
	if err := ctx.Err(); err != nil {
		// Interrupted before anything was written: hand the leases back and stop here.
		ls := make([]lua.Lease, len(hs))
		for i, h := range hs {
			fail(h.it, fmt.Errorf("interrupted before commit, nothing written: %w", err))
			ls[i] = h.lease
		}
		release(ls)
		return
	}
	// From here on the batch is written under a context that ignores the caller's
	// cancellation (each step bounded by reparseWriteTimeout): a reparse interrupted with
	// Ctrl-C stops between batches, never between making a job runnable (re-queue, record)
	// and committing it or putting it back (see finishJob).
	var records []tasks.JobRecord
	var run []reparseJob
	var giveBack []lua.Lease
	for _, h := range hs {
		st, exists := states[h.it.o.key]
		j := reparseJob{it: h.it, lease: h.lease}
		switch {
		case !exists:
			records = append(records, tasks.JobRecord{Key: h.it.o.key, Spec: h.it.job.Spec})
			j.recorded = true
		case st.State == string(tasks.StateComplete):
			h.it.o.result = "already_done"
			giveBack = append(giveBack, h.lease)
			continue
		case st.State == string(tasks.StateFailed):
			j.requeue = true
		}
		run = append(run, j)
	}
	if len(records) > 0 {
		wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), reparseWriteTimeout)
		_, err := rp.cfg.Store.JobsRecord(wctx, records)
		cancel()
		if err != nil {
			// One statement: nothing was recorded, unless the reply was lost after it took
			// effect; the recorded jobs are put back to failed either way (a job that is not
			// there is left alone).
			var wg sync.WaitGroup
			slots := make(chan struct{}, rp.cfg.Concurrency)
			for _, j := range run {
				fail(j.it, err)
				giveBack = append(giveBack, j.lease) // released once the put-backs are done
				if j.recorded {
					wg.Add(1)
					slots <- struct{}{}
					go func() {
						defer func() { <-slots; wg.Done() }()
						_ = rp.putBack(ctx, &j, string(tasks.CategoryInternal), "recording the job failed: "+err.Error()) // logged there
					}()
				}
			}
			wg.Wait()
			release(giveBack)
			return
		}
	}
	release(giveBack)
	var mu sync.Mutex
	var wg sync.WaitGroup
	var links []inputs.LinkParams
	// Concurrency bounds the jobs being written at once, as it bounds the parses: a batch
	// of 500 must not put 500 starts and commits on the database (and the group committer's
	// queue) at the same time. A job waiting for its slot keeps its lease only for what is
	// left of reparseLease: finishJob renews it before the first write.
	slots := make(chan struct{}, rp.cfg.Concurrency)
	for _, j := range run {
		wg.Add(1)
		slots <- struct{}{}
		go func() {
			defer func() { <-slots; wg.Done() }()
			if rp.finishJob(ctx, &j, owner) {
				mu.Lock()
				links = append(links, inputs.LinkParams{Key: j.it.o.key, Fence: j.lease.Token, ParserVersion: j.it.job.Spec.ParserVersion,
					Outcome: inputs.OutcomeParsed, FromKey: j.it.in.JobKey, FromFence: j.it.in.SavedFence})
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	// The new attempts consumed the same inputs: link them (shared blobs), so these jobs can
	// be reparsed in their turn. Evidence only: a failure is logged. It was committed, so the
	// caller's cancellation does not skip it.
	lctx, cancel := detached(ctx)
	defer cancel()
	if err := rp.in.Link(lctx, links...); err != nil {
		rp.cfg.Logger.Warn("reparse: saved inputs not linked", "err", err)
	}
}

// reparseJob is one target job whose lease a reparse holds, on its way to a commit.
type reparseJob struct {
	it    *reparseItem
	lease lua.Lease // the lease held (replaced when a stale token is re-claimed)
	// requeue: the job is failed; it is re-queued (made runnable) before it is started.
	requeue bool
	// recorded: the job did not exist; this reparse recorded it (pending: runnable).
	recorded bool
	// category is the failure category to put a re-queued job back with.
	category string
}

// madeRunnable reports whether this reparse made the job runnable (re-queued or recorded
// it): such a job is never left runnable when its commit does not happen.
func (j *reparseJob) madeRunnable() bool { return j.requeue || j.recorded }

// finishJob re-queues the job if it is failed, starts its attempt under the lease's token
// and commits the observation, then releases the lease (ReleaseDone once committed). It
// runs under a context that ignores the caller's cancellation, each step bounded by
// reparseWriteTimeout. When the job is not committed, a job the reparse made runnable is put
// back to failed (putBack) while the lease is still held, so no worker fetches it: a
// re-queued job with its original category, a job the reparse recorded as internal. A job
// that was runnable before (pending, retryable) and that the reparse started is handed back
// retryable, as before. It reports whether the observation was committed (the result may
// be a duplicate: ResultInserted false).
func (rp *reparser) finishJob(ctx context.Context, j *reparseJob, owner string) bool {
	it, key := j.it, j.it.o.key
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), reparseWriteTimeout)
	defer cancel()
	done := false
	defer func() {
		rctx, cancel := detached(ctx)
		defer cancel()
		var err error
		if done {
			err = rp.leases.ReleaseDone(rctx, j.lease)
		} else {
			err = rp.leases.Release(rctx, j.lease)
		}
		if err != nil && !errors.Is(err, lua.ErrLeaseLost) && !errors.Is(err, lua.ErrNotOwner) {
			rp.cfg.Logger.Warn("reparse: lease release failed", "job", key, "err", err)
		}
	}()
	// The lease was claimed with the whole batch; the job may have waited for its write slot
	// since. Renewed before the first write, so the writes run under a whole reparseLease;
	// a lease already lost (a worker took the job) means nothing is written: busy.
	if err := rp.leases.Renew(wctx, j.lease, reparseLease); err != nil {
		if errors.Is(err, lua.ErrLeaseLost) || errors.Is(err, lua.ErrNotOwner) {
			it.o.result = "busy"
		} else {
			it.o.result, it.o.errText = "error", fmt.Sprintf("%s: renew the lease: %v", key, err)
		}
		if j.recorded {
			// This reparse recorded the job (runnable): it goes back to failed, unless a
			// worker already took it (the put-back is fenced).
			_ = rp.putBack(ctx, j, string(tasks.CategoryInternal), "lease lost before the writes: "+err.Error()) // logged there
		}
		return false
	}
	if j.requeue {
		j.category = it.in.LastCategory
		if it.in.JobKey != key || j.category == "" {
			// Another version's failed job (a previous reparse's): read its category.
			if job, err := rp.cfg.Store.JobGet(wctx, key); err == nil {
				j.category = job.LastCategory
			}
		}
		j.category = cmp.Or(j.category, string(tasks.CategoryInternal))
		_, err := rp.ops.JobRequeue(wctx, ops.RequeueParams{Key: key, By: rp.cfg.By,
			Note: fmt.Sprintf("reparse: parser v%d over the saved input of %s (fence %d)", it.job.Spec.ParserVersion, it.in.JobKey, it.in.SavedFence)})
		if err != nil {
			it.o.result, it.o.errText = "error", fmt.Sprintf("%s: %v", key, err)
			// One statement; if its reply was lost after it took effect, the job is pending.
			_ = rp.putBack(ctx, j, j.category, "re-queue failed: "+err.Error()) // logged there
			return false
		}
	}
	started, ins, err := rp.startAndCommit(wctx, j, owner)
	if err == nil {
		done = true
		if ins {
			it.o.result = "committed"
		} else {
			it.o.result = "duplicate_result"
		}
		return true
	}
	var heldErr *lua.HeldError
	switch {
	case errors.Is(err, store.ErrJobComplete):
		it.o.result = "already_done"
		return false
	case !started && (errors.As(err, &heldErr) || errors.Is(err, store.ErrStaleFence)):
		it.o.result = "busy"
	default:
		it.o.result, it.o.errText = "error", fmt.Sprintf("%s: %v", key, err)
	}
	switch {
	case j.madeRunnable():
		cat := j.category
		if j.recorded {
			cat = string(tasks.CategoryInternal)
		}
		if perr := rp.putBack(ctx, j, cat, err.Error()); perr == nil && it.o.errText != "" {
			it.o.errText += fmt.Sprintf(" (put back to failed, %s)", cat)
		}
	case started:
		// The job was runnable before; it runs under our token and nothing was committed:
		// hand it back retryable, so the reconciler and workers take it as they would any
		// other.
		fctx, cancel := detached(ctx)
		defer cancel()
		if ferr := rp.cfg.Store.JobMarkRetryable(fctx, store.AttemptFinishParams{Key: key, Token: j.lease.Token,
			NextAttemptAt: time.Now().Add(time.Minute), Category: string(tasks.CategoryInternal),
			Error: "reparse commit failed: " + err.Error()}); ferr != nil {
			rp.cfg.Logger.Warn("reparse: failed commit not recorded", "job", key, "err", ferr)
		}
	}
	return false
}

// maxReclaims bounds how often reparse re-claims because PostgreSQL holds a fence at or
// above the token its Redis claim issued. Once is enough after a Redis data loss; more
// means another worker keeps starting attempts, and the job is busy.
const maxReclaims = 3

// startAndCommit starts the job's attempt under the lease's token (re-claiming above a
// stale fence, at most maxReclaims times) and commits the observation. started reports whether
// the attempt was started under j.lease's token; inserted is the commit's ResultInserted.
func (rp *reparser) startAndCommit(ctx context.Context, j *reparseJob, owner string) (started, inserted bool, err error) {
	it, key := j.it, j.it.o.key
	start := store.AttemptStartParams{Key: key, Worker: "reparse/" + rp.cfg.By, Country: it.job.Spec.Country, Owner: owner}
	for reclaims := 0; ; reclaims++ {
		start.Token = j.lease.Token
		_, err = rp.group.JobStart(ctx, start)
		var te *store.TransitionError
		if !errors.As(err, &te) || !errors.Is(err, store.ErrStaleFence) || reclaims == maxReclaims {
			break
		}
		// Redis issued a token at or below the fence PostgreSQL holds (it lost its counter,
		// or runners raised the fence with tokens of PostgreSQL's): re-claim above it; the
		// holder's re-claim gets a higher token.
		l, cerr := rp.leases.Claim(ctx, key, owner, reparseLease, te.Fence)
		if cerr != nil {
			err = cerr
			break
		}
		j.lease = l
	}
	if err != nil {
		return false, false, err
	}
	topic := cmp.Or(rp.cfg.Parsers.Topic(it.job.Spec.Kind), it.job.Spec.Kind)
	payload, err := handlers.EventPayload(it.job, it.obs, it.data)
	if err != nil {
		return true, false, err
	}
	p := store.CommitParams{
		Key: key, Token: j.lease.Token, ObservationKey: it.obs.ObservationKey, ParserVersion: it.job.Spec.ParserVersion,
		Data: it.data, Fingerprint: it.in.Fingerprint, EventKey: handlers.EventKey(key), Topic: topic, EventPayload: payload,
	}
	var res store.CommitResult
	if rp.commitHook != nil {
		err = rp.commitHook(key)
	}
	if err == nil {
		res, err = rp.group.Commit(ctx, p)
	}
	if err != nil {
		return true, false, err
	}
	return true, res.ResultInserted, nil
}

// putBack moves a job this reparse made runnable (re-queued or recorded) and did not commit
// back to failed with category, under the lease's token, while the lease is still held: a
// failed attempt whose error says the reparse failed and why. A job that is not running
// under the token (never started, or its start's reply was lost) is started first. A job
// that is complete, failed or absent is left alone. It runs on a detached context (the
// caller's cancellation must not leave the job runnable); a failure is logged as an error
// (the job is then pending or retryable and a worker may fetch it) and returned.
func (rp *reparser) putBack(ctx context.Context, j *reparseJob, category, why string) error {
	key := j.it.o.key
	cctx, cancel := detached(ctx)
	defer cancel()
	settled := func(err error) bool {
		return errors.Is(err, store.ErrJobComplete) || errors.Is(err, store.ErrJobFailed) || errors.Is(err, store.ErrJobNotFound)
	}
	p := store.AttemptFinishParams{Key: key, Token: j.lease.Token, Category: category,
		Error: fmt.Sprintf("reparse (parser v%d) failed, job put back to failed: %s", j.it.job.Spec.ParserVersion, why)}
	err := rp.cfg.Store.JobFail(cctx, p)
	if err == nil || settled(err) {
		return nil
	}
	_, err = rp.cfg.Store.JobStart(cctx, store.AttemptStartParams{Key: key, Token: j.lease.Token,
		Worker: "reparse/" + rp.cfg.By, Country: j.it.job.Spec.Country})
	if err == nil {
		err = rp.cfg.Store.JobFail(cctx, p)
	}
	if err == nil || settled(err) {
		return nil
	}
	rp.cfg.Logger.Error("reparse: job left runnable: not put back to failed", "job", key, "category", category, "err", err)
	return err
}
