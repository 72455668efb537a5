package handlers

import "github.com/redis/go-redis/v9"

// WaitReleases waits for the background lease releases of committed jobs (releaseDone).
func WaitReleases(r *Registry) { r.releases.Wait() }

// RedisOf is the registry's Redis client.
func RedisOf(r *Registry) redis.UniversalClient { return r.cfg.Redis }
