-- A fenced progress update: token count and a delta event on the job's (capped) events stream.
-- The event is written first, so that an events key of the wrong type fails the call before it
-- changed anything.
-- KEYS: job hash, events stream
-- ARGV: fence, tokens generated, completion index, delta text, delta token ids JSON, maxlen,
--       end (the completion's tokens + characters published once this delta is, or 0)
-- With an end, a delta this lease already wrote (one of a pipeline sent again after its reply
-- was lost with the connection) is skipped: the job hash keeps 'pub:<index>' = '<fence>:<end>'.
-- Returns 1 written (or already) | 0 refused (lease lost).
local job, events = KEYS[1], KEYS[2]
if not holds(job, ARGV[1]) then
  return 0
end
local done = 'pub:' .. ARGV[3]
local upto = tonumber(ARGV[7] or '0')
if upto > 0 then
  local seen = redis.call('HGET', job, done)
  if seen then
    local fence, prev = string.match(seen, '^(%d+):(%d+)$')
    if fence == ARGV[1] and tonumber(prev) >= upto then
      return 1
    end
  end
end
redis.call('XADD', events, 'MAXLEN', '~', ARGV[6], '*', 'type', 'delta', 'index', ARGV[3],
  'text', ARGV[4], 'token_ids', ARGV[5], 'tokens', ARGV[2])
redis.call('HSET', job, 'tokens_generated', ARGV[2])
if upto > 0 then
  redis.call('HSET', job, done, ARGV[1] .. ':' .. ARGV[7])
end
redis.call('HSETNX', job, 'first_token_at', now_s())
return 1
