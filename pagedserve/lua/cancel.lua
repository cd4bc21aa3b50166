-- A client's cancel: a queued job is cancelled at once (a worker skips its entry at claim); a
-- running job becomes 'cancelling' and goes into its owner's cancel set.
-- KEYS: job hash, events stream
-- ARGV: cancel-set key prefix, retention s, events maxlen
-- Returns {status after the call (or 'not_found'), 1 if the job ended here else 0,
-- <batch fields>} (see lease.lua): pagedserve.store then adds a batch job's line.
local job, events = KEYS[1], KEYS[2]
local cur = redis.call('HMGET', job, 'status', 'worker', 'id')
local status = cur[1]
if not status then
  return {'not_found', 0}
end
local b = batch_fields(job)
if status == 'queued' then
  finish(job, events, 'cancelled', ARGV[2], ARGV[3])
  return {'cancelled', 1, b[1], b[2], b[3], b[4]}
end
if status == 'running' then
  redis.call('HSET', job, 'status', 'cancelling')
  local set = ARGV[1] .. cur[2]
  redis.call('SADD', set, cur[3])
  redis.call('EXPIRE', set, ARGV[2])
  status = 'cancelling'
end
return {status, 0, b[1], b[2], b[3], b[4]}
