package lua_test

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/lua"
	"github.com/idemscrape/idemscrape/testutil"
)

// scriptCalls records the KEYS of every script call (EVAL or EVALSHA, single or pipelined)
// a client sends, by script file, so a test sees exactly what the wrappers send.
type scriptCalls struct {
	bySHA map[string]string // sha1 of the source -> file name

	mu   sync.Mutex
	keys map[string][][]string // file -> KEYS of each call
}

func newScriptCalls(t *testing.T) *scriptCalls {
	t.Helper()
	files, err := filepath.Glob("*.lua")
	require.NoError(t, err)
	require.NotEmpty(t, files)
	sc := &scriptCalls{bySHA: map[string]string{}, keys: map[string][][]string{}}
	for _, f := range files {
		b, err := os.ReadFile(f)
		require.NoError(t, err)
		sum := sha1.Sum(b)
		sc.bySHA[hex.EncodeToString(sum[:])] = f
		// A script that uses the stream id functions is sent with them in front.
		sum = sha1.Sum([]byte(lua.StreamIDFuncs + string(b)))
		sc.bySHA[hex.EncodeToString(sum[:])] = f
	}
	return sc
}

func (sc *scriptCalls) record(cmd redis.Cmder) {
	args := cmd.Args()
	if len(args) < 3 {
		return
	}
	name := strings.ToLower(fmt.Sprint(args[0]))
	var file string
	switch name {
	case "evalsha":
		file = sc.bySHA[fmt.Sprint(args[1])]
	case "eval":
		sum := sha1.Sum([]byte(fmt.Sprint(args[1])))
		file = sc.bySHA[hex.EncodeToString(sum[:])]
	default:
		return
	}
	if file == "" {
		file = "unknown script"
	}
	n, _ := strconv.Atoi(fmt.Sprint(args[2]))
	keys := make([]string, 0, n)
	for _, k := range args[3 : 3+n] {
		keys = append(keys, fmt.Sprint(k))
	}
	sc.mu.Lock()
	sc.keys[file] = append(sc.keys[file], keys)
	sc.mu.Unlock()
}

func (sc *scriptCalls) DialHook(next redis.DialHook) redis.DialHook { return next }

func (sc *scriptCalls) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		sc.record(cmd)
		return next(ctx, cmd)
	}
}

func (sc *scriptCalls) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, c := range cmds {
			sc.record(c)
		}
		return next(ctx, cmds)
	}
}

// randomJobKey returns a job key of one of the forms tasks derives (natural, hashed) or a
// hostile one (braces, which the key builder must turn into a hash tag of its own).
func randomJobKey(r *rand.Rand, i int) string {
	switch i % 4 {
	case 0:
		return fmt.Sprintf("catalog:sku-%d:%s:2026-%02d-%02d:v%d", r.IntN(1e9), []string{"US", "DE", "JP", "BR"}[r.IntN(4)], 1+r.IntN(12), 1+r.IntN(28), 1+r.IntN(9))
	case 1:
		return fmt.Sprintf("catalog:%016x%016x", r.Uint64(), r.Uint64())
	case 2:
		return fmt.Sprintf("weird:{%d}:{x%d}", r.IntN(1000), i)
	default:
		b := make([]byte, 1+r.IntN(40))
		for j := range b {
			b[j] = byte(' ' + r.IntN(95)) // printable ASCII, braces included
		}
		return fmt.Sprintf("k%d:%s", i, b)
	}
}

// TestScriptsSingleSlot runs every Lua script of this package, through its Go wrapper, on a
// real 3-master Redis Cluster with keys for 1,000 random job keys (and random hosts and
// stream names): no call fails with CROSSSLOT, and the KEYS of every call map to one slot
// as the cluster itself computes it (CLUSTER KEYSLOT). A script file that the test does
// not run fails it, so a new script cannot skip the check.
func TestScriptsSingleSlot(t *testing.T) {
	const jobs = 1000
	ctx := context.Background()
	cluster := testutil.StartRedisCluster(t, 3, 0)
	rdb := cluster.Client()
	calls := newScriptCalls(t)
	rdb.AddHook(calls)

	r := rand.New(rand.NewPCG(14, uint64(time.Now().UnixNano())))
	prefix := "idemscrape:"
	leases, err := lua.NewLeases(rdb, prefix)
	require.NoError(t, err)
	keys := make([]string, jobs)
	for i := range keys {
		keys[i] = randomJobKey(r, i)
	}

	// The lease scripts, one call at a time (claim, renew, release) ...
	for i, k := range keys[:jobs/2] {
		l, err := leases.Claim(ctx, k, "w1", time.Minute, int64(i))
		require.NoError(t, err, "claim %q", k)
		require.NoError(t, leases.Renew(ctx, l, time.Minute), "renew %q", k)
		if i%2 == 0 {
			require.NoError(t, leases.Release(ctx, l), "release %q", k)
		} else {
			require.NoError(t, leases.ReleaseDone(ctx, l), "release done %q", k)
		}
	}
	// ... and pipelined (ClaimMany, ReleaseMany): a cluster pipeline splits by slot.
	reqs := make([]lua.ClaimRequest, 0, jobs/2)
	for _, k := range keys[jobs/2:] {
		reqs = append(reqs, lua.ClaimRequest{Key: k, Owner: "w2", TTL: time.Minute})
	}
	got, errs := leases.ClaimMany(ctx, reqs)
	require.NoError(t, errors.Join(errs...))
	require.NoError(t, errors.Join(leases.ReleaseMany(ctx, got)...))

	// The politeness scripts, one host per job key.
	hl, err := lua.NewHostLimits(rdb, prefix)
	require.NoError(t, err)
	for i := range jobs {
		host := fmt.Sprintf("shop-%d.example:%d", r.IntN(1e6), 1+r.IntN(65535))
		if i%10 == 0 {
			host = fmt.Sprintf("{odd}host-%d", i)
		}
		_, _, err := hl.Reserve(ctx, host, lua.Limit{Rate: 1000, Burst: 5}, time.Second)
		require.NoError(t, err, "reserve %q", host)
		if i%4 == 0 {
			_, err := hl.Pause(ctx, host, 10*time.Millisecond)
			require.NoError(t, err, "pause %q", host)
		}
	}

	// The unlock script, on robots.txt locks of random origins (one taken and released,
	// one left to another owner).
	for i := range 100 {
		origin := fmt.Sprintf("https://shop-%d.example:%d", r.IntN(1e6), 1+r.IntN(65535))
		if i%10 == 0 {
			origin = fmt.Sprintf("http://{odd}host-%d", i)
		}
		lock := leases.Keys().RobotsLock(origin)
		require.NoError(t, rdb.Set(ctx, lock, "owner-a", time.Minute).Err())
		require.ErrorIs(t, lua.Unlock(ctx, rdb, lock, "owner-b"), lua.ErrLockNotOwner, "unlock %q", lock)
		require.NoError(t, lua.Unlock(ctx, rdb, lock, "owner-a"), "unlock %q", lock)
	}

	// The trim script, on streams named as the outbox names them (one per topic, with a
	// consumer group that consumed part of it).
	for i := range 50 {
		stream := fmt.Sprintf("%sstream:{topic-%d}", prefix, r.IntN(1e6))
		if i%2 == 1 {
			stream = fmt.Sprintf("%sstream:topic-%d", prefix, i)
		}
		for j := range 3 {
			require.NoError(t, rdb.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []any{"j", j}}).Err())
		}
		require.NoError(t, rdb.XGroupCreate(ctx, stream, "g", "0").Err())
		res, err := rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "c", Streams: []string{stream, ">"}, Count: 2, Block: -1}).Result()
		require.NoError(t, err)
		require.NoError(t, rdb.XAck(ctx, stream, "g", res[0].Messages[0].ID).Err())
		n, _, err := lua.TrimStream(ctx, rdb, stream)
		require.NoError(t, err, "trim %q", stream)
		require.Equal(t, int64(1), n, "trim %q removes the one acknowledged entry", stream)
	}

	// The window budget script: restore, reserve, settle, on windows of random kinds.
	wb, err := lua.NewWindowBudgets(rdb, prefix)
	require.NoError(t, err)
	for i := range 50 {
		kind, window := fmt.Sprintf("kind-%d", r.IntN(1e6)), "2026-04-23"
		if i%10 == 0 {
			window = fmt.Sprintf("{odd}-%d", i)
		}
		_, _, err := wb.Restore(ctx, kind, window, 0)
		require.NoError(t, err, "restore %s/%s", kind, window)
		g, err := wb.Reserve(ctx, kind, window, "w1", 100, 10, time.Minute)
		require.NoError(t, err, "reserve %s/%s", kind, window)
		require.Equal(t, lua.Granted, g.Admission)
		_, err = wb.Settle(ctx, kind, window, "w1", 7)
		require.NoError(t, err, "settle %s/%s", kind, window)
	}

	// Every script file ran, and every call's KEYS share one slot by the cluster's own
	// reckoning. One node answers CLUSTER KEYSLOT for any key.
	node := redis.NewClient(&redis.Options{Addr: cluster.Addrs()[0]})
	defer node.Close()
	calls.mu.Lock()
	defer calls.mu.Unlock()
	require.NotContains(t, calls.keys, "unknown script", "a script call that is not one of lua/*.lua")
	var checked int
	for _, file := range sortedFiles(calls.bySHA) {
		sent := calls.keys[file]
		require.NotEmpty(t, sent, "%s was never run on the cluster: add it to this test", file)
		pipe := node.Pipeline()
		slots := make([][]*redis.IntCmd, len(sent))
		for i, ks := range sent {
			require.NotEmpty(t, ks, "%s: a call without KEYS", file)
			for _, k := range ks {
				slots[i] = append(slots[i], pipe.ClusterKeySlot(ctx, k))
			}
		}
		_, err := pipe.Exec(ctx)
		require.NoError(t, err)
		for i, ks := range sent {
			first := slots[i][0].Val()
			for j, c := range slots[i] {
				if !assert.Equal(t, first, c.Val(), "%s: KEYS %q span slots", file, ks) {
					break
				}
				// The cluster and the spec agree (the key builder's tags are what we think).
				assert.Equal(t, int64(slot(ks[j])), c.Val(), "slot of %q", ks[j])
			}
			checked++
		}
		t.Logf("%s: %d calls, KEYS of each in one slot", file, len(sent))
	}
	assert.GreaterOrEqual(t, checked, 3*jobs)
	// The job keys spread over the cluster: the tag is the job, not the prefix.
	spread := map[string]bool{}
	for _, k := range keys[:30] {
		m, err := rdb.MasterForKey(ctx, leases.Keys().Lease(k))
		require.NoError(t, err)
		spread[m.Options().Addr] = true
	}
	assert.Len(t, spread, 3, "30 jobs' leases land on every master")
}

func sortedFiles(bySHA map[string]string) []string {
	out := make([]string, 0, len(bySHA))
	for _, f := range bySHA {
		out = append(out, f)
	}
	sort.Strings(out)
	return out
}
