-- state.lua: what a dispatcher needs to know of a stream, in one call: the stream's epoch
-- marker, how many entries were ever added to the stream (XINFO STREAM entries-added, Redis
-- 7.0+; trims and deletions do not lower it) and its length. A batch runs it before it
-- appends (the check) and right after its own XADDs, in their pipeline (what it records).
-- An epoch marker that is absent or not PostgreSQL's epoch means Redis lost the stream's
-- data; entries-added below what PostgreSQL recorded means Redis came back with an older
-- copy of the stream (a failover to a lagging replica, an RDB restored) that lacks entries
-- some committed batch appended: every batch records the entries-added it read after its
-- own XADDs, a count its own entries lie within, and a copy of the stream is a prefix of
-- its history. The marker and the stream share a cluster slot (the topic's hash tag).
--
-- KEYS[1] -> <prefix>epoch:{<topic>}    STRING  the epoch marker
-- KEYS[2] -> <prefix>stream:{<topic>}   STREAM  the outbox stream
--
-- Returns {marker, added, length}
--   marker   the marker's value ("" when absent)
--   added    the stream's entries-added (0 when there is no stream); an error when the
--            server does not report it (before Redis 7.0)
--   length   the stream's length (XLEN; 0 when there is no stream)
local marker = redis.call('GET', KEYS[1])
if not marker then
  marker = ''
end
local added, length = 0, 0
if redis.call('EXISTS', KEYS[2]) == 1 then
  length = redis.call('XLEN', KEYS[2])
  added = nil
  local info = redis.call('XINFO', 'STREAM', KEYS[2])
  for i = 1, #info, 2 do
    if info[i] == 'entries-added' then
      added = info[i + 1]
      break
    end
  end
  if added == nil then
    -- A server without the counter (Redis before 7.0) would make every stream look short.
    return redis.error_reply('ERR XINFO STREAM has no entries-added: the outbox needs Redis 7.0 or later')
  end
end
return {marker, added, length}
