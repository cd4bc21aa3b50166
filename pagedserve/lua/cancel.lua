-- A client's cancel: a queued job is cancelled at once (a worker skips its entry at claim); a
-- running job becomes 'cancelling' and goes into its owner's cancel set.
-- A job of a batch cancelled here (it never reaches a worker's final write) gets its batch error
-- line ARGV[4] / ARGV[5] (code, message; default batch_cancelled). With ARGV[6] == '1' (a batch
-- expiring) a running job's line is written now too, so the batch's files are complete at once;
-- the worker's later cancelled write then finds the job counted and adds nothing.
-- KEYS: job hash, events stream
-- ARGV: cancel-set key prefix, retention s, events maxlen[, batch code, batch message,
--       '1' to count running jobs too]
-- Returns the job's status after the call, or 'not_found'.
local job, events = KEYS[1], KEYS[2]
local code = ARGV[4] or 'batch_cancelled'
local message = ARGV[5] or 'cancelled before it ran'
local cur = redis.call('HMGET', job, 'status', 'worker', 'id', 'request')
local status = cur[1]
if not status then
  return 'not_found'
end
if status == 'queued' then
  finish(job, events, 'cancelled', ARGV[2], ARGV[3])
  batch_error(job, cur[3], cur[4], code, message)
  return 'cancelled'
end
if status == 'running' or status == 'cancelling' then
  if ARGV[6] == '1' then
    batch_error(job, cur[3], cur[4], code, message)
  end
end
if status == 'running' then
  redis.call('HSET', job, 'status', 'cancelling')
  local set = ARGV[1] .. cur[2]
  redis.call('SADD', set, cur[3])
  redis.call('EXPIRE', set, ARGV[2])
  return 'cancelling'
end
return status
