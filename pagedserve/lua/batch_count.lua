-- Redis Cluster: the second step of a batch job's end, in the batch's own slot. The job's final
-- write (finish, lease, cancel, release: the job's slot) came first and returned the job's batch
-- fields, or reconcile read them from the job record; this adds the line and counts it, once per
-- job (the counted set), only for a member of the batch (its members set, which only the fan-out
-- writes) while the batch is open. A repeat (a retried step, reconcile) adds nothing.
-- KEYS: batch hash, members set, counted set, line list
-- ARGV: job id, line, counter field ('completed' | 'failed')
-- Returns 1 added | 0 not added.
local bhash, members, counted, lines = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local err = check_batch_keys(bhash, members, counted, lines)
if err then
  return err
end
if redis.call('SISMEMBER', members, ARGV[1]) == 0 then
  return 0
end
if redis.call('EXISTS', bhash) == 0 or redis.call('HEXISTS', bhash, 'closed') == 1 then
  return 0
end
if redis.call('SADD', counted, ARGV[1]) == 0 then
  return 0
end
redis.call('RPUSH', lines, ARGV[2])
redis.call('HINCRBY', bhash, ARGV[3], 1)
return 1
