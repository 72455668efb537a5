package main

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/cmd/internal/envflag"
)

func TestFlags(t *testing.T) {
	for _, name := range []string{"IDEMSCRAPE_SCHEDULER_CONFIG", "IDEMSCRAPE_REDIS", "IDEMSCRAPE_REDIS_CLUSTER", "IDEMSCRAPE_LOG_FORMAT", "IDEMSCRAPE_LOG_LEVEL"} {
		t.Setenv(name, "")
	}
	t.Run("DefaultRedis", func(t *testing.T) {
		c, err := parseFlags([]string{"-config", "s.yaml"}, &bytes.Buffer{})
		require.NoError(t, err)
		assert.Equal(t, envflag.RedisConfig{Addr: envflag.DefaultRedisAddr}, c.redisCfg)
	})
	t.Run("RedisClusterFromEnvironment", func(t *testing.T) {
		t.Setenv("IDEMSCRAPE_REDIS_CLUSTER", "127.0.0.1:7000, 127.0.0.1:7001")
		c, err := parseFlags([]string{"-config", "s.yaml"}, &bytes.Buffer{})
		require.NoError(t, err)
		assert.True(t, c.redisCfg.IsCluster())
		assert.Equal(t, []string{"127.0.0.1:7000", "127.0.0.1:7001"}, c.redisCfg.Cluster)
	})
	t.Run("Refused", func(t *testing.T) {
		for name, tt := range map[string]struct {
			args []string
			want string
		}{
			"NoConfig":     {nil, "-config ($IDEMSCRAPE_SCHEDULER_CONFIG) is required"},
			"BothRedis":    {[]string{"-config", "s.yaml", "-redis", "a:1", "-redis-cluster", "b:2"}, "are both set"},
			"BadCluster":   {[]string{"-config", "s.yaml", "-redis-cluster", "b"}, `-redis-cluster ($IDEMSCRAPE_REDIS_CLUSTER): entry 1 "b": not host:port`},
			"BadLogFormat": {[]string{"-config", "s.yaml", "-log-format", "xml"}, "-log-format"},
		} {
			t.Run(name, func(t *testing.T) {
				_, err := parseFlags(tt.args, &bytes.Buffer{})
				assert.ErrorContains(t, err, tt.want)
			})
		}
	})
}
