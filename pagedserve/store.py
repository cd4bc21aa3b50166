"""The Redis job store: enqueue, lease, renew, reclaim, fenced writes, cancel.

Every state change is one Lua script (atomic on the server). The worker-side calls take lists and
run as pipelines so that a worker loop needs one or two round trips per engine step however many
jobs it runs: :meth:`JobStore.commit_step` writes all progress and final results of a step and
drains the worker's cancel set in one round trip.

Fencing: each lease carries a token (``fence``) that :meth:`claim` / :meth:`reclaim` increment. A
write succeeds only while the job's current fence equals the writer's, so a worker that lost its
lease (presumed dead, its entry reclaimed by another) can never overwrite the new owner's work.

Batch jobs: the batch fan-out enqueues with a :class:`BatchRef`, written as server-owned fields of
the job record (``batch_id``, ``custom_id``, ``batch_url``, ``batch_model``) together with the
job's entry in the batch's members set. Leases carry that ref back; the store builds the job's
batch line (:func:`batch_line`, the one builder) and the scripts add it only for a member of the
batch. Nothing a client writes (``metadata``, idempotency keys) ever names a batch: the metadata
keys and idempotency-key prefix the service reserves are refused (:func:`check_client_request`).
"""

from __future__ import annotations

import redis

from pagedserve.jobstore.admission import Admission, AdmissionRequest, Admitted
from pagedserve.jobstore.base import _SCRIPTS, Call, StoreBase, _load_lua
from pagedserve.jobstore.client_side import ClientSide
from pagedserve.jobstore.commits import Commits
from pagedserve.jobstore.leasing import Leasing
from pagedserve.jobstore.records import (
    DEFAULT_EVENTS_MAXLEN,
    DEFAULT_LEASE_MS,
    DEFAULT_MAX_DELIVERIES,
    DEFAULT_RETENTION_S,
    RESERVED_IDEMPOTENCY_PREFIX,
    RESERVED_METADATA_KEYS,
    TRANSIENT_REPLY_ERRORS,
    BatchRef,
    ClaimStats,
    Entry,
    FinalStatus,
    Finish,
    Lease,
    LineAdd,
    Progress,
    StepResult,
    WriteError,
    batch_keys,
    batch_line,
    check_client_request,
)
from pagedserve.jobstore.registry import WorkerRegistry
from pagedserve.keys import DEFAULT_PREFIX, Keys, env_shards
from pagedserve.redis_url import is_cluster
from pagedserve.redis_util import connect
from pagedserve.schemas import TERMINAL_STATUSES
from pagedserve.tenants import TAG_JOB, TenantBook


class JobStore(ClientSide, Leasing, Admission, Commits, WorkerRegistry, StoreBase):
    """All job state transitions against one Redis (see the module docstring). The methods live
    in :mod:`pagedserve.jobstore` by side: client (enqueue/get/cancel), leasing
    (claim/reclaim/renew), commits (progress/finish/release), registry (heartbeats/queues)."""

    def __init__(
        self,
        redis_client: redis.Redis | str | None = None,
        *,
        prefix: str = DEFAULT_PREFIX,
        retention_s: int = DEFAULT_RETENTION_S,
        lease_ms: int = DEFAULT_LEASE_MS,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        events_maxlen: int = DEFAULT_EVENTS_MAXLEN,
        shards: int | None = None,
    ) -> None:
        if redis_client is None or isinstance(redis_client, str):
            redis_client = connect(redis_client)
        self.r = redis_client
        self.cluster = is_cluster(redis_client)
        # Shards only mean something on a cluster; a single Redis keeps its one-shard layout.
        n = (shards if shards is not None else env_shards()) if self.cluster else 1
        self.keys = Keys(prefix, shards=n, cluster=self.cluster)
        self.retention_s = retention_s
        self.lease_ms = lease_ms
        self.max_deliveries = max_deliveries
        self.events_maxlen = events_maxlen
        self.stats = ClaimStats()
        # register_script only hashes locally; _exec sends EVALSHA and loads on NOSCRIPT.
        self._scripts = {name: self.r.register_script(_load_lua(name)) for name in _SCRIPTS}
        self._scripts["tag_tenant"] = self.r.register_script(TAG_JOB)
        self.tenants = TenantBook(self.r, self.keys)
        self._groups_ready = False
        # Per consumer and stream: where re-reading the consumer's own pending entries has got
        # to ("0" at first, None once exhausted). Only the first claims after a start read them.
        self._pending_cursor = {}
        self.malformed = []
        # Entries delivered to a consumer beyond what it asked for (a blocking read can return one
        # per stream); they are leased first at the next claim.
        self._stash = {}
        self._reclaim_cursor = {}
        # Which shard a blocking claim waits on next (a blocking read cannot span slots).
        self._block_turn = 0


__all__ = [
    "DEFAULT_EVENTS_MAXLEN",
    "DEFAULT_LEASE_MS",
    "DEFAULT_MAX_DELIVERIES",
    "DEFAULT_RETENTION_S",
    "RESERVED_IDEMPOTENCY_PREFIX",
    "RESERVED_METADATA_KEYS",
    "TERMINAL_STATUSES",
    "TRANSIENT_REPLY_ERRORS",
    "AdmissionRequest",
    "Admitted",
    "BatchRef",
    "Call",
    "ClaimStats",
    "Entry",
    "FinalStatus",
    "Finish",
    "JobStore",
    "Lease",
    "LineAdd",
    "Progress",
    "StepResult",
    "WriteError",
    "batch_keys",
    "batch_line",
    "check_client_request",
]
