-- Renews many leases at once.
-- KEYS: n job hashes, then their n priority streams
-- ARGV: consumer, group, lease ms, then n fences, then n entry ids
-- Returns a list of n integers: 1 renewed, 0 lost (or unreadable).
local n = #KEYS / 2
local consumer, group, lease_ms = ARGV[1], ARGV[2], tonumber(ARGV[3])
local expiry = now_ms() + lease_ms
local out = {}
for i = 1, n do
  local job, stream = KEYS[i], KEYS[n + i]
  local fence, entry = ARGV[3 + i], ARGV[3 + n + i]
  -- pcall: a job key of the wrong type loses that one lease, not the whole renewal.
  local cur = redis.pcall('HMGET', job, 'fence', 'status', 'worker', 'entry')
  if type(cur) == 'table' and not cur.err and cur[1] == fence and cur[3] == consumer and cur[4] == entry
      and (cur[2] == 'running' or cur[2] == 'cancelling') then
    redis.call('HSET', job, 'lease_expiry', expiry)
    -- Resets the entry's idle time so XAUTOCLAIM leaves it alone.
    redis.call('XCLAIM', stream, group, consumer, 0, entry, 'JUSTID')
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
