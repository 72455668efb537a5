-- claim.lua: claim the lease of one job, or re-claim it as its current holder, and issue a
-- fencing token strictly greater than every token issued before for this job and than the
-- floor (the fence PostgreSQL holds), so a Redis that lost its counter never repeats one.
--
-- KEYS[1] -> <prefix>{<tag>}:lease   STRING  "<token>:<owner>"; expires with the lease (PX)
-- KEYS[2] -> <prefix>{<tag>}:fence   STRING  the last token issued for the job (PX ARGV[4])
-- --
-- ARGV[1] -> owner (string, non-empty)
-- ARGV[2] -> lease length (milliseconds, >= 1)
-- ARGV[3] -> floor: the job's fence in PostgreSQL (integer, >= 0)
-- ARGV[4] -> how long the token counter outlives its last claim (milliseconds, >= 1)
--
-- Returns
--   {1, token}              claimed (or re-claimed by the same owner) with a new token
--   {0, holder, remaining}  held by another owner; remaining lease in milliseconds
-- Expiry is on the Redis server's clock (PX), never the caller's.
--
-- Commands: MGET, SET NX PX, SET PX (a claim: lease, then counter); MGET, PTTL (held). The
-- lease was a HASH {owner, token} written with HSET + PEXPIRE, and read apart from the
-- counter: six commands per claim. As one STRING "<token>:<owner>" it is read with the
-- counter in one MGET and written and timed by one SET.
--
-- Rolling deploy. The lease key keeps its name across the HASH -> STRING change, so old and
-- new workers see each other's leases and never both hold one:
--   * Here, MGET reads an older worker's HASH lease as nil, but the SET NX that takes a
--     free lease finds the key taken, writes nothing, and the holder is read with HGET: that
--     lease is held as any other (and the same owner's is replaced). The check costs nothing
--     while the lease is a STRING or free; SET NX is the write the claim makes anyway.
--   * An older script's first command on a STRING lease (HGET in its claim, HMGET in its
--     renew and release) fails with WRONGTYPE before it writes anything: its claim fails
--     (the runner retries the delivery later), its renew or release fails (it had lost
--     that lease: the keeper gives it up at its deadline).
--   * The fence counter keeps its name, type and meaning in both versions, so tokens stay
--     strictly increasing whichever version issues them.
local cur = redis.call("MGET", KEYS[1], KEYS[2])
local lease = cur[1]
if lease then
  local holder = string.match(lease, "^%d+:(.*)$") or lease
  if holder ~= ARGV[1] then
    return {0, holder, redis.call("PTTL", KEYS[1])}
  end
end
local last = tonumber(cur[2] or "0")
local floor = tonumber(ARGV[3])
if last < floor then
  last = floor
end
local token = string.format("%d", last + 1)
local value = token .. ":" .. ARGV[1]
if lease then
  -- The holder re-claims: a new token, the lease restarts.
  redis.call("SET", KEYS[1], value, "PX", ARGV[2])
elseif not redis.call("SET", KEYS[1], value, "NX", "PX", ARGV[2]) then
  -- The key exists though MGET read nil: an older worker's HASH lease (rolling deploy, see
  -- above); any other type errors in HGET.
  local holder = redis.call("HGET", KEYS[1], "owner")
  if holder and holder ~= ARGV[1] then
    return {0, holder, redis.call("PTTL", KEYS[1])}
  end
  -- SET replaces the key whatever its type: the same owner's HASH lease becomes a STRING.
  redis.call("SET", KEYS[1], value, "PX", ARGV[2])
end
redis.call("SET", KEYS[2], token, "PX", ARGV[4])
return {1, tonumber(token)}
