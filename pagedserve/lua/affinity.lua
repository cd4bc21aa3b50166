-- Refreshes and drops a worker's prefix affinities (its heartbeat).
-- KEYS: affinity hash, affinity expiry zset
-- ARGV: worker, ttl ms, number of signatures to keep, keep..., drop...
-- A kept signature's affinity lasts ttl ms more, a dropped one is removed: both only while this
-- worker is its owner. Returns the kept signatures now owned by another worker (handed over).
-- One HMGET of every signature, then one ZADD / HDEL / ZREM each (chunked): a worker keeps
-- hundreds of groups when its jobs share no prefix, and a command per signature made this
-- beat a third of its Redis commands (bench.redis_cost).
local aff, exp = KEYS[1], KEYS[2]
local me, ttl, nkeep = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms()
local sigs = {}
for i = 4, #ARGV do sigs[#sigs + 1] = ARGV[i] end
local owners = call_chunked('HMGET', aff, {}, sigs)
local lost, extend, drop = {}, {}, {}
for k, sig in ipairs(sigs) do
  local owner = affinity_of(owners[k])
  if owner == me then
    if k <= nkeep then
      extend[#extend + 1] = now + ttl
      extend[#extend + 1] = sig
    else
      drop[#drop + 1] = sig
    end
  elseif k <= nkeep and owner ~= nil then
    lost[#lost + 1] = sig
  end
end
if #extend > 0 then call_chunked('ZADD', exp, {}, extend) end
if #drop > 0 then
  call_chunked('HDEL', aff, {}, drop)
  call_chunked('ZREM', exp, {}, drop)
end
return lost
