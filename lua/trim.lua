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

-- Stream ids are two unsigned 64-bit decimals; Lua numbers are doubles, so ids are
-- compared and incremented as strings.
local function split(id)
  return string.match(id, '^(%d+)-(%d+)$')
end

local function numcmp(a, b)
  if #a ~= #b then
    return #a < #b and -1 or 1
  end
  if a == b then
    return 0
  end
  return a < b and -1 or 1
end

local function idcmp(a, b)
  local ams, aseq = split(a)
  local bms, bseq = split(b)
  local c = numcmp(ams, bms)
  if c ~= 0 then
    return c
  end
  return numcmp(aseq, bseq)
end

local function incr(s)
  local digits = {}
  for i = 1, #s do
    digits[i] = string.byte(s, i) - 48
  end
  local i = #digits
  while i >= 1 do
    if digits[i] < 9 then
      digits[i] = digits[i] + 1
      break
    end
    digits[i] = 0
    i = i - 1
  end
  local out = table.concat(digits)
  if i == 0 then
    out = '1' .. out
  end
  return out
end

local function successor(id)
  local ms, seq = split(id)
  if seq == '18446744073709551615' then
    return incr(ms) .. '-0'
  end
  return ms .. '-' .. incr(seq)
end

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
