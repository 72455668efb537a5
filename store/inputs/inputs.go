// Package inputs keeps what parsers consumed — a unit's staged data and, per policy, the
// raw bodies of its steps' responses — in PostgreSQL, so that a parse can be replayed
// (idemscrape reparse) without another proxy request.
//
// Bodies are content-addressed by the sha256 of their raw bytes, stored compressed
// (zstd; a body that does not shrink is stored as is; gzip blobs of earlier versions are
// read) in input_blobs, once: identical bodies
// of many attempts share one row. A saved input belongs to one attempt, (job key, fence),
// and names its staged blob and its responses (URL, status, the headers that matter, fetch
// time, session id, body blob). Saving is ONE statement; a kind whose Policy is Never
// costs nothing. Prune deletes what is older than the retention, in bounded batches; the
// reconciler runs it.
package inputs

import (
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"iter"
	"net/http"
	"runtime"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/klauspost/compress/zstd"
)

// Store reads and writes saved inputs on a pool. It is safe for concurrent use.
type Store struct {
	pool *pgxpool.Pool
}

// New returns a Store on pool (store.PG.Pool()); the schema must be migrated.
func New(pool *pgxpool.Pool) *Store { return &Store{pool: pool} }

// Response is one HTTP response a step received.
type Response struct {
	Method    string
	URL       string // as requested (the destination's URL; the proxy is never in it)
	Status    int
	Header    http.Header // only KeptHeaders are saved
	FetchedAt time.Time
	SessionID string
	Body      []byte
	// Read back only: the body's size and sha256, and whether its bytes were stored (false:
	// the size cap left it out).
	Size   int
	SHA256 string
	Stored bool
}

// KeptHeaders are the response headers a saved input keeps: those that change how a body
// reads (type, language, encoding of the original), when it was served and where it
// pointed. Cookies and anything that can carry a secret are never kept.
var KeptHeaders = []string{"Content-Type", "Content-Language", "Date", "Last-Modified", "ETag", "Location", "Retry-After"}

// SaveParams is one attempt's saved input.
type SaveParams struct {
	Key           string
	Fence         int64 // the attempt's fencing token
	Kind          string
	ParserVersion int
	// Outcome is OutcomeParsed when the parser produced a record, else the attempt's
	// failure category.
	Outcome string
	// Staged is the staged data as the parser got it (nil: none). It is stored as the
	// JSON encoding of the map (sorted keys), whose sha256 is Fingerprint.
	Staged    map[string]json.RawMessage
	SessionID string
	Responses []Response
	// MaxBytes caps the raw bytes kept (see Policy.MaxBytes); 0 means DefaultMaxBytes.
	MaxBytes int64
}

// SaveResult says what a Save wrote.
type SaveResult struct {
	Saved       bool   // false: the attempt already had a saved input
	Fingerprint string // "sha256:<hex>" of the staged JSON, "" if none was staged
	RawBytes    int64  // raw bytes of the staged data and bodies kept
	NewBlobs    int    // blobs written (not already stored)
	StoredBytes int64  // compressed bytes of the new blobs
	Truncated   bool   // something was left out by the cap
}

// OutcomeParsed is SaveParams.Outcome of an attempt whose parser produced a record.
const OutcomeParsed = "parsed"

type blob struct {
	sum      [32]byte
	encoding string
	size     int
	data     []byte
}

// Fingerprint is "sha256:<hex>" of b.
func Fingerprint(b []byte) string {
	s := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(s[:])
}

// StagedJSON is the bytes a Save stores for staged (the JSON of the map, keys sorted);
// its Fingerprint is the saved input's fingerprint.
func StagedJSON(staged map[string]json.RawMessage) ([]byte, error) {
	if staged == nil {
		return nil, nil
	}
	return json.Marshal(staged)
}

// Blobs are written with zstd (its frames carry an xxhash64 checksum of the content):
// it decodes about twice as fast as gzip on page-sized HTML, which is most of what reading
// a saved input costs besides the parse. Blobs written with gzip by earlier versions are
// still read.
var (
	zstdEncoder, _ = zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedDefault),
		zstd.WithEncoderConcurrency(codecConcurrency()), zstd.WithEncoderCRC(true))
	zstdDecoder, _ = zstd.NewReader(nil, zstd.WithDecoderConcurrency(codecConcurrency()),
		zstd.WithDecoderMaxMemory(maxDecoded))
)

// maxDecoded bounds what one blob may decode to, whatever its header claims.
const maxDecoded = 1 << 30

// codecConcurrency is how many blobs are encoded (decoded) at once; more wait their turn.
func codecConcurrency() int { return min(runtime.GOMAXPROCS(0), 8) }

// encode returns the blob of raw: zstd when that is smaller, the raw bytes otherwise.
func encode(raw []byte) blob {
	b := blob{sum: sha256.Sum256(raw), encoding: "identity", size: len(raw), data: raw}
	if len(raw) < 64 {
		return b
	}
	if z := zstdEncoder.EncodeAll(raw, make([]byte, 0, len(raw)/3)); len(z) < len(raw) {
		b.encoding, b.data = "zstd", z
	}
	return b
}

var gzipReaders sync.Pool

// decode returns the raw bytes of a stored blob.
func decode(encoding string, data []byte) ([]byte, error) { return decodeSized(encoding, data, -1) }

// decodeSized is decode for a blob whose raw size is known (-1: unknown).
func decodeSized(encoding string, data []byte, size int) ([]byte, error) {
	switch encoding {
	case "identity":
		return data, nil
	case "zstd":
		var dst []byte
		if size >= 0 {
			dst = make([]byte, 0, size)
		}
		out, err := zstdDecoder.DecodeAll(data, dst)
		switch {
		case err != nil:
			return nil, fmt.Errorf("inputs: zstd blob: %w", err)
		case size >= 0 && len(out) != size:
			return nil, fmt.Errorf("inputs: zstd blob of %d bytes holds %d", size, len(out))
		}
		return out, nil
	case "gzip":
		zr, _ := gzipReaders.Get().(*gzip.Reader)
		var err error
		if zr == nil {
			zr, err = gzip.NewReader(bytes.NewReader(data))
		} else {
			err = zr.Reset(bytes.NewReader(data))
		}
		if err != nil {
			return nil, fmt.Errorf("inputs: gzip blob: %w", err)
		}
		defer gzipReaders.Put(zr)
		if size >= 0 {
			out := make([]byte, size)
			if _, err := io.ReadFull(zr, out); err != nil {
				return nil, fmt.Errorf("inputs: gzip blob of %d bytes: %w", size, err)
			}
			// Read to the end: gzip checks the CRC-32 and length of its trailer there.
			switch n, err := zr.Read(make([]byte, 1)); {
			case n != 0:
				return nil, fmt.Errorf("inputs: gzip blob longer than its recorded %d bytes", size)
			case !errors.Is(err, io.EOF):
				return nil, fmt.Errorf("inputs: gzip blob of %d bytes: %w", size, err)
			}
			return out, nil
		}
		out, err := io.ReadAll(zr)
		if err != nil {
			return nil, fmt.Errorf("inputs: gzip blob: %w", err)
		}
		return out, nil
	}
	return nil, fmt.Errorf("inputs: blob encoding %q unknown", encoding)
}

// keptHeaders returns the KeptHeaders of h as JSON ({} when none).
func keptHeaders(h http.Header) []byte {
	out := map[string][]string{}
	for _, name := range KeptHeaders {
		if v := h.Values(name); len(v) > 0 {
			out[http.CanonicalHeaderKey(name)] = v // as http.Header.Get looks them up
		}
	}
	b, _ := json.Marshal(out)
	return b
}

const saveSQL = `
WITH b AS (
	INSERT INTO input_blobs AS ib (sha256, encoding, size, data)
	SELECT * FROM unnest($1::bytea[], $2::text[], $3::int[], $4::bytea[])
	ON CONFLICT (sha256) DO UPDATE SET last_used_at = now()
		WHERE ib.last_used_at < now() - interval '1 hour'
	RETURNING sha256, xmax = 0 AS inserted
), si AS (
	INSERT INTO saved_inputs (job_key, fence, kind, parser_version, outcome, fingerprint, staged_sha256, session_id, truncated)
	VALUES ($5, $6, $7, $8, $9, $10, $11, $12, $13)
	ON CONFLICT (job_key, fence) DO NOTHING
	RETURNING id
), r AS (
	INSERT INTO saved_responses (input_id, seq, sha256, size, method, url, status, headers, fetched_at, session_id)
	SELECT si.id, t.seq, t.sha, t.size, t.method, t.url, t.status, t.headers, t.at, t.sid
	FROM si, unnest($14::int[], $15::bytea[], $16::int[], $17::text[], $18::text[], $19::int[], $20::jsonb[],
		$21::timestamptz[], $22::text[]) AS t(seq, sha, size, method, url, status, headers, at, sid)
)
SELECT EXISTS (SELECT 1 FROM si), (SELECT count(*) FROM b WHERE inserted)`

// Save stores one attempt's saved input in ONE statement: the new blobs (deduplicated by
// sha256; one already stored is only touched), the saved_inputs row and its responses. A
// second Save of the same attempt writes nothing (Saved false). The attempt row must
// exist (it is started before anything is fetched).
func (s *Store) Save(ctx context.Context, p SaveParams) (SaveResult, error) {
	switch {
	case p.Key == "" || p.Kind == "" || p.Outcome == "":
		return SaveResult{}, errors.New("inputs: Save: Key, Kind and Outcome are required")
	case p.Fence < 1 || p.ParserVersion < 1:
		return SaveResult{}, fmt.Errorf("inputs: Save %q: Fence %d and ParserVersion %d must be >= 1", p.Key, p.Fence, p.ParserVersion)
	}
	limit := p.MaxBytes
	if limit == 0 {
		limit = DefaultMaxBytes
	}
	var res SaveResult
	var blobs []blob
	add := func(raw []byte) ([]byte, bool) {
		if int64(len(raw)) > limit-res.RawBytes {
			res.Truncated = true
			return nil, false
		}
		res.RawBytes += int64(len(raw))
		b := encode(raw)
		// One row per sha256 in the statement: ON CONFLICT DO UPDATE may not meet a row twice.
		if !slices.ContainsFunc(blobs, func(o blob) bool { return o.sum == b.sum }) {
			blobs = append(blobs, b)
		}
		return b.sum[:], true
	}
	var stagedSum []byte
	if p.Staged != nil {
		raw, err := StagedJSON(p.Staged)
		if err != nil {
			return SaveResult{}, fmt.Errorf("inputs: Save %q: staged data: %w", p.Key, err)
		}
		res.Fingerprint = Fingerprint(raw)
		stagedSum, _ = add(raw)
	}
	n := len(p.Responses)
	seq, sizes, status := make([]int32, n), make([]int32, n), make([]int32, n)
	shas := make([][]byte, n)
	methods, urls, sids := make([]string, n), make([]string, n), make([]string, n)
	headers := make([]string, n)
	at := make([]time.Time, n)
	for i, r := range p.Responses {
		seq[i], sizes[i], status[i] = int32(i+1), int32(len(r.Body)), int32(r.Status)
		methods[i], urls[i], sids[i] = cmpOr(r.Method, http.MethodGet), r.URL, r.SessionID
		headers[i], at[i] = string(keptHeaders(r.Header)), r.FetchedAt
		if len(r.Body) > 0 {
			shas[i], _ = add(r.Body)
		}
	}
	bsum, benc, bdata := make([][]byte, len(blobs)), make([]string, len(blobs)), make([][]byte, len(blobs))
	bsize := make([]int32, len(blobs))
	for i := range blobs {
		bsum[i], benc[i], bsize[i], bdata[i] = blobs[i].sum[:], blobs[i].encoding, int32(blobs[i].size), blobs[i].data
	}
	var inserted int64
	err := s.pool.QueryRow(ctx, saveSQL, bsum, benc, bsize, bdata,
		p.Key, p.Fence, p.Kind, p.ParserVersion, p.Outcome, res.Fingerprint, stagedSum, p.SessionID, res.Truncated,
		seq, shas, sizes, methods, urls, status, headers, at, sids,
	).Scan(&res.Saved, &inserted)
	if err != nil {
		return SaveResult{}, fmt.Errorf("inputs: Save %q (fence %d): %w", p.Key, p.Fence, err)
	}
	res.NewBlobs = int(inserted)
	if inserted > 0 {
		// Which blobs were new is not reported per row; count the stored bytes of all of
		// them when every one was new (the common case), else leave the figure at 0.
		if int(inserted) == len(blobs) {
			for _, b := range blobs {
				res.StoredBytes += int64(len(b.data))
			}
		}
	}
	return res, nil
}

func cmpOr(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// Selection chooses the jobs whose latest saved input (with staged data) Select returns.
// Zero fields do not filter.
type Selection struct {
	Kind          string
	ParserVersion int    // the job's parser version
	Window        string // the job's collection window
	From, To      time.Time
	// Category is the job's last failure category (jobs.last_category), e.g. "validation".
	Category string
	// States limits the jobs' states (e.g. complete, failed).
	States []string
	// Keys limits the selection to these jobs.
	Keys []string
}

// Input is one job's latest saved input, with what reparse needs of its job.
type Input struct {
	JobKey        string
	Kind          string
	URL           string
	SourceID      string
	Country       string
	Window        string
	ParserVersion int
	Scope         string
	State         string
	LastCategory  string
	Fence         int64 // the job's fence now
	SavedFence    int64 // the fence of the attempt the input was saved by
	Outcome       string
	Fingerprint   string
	SavedAt       time.Time
	// Result is the data of the job's result, if it has one.
	Result json.RawMessage

	encoding string // of blob
	blob     []byte // the staged data as stored (compressed)
	size     int    // its raw size
	// compact: the blob is stored under the sha256 the fingerprint names, so it is the
	// compact JSON Save encoded (the codec's checksum guards the bytes read back).
	compact bool
}

// Staged decodes the staged data. Select leaves it compressed, so that callers decode
// (and parse) in parallel.
func (in Input) Staged() (map[string]json.RawMessage, error) {
	raw, err := decodeSized(in.encoding, in.blob, in.size)
	if err != nil {
		return nil, fmt.Errorf("inputs: job %q: %w", in.JobKey, err)
	}
	// The blob is the staged JSON Save wrote (json.Marshal's compact output) when it is
	// stored under the sha256 its fingerprint names: then it is split without validating
	// every value again (a third of the decoding time of a page-sized staging). Anything
	// else is decoded by encoding/json, which names what is wrong.
	if in.compact {
		if staged, ok := splitObject(raw); ok {
			return staged, nil
		}
	}
	var staged map[string]json.RawMessage
	if err := json.Unmarshal(raw, &staged); err != nil {
		return nil, fmt.Errorf("inputs: job %q: staged data: %w", in.JobKey, err)
	}
	return staged, nil
}

// splitObject splits a compact JSON object known to be valid into its members, without
// validating the values. It reports false for anything it does not expect (white space,
// escaped keys), and the caller decodes with encoding/json instead.
func splitObject(b []byte) (map[string]json.RawMessage, bool) {
	if len(b) < 2 || b[0] != '{' || b[len(b)-1] != '}' {
		return nil, false
	}
	out := map[string]json.RawMessage{}
	i := 1
	if b[i] == '}' {
		return out, i == len(b)-1
	}
	for {
		// Key: a string without escapes.
		if i >= len(b) || b[i] != '"' {
			return nil, false
		}
		j := i + 1
		for j < len(b) && b[j] != '"' {
			if b[j] == '\\' {
				return nil, false
			}
			j++
		}
		if j+1 >= len(b) || b[j+1] != ':' {
			return nil, false
		}
		key := string(b[i+1 : j])
		start := j + 2
		end, ok := skipValue(b, start)
		if !ok {
			return nil, false
		}
		out[key] = b[start:end:end]
		switch {
		case end < len(b) && b[end] == ',':
			i = end + 1
		case end == len(b)-1 && b[end] == '}':
			return out, true
		default:
			return nil, false
		}
	}
}

// skipValue returns the end of the JSON value starting at i.
func skipValue(b []byte, i int) (int, bool) {
	depth := 0
	for ; i < len(b); i++ {
		switch c := b[i]; c {
		case '"':
			// The closing quote: the next one not escaped (preceded by an even number of
			// backslashes). IndexByte skips a page-sized string many bytes at a time.
			j := i + 1
			for {
				k := bytes.IndexByte(b[j:], '"')
				if k < 0 {
					return 0, false
				}
				j += k
				bs := 0
				for m := j - 1; m > i && b[m] == '\\'; m-- {
					bs++
				}
				if bs%2 == 0 {
					break
				}
				j++
			}
			i = j
		case '{', '[':
			depth++
		case '}', ']':
			if depth == 0 {
				return i, true // the enclosing object's end
			}
			depth--
		case ',':
			if depth == 0 {
				return i, true
			}
		}
		if depth == 0 && (b[i] == '"' || b[i] == '}' || b[i] == ']') && i+1 < len(b) && (b[i+1] == ',' || b[i+1] == '}') {
			return i + 1, true
		}
	}
	return 0, false
}

// Select returns up to limit jobs matching sel whose key is above after, in key order,
// each with its latest saved input that has staged data (Input.Staged decodes it). Page
// with after = the last key returned until fewer than limit come back; Pages does that
// with fewer reads.
func (s *Store) Select(ctx context.Context, sel Selection, after string, limit int) ([]Input, error) {
	if limit < 1 {
		return nil, fmt.Errorf("inputs: Select: limit %d must be >= 1", limit)
	}
	// One snapshot for both statements: an input pruned between them would make the page
	// short, and a caller paging "until fewer than limit come back" would stop early.
	tx, err := s.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		return nil, fmt.Errorf("inputs: Select: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	ids, _, err := selectIDs(ctx, tx, sel, after, limit)
	if err != nil || len(ids) == 0 {
		return nil, err
	}
	return load(ctx, tx, ids)
}

// querier is a pool or a transaction.
type querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// pagesAhead is how many pages of Pages one selection of ids covers: each selection reads
// every matching saved input's narrow row (its key, fence and job), so fewer of them is
// less work for PostgreSQL; the ids themselves are 8 bytes each.
const pagesAhead = 10

// Pages yields the jobs matching sel, in key order, in pages of up to pageSize, each job
// with its latest saved input that has staged data — what Select returns page after page,
// with the matching inputs chosen pagesAhead pages at a time on narrow rows and only each
// page's blobs read. A read error is yielded once, and ends the sequence. Pages stops when
// the selection runs out, not on a short page: an input pruned between its selection and
// its read only leaves its job out.
func (s *Store) Pages(ctx context.Context, sel Selection, pageSize int) iter.Seq2[[]Input, error] {
	return func(yield func([]Input, error) bool) {
		if pageSize < 1 {
			yield(nil, fmt.Errorf("inputs: Pages: page size %d must be >= 1", pageSize))
			return
		}
		after := ""
		for {
			ids, last, err := selectIDs(ctx, s.pool, sel, after, pageSize*pagesAhead)
			if err != nil {
				yield(nil, err)
				return
			}
			for rest := ids; len(rest) > 0; {
				page := rest[:min(pageSize, len(rest))]
				rest = rest[len(page):]
				ins, err := load(ctx, s.pool, page)
				if err != nil {
					yield(nil, err)
					return
				}
				if !yield(ins, nil) {
					return
				}
			}
			if len(ids) < pageSize*pagesAhead {
				return
			}
			after = last
		}
	}
}

// selectIDs returns the ids of the saved inputs Select would return, in key order, and
// the last job key. The matching inputs are chosen on narrow rows: ordering whole rows
// with their blobs sorted every matching input, on disk, for each page.
func selectIDs(ctx context.Context, q querier, sel Selection, after string, limit int) ([]int64, string, error) {
	var from, to *time.Time
	if !sel.From.IsZero() {
		from = &sel.From
	}
	if !sel.To.IsZero() {
		to = &sel.To
	}
	rows, err := q.Query(ctx, `
SELECT DISTINCT ON (s.job_key) s.id, s.job_key
FROM saved_inputs s
JOIN jobs j ON j.key = s.job_key
WHERE s.job_key > $1
	AND s.staged_sha256 IS NOT NULL
	AND ($2 = '' OR j.kind = $2)
	AND ($3 = 0 OR j.parser_version = $3)
	AND ($4 = '' OR j."window" = $4)
	AND ($5::timestamptz IS NULL OR s.created_at >= $5)
	AND ($6::timestamptz IS NULL OR s.created_at < $6)
	AND ($7 = '' OR j.last_category = $7)
	AND (cardinality($8::text[]) = 0 OR j.state = ANY($8))
	AND (cardinality($9::text[]) = 0 OR j.key = ANY($9))
ORDER BY s.job_key, s.fence DESC
LIMIT $10`, after, sel.Kind, sel.ParserVersion, sel.Window, from, to, sel.Category, nonNil(sel.States), nonNil(sel.Keys), limit)
	if err != nil {
		return nil, "", fmt.Errorf("inputs: Select: %w", err)
	}
	var (
		ids       []int64
		id        int64
		key, last string
	)
	if _, err := pgx.ForEachRow(rows, []any{&id, &key}, func() error {
		ids, last = append(ids, id), key
		return nil
	}); err != nil {
		return nil, "", fmt.Errorf("inputs: Select: %w", err)
	}
	return ids, last, nil
}

// load reads the saved inputs ids (from selectIDs) with their jobs, staged blobs and
// results, in key order.
func load(ctx context.Context, q querier, ids []int64) ([]Input, error) {
	rows, err := q.Query(ctx, `
SELECT s.job_key, j.kind, COALESCE(j.url, ''), COALESCE(j.source_id, ''), j.country,
	j."window", j.parser_version, j.scope, j.state, COALESCE(j.last_category, ''), j.fence,
	s.fence, s.outcome, s.fingerprint, s.created_at, b.sha256, b.encoding, b.data, b.size,
	(SELECT r.data FROM results r WHERE r.job_key = j.key ORDER BY r.created_at DESC LIMIT 1)
FROM saved_inputs s
JOIN jobs j ON j.key = s.job_key
JOIN input_blobs b ON b.sha256 = s.staged_sha256
WHERE s.id = ANY($1)
ORDER BY s.job_key`, ids)
	if err != nil {
		return nil, fmt.Errorf("inputs: Select: %w", err)
	}
	out := make([]Input, 0, len(ids))
	var (
		in       Input
		sum      []byte
		enc      string
		data     []byte
		size     int
		result   []byte
		jobFence int64
	)
	_, err = pgx.ForEachRow(rows, []any{&in.JobKey, &in.Kind, &in.URL, &in.SourceID, &in.Country, &in.Window,
		&in.ParserVersion, &in.Scope, &in.State, &in.LastCategory, &jobFence, &in.SavedFence, &in.Outcome,
		&in.Fingerprint, &in.SavedAt, &sum, &enc, &data, &size, &result}, func() error {
		x := in
		x.Fence, x.encoding, x.blob, x.size = jobFence, enc, slices.Clone(data), size
		// Save wrote the blob under the sha256 of its raw bytes and the fingerprint from
		// the same sum: equal, the blob is the compact JSON Save encoded (Staged).
		x.compact = in.Fingerprint == "sha256:"+hex.EncodeToString(sum)
		if result != nil {
			x.Result = slices.Clone(result)
		}
		out = append(out, x)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("inputs: Select: %w", err)
	}
	return out, nil
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

// LinkParams says that the attempt (Key, Fence) consumed the same inputs as the attempt
// (FromKey, FromFence).
type LinkParams struct {
	Key           string
	Fence         int64
	ParserVersion int
	Outcome       string // as in SaveParams
	FromKey       string
	FromFence     int64
}

// Link records, in one statement for all links, saved inputs of attempts that fetched
// nothing — reparse's — sharing the blobs of the attempts whose inputs they consumed
// (nothing is copied). A link whose source has no saved input, or whose attempt already
// has one, writes nothing.
func (s *Store) Link(ctx context.Context, links ...LinkParams) error {
	if len(links) == 0 {
		return nil
	}
	n := len(links)
	keys, outcomes, from := make([]string, n), make([]string, n), make([]string, n)
	fences, fromFences := make([]int64, n), make([]int64, n)
	pvs := make([]int32, n)
	for i, l := range links {
		keys[i], fences[i], pvs[i], outcomes[i], from[i], fromFences[i] = l.Key, l.Fence, int32(l.ParserVersion), l.Outcome, l.FromKey, l.FromFence
	}
	_, err := s.pool.Exec(ctx, `
WITH l AS (
	SELECT * FROM unnest($1::text[], $2::bigint[], $3::int[], $4::text[], $5::text[], $6::bigint[])
		AS t(key, fence, pv, outcome, from_key, from_fence)
), src AS (
	SELECT l.key, l.fence, l.pv, l.outcome, s.id AS src_id, s.kind, s.fingerprint, s.staged_sha256, s.session_id, s.truncated
	FROM l JOIN saved_inputs s ON s.job_key = l.from_key AND s.fence = l.from_fence
), si AS (
	INSERT INTO saved_inputs (job_key, fence, kind, parser_version, outcome, fingerprint, staged_sha256, session_id, truncated)
	SELECT key, fence, kind, pv, outcome, fingerprint, staged_sha256, session_id, truncated FROM src
	ON CONFLICT (job_key, fence) DO NOTHING
	RETURNING id, job_key, fence
)
INSERT INTO saved_responses (input_id, seq, sha256, size, method, url, status, headers, fetched_at, session_id)
SELECT si.id, r.seq, r.sha256, r.size, r.method, r.url, r.status, r.headers, r.fetched_at, r.session_id
FROM si JOIN src ON src.key = si.job_key AND src.fence = si.fence
JOIN saved_responses r ON r.input_id = src.src_id`, keys, fences, pvs, outcomes, from, fromFences)
	if err != nil {
		return fmt.Errorf("inputs: Link (%d links, first %q fence %d): %w", n, links[0].Key, links[0].Fence, err)
	}
	return nil
}

// JobState is a job's state and fence, as JobStates reads them.
type JobState struct {
	State string
	Fence int64
}

// JobStates reads the state and fence of the jobs with keys, in one statement (reparse
// reads its targets a batch at a time). A key with no job is absent from the map.
func (s *Store) JobStates(ctx context.Context, keys []string) (map[string]JobState, error) {
	rows, err := s.pool.Query(ctx, `SELECT key, state, fence FROM jobs WHERE key = ANY($1)`, keys)
	if err != nil {
		return nil, fmt.Errorf("inputs: JobStates: %w", err)
	}
	out := make(map[string]JobState, len(keys))
	var (
		key string
		st  JobState
	)
	_, err = pgx.ForEachRow(rows, []any{&key, &st.State, &st.Fence}, func() error {
		out[key] = st
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("inputs: JobStates: %w", err)
	}
	return out, nil
}

// Saved is one saved input's row, for review.
type Saved struct {
	ID            int64
	JobKey        string
	Fence         int64
	Kind          string
	ParserVersion int
	Outcome       string
	Fingerprint   string
	SessionID     string
	Truncated     bool
	Staged        json.RawMessage // nil when none was kept
	Responses     []Response
	CreatedAt     time.Time
}

// List returns the saved inputs of job key, oldest first, with their staged data and
// responses (bodies included).
func (s *Store) List(ctx context.Context, key string) ([]Saved, error) {
	rows, err := s.pool.Query(ctx, `
SELECT s.id, s.job_key, s.fence, s.kind, s.parser_version, s.outcome, s.fingerprint, s.session_id, s.truncated,
	s.created_at, b.encoding, b.data
FROM saved_inputs s LEFT JOIN input_blobs b ON b.sha256 = s.staged_sha256
WHERE s.job_key = $1 ORDER BY s.fence`, key)
	if err != nil {
		return nil, fmt.Errorf("inputs: List %q: %w", key, err)
	}
	var out []Saved
	var (
		sv   Saved
		enc  *string
		data []byte
	)
	_, err = pgx.ForEachRow(rows, []any{&sv.ID, &sv.JobKey, &sv.Fence, &sv.Kind, &sv.ParserVersion, &sv.Outcome,
		&sv.Fingerprint, &sv.SessionID, &sv.Truncated, &sv.CreatedAt, &enc, &data}, func() error {
		x := sv
		x.Staged = nil
		if enc != nil {
			raw, err := decode(*enc, data)
			if err != nil {
				return err
			}
			x.Staged = slices.Clone(raw)
		}
		out = append(out, x)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("inputs: List %q: %w", key, err)
	}
	for i := range out {
		rows, err := s.pool.Query(ctx, `
SELECT r.method, r.url, r.status, r.headers, r.fetched_at, r.session_id, r.size,
	COALESCE(encode(r.sha256, 'hex'), ''), b.encoding, b.data
FROM saved_responses r LEFT JOIN input_blobs b ON b.sha256 = r.sha256
WHERE r.input_id = $1 ORDER BY r.seq`, out[i].ID)
		if err != nil {
			return nil, fmt.Errorf("inputs: List %q: %w", key, err)
		}
		var (
			r    Response
			hdr  map[string][]string
			benc *string
			bd   []byte
		)
		_, err = pgx.ForEachRow(rows, []any{&r.Method, &r.URL, &r.Status, &hdr, &r.FetchedAt, &r.SessionID, &r.Size,
			&r.SHA256, &benc, &bd}, func() error {
			x := r
			x.Header = http.Header(hdr)
			x.Body, x.Stored = nil, benc != nil
			if benc != nil {
				raw, err := decode(*benc, bd)
				if err != nil {
					return err
				}
				x.Body = slices.Clone(raw)
			}
			out[i].Responses = append(out[i].Responses, x)
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("inputs: List %q: %w", key, err)
		}
	}
	return out, nil
}

// Usage is how much the saved inputs hold.
type Usage struct {
	Inputs      int64 // saved_inputs rows
	Blobs       int64 // distinct bodies (and staged data) stored
	RawBytes    int64 // raw bytes of the distinct blobs
	StoredBytes int64 // bytes stored (compressed) for them
}

// Usage sums the saved inputs and blobs (a full scan: for tools and tests, not hot paths).
func (s *Store) Usage(ctx context.Context) (Usage, error) {
	var u Usage
	err := s.pool.QueryRow(ctx, `
SELECT (SELECT count(*) FROM saved_inputs), count(*), COALESCE(sum(size), 0), COALESCE(sum(length(data)), 0)
FROM input_blobs`).Scan(&u.Inputs, &u.Blobs, &u.RawBytes, &u.StoredBytes)
	if err != nil {
		return Usage{}, fmt.Errorf("inputs: Usage: %w", err)
	}
	return u, nil
}

// Prune defaults and bounds.
const (
	DefaultPruneLimit = 1000
	// MinRetention is the shortest retention Prune accepts: a save refreshes a reused
	// blob's last_used_at at most hourly, so a shorter one could delete a blob in use.
	MinRetention = 2 * time.Hour
)

// PruneParams bounds one Prune call.
type PruneParams struct {
	// Retention: saved inputs created longer ago than this, and blobs neither referenced
	// nor used for as long, are deleted. At least MinRetention.
	Retention time.Duration
	// Limit is the most saved inputs, and the most blobs, one call deletes. Defaults to
	// DefaultPruneLimit.
	Limit int
}

// PruneResult counts what one Prune deleted.
type PruneResult struct {
	Inputs int64
	Blobs  int64
}

// Done reports whether the call found less than a full batch of both, i.e. the caller
// may stop looping.
func (r PruneResult) Done(limit int) bool {
	if limit <= 0 {
		limit = DefaultPruneLimit
	}
	return r.Inputs < int64(limit) && r.Blobs < int64(limit)
}

// Prune deletes one batch of saved inputs older than the retention (their responses go
// with them), then one batch of blobs that no saved input or response references and no
// save used within the retention: two statements, times against the database's clock.
// Loop while !PruneResult.Done(limit). Safe to run concurrently with saves and with other
// Prunes.
func (s *Store) Prune(ctx context.Context, p PruneParams) (PruneResult, error) {
	if p.Retention < MinRetention {
		return PruneResult{}, fmt.Errorf("inputs: Prune: Retention %v is below the minimum %v", p.Retention, MinRetention)
	}
	if p.Limit <= 0 {
		p.Limit = DefaultPruneLimit
	}
	secs := p.Retention.Seconds()
	var res PruneResult
	tag, err := s.pool.Exec(ctx, `
DELETE FROM saved_inputs WHERE id IN (
	SELECT id FROM saved_inputs WHERE created_at < now() - make_interval(secs => $1)
	ORDER BY created_at LIMIT $2 FOR UPDATE SKIP LOCKED)`, secs, p.Limit)
	if err != nil {
		return res, fmt.Errorf("inputs: Prune: saved inputs: %w", err)
	}
	res.Inputs = tag.RowsAffected()
	tag, err = s.pool.Exec(ctx, `
DELETE FROM input_blobs b WHERE b.sha256 IN (
	SELECT c.sha256 FROM input_blobs c
	WHERE c.last_used_at < now() - make_interval(secs => $1)
		AND NOT EXISTS (SELECT 1 FROM saved_inputs s WHERE s.staged_sha256 = c.sha256)
		AND NOT EXISTS (SELECT 1 FROM saved_responses r WHERE r.sha256 = c.sha256)
	ORDER BY c.last_used_at LIMIT $2 FOR UPDATE SKIP LOCKED)
AND b.last_used_at < now() - make_interval(secs => $1)
AND NOT EXISTS (SELECT 1 FROM saved_inputs s WHERE s.staged_sha256 = b.sha256)
AND NOT EXISTS (SELECT 1 FROM saved_responses r WHERE r.sha256 = b.sha256)`, secs, p.Limit)
	if err != nil {
		return res, fmt.Errorf("inputs: Prune: blobs: %w", err)
	}
	res.Blobs = tag.RowsAffected()
	return res, nil
}
