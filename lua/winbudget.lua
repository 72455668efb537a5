-- winbudget.lua: the money budget of one kind × collection window, shared by a fleet.
-- Every attempt of a budgeted kind reserves, before it starts, what it is expected to cost
-- (or its byte cap at its exit's price); one that reaches what it reserved asks for more
-- ("topup") or stops; what it really cost replaces the reservation when its record is
-- written ("settle"). So what the window spends does not pass its budget: an attempt is
-- capped at what it reserved, and nothing is reserved past the budget.
--
-- KEYS[1] -> <prefix>{budget:<kind>/<window>}  HASH
--              spent      integer micro-units the window's finished attempts cost
--              r:<owner>  "<micro-units> <deadline ms>": one in-flight attempt's reservation
--              l:<owner>  "<micro-units> <lapsed at ms>": a reservation that lapsed (its
--                         worker was killed, or never settled by its deadline) and was
--                         charged in full to spent; its settlement, if it ever comes,
--                         charges the difference (dropped after keep ms)
-- The hash exists only with its spent field. A hash without it — Redis lost its data, or the
-- key expired after ARGV[last] ms unused — is restored from PostgreSQL by the caller
-- ("restore"), which is the system of record for what attempts cost.
--
-- ARGV[1] -> operation: "reserve", "settle", "restore", "topup" or "add"
-- reserve: ARGV[2] -> budget; ARGV[3] -> wanted (micro-units, > 0); ARGV[4] -> owner;
--          ARGV[5] -> hold (ms: the reservation lapses then, if its worker never settles);
--          ARGV[6] -> keep (ms the key lives unused)
-- settle:  ARGV[2] -> owner; ARGV[3] -> cost (micro-units, >= 0); ARGV[4] -> keep
-- restore: ARGV[2] -> spent (from PostgreSQL); ARGV[3] -> keep
-- add:     ARGV[2] -> amount (micro-units, >= 0); ARGV[3] -> keep
-- topup:   ARGV[2] -> owner; ARGV[3] -> budget; ARGV[4] -> more (micro-units, > 0);
--          ARGV[5] -> keep; ARGV[6] -> held (micro-units, > 0: what the attempt says it
--          holds, its top-ups included); ARGV[7] -> hold (ms left until its reservation
--          lapses, as at reserve)
--
-- Returns
--   reserve: {1, granted, spent, reserved}  reserved: granted = wanted, or what is left of
--                                           the budget when nothing else is reserved
--            {2, 0, spent, reserved}        wait: the rest of the budget is reserved by
--                                           attempts in flight; settlements may give some back
--            {0, 0, spent, reserved}        spent: nothing is left (spent >= budget)
--            {-1, 0, 0, 0}                  unknown: restore first
--   settle:  spent after adding the cost (the reservation goes; a lapsed one, charged
--            already, is replaced by the cost), or -1 if the hash is unknown (the cost is
--            in PostgreSQL already: the restore counts it)
--   restore: {spent, set}: the spent amount Redis holds (another worker's restore, if it
--            came first: set 0), set 1 if this restore set it
--   add:     spent after adding amount, or -1 if the hash is unknown: the restorer's
--            catch-up, what PostgreSQL recorded between its read and its restore
--   topup:   {granted, spent, reserved}: an attempt that outgrew its reservation asks for
--            more; granted is more, or what is left of the budget (0: nothing), added to its
--            reservation (to its charge if it lapsed meanwhile); {-1, 0, 0} if the hash is
--            unknown; {-2, spent, reserved} if owner's reservation is unknown (Redis lost
--            it and a restore came since: see below) and the window, its held amount
--            counted, has no room for more
-- A reservation that lapses is charged, not given back: its attempt may have spent up to
-- it (a killed worker's proxy traffic is billed all the same), and the attempt's row in
-- PostgreSQL, written as lost by whoever takes the job over, carries the same amount.
-- Commands: TIME, HGETALL, HSET, PEXPIRE (reserve; HDEL, HINCRBY, HSET per lapsed
-- reservation, HDEL per old lapse); HEXISTS, HGET, HDEL, HINCRBY, PEXPIRE (settle);
-- HSETNX, HGET, PEXPIRE (restore); HGETALL, HSET, HINCRBY, PEXPIRE (topup; TIME when the
-- reservation is re-created); HEXISTS, HINCRBY, PEXPIRE (add).
local op = ARGV[1]
if op == "settle" then
  if redis.call("HEXISTS", KEYS[1], "spent") == 0 then
    return -1
  end
  local cost = tonumber(ARGV[3])
  if redis.call("HDEL", KEYS[1], "r:" .. ARGV[2]) == 0 then
    local lapsed = redis.call("HGET", KEYS[1], "l:" .. ARGV[2])
    if lapsed then
      -- Charged in full when it lapsed: the real cost replaces that charge.
      cost = cost - tonumber(string.sub(lapsed, 1, string.find(lapsed, " ", 1, true) - 1))
      redis.call("HDEL", KEYS[1], "l:" .. ARGV[2])
    end
  end
  local spent = redis.call("HINCRBY", KEYS[1], "spent", cost)
  redis.call("PEXPIRE", KEYS[1], ARGV[4])
  return spent
elseif op == "restore" then
  local set = redis.call("HSETNX", KEYS[1], "spent", ARGV[2])
  redis.call("PEXPIRE", KEYS[1], ARGV[3])
  return {tonumber(redis.call("HGET", KEYS[1], "spent")), set}
elseif op == "add" then
  if redis.call("HEXISTS", KEYS[1], "spent") == 0 then
    return -1
  end
  local spent = redis.call("HINCRBY", KEYS[1], "spent", ARGV[2])
  redis.call("PEXPIRE", KEYS[1], ARGV[3])
  return spent
elseif op == "topup" then
  local all = redis.call("HGETALL", KEYS[1])
  local spent, reserved, mine, lapsed
  for i = 1, #all, 2 do
    local f, v = all[i], all[i + 1]
    if f == "spent" then
      spent = tonumber(v)
    elseif string.sub(f, 1, 2) == "r:" then
      local sp = string.find(v, " ", 1, true)
      reserved = (reserved or 0) + tonumber(string.sub(v, 1, sp - 1))
      if f == "r:" .. ARGV[2] then
        mine = {tonumber(string.sub(v, 1, sp - 1)), string.sub(v, sp + 1)}
      end
    elseif f == "l:" .. ARGV[2] then
      local sp = string.find(v, " ", 1, true)
      lapsed = {tonumber(string.sub(v, 1, sp - 1)), string.sub(v, sp + 1)}
    end
  end
  reserved = reserved or 0
  if spent == nil then
    return {-1, 0, 0}
  end
  if mine == nil and lapsed == nil then
    -- The window is known but owner's reservation is not: Redis lost the hash while the
    -- attempt ran and another worker's reservation restored spent from PostgreSQL, which
    -- records finished attempts only. (A running attempt's own top-up never follows its
    -- settlement, and a lapse leaves l:<owner>.) This is not "nothing left": answering 0
    -- failed the attempt for good as budget_exceeded with the window nearly unspent.
    -- Decision: re-create the reservation from what the attempt says it holds (ARGV[6]),
    -- held until its deadline as at reserve. That puts back what Redis lost — the money the
    -- attempt may have spent already is real whatever the window has left — so its
    -- settlement replaces it by the cost, and a lapse charges it, as its lost row in
    -- PostgreSQL does (the row records the same reservation). Then the top-up is granted
    -- what the window has left beyond it; with no room left, it answers -2, "unknown
    -- reservation", which the caller retries as internal (never budget_exceeded): the next
    -- delivery's reservation says whether the window is spent, on a total that counts
    -- this attempt's cost.
    local held = tonumber(ARGV[6])
    local t = redis.call("TIME")
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local granted = math.min(tonumber(ARGV[4]), tonumber(ARGV[3]) - spent - reserved - held)
    if granted <= 0 then
      granted = 0
    end
    redis.call("HSET", KEYS[1], "r:" .. ARGV[2], string.format("%d %d", held + granted, now + tonumber(ARGV[7])))
    redis.call("PEXPIRE", KEYS[1], ARGV[5])
    if granted == 0 then
      return {-2, spent, reserved}
    end
    return {granted, spent, reserved}
  end
  local granted = math.min(tonumber(ARGV[4]), tonumber(ARGV[3]) - spent - reserved)
  if granted <= 0 then
    return {0, spent, reserved}
  end
  if mine then
    redis.call("HSET", KEYS[1], "r:" .. ARGV[2], string.format("%d %s", mine[1] + granted, mine[2]))
  else
    -- It lapsed (charged in full) while its attempt ran on: the top-up is charged too.
    redis.call("HSET", KEYS[1], "l:" .. ARGV[2], string.format("%d %s", lapsed[1] + granted, lapsed[2]))
    spent = redis.call("HINCRBY", KEYS[1], "spent", granted)
  end
  redis.call("PEXPIRE", KEYS[1], ARGV[5])
  return {granted, spent, reserved}
elseif op ~= "reserve" then
  return redis.error_reply("winbudget: unknown operation " .. tostring(op))
end

local budget = tonumber(ARGV[2])
local wanted = tonumber(ARGV[3])
local t = redis.call("TIME")
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local all = redis.call("HGETALL", KEYS[1])
local spent
local reserved = 0
local charged = 0
local lapsed = {}
for i = 1, #all, 2 do
  local f, v = all[i], all[i + 1]
  if f == "spent" then
    spent = tonumber(v)
  elseif string.sub(f, 1, 2) == "r:" then
    local sp = string.find(v, " ", 1, true)
    local amount, deadline = tonumber(string.sub(v, 1, sp - 1)), tonumber(string.sub(v, sp + 1))
    if deadline <= now then
      -- Its worker died (or never settled by its deadline): the reservation lapses and
      -- is charged in full, the most its attempt may have cost.
      charged = charged + amount
      lapsed[#lapsed + 1] = {f, amount}
    else
      reserved = reserved + amount
    end
  elseif string.sub(f, 1, 2) == "l:" then
    local sp = string.find(v, " ", 1, true)
    if tonumber(string.sub(v, sp + 1)) + tonumber(ARGV[6]) <= now then
      redis.call("HDEL", KEYS[1], f) -- no settlement comes this late
    end
  end
end
if spent == nil then
  -- Unknown: the restore reads PostgreSQL, where lost attempts carry their reservations.
  for _, l in ipairs(lapsed) do
    redis.call("HDEL", KEYS[1], l[1])
  end
  return {-1, 0, 0, 0}
end
for _, l in ipairs(lapsed) do
  redis.call("HDEL", KEYS[1], l[1])
  redis.call("HSET", KEYS[1], "l:" .. string.sub(l[1], 3), string.format("%d %d", l[2], now))
end
if charged > 0 then
  spent = redis.call("HINCRBY", KEYS[1], "spent", charged)
end
if spent >= budget then
  return {0, 0, spent, reserved}
end
local left = budget - spent - reserved
local granted = wanted
if left < wanted then
  if reserved > 0 then
    return {2, 0, spent, reserved}
  end
  granted = left
end
redis.call("HSET", KEYS[1], "r:" .. ARGV[4], string.format("%d %d", granted, now + tonumber(ARGV[5])))
redis.call("PEXPIRE", KEYS[1], ARGV[6])
return {1, granted, spent, reserved}
