-- renew.lua: extend a lease, only for the holder that claimed it with this token.
--
-- KEYS[1] -> <prefix>{<tag>}:lease   HASH  owner, token
-- --
-- ARGV[1] -> owner
-- ARGV[2] -> token (integer)
-- ARGV[3] -> new lease length from now (milliseconds, >= 1)
--
-- Returns
--    1  renewed
--   -1  no lease: it expired or was deleted (lease lost)
--   -2  the lease is held by another owner or under another token (not owner)
-- One HMGET reads both fields (was two HGETs).
local cur = redis.call("HMGET", KEYS[1], "owner", "token")
if not cur[1] then
  return -1
end
if cur[1] ~= ARGV[1] or cur[2] ~= ARGV[2] then
  return -2
end
redis.call("PEXPIRE", KEYS[1], ARGV[3])
return 1
