package testutil

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// TestStartRedisCluster: a 3-master cluster with one replica each serves every slot, keys
// with one hash tag share a slot, and a killed master's replica takes its slots over.
func TestStartRedisCluster(t *testing.T) {
	ctx := context.Background()
	c := StartRedisCluster(t, 3, 1)
	cl := c.Client()
	require.Len(t, c.Addrs(), 6)

	// Keys of one job (one hash tag) live in one slot: a multi-key command works.
	require.NoError(t, cl.MSet(ctx, "{job:1}:a", "1", "{job:1}:b", "2").Err())
	err := cl.MSet(ctx, "x:a", "1", "y:b", "2").Err()
	require.ErrorContains(t, err, "CROSSSLOT", "keys of different slots are refused")

	// Failover: kill the master of a key; its replica is promoted and the cluster is whole.
	const key = "{job:2}:lease"
	require.NoError(t, cl.Set(ctx, key, "v", 0).Err())
	victim := c.MasterFor(ctx, key)
	c.Kill(victim)
	c.WaitHealthy()
	fresh := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	defer fresh.Close()
	require.NotEqual(t, victim, c.MasterFor(ctx, key), "a replica took the slot over")
	v, err := fresh.Get(ctx, key).Result()
	require.NoError(t, err)
	require.Equal(t, "v", v)

	// The old master restarts empty and rejoins.
	c.Restart(victim)
	c.WaitHealthy()
}
