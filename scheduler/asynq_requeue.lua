-- asynq_requeue.lua: give one active asynq task back to its queue's pending list, as
-- asynq v0.26 does itself for the unfinished tasks of a server that shuts down
-- (internal/rdb/rdb.go, requeueCmd, used by RDB.Requeue): out of the active list and the
-- lease set, pushed at the head of the pending list (the next one dequeued), state
-- "pending", no retry counted. It does so only while the task is still active under the
-- very lease the caller read (its score, the lease end its holder last wrote): a task that
-- moved on since (done, retried, recovered, given back by another reconciler, dequeued
-- again) is left alone. The lines after the check are asynq's requeueCmd, unchanged.
--
-- KEYS[1] -> asynq:{<qname>}:active
-- KEYS[2] -> asynq:{<qname>}:lease
-- KEYS[3] -> asynq:{<qname>}:pending
-- KEYS[4] -> asynq:{<qname>}:t:<task_id>
-- --
-- ARGV[1] -> task ID
-- ARGV[2] -> the task's lease score (Unix seconds) the caller read
--
-- Returns 1 when the task was given back, 0 when it had moved on (nothing written).
-- All keys share the queue's hash tag.
if redis.call("HGET", KEYS[4], "state") ~= "active" then
  return 0
end
local score = redis.call("ZSCORE", KEYS[2], ARGV[1])
if not score or tonumber(score) ~= tonumber(ARGV[2]) then
  return 0
end
if redis.call("LREM", KEYS[1], 0, ARGV[1]) == 0 then
  return redis.error_reply("NOT FOUND")
end
if redis.call("ZREM", KEYS[2], ARGV[1]) == 0 then
  return redis.error_reply("NOT FOUND")
end
redis.call("RPUSH", KEYS[3], ARGV[1])
redis.call("HSET", KEYS[4], "state", "pending")
return 1
