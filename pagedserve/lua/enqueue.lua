-- KEYS: job hash, priority stream, idempotency key (ignored unless ARGV[4] == '1')
--       [, the batch's members set (not on a Redis Cluster: the fan-out adds members apart)]
-- ARGV: job id, request JSON, priority, has idempotency key ('1' / '0'), prefix signature ('' for
--       none: pagedserve.prefix_sig) [, batch id, custom id, batch url, batch model]
-- The signature goes into the stream entry too, so that admission.lua reads it from the entries it
-- scans without touching job records.
-- A job of a batch (ARGV 6-9 given) gets the server-owned batch fields in its record and, with
-- KEYS[4], joins the batch's members set in the same step, so that no client-written value ever
-- names a batch.
-- Returns {job id, 1 if created / 0 if the idempotency key named an existing job}.
local job, stream, idem = KEYS[1], KEYS[2], KEYS[3]
if ARGV[4] == '1' then
  local existing = redis.call('GET', idem)
  if existing then
    return {existing, 0}
  end
  redis.call('SET', idem, ARGV[1])
end
local entry
if ARGV[5] ~= '' then
  entry = redis.call('XADD', stream, '*', 'job', ARGV[1], 'sig', ARGV[5])
  redis.call('HSET', job, 'prefix_sig', ARGV[5])
else
  entry = redis.call('XADD', stream, '*', 'job', ARGV[1])
end
redis.call('HSET', job, 'id', ARGV[1], 'status', 'queued', 'request', ARGV[2],
  'priority', ARGV[3], 'created_at', now_s(), 'tokens_generated', 0, 'deliveries', 0,
  'fence', 0, 'entry', entry, 'stream', stream)
if ARGV[4] == '1' then
  redis.call('HSET', job, 'idem_key', idem)
end
if #ARGV >= 9 then
  redis.call('HSET', job, 'batch_id', ARGV[6], 'custom_id', ARGV[7], 'batch_url', ARGV[8],
    'batch_model', ARGV[9])
end
if #KEYS >= 4 then
  redis.call('SADD', KEYS[4], ARGV[1])
end
return {ARGV[1], 1}
