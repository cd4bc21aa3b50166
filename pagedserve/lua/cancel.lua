-- A client's cancel: a queued job is cancelled at once (a worker skips its entry at claim); a
-- running job becomes 'cancelling' and goes into its owner's cancel set.
-- KEYS: job hash, events stream, the cancel set of the owner the caller read (any key of the
--       job's slot when it read none), the idempotency key it read (the job hash for none)
-- ARGV: that owner ('' for none), retention s, events maxlen
-- The owner and the idempotency key (expired when the job ends here) are read before the call so
-- that the script declares every key it touches; a running job whose owner is another, or a job
-- whose idempotency key is not the one given, answers 'moved' (nothing changed): read them again
-- and retry.
-- Returns {status after the call (or 'not_found' | 'moved'), 1 if the job ended here else 0,
-- <batch fields>} (see lease.lua): pagedserve.store then adds a batch job's line.
local job, events, idem = KEYS[1], KEYS[2], KEYS[4]
local cur = redis.call('HMGET', job, 'status', 'worker', 'id')
local status = cur[1]
if not status then
  return {'not_found', 0}
end
if not idem_matches(job, idem) then
  return {'moved', 0}
end
local b = batch_fields(job)
if status == 'queued' then
  finish(job, events, idem, 'cancelled', ARGV[2], ARGV[3])
  return {'cancelled', 1, b[1], b[2], b[3], b[4]}
end
if status == 'running' then
  if cur[2] ~= ARGV[1] then
    return {'moved', 0}
  end
  redis.call('HSET', job, 'status', 'cancelling')
  redis.call('SADD', KEYS[3], cur[3])
  redis.call('EXPIRE', KEYS[3], ARGV[2])
  status = 'cancelling'
end
return {status, 0, b[1], b[2], b[3], b[4]}
