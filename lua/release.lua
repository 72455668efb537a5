-- release.lua: give a lease up, only for the claim that holds it. By
-- default the token counter stays, so the next claim still gets a higher token. When the
-- caller says the job is terminal (complete: it never runs again and PostgreSQL holds its
-- fence, the floor of every later claim), the counter goes too, so a completed job leaves
-- no key behind. The counter is deleted only while it still holds this lease's token: a
-- higher one was issued to a claim PostgreSQL may not know of, and must stay.
--
-- KEYS[1] -> <prefix>{<tag>}:lease   STRING  the holder's value; PX = lease end
-- KEYS[2] -> <prefix>{<tag>}:fence   STRING  the last token issued for the job
-- --
-- ARGV[1] -> the lease's value as its claim wrote it: "<token>:<owner>" (Claim) or
--            "<owner>" (Take)
-- ARGV[2] -> token (integer; 0 for a Take lease, whose token PostgreSQL issued)
-- ARGV[3] -> terminal: "1" deletes the token counter with the lease, "0" keeps it
--
-- Returns
--    1  released
--   -1  no lease: it expired or was deleted (lease lost); nothing is deleted
--   -2  the lease is held by another owner or under another token (not owner); nothing is
--       deleted
-- Commands: MGET, DEL (released or refused); MGET, EXISTS (no STRING lease). One MGET reads
-- the lease and the counter; one DEL deletes both when the counter goes too (they share
-- the job's hash tag).
local cur = redis.call("MGET", KEYS[1], KEYS[2])
if not cur[1] then
  -- MGET reads a HASH as nil: an older worker's HASH lease (see claim.lua, rolling deploy)
  -- is another's, not a lost one.
  if redis.call("EXISTS", KEYS[1]) == 1 then
    return -2
  end
  return -1
end
if cur[1] ~= ARGV[1] then
  return -2
end
if ARGV[3] == "1" and cur[2] == ARGV[2] then
  redis.call("DEL", KEYS[1], KEYS[2])
else
  redis.call("DEL", KEYS[1])
end
return 1
