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
    ps:supervisor:restarts  hash   child name -> times ``pagedserve up`` restarted it
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Priority = Literal["interactive", "bulk"]

#: Streams in the order workers read them: interactive work first.
PRIORITIES: tuple[Priority, ...] = ("interactive", "bulk")

#: The one consumer group every worker joins.
GROUP = "workers"

DEFAULT_PREFIX = "ps"


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

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}"

    @property
    def supervisor_restarts(self) -> str:
        return f"{self.prefix}:supervisor:restarts"
