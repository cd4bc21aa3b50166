-- Adds the line of a batch job that ended without a worker's final write carrying it (cancelled
-- while queued, dead-lettered, expired, or found by reconcile): see add_batch_line. With
-- ARGV[6] == '1' the job may still be running (a batch expiring writes every line at once);
-- otherwise it must have ended (or its record be gone).
-- KEYS: job hash, batch hash, members set, counted set, line list
-- ARGV: job id, batch id, line, counter field ('completed' | 'failed'), '1' to allow a missing
--       record, '1' to allow a running job
-- Returns 1 added | 0 not added.
local job = KEYS[1]
local err = check_batch_keys(KEYS[2], KEYS[3], KEYS[4], KEYS[5])
if err then
  return err
end
local s = redis.call('HGET', job, 'status')
if s and not is_terminal(s) and ARGV[6] ~= '1' then
  return 0
end
return add_batch_line(job, ARGV[1], ARGV[2], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[3], ARGV[4],
  ARGV[5] == '1')
