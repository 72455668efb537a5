package testutil

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// RedisCluster is a throwaway Redis Cluster this test started on free loopback ports:
// Masters masters, each with Replicas replicas, no persistence. It is for tests of the
// scale-out promise (every script's keys in one slot, failover) and is torn down when the
// test ends. Nodes are this test's own processes, ended by pid.
type RedisCluster struct {
	Masters, Replicas int
	nodes             []*clusterNode
	t                 testing.TB
}

type clusterNode struct {
	port int
	dir  string
	cmd  *exec.Cmd
}

func (n *clusterNode) addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(n.port)) }

// clusterNodeTimeout is the nodes' failure-detection time: short, so failover tests run
// in seconds.
const clusterNodeTimeout = 1000 * time.Millisecond

// clusterStateReload is how often Client's clients reload the cluster's slot map.
const clusterStateReload = 500 * time.Millisecond

// StartRedisCluster starts masters × (1 + replicas) redis-server nodes with
// --cluster-enabled, joins them with `redis-cli --cluster create`, and waits until every
// node reports cluster_state:ok and all 16384 slots are served.
func StartRedisCluster(t testing.TB, masters, replicas int) *RedisCluster {
	t.Helper()
	for _, bin := range []string{"redis-server", "redis-cli"} {
		if _, err := exec.LookPath(bin); err != nil {
			serviceDown(t, bin+" binary", err)
		}
	}
	if masters < 3 || replicas < 0 {
		t.Fatalf("testutil: StartRedisCluster: Redis Cluster needs at least 3 masters and replicas >= 0 (got %d, %d)", masters, replicas)
	}
	c := &RedisCluster{Masters: masters, Replicas: replicas, t: t}
	t.Cleanup(c.stopAll)
	root := t.TempDir()
	for i := 0; i < masters*(1+replicas); i++ {
		n := &clusterNode{port: freeClusterPort(t), dir: filepath.Join(root, fmt.Sprintf("node%d", i))}
		if err := os.MkdirAll(n.dir, 0o755); err != nil {
			t.Fatalf("testutil: cluster node dir: %v", err)
		}
		c.nodes = append(c.nodes, n)
		c.startNode(n)
	}
	args := []string{"--cluster", "create"}
	for _, n := range c.nodes {
		args = append(args, n.addr())
	}
	args = append(args, "--cluster-replicas", strconv.Itoa(replicas), "--cluster-yes")
	out, err := exec.Command("redis-cli", args...).CombinedOutput()
	if err != nil {
		t.Fatalf("testutil: redis-cli --cluster create: %v\n%s", err, out)
	}
	c.WaitHealthy()
	return c
}

// freeClusterPort returns a free port p whose cluster bus port p+10000 is free as well.
func freeClusterPort(t testing.TB) int {
	t.Helper()
	for range 100 {
		p := freePort(t)
		if p+10000 > 65535 {
			continue
		}
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p+10000)))
		if err != nil {
			continue
		}
		_ = l.Close()
		return p
	}
	t.Fatalf("testutil: no free port pair for a cluster node")
	return 0
}

func (c *RedisCluster) startNode(n *clusterNode) {
	c.t.Helper()
	n.cmd = exec.Command("redis-server",
		"--bind", "127.0.0.1", "--port", strconv.Itoa(n.port),
		"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
		"--cluster-node-timeout", strconv.Itoa(int(clusterNodeTimeout/time.Millisecond)),
		"--save", "", "--appendonly", "no", "--dir", n.dir,
		"--logfile", filepath.Join(n.dir, "redis.log"))
	if err := n.cmd.Start(); err != nil {
		c.t.Fatalf("testutil: start cluster node %s: %v", n.addr(), err)
	}
	cl := redis.NewClient(&redis.Options{Addr: n.addr()})
	defer cl.Close()
	deadline := time.Now().Add(10 * time.Second)
	for cl.Ping(context.Background()).Err() != nil {
		if time.Now().After(deadline) {
			c.t.Fatalf("testutil: cluster node %s did not answer within 10s", n.addr())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Addrs returns every node's host:port (the seed list for a cluster client).
func (c *RedisCluster) Addrs() []string {
	addrs := make([]string, len(c.nodes))
	for i, n := range c.nodes {
		addrs[i] = n.addr()
	}
	return addrs
}

// AsynqOpt returns asynq's connection option for the cluster.
func (c *RedisCluster) AsynqOpt() asynq.RedisClusterClientOpt {
	return asynq.RedisClusterClientOpt{Addrs: c.Addrs()}
}

// Client returns a cluster client for the cluster, closed when the test ends. It reloads
// its map of slots every clusterStateReload (go-redis's default is a minute, and a dead
// master sends no MOVED), so it finds a promoted replica soon after WaitHealthy.
func (c *RedisCluster) Client() *redis.ClusterClient {
	cl := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), ClusterStateReloadInterval: clusterStateReload})
	c.t.Cleanup(func() { _ = cl.Close() })
	return cl
}

// MasterFor returns the index of the node that serves key's slot now.
func (c *RedisCluster) MasterFor(ctx context.Context, key string) int {
	c.t.Helper()
	cl := c.Client()
	m, err := cl.MasterForKey(ctx, key)
	if err != nil {
		c.t.Fatalf("testutil: master for %q: %v", key, err)
	}
	addr := m.Options().Addr
	for i, n := range c.nodes {
		if n.addr() == addr {
			return i
		}
	}
	c.t.Fatalf("testutil: master %s of %q is not a node of this cluster", addr, key)
	return -1
}

// Kill ends node i (SIGKILL, by pid); with replicas, one of its replicas is promoted after
// the node timeout.
func (c *RedisCluster) Kill(i int) {
	n := c.nodes[i]
	if n.cmd == nil || n.cmd.Process == nil {
		return
	}
	_ = n.cmd.Process.Kill()
	_ = n.cmd.Wait()
	n.cmd = nil
}

// Restart starts node i again on its port with its cluster config (nodes.conf) but no
// data: it rejoins the cluster having lost every key it held.
func (c *RedisCluster) Restart(i int) {
	c.t.Helper()
	c.Kill(i)
	c.startNode(c.nodes[i])
}

// WaitHealthy waits until every running node reports cluster_state:ok, serves all 16384
// slots, and every node's view assigns each slot to a master that is running (so a killed
// master's slots have moved to a promoted replica). Bounded: fails the test after 30 s.
func (c *RedisCluster) WaitHealthy() {
	c.t.Helper()
	ctx := context.Background()
	deadline := time.Now().Add(30 * time.Second)
	var last string
	for {
		ok := true
		running := map[string]bool{}
		for _, n := range c.nodes {
			if n.cmd != nil {
				running[n.addr()] = true
			}
		}
		for _, n := range c.nodes {
			if n.cmd == nil {
				continue
			}
			cl := redis.NewClient(&redis.Options{Addr: n.addr()})
			info, err := cl.ClusterInfo(ctx).Result()
			var slots []redis.ClusterSlot
			if err == nil {
				slots, err = cl.ClusterSlots(ctx).Result() //nolint:staticcheck // the slot ranges per node are all this needs; Redis 7 still answers it
			}
			var repl string
			if err == nil {
				repl, err = cl.Info(ctx, "replication").Result()
			}
			_ = cl.Close()
			// A replica that has not synced with its master can not take over from it.
			if err == nil && strings.Contains(repl, "role:slave") && !strings.Contains(repl, "master_link_status:up") {
				ok, last = false, fmt.Sprintf("replica %s: not in sync with its master", n.addr())
				break
			}
			if err != nil || !strings.Contains(info, "cluster_state:ok") || !strings.Contains(info, "cluster_slots_ok:16384") {
				ok, last = false, fmt.Sprintf("node %s: %v %s", n.addr(), err, firstLines(info, 3))
				break
			}
			covered := 0
			for _, sl := range slots {
				if len(sl.Nodes) == 0 || !running[sl.Nodes[0].Addr] {
					ok, last = false, fmt.Sprintf("node %s: slots %d-%d served by a node that is down", n.addr(), sl.Start, sl.End)
					break
				}
				covered += sl.End - sl.Start + 1
			}
			if ok && covered != 16384 {
				ok, last = false, fmt.Sprintf("node %s: %d slots assigned", n.addr(), covered)
			}
			if !ok {
				break
			}
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("testutil: Redis Cluster not healthy within 30s: %s", last)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func firstLines(s string, n int) string {
	lines := strings.SplitN(s, "\n", n+1)
	if len(lines) > n {
		lines = lines[:n]
	}
	return strings.Join(lines, " ")
}

func (c *RedisCluster) stopAll() {
	for i := range c.nodes {
		c.Kill(i)
	}
}

// String implements fmt.Stringer.
func (c *RedisCluster) String() string {
	return fmt.Sprintf("redis cluster %d masters × %d replicas %v", c.Masters, c.Replicas, c.Addrs())
}
