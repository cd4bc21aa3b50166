"""Batch records: create, read, list, the optimistic read-modify-write every transition goes
through, and the batch's job ids.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any

import redis

from pagedserve.batchstore.files import FileStore
from pagedserve.batchstore.models import (
    DEFAULT_FILE_TTL_S,
    DEFAULT_FINALIZE_ATTEMPTS,
    DEFAULT_FINALIZE_BACKOFF_S,
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_RECONCILE_EVERY_S,
    ENQUEUE_CHUNK,
    FINAL_STATUSES,
    Batch,
    RequestCounts,
    _known_models_from_env,
    _new_id,
    check_ttl,
    parse_window,
)
from pagedserve.keys import DEFAULT_PREFIX
from pagedserve.openai_format import (
    BATCH_CANCELLED,
    ENDPOINTS,
)
from pagedserve.store import JobStore

log = logging.getLogger("pagedserve.batches")


class BatchRecords:
    """Batches over a :class:`JobStore` (same Redis, same prefix): their records."""

    def __init__(
        self,
        store: JobStore | str | None = None,
        *,
        prefix: str = DEFAULT_PREFIX,
        known_models: Collection[str] | None = None,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        reconcile_every_s: float = DEFAULT_RECONCILE_EVERY_S,
        finalize_attempts: int = DEFAULT_FINALIZE_ATTEMPTS,
        finalize_backoff_s: float = DEFAULT_FINALIZE_BACKOFF_S,
    ) -> None:
        self.jobs = store if isinstance(store, JobStore) else JobStore(store, prefix=prefix)
        self.r = self.jobs.r
        self.keys = self.jobs.keys
        self.files = FileStore(self.r, self.keys.prefix, max_file_bytes, keys=self.keys)
        self.known_models = (
            list(known_models) if known_models is not None else _known_models_from_env()
        )
        self.reconcile_every_s = reconcile_every_s
        self.finalize_attempts = finalize_attempts
        self.finalize_backoff_s = finalize_backoff_s

    # ----------------------------------------------------------------------------- keys
    @property
    def index_key(self) -> str:
        return self.keys.batches

    @property
    def active_key(self) -> str:
        return self.keys.batches_active

    def jobs_key(self, batch_id: str) -> str:
        return self.keys.batch_jobs(batch_id)

    def _now(self) -> int:
        return int(self.r.time()[0])

    # ----------------------------------------------------------------------------- create / read
    def create(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
        *,
        output_expires_after_s: int | None = None,
        tenant: str | None = None,
    ) -> Batch:
        """A new batch (``validating``); its output files and, once it ends, its records expire
        ``output_expires_after_s`` after they are written (default 30 days). ``tenant`` is
        written as its own field, listed in the tenant's index, copied onto its jobs and output
        files."""
        if endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {endpoint!r}")
        window = parse_window(completion_window)
        ttl = DEFAULT_FILE_TTL_S if output_expires_after_s is None else output_expires_after_s
        check_ttl(ttl, "output_expires_after")
        f = self.files.get(input_file_id)
        if f is None:
            raise KeyError(f"file {input_file_id} not found")
        if f.purpose != "batch":
            raise ValueError(f"file {input_file_id} has purpose {f.purpose!r}, not 'batch'")
        now = self._now()
        seq = self.r.incr(self.keys.batches_seq)  # orders batches created in the same ms
        b = Batch(
            id=_new_id("batch"),
            endpoint=endpoint,
            input_file_id=input_file_id,
            completion_window=completion_window,
            status="validating",
            created_at=now,
            expires_at=now + window,
            metadata=metadata,
        )
        counts = {"total": 0, "completed": 0, "failed": 0, "output_ttl": ttl}
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.keys.batch(b.id), mapping=self._fields(b))
        pipe.hset(self.keys.batch(b.id), mapping=counts)
        if tenant is not None:
            pipe.hset(self.keys.batch(b.id), "tenant", tenant)
        if self.jobs.cluster:
            # The indexes are other slots: written once the batch exists (a process dying in
            # between leaves an unlisted batch that never started; its caller saw no answer).
            pipe.execute()
            if tenant is not None:
                self.r.zadd(self.keys.tenant_batches(tenant), {b.id: seq})
            self.r.zadd(self.index_key, {b.id: seq})
            self.r.sadd(self.active_key, b.id)
            return b
        if tenant is not None:
            pipe.zadd(self.keys.tenant_batches(tenant), {b.id: seq})
        pipe.zadd(self.index_key, {b.id: seq})
        pipe.sadd(self.active_key, b.id)
        pipe.execute()
        return b

    @staticmethod
    def _fields(b: Batch) -> dict[str, str]:
        return {"obj": b.model_dump_json(exclude={"request_counts"})}

    @staticmethod
    def _from_hash(h: dict[str, str]) -> Batch | None:
        if not h or "obj" not in h:
            return None
        b = Batch.model_validate_json(h["obj"])
        b.request_counts = RequestCounts(
            total=int(h.get("total", 0)),
            completed=int(h.get("completed", 0)),
            failed=int(h.get("failed", 0)),
        )
        return b

    def get(self, batch_id: str) -> Batch | None:
        return self._from_hash(self.r.hgetall(self.keys.batch(batch_id)))

    def _field(self, batch_id: str, name: str) -> str | None:
        return self.r.hget(self.keys.batch(batch_id), name)

    def _ttl(self, batch_id: str) -> int:
        return int(self._field(batch_id, "output_ttl") or DEFAULT_FILE_TTL_S)

    def owner(self, batch_id: str) -> tuple[bool, str | None]:
        """(whether the batch exists, its tenant) in one round trip."""
        obj, tenant = self.r.hmget(self.keys.batch(batch_id), "obj", "tenant")
        return obj is not None, tenant

    def list(
        self, after: str | None = None, limit: int = 20, *, tenant: str | None = None
    ) -> dict[str, Any]:
        """Newest first; ``after`` is the last id of the previous page (expired batches are
        dropped from the index as they are met). With ``tenant``, only that tenant's batches
        (its own index: another tenant's id as ``after`` is not found)."""
        limit = max(1, min(limit, 100))
        index = self.index_key if tenant is None else self.keys.tenant_batches(tenant)
        start = 0
        if after is not None:
            rank = self.r.zrevrank(index, after)
            if rank is None:
                raise KeyError(f"batch {after} not found")
            start = rank + 1
        ids = self.r.zrevrange(index, start, start + limit)  # one extra: has_more
        page = ids[:limit]
        pipe = self.r.pipeline(transaction=False)
        for bid in page:
            pipe.hgetall(self.keys.batch(bid))
        found = [(bid, self._from_hash(h)) for bid, h in zip(page, pipe.execute(), strict=True)]
        gone = [bid for bid, b in found if b is None]
        if gone:
            self.r.zrem(index, *gone)
            self.r.zrem(self.index_key, *gone)
        return {
            "object": "list",
            "data": [b.model_dump(mode="json") for _, b in found if b is not None],
            "first_id": page[0] if page else None,
            "last_id": page[-1] if page else None,
            "has_more": len(ids) > limit,
        }

    def active(self) -> list[str]:
        return sorted(self.r.smembers(self.active_key))

    # ----------------------------------------------------------------------------- transitions
    def _update(
        self, batch_id: str, change: Callable[[Batch, redis.client.Pipeline], bool]
    ) -> Batch | None:
        """Optimistic read-modify-write of a batch: ``change(batch, pipe)`` edits the batch (and
        may queue more commands) and returns whether to write; retried on concurrent writes. A
        batch reaching a final status leaves the active set and its keys get their TTL."""
        key = self.keys.batch(batch_id)
        while True:
            with self.r.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(key)
                    h = pipe.hgetall(key)
                    b = self._from_hash(h)
                    if b is None:
                        return None
                    pipe.multi()
                    if not change(b, pipe):
                        pipe.reset()
                        return b
                    pipe.hset(key, mapping=self._fields(b))
                    final = b.status in FINAL_STATUSES
                    if final and not self.jobs.cluster:
                        pipe.srem(self.active_key, batch_id)
                    if final:
                        ttl = int(h.get("output_ttl") or DEFAULT_FILE_TTL_S)
                        for k in self.keys.batch_all(batch_id):
                            pipe.expire(k, ttl)
                    pipe.execute()
                    if final and self.jobs.cluster:  # another slot (finalize_ready retries it)
                        self.r.srem(self.active_key, batch_id)
                    return self.get(batch_id)
                except redis.WatchError:
                    continue

    def job_ids(self, batch_id: str) -> list[str]:
        """The batch's job ids in input order (once the fan-out ended; members before)."""
        ids = self.r.lrange(self.jobs_key(batch_id), 0, -1)
        if ids or self._field(batch_id, "fanout") == "done":
            return ids
        return sorted(self.r.smembers(self.keys.batch_members(batch_id)))

    def member_ids(self, batch_id: str) -> list[str]:
        """Every job of the batch, also while the fan-out runs."""
        return sorted(self.r.smembers(self.keys.batch_members(batch_id)))

    def _cancel_jobs(
        self,
        batch_id: str,
        code: str = BATCH_CANCELLED,
        message: str = "the batch was cancelled before this request ran",
        count_running: bool = False,
    ) -> None:
        """Cancel every job; each queued one gets its ``code`` error line, and with
        ``count_running`` (expiry) each running one too (its worker adds no other)."""
        ids = self.member_ids(batch_id)
        for i in range(0, len(ids), ENQUEUE_CHUNK):
            self.jobs.cancel_many(
                ids[i : i + ENQUEUE_CHUNK], code=code, message=message, count_running=count_running
            )
