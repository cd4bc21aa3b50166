-- Leases one delivered stream entry to a consumer.
-- KEYS: job hash, priority stream, dead-letter stream, events stream, the job's idempotency key
--       (the job hash when the caller does not know it: see idem_matches)
-- ARGV: consumer, group, entry id, lease ms, max deliveries, retention s, events maxlen
-- Returns {'ok', fence, request JSON, deliveries, idempotency key ('' for none), created_at (''
-- if unknown), <batch fields>}
-- | {'skip', why, <batch fields>} | {'dead', reason, <batch fields>} | {'idem', idempotency key}:
-- the job would end here (cancelled, dead-lettered) but KEYS[5] is not its idempotency key, which
-- finish() expires; nothing changed, call again naming it (rare: most leases end nothing here); <batch fields>: batch_id, custom_id, batch_url,
-- batch_model of a batch job (nil otherwise), so that pagedserve.store adds the batch line of a
-- job that ends here (dead-lettered, or cancelled).
-- A job leased again after an earlier delivery (its worker died) gets a 'restart' event, and its
-- events stream loses the earlier run's deltas: followers start over instead of repeating text.
local job, stream, dead, events, idem = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local consumer, group, entry = ARGV[1], ARGV[2], ARGV[3]
local lease_ms, max_deliveries = tonumber(ARGV[4]), tonumber(ARGV[5])
local retention, maxlen = ARGV[6], ARGV[7]

local cur = redis.call('HMGET', job, 'status', 'entry', 'id', 'idem_key', 'deliveries')
local status = cur[1]
if not status then
  redis.call('XACK', stream, group, entry)
  return {'skip', 'missing'}
end
local b = batch_fields(job)
if is_terminal(status) then
  redis.call('XACK', stream, group, entry)
  return {'skip', status}
end
if cur[2] ~= entry then
  -- The job went back to the queue under a newer entry (release); this one is obsolete.
  redis.call('XACK', stream, group, entry)
  return {'skip', 'superseded'}
end
local ends = status == 'cancelling' or (tonumber(cur[5] or '0') or 0) + 1 > max_deliveries
if ends and not idem_matches(job, idem) then
  return {'idem', cur[4]}
end
if status == 'cancelling' then
  -- Its previous owner died between the cancel request and honouring it.
  finish(job, events, idem, 'cancelled', retention, maxlen)
  redis.call('XACK', stream, group, entry)
  return {'skip', 'cancelled', b[1], b[2], b[3], b[4]}
end

local deliveries = redis.call('HINCRBY', job, 'deliveries', 1)
if deliveries > max_deliveries then
  local reason = 'dead-lettered: delivered ' .. deliveries .. ' times (max ' .. max_deliveries .. ')'
  redis.call('HSET', job, 'error', reason)
  redis.call('HINCRBY', job, 'fence', 1)
  finish(job, events, idem, 'failed', retention, maxlen)
  redis.call('XADD', dead, '*', 'job', cur[3], 'stream', stream, 'entry', entry,
    'deliveries', deliveries, 'reason', reason)
  redis.call('XACK', stream, group, entry)
  return {'dead', reason, b[1], b[2], b[3], b[4]}
end

local fence = redis.call('HINCRBY', job, 'fence', 1)
-- Make sure the entry sits in this consumer's pending list (it may come from XAUTOCLAIM or an
-- old consumer), with its idle time reset.
redis.call('XCLAIM', stream, group, consumer, 0, entry, 'JUSTID')
redis.call('HSET', job, 'status', 'running', 'worker', consumer, 'lease_expiry', now_ms() + lease_ms)
redis.call('HSETNX', job, 'started_at', now_s())
if deliveries > 1 then
  local rid = redis.pcall('XADD', events, 'MAXLEN', '~', maxlen, '*', 'type', 'restart')
  if type(rid) == 'string' then
    redis.call('XTRIM', events, 'MINID', rid)
  end
end
return {'ok', fence, redis.call('HGET', job, 'request'), deliveries, cur[4] or '',
  redis.call('HGET', job, 'created_at') or '', b[1], b[2], b[3], b[4]}
