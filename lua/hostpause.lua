-- hostpause.lua: hold every worker's requests to one destination host back until now +
-- pause (a 429/503 with Retry-After), on the Redis server's clock. A later pause never
-- shortens an earlier, longer one.
--
-- KEYS[1] -> <prefix>{host:<host>}:notbefore  STRING  server µs before which nothing is sent
-- --
-- ARGV[1] -> pause (milliseconds, >= 1)
--
-- Returns
--   1  the host's not-before moved later
--   0  an existing, later not-before was kept
local t = redis.call("TIME")
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local pause = tonumber(ARGV[1])
local until_ = now + pause * 1000
local nb = tonumber(redis.call("GET", KEYS[1]) or "0")
if nb >= until_ then
  return 0
end
redis.call("SET", KEYS[1], string.format("%d", until_), "PX", pause)
return 1
