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
    ps:batch:{id}[:...]     batch hash and its lists and sets (see pagedserve.batches)
    ps:bidem:{batch}:{hash} string a batch request's idempotency key (fan-out only)
    ps:file:{id}[:chunks]   hash   file meta (and content), list of content chunks
    ps:files                zset   file id -> creation sequence number
    ps:supervisor:restarts  hash   child name -> times ``pagedserve up`` restarted it
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pagedserve.settings import PREFIX

Priority = Literal["interactive", "bulk"]

#: Streams in the order workers read them: interactive work first.
PRIORITIES: tuple[Priority, ...] = ("interactive", "bulk")

#: The one consumer group every worker joins.
GROUP = "workers"

#: The key prefix when none is given, and the environment variable every process reads it from.
DEFAULT_PREFIX = PREFIX.default
PREFIX_ENV = PREFIX.name


def env_prefix() -> str:
    """The key prefix from ``PAGEDSERVE_PREFIX``, else :data:`DEFAULT_PREFIX`."""
    return PREFIX.text()


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix (several deployments can share one Redis)."""

    prefix: str = DEFAULT_PREFIX

    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def stream(self, priority: str) -> str:
        if priority not in PRIORITIES:
            raise ValueError(f"unknown priority {priority!r}; expected one of {PRIORITIES}")
        return f"{self.prefix}:jobs:{priority}"

    @property
    def dead(self) -> str:
        return f"{self.prefix}:dead"

    def events(self, job_id: str) -> str:
        return f"{self.prefix}:events:{job_id}"

    def idem(self, key: str) -> str:
        return f"{self.prefix}:idem:{key}"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    @property
    def cancel_prefix(self) -> str:
        return f"{self.prefix}:cancel:"

    def cancel(self, consumer: str) -> str:
        return f"{self.cancel_prefix}{consumer}"

    # ------------------------------------------------------------------ batches and files
    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}"

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
        """A batch request's idempotency key: outside ``idem``, which clients write."""
        return f"{self.prefix}:bidem:{batch_id}:{digest}"

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
        return f"{self.prefix}:file:{file_id}"

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
        """Set of every tenant that has written something (pagedserve.tenants)."""
        return f"{self.prefix}:tenants"

    def tenant(self, tenant: str) -> str:
        """Base of one tenant's keys: ``:open`` (set of open job ids), ``:stats`` (hash),
        ``:files`` (hash file id -> bytes), ``:prune`` (throttle), ``:batches`` (zset)."""
        return f"{self.prefix}:tenant:{tenant}"

    def tenant_batches(self, tenant: str) -> str:
        """One tenant's batches, like ``{prefix}:batches`` (the newest-first list)."""
        return f"{self.tenant(tenant)}:batches"

    def tenant_files(self, tenant: str) -> str:
        """One tenant's stored files: hash file id -> bytes (pagedserve.tenants)."""
        return f"{self.tenant(tenant)}:files"

    @property
    def supervisor_restarts(self) -> str:
        return f"{self.prefix}:supervisor:restarts"
