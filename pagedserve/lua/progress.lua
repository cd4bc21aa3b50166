-- A fenced progress update: token count and a delta event on the job's (capped) events stream.
-- The event is written first, so that an events key of the wrong type fails the call before it
-- changed anything.
-- KEYS: job hash, events stream
-- ARGV: fence, tokens generated, completion index, delta text, delta token ids JSON, maxlen
-- Returns 1 written | 0 refused (lease lost).
local job, events = KEYS[1], KEYS[2]
if not holds(job, ARGV[1]) then
  return 0
end
redis.call('XADD', events, 'MAXLEN', '~', ARGV[6], '*', 'type', 'delta', 'index', ARGV[3],
  'text', ARGV[4], 'token_ids', ARGV[5], 'tokens', ARGV[2])
redis.call('HSET', job, 'tokens_generated', ARGV[2])
redis.call('HSETNX', job, 'first_token_at', now_s())
return 1
