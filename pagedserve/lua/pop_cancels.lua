-- Drains a worker's cancel set atomically.
-- KEYS: cancel set
-- Returns {job ids} (wrapped, so an empty set still answers a list).
local m = redis.call('SMEMBERS', KEYS[1])
redis.call('DEL', KEYS[1])
return {m}
