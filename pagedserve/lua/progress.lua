-- Fenced progress updates of one or more jobs, each in turn: per job its token count and a delta
-- event on its (capped) events stream. One call carries a whole step's deltas on a single Redis;
-- on a cluster, where jobs' keys lie in different slots, one call per job.
-- KEYS: per job, its job hash, events stream and watch key (3 keys a job)
-- ARGV: events maxlen, then per job 6 values: fence, tokens generated, completion index, delta
--       text, delta token ids JSON, end (the completion's tokens + characters published once this
--       delta is, or 0)
-- With an end, a delta this lease already wrote (one of a pipeline sent again after its reply was
-- lost with the connection) is skipped: the job hash keeps 'pub:<index>' = '<fence>:<end>'.
-- The event is written before the hash, so that an events key of the wrong type fails the job's
-- update before it changed anything.
-- Returns one reply a job, in order: 1 written (or already) | 2 the same, and a reader follows the
-- job's events (its watch key is set: the worker writes its progress at the streaming pace) |
-- 0 refused (lease lost) | the error Redis raised for that job (caught here: the other jobs'
-- updates go on).
local function progress_one(job, events, watch, fence, tokens, index, text, ids, maxlen, upto_s)
  local done = 'pub:' .. index
  -- the fence check, whether the job has its first token time, and this delta's mark: one read
  local ok, _, first_at, seen = holds(job, fence, 'first_token_at', done)
  if not ok then
    return 0
  end
  local done_reply = 1 + redis.call('EXISTS', watch)
  local upto = tonumber(upto_s or '0')
  if upto > 0 and seen then
    local f, prev = string.match(seen, '^(%d+):(%d+)$')
    if f == fence and tonumber(prev) >= upto then
      return done_reply
    end
  end
  redis.call('XADD', events, 'MAXLEN', '~', maxlen, '*', 'type', 'delta', 'index', index,
    'text', text, 'token_ids', ids, 'tokens', tokens)
  local fields = {'tokens_generated', tokens}
  if upto > 0 then
    fields[#fields + 1] = done
    fields[#fields + 1] = fence .. ':' .. upto_s
  end
  if not first_at then  -- now_s() is a TIME call: a job's first update only
    fields[#fields + 1] = 'first_token_at'
    fields[#fields + 1] = now_s()
  end
  redis.call('HSET', job, unpack(fields))
  return done_reply
end

local maxlen = ARGV[1]

-- The i-th job's update (its 3 keys and 6 values).
local function progress_at(i)
  local a = 1 + (i - 1) * 6
  return progress_one(KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i], ARGV[a + 1], ARGV[a + 2],
    ARGV[a + 3], ARGV[a + 4], ARGV[a + 5], maxlen, ARGV[a + 6])
end

local out = {}
for i = 1, #KEYS / 3 do
  local ok, res = pcall(progress_at, i)
  if ok then
    out[i] = res
  elseif type(res) == 'table' and res.err then
    out[i] = res.err
  else
    out[i] = tostring(res)
  end
end
return out
