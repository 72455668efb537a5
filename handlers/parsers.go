package handlers

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/gocolly/colly/v2"

	"github.com/idemscrape/idemscrape/parse"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/inputs"
	"github.com/idemscrape/idemscrape/tasks"
)

// CategoryParserVersion is the failure category of a job whose spec names a parser
// version this worker does not have (see WithParserVersion). It is retryable and does
// not count against the job's attempt cap, bandwidth or time budget, nor asynq's
// MaxRetry: during a rolling deploy a worker that has the version takes the job.
const CategoryParserVersion tasks.Category = "parser_version_unavailable"

// ParserVersionError: the job's spec names a parser version the worker has not
// registered for the kind.
type ParserVersionError struct {
	Kind    string
	Version int
	Have    []int // the versions this worker has, sorted
	Worker  string
}

func (e *ParserVersionError) Error() string {
	return fmt.Sprintf("handlers: kind %q parser version %d is not registered on worker %s (it has %v): "+
		"left for a worker that has it (not counted against the job's budget)", e.Kind, e.Version, e.Worker, e.Have)
}

// WithParserVersion registers the kind's parser (the one given to Register) as parser
// version v only: a job whose spec names another version is refused, retryably (see
// CategoryParserVersion), unless AddParser registers that version too. Without it the
// parser serves every version (it ignores the version). v must be >= 1.
func WithParserVersion(v int) KindOption { return func(k *kind) { k.version = v } }

// WithSavedInputs sets the kind's saved-input policy (what the parser consumed and the
// raw responses, kept for reparse; see package store/inputs and docs/PARSERS.md).
// Defaults to inputs.Policy{} (never): no capture, no extra statement per job.
func WithSavedInputs(p inputs.Policy) KindOption { return func(k *kind) { k.saved = p } }

// WithRecordedFingerprints seeds the kind's schema fingerprints for parser version v
// (e.g. a reviewed sample): drift is judged against them, against those the fleet's
// committed parses recorded in PostgreSQL (schema_fingerprints, read on first use) and
// against those of the parses this registry commits (see Observation.Schema). Seeds stay
// in this registry's memory; they are not written to PostgreSQL.
func WithRecordedFingerprints(v int, fps ...parse.Fingerprint) KindOption {
	return func(k *kind) {
		for _, fp := range fps {
			k.schema(v).record(fp)
		}
	}
}

// AddParser registers parser as version v of an already registered kind that was
// registered with WithParserVersion (a kind registered without it has one parser for every
// version). Registering a version twice is an error.
func (r *Registry) AddParser(kindName string, v int, parser ParserFunc) error {
	if v < 1 || parser == nil {
		return fmt.Errorf("handlers: AddParser %q: version %d must be >= 1 and the parser non-nil", kindName, v)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	k := r.kinds[kindName]
	switch {
	case k == nil:
		return fmt.Errorf("handlers: AddParser: kind %q is not registered", kindName)
	case k.parsers == nil:
		return fmt.Errorf("handlers: AddParser: kind %q was registered without WithParserVersion: its parser serves every version", kindName)
	}
	if _, dup := k.parsers[v]; dup {
		return fmt.Errorf("handlers: AddParser: kind %q parser version %d registered twice", kindName, v)
	}
	// Copy on write: running jobs read the map without the registry's lock.
	m := make(map[int]ParserFunc, len(k.parsers)+1)
	for ver, p := range k.parsers {
		m[ver] = p
	}
	m[v] = parser
	nk := *k
	nk.parsers = m
	r.kinds[kindName] = &nk
	return nil
}

// Parser returns the parser of kind for parser version v, if this registry has it.
func (r *Registry) Parser(kindName string, v int) (ParserFunc, bool) {
	r.mu.RLock()
	k := r.kinds[kindName]
	r.mu.RUnlock()
	if k == nil {
		return nil, false
	}
	return k.parserFor(v)
}

// Topic returns the outbox topic of kind's events ("" if it is not registered).
func (r *Registry) Topic(kindName string) string {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if k := r.kinds[kindName]; k != nil {
		return k.topic
	}
	return ""
}

// ParserVersions returns the versions registered for kind, sorted; nil when its parser
// serves every version or the kind is unknown.
func (r *Registry) ParserVersions(kindName string) []int {
	r.mu.RLock()
	k := r.kinds[kindName]
	r.mu.RUnlock()
	if k == nil {
		return nil
	}
	return k.versions()
}

func (k *kind) parserFor(v int) (ParserFunc, bool) {
	if k.parsers == nil {
		return k.parser, k.parser != nil
	}
	p, ok := k.parsers[v]
	return p, ok
}

func (k *kind) versions() []int {
	if k.parsers == nil {
		return nil
	}
	out := make([]int, 0, len(k.parsers))
	for v := range k.parsers {
		out = append(out, v)
	}
	slices.Sort(out)
	return out
}

// schemaHistory is the schema fingerprints recorded for one kind and parser version: the
// distinct fingerprints of committed parses (and seeded ones), at most maxRecorded, the
// oldest dropped first.
type schemaHistory struct {
	mu   sync.Mutex
	fps  []parse.Fingerprint
	keys []string
	// loadedAt: when the fleet's recorded fingerprints were last read from PostgreSQL, or
	// a re-read was claimed (zero: never; see Registry.schemas). loading serialises the
	// first read, so concurrent first parses send one query.
	loadedAt time.Time
	loading  sync.Mutex
}

// schemaRefresh is how often, at most, a drift verdict re-reads the fleet's recorded
// fingerprints before it stands (another worker may have committed the schema since).
const schemaRefresh = 10 * time.Second

const maxRecorded = 32

// schemaSet is a kind's schema histories by parser version.
type schemaSet struct {
	mu sync.Mutex
	m  map[int]*schemaHistory
}

func (k *kind) schema(v int) *schemaHistory {
	s := k.schemas
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil {
		s.m = map[int]*schemaHistory{}
	}
	h := s.m[v]
	if h == nil {
		h = &schemaHistory{}
		s.m[v] = h
	}
	return h
}

// record adds fp to the history; it returns fp's JSON and whether fp was new to it.
func (h *schemaHistory) record(fp parse.Fingerprint) ([]byte, bool) {
	b, _ := json.Marshal(fp)
	h.mu.Lock()
	defer h.mu.Unlock()
	if slices.Contains(h.keys, string(b)) {
		return b, false
	}
	if len(h.fps) == maxRecorded {
		h.fps, h.keys = h.fps[1:], h.keys[1:]
	}
	h.fps, h.keys = append(h.fps, fp), append(h.keys, string(b))
	return b, true
}

// widens reports whether fp tells the history something its fingerprints do not: a
// selector they never queried or one they all queried that fp did not, a count outside
// their range (a list's varying length included), or no fingerprint at all yet. Only such
// a fingerprint is recorded: most pages of a kind repeat what is known, and a list's
// length alone would otherwise make nearly every page a new fingerprint.
func (h *schemaHistory) widens(fp parse.Fingerprint) bool {
	h.mu.Lock()
	recorded := slices.Clone(h.fps)
	h.mu.Unlock()
	if len(recorded) == 0 {
		return true
	}
	rep, _ := parse.Drift(recorded, fp)
	return len(rep.Changes) > 0
}

// schemas returns the kind's fingerprint history of parser version v, with the fleet's
// recorded fingerprints (schema_fingerprints) read from PostgreSQL the first time: a
// worker that starts judges drift against what was committed before, not against
// nothing. Concurrent first calls send one query.
func (r *Registry) schemas(ctx context.Context, k *kind, v int) (*schemaHistory, error) {
	h := k.schema(v)
	if h.loaded() {
		return h, nil
	}
	h.loading.Lock()
	defer h.loading.Unlock()
	if h.loaded() {
		return h, nil
	}
	return h, r.loadSchemas(ctx, k, v, h)
}

func (h *schemaHistory) loaded() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return !h.loadedAt.IsZero()
}

// loadSchemas merges the fleet's most recently seen fingerprints into h: they go before
// what h holds (seeds and this worker's own), so that a full history drops fleet
// fingerprints first, never the seeds of WithRecordedFingerprints.
func (r *Registry) loadSchemas(ctx context.Context, k *kind, v int, h *schemaHistory) error {
	rows, err := r.cfg.Store.SchemaFingerprintsRecent(ctx, k.name, v, maxRecorded)
	if err != nil {
		return err
	}
	var fps []parse.Fingerprint
	var keys []string
	for i := len(rows) - 1; i >= 0; i-- { // oldest first
		var fp parse.Fingerprint
		if json.Unmarshal(rows[i], &fp) != nil {
			continue // written by a version whose fingerprint this one can not read
		}
		b, _ := json.Marshal(fp)
		fps, keys = append(fps, fp), append(keys, string(b))
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for i, key := range h.keys {
		if j := slices.Index(keys, key); j >= 0 {
			fps, keys = slices.Delete(fps, j, j+1), slices.Delete(keys, j, j+1)
		}
		fps, keys = append(fps, h.fps[i]), append(keys, key)
	}
	if n := len(fps) - maxRecorded; n > 0 {
		fps, keys = fps[n:], keys[n:]
	}
	h.fps, h.keys, h.loadedAt = fps, keys, r.cfg.Now()
	return nil
}

// claimRefresh reports whether a drift verdict should re-read the recorded fingerprints
// (the last read is schemaRefresh old) and, if so, claims the re-read: concurrent
// verdicts do not all re-read.
func (h *schemaHistory) claimRefresh(now time.Time) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if now.Sub(h.loadedAt) < schemaRefresh {
		return false
	}
	h.loadedAt = now
	return true
}

// recordSchema adds a committed parse's fingerprint to the history when it widens it
// (see widens) and then writes it to schema_fingerprints, so the fleet judges against it
// too: once per new fingerprint and worker, not once per job. A failed write is logged
// (this worker still knows it; another records it when it commits such a page).
func (r *Registry) recordSchema(ctx context.Context, k *kind, v int, fp parse.Fingerprint, log *slog.Logger) {
	h := k.schema(v)
	if !h.widens(fp) {
		return
	}
	b, added := h.record(fp)
	if !added {
		return
	}
	rctx, cancel := detached(ctx)
	defer cancel()
	if err := r.cfg.Store.SchemaFingerprintRecord(rctx, k.name, v, b); err != nil {
		log.WarnContext(ctx, "schema fingerprint not recorded in PostgreSQL", "err", err)
	}
}

// drift returns a *parse.DriftError when fp is a surprising change against the history.
func (h *schemaHistory) drift(fp parse.Fingerprint) error {
	h.mu.Lock()
	recorded := slices.Clone(h.fps)
	h.mu.Unlock()
	rep, _ := parse.Drift(recorded, fp)
	return rep.Err()
}

// isValidation reports whether a parser's error is a validation failure or a schema drift
// (category validation: the staging is quarantined, not committed).
func isValidation(err error) bool {
	var ve *parse.ValidationError
	var de *parse.DriftError
	return errors.As(err, &ve) || errors.As(err, &de)
}

// ParserFailure is the failure the runner records for a parser's error err: category
// validation for a validation failure or a schema drift, else the error's own category
// when it has one (a *sessions.FetchError, tasks.Fail), timeout for a context deadline,
// parse_error for any other. For a tool that runs parsers itself (package reparse).
func ParserFailure(err error) *sessions.FetchError {
	if isValidation(err) {
		return &sessions.FetchError{Category: tasks.CategoryValidation, Err: err}
	}
	return asFetchError(err, tasks.CategoryParseError)
}

// runParser runs the job's parser version over staged and applies the schema check: a
// surprising Observation.Schema is a *parse.DriftError (joined with the parser's own
// error, if any), judged against the fingerprints committed before (this worker's and,
// read from PostgreSQL before the fetch, the fleet's; a drift verdict re-reads them at
// most every schemaRefresh). A validation failure or drift has category validation;
// other errors keep theirs (parse_error by default).
func (r *Registry) runParser(ctx context.Context, k *kind, parser ParserFunc, job tasks.Payload, staged map[string]json.RawMessage) (Observation, *sessions.FetchError) {
	obs, err := parser(job, staged)
	if obs.Schema != nil {
		v := job.Spec.ParserVersion
		h := k.schema(v) // read before the fetch (work)
		derr := h.drift(*obs.Schema)
		if derr != nil && h.claimRefresh(r.cfg.Now()) && r.loadSchemas(ctx, k, v, h) == nil {
			derr = h.drift(*obs.Schema)
		}
		if derr != nil {
			err = errors.Join(derr, err)
		}
	}
	if err == nil {
		return obs, nil
	}
	if isValidation(err) {
		return obs, &sessions.FetchError{Category: tasks.CategoryValidation, Err: err}
	}
	return obs, asFetchError(err, tasks.CategoryParseError)
}

// capture records the responses of a unit's steps, for the saved input. Installed only
// when the kind's policy may keep something.
type capture struct {
	now  func() time.Time
	mu   sync.Mutex
	seen map[*colly.Collector]bool
	resp []inputs.Response
}

// wrap returns a copy of u whose steps register the capture on their session's collector
// before they run.
func (c *capture) wrap(u *sessions.Unit) *sessions.Unit {
	cp := *u
	cp.Steps = make([]sessions.Step, len(u.Steps))
	for i, st := range u.Steps {
		run := st.Run
		st.Run = func(ctx context.Context, sc *sessions.StepContext) error {
			c.attach(sc)
			return run(ctx, sc)
		}
		cp.Steps[i] = st
	}
	return &cp
}

func (c *capture) attach(sc *sessions.StepContext) {
	col := sc.Collector()
	sid := ""
	if sc.Session != nil {
		sid = sc.Session.ID
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.seen[col] {
		return
	}
	if c.seen == nil {
		c.seen = map[*colly.Collector]bool{}
	}
	c.seen[col] = true
	col.OnResponse(func(r *colly.Response) {
		rec := inputs.Response{Status: r.StatusCode, FetchedAt: c.now(), SessionID: sid, Body: r.Body}
		if r.Request != nil {
			rec.Method = r.Request.Method
			if r.Request.URL != nil {
				rec.URL = r.Request.URL.String()
			}
		}
		if r.Headers != nil {
			rec.Header = *r.Headers
		}
		c.mu.Lock()
		c.resp = append(c.resp, rec)
		c.mu.Unlock()
	})
}

func (c *capture) responses() []inputs.Response {
	if c == nil {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.resp)
}

// saveInputs keeps the attempt's inputs if the kind's policy says so: one statement. A
// failure is logged, never the job's failure (the inputs are evidence).
func (r *Registry) saveInputs(ctx context.Context, k *kind, job tasks.Payload, acq acquired, w *workResult, log *slog.Logger) {
	failed := w.err != nil
	if !k.saved.Enabled() || !k.saved.Keeps(job.Key, failed) {
		return
	}
	outcome := inputs.OutcomeParsed
	if failed {
		outcome = string(sessions.CategoryOf(w.err))
	}
	sctx, cancel := detached(ctx)
	defer cancel()
	res, err := r.inputs.Save(sctx, inputs.SaveParams{
		Key: job.Key, Fence: acq.Lease.Token, Kind: k.name, ParserVersion: job.Spec.ParserVersion,
		Outcome: outcome, Staged: w.unit.Staged, SessionID: w.session(), Responses: w.capture.responses(),
		MaxBytes: k.saved.Cap(),
	})
	if err != nil {
		r.metrics.savedInputs.WithLabelValues(k.name, "error").Inc()
		log.WarnContext(ctx, "saved input not stored", "err", err)
		return
	}
	result := "saved"
	if res.Truncated {
		result = "truncated"
	}
	r.metrics.savedInputs.WithLabelValues(k.name, result).Inc()
}

// quarantineParse keeps the staging of a parse that failed validation or drifted, for
// review, like the unit's own validation failures.
func (r *Registry) quarantineParse(ctx context.Context, job tasks.Payload, acq acquired, w *workResult, log *slog.Logger) {
	staged, err := json.Marshal(w.unit.Staged)
	if err != nil {
		log.WarnContext(ctx, "parse failure's staging not quarantined", "err", err)
		return
	}
	qctx, cancel := detached(ctx)
	defer cancel()
	if err := r.cfg.Store.QuarantineInsert(qctx, store.QuarantineParams{
		Key: job.Key, AttemptNo: acq.Attempt.AttemptNo, SessionID: w.session(),
		Reason: string(tasks.CategoryValidation), Detail: w.err.Error(), Staged: store.JSONReplaceNUL(staged),
	}); err != nil {
		log.WarnContext(ctx, "parse failure's staging not quarantined", "err", err)
	}
}
