-- release.lua: give a lease up, only for the holder that claimed it with this token. The
-- token counter stays, so the next claim still gets a higher token.
--
-- KEYS[1] -> <prefix>{<tag>}:lease   HASH  owner, token
-- --
-- ARGV[1] -> owner
-- ARGV[2] -> token (integer)
--
-- Returns
--    1  released
--   -1  no lease: it expired or was deleted (lease lost)
--   -2  the lease is held by another owner or under another token (not owner)
local owner = redis.call("HGET", KEYS[1], "owner")
if not owner then
  return -1
end
if owner ~= ARGV[1] or redis.call("HGET", KEYS[1], "token") ~= ARGV[2] then
  return -2
end
redis.call("DEL", KEYS[1])
return 1
