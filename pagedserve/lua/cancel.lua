-- A client's cancel: a queued job is cancelled at once (a worker skips its entry at claim); a
-- running job becomes 'cancelling' and goes into its owner's cancel set.
-- KEYS: job hash, events stream
-- ARGV: cancel-set key prefix, retention s, events maxlen
-- Returns the job's status after the call, or 'not_found'.
local job, events = KEYS[1], KEYS[2]
local cur = redis.call('HMGET', job, 'status', 'worker', 'id')
local status = cur[1]
if not status then
  return 'not_found'
end
if status == 'queued' then
  finish(job, events, 'cancelled', ARGV[2], ARGV[3])
  return 'cancelled'
end
if status == 'running' then
  redis.call('HSET', job, 'status', 'cancelling')
  local set = ARGV[1] .. cur[2]
  redis.call('SADD', set, cur[3])
  redis.call('EXPIRE', set, ARGV[2])
  return 'cancelling'
end
return status
