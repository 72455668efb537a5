package envflag

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// DefaultRedisAddr is the Redis server used when neither -redis nor -redis-cluster is given.
const DefaultRedisAddr = "127.0.0.1:6379"

// Names of the Redis settings: the flags and, after the Set's prefix, the environment
// variables (IDEMSCRAPE_REDIS, IDEMSCRAPE_REDIS_CLUSTER for the binaries).
const (
	RedisFlag        = "redis"
	RedisClusterFlag = "redis-cluster"
	RedisEnv         = "REDIS"
	RedisClusterEnv  = "REDIS_CLUSTER"
)

// RedisConfig says where idemscrape's Redis is: one server (Addr) or a Redis Cluster
// (Cluster, a seed list of nodes; the client discovers the others). Exactly one of the two
// is set in a RedisConfig returned by Redis.Config or RedisFromEnv. Every component takes
// the clients built here (redis.UniversalClient, asynq.RedisConnOpt), so moving to a
// cluster is this configuration change and nothing else.
type RedisConfig struct {
	Addr    string   // host:port of the one server
	Cluster []string // host:port of some cluster nodes
}

// IsCluster reports whether the configuration names a Redis Cluster.
func (c RedisConfig) IsCluster() bool { return len(c.Cluster) > 0 }

// DefaultClusterStateReload bounds how stale a cluster client's map of slots to nodes may
// get. go-redis reloads the map at once on a MOVED or ASK redirect, but a master that died
// sends none: with go-redis's own default (60 s) its slots' commands would fail for up to a
// minute after a replica took over. The clients built here also reload at once after a
// command failed for a dead node or CLUSTERDOWN (see NewClient), so this is a backstop.
const DefaultClusterStateReload = 5 * time.Second

// NewClient returns a client for the configuration: a *redis.ClusterClient for a cluster,
// a *redis.Client for one server. The caller closes it. A cluster client reloads its slot
// map when a command fails because a node is gone or the cluster is down (so a failover
// is followed in a fraction of a second), and at least every DefaultClusterStateReload.
func (c RedisConfig) NewClient() redis.UniversalClient {
	if c.IsCluster() {
		return newClusterClient(c.Cluster)
	}
	return redis.NewClient(&redis.Options{Addr: c.Addr})
}

// AsynqConnOpt returns asynq's connection option for the configuration: for a cluster a
// ClusterConnOpt (asynq hash-tags every key of a queue with {<queue>}, so a queue lives on
// one slot; the option builds the same failover-following cluster client as NewClient), for
// one server asynq.RedisClientOpt.
func (c RedisConfig) AsynqConnOpt() asynq.RedisConnOpt {
	if c.IsCluster() {
		return ClusterConnOpt{Addrs: append([]string(nil), c.Cluster...)}
	}
	return asynq.RedisClientOpt{Addr: c.Addr}
}

// ClusterConnOpt is an asynq.RedisConnOpt for a Redis Cluster. Unlike
// asynq.RedisClusterClientOpt, whose clients keep go-redis's 60 s slot-map refresh, its
// clients follow a failover at once (see RedisConfig.NewClient): asynq's server, client and
// inspector, and asynqmon, build theirs from it.
type ClusterConnOpt struct {
	Addrs []string // host:port of some cluster nodes
}

// MakeRedisClient implements asynq.RedisConnOpt: it returns a *redis.ClusterClient.
func (o ClusterConnOpt) MakeRedisClient() any { return newClusterClient(o.Addrs) }

var _ asynq.RedisConnOpt = ClusterConnOpt{}

// newClusterClient is the one constructor of idemscrape's cluster clients.
func newClusterClient(addrs []string) *redis.ClusterClient {
	cc := redis.NewClusterClient(&redis.ClusterOptions{
		Addrs:                      append([]string(nil), addrs...),
		ClusterStateReloadInterval: DefaultClusterStateReload,
	})
	cc.AddHook(reloadOnNodeFailure{cc})
	return cc
}

// reloadOnNodeFailure asks the cluster client to reload its slot map (asynchronously, at
// most one reload at a time) after a command or pipeline failed because a node did not
// answer or the cluster was down: after a failover the slot's new master is found on the
// next command instead of at the next periodic reload.
type reloadOnNodeFailure struct{ cc *redis.ClusterClient }

func (h reloadOnNodeFailure) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h reloadOnNodeFailure) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if nodeFailure(err) {
			h.cc.ReloadState(ctx)
		}
		return err
	}
}

func (h reloadOnNodeFailure) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		failed := nodeFailure(err)
		for _, c := range cmds {
			failed = failed || nodeFailure(c.Err())
		}
		if failed {
			h.cc.ReloadState(ctx)
		}
		return err
	}
}

// nodeFailure reports whether err says a node is gone (a network error, a closed
// connection) or the cluster cannot serve (CLUSTERDOWN), rather than a reply or a
// cancellation of the caller's.
func nodeFailure(err error) bool {
	if err == nil || errors.Is(err, redis.Nil) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var ne net.Error
	return errors.As(err, &ne) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) ||
		redis.HasErrorPrefix(err, "CLUSTERDOWN")
}

// String describes the configuration for logs: "redis 127.0.0.1:6379" or "redis cluster
// a:1,b:2". It holds no secret (the configuration has none).
func (c RedisConfig) String() string {
	if c.IsCluster() {
		return "redis cluster " + strings.Join(c.Cluster, ",")
	}
	return "redis " + c.Addr
}

// Redis holds the -redis and -redis-cluster flags of a Set (and their environment
// variables <Prefix>REDIS and <Prefix>REDIS_CLUSTER). Define them with Define, read them
// with Config after Parse.
type Redis struct {
	Addr    string // -redis: one server, host:port
	Cluster string // -redis-cluster: cluster seed nodes, host:port,host:port,...
	prefix  string
}

// Define defines -redis and -redis-cluster on s. They are mutually exclusive; with neither,
// Config returns DefaultRedisAddr.
func (r *Redis) Define(s *Set) {
	r.prefix = s.Prefix
	s.String(&r.Addr, RedisFlag, RedisEnv, "", "Redis server address host:port (default "+DefaultRedisAddr+"; not with -"+RedisClusterFlag+")")
	s.String(&r.Cluster, RedisClusterFlag, RedisClusterEnv, "", "Redis Cluster seed nodes host:port,host:port,... (not with -"+RedisFlag+")")
}

// Config validates the two settings and returns the configuration. Both given, an address
// that is not host:port, or an empty entry in the cluster list is an error naming the flag
// and its environment variable.
func (r Redis) Config() (RedisConfig, error) {
	return parseRedis(r.Addr, r.Cluster,
		fmt.Sprintf("-%s ($%s%s)", RedisFlag, r.prefix, RedisEnv),
		fmt.Sprintf("-%s ($%s%s)", RedisClusterFlag, r.prefix, RedisClusterEnv))
}

// RedisFromEnv reads the Redis configuration from the environment alone:
// <prefix>REDIS (one server) or <prefix>REDIS_CLUSTER (cluster seed nodes), mutually
// exclusive, DefaultRedisAddr when neither is set. It is for commands without flags for
// them (the CLI); errors name the variable.
func RedisFromEnv(prefix string) (RedisConfig, error) {
	return parseRedis(os.Getenv(prefix+RedisEnv), os.Getenv(prefix+RedisClusterEnv),
		"$"+prefix+RedisEnv, "$"+prefix+RedisClusterEnv)
}

// parseRedis is the one place that turns the two settings into a RedisConfig; addrName
// and clusterName are how errors name them.
func parseRedis(addr, cluster, addrName, clusterName string) (RedisConfig, error) {
	addr, cluster = strings.TrimSpace(addr), strings.TrimSpace(cluster)
	switch {
	case addr != "" && cluster != "":
		return RedisConfig{}, fmt.Errorf("%s and %s are both set: give one server or one cluster, not both", addrName, clusterName)
	case cluster != "":
		var seeds []string
		seen := map[string]bool{}
		for i, part := range strings.Split(cluster, ",") {
			part = strings.TrimSpace(part)
			if err := checkHostPort(part); err != nil {
				return RedisConfig{}, fmt.Errorf("%s: entry %d %q: %w", clusterName, i+1, part, err)
			}
			if seen[part] {
				return RedisConfig{}, fmt.Errorf("%s: entry %d %q is listed twice", clusterName, i+1, part)
			}
			seen[part] = true
			seeds = append(seeds, part)
		}
		return RedisConfig{Cluster: seeds}, nil
	case addr != "":
		if strings.Contains(addr, ",") {
			return RedisConfig{}, fmt.Errorf("%s %q: one address only (a cluster's nodes go in %s)", addrName, addr, clusterName)
		}
		if err := checkHostPort(addr); err != nil {
			return RedisConfig{}, fmt.Errorf("%s %q: %w", addrName, addr, err)
		}
		return RedisConfig{Addr: addr}, nil
	}
	return RedisConfig{Addr: DefaultRedisAddr}, nil
}

// checkHostPort accepts host:port with a non-empty host and a port in 1..65535.
func checkHostPort(s string) error {
	if s == "" {
		return errors.New("empty address (want host:port)")
	}
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		return errors.New("not host:port")
	}
	if host == "" {
		return errors.New("empty host (want host:port)")
	}
	if strings.ContainsAny(host, "/ ") {
		return errors.New("host holds '/' or a space (want host:port, not a URL)")
	}
	n, err := strconv.Atoi(port)
	if err != nil || n < 1 || n > 65535 {
		return fmt.Errorf("port %q is not a number in 1..65535", port)
	}
	return nil
}
