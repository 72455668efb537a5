package handlers_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/parse"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// schemaParser is the catalog parser reporting the schema fingerprint *fp says.
type schemaParser struct {
	mu sync.Mutex
	fp parse.Fingerprint
}

func (p *schemaParser) set(fp parse.Fingerprint) { p.mu.Lock(); p.fp = fp; p.mu.Unlock() }

func (p *schemaParser) parse(job tasks.Payload, staged map[string]json.RawMessage) (handlers.Observation, error) {
	obs, err := catalog.Parse(job, staged)
	p.mu.Lock()
	fp := p.fp
	p.mu.Unlock()
	obs.Schema = &fp
	return obs, err
}

// TestSchemaFingerprintsShared: drift is judged against what the fleet committed, read
// from PostgreSQL — a worker that starts after others committed a schema refuses a page
// that drifts from it (memory alone would have no baseline and accept it); a worker whose
// history is older re-reads it on a drift verdict, at most every 10 s, and then accepts a
// schema another worker committed meanwhile.
func TestSchemaFingerprintsShared(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	clock := testutil.NewClock(time.Date(2026, 12, 3, 12, 0, 0, 0, time.UTC))
	worker := func(p *schemaParser) *handlers.Registry {
		reg, err := handlers.NewRegistry(handlers.Config{Store: r.st, Redis: r.ns.Client, Provider: r.prov, KeyPrefix: r.ns.Prefix,
			Collector: sessions.CollectorConfig{Guard: sessions.LoopbackGuard()}, Now: clock.Now, Rand: func() float64 { return 0.5 },
			Logger: slog.New(slog.NewTextHandler(testWriter{t}, nil))})
		require.NoError(t, err)
		t.Cleanup(reg.Close)
		require.NoError(t, reg.Register(catalog.Kind, catalog.Workflow(r.site.URL), p.parse))
		return reg
	}
	old := parse.Fingerprint{Selectors: []parse.SelectorCount{{Selector: "h1.name", Count: 1, Required: true}}}
	changed := parse.Fingerprint{Selectors: []parse.SelectorCount{{Selector: "h1.title", Count: 1, Required: true}, {Selector: "h1.name", Count: 0, Required: true}}}
	state := func(key string) tasks.JobState {
		job, err := r.st.JobGet(ctx, key)
		require.NoError(t, err)
		return job.State
	}

	// Worker A commits a page of the old schema: recorded in PostgreSQL.
	pa := &schemaParser{fp: old}
	a := worker(pa)
	key, task := r.job(t, "sku-1")
	require.NoError(t, a.ProcessTask(ctx, task))
	require.Equal(t, tasks.StateComplete, state(key))
	recorded, err := r.st.SchemaFingerprintsRecent(ctx, catalog.Kind, 1, 10)
	require.NoError(t, err)
	require.Len(t, recorded, 1)

	// Worker B starts afterwards and meets the changed schema: refused against A's.
	pb := &schemaParser{fp: changed}
	b := worker(pb)
	key, task = r.job(t, "sku-2")
	require.True(t, decisionOf(b.ProcessTask(ctx, task)).Skip, "drift is terminal (validation)")
	require.Equal(t, tasks.StateFailed, state(key))
	atts, err := r.st.AttemptList(ctx, key)
	require.NoError(t, err)
	require.Equal(t, string(tasks.CategoryValidation), atts[0].Category)
	require.Contains(t, atts[0].Error, "schema drift")

	// The changed schema is accepted by the fleet (an operator records it after review;
	// another worker that committed it would have too). A, whose history is from before,
	// refuses it until its re-read is due, then accepts it.
	fp, err := json.Marshal(changed)
	require.NoError(t, err)
	require.NoError(t, r.st.SchemaFingerprintRecord(ctx, catalog.Kind, 1, fp))
	pa.set(changed)
	key, task = r.job(t, "sku-3")
	require.True(t, decisionOf(a.ProcessTask(ctx, task)).Skip, "history read less than 10 s ago: the drift stands")
	require.Equal(t, tasks.StateFailed, state(key))
	clock.Advance(10 * time.Second)
	key, task = r.job(t, "sku-4")
	require.NoError(t, a.ProcessTask(ctx, task), "the drift verdict re-read the fleet's fingerprints")
	require.Equal(t, tasks.StateComplete, state(key))

	// Only a fingerprint that widens what is known is written: a list of 3, then of 5
	// items (outside 3–3), then of 4 (inside 3–5: not written).
	rows := func() int {
		got, err := r.st.SchemaFingerprintsRecent(ctx, catalog.Kind, 2, 10)
		require.NoError(t, err)
		return len(got)
	}
	list := func(n int) parse.Fingerprint {
		return parse.Fingerprint{Selectors: []parse.SelectorCount{{Selector: "h1.name", Count: 1, Required: true}, {Selector: "li.spec", Count: n, List: true}}}
	}
	for i, n := range []int{3, 5, 4} {
		pa.set(list(n))
		_, task := r.jobOf(t, catalog.Kind, fmt.Sprintf("sku-%d", 5+i), "US", 2)
		require.NoError(t, a.ProcessTask(ctx, task))
		require.Equal(t, min(i+1, 2), rows(), "after a list of %d", n)
	}
}

// TestSchemaFingerprintsUnreadable: when the recorded fingerprints can not be read, a parse
// that reports a schema is not judged against nothing: the attempt fails retryably
// (internal), and the next delivery, once they can be read, commits.
func TestSchemaFingerprintsUnreadable(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	p := &schemaParser{fp: parse.Fingerprint{Selectors: []parse.SelectorCount{{Selector: "h1.name", Count: 1, Required: true}}}}
	reg := r.registryKind(t, catalog.Workflow(r.site.URL), p.parse)
	// This test's own database: the table is moved away and back.
	_, err := r.st.Pool().Exec(ctx, `ALTER TABLE schema_fingerprints RENAME TO schema_fingerprints_away`)
	require.NoError(t, err)
	key, task := r.job(t, "sku-1")
	dec := decisionOf(reg.ProcessTask(ctx, task))
	require.True(t, dec.Retry, "retryable: %s", dec.ErrorMsg)
	requireJob(t, r.st, key, tasks.StateRetryable, tasks.CategoryInternal)
	atts, err := r.st.AttemptList(ctx, key)
	require.NoError(t, err)
	require.Contains(t, atts[0].Error, `schema fingerprints of "catalog" v1`)
	require.Zero(t, r.site.TotalHits(), "refused before anything was fetched")

	_, err = r.st.Pool().Exec(ctx, `ALTER TABLE schema_fingerprints_away RENAME TO schema_fingerprints`)
	require.NoError(t, err)
	require.NoError(t, reg.ProcessTask(ctx, task))
	requireState(t, r.st, key, tasks.StateComplete)
}
