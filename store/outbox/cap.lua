-- cap.lua: hold an outbox stream at a length cap, and count what the cap takes from each
-- consumer group. The safety valve behind the pending-safe trim (lua/trim.lua): a consumer
-- group that stopped reading holds that trim's floor for ever, and the stream would grow
-- until Redis refuses writes. When the stream holds more than maxlen entries, its oldest
-- entries are removed (XTRIM MAXLEN =, exact), at most step of them per call, whether or not
-- every group has acknowledged them; for each group the script counts the removed entries
-- the group had not acknowledged — never delivered to it, or delivered and still pending.
-- Those events are lost for that group. Reading the groups, trimming and counting happen in
-- one script: no group reads or acknowledges in between.
--
-- Undelivered entries of a group are the entries after its last-delivered-id. Their number
-- is the group's lag (XINFO GROUPS, Redis 7.0+) when Redis knows it and it is possible
-- (below the stream's length). Otherwise — a group created at an id inside the stream that
-- has not read since, entries deleted with XDEL after its position — the removed entries up
-- to its last-delivered-id are removed first, whole stream nodes at a time, by XTRIM MINID ~
-- with a LIMIT, whose reply counts them, and the rest of them (at most one node's worth,
-- stream-node-max-entries) with XRANGE: no entry is read one by one. Pending entries removed
-- are the group's PEL entries from the old first entry up to the new one, so an entry is
-- counted once even while its PEL record outlives it.
--
-- Redis 7.0 keeps counting trimmed entries in a group's lag once the group reads past them
-- (entries-read counts reads, not positions), which would make every later count too high.
-- So for every group whose last-delivered-id lies before the new first entry, the script
-- sets entries-read to the logical counter of the last removed entry (XGROUP SETID with the
-- group's own last-delivered-id, which does not move, and ENTRIESREAD): what Redis itself
-- reports for such a group. Its lag is then the number of entries it has not read. Skipped
-- when XDEL left deleted entries after the new first entry (the counters are unknown there).
--
-- KEYS[1] -> <prefix>stream:{<topic>}   STREAM  the outbox stream (its name may carry a hash tag)
-- --
-- ARGV[1] -> maxlen   the most entries the stream keeps (entries, >= 1)
-- ARGV[2] -> step     the most entries one call removes (entries, >= 1)
--
-- Returns {removed, over, first, name1, lost1, name2, lost2, ...}
--   removed       entries this call removed; 0: no stream, or not longer than maxlen
--   over          entries still above maxlen after this call (> 0 only when step bounded it)
--   first         the id of the stream's first entry after the trim ("" when removed is 0)
--   nameN, lostN  a consumer group and how many of the removed entries it had not
--                 acknowledged (only groups with lostN > 0)

local maxlen = tonumber(ARGV[1])
local step = tonumber(ARGV[2])
if redis.call('TYPE', KEYS[1])['ok'] ~= 'stream' then
  return {0, 0, ''}
end
local len = redis.call('XLEN', KEYS[1])
if len <= maxlen then
  return {0, 0, ''}
end
local remove = math.min(len - maxlen, step)
local keep = len - remove

-- split, numcmp, idcmp, incr, successor: lua/lib/streamids.lua, prepended to this script.

-- fields turns a flat {name, value, name, value, ...} reply into a table.
local function fields(reply)
  local t = {}
  for i = 1, #reply, 2 do
    t[reply[i]] = reply[i + 1]
  end
  return t
end

local info = fields(redis.call('XINFO', 'STREAM', KEYS[1]))
local oldfirst = info['first-entry'][1]
local last = info['last-entry'][1]
local added = info['entries-added']
local maxdeleted = info['max-deleted-entry-id']

-- Per group, before anything is removed: how many of the entries about to be removed (the
-- oldest `remove` ones) it was never delivered. Groups whose lag Redis does not know are
-- left for below (unknown).
local groups, unknown = {}, {}
for _, raw in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local g = fields(raw)
  g = {name = g['name'], last = g['last-delivered-id'], pending = g['pending'], lag = g['lag'], lost = 0}
  if idcmp(g.last, oldfirst) < 0 then
    g.lost = remove
  elseif idcmp(g.last, last) >= 0 then
    g.lost = 0
  elseif g.lag and g.lag < len then
    g.lost = math.max(0, g.lag - keep)
  else
    table.insert(unknown, g)
  end
  table.insert(groups, g)
end

-- The groups without a lag, by ascending last-delivered-id: the entries up to a group's id
-- that are to be removed are removed first, whole nodes at a time (XTRIM MINID ~ to the id's
-- successor, LIMIT the entries still to remove), which counts them without reading them; the
-- few left up to the id (in the node that holds it, or past the LIMIT) are counted with
-- XRANGE. The group was delivered every entry up to its id, so it lost the removed entries
-- beyond them. Every entry removed here is among the oldest `remove`.
table.sort(unknown, function(a, b) return idcmp(a.last, b.last) < 0 end)
local removed = 0
for _, g in ipairs(unknown) do
  if remove - removed > 0 then
    removed = removed + redis.call('XTRIM', KEYS[1], 'MINID', '~', successor(g.last), 'LIMIT', remove - removed)
  end
  local upto = removed
  if remove - upto > 0 then
    upto = upto + #redis.call('XRANGE', KEYS[1], '-', g.last, 'COUNT', remove - upto)
  end
  g.lost = remove - upto
end

removed = removed + redis.call('XTRIM', KEYS[1], 'MAXLEN', '=', keep)
local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)[1][1]

local out = {removed, keep - maxlen, first}
for _, g in ipairs(groups) do
  -- Pending entries among the removed ones: PEL ids in [oldfirst, first).
  if g.pending > 0 then
    local summary = redis.call('XPENDING', KEYS[1], g.name)
    if idcmp(summary[3], oldfirst) >= 0 and idcmp(summary[2], first) < 0 then
      local start = oldfirst
      while true do
        local page = redis.call('XPENDING', KEYS[1], g.name, start, '(' .. first, 1000)
        g.lost = g.lost + #page
        if #page < 1000 then
          break
        end
        start = '(' .. page[#page][1]
      end
    end
  end
  if idcmp(g.last, first) < 0 and idcmp(maxdeleted, first) < 0 then
    redis.call('XGROUP', 'SETID', KEYS[1], g.name, g.last, 'ENTRIESREAD', added - keep)
  end
  if g.lost > 0 then
    table.insert(out, g.name)
    table.insert(out, g.lost)
  end
end
return out
