package handlers

import "github.com/redis/go-redis/v9"

// SetReparseCommitHook makes Reparse call hook before each commit; an error it returns is
// the commit's (a failure injected after the job was re-queued or recorded and started).
func SetReparseCommitHook(cfg *ReparseConfig, hook func(key string) error) { cfg.commitHook = hook }

// WaitReleases waits for the background lease releases of committed jobs (releaseDone).
func WaitReleases(r *Registry) { r.releases.Wait() }

// RedisOf is the registry's Redis client.
func RedisOf(r *Registry) redis.UniversalClient { return r.cfg.Redis }
