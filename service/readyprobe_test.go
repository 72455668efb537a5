package service_test

import (
	"context"
	"net"
	"net/http"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/testutil"
)

// TestReadyzRedisReadOnly: a Redis that answers PING but refuses every write (a read-only
// replica, or out of memory under noeviction) makes /readyz answer 503 naming redis; once
// it takes writes again, 200. The probe's key sits under the service's key prefix and
// expires.
func TestReadyzRedisReadOnly(t *testing.T) {
	ctx := context.Background()
	for name, tc := range map[string]struct {
		refuse, lift func(t *testing.T, srv *testutil.RedisServer)
	}{
		"Replica": {
			refuse: func(t *testing.T, srv *testutil.RedisServer) {
				// A "master" that accepts the connection and never answers: the server stays
				// a read-only replica, its data kept, for as long as the test holds it.
				ln, err := net.Listen("tcp", "127.0.0.1:0")
				require.NoError(t, err)
				t.Cleanup(func() { _ = ln.Close() })
				port := ln.Addr().(*net.TCPAddr).Port
				require.NoError(t, srv.Client().Do(ctx, "REPLICAOF", "127.0.0.1", strconv.Itoa(port)).Err())
			},
			lift: func(t *testing.T, srv *testutil.RedisServer) {
				require.NoError(t, srv.Client().Do(ctx, "REPLICAOF", "NO", "ONE").Err())
			},
		},
		"OutOfMemory": {
			refuse: func(t *testing.T, srv *testutil.RedisServer) {
				c := srv.Client()
				require.NoError(t, c.ConfigSet(ctx, "maxmemory-policy", "noeviction").Err())
				require.NoError(t, c.ConfigSet(ctx, "maxmemory", "1").Err())
			},
			lift: func(t *testing.T, srv *testutil.RedisServer) {
				require.NoError(t, srv.Client().ConfigSet(ctx, "maxmemory", "0").Err())
			},
		},
	} {
		t.Run(name, func(t *testing.T) {
			srv := testutil.StartRedis(t)
			b := setup(t, setupOpts{redisAddr: srv.Addr, rdb: srv.Client()})
			code, body := b.do(t, "GET", "/readyz", nil)
			require.Equal(t, http.StatusOK, code, body)
			keys, err := srv.Client().Keys(ctx, b.prefix+"ready-probe:*").Result()
			require.NoError(t, err)
			if assert.Len(t, keys, 1, "one probe key per process, under the key prefix") {
				ttl, err := srv.Client().PTTL(ctx, keys[0]).Result()
				require.NoError(t, err)
				assert.Positive(t, ttl, "the probe key expires")
			}

			require.NoError(t, srv.Client().Ping(ctx).Err())
			tc.refuse(t, srv)
			require.Error(t, srv.Client().Set(ctx, b.prefix+"x", "1", 0).Err(), "the server refuses writes")
			require.NoError(t, srv.Client().Ping(ctx).Err(), "and still answers PING")
			code, body = b.do(t, "GET", "/readyz", nil)
			assert.Equal(t, http.StatusServiceUnavailable, code, body)
			assert.Contains(t, body, "redis: failing")
			assert.Contains(t, body, "postgres: ok")

			tc.lift(t, srv)
			code, body = b.do(t, "GET", "/readyz", nil)
			assert.Equal(t, http.StatusOK, code, body)
			assert.Contains(t, body, "redis: ok")
		})
	}
}
