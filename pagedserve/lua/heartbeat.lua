-- A worker's heartbeat: its hash replaced by the given fields and the Redis time it was written
-- ('last_seen'), with a TTL, and its id scored by that time in the workers' set. One call, so the
-- worker does not first ask Redis for the time (a round trip of its own).
-- KEYS: the worker's hash, the workers' sorted set (both in the {w} slot on a cluster)
-- ARGV: ttl seconds, worker id, then field/value pairs (JSON values)
-- Returns 1.
local t = redis.call('TIME')
local hash = KEYS[1]
redis.call('DEL', hash)
local fields = {'last_seen', string.format('%d.%06d', tonumber(t[1]), tonumber(t[2]))}
for i = 3, #ARGV do fields[#fields + 1] = ARGV[i] end
call_chunked('HSET', hash, {}, fields)
redis.call('EXPIRE', hash, ARGV[1])
redis.call('ZADD', KEYS[2], t[1], ARGV[2])
return 1
