-- Takes over entries whose consumer stopped renewing them (a dead worker's), for the caller.
-- KEYS: the stream
-- ARGV: group, consumer, min idle ms, start (an entry id, '(' id for after it, or '-'), most
--       entries to take, the admission window's consumer name, most pending rows to look at
-- Returns {next start ('0-0' once the end of the pending list was reached), XCLAIM's entries}.
--
-- Why not XAUTOCLAIM: it takes every idle entry whatever its consumer, and the admission window
-- (admission.lua) keeps bulk entries pending under a consumer no process runs, for as long as no
-- worker chooses them. Their idle times are reset only by admission rounds; a worker at capacity
-- runs none, so after a while every window entry looked like a dead worker's, and the next
-- reclaim leased them all with one delivery more (the sentinel failover test dead-lettered jobs
-- "delivered 4 times" that no worker had died with). Here the window's entries are skipped; the
-- XCLAIM still names the idle time, so an entry renewed meanwhile is left alone.
local group, me, min_idle = ARGV[1], ARGV[2], tonumber(ARGV[3])
local start, want, win, scan = ARGV[4], tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])
local rows = redis.call('XPENDING', KEYS[1], group, 'IDLE', min_idle, start, '+', scan)
local ids, seen = {}, 0
for i, r in ipairs(rows) do
  if #ids >= want then break end
  seen = i
  if r[2] ~= win then ids[#ids + 1] = r[1] end
end
-- Go on after the last row looked at while rows are left behind it (here, or past the scan).
local nxt = '0-0'
if seen > 0 and (seen < #rows or #rows == scan) then nxt = '(' .. rows[seen][1] end
local got = {}
if #ids > 0 then got = redis.call('XCLAIM', KEYS[1], group, me, min_idle, unpack(ids)) end
return {nxt, got}
