-- A fenced final write by the lease holder: succeeded (with result), failed (with error) or
-- cancelled; then XACK. For a job of a batch (KEYS 5-8 given) it also appends the job's output or
-- error line (built by pagedserve.store) and counts it, atomically with the write: see
-- add_batch_line (membership is checked against the batch's own members set).
-- KEYS: job hash, priority stream, events stream, idempotency key (the lease's; the job hash
--       for none: see idem_matches)[, batch hash, members set, counted set, line list]
-- ARGV: fence, group, final status, result JSON or '', error or '', tokens generated or '',
--       retention s, events maxlen[, job id, batch id, line, counter field]
-- Returns {1, status} | {0, 'stale' | 'missing'} | an error (not the job's idempotency key).
local job, stream, events, idem = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local ok, why = holds(job, ARGV[1])
if not ok then
  return {0, why}
end
if not idem_matches(job, idem) then
  return idem_error(job)
end
if #KEYS >= 8 then
  local err = check_batch_keys(KEYS[5], KEYS[6], KEYS[7], KEYS[8])
  if err then
    return err
  end
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
finish(job, events, idem, ARGV[3], ARGV[7], ARGV[8])
redis.call('XACK', stream, ARGV[2], entry)
if #KEYS >= 8 then
  add_batch_line(job, ARGV[9], ARGV[10], KEYS[5], KEYS[6], KEYS[7], KEYS[8], ARGV[11], ARGV[12],
    false)
end
return {1, ARGV[3]}
