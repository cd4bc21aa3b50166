-- Fenced progress updates of many jobs in one call (what progress.lua does for one job, for each
-- job in turn): one script call per engine step instead of one per job, on a Redis that is not
-- a cluster (a cluster keeps one progress.lua call per job: its keys are in different slots).
-- KEYS: per job, its job hash and events stream (2 keys a job)
-- ARGV: maxlen, then per job 6 values: fence, tokens generated, completion index, delta text,
--       delta token ids JSON, end (as in progress.lua)
-- Returns one reply a job, in order: 1 written (or already) | 0 refused (lease lost) | the error
-- Redis raised for that job (a key of the wrong type, say: the job's writes stop there, as its
-- own progress.lua call would have; the other jobs' writes go on).
local function progress_one(job, events, fence, tokens, index, text, ids, maxlen, upto_s)
  if not holds(job, fence) then
    return 0
  end
  local done = 'pub:' .. index
  local upto = tonumber(upto_s or '0')
  if upto > 0 then
    local seen = redis.call('HGET', job, done)
    if seen then
      local f, prev = string.match(seen, '^(%d+):(%d+)$')
      if f == fence and tonumber(prev) >= upto then
        return 1
      end
    end
  end
  redis.call('XADD', events, 'MAXLEN', '~', maxlen, '*', 'type', 'delta', 'index', index,
    'text', text, 'token_ids', ids, 'tokens', tokens)
  redis.call('HSET', job, 'tokens_generated', tokens)
  if upto > 0 then
    redis.call('HSET', job, done, fence .. ':' .. upto_s)
  end
  redis.call('HSETNX', job, 'first_token_at', now_s())
  return 1
end

local maxlen = ARGV[1]

-- The i-th job's update (its 2 keys and 6 values).
local function progress_at(i)
  local a = 1 + (i - 1) * 6
  return progress_one(KEYS[2 * i - 1], KEYS[2 * i], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3],
    ARGV[a + 4], ARGV[a + 5], maxlen, ARGV[a + 6])
end

local out = {}
for i = 1, #KEYS / 2 do
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
