package politeness_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/politeness"
	"github.com/idemscrape/idemscrape/sessions"
	"github.com/idemscrape/idemscrape/testutil"
)

// robotsHolderEnv, set in a child process of the test binary, makes TestMain run
// robotsHolderMain instead of the tests: a worker that fetches an origin's robots.txt
// under the fleet-wide lock, which the parent then stops with SIGSTOP.
const robotsHolderEnv = "IDEMSCRAPE_TEST_ROBOTS_HOLDER"

// robotsHolderSpec is what the child needs: the parent's Redis namespace, the site and
// the worker's request timeout.
type robotsHolderSpec struct {
	Redis   string        `json:"redis"`
	Prefix  string        `json:"prefix"`
	Site    string        `json:"site"`
	Timeout time.Duration `json:"timeout"`
}

// robotsHolderMain checks spec.Site's /page against a RobotsCache of its own, as a worker's
// request does: the robots.txt fetch runs (and its lock is held and renewed) until the site
// answers. It returns the process's exit code: 0 when the check passed.
func robotsHolderMain(raw string) int {
	var spec robotsHolderSpec
	if err := json.Unmarshal([]byte(raw), &spec); err != nil {
		fmt.Fprintln(os.Stderr, "robots holder:", err)
		return 2
	}
	rdb := redis.NewClient(&redis.Options{Addr: spec.Redis})
	defer rdb.Close()
	rc, err := politeness.NewRobotsCache(politeness.RobotsConfig{Redis: rdb, KeyPrefix: spec.Prefix})
	if err != nil {
		fmt.Fprintln(os.Stderr, "robots holder:", err)
		return 2
	}
	u, err := url.Parse(spec.Site + "/page")
	if err != nil {
		fmt.Fprintln(os.Stderr, "robots holder:", err)
		return 2
	}
	// The request's own deadline, as the collector's http.Client gives every request.
	ctx, cancel := context.WithTimeout(context.Background(), spec.Timeout)
	defer cancel()
	via := &directVia{timeout: spec.Timeout, client: &http.Client{Transport: &http.Transport{Proxy: nil}}}
	if err := rc.Check(ctx, via, u); err != nil {
		fmt.Fprintln(os.Stderr, "robots holder:", err)
		return 1
	}
	return 0
}

// directVia fetches robots.txt straight from the (loopback) site: the holder's lock,
// lease and renewals are the RobotsCache's own, whatever the fetch goes through.
type directVia struct {
	timeout time.Duration
	client  *http.Client
}

func (v *directVia) UserAgent() string      { return "idemscrape-test" }
func (v *directVia) Timeout() time.Duration { return v.timeout }
func (v *directVia) Fail(err error) error   { return err }

func (v *directVia) Get(ctx context.Context, target string, _ *atomic.Int64) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
	if err != nil {
		return nil, err
	}
	return v.client.Do(req)
}

// firstHeldRobotsSite holds the first robots.txt request until release is closed (or the
// client goes away) and answers every later one at once; each is counted, the first
// announced on arrived. Every other path is a page.
type firstHeldRobotsSite struct {
	*httptest.Server
	robots  atomic.Int64
	arrived chan struct{}
	release chan struct{}
	once    sync.Once
}

func newFirstHeldRobotsSite(t *testing.T) *firstHeldRobotsSite {
	t.Helper()
	s := &firstHeldRobotsSite{arrived: make(chan struct{}), release: make(chan struct{})}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/robots.txt" {
			_, _ = fmt.Fprint(w, "<p>page</p>")
			return
		}
		if s.robots.Add(1) == 1 {
			close(s.arrived)
			select {
			case <-s.release:
			case <-r.Context().Done():
				return
			}
		}
		_, _ = fmt.Fprint(w, "User-agent: *\nDisallow: /private/\n")
	}))
	t.Cleanup(s.Close)
	t.Cleanup(s.open) // before Close: no handler stays held
	return s
}

func (s *firstHeldRobotsSite) open() { s.once.Do(func() { close(s.release) }) }

// processStopped tells whether the process pid is in the stopped state (Linux /proc).
func processStopped(t *testing.T, pid int) bool {
	t.Helper()
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	require.NoError(t, err)
	// "pid (comm) S ...": the state follows the last ')'.
	i := bytes.LastIndexByte(stat, ')')
	require.True(t, i > 0 && i+2 < len(stat), "unreadable /proc/%d/stat: %q", pid, stat)
	return stat[i+2] == 'T'
}

// TestRobotsLockHolderPaused: a worker stopped (SIGSTOP) while it fetches an origin's
// robots.txt under the fleet-wide lock does not stall the origin's other workers. Another
// worker's request, with a worker's request timeout, waits at most a quarter of it; the
// stopped holder can not renew its lease, which lapses within that wait, and the waiting
// worker takes the lock and fetches robots.txt itself, through its own session: its
// request ends with robots.txt's own answer before its time runs out, instead of timing
// out (and replaying its unit on a new session) while the holder's lock lived the holder's
// whole request timeout and more. Continued, the holder finishes its fetch and deletes no
// lock that is not its own.
func TestRobotsLockHolderPaused(t *testing.T) {
	const requestTimeout = sessions.DefaultRequestTimeout // a worker's
	bg := context.Background()
	e := newEnv(t, testutil.FakeSiteConfig{})
	ns := testutil.Redis(t)
	site := newFirstHeldRobotsSite(t)
	keys, err := lua.NewKeys(ns.Prefix)
	require.NoError(t, err)
	org := strings.ToLower(site.URL)
	lockKey := keys.RobotsLock(org)

	// The holder: a worker process of its own, whose robots.txt fetch the site holds.
	spec, err := json.Marshal(robotsHolderSpec{Redis: ns.Addr, Prefix: ns.Prefix, Site: site.URL, Timeout: requestTimeout})
	require.NoError(t, err)
	holder := exec.Command(os.Args[0], "-test.run=^$")
	holder.Env = append(os.Environ(), robotsHolderEnv+"="+string(spec))
	var holderErr bytes.Buffer
	holder.Stderr = &holderErr
	require.NoError(t, holder.Start())
	exited := make(chan error, 1)
	go func() { exited <- holder.Wait() }()
	var holderDone atomic.Bool
	t.Cleanup(func() { // our own child, by its pid
		if !holderDone.Load() {
			_ = holder.Process.Signal(syscall.SIGCONT) // so that the kill is not left pending
			_ = holder.Process.Kill()
			t.Logf("holder killed at cleanup: %v", <-exited)
		}
	})
	select {
	case <-site.arrived: // the holder took the lock and its fetch runs
	case err := <-exited:
		holderDone.Store(true)
		t.Fatalf("the holder ended before its robots.txt fetch reached the site: %v: %s", err, holderErr.String())
	case <-time.After(time.Minute): // a hang guard, not a timing
		t.Fatal("the holder's robots.txt fetch never reached the site")
	}
	holderOwner, err := ns.Client.Get(bg, lockKey).Result()
	require.NoError(t, err, "the holder holds the lock while its fetch runs")

	require.NoError(t, holder.Process.Signal(syscall.SIGSTOP))
	for !processStopped(t, holder.Process.Pid) {
		select {
		case <-time.After(10 * time.Millisecond): // polling the process's state
		case <-t.Context().Done():
			t.Fatal("test ended")
		}
	}

	// Another worker's request to the origin, with a worker's request timeout as its budget.
	var (
		waits   lockWaits
		fetches atomic.Int64
	)
	cache, err := politeness.NewRobotsCache(politeness.RobotsConfig{Redis: ns.Client, KeyPrefix: ns.Prefix,
		OnFetch: func(string, int, int64) { fetches.Add(1) }, OnLockWait: waits.add})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(bg, requestTimeout)
	defer cancel()
	s, err := e.provider.NewSession("US", 0, time.Now())
	require.NoError(t, err)
	col, err := sessions.NewCollector(ctx, s, &sessions.CollectorConfig{
		Guard: sessions.LoopbackGuard(), RequestTimeout: requestTimeout, Robots: cache})
	require.NoError(t, err)
	t.Cleanup(col.Close)
	_, err = col.Get(site.URL + "/private/x") // bounded by ctx

	require.NoError(t, ctx.Err(), "the request ended before its time ran out: %v", err)
	assert.Equal(t, "robots_disallowed", string(sessions.CategoryOf(err)),
		"the request was answered by robots.txt, which it fetched itself: %v", err)
	assert.Equal(t, map[politeness.RobotsLockWait]int{politeness.RobotsLockWaitTookOver: 1}, waits.counts(),
		"it waited for the stopped holder, then took the lock over")
	assert.EqualValues(t, 1, fetches.Load(), "it fetched robots.txt")
	assert.EqualValues(t, 2, site.robots.Load(), "the stopped holder's fetch and its own")
	assert.Zero(t, ns.Client.Exists(bg, lockKey).Val(), "it gave the lock it took up")
	entry, err := ns.Client.Get(bg, keys.Robots(org)).Result()
	require.NoError(t, err, "its robots.txt is cached for the fleet")

	// The holder continues and its fetch ends: it stores its answer and deletes no lock
	// but its own. Another worker holds the lock by now.
	ok, err := ns.Client.SetNX(bg, lockKey, "other-worker", time.Minute).Result()
	require.NoError(t, err)
	require.True(t, ok)
	require.NotEqual(t, holderOwner, "other-worker")
	require.NoError(t, holder.Process.Signal(syscall.SIGCONT))
	site.open()
	select {
	case err := <-exited:
		holderDone.Store(true)
		require.NoError(t, err, "the holder's check passed: %s", holderErr.String())
	case <-time.After(time.Minute): // a hang guard, not a timing
		t.Fatal("the continued holder did not finish")
	}
	got, err := ns.Client.Get(bg, lockKey).Result()
	require.NoError(t, err, "the other worker's lock is still there")
	assert.Equal(t, "other-worker", got)
	assert.Greater(t, ns.Client.PTTL(bg, lockKey).Val(), requestTimeout/4/2,
		"with its own expiry: the continued holder's renewal did not shorten it to its lease")
	after, err := ns.Client.Get(bg, keys.Robots(org)).Result()
	require.NoError(t, err)
	assert.JSONEq(t, stripExpires(t, entry), stripExpires(t, after), "the same robots.txt")
}

// stripExpires is a robots.txt cache entry without its expiry (the clock of whoever wrote it).
func stripExpires(t *testing.T, raw string) string {
	t.Helper()
	var m map[string]any
	require.NoError(t, json.Unmarshal([]byte(raw), &m))
	delete(m, "expires")
	out, err := json.Marshal(m)
	require.NoError(t, err)
	return string(out)
}
