"""Per-tenant accounting in Redis: open jobs, file bytes, generated tokens.

Layout (prefix ``ps``)::

    ps:tenants               set    every tenant that has written something
    ps:tenant:{t}:open       set    ids of the tenant's jobs not yet seen ended (see below)
    ps:tenant:{t}:files      hash   file id -> bytes, the tenant's stored files
    ps:tenant:{t}:stats      hash   tokens (output tokens of the jobs pruned from ``open``), jobs
    ps:tenant:{t}:prune      string throttle of the full prune (expires after PRUNE_EVERY_MS)

Counting open jobs: a job id is added to ``open`` when a job is created with a tenant (atomically
with the ``tenant`` field, :data:`TAG_JOB`), or reserved just before that by the API's admission
(:data:`ADMIT_JOB`). Nothing in the workers' Lua end paths has to know about tenants: removal is a
*prune* by job status, done (a) by two random samples at every tagged enqueue, which keeps the set
within about twice the number of open jobs, and (b) fully, throttled to once per
:data:`PRUNE_EVERY_MS` per tenant, before a limit is enforced, and unthrottled for the usage
view (metrics, ``/v1/tenants``: ``jobs_finished`` is exact once jobs have ended). An id is
removed once its record says it ended, and only then (the one ``SREM`` that succeeds) are its
generated tokens added to ``stats``, so each job is counted exactly once whoever removes it. An id
without a record is removed uncounted: expired before any prune saw it end, or reserved and not yet
created (its tag adds it back). Between full prunes the count can only over-count (ended jobs not
yet removed), so a limit errs on refusing (429 with Retry-After); the one way past it is a prune
that drops another request's reservation in the instant between its admission and its enqueue.
Every script declares every key it touches: the members a prune looks at are read first
(``SRANDMEMBER``, ``SMEMBERS``) and their job keys passed in KEYS; a member that left the set
meanwhile is skipped (its ``SREM`` answers 0, and only the ``SREM`` that removes an id counts it).

File bytes are the sum of the ``files`` hash after dropping entries whose file key no longer exists,
so deleting a file (by any code path) frees its bytes without a counter to keep in step.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from pagedserve.keys import Keys

#: Tenant names: they become part of Redis key names and Prometheus labels.
TENANT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: The tenant of a bare API key (one given without ``tenant:``) and of records written without a
#: tenant (by Redis-side clients that pass none, or before tenants existed).
DEFAULT_TENANT = "default"
#: A key of this tenant (or marked ``:admin``) sees every tenant's records.
ADMIN_TENANT = "admin"
#: Full prunes of one tenant's open set happen at most this often (a prune reads every member's
#: status inside Redis: about 0.3 ms per 1,000 open jobs).
PRUNE_EVERY_MS = 100

#: Open-set members pruned per script call (each member's job key is one of its KEYS).
PRUNE_CHUNK = 500

_PRUNE = """
local function drop(open, stats, job, id)
  local s = redis.call('HGET', job, 'status')
  if not s then
    redis.call('SREM', open, id)
  elseif (s == 'succeeded' or s == 'failed' or s == 'cancelled')
      and redis.call('SREM', open, id) == 1 then
    local t = tonumber(redis.call('HGET', job, 'tokens_generated') or '0') or 0
    redis.call('HINCRBY', stats, 'tokens', t)
    redis.call('HINCRBY', stats, 'jobs', 1)
  end
end
"""

#: KEYS: job hash, open set, stats hash, tenants set, then the job hashes of sampled open-set
#: members; ARGV: job id, tenant, then the sampled ids. Tags a job just created (its ``id``
#: field is ours; an idempotent duplicate is left alone) and prunes the sampled members.
TAG_JOB = (
    _PRUNE
    + """
if redis.call('HGET', KEYS[1], 'id') ~= ARGV[1] then return 0 end
if redis.call('HSETNX', KEYS[1], 'tenant', ARGV[2]) == 0 then return 0 end
redis.call('SADD', KEYS[4], ARGV[2])
for i = 5, #KEYS do
  drop(KEYS[2], KEYS[3], KEYS[i], ARGV[i - 2])
end
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""
)

#: KEYS: open set, stats hash, then the job hashes of open-set members; ARGV: their ids.
#: Prunes those members; returns the open count after.
COUNT_OPEN = (
    _PRUNE
    + """
for i = 3, #KEYS do
  drop(KEYS[1], KEYS[2], KEYS[i], ARGV[i - 2])
end
return redis.call('SCARD', KEYS[1])
"""
)

#: KEYS: open set, tenants set; ARGV: limit, job id, tenant. Reserves ``job id`` in the open set
#: if the tenant has fewer than ``limit`` open jobs. Returns {admitted 0/1, open count}; the
#: caller prunes (throttled) and asks again when it looks full.
ADMIT_JOB = """
local n = redis.call('SCARD', KEYS[1])
if n >= tonumber(ARGV[1]) then return {0, n} end
redis.call('SADD', KEYS[2], ARGV[3])
redis.call('SADD', KEYS[1], ARGV[2])
return {1, n + 1}
"""

#: KEYS: files hash, tenants set; ARGV: file id, bytes ('' to only sum), limit (0: none),
#: tenant. Sums the files hash (the caller dropped the entries of deleted files: each file key is
#: its own, on a cluster in a slot of its own), then admits the new file if the sum stays within
#: the limit. Returns {admitted 0/1, bytes stored (with the new file when admitted)}.
ADMIT_FILE = """
local total = 0
local h = redis.call('HGETALL', KEYS[1])
for i = 2, #h, 2 do
  total = total + tonumber(h[i])
end
if ARGV[2] == '' then return {1, total} end
local size, limit = tonumber(ARGV[2]), tonumber(ARGV[3])
if limit > 0 and total + size > limit then return {0, total} end
redis.call('SADD', KEYS[2], ARGV[4])
redis.call('HSET', KEYS[1], ARGV[1], size)
return {1, total + size}
"""


class QuotaExceeded(Exception):
    """A tenant limit would be exceeded: ``what`` (jobs, file bytes), ``used`` with the new item."""

    def __init__(self, what: str, used: int, limit: int) -> None:
        super().__init__(f"tenant limit on {what} exceeded: {used} > {limit}")
        self.what = what
        self.used = used
        self.limit = limit


def check_tenant(name: str) -> str:
    if not TENANT_RE.match(name):
        raise ValueError(f"tenant name {name[:80]!r} must match {TENANT_RE.pattern}")
    return name


@dataclass(frozen=True)
class TenantUsage:
    """One tenant's counts (metrics and the dashboard)."""

    tenant: str
    queued: int
    running: int
    file_bytes: int
    tokens_generated: int
    jobs_finished: int


class TenantBook:
    """The per-tenant keys and scripts under one prefix (see the module docstring).

    On a Redis Cluster the job accounting is kept per shard (``ps:{sK}:tenant:{t}:open`` ...,
    beside the shard's jobs, so that a prune reads job records of its own slot) and summed over
    shards; a job limit is then checked against the other shards' counts read just before, so
    concurrent admissions may pass it by a few. A tenant's files hash lives in shard 0's slot;
    entries of deleted files (each file has a slot of its own) are dropped before the count.
    """

    def __init__(self, r: redis.Redis, keys: Keys) -> None:
        self.r = r
        self.keys = keys
        self._count = r.register_script(COUNT_OPEN)
        self._admit_job = r.register_script(ADMIT_JOB)
        self._admit_file = r.register_script(ADMIT_FILE)

    # ----------------------------------------------------------------------------- keys
    def base(self, tenant: str, shard: int = 0) -> str:
        return self.keys.tenant_in(tenant, shard)

    @property
    def index(self) -> str:
        return self.keys.tenants

    def open_key(self, tenant: str, shard: int = 0) -> str:
        return f"{self.base(tenant, shard)}:open"

    def stats_key(self, tenant: str, shard: int = 0) -> str:
        return f"{self.base(tenant, shard)}:stats"

    def files_key(self, tenant: str) -> str:
        return self.keys.tenant_files(tenant)

    def _shard_keys(self, tenant: str, shard: int) -> list[str]:
        """Open set, stats hash, prune throttle and tenants index of one shard."""
        return [
            self.open_key(tenant, shard),
            self.stats_key(tenant, shard),
            f"{self.base(tenant, shard)}:prune",
            self.keys.tenants_in(shard),
        ]

    def tag_call(self, job_id: str, tenant: str, sample: Sequence[str]) -> tuple[list, list]:
        """KEYS and ARGV of :data:`TAG_JOB` for a job of ``tenant``, pruning the ``sample``
        of its shard's open set (:meth:`samples`)."""
        k = self.keys.shard(job_id)
        keys = [self.keys.job(job_id), *self._shard_keys(tenant, k)[:2], self.keys.tenants_in(k)]
        return keys + [self.keys.job(j) for j in sample], [job_id, tenant, *sample]

    def samples(self, tenant: str, job_ids: Sequence[str]) -> dict[str, list[str]]:
        """Two random open-set members (distinct ones, where the set has them) for each of
        ``job_ids`` to prune at its tag, read from each job's shard in one round trip."""
        by_shard: dict[int, list[str]] = {}
        for jid in job_ids:
            by_shard.setdefault(self.keys.shard(jid), []).append(jid)
        pipe = self.r.pipeline(transaction=False)
        for k, ids in by_shard.items():
            pipe.srandmember(self.open_key(tenant, k), 2 * len(ids))
        out: dict[str, list[str]] = {}
        for ids, got in zip(by_shard.values(), pipe.execute(), strict=True):
            members = sorted(got or ())
            for i, jid in enumerate(ids):
                out[jid] = members[2 * i : 2 * i + 2]
        return out

    # ----------------------------------------------------------------------------- jobs
    def admit_job(self, tenant: str, job_id: str, limit: int) -> tuple[bool, int]:
        """Reserve a place for ``job_id`` among the tenant's at most ``limit`` open jobs; when
        the tenant looks full, its open set is pruned (throttled) and asked again."""
        k = self.keys.shard(job_id)
        others = sum(self._open_in(tenant, j, False) for j in range(self.keys.shards) if j != k)
        keys = [self.open_key(tenant, k), self.keys.tenants_in(k)]
        args = [limit - others, job_id, tenant]
        ok, n = self._admit_job(keys=keys, args=args)
        if not ok and self._prune_due(tenant, k):
            self._prune(tenant, k)
            ok, n = self._admit_job(keys=keys, args=args)
        return bool(ok), int(n) + others

    def unreserve(self, tenant: str, job_id: str) -> None:
        """Give back a reservation whose job was not created (an idempotent duplicate)."""
        self.r.srem(self.open_key(tenant, self.keys.shard(job_id)), job_id)

    def open_jobs(self, tenant: str, *, force: bool = False) -> int:
        """Open jobs after a (throttled, unless ``force``) prune."""
        return sum(self._open_in(tenant, k, force) for k in range(self.keys.shards))

    def _open_in(self, tenant: str, shard: int, force: bool) -> int:
        if force or self._prune_due(tenant, shard):
            return self._prune(tenant, shard)
        return int(self.r.scard(self.open_key(tenant, shard)))

    def _prune_due(self, tenant: str, shard: int) -> bool:
        """The throttle: true at most once per :data:`PRUNE_EVERY_MS` per tenant and shard."""
        throttle = f"{self.base(tenant, shard)}:prune"
        return bool(self.r.set(throttle, "1", nx=True, px=PRUNE_EVERY_MS))

    def _prune(self, tenant: str, shard: int) -> int:
        """Prune every member of one shard's open set (:data:`COUNT_OPEN`, its members read
        first and declared); returns the open count after."""
        head = self._shard_keys(tenant, shard)[:2]
        ids = sorted(self.r.smembers(head[0]))
        n = 0
        for i in range(0, max(len(ids), 1), PRUNE_CHUNK):
            part = ids[i : i + PRUNE_CHUNK]
            n = int(self._count(keys=head + [self.keys.job(j) for j in part], args=part))
        return n

    # ----------------------------------------------------------------------------- files
    def admit_file(self, tenant: str, file_key_prefix: str, file_id: str, size: int, limit: int):
        """Count a new file against the tenant's ``limit`` bytes (0: none): (admitted, bytes)."""
        self._drop_gone(tenant, file_key_prefix)
        keys = [self.files_key(tenant), self.index]
        ok, total = self._admit_file(keys=keys, args=[file_id, size, limit, tenant])
        return bool(ok), int(total)

    def file_bytes(self, tenant: str, file_key_prefix: str) -> int:
        self._drop_gone(tenant, file_key_prefix)
        keys = [self.files_key(tenant), self.index]
        return int(self._admit_file(keys=keys, args=["", "", 0, tenant])[1])

    def _drop_gone(self, tenant: str, file_key_prefix: str) -> None:
        """Drop the entries of deleted files before ADMIT_FILE sums the hash. Done here, not
        in the script: each file key is its own (on a cluster in a slot of its own), and a
        script touches only the keys it declares. A file deleted between this and the sum is
        still counted (an over-count: a limit errs on refusing; the next count drops it)."""
        key = self.files_key(tenant)
        ids = sorted(self.r.hkeys(key))
        pipe = self.r.pipeline(transaction=False)
        for fid in ids:
            pipe.exists(self.keys.file(fid) if self.keys.cluster else file_key_prefix + fid)
        gone = [fid for fid, n in zip(ids, pipe.execute() if ids else [], strict=True) if not n]
        if gone:
            self.r.hdel(key, *gone)

    # ----------------------------------------------------------------------------- usage
    def tenants(self) -> list[str]:
        names: set[str] = set()
        for k in range(self.keys.shards):
            names |= self.r.smembers(self.keys.tenants_in(k))
        return sorted(names)

    def usage(self, tenant: str, file_key_prefix: str) -> TenantUsage:
        """Counts of one tenant. Prunes its open set first, unthrottled: an ended job still in
        the set is neither queued nor running, so a skipped prune would leave it out of
        ``jobs_finished`` (the prune costs about what the status reads below cost anyway)."""
        self.open_jobs(tenant, force=True)
        ids: list[str] = []
        tokens = jobs = 0
        for k in range(self.keys.shards):
            ids += sorted(self.r.smembers(self.open_key(tenant, k)))
            stats = self.r.hgetall(self.stats_key(tenant, k))
            tokens += int(stats.get("tokens", 0))
            jobs += int(stats.get("jobs", 0))
        pipe = self.r.pipeline(transaction=False)
        for jid in ids:
            pipe.hmget(self.keys.job(jid), "status", "tokens_generated")
        rows: list[Any] = pipe.execute() if ids else []
        queued = sum(1 for s, _ in rows if s == "queued")
        running = sum(1 for s, _ in rows if s in ("running", "cancelling"))
        live_tokens = sum(int(t or 0) for s, t in rows if s in ("running", "cancelling"))
        return TenantUsage(
            tenant=tenant,
            queued=queued,
            running=running,
            file_bytes=self.file_bytes(tenant, file_key_prefix),
            tokens_generated=tokens + live_tokens,
            jobs_finished=jobs,
        )
