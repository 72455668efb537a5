-- renew.lua: extend a lease, only for the claim that holds it.
--
-- KEYS[1] -> <prefix>{<tag>}:lease   STRING  the holder's value; PX = lease end
-- --
-- ARGV[1] -> the lease's value as its claim wrote it: "<token>:<owner>" (Claim) or
--            "<owner>" (Take)
-- ARGV[2] -> new lease length from now (milliseconds, >= 1)
--
-- Returns
--    1  renewed
--   -1  no lease: it expired or was deleted (lease lost)
--   -2  the lease is held by another owner or under another token (not owner)
-- Commands: GET, PEXPIRE (renewed); GET (refused).
local cur = redis.pcall("GET", KEYS[1])
if type(cur) == "table" then
  -- WRONGTYPE: an older worker's HASH lease (see claim.lua, rolling deploy). Our lease is
  -- always a STRING, so it was lost and claimed since: not ours.
  return -2
end
if not cur then
  return -1
end
if cur ~= ARGV[1] then
  return -2
end
redis.call("PEXPIRE", KEYS[1], ARGV[2])
return 1
