"""Every Redis key name the service uses, in one place, under a configurable prefix.

Layout (prefix ``ps`` by default)::

    ps:job:{id}             hash   the job record (request, status, owner, fence, times, result)
    ps:jobs:{priority}      stream one per priority, one consumer group (GROUP)
    ps:dead                 stream dead-lettered entries (delivered too often)
    ps:events:{id}          stream a job's progress deltas and its end event (capped)
    ps:idem:{key}           string idempotency key -> job id
    ps:worker:{id}          hash   a worker's heartbeat (with a TTL)
    ps:workers              zset   worker id -> last heartbeat time
    ps:cancel:{consumer}    set    job ids a worker must abort at its next step
    ps:affinity             hash   prefix signature -> the worker that holds its prefix cached
    ps:affinity:expiry      zset   prefix signature -> when that affinity lapses (ms, Redis clock)
    ps:window               hash   bulk entry id in the admission window -> 'entered ms|sig|job id'
    ps:batch:{id}[:...]     batch hash and its lists and sets (see pagedserve.batches)
    ps:bidem:{batch}:{hash} string a batch request's idempotency key (fan-out only)
    ps:file:{id}[:chunks]   hash   file meta (and content), list of content chunks
    ps:files                zset   file id -> creation sequence number
    ps:supervisor:restarts  hash   child name -> times ``pagedserve up`` restarted it
    ps:api:rejected         hash   error code -> 429 answers the API gave (``/metrics``)

Redis Cluster (``Keys(cluster=True)``; :mod:`pagedserve.redis_url`): every script must touch one
hash slot, so the job keys carry a *shard* tag. A shard is a hash tag ``{sK}``, K in
``0..shards-1`` (``PAGEDSERVE_SHARDS``); each job lives in shard ``crc32(job id) % shards`` with
everything its scripts touch::

    ps:{sK}:job:{id}  ps:{sK}:events:{id}  ps:{sK}:idem:{key}  ps:{sK}:bidem:{batch}:{hash}
    ps:{sK}:jobs:{priority}  ps:{sK}:dead  ps:{sK}:cancel:{consumer}
    ps:{s0}:affinity[:expiry]  ps:{s0}:window   (prefix admission: one shard only)
    ps:{w}:worker:{id}  ps:{w}:workers           (heartbeats, written together)
    ps:{w}:shards                                (the shard count, checked by every process)
    ps:{sK}:tenant:{t}:open|:stats|:prune  ps:{sK}:tenants  ps:{s0}:tenant:{t}:files
    ps:batch:{{id}}[:...]  ps:file:{{id}}[:chunks]  (each batch, each file: a slot of its own)

Batch jobs span two slots (the job's, the batch's): their line is a second, idempotent step
(``batch_count.lua``) right after the job's final write, and the fan-out adds members after their
enqueue; a process dying in between leaves work that reconcile / the re-run fan-out finishes.
The indexes (``batches``, ``batches:active``, ``files``) are written after the records they
list, outside the records' transaction.

An idempotency key's shard is ``crc32(key) % shards``; the store draws the job's id until it
lands there (:meth:`JobStore.enqueue_args`), so the key and the job share a slot. Workers read
every shard's streams (one consumer group per stream). Without a cluster the first layout
above is kept as it was (one shard, no tags): a single Redis needs no migration.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Literal

from pagedserve.settings import PREFIX, SHARDS

Priority = Literal["interactive", "bulk"]

#: Streams in the order workers read them: interactive work first.
PRIORITIES: tuple[Priority, ...] = ("interactive", "bulk")

#: The one consumer group every worker joins.
GROUP = "workers"

#: The consumer of GROUP holding the bulk look-ahead window (``admission.lua``): bulk entries read
#: ahead but not yet taken by a worker sit in its pending list. No process has this name.
WINDOW_CONSUMER = "~window"

#: The key prefix when none is given, and the environment variable every process reads it from.
DEFAULT_PREFIX = PREFIX.default
PREFIX_ENV = PREFIX.name


def env_prefix() -> str:
    """The key prefix from ``PAGEDSERVE_PREFIX``, else :data:`DEFAULT_PREFIX`."""
    return PREFIX.text()


def env_shards() -> int:
    """The number of job shards on a Redis Cluster from ``PAGEDSERVE_SHARDS`` (at least 1)."""
    n = SHARDS.integer()
    if n < 1:
        raise ValueError(f"{SHARDS.name} must be at least 1, not {n}")
    return n


def shard_of(text: str, shards: int) -> int:
    """The shard a job id (or an idempotency key) belongs to: computable from the text alone."""
    return zlib.crc32(text.encode()) % shards if shards > 1 else 0


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix (several deployments can share one Redis)."""

    prefix: str = DEFAULT_PREFIX
    #: Job shards (hash tags); more than one only on a cluster.
    shards: int = 1
    #: The cluster layout: job keys tagged with their shard (see the module docstring).
    cluster: bool = False

    def __post_init__(self) -> None:
        if self.shards < 1 or (self.shards > 1 and not self.cluster):
            raise ValueError(f"shards must be 1, or more on a Redis Cluster; not {self.shards}")

    def _in(self, shard: int) -> str:
        """The key base of one shard: ``ps:{sK}`` on a cluster, ``ps`` on a single Redis."""
        return f"{self.prefix}:{{s{shard}}}" if self.cluster else self.prefix

    def shard(self, job_id: str) -> int:
        return shard_of(job_id, self.shards)

    def idem_shard(self, key: str) -> int:
        """The shard of a client's idempotency key (its job is drawn to land there)."""
        return shard_of(key, self.shards)

    def batch_idem_shard(self, batch_id: str, digest: str) -> int:
        return shard_of(f"{batch_id}:{digest}", self.shards)

    def job(self, job_id: str) -> str:
        return f"{self._in(self.shard(job_id))}:job:{job_id}"

    def job_pattern(self, shard: int = 0) -> str:
        """SCAN/KEYS pattern of one shard's job records."""
        return f"{self._in(shard)}:job:*"

    def stream(self, priority: str, shard: int = 0) -> str:
        if priority not in PRIORITIES:
            raise ValueError(f"unknown priority {priority!r}; expected one of {PRIORITIES}")
        return f"{self._in(shard)}:jobs:{priority}"

    def job_stream(self, job_id: str, priority: str) -> str:
        """The priority stream of ``job_id``'s shard."""
        return self.stream(priority, self.shard(job_id))

    @property
    def dead(self) -> str:
        return self.dead_in(0)

    def dead_in(self, shard: int) -> str:
        """A shard's dead-letter stream (its lease script adds to it)."""
        return f"{self._in(shard)}:dead"

    def events(self, job_id: str) -> str:
        return f"{self._in(self.shard(job_id))}:events:{job_id}"

    def watch(self, job_id: str) -> str:
        """Set (with a time to live) while a reader follows the job's events: its worker then
        writes the job's progress at the streaming pace (``progress.lua``)."""
        return f"{self._in(self.shard(job_id))}:watch:{job_id}"

    def idem(self, key: str) -> str:
        return f"{self._in(self.idem_shard(key))}:idem:{key}"

    @property
    def _registry(self) -> str:
        return f"{self.prefix}:{{w}}" if self.cluster else self.prefix

    def worker(self, worker_id: str) -> str:
        return f"{self._registry}:worker:{worker_id}"

    @property
    def workers(self) -> str:
        return f"{self._registry}:workers"

    @property
    def shard_count(self) -> str:
        """String: the shard count the deployment's first process wrote (cluster only): a
        process configured otherwise refuses to start rather than miss shards."""
        return f"{self._registry}:shards"

    def cancel(self, consumer: str, shard: int = 0) -> str:
        """Set: ids of ``consumer``'s jobs (of one shard) that clients asked to cancel."""
        return f"{self._in(shard)}:cancel:{consumer}"

    @property
    def affinity(self) -> str:
        """Hash: prefix signature -> id of the worker whose cache holds that prefix."""
        return f"{self._in(0)}:affinity"

    @property
    def affinity_expiry(self) -> str:
        """Zset: prefix signature -> when its affinity lapses (ms; refreshed by the owner)."""
        return f"{self._in(0)}:affinity:expiry"

    @property
    def window(self) -> str:
        """Hash: bulk entry id in the admission window -> ``entered ms|signature|job id``."""
        return f"{self._in(0)}:window"

    # ------------------------------------------------------------------ batches and files
    def batch(self, batch_id: str) -> str:
        """The batch's hash; its other keys extend this name (one slot on a cluster)."""
        return (
            f"{self.prefix}:batch:{{{batch_id}}}"
            if self.cluster
            else f"{self.prefix}:batch:{batch_id}"
        )

    def batch_jobs(self, batch_id: str) -> str:
        """List: the batch's job ids in input order (written when the fan-out ends)."""
        return f"{self.batch(batch_id)}:jobs"

    def batch_members(self, batch_id: str) -> str:
        """Set: the batch's job ids, each added atomically with its job (enqueue.lua)."""
        return f"{self.batch(batch_id)}:members"

    def batch_output(self, batch_id: str) -> str:
        return f"{self.batch(batch_id)}:output"

    def batch_errors(self, batch_id: str) -> str:
        return f"{self.batch(batch_id)}:errors"

    def batch_counted(self, batch_id: str) -> str:
        return f"{self.batch(batch_id)}:counted"

    def batch_all(self, batch_id: str) -> tuple[str, ...]:
        """Every key of one batch (to expire them together)."""
        return (
            self.batch(batch_id),
            self.batch_jobs(batch_id),
            self.batch_members(batch_id),
            self.batch_output(batch_id),
            self.batch_errors(batch_id),
            self.batch_counted(batch_id),
        )

    def batch_idem(self, batch_id: str, digest: str) -> str:
        """A batch request's idempotency key: outside ``idem``, which clients write (in the
        shard its job is drawn to)."""
        shard = self.batch_idem_shard(batch_id, digest)
        return f"{self._in(shard)}:bidem:{batch_id}:{digest}"

    @property
    def batches(self) -> str:
        return f"{self.prefix}:batches"

    @property
    def batches_seq(self) -> str:
        return f"{self.prefix}:batches:seq"

    @property
    def batches_active(self) -> str:
        return f"{self.prefix}:batches:active"

    def file(self, file_id: str) -> str:
        """A file's hash; its chunk list extends this name (one slot on a cluster)."""
        return (
            f"{self.prefix}:file:{{{file_id}}}" if self.cluster else f"{self.prefix}:file:{file_id}"
        )

    def file_chunks(self, file_id: str) -> str:
        """List: a generated file's content in chunks (no size cap)."""
        return f"{self.file(file_id)}:chunks"

    @property
    def files(self) -> str:
        return f"{self.prefix}:files"

    @property
    def files_seq(self) -> str:
        return f"{self.prefix}:files:seq"

    # ----------------------------------------------------------------------------- tenants
    @property
    def tenants(self) -> str:
        """Set of every tenant that has written something (pagedserve.tenants); on a cluster
        shard 0's (each shard has one: :meth:`tenants_in`)."""
        return self.tenants_in(0)

    def tenants_in(self, shard: int) -> str:
        return f"{self._in(shard)}:tenants"

    def tenant(self, tenant: str) -> str:
        """Base of one tenant's keys: ``:open`` (set of open job ids), ``:stats`` (hash),
        ``:files`` (hash file id -> bytes), ``:prune`` (throttle), ``:batches`` (zset). On a
        cluster the first three are per shard (:meth:`tenant_in`; files: shard 0's)."""
        return f"{self.prefix}:tenant:{tenant}"

    def tenant_in(self, tenant: str, shard: int) -> str:
        """Base of one tenant's keys of one shard (the job accounting: beside its jobs)."""
        return f"{self._in(shard)}:tenant:{tenant}"

    def tenant_batches(self, tenant: str) -> str:
        """One tenant's batches, like ``{prefix}:batches`` (the newest-first list)."""
        return f"{self.tenant(tenant)}:batches"

    def tenant_files(self, tenant: str) -> str:
        """One tenant's stored files: hash file id -> bytes (pagedserve.tenants)."""
        return f"{self.tenant_in(tenant, 0)}:files"

    @property
    def supervisor_restarts(self) -> str:
        return f"{self.prefix}:supervisor:restarts"

    @property
    def api_rejected(self) -> str:
        return f"{self.prefix}:api:rejected"
