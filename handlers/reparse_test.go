package handlers_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/reparse"
	"github.com/idemscrape/idemscrape/store/inputs"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// reparseFixture runs n shop jobs of parser v1 that fail on validation (the site renamed
// the price field) and keep their inputs, then stops the site and the proxy: whatever a
// reparse does next, no request can reach them. It returns the failed jobs' keys and a
// reparse configuration whose parsers are the fixed v1 (and v2, with a label).
func reparseFixture(t *testing.T, n int) (*rig, []string, reparse.Config) {
	t.Helper()
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	always, err := inputs.ParsePolicy("always")
	require.NoError(t, err)
	reg := r.shopRegistry(t, handlers.WithParserVersion(1), handlers.WithSavedInputs(always))
	r.site.SetSchemaChange(true)
	var keys []string
	for i := 1; i <= n; i++ {
		key, task := r.shopJob(t, fmt.Sprintf("sku-%d", i), 1)
		require.True(t, decisionOf(reg.ProcessTask(ctx, task)).Skip)
		keys = append(keys, key)
	}
	r.site.Close()
	r.proxy.Close()
	cfg := reparse.Config{Store: r.st, Redis: r.ns.Client, KeyPrefix: r.ns.Prefix, By: "reparse-test",
		Logger:  slog.New(slog.NewTextHandler(testWriter{t}, nil)),
		Parsers: new(handlers.Parsers).Add(shopKind, 1, "", shopParser(true, false)).Add(shopKind, 2, "", shopParser(true, true))}
	return r, keys, cfg
}

// runnable counts the jobs a worker could take: pending or retryable.
func runnable(t *testing.T, r *rig) int {
	return testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM jobs WHERE state IN ('pending', 'retryable')`)
}

// TestReparseCommitFailurePutsBack: a commit that fails after reparse re-queued a failed job
// (or recorded a new version's job) and started it leaves the job failed — with its
// original category, or internal for a job reparse recorded — never runnable, where a worker
// would fetch it again over the proxy.
func TestReparseCommitFailurePutsBack(t *testing.T) {
	ctx := context.Background()
	r, keys, cfg := reparseFixture(t, 3)
	injected := errors.New("injected commit failure")
	var failKey string
	reparse.SetCommitHook(&cfg, func(key string) error {
		if key == failKey {
			return injected
		}
		return nil
	})

	// The same version: the failed job is re-queued, started, and its commit fails.
	failKey = keys[0]
	v1 := inputs.Selection{Kind: shopKind, ParserVersion: 1}
	sum, err := reparse.Run(ctx, cfg, reparse.Options{Selection: v1})
	require.NoError(t, err)
	assert.Equal(t, 2, sum.Committed, sum.String())
	assert.Equal(t, 1, sum.Errors, sum.String())
	require.NotEmpty(t, sum.Errs)
	assert.Contains(t, sum.Errs[0], "put back to failed, validation")
	requireJob(t, r.st, keys[0], tasks.StateFailed, tasks.CategoryValidation, "its original category")
	atts, err := r.st.AttemptList(ctx, keys[0])
	require.NoError(t, err)
	last := atts[len(atts)-1]
	assert.Equal(t, "reparse/reparse-test", last.Worker)
	assert.Equal(t, tasks.StateFailed, tasks.JobState(last.Outcome))
	assert.Contains(t, last.Error, "reparse (parser v1) failed")
	assert.Contains(t, last.Error, injected.Error())
	assert.Zero(t, runnable(t, r))

	// A new version: the v2 job reparse recorded is failed (internal), not left pending.
	spec, err := tasks.Spec{Kind: shopKind, SourceID: "sku-2", Country: "US", Window: "2026-04-23", ParserVersion: 2}.Normalize()
	require.NoError(t, err)
	v2Key, err := spec.Key()
	require.NoError(t, err)
	failKey = v2Key
	sum, err = reparse.Run(ctx, cfg, reparse.Options{Selection: v1, Version: 2})
	require.NoError(t, err)
	assert.Equal(t, 1, sum.Errors, sum.String())
	requireJob(t, r.st, v2Key, tasks.StateFailed, tasks.CategoryInternal)
	assert.Zero(t, runnable(t, r))

	// Without the failure, a second reparse completes both.
	failKey = ""
	sum, err = reparse.Run(ctx, cfg, reparse.Options{Selection: v1})
	require.NoError(t, err)
	assert.Equal(t, 1, sum.Committed, sum.String())
	sum, err = reparse.Run(ctx, cfg, reparse.Options{Selection: v1, Version: 2})
	require.NoError(t, err)
	assert.Equal(t, 1, sum.Committed, sum.String())
	assert.Zero(t, sum.Errors, sum.Errs)
	assert.Equal(t, 6, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM jobs WHERE state = 'complete'`))
}

// TestReparseInterrupted: the caller's context is cancelled while a batch commits (Ctrl-C):
// the batch is finished — every job re-queued is committed — and the next batch is not
// started; no failed job is left runnable.
func TestReparseInterrupted(t *testing.T) {
	ctx := context.Background()
	r, keys, cfg := reparseFixture(t, 6)
	v1 := inputs.Selection{Kind: shopKind, ParserVersion: 1}

	t.Run("MidBatch", func(t *testing.T) {
		cctx, cancel := context.WithCancel(ctx)
		defer cancel()
		entered, proceed := make(chan struct{}), make(chan struct{})
		var once sync.Once
		c := cfg
		c.BatchSize = 4 // keys[0..3]: the first batch
		reparse.SetCommitHook(&c, func(string) error {
			once.Do(func() { close(entered) })
			<-proceed // every commit of the batch waits until the context is cancelled
			return nil
		})
		type out struct {
			sum reparse.Summary
			err error
		}
		done := make(chan out, 1)
		go func() {
			sum, err := reparse.Run(cctx, c, reparse.Options{Selection: v1})
			done <- out{sum, err}
		}()
		<-entered // a job is re-queued and started, its commit under way
		cancel()
		close(proceed)
		o := <-done
		require.ErrorIs(t, o.err, context.Canceled)
		assert.Equal(t, 4, o.sum.Committed, o.sum.String())
		assert.Zero(t, o.sum.Errors, o.sum.Errs)
		for _, key := range keys[:4] {
			requireState(t, r.st, key, tasks.StateComplete, key)
		}
		for _, key := range keys[4:] {
			requireState(t, r.st, key, tasks.StateFailed, "the next batch is not started: %s", key)
		}
		assert.Zero(t, runnable(t, r))
	})

	t.Run("BeforeWrites", func(t *testing.T) {
		// Cancelled before the batch is read: nothing at all is written.
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		_, err := reparse.Run(cctx, cfg, reparse.Options{Selection: v1})
		require.ErrorIs(t, err, context.Canceled)
		assert.Zero(t, runnable(t, r))
		assert.Equal(t, 2, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM jobs WHERE state = 'failed'`))
	})
}

// TestReparseDuplicateResults: a parser whose ObservationKey does not depend on the parser
// version, run as a new version, completes the new jobs but its results are rejected as
// duplicates: counted as such, not as committed.
func TestReparseDuplicateResults(t *testing.T) {
	ctx := context.Background()
	r, keys, cfg := reparseFixture(t, 2)
	byProduct := func(p handlers.ParserFunc) handlers.ParserFunc {
		return func(job tasks.Payload, staged map[string]json.RawMessage) (handlers.Observation, error) {
			obs, err := p(job, staged)
			obs.ObservationKey = "shop/" + job.Spec.SourceID // the same for every version
			return obs, err
		}
	}
	cfg.Parsers = new(handlers.Parsers).Add(shopKind, 1, "", byProduct(shopParser(true, false))).Add(shopKind, 2, "", byProduct(shopParser(true, true)))
	v1 := inputs.Selection{Kind: shopKind, ParserVersion: 1}
	sum, err := reparse.Run(ctx, cfg, reparse.Options{Selection: v1})
	require.NoError(t, err)
	assert.Equal(t, len(keys), sum.Committed, sum.String())
	assert.Zero(t, sum.DuplicateResults)

	sum, err = reparse.Run(ctx, cfg, reparse.Options{Selection: v1, Version: 2})
	require.NoError(t, err)
	assert.Zero(t, sum.Committed, sum.String())
	assert.Equal(t, len(keys), sum.DuplicateResults, sum.String())
	assert.Contains(t, sum.String(), fmt.Sprintf("duplicate results %d", len(keys)))
	assert.Equal(t, len(keys), testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM results`), "no v2 result row")
	assert.Equal(t, len(keys), testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM jobs WHERE parser_version = 2 AND state = 'complete'`))
}

// TestReparseVersionNotRegistered: a reparse to a version no parser is registered for
// explicitly (a parser for every version runs each job's own version only) is refused
// before anything is written.
func TestReparseVersionNotRegistered(t *testing.T) {
	ctx := context.Background()
	r, keys, cfg := reparseFixture(t, 2)
	cfg.Parsers = new(handlers.Parsers).Add(shopKind, 0, "", shopParser(true, false)).Add(shopKind, 2, "", shopParser(true, true))
	jobs := func() int { return testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM jobs`) }

	// Up front, when the selection names the kind.
	_, err := reparse.Run(ctx, cfg, reparse.Options{Selection: inputs.Selection{Kind: shopKind}, Version: 7})
	var ve *reparse.VersionError
	require.ErrorAs(t, err, &ve)
	assert.Equal(t, 7, ve.Version)
	assert.Equal(t, []int{2}, ve.Registered)
	assert.Contains(t, err.Error(), `kind "shop" has no parser registered for version 7 (registered versions: 2)`)

	// Job by job otherwise: each is an error, nothing written.
	sum, err := reparse.Run(ctx, cfg, reparse.Options{Version: 7})
	require.NoError(t, err)
	assert.Equal(t, len(keys), sum.Errors, sum.String())
	assert.Contains(t, sum.Errs[0], "no parser registered for version 7")
	assert.Equal(t, len(keys), jobs())
	assert.Zero(t, runnable(t, r))

	// The any-version parser still reparses each job's own version; a registered version runs.
	sum, err = reparse.Run(ctx, cfg, reparse.Options{})
	require.NoError(t, err)
	assert.Equal(t, len(keys), sum.Committed, sum.String())
	sum, err = reparse.Run(ctx, cfg, reparse.Options{Version: 2})
	require.NoError(t, err)
	assert.Equal(t, len(keys), sum.Committed, sum.String())
}

// TestReparseCommitsBounded: reparse.Config.Concurrency bounds the jobs being written at
// once, not only the parses: with 2, no more than 2 commits are ever in flight, though the
// batch holds 10 jobs. Each commit waits in the hook until a third one joins it, or 100 ms:
// an unbounded writer has a third there at once; a bounded one never does (the timer only
// keeps the bounded run moving; the outcome does not depend on it).
func TestReparseCommitsBounded(t *testing.T) {
	ctx := context.Background()
	_, _, cfg := reparseFixture(t, 10)
	cfg.Concurrency = 2
	var mu sync.Mutex
	inflight, most := 0, 0
	over := make(chan struct{})
	var once sync.Once
	reparse.SetCommitHook(&cfg, func(string) error {
		mu.Lock()
		inflight++
		most = max(most, inflight)
		if inflight > cfg.Concurrency {
			once.Do(func() { close(over) })
		}
		mu.Unlock()
		t := time.NewTimer(100 * time.Millisecond)
		select {
		case <-over:
		case <-t.C:
		}
		t.Stop()
		mu.Lock()
		inflight--
		mu.Unlock()
		return nil
	})
	sum, err := reparse.Run(ctx, cfg, reparse.Options{Selection: inputs.Selection{Kind: shopKind, ParserVersion: 1}})
	require.NoError(t, err)
	assert.Equal(t, 10, sum.Committed, sum.String())
	assert.LessOrEqual(t, most, 2, "commits in flight at once")
}

// TestReparseLeaseLostWhileWaiting: a job whose lease expired while it waited for a write
// slot (here: deleted while the first job commits, with Concurrency 1) is not written: it
// is reported busy and stays failed, never runnable.
func TestReparseLeaseLostWhileWaiting(t *testing.T) {
	ctx := context.Background()
	r, keys, cfg := reparseFixture(t, 3)
	cfg.Concurrency = 1
	lk, err := lua.NewKeys(cfg.KeyPrefix)
	require.NoError(t, err)
	var once sync.Once
	reparse.SetCommitHook(&cfg, func(key string) error {
		once.Do(func() {
			for _, k := range keys {
				if k != key {
					require.NoError(t, r.ns.Client.Del(ctx, lk.Lease(k)).Err())
				}
			}
		})
		return nil
	})
	sum, err := reparse.Run(ctx, cfg, reparse.Options{Selection: inputs.Selection{Kind: shopKind, ParserVersion: 1}})
	require.NoError(t, err)
	assert.Equal(t, 1, sum.Committed, sum.String())
	assert.Equal(t, 2, sum.Busy, sum.String())
	assert.Zero(t, runnable(t, r))
	assert.Equal(t, 2, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM jobs WHERE state = 'failed'`))
}

// TestReparseRenewFails: Redis failing the lease renewal (an error, not a lost lease) is
// an error for that job, named, and nothing is written: it stays failed, never runnable.
func TestReparseRenewFails(t *testing.T) {
	ctx := context.Background()
	r, _, cfg := reparseFixture(t, 3)
	cfg.Concurrency = 1
	var failScripts atomic.Bool
	rdb := redis.NewClient(&redis.Options{Addr: r.ns.Addr})
	t.Cleanup(func() { _ = rdb.Close() })
	rdb.AddHook(scriptFailer{&failScripts})
	cfg.Redis = rdb
	reparse.SetCommitHook(&cfg, func(string) error {
		failScripts.Store(true) // from the first commit on, every script call fails
		return nil
	})
	sum, err := reparse.Run(ctx, cfg, reparse.Options{Selection: inputs.Selection{Kind: shopKind, ParserVersion: 1}})
	require.NoError(t, err)
	assert.Equal(t, 1, sum.Committed, sum.String())
	assert.Equal(t, 2, sum.Errors, sum.String())
	require.Len(t, sum.Errs, 2)
	for _, e := range sum.Errs {
		assert.Contains(t, e, "renew the lease")
	}
	assert.Zero(t, runnable(t, r))
	assert.Equal(t, 2, testutil.Count(t, r.st.Pool(), `SELECT count(*) FROM jobs WHERE state = 'failed'`))
}

// scriptFailer fails every EVAL/EVALSHA once *on is set, as a Redis that errors would.
type scriptFailer struct{ on *atomic.Bool }

func (scriptFailer) DialHook(next redis.DialHook) redis.DialHook { return next }

func (f scriptFailer) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if f.on.Load() && (cmd.Name() == "evalsha" || cmd.Name() == "eval") {
			err := errors.New("injected: redis script failed")
			cmd.SetErr(err)
			return err
		}
		return next(ctx, cmd)
	}
}

func (scriptFailer) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestReparseFailingExamples: a parser version that still fails says which jobs and why
// (reparse.Summary.FailingExamples), not only how many: the unfixed v1 parser fails each
// job on validation, naming the missing field; a kind without a parser in the binary
// names the kind and version.
func TestReparseFailingExamples(t *testing.T) {
	ctx := context.Background()
	_, keys, cfg := reparseFixture(t, 2)
	cfg.Parsers = new(handlers.Parsers).Add(shopKind, 1, "", shopParser(false, false))
	sum, err := reparse.Run(ctx, cfg, reparse.Options{DryRun: true})
	require.NoError(t, err)
	assert.Equal(t, map[string]int{"validation": len(keys)}, sum.StillFailing, sum.String())
	require.Len(t, sum.FailingExamples, len(keys))
	for i, ex := range sum.FailingExamples {
		key, _, found := strings.Cut(ex, ": ")
		require.True(t, found, ex)
		assert.Contains(t, keys, key, "each example starts with its job key: %s", ex)
		assert.Contains(t, ex, "validation", "example %d names the category", i)
		assert.Contains(t, ex, "price", "example %d names the field that is missing", i)
	}
	assert.Empty(t, sum.Errs)

	cfg.Parsers = new(handlers.Parsers).Add("other", 1, "", shopParser(true, false))
	sum, err = reparse.Run(ctx, cfg, reparse.Options{DryRun: true})
	require.NoError(t, err)
	require.NotEmpty(t, sum.FailingExamples)
	assert.Contains(t, sum.FailingExamples[0], `kind "shop" has no parser v1 in this binary`)
}
