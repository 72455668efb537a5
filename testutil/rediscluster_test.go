package testutil

import (
	"context"
	"testing"
	"time"

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
	// Write on the key's master and WAIT, on the same connection, until a replica has it:
	// replication is asynchronous, and a failover may otherwise lose the write.
	master, err := cl.MasterForKey(ctx, key)
	require.NoError(t, err)
	pipe := master.Pipeline()
	pipe.Set(ctx, key, "v", 0)
	acked := pipe.Do(ctx, "WAIT", 1, (10 * time.Second).Milliseconds())
	_, err = pipe.Exec(ctx)
	require.NoError(t, err)
	n, err := acked.Int64()
	require.NoError(t, err)
	require.Equal(t, int64(1), n, "a replica acknowledged the write")
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
