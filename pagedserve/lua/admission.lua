-- Prefix-aware admission of bulk jobs: look ahead over a bounded window of the bulk stream and
-- pick what this worker should run. O(window) work, one call per admission round.
-- KEYS: bulk stream, affinity hash, affinity expiry zset, window-since hash (entry id -> ms it
--       entered the window: how long it has been passed over)
-- ARGV: group, window consumer, worker, window size, most entries to take, max wait ms (aging),
--       steal ms, affinity ttl ms, group slots, n, n x (signature, running jobs) of the worker's
--       warm groups, m, m x signature of its warming groups (a first job's prefill not done)
-- The window is the pending list of the window consumer: entries read ahead (XREADGROUP) but not
-- yet taken. Reading it back (XREADGROUP from 0) also resets their idle time, so reclaim
-- (XAUTOCLAIM, for dead workers) leaves them alone while admission runs. Taken entries move to the
-- worker's own pending list (XCLAIM) and are leased as before (lease.lua): delivery, fencing,
-- reclaim and cancel are those of any entry; only the order differs.
-- Order of choice: (1) entries passed over (in the window) >= max wait, oldest first, whoever
-- owns their group;
-- (2) entries of the worker's warm groups; (3) in window order, jobs without a signature and the
-- first job (a pilot, whose prefill fills the cache) of each new group while a slot is free;
-- (4) the pilot of a group whose owner took none of its jobs for steal ms while its oldest entry
-- waited that long: its owner is busy, the group is handed over; (5) with capacity left, help:
-- jobs of other workers' groups this worker has warm too, and the pilot of one with a backlog
-- (at least HELP_BACKLOG entries) while a slot is free. A helper computes the prefix once more,
-- still once per worker that serves it; the group stays its owner's.
-- Returns {{entry id, job id, signature}..., claimed signatures, lost signatures, signatures
-- piloted (new to this worker)}.
local stream, aff, exp, since = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local group, win, me = ARGV[1], ARGV[2], ARGV[3]
local size, want = tonumber(ARGV[4]), tonumber(ARGV[5])
local max_wait, steal, ttl = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local slots = tonumber(ARGV[9])
local HELP_BACKLOG = 4
local warm, running, warming = {}, {}, {}
local a = 10
for _ = 1, tonumber(ARGV[a]) do
  warm[ARGV[a + 1]] = true
  running[ARGV[a + 1]] = tonumber(ARGV[a + 2])
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

local function read(from, count)
  if count <= 0 then
    return {}
  end
  local r = redis.call('XREADGROUP', 'GROUP', group, win, 'COUNT', count, 'STREAMS', stream, from)
  if not r or not r[1] then
    return {}
  end
  return r[1][2]
end
local entries = read('0', size)
local fresh = {}
for _, e in ipairs(read('>', size - #entries)) do
  entries[#entries + 1] = e
  fresh[#fresh + 1] = e[1]
  fresh[#fresh + 1] = now
end
if #fresh > 0 then
  call_chunked('HSET', {since}, fresh)
end

-- items: {entry id, job id, signature, ms it entered the window}; entries without a job are
-- acked here.
local items, gone, count, sigs = {}, {}, {}, {}
for _, e in ipairs(entries) do
  local job, sig = nil, ''
  for k = 1, #(e[2] or {}), 2 do
    if e[2][k] == 'job' then job = e[2][k + 1] elseif e[2][k] == 'sig' then sig = e[2][k + 1] end
  end
  if job == nil then
    gone[#gone + 1] = e[1]
  else
    items[#items + 1] = {e[1], job, sig, now}
    if sig ~= '' then
      if not count[sig] then sigs[#sigs + 1] = sig end
      count[sig] = (count[sig] or 0) + 1
    end
  end
end
if #gone > 0 then
  call_chunked('XACK', {stream, group}, gone)
  call_chunked('HDEL', {since}, gone)
end
do
  local ids = {}
  for i, it in ipairs(items) do ids[i] = it[1] end
  local at = call_chunked('HMGET', {since}, ids)
  local unset = {}
  for i, it in ipairs(items) do
    it[4] = tonumber(at[i])
    if not it[4] then
      it[4] = now
      unset[#unset + 1] = it[1]
      unset[#unset + 1] = now
    end
  end
  if #unset > 0 then
    call_chunked('HSET', {since}, unset)
  end
  -- Entries that left the window otherwise (reclaimed after a long pause) leave stale fields.
  if redis.call('HLEN', since) > #items + 1000 then
    local keep = {}
    for _, id in ipairs(ids) do keep[id] = true end
    local stale = {}
    for _, id in ipairs(redis.call('HKEYS', since)) do
      if not keep[id] then stale[#stale + 1] = id end
    end
    call_chunked('HDEL', {since}, stale)
  end
end
for s in pairs(warm) do if not count[s] then sigs[#sigs + 1] = s end end
for s in pairs(warming) do if not count[s] and not warm[s] then sigs[#sigs + 1] = s end end

local owner, served = {}, {}
if #sigs > 0 then
  local vals = call_chunked('HMGET', {aff}, sigs)
  for i, s in ipairs(sigs) do
    owner[s], served[s] = affinity_of(vals[i])
  end
end

-- Group slots: a warming group, or a warm one with running jobs or window entries, holds one
-- (whoever owns it: a group this worker helps with counts too).
local busy, lost = 0, {}
for _, s in ipairs(sigs) do
  if owner[s] ~= nil and owner[s] ~= me and (warm[s] or warming[s]) then
    lost[#lost + 1] = s
  end
  if warming[s] or (warm[s] and ((running[s] or 0) > 0 or count[s])) then
    busy = busy + 1
  end
end
local free_slots = slots - busy

local taken, took, touched, claimed, piloted, pilots = {}, {}, {}, {}, {}, {}
local function take(k)
  taken[#taken + 1] = k
  took[k] = true
end
local function serve(s)  -- this worker owns group s from now on and has just taken one of its jobs
  if owner[s] ~= me then
    claimed[#claimed + 1] = s
    owner[s] = me
  end
  touched[s] = true
end
local function pilot(k, s, own)
  if free_slots > 0 and not piloted[s] then
    piloted[s] = true
    pilots[#pilots + 1] = s
    free_slots = free_slots - 1
    if own then serve(s) end
    take(k)
  end
end

for k, it in ipairs(items) do  -- (1) aged
  if #taken >= want then break end
  if now - it[4] >= max_wait then take(k) end
end
for k, it in ipairs(items) do  -- (2) my warm groups
  if #taken >= want then break end
  local s = it[3]
  if not took[k] and warm[s] and (owner[s] == nil or owner[s] == me) then
    serve(s)
    take(k)
  end
end
for k, it in ipairs(items) do  -- (3) unsigned jobs and new groups
  if #taken >= want then break end
  local s = it[3]
  if not took[k] then
    if s == '' then
      take(k)
    elseif owner[s] == nil and not warming[s] and not warm[s] then
      pilot(k, s, true)
    end
  end
end
for k, it in ipairs(items) do  -- (4) groups whose owner is busy
  if #taken >= want or free_slots <= 0 then break end
  local s = it[3]
  if not took[k] and s ~= '' and owner[s] ~= nil and owner[s] ~= me and not piloted[s]
      and now - it[4] >= steal and now - (served[s] or 0) >= steal then
    pilot(k, s, true)
  end
end
for k, it in ipairs(items) do  -- (5) help other workers' groups
  if #taken >= want then break end
  local s = it[3]
  if not took[k] and s ~= '' and owner[s] ~= nil and owner[s] ~= me and not warming[s] then
    if warm[s] then
      take(k)
    elseif (count[s] or 0) >= HELP_BACKLOG then
      pilot(k, s, false)
    end
  end
end

for s in pairs(touched) do
  redis.call('HSET', aff, s, me .. '|' .. now)
  redis.call('ZADD', exp, now + ttl, s)
end
for _, s in ipairs(sigs) do
  if owner[s] == me and not touched[s] and (warm[s] or warming[s]) then
    redis.call('ZADD', exp, now + ttl, s)
  end
end

local out, ids = {}, {}
for _, k in ipairs(taken) do
  local it = items[k]
  ids[#ids + 1] = it[1]
  out[#out + 1] = {it[1], it[2], it[3]}
end
if #ids > 0 then
  call_chunked('XCLAIM', {stream, group, me, 0}, ids, {'JUSTID'})
  call_chunked('HDEL', {since}, ids)
end
out[#out + 1] = claimed
out[#out + 1] = lost
out[#out + 1] = pilots
return out
