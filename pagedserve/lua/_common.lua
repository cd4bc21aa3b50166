-- Shared helpers, prepended to every script by pagedserve.store (not a script of its own).

local function now_s()
  local t = redis.call('TIME')
  return string.format('%.3f', tonumber(t[1]) + tonumber(t[2]) / 1000000)
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function is_terminal(s)
  return s == 'succeeded' or s == 'failed' or s == 'cancelled'
end

-- Whether `idem` (a declared key) names the job's idempotency key: the record's server-written
-- idem_key field, or, for a job without one, the job key itself (a harmless key of its slot, so
-- that the KEYS count stays fixed). A script that may end a job checks this before any write:
-- finish() expires the idempotency key, and a script touches only keys it declares.
local function idem_matches(job, idem)
  local ik = redis.call('HGET', job, 'idem_key')
  if ik then
    return ik == idem
  end
  return idem == job
end

-- Ends a job: final status and time, the end event for streamers, and the retention TTL on
-- everything the job owns (record, events, idempotency key `idem`: see idem_matches, checked by
-- the caller). The events stream is a convenience for followers: an error there (a key of the
-- wrong type) never stops the job's final write.
local function finish(job, events, idem, status, retention_s, events_maxlen)
  redis.call('HSET', job, 'status', status, 'finished_at', now_s())
  redis.call('HDEL', job, 'lease_expiry')
  redis.pcall('XADD', events, 'MAXLEN', '~', events_maxlen, '*', 'type', 'end', 'status', status)
  redis.call('EXPIRE', job, retention_s)
  redis.pcall('EXPIRE', events, retention_s)
  if idem ~= job then
    redis.pcall('EXPIRE', idem, retention_s)
  end
end

-- The error a worker's write answers when it was not given the job's idempotency key (its
-- lease names it): nothing was written.
local function idem_error(job)
  return redis.error_reply('ERR idempotency key of ' .. job .. ' not the one given')
end

-- True when `fence` is the job's current lease and the job is still owned by a worker; then
-- also its status and the values of the fields named after the fence (one HMGET in all).
local function holds(job, fence, ...)
  local cur = redis.call('HMGET', job, 'fence', 'status', ...)
  if not cur[2] then
    return false, 'missing'
  end
  if cur[1] ~= fence or (cur[2] ~= 'running' and cur[2] ~= 'cancelling') then
    return false, 'stale'
  end
  return true, cur[2], cur[3], cur[4]
end

-- The server-owned batch fields of a job record (written by the fan-out through enqueue.lua).
local function batch_fields(job)
  return redis.call('HMGET', job, 'batch_id', 'custom_id', 'batch_url', 'batch_model')
end

-- Raises before any write when a batch key has the wrong type, so that a script that calls this
-- first either does everything or nothing.
local function wrong_type(key, want)
  local t = redis.call('TYPE', key).ok
  if t ~= 'none' and t ~= want then
    return 'WRONGTYPE batch key ' .. key .. ' is a ' .. t
  end
  return nil
end

local function check_batch_keys(bhash, members, counted, lines)
  local why = wrong_type(bhash, 'hash') or wrong_type(members, 'set') or
    wrong_type(counted, 'set') or wrong_type(lines, 'list')
  if why then
    return redis.error_reply(why)
  end
  return nil
end

-- Appends a batch job's output or error `line` (built by pagedserve.store) and counts it under
-- `field`, once per job (the counted set), and only when the job belongs to the batch: its
-- server-written batch_id field names `batch_id` and the batch's members set holds it (with
-- `allow_missing`, a job whose record is gone counts on membership alone), and the batch is open
-- (not yet closed for writing its files). Returns 1 when added, 0 otherwise.
local function add_batch_line(job, job_id, batch_id, bhash, members, counted, lines, line, field,
                              allow_missing)
  local bid = redis.call('HGET', job, 'batch_id')
  if bid ~= batch_id and not (bid == false and allow_missing and
      redis.call('EXISTS', job) == 0) then
    return 0
  end
  if redis.call('SISMEMBER', members, job_id) == 0 then
    return 0
  end
  if redis.call('EXISTS', bhash) == 0 or redis.call('HEXISTS', bhash, 'closed') == 1 then
    return 0
  end
  if redis.call('SADD', counted, job_id) == 0 then
    return 0
  end
  redis.call('RPUSH', lines, line)
  redis.call('HINCRBY', bhash, field, 1)
  return 1
end

-- Prefix affinity (admission.lua, affinity.lua): the affinity hash maps a prefix signature to
-- 'worker|ms' (its owner, and when the owner last took one of the group's jobs); the expiry zset
-- says when each lapses. Returns owner, served ms (nil, nil for none).
local function affinity_of(value)
  if not value then
    return nil, nil
  end
  local owner, served = string.match(value, '^(.*)|(%d+)$')
  return owner, tonumber(served)
end

-- Calls redis `cmd` with `key` (its one key), `head`, a chunk of `list` and `tail` (optional),
-- chunk by chunk (Lua's unpack is bounded); the table replies are concatenated.
local function call_chunked(cmd, key, head, list, tail)
  local out = {}
  for i = 1, #list, 1000 do
    local args = {}
    for _, h in ipairs(head) do args[#args + 1] = h end
    for j = i, math.min(i + 999, #list) do args[#args + 1] = list[j] end
    for _, t in ipairs(tail or {}) do args[#args + 1] = t end
    local r = redis.call(cmd, key, unpack(args))
    if type(r) == 'table' then
      for _, x in ipairs(r) do out[#out + 1] = x end
    end
  end
  return out
end
