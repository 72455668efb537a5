package envflag

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// withSecret joins what comes before a password (scheme and user), a made-up password and
// what follows the "@": the test's settings, without a literal credential URL in the
// source.
func withSecret(before, password, after string) string { return before + ":" + password + "@" + after }

// proto is a Redis error reply as go-redis returns it.
type proto string

func (e proto) Error() string { return string(e) }
func (proto) RedisError()     {}

func TestRedis(t *testing.T) {
	parse := func(t *testing.T, args ...string) (RedisConfig, error) {
		t.Helper()
		var r Redis
		s := New("t", "EFT_", io.Discard)
		r.Define(s)
		require.NoError(t, s.Parse(args))
		return r.Config()
	}
	for _, v := range []string{"REDIS", "REDIS_CLUSTER", "REDIS_PASSWORD", "REDIS_PASSWORD_FILE", "REDIS_TLS_CA", "REDIS_TLS_CERT", "REDIS_TLS_KEY", "REDIS_TLS_SERVER_NAME"} {
		t.Setenv("EFT_"+v, "")
	}

	t.Run("DefaultIsOneLocalServer", func(t *testing.T) {
		c, err := parse(t)
		require.NoError(t, err)
		assert.Equal(t, RedisConfig{Addr: DefaultRedisAddr}, c)
		assert.False(t, c.IsCluster())
	})
	t.Run("OneServer", func(t *testing.T) {
		t.Setenv("EFT_REDIS", "10.0.0.5:6380")
		c, err := parse(t)
		require.NoError(t, err)
		assert.Equal(t, RedisConfig{Addr: "10.0.0.5:6380"}, c)
		assert.Equal(t, asynq.RedisClientOpt{Addr: "10.0.0.5:6380"}, c.AsynqConnOpt())
		cl := c.NewClient()
		defer cl.Close()
		assert.IsType(t, &redis.Client{}, cl)
		assert.Equal(t, "redis 10.0.0.5:6380", c.String())
	})
	t.Run("Cluster", func(t *testing.T) {
		t.Setenv("EFT_REDIS_CLUSTER", " 127.0.0.1:7000, 127.0.0.1:7001 ,[::1]:7002")
		c, err := parse(t)
		require.NoError(t, err)
		want := []string{"127.0.0.1:7000", "127.0.0.1:7001", "[::1]:7002"}
		assert.Equal(t, RedisConfig{Cluster: want}, c)
		assert.True(t, c.IsCluster())
		assert.Equal(t, ClusterConnOpt{Addrs: want}, c.AsynqConnOpt())
		cl := c.NewClient()
		defer cl.Close()
		assert.IsType(t, &redis.ClusterClient{}, cl)
		assert.Equal(t, DefaultClusterStateReload, cl.(*redis.ClusterClient).Options().ClusterStateReloadInterval)
		ac, ok := c.AsynqConnOpt().MakeRedisClient().(*redis.ClusterClient)
		require.True(t, ok, "asynq gets a cluster client")
		defer ac.Close()
		assert.Equal(t, want, ac.Options().Addrs)
		assert.Equal(t, DefaultClusterStateReload, ac.Options().ClusterStateReloadInterval)
	})
	t.Run("OneSeedStillACluster", func(t *testing.T) {
		c, err := parse(t, "-redis-cluster", "127.0.0.1:7000")
		require.NoError(t, err)
		cl := c.NewClient()
		defer cl.Close()
		assert.IsType(t, &redis.ClusterClient{}, cl, "a seed list of one node is still a cluster")
		assert.IsType(t, ClusterConnOpt{}, c.AsynqConnOpt())
	})
	t.Run("URL", func(t *testing.T) {
		c, err := parse(t, "-redis", withSecret("redis://app", "pw", "10.0.0.5:6380/3"))
		require.NoError(t, err)
		assert.Equal(t, RedisConfig{Addr: "10.0.0.5:6380", Username: "app", Password: "pw", DB: 3}, c)
		assert.Equal(t, asynq.RedisClientOpt{Addr: "10.0.0.5:6380", Username: "app", Password: "pw", DB: 3}, c.AsynqConnOpt())
		assert.Equal(t, "redis app@10.0.0.5:6380/3", c.String(), "no password")
		for _, f := range []string{"%v", "%+v", "%#v", "%s"} {
			assert.NotContains(t, fmt.Sprintf(f, c), ":pw", f)
		}
		var b strings.Builder
		slog.New(slog.NewJSONHandler(&b, nil)).Info("x", "redis", c)
		assert.Contains(t, b.String(), `"redis":"redis app@10.0.0.5:6380/3"`)
	})
	t.Run("PasswordFromFile", func(t *testing.T) {
		pw := t.TempDir() + "/pw"
		require.NoError(t, os.WriteFile(pw, []byte("from-file\n"), 0o600))
		t.Setenv("EFT_REDIS_PASSWORD_FILE", pw)
		c, err := parse(t, "-redis", "redis://app@h:6379")
		require.NoError(t, err)
		assert.Equal(t, "from-file", c.Password, "one trailing newline removed")
	})
	t.Run("TLSURL", func(t *testing.T) {
		c, err := parse(t, "-redis", "rediss://h:6380", "-redis-tls-server-name", "redis.internal")
		require.NoError(t, err)
		require.NotNil(t, c.TLS)
		assert.Equal(t, "redis.internal", c.TLS.ServerName)
		assert.Equal(t, "rediss h:6380", c.String())
		opt := c.AsynqConnOpt().(asynq.RedisClientOpt)
		require.NotNil(t, opt.TLSConfig)
		assert.NotSame(t, c.TLS, opt.TLSConfig, "each client gets its own copy")
	})
	t.Run("ClusterURL", func(t *testing.T) {
		c, err := parse(t, "-redis-cluster", withSecret("rediss://app", "pw", "127.0.0.1:7000?addr=127.0.0.1:7001"))
		require.NoError(t, err)
		assert.Equal(t, []string{"127.0.0.1:7000", "127.0.0.1:7001"}, c.Cluster)
		assert.Equal(t, "app", c.Username)
		assert.Equal(t, "pw", c.Password)
		require.NotNil(t, c.TLS)
		ac := c.AsynqConnOpt().MakeRedisClient().(*redis.ClusterClient)
		defer ac.Close()
		assert.Equal(t, "app", ac.Options().Username)
		assert.NotNil(t, ac.Options().TLSConfig)
		assert.Equal(t, "rediss cluster app@127.0.0.1:7000,127.0.0.1:7001", c.String())
	})
	t.Run("OptionIsACopy", func(t *testing.T) {
		c := RedisConfig{Cluster: []string{"a:1"}}
		c.AsynqConnOpt().(ClusterConnOpt).Addrs[0] = "changed:2"
		assert.Equal(t, []string{"a:1"}, c.Cluster)
	})
	t.Run("Refused", func(t *testing.T) {
		tests := []struct {
			name    string
			env     map[string]string
			args    []string
			wantErr string
		}{
			{"BothFromEnvironment", map[string]string{"EFT_REDIS": "a:1", "EFT_REDIS_CLUSTER": "b:2"}, nil,
				"-redis ($EFT_REDIS) and -redis-cluster ($EFT_REDIS_CLUSTER) are both set"},
			{"FlagAndEnvironment", map[string]string{"EFT_REDIS_CLUSTER": "b:2"}, []string{"-redis", "a:1"},
				"are both set"},
			{"NoPort", nil, []string{"-redis", "localhost"}, `-redis ($EFT_REDIS) "localhost": not host:port`},
			{"BadPort", nil, []string{"-redis", "localhost:http"}, `port "http" is not a number`},
			{"PortZero", nil, []string{"-redis", "localhost:0"}, `port "0"`},
			{"OtherScheme", nil, []string{"-redis", "http://h:6379"}, `-redis ($EFT_REDIS): URL scheme "http": want redis:// or rediss://`},
			{"BadURLHidesPassword", nil, []string{"-redis", withSecret("redis://u", "s3cret", "h:6379/x")}, `-redis ($EFT_REDIS): not a valid Redis URL`},
			{"TLSFilesWithoutTLS", nil, []string{"-redis", "redis://h:6379", "-redis-tls-ca", "/x.pem"},
				"-redis-tls-ca ($EFT_REDIS_TLS_CA) is a TLS setting: give Redis as a rediss:// URL"},
			{"CertWithoutKey", nil, []string{"-redis", "rediss://h:6379", "-redis-tls-cert", "/x.pem"}, "go together"},
			{"MissingCA", nil, []string{"-redis", "rediss://h:6379", "-redis-tls-ca", "/nonexistent/ca.pem"}, "-redis-tls-ca ($EFT_REDIS_TLS_CA): open /nonexistent/ca.pem"},
			{"PasswordTwice", map[string]string{"EFT_REDIS_PASSWORD": "p2"}, []string{"-redis", withSecret("redis://u", "p1", "h:6379")}, "give it one way"},
			{"HashInPassword", nil, []string{"-redis", withSecret("redis://", "s3cret#x", "h:6379")}, "its user or password does not parse"},
			{"SlashInPassword", nil, []string{"-redis", withSecret("redis://", "12/s3cret", "h")}, "its user or password does not parse"},
			{"BadEscapeInPassword", nil, []string{"-redis", withSecret("redis://u", "s3cret%zz", "h:1")}, "its user or password does not parse"},
			{"PasswordWithoutScheme", nil, []string{"-redis", withSecret("user", "s3cret", "h:6379")}, "needs the URL form"},
			{"PasswordInClusterEntry", nil, []string{"-redis-cluster", "a:1," + withSecret("user", "s3cret", "h:6379")}, "entry 2"},
			{"SkipVerifyRefused", nil, []string{"-redis", "rediss://h:6379?skip_verify=true"}, `URL option "skip_verify" is not supported`},
			{"TimeoutOptionRefused", nil, []string{"-redis", "redis://h:6379?dial_timeout=1s"}, `URL option "dial_timeout"`},
			{"ClusterDBRefused", nil, []string{"-redis-cluster", "redis://h:6379/2?addr=h:6380"}, "no database path"},
			{"PasswordFileMissing", map[string]string{"EFT_REDIS_PASSWORD_FILE": "/nonexistent/pw"}, nil, "$EFT_REDIS_PASSWORD_FILE: secret file /nonexistent/pw"},
			{"ListInSingle", nil, []string{"-redis", "a:1,b:2"}, "one address only (a cluster's nodes go in -redis-cluster ($EFT_REDIS_CLUSTER))"},
			{"EmptyEntry", map[string]string{"EFT_REDIS_CLUSTER": "a:1,,b:2"}, nil,
				`-redis-cluster ($EFT_REDIS_CLUSTER): entry 2 "": empty address`},
			{"BadEntry", nil, []string{"-redis-cluster", "a:1,b"}, `-redis-cluster ($EFT_REDIS_CLUSTER): entry 2 "b": not host:port`},
			{"NoHost", nil, []string{"-redis-cluster", ":7000"}, `entry 1 ":7000": empty host`},
			{"Duplicate", nil, []string{"-redis-cluster", "a:1,a:1"}, `entry 2 "a:1" is listed twice`},
		}
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				for k, v := range tt.env {
					t.Setenv(k, v)
				}
				_, err := parse(t, tt.args...)
				require.Error(t, err)
				assert.Contains(t, err.Error(), tt.wantErr)
				for _, secret := range []string{"s3cret", "p1", "p2"} {
					assert.NotContains(t, err.Error(), secret, "no password in an error")
				}
			})
		}
	})
	t.Run("NodeFailure", func(t *testing.T) {
		for _, tt := range []struct {
			err  error
			want bool
		}{
			{nil, false},
			{redis.Nil, false},
			{context.Canceled, false},
			{fmt.Errorf("read: %w", context.DeadlineExceeded), false},
			{errors.New("ERR wrong number of arguments"), false},
			{redis.ErrClosed, false},
			{&net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}, true},
			{fmt.Errorf("x: %w", syscall.ECONNRESET), true},
			{io.EOF, true},
			{proto("CLUSTERDOWN The cluster is down"), true},
			{proto("MOVED 3999 127.0.0.1:6381"), false}, // go-redis follows and reloads itself
		} {
			assert.Equal(t, tt.want, nodeFailure(tt.err), "%v", tt.err)
		}
	})
	t.Run("FromEnvironment", func(t *testing.T) {
		c, err := RedisFromEnv("EFT_")
		require.NoError(t, err)
		assert.Equal(t, RedisConfig{Addr: DefaultRedisAddr}, c)

		t.Setenv("EFT_REDIS_CLUSTER", "127.0.0.1:7000,127.0.0.1:7001")
		c, err = RedisFromEnv("EFT_")
		require.NoError(t, err)
		assert.Equal(t, []string{"127.0.0.1:7000", "127.0.0.1:7001"}, c.Cluster)

		t.Setenv("EFT_REDIS", "a:1")
		_, err = RedisFromEnv("EFT_")
		assert.ErrorContains(t, err, "$EFT_REDIS and $EFT_REDIS_CLUSTER are both set")

		t.Setenv("EFT_REDIS", "")
		t.Setenv("EFT_REDIS_CLUSTER", "x")
		_, err = RedisFromEnv("EFT_")
		assert.ErrorContains(t, err, `$EFT_REDIS_CLUSTER: entry 1 "x": not host:port`)
	})
}

// TestRedisURLQueryAt: options are read from a Redis URL as go-redis reads them (net/url:
// the user information is in the authority only), so an "@" in the query or the fragment
// hides no option: skip_verify (whatever its value) is refused in every form below, with
// or without user information, and no error quotes the password. A URL without options
// parses, its password read as go-redis reads it.
func TestRedisURLQueryAt(t *testing.T) {
	for _, v := range []string{"REDIS", "REDIS_CLUSTER", "REDIS_PASSWORD", "REDIS_PASSWORD_FILE", "REDIS_TLS_CA", "REDIS_TLS_CERT", "REDIS_TLS_KEY", "REDIS_TLS_SERVER_NAME"} {
		t.Setenv("EFT_"+v, "")
	}
	parse := func(t *testing.T, args ...string) (RedisConfig, error) {
		t.Helper()
		var r Redis
		s := New("t", "EFT_", io.Discard)
		r.Define(s)
		require.NoError(t, s.Parse(args))
		return r.Config()
	}
	const secret = "s3cr"
	for _, tc := range []struct {
		name    string
		flag    string
		url     string
		wantErr string // "": accepted
		user    string // accepted: the user and password read
		pass    string
	}{
		{"AtInQuery", "-redis", "rediss://h:6380/0?skip_verify=true&client_name=ops@team", `"skip_verify"`, "", ""},
		{"AtInQueryFalse", "-redis", "rediss://h:6380/0?client_name=ops@team&skip_verify=false", `"skip_verify"`, "", ""},
		{"AtInQueryCluster", "-redis-cluster", "rediss://h:7000?addr=h:7001&skip_verify=true&client_name=ops@team", `"skip_verify"`, "", ""},
		{"AtInFragment", "-redis", "rediss://h:6380/0?skip_verify=true#ops@team", `"skip_verify"`, "", ""},
		{"FragmentAlone", "-redis", "rediss://h:6380/0#ops@team", "no #fragment", "", ""},
		{"EncodedAtInPassword", "-redis", withSecret("rediss://u", secret+"%40et", "h:6380/0?skip_verify=true"), `"skip_verify"`, "", ""},
		{"EncodedAtInPasswordAccepted", "-redis", withSecret("rediss://u", secret+"%40et", "h:6380/0"), "", "u", secret + "@et"},
		{"RawAtInPassword", "-redis", withSecret("rediss://u", secret+"@et", "h:6380/0?skip_verify=true"), `"skip_verify"`, "", ""},
		{"RawAtInPasswordAccepted", "-redis", withSecret("rediss://u", secret+"@et", "h:6380/0"), "", "u", secret + "@et"},
		{"NoUserinfo", "-redis", "rediss://h:6380?skip_verify=true", `URL option "skip_verify" is not supported`, "", ""},
		{"NoUserinfoAccepted", "-redis", "rediss://h:6380/0", "", "", ""},
		{"UserinfoAndAtInQuery", "-redis", withSecret("rediss://u", secret+"et", "h:6380/0?skip_verify=true&client_name=ops@team"), `"skip_verify"`, "", ""},
		// A password with an unencoded "?" or "#" before its "@": the text after it is the
		// query or the fragment, never quoted.
		{"PasswordInQuery", "-redis", withSecret("rediss://", "12?"+secret+"et", "h:6380?skip_verify=true"), "not named here", "", ""},
		{"PasswordInQueryAlone", "-redis", withSecret("rediss://", "12?"+secret+"et", "h:6380"), "1 URL option(s) are (the query's other options are not named here", "", ""},
		{"PasswordInFragment", "-redis", withSecret("rediss://", "12#"+secret+"et", "h:6380"), "no #fragment", "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := parse(t, tc.flag, tc.url)
			if tc.wantErr == "" {
				require.NoError(t, err)
				require.NotNil(t, c.TLS)
				assert.False(t, c.TLS.InsecureSkipVerify)
				assert.Equal(t, tc.user, c.Username)
				assert.Equal(t, tc.pass, c.Password)
				return
			}
			require.Error(t, err, "skip_verify or a fragment must not pass: %+v", c)
			assert.Contains(t, err.Error(), tc.wantErr)
			assert.NotContains(t, err.Error(), secret, "no password in an error")
		})
	}
}
