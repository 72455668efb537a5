package handlers_test

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/examples/catalog"
	"github.com/idemscrape/idemscrape/handlers"
	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/politeness"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/store"
	"github.com/idemscrape/idemscrape/store/ops"
	"github.com/idemscrape/idemscrape/tasks"
	"github.com/idemscrape/idemscrape/testutil"
)

// timedSite is a destination that records when each request arrived (the fake site keeps
// counts only), for rate assertions measured at the site.
type timedSite struct {
	*httptest.Server
	host string // host:port, as the limiter keys it

	mu          sync.Mutex
	clock       func() time.Time // stamps arrivals (useClock); nil: time.Now
	arrivals    []arrival
	robots      int // status of /robots.txt
	throttleAt  int // the n-th /item request answers 429 Retry-After: 2 (0 = never)
	items       int // /item requests so far
	throttledAt []time.Time
}

type arrival struct {
	path string
	at   time.Time
}

func newTimedSite(t *testing.T) *timedSite {
	t.Helper()
	s := &timedSite{robots: http.StatusOK}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		clock := s.clock
		s.mu.Unlock()
		now := time.Now()
		if clock != nil {
			now = clock()
		}
		host, _, _ := net.SplitHostPort(r.RemoteAddr)
		w.Header().Set("X-Exit", host)
		s.mu.Lock()
		s.arrivals = append(s.arrivals, arrival{r.URL.Path, now})
		robots := s.robots
		throttle := false
		if strings.HasPrefix(r.URL.Path, "/item/") {
			s.items++
			if s.items == s.throttleAt {
				throttle = true
				s.throttledAt = append(s.throttledAt, now)
			}
		}
		s.mu.Unlock()
		switch {
		case r.URL.Path == "/robots.txt":
			w.WriteHeader(robots)
			_, _ = fmt.Fprint(w, "User-agent: *\nDisallow: /private/\n")
		case throttle:
			w.Header().Set("Retry-After", "2")
			w.WriteHeader(http.StatusTooManyRequests)
		default:
			_ = json.NewEncoder(w).Encode(map[string]string{"path": r.URL.Path, "exit": host})
		}
	}))
	t.Cleanup(s.Close)
	s.host = strings.TrimPrefix(s.URL, "http://")
	return s
}

// useClock makes the site stamp arrivals with clock (see serverClock).
func (s *timedSite) useClock(clock func() time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.clock = clock
}

// serverClock reads the Redis server's clock (TIME), the one the host limiter counts in. A
// site stamping arrivals with it compares them with the limiter's slots on one clock; each
// stamp is taken after the request arrived, so it is never early.
func serverClock(t *testing.T, rdb *redis.Client) func() time.Time {
	return func() time.Time {
		now, err := rdb.Time(context.Background()).Result()
		if err != nil {
			t.Errorf("site clock: %v", err)
		}
		return now
	}
}

// limiterLog is a go-redis hook on the Redis client of a fleet's registries: it records
// every host-limit script run on one host's keys — hostlimit.lua (a reservation, or the
// unpaced re-check after a wait) and hostpause.lua (a Retry-After) — in the Redis server's
// time, the limiter's own clock. It runs each of them between two TIMEs in one MULTI/EXEC
// (nothing else runs in between), so the script's own reading of TIME lies between the
// two and the slot it handed out between each plus the wait it returned — whatever the
// scheduler did to the worker that asked or to the test. Everything else passes through.
type limiterLog struct {
	tx             *redis.Client // without the hook: runs the transactions
	tat, notBefore string        // the host's key suffixes, "{host:<host>}:tat" and ":notbefore"
	seq            string        // a counter each transaction increments: the server's order

	mu     sync.Mutex
	calls  []limiterCall
	notify chan<- limiterCall // when set (notifyTo), also gets each call, if it has room
}

type limiterCall struct {
	seq       int64         // the order in which the server ran the scripts
	key       string        // the script's key: which bucket
	pause     bool          // hostpause.lua; else hostlimit.lua
	paced     bool          // hostlimit.lua with an emission interval: reserves a slot
	ok        bool          // hostlimit.lua answered {1, wait}: send after wait
	wait      time.Duration // hostlimit.lua's wait
	lo, hi    time.Time     // the server's TIME just before and just after the script
	notBefore time.Time     // hostpause.lua: the host's not-before afterwards
}

// slot bounds the instant hostlimit.lua handed out: its TIME plus the wait it returned.
func (c limiterCall) slot() (lo, hi time.Time) { return c.lo.Add(c.wait), c.hi.Add(c.wait) }

// limiterLog returns a Redis client for the registries that records the limiter's scripts
// on host in the returned log.
func (r *rig) limiterLog(t *testing.T, host string) (*redis.Client, *limiterLog) {
	t.Helper()
	tag := "{host:" + host + "}"
	log := &limiterLog{tx: r.ns.Client, tat: tag + ":tat", notBefore: tag + ":notbefore", seq: r.ns.Prefix + "limiterlog:seq"}
	rdb := redis.NewClient(&redis.Options{Addr: r.ns.Addr, PoolSize: 64})
	rdb.AddHook(log)
	t.Cleanup(func() { _ = rdb.Close() }) // after the registries' Close (cleanups run last first)
	return rdb, log
}

func (h *limiterLog) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *limiterLog) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *limiterLog) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		args := cmd.Args() // eval(sha) script numkeys key... arg...
		if (cmd.Name() != "evalsha" && cmd.Name() != "eval") || len(args) < 4 {
			return next(ctx, cmd)
		}
		key, _ := args[3].(string)
		c := limiterCall{key: key}
		switch {
		case len(args) == 8 && strings.HasSuffix(key, h.tat): // 2 keys; interval, burst, max wait
			c.paced = fmt.Sprint(args[5]) != "0"
		case len(args) == 5 && strings.HasSuffix(key, h.notBefore): // 1 key; pause
			c.pause = true
		default:
			return next(ctx, cmd)
		}
		var before, after *redis.TimeCmd
		var seq *redis.IntCmd
		var nb *redis.StringCmd
		if _, err := h.tx.TxPipelined(ctx, func(p redis.Pipeliner) error {
			seq = p.Incr(ctx, h.seq)
			before = p.Time(ctx)
			_ = p.Process(ctx, cmd)
			if c.pause {
				nb = p.Get(ctx, key)
			}
			after = p.Time(ctx)
			return nil
		}); err != nil {
			// NOSCRIPT included: go-redis then sends EVAL, through this hook. The caller
			// reads the command's error.
			if cmd.Err() == nil {
				cmd.SetErr(err)
			}
			return err
		}
		c.seq, c.lo, c.hi = seq.Val(), before.Val(), after.Val()
		var err error
		if c.pause {
			var us int64
			if us, err = strconv.ParseInt(nb.Val(), 10, 64); err == nil {
				c.notBefore = time.UnixMicro(us)
			}
		} else {
			var reply []int64
			if reply, err = cmd.(*redis.Cmd).Int64Slice(); err == nil && len(reply) != 2 {
				err = fmt.Errorf("reply %v", reply)
			}
			if err == nil {
				c.ok, c.wait = reply[0] == 1, time.Duration(reply[1])*time.Microsecond
			}
		}
		if err != nil { // fails the request, so the test sees it
			err = fmt.Errorf("limiterLog: %w", err)
			cmd.SetErr(err)
			return err
		}
		h.mu.Lock()
		h.calls = append(h.calls, c)
		if h.notify != nil {
			select {
			case h.notify <- c:
			default:
			}
		}
		h.mu.Unlock()
		return nil
	}
}

// notifyTo makes the log send each later call to ch as well (a test's signal that a worker
// reached the limiter), dropping it when ch is full.
func (h *limiterLog) notifyTo(ch chan<- limiterCall) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.notify = ch
}

// recorded returns the calls in the order the server ran them (the hook appends them in
// the order their replies came back).
func (h *limiterLog) recorded() []limiterCall {
	h.mu.Lock()
	calls := slices.Clone(h.calls)
	h.mu.Unlock()
	slices.SortFunc(calls, func(a, b limiterCall) int { return cmp.Compare(a.seq, b.seq) })
	return calls
}

func (s *timedSite) times(pathPrefix string) []time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	var ts []time.Time
	for _, a := range s.arrivals {
		if strings.HasPrefix(a.path, pathPrefix) {
			ts = append(ts, a.at)
		}
	}
	slices.SortFunc(ts, func(a, b time.Time) int { return a.Compare(b) })
	return ts
}

// itemKind fetches <base>/item/<source id> in one step.
func itemWorkflow(base string) handlers.WorkflowFunc {
	return func(job tasks.Payload) (*sessions.Unit, error) {
		return &sessions.Unit{Name: "item", Steps: []sessions.Step{{Name: "item", Safe: true,
			Run: func(ctx context.Context, sc *sessions.StepContext) error {
				resp, err := sc.Get(base + "/item/" + job.Spec.SourceID)
				if err != nil {
					return err
				}
				return sc.Staging.Put("item", json.RawMessage(resp.Body))
			}}}}, nil
	}
}

func itemParse(_ tasks.Payload, staged map[string]json.RawMessage) (handlers.Observation, error) {
	return handlers.Observation{Data: staged["item"]}, nil
}

// kindJob records a job of kind for id and returns its key and task.
func (r *rig) kindJob(t *testing.T, kind, id string) (string, *asynq.Task) {
	t.Helper()
	return r.jobOf(t, kind, id, "US", 1)
}

// limitedFleet returns n workers (worker-0 …) on rdb, the limiter log's client; mutate sets
// their host limits, register their kinds.
func (r *rig) limitedFleet(t *testing.T, rdb *redis.Client, n int, mutate func(*handlers.Config), register func(*handlers.Registry)) []*handlers.Registry {
	t.Helper()
	regs := make([]*handlers.Registry, n)
	for i := range regs {
		cfg := handlers.Config{Store: r.st, Redis: rdb, Provider: r.prov, KeyPrefix: r.ns.Prefix,
			WorkerID: fmt.Sprintf("worker-%d", i),
			// A request that takes long on a loaded box is not what this test is about.
			Collector: sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), RequestTimeout: time.Minute},
		}
		mutate(&cfg)
		reg, err := handlers.NewRegistry(cfg)
		require.NoError(t, err)
		t.Cleanup(reg.Close)
		register(reg)
		regs[i] = reg
	}
	return regs
}

// runFleet delivers every task once, spread over the registries with perReg goroutines
// each, as len(regs) worker processes would, and returns each task's error by index.
func runFleet(regs []*handlers.Registry, perReg int, ts []*asynq.Task) []error {
	errs := make([]error, len(ts))
	next := make(chan int, len(ts))
	for i := range ts {
		next <- i
	}
	close(next)
	var wg sync.WaitGroup
	for _, reg := range regs {
		for range perReg {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range next {
					errs[i] = reg.ProcessTask(context.Background(), ts[i])
				}
			}()
		}
	}
	wg.Wait()
	return errs
}

func metricFamily(t *testing.T, g prometheus.Gatherer, name string) []*dto.Metric {
	t.Helper()
	mfs, err := g.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()
		}
	}
	return nil
}

func labelled(m *dto.Metric, name, value string) bool {
	for _, l := range m.GetLabel() {
		if l.GetName() == name && l.GetValue() == value {
			return true
		}
	}
	return false
}

// robotsLockTaken is a Redis hook that closes taken when a SET NX of key fails: the
// worker behind the client found the robots.txt lock held by another.
type robotsLockTaken struct {
	key   string
	taken chan struct{}
	once  sync.Once
}

func (h *robotsLockTaken) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *robotsLockTaken) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		args := cmd.Args()
		if bc, ok := cmd.(*redis.BoolCmd); ok && err == nil && !bc.Val() && len(args) > 1 &&
			strings.EqualFold(fmt.Sprint(args[0]), "set") && fmt.Sprint(args[1]) == h.key {
			h.once.Do(func() { close(h.taken) })
		}
		return err
	}
}

func (h *robotsLockTaken) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// fleetCounter sums a counter over every registry, for metrics whose labels match.
func fleetCounter(t *testing.T, regs []*handlers.Registry, name, label, value string) float64 {
	t.Helper()
	var v float64
	for _, reg := range regs {
		for _, m := range metricFamily(t, reg.Gatherer(), name) {
			if label == "" || labelled(m, label, value) {
				v += m.GetCounter().GetValue()
			}
		}
	}
	return v
}

func TestRobotsFetchedOncePerHost(t *testing.T) {
	ctx := context.Background()

	t.Run("FiftyJobsFourWorkers", func(t *testing.T) {
		r := newRig(t, rigOpts{})
		regs := make([]*handlers.Registry, 4)
		for i := range regs {
			regs[i] = r.registry(t, func(c *handlers.Config) { c.WorkerID = fmt.Sprintf("worker-%d", i) })
		}
		var ts []*asynq.Task
		for i := 1; i <= 50; i++ {
			_, task := r.job(t, fmt.Sprintf("sku-%d", i))
			ts = append(ts, task)
		}
		for i, err := range runFleet(regs, 4, ts) {
			require.NoError(t, err, "job %d", i)
		}
		assert.Equal(t, 50, testutil.Count(t, r.st.Pool(), `SELECT count(*)::int FROM jobs WHERE state = 'complete'`))
		assert.Equal(t, 1, r.site.RobotsHits(), "one robots.txt fetch for 50 jobs on 4 workers")
		assert.Equal(t, 1.0, fleetCounter(t, regs, "idemscrape_robots_fetches_total", "status", "2xx"))
		robotsBytes := fleetCounter(t, regs, "idemscrape_robots_bytes_total", "", "")
		assert.Positive(t, robotsBytes, "the fetch's bytes are the fleet's")
		// Zero config: no host is limited, so the limiter never touched Redis.
		tat, err := r.ns.Client.Keys(ctx, r.ns.Prefix+"*:tat").Result()
		require.NoError(t, err)
		assert.Empty(t, tat)
		for _, reg := range regs {
			assert.Empty(t, metricFamily(t, reg.Gatherer(), "idemscrape_host_wait_seconds"))
		}
	})
	t.Run("DisallowedPathIsTerminal", func(t *testing.T) {
		r := newRig(t, rigOpts{})
		reg := r.registryKind(t, func(tasks.Payload) (*sessions.Unit, error) {
			return &sessions.Unit{Name: "private", Steps: []sessions.Step{{Name: "private", Safe: true,
				Run: func(ctx context.Context, sc *sessions.StepContext) error {
					_, err := sc.Get(r.site.URL + "/private/report")
					return err
				}}}}, nil
		}, catalog.Parse)
		key, task := r.job(t, "sku-1")
		d := decisionOf(reg.ProcessTask(ctx, task))
		require.True(t, d.Skip, "terminal: %s", d.ErrorMsg)
		requireJob(t, r.st, key, tasks.StateFailed, tasks.CategoryRobotsDisallowed)
		atts, err := r.st.AttemptList(ctx, key)
		require.NoError(t, err)
		require.Len(t, atts, 1)
		assert.Contains(t, atts[0].Error, "robots.txt of "+r.site.URL+" disallows /private/report")
		assert.Zero(t, r.site.Hits("/private/report"))
	})
	// Another worker holds the origin's robots.txt lock: the job's request waits for it,
	// and idemscrape_robots_lock_waits_total counts how the wait ended.
	t.Run("LockWaitsCounted", func(t *testing.T) {
		for _, tc := range []struct {
			name    string
			lapse   bool // the holder stops: its lease lapses while the job waits
			outcome politeness.RobotsLockWait
			state   tasks.JobState
		}{
			{"HolderStopped", true, politeness.RobotsLockWaitTookOver, tasks.StateComplete},
			{"HolderStillFetching", false, politeness.RobotsLockWaitGaveUp, tasks.StateRetryable},
		} {
			t.Run(tc.name, func(t *testing.T) {
				r := newRig(t, rigOpts{})
				keys, err := lua.NewKeys(r.ns.Prefix)
				require.NoError(t, err)
				lockKey := keys.RobotsLock(strings.ToLower(r.site.URL))
				taken := &robotsLockTaken{key: lockKey, taken: make(chan struct{})}
				rdb := redis.NewClient(&redis.Options{Addr: r.ns.Addr})
				t.Cleanup(func() { _ = rdb.Close() })
				rdb.AddHook(taken)
				reg := r.registry(t, func(c *handlers.Config) { c.Redis = rdb })
				ok, err := r.ns.Client.SetNX(ctx, lockKey, "another-worker", time.Hour).Result()
				require.NoError(t, err)
				require.True(t, ok)

				key, task := r.job(t, "sku-1")
				done := make(chan error, 1)
				go func() { done <- reg.ProcessTask(ctx, task) }()
				select {
				case <-taken.taken: // the job's request found the lock held, and waits
				case err := <-done:
					t.Fatalf("the job ended without waiting for the lock: %v", err)
				case <-time.After(time.Minute): // a hang guard, not a timing
					t.Fatal("the job never tried the lock")
				}
				if tc.lapse {
					require.NoError(t, r.ns.Client.Del(ctx, lockKey).Err()) // what the lapse leaves
				}
				var perr error
				select {
				case perr = <-done:
				case <-time.After(time.Minute): // a hang guard, not a timing
					t.Fatal("the job did not end")
				}
				if tc.state == tasks.StateComplete {
					require.NoError(t, perr)
					requireJob(t, r.st, key, tasks.StateComplete, "")
					assert.Equal(t, 1, r.site.RobotsHits(), "the waiting worker fetched robots.txt")
				} else {
					assert.True(t, decisionOf(perr).Retry, "retryable: %v", perr)
					requireJob(t, r.st, key, tasks.StateRetryable, tasks.CategoryNetwork)
					assert.Zero(t, r.site.RobotsHits(), "not fetched while another worker's lock is held")
				}
				regs := []*handlers.Registry{reg}
				for _, o := range []politeness.RobotsLockWait{politeness.RobotsLockWaitEntry, politeness.RobotsLockWaitTookOver, politeness.RobotsLockWaitGaveUp} {
					want := 0.0
					if o == tc.outcome {
						want = 1
					}
					assert.Equal(t, want, fleetCounter(t, regs, "idemscrape_robots_lock_waits_total", "outcome", string(o)), "outcome %s", o)
				}
			})
		}
	})
	t.Run("ServerErrorRobotsJobsWait", func(t *testing.T) {
		r := newRig(t, rigOpts{})
		site := newTimedSite(t)
		site.mu.Lock()
		site.robots = http.StatusServiceUnavailable
		site.mu.Unlock()
		reg := r.registryKind(t, itemWorkflow(site.URL), itemParse)
		var keys []string
		var ts []*asynq.Task
		for i := range 5 {
			key, task := r.job(t, fmt.Sprintf("sku-%d", i+1))
			keys, ts = append(keys, key), append(ts, task)
		}
		for _, err := range runFleet([]*handlers.Registry{reg}, 2, ts) {
			d := decisionOf(err)
			require.True(t, d.Retry, "jobs wait, they do not fail: %s", d.ErrorMsg)
			assert.True(t, d.Counted)
		}
		for _, key := range keys {
			requireJob(t, r.st, key, tasks.StateRetryable, tasks.CategoryDestinationError)
			atts, err := r.st.AttemptList(ctx, key)
			require.NoError(t, err)
			assert.Contains(t, atts[0].Error, "robots.txt of "+site.URL+" answered 503")
		}
		assert.Len(t, site.times("/robots.txt"), 1, "the 5xx is shared for a while, not fetched per job")
		assert.Empty(t, site.times("/item/"))
	})
}

// TestHostRateLimitFleetWide: three workers with six deliveries each share one host's
// limit. It is measured in the limiter's own time — the Redis server's clock, on which the
// GCRA hands out slots — not in wall-clock windows at the site, which a loaded scheduler
// fills with requests that waited their turn in a run queue: the slots are spaced as the
// limit says, every request took one, and none reached the site before its slot.
func TestHostRateLimitFleetWide(t *testing.T) {
	const (
		rate  = 20
		burst = 5
		jobsA = 110
		jobsB = 110
	)
	interval := time.Duration(math.Ceil(1e6/rate)) * time.Microsecond // as lua.HostLimits rounds it
	r := newRig(t, rigOpts{})
	siteA, siteB := newTimedSite(t), newTimedSite(t)
	siteA.useClock(serverClock(t, r.ns.Client))
	rdb, limiter := r.limiterLog(t, siteA.host)
	regs := r.limitedFleet(t, rdb, 3, func(c *handlers.Config) {
		c.HostLimits = map[string]politeness.Limit{
			siteA.host: {Rate: rate, Burst: burst},
			siteB.host: {Rate: 10000, Burst: 1000}, // generous: never makes anyone wait here
		}
	}, func(reg *handlers.Registry) {
		require.NoError(t, reg.Register("polite.a", itemWorkflow(siteA.URL), itemParse))
		require.NoError(t, reg.Register("polite.b", itemWorkflow(siteB.URL), itemParse))
	})
	var ts []*asynq.Task
	for i := range max(jobsA, jobsB) {
		if i < jobsA {
			_, task := r.kindJob(t, "polite.a", fmt.Sprintf("a-%d", i))
			ts = append(ts, task)
		}
		if i < jobsB {
			_, task := r.kindJob(t, "polite.b", fmt.Sprintf("b-%d", i))
			ts = append(ts, task)
		}
	}
	for i, err := range runFleet(regs, 6, ts) {
		require.NoError(t, err, "job %d", i)
	}

	// Every request to A (robots.txt included: it is paced too) took exactly one slot, all
	// from one bucket: the fleet's.
	arrivals := siteA.times("/")
	require.Len(t, arrivals, jobsA+1)
	var slots []limiterCall // reservations, in the order the server ran them
	buckets := map[string]bool{}
	for _, c := range limiter.recorded() {
		if c.paced {
			require.True(t, c.ok, "no slot was out of reach (HostWaitMax): %+v", c)
			slots = append(slots, c)
			buckets[c.key] = true
		}
	}
	require.Len(t, slots, len(arrivals), "one slot per request")
	require.Len(t, buckets, 1, "one bucket for the fleet: %v", buckets)

	// What the GCRA guarantees, on its clock: the k-th slot reserved after the i-th is at
	// least (k-i+1-burst) emission intervals later. Hence at most rate·w + burst slots in
	// any w, and over the whole run. Each side is taken at its most favourable bound, so
	// no scheduling delay can fail this; a limit per worker (three buckets, three bursts
	// at once) fails it by a second or more.
	worst, wi, wk := time.Duration(math.MinInt64), 0, 0
	for i := range slots {
		iLo, _ := slots[i].slot()
		for k := i + burst; k < len(slots); k++ {
			_, kHi := slots[k].slot()
			if short := time.Duration(k-i+1-burst)*interval - kHi.Sub(iLo); short > worst {
				worst, wi, wk = short, i, k
			}
		}
	}
	if !assert.LessOrEqual(t, worst, time.Duration(0),
		"slots %d and %d (Redis time) are closer than %d slots at %d/s with a burst of %d allow", wi, wk, wk-wi+1, rate, burst) {
		logSlots(t, slots)
	}

	// No request reached the site before its slot. The site stamps each arrival in the
	// same server time, after the request arrived; the j earliest arrivals each came after
	// a slot of their own, so the j-th arrival is no earlier than the j-th slot. A worker
	// that sent without waiting for its slot fails this.
	starts := make([]time.Time, len(slots))
	for i, c := range slots {
		starts[i], _ = c.slot()
	}
	slices.SortFunc(starts, func(a, b time.Time) int { return a.Compare(b) })
	for j, at := range arrivals {
		if !assert.False(t, at.Before(starts[j]), "arrival %d at the site is %v before the %d-th slot", j, starts[j].Sub(at), j) {
			logSlots(t, slots)
			break
		}
	}

	// The other host was never held back: every request to it was sent at once.
	var waitsB, zeroB uint64
	for _, reg := range regs {
		for _, m := range metricFamily(t, reg.Gatherer(), "idemscrape_host_wait_seconds") {
			if !labelled(m, "kind", "polite.b") {
				continue
			}
			h := m.GetHistogram()
			waitsB += h.GetSampleCount()
			zeroB += h.GetBucket()[0].GetCumulativeCount() // le=0
		}
	}
	assert.Equal(t, uint64(jobsB+1), waitsB, "every request to B (and its robots.txt) asked the limiter")
	assert.Equal(t, waitsB, zeroB, "and none of them waited")
}

// logSlots logs each slot's bounds relative to the first, for a failure's reader.
func logSlots(t *testing.T, slots []limiterCall) {
	t.Helper()
	if len(slots) == 0 {
		return
	}
	t0, _ := slots[0].slot()
	for i, c := range slots {
		lo, hi := c.slot()
		t.Logf("slot %3d: %v..%v (wait %v, bucket %s)", i, lo.Sub(t0), hi.Sub(t0), c.wait, c.key)
	}
}

func TestRetryAfterSlowsHost(t *testing.T) {
	const (
		rate  = 5
		jobs  = 15
		pause = 2 * time.Second // the site's Retry-After
	)
	r := newRig(t, rigOpts{})
	site := newTimedSite(t)
	site.mu.Lock()
	site.throttleAt = 5
	site.mu.Unlock()
	site.useClock(serverClock(t, r.ns.Client))
	rdb, limiter := r.limiterLog(t, site.host)
	regs := r.limitedFleet(t, rdb, 3, func(c *handlers.Config) {
		c.Collector.ThrottleWaitMax = -1
		c.HostLimits = map[string]politeness.Limit{site.host: {Rate: rate, Burst: 1}}
	}, func(reg *handlers.Registry) {
		require.NoError(t, reg.Register("polite.a", itemWorkflow(site.URL), itemParse))
	})
	var ts []*asynq.Task
	for i := range jobs {
		_, task := r.kindJob(t, "polite.a", fmt.Sprintf("a-%d", i))
		ts = append(ts, task)
	}
	var throttled []asynqDecision
	for i, err := range runFleet(regs, 2, ts) {
		d := decisionOf(err)
		if !d.Ack {
			throttled = append(throttled, d)
			continue
		}
		require.NoError(t, err, "job %d", i)
	}
	require.Len(t, throttled, 1, "only the job that got the 429 did not complete")
	assert.True(t, throttled[0].Retry)
	assert.GreaterOrEqual(t, throttled[0].Delay, pause, "it waits at least the Retry-After")
	assert.Contains(t, throttled[0].ErrorMsg, string(tasks.CategoryThrottled))

	site.mu.Lock()
	answered429 := len(site.throttledAt)
	site.mu.Unlock()
	require.Equal(t, 1, answered429)

	// Measured in the limiter's time (the Redis server's clock), not against when the site
	// sent its 429: requests let go before the pause was set may still be on their way
	// after it — the later the worker that got the 429 reaches Redis, the more of them a
	// loaded box has. What the fleet guarantees is that nothing is let go from the moment
	// the pause is set until it ends.
	calls := limiter.recorded()
	var pauses []limiterCall
	for _, c := range calls {
		if c.pause {
			pauses = append(pauses, c)
		}
	}
	require.Len(t, pauses, 1, "one 429, one pause for the fleet")
	p := pauses[0]
	require.GreaterOrEqual(t, p.notBefore.Sub(p.lo), pause, "paused for the Retry-After")
	// A request is let go by the limiter's {1, 0}: a slot due now, or the re-check after
	// waiting for one. Each request is let go once, after which it is sent.
	letGo := 0 // before the pause was set
	var offsets, during []string
	for _, c := range calls {
		if c.pause || !c.ok || c.wait != 0 {
			continue
		}
		at := fmt.Sprintf("%v..%v", c.lo.Sub(p.notBefore), c.hi.Sub(p.notBefore))
		offsets = append(offsets, at)
		switch {
		case c.seq < p.seq:
			letGo++
		case c.hi.Before(p.notBefore):
			during = append(during, at)
		}
	}
	assert.Empty(t, during, "let go after the pause was set, before its end (relative to the end)")
	// So every request that reached the site before the pause ended (stamped in the same
	// server time, after it arrived) was let go before the pause was set.
	var early, after int
	for _, at := range site.times("/") {
		if at.Before(p.notBefore) {
			early++
		} else {
			after++
		}
	}
	assert.LessOrEqual(t, early, letGo,
		"requests at the site before the pause ended vs. let go before it was set; permissions relative to the pause's end: %v", offsets)
	assert.Positive(t, after, "the other workers' jobs went on after the pause")
	assert.Equal(t, 1.0, fleetCounter(t, regs, "idemscrape_host_throttled_total", "reason", "retry_after"))
}

func TestSilentExitChangeIsSessionLoss(t *testing.T) {
	ctx := context.Background()
	clock := testutil.NewClock(time.Date(2026, 4, 23, 15, 0, 0, 0, time.UTC))
	// The fake proxy re-assigns a session's exit, without any error, once a minute of its
	// (stub) clock has passed; the site is not strict, so only the exit check can notice.
	r := newRig(t, rigOpts{proxy: testutil.FakeProxyConfig{Format: testutil.ProxyFormatGeneric, User: "acct", Password: canary,
		SessionLifetime: time.Minute, Now: clock.Now}})
	var err error
	r.prov, err = r.prov.WithExitHeader("X-Exit") // the fake site names the exit it saw
	require.NoError(t, err)

	var moved atomic.Bool
	workflow := func(job tasks.Payload) (*sessions.Unit, error) {
		u, err := catalog.Workflow(r.site.URL)(job)
		if err != nil {
			return nil, err
		}
		orig := u.Steps[0].Run
		u.Steps[0].Run = func(ctx context.Context, sc *sessions.StepContext) error {
			err := orig(ctx, sc)
			if moved.CompareAndSwap(false, true) {
				clock.Advance(2 * time.Minute) // mid-unit, after step 1 of the first session
			}
			return err
		}
		return u, nil
	}
	// The record keeps the exit each step saw, so the test can tell where it came from.
	parse := func(job tasks.Payload, staged map[string]json.RawMessage) (handlers.Observation, error) {
		obs, err := catalog.Parse(job, staged)
		if err != nil {
			return obs, err
		}
		var steps [3]struct{ Exit string }
		for i, k := range []string{"search", "product", "price"} {
			if err := json.Unmarshal(staged[k], &steps[i]); err != nil {
				return obs, err
			}
		}
		obs.Data = map[string]any{"record": obs.Data, "exits": []string{steps[0].Exit, steps[1].Exit, steps[2].Exit}}
		return obs, nil
	}
	reg := r.registryKind(t, workflow, parse)
	key, task := r.job(t, "sku-4")
	require.NoError(t, reg.ProcessTask(ctx, task))

	var data struct{ Exits []string }
	var raw []byte
	require.NoError(t, r.st.Pool().QueryRow(ctx, `SELECT data FROM results WHERE job_key = $1`, key).Scan(&raw))
	require.NoError(t, json.Unmarshal(raw, &data))
	require.Len(t, data.Exits, 3)
	assert.Equal(t, []string{data.Exits[0], data.Exits[0], data.Exits[0]}, data.Exits, "the committed result comes from one exit")

	atts, err := r.st.AttemptList(ctx, key)
	require.NoError(t, err)
	require.Len(t, atts, 1)
	assert.Equal(t, store.OutcomeComplete, atts[0].Outcome)
	assert.Equal(t, data.Exits[0], r.proxy.ExitOf(atts[0].SessionID), "on the restarted session's exit")
	assert.Equal(t, 1, testutil.Count(t, r.st.Pool(),
		`SELECT count(*)::int FROM quarantine WHERE job_key = $1 AND attempt_no = 1 AND reason LIKE 'session_lost%exit changed%'`, key),
		"the lost session's half is quarantined with the reason")
	assert.Equal(t, 1.0, fleetCounter(t, []*handlers.Registry{reg}, "idemscrape_session_restarts_total", "reason", string(tasks.CategorySessionLost)))
}

func TestHostWaitRespectsTheJob(t *testing.T) {
	ctx := context.Background()
	type hostWait struct {
		*rig
		site *timedSite
		reg  *handlers.Registry
		// paused is a time before the host was paused (for a minute, from then on the
		// server's clock): what is left of the pause is at least a minute less the time
		// since.
		paused time.Time
		// slots gets each limiter call for the host: the first is the job's reservation,
		// after which it waits for its slot (a minute away). The subtests end the wait only
		// then: ended earlier — at the first lease renewal, say, which a loaded box can
		// reach before the job reaches the host — it ends something else.
		slots chan limiterCall
	}
	setup := func(t *testing.T, waitMax time.Duration, onRenew func(error)) hostWait {
		w := hostWait{rig: newRig(t, rigOpts{}), site: newTimedSite(t), slots: make(chan limiterCall, 10)}
		rdb, limiter := w.limiterLog(t, w.site.host)
		limiter.notifyTo(w.slots)
		var err error
		w.reg, err = handlers.NewRegistry(handlers.Config{Store: w.st, Redis: rdb, Provider: w.prov, KeyPrefix: w.ns.Prefix,
			Collector:   sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), RequestTimeout: 5 * time.Second, IgnoreRobotsTxt: true},
			HostLimits:  map[string]politeness.Limit{w.site.host: {Rate: 100, Burst: 10}},
			HostWaitMax: waitMax,
			KeepOptions: &lua.KeepOptions{Interval: 50 * time.Millisecond, OnRenew: onRenew},
		})
		require.NoError(t, err)
		t.Cleanup(w.reg.Close)
		require.NoError(t, w.reg.Register("polite.a", itemWorkflow(w.site.URL), itemParse))
		// Another worker got a 429 with a long Retry-After from this host.
		hl, err := lua.NewHostLimits(w.ns.Client, w.ns.Prefix)
		require.NoError(t, err)
		w.paused = time.Now()
		_, err = hl.Pause(ctx, w.site.host, time.Minute)
		require.NoError(t, err)
		return w
	}
	// waiting returns once the job holds a slot a minute away and so waits for it.
	waiting := func(t *testing.T, w hostWait) {
		t.Helper()
		c := recv(t, w.slots, "the job's reservation at the host")
		require.True(t, c.paced && c.ok, "a reserved slot: %+v", c)
		require.Greater(t, c.wait, 30*time.Second, "behind the host's pause: %+v", c)
	}

	t.Run("TooLongAWaitEndsTheAttemptThrottled", func(t *testing.T) {
		w := setup(t, 0, nil) // HostWaitMax: the default, 10 s
		key, task := w.kindJob(t, "polite.a", "a-1")
		d := decisionOf(w.reg.ProcessTask(ctx, task))
		require.True(t, d.Retry, d.ErrorMsg)
		assert.GreaterOrEqual(t, d.Delay, time.Minute-time.Since(w.paused), "retried once the host's pause is over")
		job, err := w.st.JobGet(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, string(tasks.CategoryThrottled), job.LastCategory)
		assert.Empty(t, w.site.times("/"))
		assert.Equal(t, 1.0, fleetCounter(t, []*handlers.Registry{w.reg}, "idemscrape_host_throttled_total", "reason", "wait_too_long"))
	})
	t.Run("KeeperRenewsWhileWaitingAndLeaseLossEndsTheWait", func(t *testing.T) {
		renewed := make(chan error, 100)
		w := setup(t, 5*time.Minute, func(err error) {
			select {
			case renewed <- err:
			default:
			}
		})
		key, task := w.kindJob(t, "polite.a", "a-1")
		done := make(chan error, 1)
		go func() { done <- w.reg.ProcessTask(ctx, task) }()
		// The job waits for the host (a minute away) while its lease is renewed...
		waiting(t, w)
		for len(renewed) > 0 { // renewals before the wait began
			require.NoError(t, <-renewed)
		}
		for range 3 {
			require.NoError(t, recv(t, renewed, "a lease renewal during the wait"))
		}
		// ...until the lease is lost: the wait ends at once, not when the pause does.
		keys, err := lua.NewKeys(w.ns.Prefix)
		require.NoError(t, err)
		require.NoError(t, w.ns.Client.Del(ctx, keys.Lease(key)).Err())
		d := decisionOf(recv(t, done, "the delivery's end after its lease was lost"))
		require.True(t, d.Retry, d.ErrorMsg)
		job, err := w.st.JobGet(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, string(tasks.CategoryLeaseLost), job.LastCategory)
		assert.Empty(t, w.site.times("/"), "nothing was sent")
	})
	t.Run("ShutdownEndsTheWait", func(t *testing.T) {
		w := setup(t, 5*time.Minute, nil)
		key, task := w.kindJob(t, "polite.a", "a-1")
		dctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- w.reg.ProcessTask(dctx, task) }()
		waiting(t, w)
		cancel()
		d := decisionOf(recv(t, done, "the delivery's end after shutdown"))
		require.True(t, d.Retry, d.ErrorMsg)
		job, err := w.st.JobGet(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, string(tasks.CategoryInterrupted), job.LastCategory)
		assert.Empty(t, w.site.times("/"))
	})
}

func TestPolitenessConfig(t *testing.T) {
	r := newRig(t, rigOpts{})
	build := func(mutate func(*handlers.Config)) error {
		cfg := handlers.Config{Store: r.st, Redis: r.ns.Client, Provider: r.prov, KeyPrefix: r.ns.Prefix, NoGroupCommit: true}
		mutate(&cfg)
		reg, err := handlers.NewRegistry(cfg)
		if err == nil {
			reg.Close()
		}
		return err
	}
	t.Run("BadHostLimit", func(t *testing.T) {
		err := build(func(c *handlers.Config) { c.HostLimits = map[string]politeness.Limit{"shop.example": {Rate: -1}} })
		require.ErrorContains(t, err, `handlers: Config.HostLimits["shop.example"]: `)
		require.ErrorContains(t, err, "Limit.Rate")
	})
	t.Run("BadDefaultHostLimit", func(t *testing.T) {
		err := build(func(c *handlers.Config) { c.DefaultHostLimit = &politeness.Limit{Rate: 1, Burst: -2} })
		require.ErrorContains(t, err, "handlers: Config.DefaultHostLimit: ")
	})
	t.Run("NegativeHostWaitMax", func(t *testing.T) {
		require.ErrorContains(t, build(func(c *handlers.Config) { c.HostWaitMax = -time.Second }), "handlers: Config.HostWaitMax: -1s must be positive")
	})
	t.Run("BadKindLimit", func(t *testing.T) {
		reg, err := handlers.NewRegistry(handlers.Config{Store: r.st, Redis: r.ns.Client, Provider: r.prov, KeyPrefix: r.ns.Prefix, NoGroupCommit: true})
		require.NoError(t, err)
		defer reg.Close()
		err = reg.Register("polite.a", itemWorkflow("http://127.0.0.1:1"), itemParse, handlers.WithHostLimit(politeness.Limit{Rate: -3}))
		require.ErrorContains(t, err, "WithHostLimit")
	})
}

// TestHostPauseCapped: a Retry-After of two hours pauses the host for the fleet at most
// MaxHostPause; the job that received it still waits the whole Retry-After.
func TestHostPauseCapped(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	reg := r.registry(t, func(c *handlers.Config) { c.DefaultHostLimit = &politeness.Limit{Rate: 100, Burst: 10} })
	key, task := r.job(t, "sku-13")
	r.site.Throttle(1, 2*time.Hour)
	dec := decisionOf(reg.ProcessTask(ctx, task))
	require.True(t, dec.Retry, "%+v", dec)
	require.GreaterOrEqual(t, dec.Delay, 2*time.Hour-time.Minute, "the job waits its whole Retry-After")
	keys, err := r.ns.Client.Keys(ctx, r.ns.Prefix+"{host:*}:notbefore").Result()
	require.NoError(t, err)
	require.Len(t, keys, 1, "the host was paused for the fleet")
	ttl, err := r.ns.Client.PTTL(ctx, keys[0]).Result()
	require.NoError(t, err)
	require.LessOrEqual(t, ttl, politeness.MaxHostPause, "but at most MaxHostPause")
	job, err := r.st.JobGet(ctx, key)
	require.NoError(t, err)
	require.Equal(t, string(tasks.CategoryThrottled), job.LastCategory)
}

// TestFleetPauseNotChargedToBudget: a job that meets a host paused fleet-wide by another
// job's Retry-After (nothing sent) is retried once the pause is over, uncounted and out of
// its budgets — not failed as budget_exceeded although the pause is longer than what is
// left of its total time budget, and although this is its last attempt under the cap. The
// job that receives a Retry-After itself is still charged for it.
func TestFleetPauseNotChargedToBudget(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, rigOpts{})
	site := newTimedSite(t)
	reg, err := handlers.NewRegistry(handlers.Config{Store: r.st, Redis: r.ns.Client, Provider: r.prov, KeyPrefix: r.ns.Prefix,
		Collector:  sessions.CollectorConfig{Guard: sessions.LoopbackGuard(), ThrottleWaitMax: -1, RequestTimeout: 5 * time.Second, IgnoreRobotsTxt: true},
		HostLimits: map[string]politeness.Limit{site.host: {Rate: 100, Burst: 10}},
		Rand:       func() float64 { return 0.5 },
	})
	require.NoError(t, err)
	t.Cleanup(reg.Close)
	tight := handlers.WithRetry(handlers.RetryConfig{MaxAttempts: 1, TotalBudget: 30 * time.Second})
	require.NoError(t, reg.Register("polite.a", itemWorkflow(site.URL), itemParse, tight))

	t.Run("FleetPause", func(t *testing.T) {
		hl, err := lua.NewHostLimits(r.ns.Client, r.ns.Prefix)
		require.NoError(t, err)
		paused := time.Now()
		_, err = hl.Pause(ctx, site.host, time.Minute) // another worker's 429
		require.NoError(t, err)
		key, task := r.kindJob(t, "polite.a", "a-1")
		d := decisionOf(reg.ProcessTask(ctx, task))
		require.True(t, d.Retry, d.ErrorMsg)
		assert.False(t, d.Counted, "the fleet's wait is not the job's failure")
		// What is left of the pause, at least: a minute less the time since it was set.
		assert.GreaterOrEqual(t, d.Delay, time.Minute-time.Since(paused), "retried once the host's pause is over")
		requireJob(t, r.st, key, tasks.StateRetryable, tasks.CategoryThrottled)
		budget, err := ops.New(r.st.Pool()).BudgetGet(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, 1, budget.Attempts, "the attempt is out of the job's attempt cap")
		assert.Empty(t, site.times("/"), "nothing was sent")
	})
	t.Run("OwnRetryAfterStillCharged", func(t *testing.T) {
		site2 := newTimedSite(t)
		site2.throttleAt = 1 // the first /item answers 429 Retry-After: 2
		require.NoError(t, reg.Register("polite.b", itemWorkflow(site2.URL), itemParse,
			handlers.WithRetry(handlers.RetryConfig{MaxAttempts: 1, TotalBudget: 30 * time.Second})))
		key, task := r.kindJob(t, "polite.b", "b-1")
		d := decisionOf(reg.ProcessTask(ctx, task))
		require.True(t, d.Skip, d.ErrorMsg)
		requireJob(t, r.st, key, tasks.StateFailed, tasks.CategoryBudgetExceeded, "the destination answered this job: its own failure")
	})
}
