-- hostlimit.lua: reserve the next send slot of one destination host under a fleet-wide
-- GCRA (generic cell rate algorithm) limit and honour the host's shared "not before"
-- (set by hostpause.lua after a 429/503 with Retry-After). Every worker calls it before
-- every request to the host: one round trip per request.
--
-- KEYS[1] -> <prefix>{host:<host>}:tat        STRING  theoretical arrival time (server µs)
-- KEYS[2] -> <prefix>{host:<host>}:notbefore  STRING  server µs before which nothing is sent
-- --
-- ARGV[1] -> emission interval: 1/rate (microseconds, >= 0; 0 = unpaced, only not-before)
-- ARGV[2] -> burst (requests sent back to back at most, integer >= 1)
-- ARGV[3] -> longest wait the caller accepts (microseconds, >= 0)
--
-- Returns
--   {1, wait}  a slot is reserved: send after wait microseconds (0 = now)
--   {0, wait}  nothing reserved: the earliest slot is wait microseconds away, more than
--              ARGV[3] (the caller gives up instead of holding its job that long)
-- Time is the Redis server's (TIME), never the caller's.
-- Commands: TIME, MGET, SET (paced, reserved); TIME, MGET (paced, refused); TIME, GET
-- (unpaced).
local t = redis.call("TIME")
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = tonumber(ARGV[1])
local tolerance = interval * (tonumber(ARGV[2]) - 1)
local maxwait = tonumber(ARGV[3])

-- Unpaced callers (interval 0) only look at the pause: the bucket's reservations are not
-- theirs to wait for.
local tat = now
local at = now
local nb
if interval > 0 then
  -- One MGET reads the bucket and the pause (was two GETs).
  local cur = redis.call("MGET", KEYS[1], KEYS[2])
  tat = tonumber(cur[1] or "0")
  nb = tonumber(cur[2] or "0")
  if tat < now then
    tat = now
  end
  at = tat - tolerance
  if at < now then
    at = now
  end
else
  nb = tonumber(redis.call("GET", KEYS[2]) or "0")
end
if at < nb then
  at = nb
end
local wait = at - now
if wait > maxwait then
  return {0, wait}
end
if interval > 0 then
  local newtat = tat
  if at > newtat then
    newtat = at
  end
  newtat = newtat + interval
  -- Keep the key as long as it holds back anyone, plus a second.
  redis.call("SET", KEYS[1], string.format("%d", newtat), "PX", math.floor((newtat - now) / 1000) + 1000)
end
return {1, wait}
