-- lib/streamids.lua: stream id arithmetic for the scripts that compare or step through stream
-- ids (lua/trim.lua, store/outbox/cap.lua). It is prepended to their source
-- (lua.StreamIDFuncs); it defines local functions only and touches no key.
--
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

