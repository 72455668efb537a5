-- unlock.lua: delete a lock only while the caller still holds it (compare-and-delete). A
-- lock is a STRING whose value is its holder's random owner token, taken with SET NX PX. A
-- holder that outlived its lock must not delete the lock another worker has taken since:
-- GET and DEL in one script, so nothing can take the lock between the two.
--
-- KEYS[1] -> <prefix>{host:<origin>}:robots-lock   STRING  owner token; PX = lock end
-- --
-- ARGV[1] -> owner token of the caller (the value it set the lock to)
--
-- Returns
--    1  the lock was the caller's: deleted
--   -1  no lock: it expired or was deleted (lock lost); nothing is deleted
--   -2  another owner holds the lock (not owner); nothing is deleted
local cur = redis.call("GET", KEYS[1])
if not cur then
  return -1
end
if cur ~= ARGV[1] then
  return -2
end
redis.call("DEL", KEYS[1])
return 1
