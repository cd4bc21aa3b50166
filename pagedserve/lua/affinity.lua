-- Refreshes and drops a worker's prefix affinities (its heartbeat).
-- KEYS: affinity hash, affinity expiry zset
-- ARGV: worker, ttl ms, number of signatures to keep, keep..., drop...
-- A kept signature's affinity lasts ttl ms more, a dropped one is removed: both only while this
-- worker is its owner. Returns the kept signatures now owned by another worker (handed over).
local aff, exp = KEYS[1], KEYS[2]
local me, ttl, nkeep = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms()
local lost = {}
for i = 4, #ARGV do
  local sig = ARGV[i]
  local owner = affinity_of(redis.call('HGET', aff, sig))
  if owner == me then
    if i < 4 + nkeep then
      redis.call('ZADD', exp, now + ttl, sig)
    else
      redis.call('HDEL', aff, sig)
      redis.call('ZREM', exp, sig)
    end
  elseif i < 4 + nkeep and owner ~= nil then
    lost[#lost + 1] = sig
  end
end
return lost
