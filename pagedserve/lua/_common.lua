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

-- Ends a job: final status and time, the end event for streamers, and the retention TTL on
-- everything the job owns (record, events, idempotency key).
local function finish(job, events, status, retention_s, events_maxlen)
  redis.call('HSET', job, 'status', status, 'finished_at', now_s())
  redis.call('HDEL', job, 'lease_expiry')
  redis.call('XADD', events, 'MAXLEN', '~', events_maxlen, '*', 'type', 'end', 'status', status)
  redis.call('EXPIRE', job, retention_s)
  redis.call('EXPIRE', events, retention_s)
  local ik = redis.call('HGET', job, 'idem_key')
  if ik then
    redis.call('EXPIRE', ik, retention_s)
  end
end

-- True when `fence` is the job's current lease and the job is still owned by a worker.
local function holds(job, fence)
  local cur = redis.call('HMGET', job, 'fence', 'status')
  if not cur[2] then
    return false, 'missing'
  end
  if cur[1] ~= fence or (cur[2] ~= 'running' and cur[2] ~= 'cancelling') then
    return false, 'stale'
  end
  return true, cur[2]
end

-- For a job of an OpenAI batch (its request's metadata names batch_id and custom_id) that ends
-- here without a worker's final write: appends its error-file line to the batch and counts it as
-- failed, once per job (the batch's counted set, as in finish.lua), if the batch still exists.
-- The batch keys are derived from the job key (<prefix>:job:<id> -> <prefix>:batch:<batch id>).
local function batch_error(job, job_id, request, code, message)
  if not request or not job_id then
    return
  end
  local ok, req = pcall(cjson.decode, request)
  if not ok or type(req) ~= 'table' or type(req.metadata) ~= 'table' then
    return
  end
  local bid, cid = req.metadata.batch_id, req.metadata.custom_id
  if type(bid) ~= 'string' or cid == nil then
    return
  end
  local bhash = string.sub(job, 1, #job - #job_id - 4) .. 'batch:' .. bid
  if redis.call('EXISTS', bhash) == 0 then
    return
  end
  if redis.call('SADD', bhash .. ':counted', job_id) == 1 then
    local line = cjson.encode({id = 'batch_req_' .. job_id, custom_id = tostring(cid),
      response = cjson.null, error = {code = code, message = message}})
    redis.call('RPUSH', bhash .. ':errors', line)
    redis.call('HINCRBY', bhash, 'failed', 1)
  end
end
