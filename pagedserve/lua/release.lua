-- Hands a running job back to the queue (worker drain): a fresh stream entry at the tail, the old
-- one acked, the lease revoked. The delivery does not count against max deliveries.
-- A job being cancelled is cancelled instead.
-- KEYS: job hash, priority stream, events stream, idempotency key (the lease's; the job hash
--       for none: see idem_matches)
-- ARGV: fence, group, job id, retention s, events maxlen
-- Returns {'queued' | 'cancelled' | 'stale' | 'missing', <batch fields>} (see lease.lua), or an
-- error (not the job's idempotency key: nothing changed).
local job, stream, events, idem = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local ok, status = holds(job, ARGV[1])
if not ok then
  return {status}
end
if not idem_matches(job, idem) then
  return idem_error(job)
end
local b = batch_fields(job)
local old = redis.call('HGET', job, 'entry')
if status == 'cancelling' then
  finish(job, events, idem, 'cancelled', ARGV[4], ARGV[5])
  redis.call('XACK', stream, ARGV[2], old)
  return {'cancelled', b[1], b[2], b[3], b[4]}
end
local sig = redis.call('HGET', job, 'prefix_sig')
local entry
if sig then  -- the new entry keeps the job's prefix group (admission.lua)
  entry = redis.call('XADD', stream, '*', 'job', ARGV[3], 'sig', sig)
else
  entry = redis.call('XADD', stream, '*', 'job', ARGV[3])
end
redis.call('XACK', stream, ARGV[2], old)
redis.call('HSET', job, 'status', 'queued', 'entry', entry, 'tokens_generated', 0)
redis.call('HDEL', job, 'worker', 'lease_expiry', 'started_at', 'first_token_at')
redis.call('HINCRBY', job, 'deliveries', -1)
redis.call('HINCRBY', job, 'fence', 1)
local rid = redis.pcall('XADD', events, 'MAXLEN', '~', ARGV[5], '*', 'type', 'restart')
if type(rid) == 'string' then
  redis.call('XTRIM', events, 'MINID', rid)
end
return {'queued'}
