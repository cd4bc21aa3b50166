-- A fenced final write by the lease holder: succeeded (with result), failed (with error) or
-- cancelled; then XACK. For a job of a batch (KEYS 4-6 given), also appends the job's output or
-- error line to the batch and counts it, once per job (the counted set), if the batch still exists.
-- KEYS: job hash, priority stream, events stream[, batch hash, batch line list, counted set]
-- ARGV: fence, group, final status, result JSON or '', error or '', tokens generated or '',
--       retention s, events maxlen[, batch line, counter field, job id]
-- Returns {1, status} | {0, 'stale' | 'missing'}.
local job, stream, events = KEYS[1], KEYS[2], KEYS[3]
local ok, why = holds(job, ARGV[1])
if not ok then
  return {0, why}
end
if ARGV[4] ~= '' then
  redis.call('HSET', job, 'result', ARGV[4])
end
if ARGV[5] ~= '' then
  redis.call('HSET', job, 'error', ARGV[5])
end
if ARGV[6] ~= '' then
  redis.call('HSET', job, 'tokens_generated', ARGV[6])
end
local entry = redis.call('HGET', job, 'entry')
finish(job, events, ARGV[3], ARGV[7], ARGV[8])
redis.call('XACK', stream, ARGV[2], entry)
if #KEYS >= 6 and redis.call('EXISTS', KEYS[4]) == 1 then
  if redis.call('SADD', KEYS[6], ARGV[11]) == 1 then
    redis.call('RPUSH', KEYS[5], ARGV[9])
    redis.call('HINCRBY', KEYS[4], ARGV[10], 1)
  end
end
return {1, ARGV[3]}
