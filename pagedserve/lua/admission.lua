-- Prefix-aware admission of bulk jobs: look ahead over a bounded window of the bulk stream and
-- pick what this worker should run. O(window) work, one call per admission round.
-- KEYS: bulk stream, affinity hash, affinity expiry zset, window meta hash (entry id -> 'entered
--       ms|signature|job id'; entered: when it came into the window, how long it was passed over)
-- ARGV: group, window consumer, worker, window size, most entries to take, max wait ms (aging),
--       steal ms, affinity ttl ms, group slots, touch ms, n, n x (signature, running jobs) of the
--       worker's warm groups (the running count is informational), m, m x signature of its
--       warming groups (a first job's prefill is not done)
-- The window is the pending list of the window consumer: entries read ahead (XREADGROUP) but not
-- yet taken. Taken entries move to the worker's own pending list (XCLAIM) and are leased as before
-- (lease.lua): delivery, fencing, reclaim and cancel are those of any entry; only the order
-- differs. Work per round: XPENDING and HMGET over the window (no entry bodies re-read), the
-- choice below, and XCLAIM of what is taken and of entries idle for touch ms.
-- Order of choice, so that no seat stays free while admissible work is in the window:
-- (1) entries passed over (in the window) >= max wait, oldest first, whoever owns their group;
-- (2) entries of the worker's warm and warming groups (all of them, up to the seats asked for);
-- (3) in window order, jobs without a signature, and the first job (the pilot) of each new group
-- while a group slot is free, with the group's other window entries joining it; a group with
-- one window entry needs no slot (signatures that do not repeat are taken as in FCFS);
-- (4) the pilot of a group whose owner took none of its jobs for steal ms while its oldest entry
-- waited that long: its owner is busy, the group is handed over (its other entries join);
-- (5) with capacity left, help: jobs of other workers' groups this worker has warm or warming
-- too, and the pilot of one with a backlog (at least HELP_BACKLOG entries, they join) while a
-- slot is free. A helper computes the prefix once more, still once per worker that serves it;
-- the group stays its owner's.
-- Why jobs join their pilot at once: the engine's prefix cache registers a block when the block
-- is scheduled, so a job admitted in the pilot's step (or any later one) shares its prefix
-- (measured: 7 followers of a 512-token prefix taken with the pilot got 512 cached tokens each,
-- at step budgets 512 and 2048). Waiting for the pilot's prefill only left seats idle.
-- Group slots bound how many new groups one round pilots: each group warm or warming here with
-- window entries left after (2) holds one.
-- Returns {{entry id, job id, signature}..., claimed signatures, lost signatures, signatures
-- piloted (new to this worker), entries left that this worker could take (a diagnostic)}.
local stream, aff, exp, meta_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local group, win, me = ARGV[1], ARGV[2], ARGV[3]
local size, want = tonumber(ARGV[4]), tonumber(ARGV[5])
local max_wait, steal, ttl = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local slots, touch_ms = tonumber(ARGV[9]), tonumber(ARGV[10])
local HELP_BACKLOG = 4
local warm, warming = {}, {}
local a = 11
for _ = 1, tonumber(ARGV[a]) do
  warm[ARGV[a + 1]] = true
  a = a + 2
end
a = a + 1
for _ = 1, tonumber(ARGV[a]) do
  warming[ARGV[a + 1]] = true
  a = a + 1
end
local now = now_ms()

local lapsed = redis.call('ZRANGEBYSCORE', exp, '-inf', now, 'LIMIT', 0, 1000)
if #lapsed > 0 then
  redis.call('HDEL', aff, unpack(lapsed))
  redis.call('ZREM', exp, unpack(lapsed))
end

-- The window, oldest first: the window consumer's pending entries (XPENDING: ids and idle times,
-- no entry bodies), with each entry's 'entered ms|signature|job id' from the meta hash.
local pend = redis.call('XPENDING', stream, group, '-', '+', size, win)
local ids, idle = {}, {}
for i, p in ipairs(pend) do
  ids[i] = p[1]
  idle[i] = tonumber(p[3])
end
local meta = call_chunked('HMGET', meta_key, {}, ids)
if #ids < size then  -- top up with new entries
  local r = redis.call('XREADGROUP', 'GROUP', group, win, 'COUNT', size - #ids, 'STREAMS', stream,
    '>')
  local fresh, gone = {}, {}
  for _, e in ipairs((r and r[1] and r[1][2]) or {}) do
    local job, sig = nil, ''
    for k = 1, #e[2], 2 do
      if e[2][k] == 'job' then job = e[2][k + 1] elseif e[2][k] == 'sig' then sig = e[2][k + 1] end
    end
    if job == nil then
      gone[#gone + 1] = e[1]
    else
      local m = now .. '|' .. sig .. '|' .. job
      local n = #ids + 1
      ids[n] = e[1]
      idle[n] = 0
      meta[n] = m
      fresh[#fresh + 1] = e[1]
      fresh[#fresh + 1] = m
    end
  end
  if #gone > 0 then call_chunked('XACK', stream, {group}, gone) end
  if #fresh > 0 then call_chunked('HSET', meta_key, {}, fresh) end
end

-- items: {entry id, job id, signature, ms it entered the window}. An entry without meta (read
-- into the window some other way) gets it from the stream; one deleted from the stream is acked.
local items, count, sigs, touch, gone = {}, {}, {}, {}, {}
for i, id in ipairs(ids) do
  local m = meta[i]
  if not m then
    local e = redis.call('XRANGE', stream, id, id)[1]
    local job, sig = nil, ''
    for k = 1, #((e and e[2]) or {}), 2 do
      if e[2][k] == 'job' then job = e[2][k + 1] elseif e[2][k] == 'sig' then sig = e[2][k + 1] end
    end
    if job then
      m = now .. '|' .. sig .. '|' .. job
      redis.call('HSET', meta_key, id, m)
    end
  end
  if m then
    local at, sig, job = string.match(m, '^(%d+)|([^|]*)|(.*)$')
    items[#items + 1] = {id, job, sig, tonumber(at)}
    if sig ~= '' then
      if not count[sig] then sigs[#sigs + 1] = sig end
      count[sig] = (count[sig] or 0) + 1
    end
    if idle[i] >= touch_ms then touch[#touch + 1] = id end
  else
    gone[#gone + 1] = id
  end
end
if #gone > 0 then call_chunked('XACK', stream, {group}, gone) end
-- Reset the idle time of entries waiting long in the window, so that reclaim (XAUTOCLAIM, for dead
-- workers' entries) leaves them alone: each entry about once per touch ms, still the window's.
if #touch > 0 then call_chunked('XCLAIM', stream, {group, win, 0}, touch, {'JUSTID'}) end
-- Entries that left the window otherwise (reclaimed after a long pause) leave stale meta.
if redis.call('HLEN', meta_key) > #items + 1000 then
  local keep, stale = {}, {}
  for _, it in ipairs(items) do keep[it[1]] = true end
  for _, id in ipairs(redis.call('HKEYS', meta_key)) do
    if not keep[id] then stale[#stale + 1] = id end
  end
  call_chunked('HDEL', meta_key, {}, stale)
end
for s in pairs(warm) do if not count[s] then sigs[#sigs + 1] = s end end
for s in pairs(warming) do if not count[s] and not warm[s] then sigs[#sigs + 1] = s end end

local owner, served = {}, {}
if #sigs > 0 then
  local vals = call_chunked('HMGET', aff, {}, sigs)
  for i, s in ipairs(sigs) do
    owner[s], served[s] = affinity_of(vals[i])
  end
end

-- Groups this worker names (warm or warming here) that another worker owns: reported as lost.
local lost = {}
for _, s in ipairs(sigs) do
  if owner[s] ~= nil and owner[s] ~= me and (warm[s] or warming[s]) then
    lost[#lost + 1] = s
  end
end

-- left[s]: group s's window entries not taken yet.
local taken, took, touched, claimed, piloted, pilots, left = {}, {}, {}, {}, {}, {}, {}
for s, c in pairs(count) do left[s] = c end
local function take(k)
  taken[#taken + 1] = k
  took[k] = true
  local s = items[k][3]
  if s ~= '' then left[s] = left[s] - 1 end
end
local function serve(s)  -- this worker owns group s from now on and has just taken one of its jobs
  if owner[s] ~= me then
    claimed[#claimed + 1] = s
    owner[s] = me
  end
  touched[s] = true
end
local free_slots = 0
local function pilot(k, s, own, single)  -- a single entry's group needs no slot
  if single or free_slots > 0 then
    piloted[s] = true
    pilots[#pilots + 1] = s
    if not single then free_slots = free_slots - 1 end
    if own then serve(s) end
    take(k)
  end
end

for k, it in ipairs(items) do  -- (1) aged
  if #taken >= want then break end
  if now - it[4] >= max_wait then take(k) end
end
for k, it in ipairs(items) do  -- (2) my warm and warming groups
  if #taken >= want then break end
  local s = it[3]
  if not took[k] and (warm[s] or warming[s]) and (owner[s] == nil or owner[s] == me) then
    serve(s)
    take(k)
  end
end
-- Group slots: a group warm or warming here (this worker's or one it helps with) that still has
-- window entries holds one; the rest bound how many new groups this round pilots.
local busy = 0
for _, s in ipairs(sigs) do
  if (warm[s] or warming[s]) and (left[s] or 0) > 0 then busy = busy + 1 end
end
free_slots = slots - busy
for k, it in ipairs(items) do  -- (3) unsigned jobs and new groups
  if #taken >= want then break end
  local s = it[3]
  if not took[k] then
    if s == '' then
      take(k)
    elseif piloted[s] then
      take(k)  -- joins its pilot (piloted in this loop: owned by this worker now)
    elseif owner[s] == nil and not warming[s] and not warm[s] then
      pilot(k, s, true, count[s] == 1)
    end
  end
end
for k, it in ipairs(items) do  -- (4) groups whose owner is busy
  if #taken >= want then break end
  local s = it[3]
  if not took[k] and s ~= '' and owner[s] ~= nil then
    if piloted[s] and owner[s] == me then
      take(k)
    elseif owner[s] ~= me and not piloted[s] and now - it[4] >= steal
        and now - (served[s] or 0) >= steal then
      pilot(k, s, true)
    end
  end
end
for k, it in ipairs(items) do  -- (5) help other workers' groups
  if #taken >= want then break end
  local s = it[3]
  if not took[k] and s ~= '' and owner[s] ~= nil and owner[s] ~= me then
    if warm[s] or warming[s] or piloted[s] then
      take(k)
    elseif (count[s] or 0) >= HELP_BACKLOG then
      pilot(k, s, false)
    end
  end
end

-- Only the groups this round took jobs of (or piloted) are written: the worker's heartbeat
-- (affinity.lua) extends every group it keeps, once a beat. Extending all its warm groups here
-- too, every round, was a third of a worker's Redis commands at fast steps (bench.redis_cost:
-- ~25 ZADD per job when every job had its own prefix) and extended nothing the beat did not.
for s in pairs(touched) do
  redis.call('HSET', aff, s, me .. '|' .. now)
  redis.call('ZADD', exp, now + ttl, s)
end

local out, ids = {}, {}
for _, k in ipairs(taken) do
  local it = items[k]
  ids[#ids + 1] = it[1]
  out[#out + 1] = {it[1], it[2], it[3]}
end
if #ids > 0 then
  call_chunked('XCLAIM', stream, {group, me, 0}, ids, {'JUSTID'})
  call_chunked('HDEL', meta_key, {}, ids)
end
-- Diagnostic: entries left that this worker would take with more seats (no signature, or a group
-- that is no other worker's).
local waiting = 0
for k, it in ipairs(items) do
  local s = it[3]
  if not took[k] and (s == '' or owner[s] == nil or owner[s] == me) then waiting = waiting + 1 end
end
out[#out + 1] = claimed
out[#out + 1] = lost
out[#out + 1] = pilots
out[#out + 1] = waiting
return out
