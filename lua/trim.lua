-- trim.lua: trim an outbox stream to the entries some consumer group still needs, and
-- nothing more: remove only entries that every group has delivered and acknowledged.
-- The floor is the smallest, over every consumer group of the stream, of
--   * the group's oldest pending id (delivered, not acknowledged), and
--   * the id right after the group's last-delivered-id (the first entry not delivered);
-- the stream is trimmed with XTRIM MINID = <floor> (exact). Reading the groups and trimming
-- happen in one script, so no group can appear or move between the two.
--
-- KEYS[1] -> <prefix>stream:<topic>   STREAM  the outbox stream (its name may carry a hash tag)
-- --
-- (no ARGV)
--
-- Returns
--   {n, "<ms>-<seq>"}  n entries below the floor were removed (n may be 0)
--   {0, ""}            the stream does not exist or has no consumer group: nothing removed

if redis.call('TYPE', KEYS[1])['ok'] ~= 'stream' then
  return {0, ''}
end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
if #groups == 0 then
  return {0, ''}
end

-- split, numcmp, idcmp, incr, successor: lua/lib/streamids.lua, prepended to this script.

local floor = nil
local function lower(id)
  if floor == nil or idcmp(id, floor) < 0 then
    floor = id
  end
end

for _, g in ipairs(groups) do
  local name, pending, last
  for i = 1, #g, 2 do
    if g[i] == 'name' then
      name = g[i + 1]
    elseif g[i] == 'pending' then
      pending = g[i + 1]
    elseif g[i] == 'last-delivered-id' then
      last = g[i + 1]
    end
  end
  lower(successor(last))
  if pending > 0 then
    local summary = redis.call('XPENDING', KEYS[1], name)
    lower(summary[2])
  end
end

local trimmed = redis.call('XTRIM', KEYS[1], 'MINID', '=', floor)
return {trimmed, floor}
