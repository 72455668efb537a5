package handlers_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/ops"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// runServer runs an asynq server with reg on the rig's queue until the test ends.
func (r *rig) runServer(t *testing.T, reg *handlers.Registry, concurrency int) {
	t.Helper()
	srv := asynq.NewServer(r.ns.AsynqOpt(), reg.ServerConfig(asynq.Config{
		Queues: map[string]int{r.ns.Queue: 1}, Concurrency: concurrency,
		DelayedTaskCheckInterval: 100 * time.Millisecond,
		Logger:                   quietAsynq{},
	}))
	require.NoError(t, srv.Start(reg))
	t.Cleanup(srv.Shutdown)
}

type quietAsynq struct{}

func (quietAsynq) Debug(...any) {}
func (quietAsynq) Info(...any)  {}
func (quietAsynq) Warn(...any)  {}
func (quietAsynq) Error(...any) {}
func (quietAsynq) Fatal(...any) {}

// enqueuer returns an Enqueuer on the rig's queue with an Inspector, as every binary has.
func (r *rig) enqueuer(t *testing.T) (*tasks.Enqueuer, *asynq.Inspector) {
	t.Helper()
	client := asynq.NewClient(r.ns.AsynqOpt())
	t.Cleanup(func() { _ = client.Close() })
	insp := asynq.NewInspector(r.ns.AsynqOpt())
	t.Cleanup(func() { _ = insp.Close() })
	enq, err := tasks.NewEnqueuer(client, r.st, &tasks.EnqueuerConfig{Queue: r.ns.Queue, Inspector: insp})
	require.NoError(t, err)
	return enq, insp
}

func countState(t *testing.T, st *store.PG, state tasks.JobState) int {
	return testutil.Count(t, st.Pool(), `SELECT count(*)::int FROM jobs WHERE state = $1`, string(state))
}

// TestArchivedTaskDoesNotStrandJob: no path archives the task of a job PostgreSQL holds as
// runnable, and an archived task met at enqueue is repaired, not reported as queued.
func TestArchivedTaskDoesNotStrandJob(t *testing.T) {
	ctx := context.Background()

	t.Run("NoJobRowIsRevokedNotArchived", func(t *testing.T) {
		r := newRig(t, rigOpts{})
		reg := r.registry(t, nil)
		spec, err := tasks.Spec{Kind: catalog.Kind, SourceID: "sku-9", Country: "US", Window: "w", ParserVersion: 1}.Normalize()
		require.NoError(t, err)
		key, err := spec.Key()
		require.NoError(t, err)
		payload, err := json.Marshal(tasks.Payload{Key: key, Spec: spec})
		require.NoError(t, err)
		err = reg.ProcessTask(ctx, asynq.NewTask(catalog.Kind, payload))
		require.ErrorIs(t, err, asynq.RevokeTask)
		require.NotErrorIs(t, err, asynq.SkipRetry)

		// Through a real asynq server: the task is gone afterwards (not archived) and its id
		// is free for the job once it exists.
		client := asynq.NewClient(r.ns.AsynqOpt())
		defer client.Close()
		insp := asynq.NewInspector(r.ns.AsynqOpt())
		defer insp.Close()
		_, err = client.Enqueue(asynq.NewTask(catalog.Kind, payload), asynq.TaskID(key), asynq.Queue(r.ns.Queue))
		require.NoError(t, err)
		r.runServer(t, reg, 2)
		handlers.WaitUntil(t, "the task's revocation", 20*time.Millisecond, func() bool {
			_, err := insp.GetTaskInfo(r.ns.Queue, key)
			return errors.Is(err, asynq.ErrTaskNotFound)
		})
		archived, err := insp.ListArchivedTasks(r.ns.Queue)
		require.NoError(t, err)
		require.Empty(t, archived)
	})

	t.Run("UndecodablePayloadIsRetriedNotArchived", func(t *testing.T) {
		r := newRig(t, rigOpts{})
		err := r.registry(t, nil).ProcessTask(ctx, asynq.NewTask(catalog.Kind, []byte(`{"v":99,"future":true}`)))
		require.Error(t, err)
		require.NotErrorIs(t, err, asynq.SkipRetry)
		dec := decisionOf(err)
		require.True(t, dec.Retry, "%v", err)
		require.False(t, dec.Counted)
		require.GreaterOrEqual(t, dec.Delay, time.Minute, "retried late, for a newer worker")
	})

	t.Run("ArchivedTaskRepairedAtEnqueueAndJobRuns", func(t *testing.T) {
		r := newRig(t, rigOpts{})
		enq, insp := r.enqueuer(t)
		spec := tasks.Spec{Kind: catalog.Kind, SourceID: "sku-3", Country: "US", Window: "w", ParserVersion: 1}
		res, err := enq.Enqueue(ctx, spec)
		require.NoError(t, err)
		require.Equal(t, tasks.Created, res.Outcome)
		// An older worker archived the task (SkipRetry) while the job stayed pending.
		require.NoError(t, insp.ArchiveTask(r.ns.Queue, res.Key))

		res, err = enq.Enqueue(ctx, spec)
		require.NoError(t, err)
		require.Equal(t, tasks.Repaired, res.Outcome, "the outcome says what happened")
		info, err := insp.GetTaskInfo(r.ns.Queue, res.Key)
		require.NoError(t, err)
		require.Equal(t, asynq.TaskStatePending, info.State)

		r.runServer(t, r.registry(t, nil), 2)
		handlers.WaitUntil(t, "the repaired job's completion", 20*time.Millisecond, func() bool {
			return countState(t, r.st, tasks.StateComplete) == 1
		})
		require.Equal(t, 1, testutil.Count(t, r.st.Pool(), `SELECT count(*)::int FROM results`))
	})
}

// switchProxy is a TCP front of a proxy that answers 407 to every new connection while
// refusing is set (a rotated password, an empty balance), and passes connections through
// untouched otherwise.
type switchProxy struct {
	ln       net.Listener
	backend  string
	refusing atomic.Bool
	refused  atomic.Int64
	wg       sync.WaitGroup
	mu       sync.Mutex
	conns    map[net.Conn]struct{}
}

func newSwitchProxy(t *testing.T, backend string) *switchProxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &switchProxy{ln: ln, backend: backend, conns: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	return p
}

func (p *switchProxy) addr() string { return p.ln.Addr().String() }

func (p *switchProxy) track(c net.Conn, on bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if on {
		p.conns[c] = struct{}{}
	} else {
		delete(p.conns, c)
	}
}

func (p *switchProxy) close() {
	_ = p.ln.Close()
	p.mu.Lock()
	for c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

func (p *switchProxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.track(c, true)
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			defer p.track(c, false)
			defer c.Close()
			if p.refusing.Load() {
				if _, err := http.ReadRequest(bufio.NewReader(c)); err != nil {
					return
				}
				p.refused.Add(1)
				_, _ = io.WriteString(c, "HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm=\"proxy\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
				return
			}
			up, err := net.Dial("tcp", p.backend)
			if err != nil {
				return
			}
			p.track(up, true)
			defer p.track(up, false)
			defer up.Close()
			done := make(chan struct{}, 2)
			go func() { _, _ = io.Copy(up, c); done <- struct{}{} }()
			go func() { _, _ = io.Copy(c, up); done <- struct{}{} }()
			<-done
		}()
	}
}

// TestProxyAuthIncidentRecovers: a 407 (password rotated, balance empty) is the account's
// incident, not the jobs' failure: the worker stops taking work, reports it, probes, and
// once the proxy authenticates again every job completes; none fails.
func TestProxyAuthIncidentRecovers(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	front := newSwitchProxy(t, r.proxy.Addr)
	front.refusing.Store(true)
	prov := newProvider(t, "generic", front.addr())
	metrics := prometheus.NewRegistry()
	reg, err := handlers.NewRegistry(handlers.Config{
		Store: r.st, Redis: r.ns.Client, Provider: prov, KeyPrefix: r.ns.Prefix,
		Collector:             sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), RequestTimeout: 5 * time.Second},
		Logger:                slog.New(slog.NewTextHandler(testWriter{t}, nil)),
		Registerer:            metrics,
		IncidentProbeInterval: 200 * time.Millisecond,
		IncidentProbeMax:      400 * time.Millisecond,
	})
	require.NoError(t, err)
	t.Cleanup(reg.Close)
	require.NoError(t, reg.Register(catalog.Kind, catalog.Workflow(r.site.URL), catalog.Parse))
	require.NoError(t, reg.Ready())

	enq, _ := r.enqueuer(t)
	const jobs = 20
	specs := make([]tasks.Spec, jobs)
	for i := range specs {
		specs[i] = tasks.Spec{Kind: catalog.Kind, SourceID: fmt.Sprintf("sku-%d", i+1), Country: "US", Window: "w", ParserVersion: 1}
	}
	_, err = enq.EnqueueMany(ctx, specs)
	require.NoError(t, err)
	const concurrency = 4
	start := time.Now()
	r.runServer(t, reg, concurrency)

	// The incident trips the breaker; probes keep meeting the 407.
	handlers.WaitUntil(t, "the breaker opening and probing more than once", 10*time.Millisecond, func() bool {
		return errors.Is(reg.Ready(), handlers.ErrIncident) && front.refused.Load() >= 8
	})
	require.ErrorContains(t, reg.Ready(), string(tasks.CategoryProxyAuth))
	require.NotContains(t, reg.Ready().Error(), canary)
	require.Zero(t, countState(t, r.st, tasks.StateFailed), "no job failed for the account's incident")
	require.Equal(t, 1.0, sumCounter(t, metrics, "idemscrape_incidents_total"), "one incident, not one per job")
	// The worker stopped hammering the gateway: deliveries were handed back untouched, and
	// what reached the gateway is what the breaker allows — the deliveries in flight when it
	// opened, then one probe per probe interval (at least 200 ms) — in however long this
	// took on this box, not a count that assumes it was quick.
	refusedWhileOpen := front.refused.Load()
	allowed := int64(concurrency + 1 + time.Since(start)/(200*time.Millisecond))
	require.LessOrEqual(t, refusedWhileOpen, allowed, "407s met vs. the breaker's schedule")
	require.Positive(t, sumCounter(t, metrics, "idemscrape_incident_deferred_deliveries_total"), "deliveries were handed back")

	// The account is fixed: the next probe authenticates and every job completes.
	front.refusing.Store(false)
	handlers.WaitUntil(t, "every job's completion after the incident", 20*time.Millisecond, func() bool {
		return countState(t, r.st, tasks.StateComplete) == jobs
	})
	require.NoError(t, reg.Ready())
	require.Zero(t, countState(t, r.st, tasks.StateFailed))
	require.Equal(t, jobs, testutil.Count(t, r.st.Pool(), `SELECT count(*)::int FROM results`))
	authAttempts := testutil.Count(t, r.st.Pool(), `SELECT count(*)::int FROM attempts WHERE category = 'proxy_auth'`)
	require.GreaterOrEqual(t, authAttempts, 1, "the incident is on the record")
	require.Equal(t, int(front.refused.Load()), authAttempts, "every 407 was an attempt's: no handed-back delivery reached the gateway")
	require.Zero(t, testutil.Count(t, r.st.Pool(), `SELECT count(*)::int FROM attempts WHERE outcome = 'failed'`))
	require.Equal(t, 0.0, gaugeValue(t, metrics, "idemscrape_incident_open"))
	// The incident's attempts are in the history but out of every job's retry budget.
	require.Zero(t, testutil.Count(t, r.st.Pool(), `SELECT count(*)::int FROM jobs j
		WHERE j.budget_attempts <> (SELECT count(*) FROM attempts a WHERE a.job_key = j.key AND a.category = 'proxy_auth')`),
		"budget_attempts counts exactly the proxy_auth attempts")
}

// TestBudgetStopsMidAttempt: a job's bandwidth budget stops the attempt that crosses it
// while the response is still streaming, not only between attempts.
func TestBudgetStopsMidAttempt(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	const budget = 256 << 10
	reg, err := handlers.NewRegistry(handlers.Config{Store: r.st, Redis: r.ns.Client, Provider: r.prov, KeyPrefix: r.ns.Prefix,
		Collector: sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), MaxBodyBytes: 64 << 20}})
	require.NoError(t, err)
	t.Cleanup(reg.Close)
	big := func(job tasks.Payload) (*sessions.Unit, error) {
		return &sessions.Unit{Steps: []sessions.Step{{Name: "big", Safe: true, Run: func(ctx context.Context, sc *sessions.StepContext) error {
			resp, err := sc.Get(r.site.URL + "/big") // 20 MiB
			if err != nil {
				return err
			}
			return sc.Staging.Put("size", len(resp.Body))
		}}}}, nil
	}
	require.NoError(t, reg.Register(catalog.Kind, big, catalog.Parse, handlers.WithRetry(handlers.RetryConfig{BandwidthBudget: budget})))
	key, task := r.job(t, "sku-1")
	err = reg.ProcessTask(ctx, task)
	require.ErrorIs(t, err, asynq.SkipRetry)
	job := requireJob(t, r.st, key, tasks.StateFailed, tasks.CategoryBudgetExceeded)
	require.Greater(t, job.BytesTotal, int64(budget), "the attempt's bytes are recorded")
	require.Less(t, job.BytesTotal, int64(4*budget), "stopped near the budget, not after 20 MiB")
	require.Less(t, r.proxy.Bytes(), int64(8<<20), "the proxy did not carry the whole page")
}

// TestSupersededAttemptEvidence: a delivery whose work was superseded by a newer attempt
// writes no result, but its bytes, session and error are on the record and in the job's
// bytes_total: duplicate work is what the bandwidth figures must show.
func TestSupersededAttemptEvidence(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	key, task := r.job(t, "sku-2")
	leaseKey := r.ns.Prefix + "{" + key + "}:lease"
	inA, releaseA := make(chan struct{}), make(chan struct{})
	first := true
	var mu sync.Mutex
	reg := registryWith(t, r, nil, func(u *sessions.Unit, _ string) {
		mu.Lock()
		defer mu.Unlock()
		if !first {
			return
		}
		first = false
		orig := u.Steps[2].Run
		u.Steps[2].Run = func(ctx context.Context, sc *sessions.StepContext) error {
			if err := orig(ctx, sc); err != nil {
				return err
			}
			close(inA)
			<-releaseA // A "pauses" after fetching; B takes the job over meanwhile
			return nil
		}
	})
	errA := make(chan error, 1)
	go func() { errA <- reg.ProcessTask(ctx, task) }()
	<-inA
	require.NoError(t, r.ns.Client.Del(ctx, leaseKey).Err()) // A's lease expires
	require.NoError(t, reg.ProcessTask(ctx, task))           // B does the job
	close(releaseA)
	require.NoError(t, <-errA, "superseded: acknowledged, nothing written")

	require.Equal(t, 1, testutil.Count(t, r.st.Pool(), `SELECT count(*)::int FROM results`))
	atts, err := r.st.AttemptList(ctx, key)
	require.NoError(t, err)
	require.Len(t, atts, 2)
	a, b := atts[0], atts[1]
	require.Equal(t, store.OutcomeComplete, b.Outcome)
	require.Equal(t, store.OutcomeSuperseded, a.Outcome)
	require.Positive(t, a.Bytes, "A's bytes are recorded")
	require.NotEmpty(t, a.SessionID)
	require.NotEmpty(t, a.Error)
	job, err := r.st.JobGet(ctx, key)
	require.NoError(t, err)
	require.Equal(t, a.Bytes+b.Bytes, job.BytesTotal, "bytes per logical job include the duplicate work")
}

// TestRequeueGivesFreshBudget: a job that failed on its attempt cap, re-queued by an
// operator, gets the whole budget again — its next failure is retryable, not the cap.
func TestRequeueGivesFreshBudget(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	key, task := r.job(t, "sku-6")
	reg := r.registry(t, nil, handlers.WithRetry(handlers.RetryConfig{MaxAttempts: 2}))
	for i := 0; i < 2; i++ {
		r.site.Throttle(1, time.Second)
		_ = reg.ProcessTask(ctx, task)
	}
	requireJob(t, r.st, key, tasks.StateFailed, tasks.CategoryBudgetExceeded)

	_, err := ops.New(r.st.Pool()).JobRequeue(ctx, ops.RequeueParams{Key: key, By: "test", Note: "fresh budget"})
	require.NoError(t, err)
	r.site.Throttle(1, time.Second)
	dec := decisionOf(reg.ProcessTask(ctx, task))
	require.True(t, dec.Retry && dec.Counted, "attempt 1 of the new budget: retryable")
	job := requireState(t, r.st, key, tasks.StateRetryable)
	require.Equal(t, 3, job.Attempts, "the history keeps counting")

	require.NoError(t, reg.ProcessTask(ctx, task))
	requireState(t, r.st, key, tasks.StateComplete)
}

// TestCompletedJobLeavesNoRedisKeys: a completed job's lease is gone from Redis, and no job
// the runner ran keeps a token counter there (PostgreSQL issues the tokens), not even one
// that will run again.
func TestCompletedJobLeavesNoRedisKeys(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	reg := r.registry(t, nil)
	keysOf := func(key string) []string {
		keys, err := r.ns.Client.Keys(ctx, r.ns.Prefix+"{"+key+"}*").Result()
		require.NoError(t, err)
		return keys
	}
	done, task := r.job(t, "sku-11")
	require.NoError(t, reg.ProcessTask(ctx, task))
	handlers.WaitReleases(reg) // a committed job's lease is released in the background
	require.Empty(t, keysOf(done), "no lease, no fence counter")

	again, task := r.job(t, "sku-12")
	r.site.Throttle(1, time.Second)
	require.True(t, decisionOf(reg.ProcessTask(ctx, task)).Retry)
	require.Empty(t, keysOf(again), "a job that runs again keeps no key either")
}
