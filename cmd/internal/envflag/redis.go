package envflag

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/url"
	"os"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/idemscrape/idemscrape/cmd/internal/quote"
	"github.com/idemscrape/idemscrape/internal/secretenv"
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
	// RedisPasswordEnv is the password (of the URL's user, or of the default user), from
	// the environment only ($<prefix>REDIS_PASSWORD or a file named by
	// $<prefix>REDIS_PASSWORD_FILE): a flag would show it in the process list.
	RedisPasswordEnv = "REDIS_PASSWORD"
	// TLS settings, for a rediss:// URL: flags -redis-tls-ca, -redis-tls-cert,
	// -redis-tls-key, -redis-tls-server-name and their variables.
	RedisTLSCAFlag         = "redis-tls-ca"
	RedisTLSCertFlag       = "redis-tls-cert"
	RedisTLSKeyFlag        = "redis-tls-key"
	RedisTLSServerNameFlag = "redis-tls-server-name"
	RedisTLSCAEnv          = "REDIS_TLS_CA"
	RedisTLSCertEnv        = "REDIS_TLS_CERT"
	RedisTLSKeyEnv         = "REDIS_TLS_KEY"
	RedisTLSServerNameEnv  = "REDIS_TLS_SERVER_NAME"
)

// RedisConfig says where idemscrape's Redis is: one server (Addr) or a Redis Cluster
// (Cluster, a seed list of nodes; the client discovers the others). Exactly one of the two
// is set in a RedisConfig returned by Redis.Config or RedisFromEnv. Every component takes
// the clients built here (redis.UniversalClient, asynq.RedisConnOpt), so moving to a
// cluster is this configuration change and nothing else.
type RedisConfig struct {
	Addr    string   // host:port of the one server
	Cluster []string // host:port of some cluster nodes

	Username string      // ACL user ("" the default user)
	Password string      // never printed: String leaves it out
	DB       int         // database number (one server only; a cluster has only 0)
	TLS      *tls.Config // nil: plain TCP
}

// GoString is String: %#v of a configuration shows no password either.
func (c RedisConfig) GoString() string { return "envflag.RedisConfig{" + c.String() + "}" }

// LogValue makes slog print String (the JSON handler would otherwise marshal the struct,
// password included).
func (c RedisConfig) LogValue() slog.Value { return slog.StringValue(c.String()) }

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
		return c.clusterConnOpt().MakeRedisClient().(*redis.ClusterClient)
	}
	return redis.NewClient(&redis.Options{Addr: c.Addr, Username: c.Username, Password: c.Password, DB: c.DB, TLSConfig: c.tlsClone()})
}

func (c RedisConfig) tlsClone() *tls.Config {
	if c.TLS == nil {
		return nil
	}
	return c.TLS.Clone()
}

func (c RedisConfig) clusterConnOpt() ClusterConnOpt {
	return ClusterConnOpt{Addrs: append([]string(nil), c.Cluster...), Username: c.Username, Password: c.Password, TLSConfig: c.tlsClone()}
}

// AsynqConnOpt returns asynq's connection option for the configuration: for a cluster a
// ClusterConnOpt (asynq hash-tags every key of a queue with {<queue>}, so a queue lives on
// one slot; the option builds the same failover-following cluster client as NewClient), for
// one server asynq.RedisClientOpt.
func (c RedisConfig) AsynqConnOpt() asynq.RedisConnOpt {
	if c.IsCluster() {
		return c.clusterConnOpt()
	}
	return asynq.RedisClientOpt{Addr: c.Addr, Username: c.Username, Password: c.Password, DB: c.DB, TLSConfig: c.tlsClone()}
}

// ClusterConnOpt is an asynq.RedisConnOpt for a Redis Cluster. Unlike
// asynq.RedisClusterClientOpt, whose clients keep go-redis's 60 s slot-map refresh, its
// clients follow a failover at once (see RedisConfig.NewClient): asynq's server, client and
// inspector, and asynqmon, build theirs from it.
type ClusterConnOpt struct {
	Addrs     []string // host:port of some cluster nodes
	Username  string
	Password  string
	TLSConfig *tls.Config
}

// MakeRedisClient implements asynq.RedisConnOpt: it returns a *redis.ClusterClient.
func (o ClusterConnOpt) MakeRedisClient() any {
	var tc *tls.Config
	if o.TLSConfig != nil {
		tc = o.TLSConfig.Clone()
	}
	return newClusterClient(&redis.ClusterOptions{Addrs: append([]string(nil), o.Addrs...), Username: o.Username, Password: o.Password, TLSConfig: tc})
}

var _ asynq.RedisConnOpt = ClusterConnOpt{}

// newClusterClient is the one constructor of idemscrape's cluster clients.
func newClusterClient(o *redis.ClusterOptions) *redis.ClusterClient {
	o.ClusterStateReloadInterval = DefaultClusterStateReload
	cc := redis.NewClusterClient(o)
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

// String describes the configuration for logs: "redis 127.0.0.1:6379", "redis cluster
// a:1,b:2", with "rediss", the user and the database when set ("rediss app@host:6380/2").
// It never holds the password, nor a file's contents.
func (c RedisConfig) String() string {
	name := "redis"
	if c.TLS != nil {
		name = "rediss"
	}
	user := ""
	if c.Username != "" {
		user = c.Username + "@"
	}
	if c.IsCluster() {
		return name + " cluster " + user + strings.Join(c.Cluster, ",")
	}
	db := ""
	if c.DB != 0 {
		db = "/" + strconv.Itoa(c.DB)
	}
	return name + " " + user + c.Addr + db
}

// Redis holds the -redis and -redis-cluster flags of a Set (and their environment
// variables <Prefix>REDIS and <Prefix>REDIS_CLUSTER). Define them with Define, read them
// with Config after Parse.
type Redis struct {
	Addr    string // -redis: one server, host:port or a redis:// or rediss:// URL
	Cluster string // -redis-cluster: cluster seed nodes, host:port,host:port,... or a URL
	// TLS files and the server name to verify (with a rediss:// URL).
	TLSCA, TLSCert, TLSKey, TLSServerName string
	prefix                                string
}

// Define defines -redis and -redis-cluster on s. They are mutually exclusive; with neither,
// Config returns DefaultRedisAddr.
func (r *Redis) Define(s *Set) {
	r.prefix = s.Prefix
	s.String(&r.Addr, RedisFlag, RedisEnv, "", "Redis server: host:port, redis://[user@]host:port[/db] or rediss://… for TLS (default "+DefaultRedisAddr+"; not with -"+RedisClusterFlag+"; the password in $"+s.Prefix+RedisPasswordEnv+"[_FILE])")
	s.String(&r.Cluster, RedisClusterFlag, RedisClusterEnv, "", "Redis Cluster seed nodes: host:port,host:port,... or redis[s]://[user@]host:port?addr=host:port&addr=... (not with -"+RedisFlag+")")
	s.String(&r.TLSCA, RedisTLSCAFlag, RedisTLSCAEnv, "", "with rediss://: PEM file of the CA that signed Redis's certificate (default: the system's)")
	s.String(&r.TLSCert, RedisTLSCertFlag, RedisTLSCertEnv, "", "with rediss://: PEM client certificate file (with -"+RedisTLSKeyFlag+")")
	s.String(&r.TLSKey, RedisTLSKeyFlag, RedisTLSKeyEnv, "", "with rediss://: PEM client key file (with -"+RedisTLSCertFlag+")")
	s.String(&r.TLSServerName, RedisTLSServerNameFlag, RedisTLSServerNameEnv, "", "with rediss://: the name Redis's certificate must carry (default: the URL's host)")
}

// Config validates the settings and returns the configuration. Both servers given, an
// address that is neither host:port nor a Redis URL, an empty entry in the cluster list,
// TLS files without rediss:// or that do not load are errors naming the flag and its
// environment variable (never a password).
func (r Redis) Config() (RedisConfig, error) {
	name := func(flag, env string) string { return fmt.Sprintf("-%s ($%s%s)", flag, r.prefix, env) }
	return parseRedis(redisSettings{
		addr: r.Addr, cluster: r.Cluster, ca: r.TLSCA, cert: r.TLSCert, key: r.TLSKey, serverName: r.TLSServerName,
		addrName: name(RedisFlag, RedisEnv), clusterName: name(RedisClusterFlag, RedisClusterEnv),
		caName: name(RedisTLSCAFlag, RedisTLSCAEnv), certName: name(RedisTLSCertFlag, RedisTLSCertEnv),
		keyName: name(RedisTLSKeyFlag, RedisTLSKeyEnv), serverNameName: name(RedisTLSServerNameFlag, RedisTLSServerNameEnv),
		passwordEnv: r.prefix + RedisPasswordEnv,
	})
}

// RedisFromEnv reads the Redis configuration from the environment alone:
// <prefix>REDIS (one server) or <prefix>REDIS_CLUSTER (cluster seed nodes), mutually
// exclusive, DefaultRedisAddr when neither is set; the password and TLS settings as for
// the flags. It is for commands without flags for them (the CLI); errors name the
// variable.
func RedisFromEnv(prefix string) (RedisConfig, error) {
	name := func(env string) string { return "$" + prefix + env }
	return parseRedis(redisSettings{
		addr: os.Getenv(prefix + RedisEnv), cluster: os.Getenv(prefix + RedisClusterEnv),
		ca: os.Getenv(prefix + RedisTLSCAEnv), cert: os.Getenv(prefix + RedisTLSCertEnv),
		key: os.Getenv(prefix + RedisTLSKeyEnv), serverName: os.Getenv(prefix + RedisTLSServerNameEnv),
		addrName: name(RedisEnv), clusterName: name(RedisClusterEnv), caName: name(RedisTLSCAEnv),
		certName: name(RedisTLSCertEnv), keyName: name(RedisTLSKeyEnv), serverNameName: name(RedisTLSServerNameEnv),
		passwordEnv: prefix + RedisPasswordEnv,
	})
}

// redisSettings are the raw settings and how errors name each.
type redisSettings struct {
	addr, cluster, ca, cert, key, serverName                         string
	addrName, clusterName, caName, certName, keyName, serverNameName string
	passwordEnv                                                      string // variable of the password ([_FILE])
}

// parseRedis is the one place that turns the settings into a RedisConfig.
func parseRedis(s redisSettings) (RedisConfig, error) {
	c, err := parseRedisAddr(s)
	if err != nil {
		return RedisConfig{}, err
	}
	pass, set, err := secretenv.Lookup(s.passwordEnv)
	if err != nil {
		return RedisConfig{}, err
	}
	if set {
		if c.Password != "" {
			return RedisConfig{}, fmt.Errorf("a password is in the Redis URL and in $%s[%s]: give it one way (the variable keeps it out of the process list)", s.passwordEnv, secretenv.FileSuffix)
		}
		c.Password = pass
	}
	if err := s.applyTLS(&c); err != nil {
		return RedisConfig{}, err
	}
	return c, nil
}

// applyTLS loads the TLS settings into c, which has TLS iff its URL was rediss://.
func (s redisSettings) applyTLS(c *RedisConfig) error {
	ca, cert, key, sn := strings.TrimSpace(s.ca), strings.TrimSpace(s.cert), strings.TrimSpace(s.key), strings.TrimSpace(s.serverName)
	if c.TLS == nil {
		for _, x := range []struct{ v, name string }{{ca, s.caName}, {cert, s.certName}, {key, s.keyName}, {sn, s.serverNameName}} {
			if x.v != "" {
				return fmt.Errorf("%s is a TLS setting: give Redis as a rediss:// URL in %s or %s", x.name, s.addrName, s.clusterName)
			}
		}
		return nil
	}
	if c.TLS.MinVersion == 0 {
		c.TLS.MinVersion = tls.VersionTLS12
	}
	if ca != "" {
		pem, err := os.ReadFile(ca)
		if err != nil {
			return fmt.Errorf("%s: %w", s.caName, err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return fmt.Errorf("%s: %s holds no PEM certificate", s.caName, ca)
		}
		c.TLS.RootCAs = pool
	}
	switch {
	case cert != "" && key != "":
		pair, err := tls.LoadX509KeyPair(cert, key)
		if err != nil {
			return fmt.Errorf("%s and %s: %w", s.certName, s.keyName, err)
		}
		c.TLS.Certificates = []tls.Certificate{pair}
	case cert != "" || key != "":
		return fmt.Errorf("%s and %s go together: give both or neither", s.certName, s.keyName)
	}
	if sn != "" {
		c.TLS.ServerName = sn
	}
	return nil
}

// isRedisURL reports whether v is given as a URL rather than host:port.
func isRedisURL(v string) bool { return strings.Contains(v, "://") }

// splitAuthority splits a URL as RFC 3986 (and net/url, which go-redis parses with) reads
// it: after "scheme://", the authority runs to the first "/", "?" or "#"; its user
// information, if any, ends at the authority's last "@". userEnd is the index in v of that
// "@" (-1 when the authority has none); rest is what follows the authority.
func splitAuthority(v string) (prefix, authority, rest string, userEnd int) {
	scheme, after, ok := strings.Cut(v, "://")
	if !ok {
		return "", v, "", strings.LastIndex(v, "@")
	}
	prefix = scheme + "://"
	authority, rest = after, ""
	if i := strings.IndexAny(after, "/?#"); i >= 0 {
		authority, rest = after[:i], after[i:]
	}
	userEnd = -1
	if i := strings.LastIndex(authority, "@"); i >= 0 {
		userEnd = len(prefix) + i
	}
	return prefix, authority, rest, userEnd
}

// ambiguousAt reports whether v holds an "@" after its authority (in its path, query or
// fragment): legitimate there (?client_name=ops@team), but it is also what a password with
// an unencoded "/", "?" or "#" followed by "@host" looks like, so text from that part of v
// may be a password.
func ambiguousAt(v string) bool {
	_, _, rest, _ := splitAuthority(v)
	return strings.Contains(rest, "@")
}

// redactUserinfo returns v, for an error message, without anything that may be a user or
// password: the URL's user information (its authority up to the last "@", as net/url
// reads it) is replaced with "redacted"; when an "@" also stands after the authority
// (ambiguousAt: maybe a password holding an unencoded "/", "?" or "#"), everything from
// "scheme://" to the last "@" of v is. A value that is no URL loses what stands before its
// last "@". had reports whether anything was redacted.
func redactUserinfo(v string) (redacted string, had bool) {
	prefix, _, rest, userEnd := splitAuthority(v)
	if prefix == "" {
		if userEnd >= 0 {
			return "redacted@" + v[userEnd+1:], true
		}
		return v, false
	}
	if strings.Contains(rest, "@") {
		return prefix + "redacted@" + v[strings.LastIndex(v, "@")+1:], true
	}
	if userEnd < 0 {
		return v, false
	}
	return prefix + "redacted@" + v[userEnd+1:], true
}

// urlError explains why a Redis URL does not parse without quoting its user or password:
// the parser runs again on the URL with its user information redacted, and its error (on
// that copy) is the explanation; when the copy parses, the user information itself was
// the problem.
func urlError(name, v string, parse func(string) error) error {
	const want = "want redis://[user@]host:port[/db] or rediss://… for TLS, the password in its own variable"
	red, had := redactUserinfo(v)
	err := parse(red)
	if err == nil && had {
		return fmt.Errorf("%s: not a valid Redis URL: its user or password does not parse (percent-encode characters such as @ : / ? # %% in them) (%s)", name, want)
	}
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err
	}
	if err == nil {
		err = errors.New("does not parse")
	}
	return fmt.Errorf("%s: not a valid Redis URL (%s): %w", name, want, err)
}

// redisURLOptions are the query options go-redis's URL parsers know (redis.ParseURL,
// redis.ParseClusterURL): public names, which an error may print even when the URL is
// ambiguous (ambiguousAt).
var redisURLOptions = map[string]bool{
	"addr": true, "db": true, "protocol": true, "client_name": true, "max_retries": true, "min_retry_backoff": true,
	"max_retry_backoff": true, "dial_timeout": true, "read_timeout": true, "write_timeout": true, "pool_fifo": true,
	"pool_size": true, "pool_timeout": true, "min_idle_conns": true, "max_idle_conns": true, "max_active_conns": true,
	"max_concurrent_dials": true, "pipeline_pool_size": true, "pipeline_read_buffer_size": true,
	"pipeline_write_buffer_size": true, "conn_max_idle_time": true, "idle_timeout": true, "conn_max_lifetime": true,
	"max_conn_age": true, "conn_max_lifetime_jitter": true, "skip_verify": true, "max_redirects": true,
	"read_only": true, "route_by_latency": true, "route_by_latency_tolerance": true, "route_randomly": true,
	"dialer_retries": true, "dialer_retry_timeout": true,
}

// checkURLOptions refuses query options (go-redis's parsers accept timeouts, pool sizes,
// skip_verify…, which idemscrape would not carry to its clients, or would carry silently:
// skip_verify turns certificate checks off): only a cluster URL's addr= options pass. The
// URL is read as go-redis reads it (net/url on v itself), so an "@" in the query or the
// fragment hides no option. A fragment (which go-redis ignores) is refused too: it is
// mostly a password's unencoded "#". The error names the options, sorted; one that is not
// a go-redis option is named only when it can not be part of a password.
func checkURLOptions(v, name string, cluster bool) error {
	u, err := url.Parse(v)
	if err != nil {
		return nil //nolint:nilerr // go-redis's parser fails the same way; the caller explains it (urlError)
	}
	var bad []string // quoted names
	unnamed := 0
	for k := range u.Query() {
		switch {
		case cluster && k == "addr":
		case redisURLOptions[k] || !ambiguousAt(v):
			bad = append(bad, quote.Input(k))
		default:
			unnamed++
		}
	}
	sort.Strings(bad)
	if len(bad)+unnamed > 0 {
		what := "URL option " + strings.Join(bad, "") + " is"
		switch {
		case len(bad) > 0 && unnamed > 0:
			what = fmt.Sprintf("URL options %s and %d more are", strings.Join(bad, ", "), unnamed)
		case len(bad) > 1:
			what = "URL options " + strings.Join(bad, ", ") + " are"
		case unnamed > 0:
			what = fmt.Sprintf("%d URL option(s) are", unnamed)
		}
		if unnamed > 0 {
			what += " (the query's other options are not named here: they may be part of a password, " +
				"percent-encode / ? # @ in one)"
		}
		return fmt.Errorf("%s: %s not supported (only the address, user, password, database and TLS: use the -redis-tls-* settings)", name, what)
	}
	if strings.Contains(v, "#") {
		return fmt.Errorf("%s: a Redis URL has no #fragment (percent-encode a # in a password as %%23)", name)
	}
	if cluster && strings.Trim(u.Path, "/") != "" {
		return fmt.Errorf("%s: a cluster URL has no database path (a cluster has only database 0)", name)
	}
	return nil
}

// safeQuote quotes a setting's value for an error, without what may be a user and
// password before an "@".
func safeQuote(v string) string {
	red, _ := redactUserinfo(v)
	return quote.Input(red)
}

// checkScheme accepts the two schemes idemscrape documents.
func checkScheme(v, name string) error {
	scheme, _, _ := strings.Cut(v, "://")
	if scheme != "redis" && scheme != "rediss" {
		return fmt.Errorf("%s: URL scheme %s: want redis:// or rediss:// (TLS)", name, quote.Input(scheme))
	}
	return nil
}

// parseRedisAddr reads the server or cluster setting: host:port (list) or a URL, through
// go-redis's own parsers (redis.ParseURL, redis.ParseClusterURL).
func parseRedisAddr(s redisSettings) (RedisConfig, error) {
	addr, cluster, addrName, clusterName := strings.TrimSpace(s.addr), strings.TrimSpace(s.cluster), s.addrName, s.clusterName
	switch {
	case addr != "" && cluster != "":
		return RedisConfig{}, fmt.Errorf("%s and %s are both set: give one server or one cluster, not both", addrName, clusterName)
	case cluster != "" && isRedisURL(cluster):
		if err := checkScheme(cluster, clusterName); err != nil {
			return RedisConfig{}, err
		}
		if err := checkURLOptions(cluster, clusterName, true); err != nil {
			return RedisConfig{}, err
		}
		o, err := redis.ParseClusterURL(cluster)
		if err != nil {
			return RedisConfig{}, urlError(clusterName, cluster, func(v string) error { _, err := redis.ParseClusterURL(v); return err })
		}
		for i, a := range o.Addrs {
			if err := checkHostPort(a); err != nil {
				return RedisConfig{}, fmt.Errorf("%s: node %d %s: %w", clusterName, i+1, quote.Input(a), err)
			}
		}
		return RedisConfig{Cluster: o.Addrs, Username: o.Username, Password: o.Password, TLS: o.TLSConfig}, nil
	case addr != "" && isRedisURL(addr):
		if err := checkScheme(addr, addrName); err != nil {
			return RedisConfig{}, err
		}
		if err := checkURLOptions(addr, addrName, false); err != nil {
			return RedisConfig{}, err
		}
		o, err := redis.ParseURL(addr)
		if err != nil {
			return RedisConfig{}, urlError(addrName, addr, func(v string) error { _, err := redis.ParseURL(v); return err })
		}
		if err := checkHostPort(o.Addr); err != nil {
			return RedisConfig{}, fmt.Errorf("%s: address %s: %w", addrName, quote.Input(o.Addr), err)
		}
		return RedisConfig{Addr: o.Addr, Username: o.Username, Password: o.Password, DB: o.DB, TLS: o.TLSConfig}, nil
	case cluster != "":
		var seeds []string
		seen := map[string]bool{}
		for i, part := range strings.Split(cluster, ",") {
			part = strings.TrimSpace(part)
			if err := checkHostPort(part); err != nil {
				return RedisConfig{}, fmt.Errorf("%s: entry %d %s: %w", clusterName, i+1, safeQuote(part), err)
			}
			if seen[part] {
				return RedisConfig{}, fmt.Errorf("%s: entry %d %s is listed twice", clusterName, i+1, safeQuote(part))
			}
			seen[part] = true
			seeds = append(seeds, part)
		}
		return RedisConfig{Cluster: seeds}, nil
	case addr != "":
		if strings.Contains(addr, ",") {
			return RedisConfig{}, fmt.Errorf("%s %s: one address only (a cluster's nodes go in %s)", addrName, safeQuote(addr), clusterName)
		}
		if strings.Contains(addr, "@") {
			return RedisConfig{}, fmt.Errorf("%s %s: a user or password needs the URL form, redis://user@host:port (the password in $%s)", addrName, safeQuote(addr), s.passwordEnv)
		}
		if err := checkHostPort(addr); err != nil {
			return RedisConfig{}, fmt.Errorf("%s %s: %w", addrName, safeQuote(addr), err)
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
		return fmt.Errorf("port %s is not a number in 1..65535", quote.Input(port))
	}
	return nil
}

// RouteRedisLogs sends go-redis's own log lines (a pool that can not dial, a cluster
// reload that failed), which it writes as plain text to stderr by default, through log at
// level WARN, so that a JSON log stays JSON. go-redis's logger is process-wide.
func RouteRedisLogs(log *slog.Logger) {
	redis.SetLogger(redisLogger{log.With("component", "go-redis")})
}

type redisLogger struct{ l *slog.Logger }

func (r redisLogger) Printf(ctx context.Context, format string, v ...any) {
	r.l.WarnContext(ctx, strings.TrimSpace(fmt.Sprintf(format, v...)))
}
