"""OpenAI-style files and batches in Redis (JSON only). Key names come from :mod:`pagedserve.keys`.

Layout (prefix ``ps``)::

    ps:file:{id}             hash   meta (file object JSON); content (an uploaded file's text)
    ps:file:{id}:chunks      list   a generated file's text in chunks (no size cap)
    ps:files                 zset   file id -> creation sequence number (list newest first)
    ps:batch:{id}            hash   obj (batch object JSON without counts), total, completed,
                                    failed, fanout (started | done), closed, output_ttl,
                                    finalize_attempts / _retry_at / _error, reconciled_at
    ps:batch:{id}:members    set    the batch's job ids, each added atomically with its job
    ps:batch:{id}:jobs       list   the batch's job ids in input order (when the fan-out ends)
    ps:batch:{id}:output     list   output-file lines
    ps:batch:{id}:errors     list   error-file lines (rejected input lines, failed jobs)
    ps:batch:{id}:counted    set    job ids already counted (each job is counted once)
    ps:batches               zset   batch id -> creation sequence number (list newest first)
    ps:batches:active        set    batches not yet in a final status (for beat tasks)

Life cycle: validating -> (fan_out) in_progress | failed -> (finalize) finalizing -> completed;
cancel: cancelling -> cancelled; past the completion window: expired (partial output kept); a
batch whose finalisation keeps failing: failed after ``finalize_attempts`` tries (with backoff).

Membership is server-owned: the fan-out enqueues each request with a
:class:`~pagedserve.store.BatchRef` (fields of the job record, and the members set); every line
is built by :func:`pagedserve.store.batch_line` and added by a script that checks membership, so
a job whose metadata names a batch is a plain job. Every request of a batch ends with exactly
one output or error line, counted once (the counted set guards every writer): a worker's fenced
final write (finish.lua); a job dead-lettered or cancelled without a worker's final write (the
store adds its line right after: lease, cancel, release); and, as a safety net for any other way
a job ends without its line (a process dying between those two steps, a lost job record),
:meth:`BatchStore.reconcile`, run by cancel / expire and periodically by ``finalize_ready``.
Once a batch writes its files it is ``closed``: no line is added after, so counts equal lines.

Files and finished batches expire: uploads after ``DEFAULT_FILE_TTL_S`` (or ``expires_after``),
a batch's output files and records after its ``output_expires_after`` (default the same 30 days).
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, Literal

import redis
from pydantic import BaseModel, ConfigDict, Field

from pagedserve.batch_checks import limit_errors
from pagedserve.keys import DEFAULT_PREFIX, Keys
from pagedserve.openai_format import (
    BATCH_CANCELLED,
    BATCH_EXPIRED,
    ENDPOINTS,
    JOB_LOST,
    LineError,
    line_error_line,
    parse_file,
)
from pagedserve.schemas import JobRequest, JobResult
from pagedserve.store import BatchRef, JobStore, LineAdd, batch_line
from pagedserve.tenants import ADMIT_FILE, DEFAULT_TENANT, QuotaExceeded

log = logging.getLogger(__name__)

#: Largest uploaded file (it lives in Redis memory). Generated files have no cap.
DEFAULT_MAX_FILE_BYTES = 64 * 1024 * 1024
#: Jobs per pipelined enqueue round trip.
ENQUEUE_CHUNK = 2000
#: Lines per chunk of a generated file (one LRANGE and one RPUSH each).
FILE_CHUNK_LINES = 1000
#: Entries read per round trip when a file listing is filtered by tenant (others' are skipped).
LIST_SCAN_WINDOW = 1000
#: Environment variable listing served models (comma-separated); empty accepts any model.
MODELS_ENV = "PAGEDSERVE_MODELS"
#: How often ``finalize_ready`` reconciles an in-progress batch whose counts are short (s).
DEFAULT_RECONCILE_EVERY_S = 30.0
#: How long files and finished batches are kept by default (OpenAI's default for batch files).
DEFAULT_FILE_TTL_S = 30 * 24 * 3600
#: ``expires_after`` / ``output_expires_after`` bounds (OpenAI's: one hour to 30 days).
MIN_TTL_S, MAX_TTL_S = 3600, 30 * 24 * 3600
#: Tries before a batch whose finalisation keeps failing is failed, and the first backoff (s).
DEFAULT_FINALIZE_ATTEMPTS = 5
DEFAULT_FINALIZE_BACKOFF_S = 2.0

BatchStatus = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
FINAL_STATUSES = frozenset({"failed", "completed", "expired", "cancelled"})


def _new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}" if kind == "file" else f"{kind}_{uuid.uuid4().hex}"


def parse_window(window: str) -> int:
    """A completion window (``24h``; also ``90m``, ``30s``) in seconds."""
    m = re.fullmatch(r"(\d+)([smh])", window)
    if not m or int(m.group(1)) <= 0:
        raise ValueError(f"completion_window must look like '24h', got {window!r}")
    return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]


class FileObject(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    expires_at: int | None = None


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]] = Field(default_factory=list)


class Batch(BaseModel):
    """The OpenAI batch object."""

    model_config = ConfigDict(extra="forbid")

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None


def check_ttl(seconds: int, what: str = "expires_after") -> int:
    """An ``expires_after`` / ``output_expires_after`` duration, checked against OpenAI's bounds."""
    if not MIN_TTL_S <= seconds <= MAX_TTL_S:
        raise ValueError(f"{what}.seconds must be between {MIN_TTL_S} and {MAX_TTL_S}")
    return seconds


class FileStore:
    """Uploaded and generated files (text) in Redis, listed newest first, each with a TTL."""

    def __init__(
        self,
        r: redis.Redis,
        prefix: str = DEFAULT_PREFIX,
        max_bytes: int = DEFAULT_MAX_FILE_BYTES,
        ttl_s: int = DEFAULT_FILE_TTL_S,
    ):
        self.r = r
        self.keys = Keys(prefix)
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._admit_file = r.register_script(ADMIT_FILE)

    def key(self, file_id: str) -> str:
        return self.keys.file(file_id)

    def _new(self, size: int, filename: str, purpose: str, ttl_s: int | None) -> FileObject:
        if purpose not in ("batch", "batch_output"):
            raise ValueError(f"unsupported purpose {purpose!r}")
        now = int(self.r.time()[0])
        return FileObject(
            id=_new_id("file"),
            bytes=size,
            created_at=now,
            filename=filename,
            purpose=purpose,
            expires_at=now + (self.ttl_s if ttl_s is None else ttl_s),
        )

    def _register(self, pipe: redis.client.Pipeline, f: FileObject, tenant: str | None) -> None:
        """Queue the meta (and owner), the listing entry and the TTL of ``f`` on ``pipe``."""
        key = self.key(f.id)
        pipe.hset(key, "meta", f.model_dump_json())
        if tenant is not None:
            pipe.hset(key, "tenant", tenant)
        pipe.expireat(key, f.expires_at or 0)
        pipe.expireat(self.keys.file_chunks(f.id), f.expires_at or 0)
        pipe.zadd(self.keys.files, {f.id: self.r.incr(self.keys.files_seq)})

    def create(
        self,
        content: bytes | str,
        filename: str,
        purpose: str = "batch",
        *,
        expires_after_s: int | None = None,
        tenant: str | None = None,
        tenant_max_bytes: int = 0,
    ) -> FileObject:
        """Store an uploaded file (at most ``max_bytes``); with ``tenant``, it is the file's owner
        (its own ``tenant`` field) and the file counts against the tenant's ``tenant_max_bytes``
        (0: no limit): over it, the file is removed again and
        :class:`~pagedserve.tenants.QuotaExceeded` raised."""
        data = content.encode() if isinstance(content, str) else content
        if len(data) > self.max_bytes:
            raise ValueError(f"file is {len(data)} bytes; the limit is {self.max_bytes}")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"file is not UTF-8 text: {e}") from e
        obj = self._new(len(data), filename, purpose, expires_after_s)
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.key(obj.id), "content", text)
        self._register(pipe, obj, tenant)
        pipe.execute()
        if tenant is not None:
            self._count_bytes(obj, tenant, tenant_max_bytes)
        return obj

    def create_from_list(
        self,
        lines_key: str,
        filename: str,
        purpose: str,
        *,
        expires_after_s: int | None = None,
        tenant: str | None = None,
    ) -> FileObject | None:
        """A generated file made of the lines of the Redis list ``lines_key`` (one per line),
        copied in chunks of :data:`FILE_CHUNK_LINES` (no size cap); ``None`` for an empty list.
        With ``tenant`` the file is that tenant's and its bytes count among the tenant's, never
        refused (a batch's results are not lost to the limit)."""
        n = self.r.llen(lines_key)
        if n == 0:
            return None
        file_id = _new_id("file")
        chunks = self.keys.file_chunks(file_id)
        size = 0
        for start in range(0, n, FILE_CHUNK_LINES):
            part = self.r.lrange(lines_key, start, start + FILE_CHUNK_LINES - 1)
            text = "".join(x + "\n" for x in part)
            size += len(text.encode())
            self.r.rpush(chunks, text)
            self.r.expire(chunks, MAX_TTL_S)  # bounded even if this process dies midway
        obj = self._new(size, filename, purpose, expires_after_s).model_copy(update={"id": file_id})
        pipe = self.r.pipeline(transaction=True)
        self._register(pipe, obj, tenant)
        pipe.execute()
        if tenant is not None:
            self._count_bytes(obj, tenant, 0)
        return obj

    def _count_bytes(self, obj: FileObject, tenant: str, limit: int) -> None:
        """Count a file just written among its tenant's bytes (after it exists: the count drops
        entries whose file is gone); over ``limit`` (0: none) it is deleted again."""
        keys = [self.keys.tenant_files(tenant), self.keys.tenants]
        ok, total = self._admit_file(
            keys=keys, args=[self.key(""), obj.id, obj.bytes, limit, tenant]
        )
        if not ok:
            self.delete(obj.id)
            raise QuotaExceeded("file bytes", int(total) + obj.bytes, limit)

    def owner(self, file_id: str) -> tuple[bool, str | None]:
        """(whether the file exists, its tenant) in one round trip."""
        meta, tenant = self.r.hmget(self.key(file_id), "meta", "tenant")
        return meta is not None, tenant

    def get(self, file_id: str) -> FileObject | None:
        meta = self.r.hget(self.key(file_id), "meta")
        return FileObject.model_validate_json(meta) if meta else None

    def iter_content(self, file_id: str) -> Iterator[str] | None:
        """The file's text in pieces (``None`` for an unknown file): streams a large file."""
        key = self.key(file_id)
        text, meta = self.r.hmget(key, "content", "meta")
        if meta is None:
            return None
        if text is not None:
            return iter([text])
        return self._chunks(file_id)

    def _chunks(self, file_id: str) -> Iterator[str]:
        key, i = self.keys.file_chunks(file_id), 0
        while True:
            part = self.r.lrange(key, i, i + 15)
            if not part:
                return
            yield from part
            i += len(part)

    def content(self, file_id: str) -> str | None:
        pieces = self.iter_content(file_id)
        return None if pieces is None else "".join(pieces)

    def delete(self, file_id: str) -> bool:
        """Delete a file; ``False`` if there was none."""
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self.key(file_id), self.keys.file_chunks(file_id))
        pipe.zrem(self.keys.files, file_id)
        deleted, _ = pipe.execute()
        return bool(deleted)

    def _after_rank(self, after: str, tenant: str | None) -> int:
        """Where the page after ``after`` starts; ``KeyError`` for an id not listed (or, with
        ``tenant``, another tenant's: its id is not revealed)."""
        rank = self.r.zrevrank(self.keys.files, after)
        meta, owner = self.r.hmget(self.key(after), "meta", "tenant")
        foreign = tenant is not None and meta is not None and (owner or DEFAULT_TENANT) != tenant
        if rank is None or foreign:
            raise KeyError(f"file {after} not found")
        return rank + 1

    def list(
        self,
        purpose: str | None = None,
        after: str | None = None,
        limit: int = 20,
        *,
        tenant: str | None = None,
    ) -> dict[str, Any]:
        """OpenAI's list shape, newest first; ``after`` is the last id of the previous page.
        Entries of expired files are dropped from the listing as they are met. With ``tenant``,
        only that tenant's files (one without a ``tenant`` field is the default tenant's)."""
        limit = max(1, min(limit, 10_000))
        start = 0 if after is None else self._after_rank(after, tenant)
        window = 2 * limit if tenant is None else max(2 * limit, LIST_SCAN_WINDOW)
        page: list[FileObject] = []
        more = False
        while not more:
            ids = self.r.zrevrange(self.keys.files, start, start + window)
            if not ids:
                break
            pipe = self.r.pipeline(transaction=False)
            for fid in ids:
                pipe.hmget(self.key(fid), "meta", "tenant")
            gone = []
            for fid, (meta, owner) in zip(ids, pipe.execute(), strict=True):
                if meta is None:
                    gone.append(fid)
                    continue
                if more or (tenant is not None and (owner or DEFAULT_TENANT) != tenant):
                    continue
                f = FileObject.model_validate_json(meta)
                if purpose is not None and f.purpose != purpose:
                    continue
                if len(page) == limit:
                    more = True
                else:
                    page.append(f)
            if gone:
                self.r.zrem(self.keys.files, *gone)
            start += len(ids) - len(gone)
        return {
            "object": "list",
            "data": [f.model_dump(mode="json") for f in page],
            "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None,
            "has_more": more,
        }


def _known_models_from_env() -> list[str]:
    return [m.strip() for m in os.environ.get(MODELS_ENV, "").split(",") if m.strip()]


class BatchStore:
    """Batches over a :class:`JobStore` (same Redis, same prefix)."""

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
        self.files = FileStore(self.r, self.keys.prefix, max_file_bytes)
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
                    if b.status in FINAL_STATUSES:
                        pipe.srem(self.active_key, batch_id)
                        ttl = int(h.get("output_ttl") or DEFAULT_FILE_TTL_S)
                        for k in self.keys.batch_all(batch_id):
                            pipe.expire(k, ttl)
                    pipe.execute()
                    return self.get(batch_id)
                except redis.WatchError:
                    continue

    def fan_out(self, batch_id: str) -> Batch | None:
        """Validate the input file and queue every valid line as a bulk job, a member of the
        batch (idempotent: a retried fan-out queues nothing twice). A cancel that lands while
        this runs stops further enqueueing; the jobs already queued are then cancelled here."""
        b = self.get(batch_id)
        if b is None:
            return None
        if not self._begin_fan_out(batch_id):
            b = self.get(batch_id)
            if b is not None and b.status == "cancelling":
                return self._settle_cancel(batch_id)
            return b
        content = self.files.content(b.input_file_id)
        if content is None:
            err = LineError(line=0, code="file_not_found", message=f"{b.input_file_id} is gone")
            return self._fail_validation(batch_id, [err])
        parsed = parse_file(
            content, endpoint=b.endpoint, known_models=self.known_models, batch_id=batch_id
        )
        fatal = parsed.format_errors or limit_errors(parsed)
        if fatal:
            return self._fail_validation(batch_id, fatal)
        tenant = self._field(batch_id, "tenant")
        job_ids = self._enqueue(batch_id, [(x.request, x.custom_id, x.url, x.model)
                                           for x in parsed.lines], tenant=tenant)  # fmt: skip
        err_lines = [line_error_line(e, batch_id) for e in parsed.request_errors]

        def start(cur: Batch, pipe: redis.client.Pipeline) -> bool:
            return self._start(batch_id, cur, pipe, parsed.total, job_ids, err_lines)

        out = self._update(batch_id, start)
        if out is not None and out.status == "cancelling":
            return self.cancel(batch_id)
        return out

    def _begin_fan_out(self, batch_id: str) -> bool:
        """Mark the fan-out started; ``False`` when it must not run (a batch no longer
        validating, or already fanned out), except that a fan-out interrupted midway (a crash,
        a cancel) runs again to the end."""
        state = self._field(batch_id, "fanout")
        if state == "done":
            return False

        def begin(b: Batch, pipe: redis.client.Pipeline) -> bool:
            if b.status == "validating" or (b.status == "cancelling" and state == "started"):
                pipe.hset(self.keys.batch(batch_id), "fanout", "started")
                return True
            return False

        self._update(batch_id, begin)
        return self._field(batch_id, "fanout") == "started"

    def _start(
        self,
        batch_id: str,
        cur: Batch,
        pipe: redis.client.Pipeline,
        total: int,
        job_ids: list[str],
        err_lines: list[str],
    ) -> bool:
        """End of the fan-out (runs once: the status and fanout guards): totals, the ordered
        job list, the rejected lines' error lines; validating -> in_progress."""
        if cur.status not in ("validating", "cancelling"):
            return False
        key = self.keys.batch(batch_id)
        pipe.hset(key, mapping={"total": total, "fanout": "done"})
        pipe.delete(self.jobs_key(batch_id))
        if job_ids:
            pipe.rpush(self.jobs_key(batch_id), *job_ids)
        # Jobs may already be appending lines and counting: add.
        if err_lines:
            pipe.rpush(self.keys.batch_errors(batch_id), *err_lines)
            pipe.hincrby(key, "failed", len(err_lines))
        if cur.status == "validating":
            cur.status = "in_progress"
            cur.in_progress_at = self._now()
        return True

    def _enqueue(
        self,
        batch_id: str,
        lines: Sequence[tuple[JobRequest, str, str, str]],
        tenant: str | None = None,
    ) -> list[str]:
        """Queue (request, custom id, url, model) lines, chunk by chunk, as jobs of ``tenant``
        (the batch's); stops early when the batch is being cancelled. Returns the ids of the
        jobs queued."""
        ids: list[str] = []
        for i in range(0, len(lines), ENQUEUE_CHUNK):
            if i and self._status(batch_id) != "validating":
                break
            part = lines[i : i + ENQUEUE_CHUNK]
            jobs = [(uuid.uuid4().hex, req) for req, *_ in part]
            refs = [BatchRef(batch_id, cid, url, model) for _, cid, url, model in part]
            ids += [got for got, _ in self.jobs.enqueue_many(jobs, batches=refs, tenant=tenant)]
        return ids

    def _status(self, batch_id: str) -> str | None:
        b = self.get(batch_id)
        return b.status if b is not None else None

    def _fail_validation(self, batch_id: str, errors: Sequence[LineError]) -> Batch | None:
        data = [
            {"code": e.code, "message": str(e), "param": None, "line": e.line or None}
            for e in errors
        ]

        def fail(b: Batch, pipe: redis.client.Pipeline) -> bool:
            pipe.hset(self.keys.batch(batch_id), "fanout", "done")
            if b.status == "cancelling":
                return True  # settled below
            if b.status != "validating":
                return False
            b.status = "failed"
            b.failed_at = self._now()
            b.errors = BatchErrors(data=data)
            return True

        out = self._update(batch_id, fail)
        if out is not None and out.status == "cancelling":
            return self._settle_cancel(batch_id)
        return out

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

    def reconcile(self, batch_id: str) -> int:
        """Add the line and count of every job of the batch that has ended (or whose record is
        gone) without being counted; returns how many. Idempotent and safe against concurrent
        worker writes: each job is counted at most once (the counted set, checked in Redis)."""
        if not self.r.exists(self.keys.batch(batch_id)):
            return 0
        self.r.hset(self.keys.batch(batch_id), "reconciled_at", self._now())
        counted = self.r.smembers(self.keys.batch_counted(batch_id))
        todo = [j for j in self.member_ids(batch_id) if j not in counted]
        added = 0
        for i in range(0, len(todo), ENQUEUE_CHUNK):
            part = todo[i : i + ENQUEUE_CHUNK]
            pipe = self.r.pipeline(transaction=False)
            for j in part:
                pipe.hmget(self.keys.job(j), "status", "result", "error", "custom_id",
                           "batch_url", "batch_model")  # fmt: skip
            adds = [
                a
                for j, row in zip(part, pipe.execute(), strict=True)
                if (a := self._final_line(batch_id, j, *row)) is not None
            ]
            added += self.jobs.add_batch_lines(adds)
        return added

    @staticmethod
    def _final_line(
        batch_id: str,
        job_id: str,
        status: str | None,
        res: str | None,
        error: str | None,
        custom_id: str | None,
        url: str | None,
        model: str | None,
    ) -> LineAdd | None:
        """The line of a job that has ended (or is gone); ``None`` while it has not."""
        ref = BatchRef(batch_id, custom_id or "", url or "", model or "")
        if status is None:
            msg = "the job's record is gone"
            ok, line = batch_line(ref, job_id, "failed", error=msg, code=JOB_LOST)
            return LineAdd(job_id, ref, ok, line, allow_missing=True)
        if status not in ("succeeded", "failed", "cancelled"):
            return None
        result = JobResult.model_validate_json(res) if status == "succeeded" and res else None
        if status == "succeeded" and result is None:
            status, error = "failed", "the job's result is gone"
        ok, line = batch_line(ref, job_id, status, result, error)
        return LineAdd(job_id, ref, ok, line)

    def cancel(self, batch_id: str) -> Batch | None:
        """Cancel every queued or running job; the batch is cancelled once none is running."""

        def mark(b: Batch, pipe: redis.client.Pipeline) -> bool:
            if b.status not in ("validating", "in_progress"):
                return False
            b.status = "cancelling"
            b.cancelling_at = self._now()
            return True

        b = self._update(batch_id, mark)
        if b is None or b.status != "cancelling":
            return b
        return self._settle_cancel(batch_id)

    def _settle_cancel(self, batch_id: str) -> Batch | None:
        """cancelling -> cancelled (with the partial output files) once the fan-out has ended
        (or never started) and no job is running; cancels any job still queued first."""
        if self._field(batch_id, "fanout") == "started":
            return self.get(batch_id)  # the fan-out cancels what it queued when it ends
        ids = self.member_ids(batch_id)
        statuses = self.jobs.statuses(ids)
        if any(s == "queued" for s in statuses):
            self._cancel_jobs(batch_id)
            statuses = self.jobs.statuses(ids)
        if any(s in ("running", "cancelling") for s in statuses):
            return self.get(batch_id)
        if self.get(batch_id) is None:
            return None
        self.reconcile(batch_id)
        files = self._write_files(batch_id)

        def done(b: Batch, pipe: redis.client.Pipeline) -> bool:
            if b.status != "cancelling":
                return False
            b.status = "cancelled"
            b.cancelled_at = self._now()
            b.output_file_id, b.error_file_id = files
            return True

        return self._update(batch_id, done)

    def _write_files(self, batch_id: str) -> tuple[str | None, str | None]:
        """Close the batch (no line is added after this) and write its output and error files
        from its line lists, in chunks."""
        self.r.hset(self.keys.batch(batch_id), "closed", 1)
        ttl = self._ttl(batch_id)
        tenant = self._field(batch_id, "tenant")
        ids: list[str | None] = []
        for key, kind in (
            (self.keys.batch_output(batch_id), "output"),
            (self.keys.batch_errors(batch_id), "error"),
        ):
            name = f"{batch_id}_{kind}.jsonl"
            f = self.files.create_from_list(
                key, name, "batch_output", expires_after_s=ttl, tenant=tenant
            )
            ids.append(f.id if f is not None else None)
        return ids[0], ids[1]

    def finalize(self, batch_id: str) -> Batch | None:
        """in_progress with every request counted -> finalizing -> completed (files written)."""

        def begin(b: Batch, pipe: redis.client.Pipeline) -> bool:
            c = b.request_counts
            if b.status != "in_progress" or c.completed + c.failed < c.total:
                return False
            b.status = "finalizing"
            b.finalizing_at = self._now()
            return True

        b = self._update(batch_id, begin)
        if b is None or b.status != "finalizing":
            return b
        files = self._write_files(batch_id)

        def end(cur: Batch, pipe: redis.client.Pipeline) -> bool:
            if cur.status != "finalizing":
                return False
            cur.status = "completed"
            cur.completed_at = self._now()
            cur.output_file_id, cur.error_file_id = files
            return True

        return self._update(batch_id, end)

    def finalize_ready(self) -> list[str]:
        """Finalize every complete batch and settle cancelling ones; returns the ids changed.
        Each batch is handled apart: one that fails (an error of its own) is retried with
        backoff and failed after ``finalize_attempts`` tries, and never holds up the others."""
        changed = []
        for bid in self.active():
            if not self._finalize_due(bid):
                continue
            try:
                if self._finalize_one(bid):
                    changed.append(bid)
            except redis.ConnectionError:
                raise
            except Exception as e:
                log.warning("batch %s: finalizing failed: %s", bid, e)
                if self._finalize_failed(bid, e):
                    changed.append(bid)
        return changed

    def _finalize_one(self, bid: str) -> bool:
        b = self.get(bid)
        if b is None:
            self.r.srem(self.active_key, bid)
            return False
        if b.status == "finalizing":  # a finalize interrupted midway: redo it
            b.status = "in_progress"
            self._update(bid, lambda cur, pipe: self._reset_finalizing(cur))
        if b.status == "cancelling":
            after = self._settle_cancel(bid)
        elif b.status == "in_progress":
            c = b.request_counts
            if c.completed + c.failed < c.total and self._reconcile_due(bid):
                self.reconcile(bid)
            after = self.finalize(bid)
        else:
            return False
        return after is not None and after.status != b.status

    def _finalize_due(self, batch_id: str) -> bool:
        retry_at = self._field(batch_id, "finalize_retry_at")
        return retry_at is None or self._now() >= float(retry_at)

    def _finalize_failed(self, batch_id: str, err: Exception) -> bool:
        """Count a failed try; schedule the next with backoff, or fail the batch after the
        last. Returns whether the batch failed."""
        key = self.keys.batch(batch_id)
        tries = int(self.r.hincrby(key, "finalize_attempts", 1))
        reason = f"finalizing failed {tries} times: {type(err).__name__}: {err}"
        delay = self.finalize_backoff_s * 2 ** (tries - 1)
        self.r.hset(
            key, mapping={"finalize_error": reason, "finalize_retry_at": self._now() + delay}
        )
        if tries < self.finalize_attempts:
            return False
        data = [{"code": "finalize_failed", "message": reason[:2000], "param": None, "line": None}]

        def fail(b: Batch, pipe: redis.client.Pipeline) -> bool:
            if b.status in FINAL_STATUSES:
                return False
            b.status = "failed"
            b.failed_at = self._now()
            b.errors = BatchErrors(data=data)
            return True

        after = self._update(batch_id, fail)
        return after is not None and after.status == "failed"

    def _reconcile_due(self, batch_id: str) -> bool:
        last = self._field(batch_id, "reconciled_at")
        return last is None or self._now() - int(last) >= self.reconcile_every_s

    @staticmethod
    def _reset_finalizing(b: Batch) -> bool:
        if b.status != "finalizing":
            return False
        b.status = "in_progress"
        return True

    def expire(self, now: int | None = None) -> list[str]:
        """Expire batches past ``expires_at``: cancel their jobs, keep their partial output; every
        request without a line yet (queued or running) gets a ``batch_expired`` error line. Each
        batch is handled apart: an error in one counts as a failed finalize try (see
        :meth:`finalize_ready`); the others go on."""
        now = self._now() if now is None else now
        expired = []
        for bid in self.active():
            try:
                if self._expire_one(bid, now):
                    expired.append(bid)
            except redis.ConnectionError:
                raise
            except Exception as e:
                log.warning("batch %s: expiring failed: %s", bid, e)
                self._finalize_failed(bid, e)  # counted with finalize's tries: failed in the end
        return expired

    def _expire_one(self, bid: str, now: int) -> bool:
        b = self.get(bid)
        if b is None or b.status not in ("validating", "in_progress") or b.expires_at > now:
            return False
        msg = "the batch expired before this request finished"
        self._cancel_jobs(bid, BATCH_EXPIRED, msg, count_running=True)
        self.reconcile(bid)
        files = self._write_files(bid)

        def mark(cur: Batch, pipe: redis.client.Pipeline) -> bool:
            if cur.status not in ("validating", "in_progress"):
                return False
            cur.status = "expired"
            cur.expired_at = now
            cur.output_file_id, cur.error_file_id = files
            return True

        after = self._update(bid, mark)
        return after is not None and after.status == "expired"
