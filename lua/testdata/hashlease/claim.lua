-- claim.lua: claim the lease of one job, or re-claim it as its current holder, and issue a
-- fencing token strictly greater than every token issued before for this job and than the
-- floor (the fence PostgreSQL holds), so a Redis that lost its counter never repeats one.
--
-- KEYS[1] -> <prefix>{<tag>}:lease   HASH  owner, token; expires with the lease
-- KEYS[2] -> <prefix>{<tag>}:fence   STRING  the last token issued for the job
-- --
-- ARGV[1] -> owner (string, non-empty)
-- ARGV[2] -> lease length (milliseconds, >= 1)
-- ARGV[3] -> floor: the job's fence in PostgreSQL (integer, >= 0)
-- ARGV[4] -> how long the token counter outlives its last claim (milliseconds, >= 1)
--
-- Returns
--   {1, token}              claimed (or re-claimed by the same owner) with a new token
--   {0, holder, remaining}  held by another owner; remaining lease in milliseconds
-- Expiry is on the Redis server's clock (PEXPIRE), never the caller's.
local holder = redis.call("HGET", KEYS[1], "owner")
if holder and holder ~= ARGV[1] then
  return {0, holder, redis.call("PTTL", KEYS[1])}
end
local last = tonumber(redis.call("GET", KEYS[2]) or "0")
local floor = tonumber(ARGV[3])
if last < floor then
  last = floor
end
local token = string.format("%d", last + 1)
redis.call("SET", KEYS[2], token, "PX", ARGV[4])
redis.call("HSET", KEYS[1], "owner", ARGV[1], "token", token)
redis.call("PEXPIRE", KEYS[1], ARGV[2])
return {1, tonumber(token)}
