package service

import (
	"fmt"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// connOptOf is the asynq connection option of the server or cluster rdb connects to, for
// Config.RedisConnOpt left nil: asynq's server and asynqmon each build their own client
// (asynqmon closes its own at Shutdown), with rdb's options — address or cluster nodes,
// ACL user and password, TLS, database, timeouts, and for a cluster its slot-map reload —
// so that the server is named once.
func connOptOf(rdb redis.UniversalClient) (asynq.RedisConnOpt, error) {
	switch c := rdb.(type) {
	case *redis.Client:
		return clientConnOpt{c.Options()}, nil
	case *redis.ClusterClient:
		return clusterConnOpt{c.Options()}, nil
	default:
		return nil, fmt.Errorf("service: Config.RedisConnOpt is required with a %T as Config.Redis (only a *redis.Client or *redis.ClusterClient gives its options)", rdb)
	}
}

// derivesConnOpt: connOptOf has an option for rdb.
func derivesConnOpt(rdb redis.UniversalClient) bool {
	_, err := connOptOf(rdb)
	return err == nil
}

// clientConnOpt makes clients with a copy of one server's options.
type clientConnOpt struct{ o *redis.Options }

func (c clientConnOpt) MakeRedisClient() any {
	o := *c.o
	if o.TLSConfig != nil {
		o.TLSConfig = o.TLSConfig.Clone()
	}
	return redis.NewClient(&o)
}

// clusterConnOpt makes clients with a copy of one cluster's options. asynq tags every
// key of a queue with {<queue>}, so a queue lives in one slot.
type clusterConnOpt struct{ o *redis.ClusterOptions }

func (c clusterConnOpt) MakeRedisClient() any {
	o := *c.o
	o.Addrs = append([]string(nil), o.Addrs...)
	if o.TLSConfig != nil {
		o.TLSConfig = o.TLSConfig.Clone()
	}
	return redis.NewClusterClient(&o)
}
