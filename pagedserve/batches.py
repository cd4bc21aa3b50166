"""OpenAI-style files and batches in Redis (JSON only).

Layout (prefix ``ps``)::

    ps:file:{id}             hash   meta (file object JSON), content (the file's text)
    ps:batch:{id}            hash   obj (batch object JSON without counts), total, completed, failed
    ps:batch:{id}:jobs       list   the batch's job ids
    ps:batch:{id}:output     list   output-file lines, appended by the fenced finish of each job
    ps:batch:{id}:errors     list   error-file lines (rejected input lines, failed jobs)
    ps:batch:{id}:counted    set    job ids already counted (each job is counted once)
    ps:batch:{id}            field  reconciled_at: when :meth:`BatchStore.reconcile` last ran
    ps:batches               zset   batch id -> creation sequence number (list newest first)
    ps:batches:seq           string that sequence
    ps:batches:active        set    batches not yet in a final status (for beat tasks)

Life cycle: validating -> (fan_out) in_progress | failed -> (finalize) finalizing -> completed;
cancel: cancelling -> cancelled; past the completion window: expired (partial output kept).

Every request of a batch ends with exactly one output or error line, counted once (the counted
set guards every writer): a worker's fenced final write (finish.lua); a job dead-lettered at claim
(lease.lua, ``dead_lettered``) or cancelled before a worker wrote it (cancel.lua and lease.lua,
``batch_cancelled``; ``batch_expired`` when the batch expires); and, as a safety net for any other
way a job ends without its line (a drain handing back a job being cancelled, a lost job record),
:meth:`BatchStore.reconcile`, run by cancel / expire and periodically by ``finalize_ready``.
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from collections.abc import Callable, Collection, Sequence
from typing import Any, Literal

import redis
from pydantic import BaseModel, ConfigDict, Field

from pagedserve.batch_checks import limit_errors
from pagedserve.keys import Keys
from pagedserve.openai_format import (
    BATCH_CANCELLED,
    BATCH_EXPIRED,
    ENDPOINTS,
    JOB_LOST,
    LineError,
    job_error_line,
    line_error_line,
    output_line,
    parse_file,
    unrun_error_line,
)
from pagedserve.schemas import JobRequest, JobResult
from pagedserve.store import JobStore, batch_keys
from pagedserve.tenants import ADMIT_FILE, QuotaExceeded

#: Largest uploaded file (it lives in Redis memory).
DEFAULT_MAX_FILE_BYTES = 64 * 1024 * 1024
#: Jobs per pipelined enqueue round trip.
ENQUEUE_CHUNK = 2000
#: Environment variable listing served models (comma-separated); empty accepts any model.
MODELS_ENV = "PAGEDSERVE_MODELS"
#: How often ``finalize_ready`` reconciles an in-progress batch whose counts are short (s).
DEFAULT_RECONCILE_EVERY_S = 30.0

#: Adds a job's line and count for :meth:`BatchStore.reconcile`, once (the counted set), and only
#: if the job has ended (or its record is gone): a job still running gets its line from its worker.
#: KEYS: job hash, batch hash, line list, counted set; ARGV: job id, line, counter field.
_RECONCILE_LUA = """
local s = redis.call('HGET', KEYS[1], 'status')
if s and s ~= 'succeeded' and s ~= 'failed' and s ~= 'cancelled' then
  return 0
end
if redis.call('EXISTS', KEYS[2]) == 0 or redis.call('SADD', KEYS[4], ARGV[1]) == 0 then
  return 0
end
redis.call('RPUSH', KEYS[3], ARGV[2])
redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
return 1
"""

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


class FileStore:
    """Uploaded and generated files (text) in Redis."""

    def __init__(self, r: redis.Redis, prefix: str = "ps", max_bytes: int = DEFAULT_MAX_FILE_BYTES):
        self.r = r
        self.prefix = prefix
        self.max_bytes = max_bytes
        self._admit_file = r.register_script(ADMIT_FILE)

    def key(self, file_id: str) -> str:
        return f"{self.prefix}:file:{file_id}"

    def create(
        self,
        content: bytes | str,
        filename: str,
        purpose: str = "batch",
        *,
        tenant: str | None = None,
        tenant_max_bytes: int = 0,
    ) -> FileObject:
        """Store a file; with ``tenant``, it is the file's owner (its own ``tenant`` field) and
        the file counts against the tenant's ``tenant_max_bytes`` (0: no limit): over it, the file
        is removed again and :class:`~pagedserve.tenants.QuotaExceeded` raised."""
        data = content.encode() if isinstance(content, str) else content
        if len(data) > self.max_bytes:
            raise ValueError(f"file is {len(data)} bytes; the limit is {self.max_bytes}")
        if purpose not in ("batch", "batch_output"):
            raise ValueError(f"unsupported purpose {purpose!r}")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"file is not UTF-8 text: {e}") from e
        obj = FileObject(
            id=_new_id("file"),
            bytes=len(data),
            created_at=int(self.r.time()[0]),
            filename=filename,
            purpose=purpose,
        )
        fields = {"meta": obj.model_dump_json(), "content": text}
        if tenant is not None:
            fields["tenant"] = tenant
        self.r.hset(self.key(obj.id), mapping=fields)
        if tenant is not None:
            self._count_bytes(obj, tenant, tenant_max_bytes)
        return obj

    def _count_bytes(self, obj: FileObject, tenant: str, limit: int) -> None:
        keys = [Keys(self.prefix).tenant_files(tenant), Keys(self.prefix).tenants]
        ok, total = self._admit_file(
            keys=keys, args=[self.key(""), obj.id, obj.bytes, limit, tenant]
        )
        if not ok:
            self.r.delete(self.key(obj.id))
            raise QuotaExceeded("file bytes", int(total) + obj.bytes, limit)

    def owner(self, file_id: str) -> tuple[bool, str | None]:
        """(whether the file exists, its tenant) in one round trip."""
        meta, tenant = self.r.hmget(self.key(file_id), "meta", "tenant")
        return meta is not None, tenant

    def get(self, file_id: str) -> FileObject | None:
        meta = self.r.hget(self.key(file_id), "meta")
        return FileObject.model_validate_json(meta) if meta else None

    def content(self, file_id: str) -> str | None:
        return self.r.hget(self.key(file_id), "content")


def _known_models_from_env() -> list[str]:
    return [m.strip() for m in os.environ.get(MODELS_ENV, "").split(",") if m.strip()]


class BatchStore:
    """Batches over a :class:`JobStore` (same Redis, same prefix)."""

    def __init__(
        self,
        store: JobStore | str | None = None,
        *,
        prefix: str = "ps",
        known_models: Collection[str] | None = None,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        reconcile_every_s: float = DEFAULT_RECONCILE_EVERY_S,
    ) -> None:
        self.jobs = store if isinstance(store, JobStore) else JobStore(store, prefix=prefix)
        self.r = self.jobs.r
        self.keys = self.jobs.keys
        self.files = FileStore(self.r, self.keys.prefix, max_file_bytes)
        self.known_models = (
            list(known_models) if known_models is not None else _known_models_from_env()
        )
        self.reconcile_every_s = reconcile_every_s
        self._reconcile_script = self.r.register_script(_RECONCILE_LUA)

    # ----------------------------------------------------------------------------- keys
    @property
    def index_key(self) -> str:
        return f"{self.keys.prefix}:batches"

    @property
    def active_key(self) -> str:
        return f"{self.keys.prefix}:batches:active"

    def jobs_key(self, batch_id: str) -> str:
        return f"{self.keys.batch(batch_id)}:jobs"

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
        tenant: str | None = None,
    ) -> Batch:
        """A new batch (``validating``); ``tenant`` is written as its own field, listed in the
        tenant's index, copied onto its jobs and output files."""
        if endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {endpoint!r}")
        window = parse_window(completion_window)
        f = self.files.get(input_file_id)
        if f is None:
            raise KeyError(f"file {input_file_id} not found")
        if f.purpose != "batch":
            raise ValueError(f"file {input_file_id} has purpose {f.purpose!r}, not 'batch'")
        now = self._now()
        seq = self.r.incr(f"{self.index_key}:seq")  # orders batches created in the same ms
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
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.keys.batch(b.id), mapping=self._fields(b))
        pipe.hset(self.keys.batch(b.id), mapping={"total": 0, "completed": 0, "failed": 0})
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

    def owner(self, batch_id: str) -> tuple[bool, str | None]:
        """(whether the batch exists, its tenant) in one round trip."""
        obj, tenant = self.r.hmget(self.keys.batch(batch_id), "obj", "tenant")
        return obj is not None, tenant

    def list(
        self, after: str | None = None, limit: int = 20, *, tenant: str | None = None
    ) -> dict[str, Any]:
        """Newest first; ``after`` is the last id of the previous page. With ``tenant``, only
        that tenant's batches (its own index: another tenant's id as ``after`` is not found)."""
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
        data = [b.model_dump(mode="json") for b in map(self._from_hash, pipe.execute()) if b]
        return {
            "object": "list",
            "data": data,
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
        may queue more commands) and returns whether to write; retried on concurrent writes."""
        key = self.keys.batch(batch_id)
        while True:
            with self.r.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(key)
                    b = self._from_hash(pipe.hgetall(key))
                    if b is None:
                        return None
                    pipe.multi()
                    if not change(b, pipe):
                        pipe.reset()
                        return b
                    pipe.hset(key, mapping=self._fields(b))
                    if b.status in FINAL_STATUSES:
                        pipe.srem(self.active_key, batch_id)
                    pipe.execute()
                    return self.get(batch_id)
                except redis.WatchError:
                    continue

    def fan_out(self, batch_id: str) -> Batch | None:
        """Validate the input file and queue every valid line as a bulk job (idempotent: the
        jobs carry idempotency keys, so a retried fan-out queues nothing twice)."""
        b = self.get(batch_id)
        if b is None or b.status != "validating":
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
        tenant = self.r.hget(self.keys.batch(batch_id), "tenant")
        job_ids = self._enqueue(batch_id, [x.request for x in parsed.lines], tenant=tenant)
        err_lines = [line_error_line(e, batch_id) for e in parsed.request_errors]
        _, _, errors_key, _ = batch_keys(self.keys, batch_id)

        def start(cur: Batch, pipe: redis.client.Pipeline) -> bool:
            if cur.status not in ("validating", "cancelling"):
                return False
            key = self.keys.batch(batch_id)
            pipe.hset(key, "total", parsed.total)
            pipe.delete(self.jobs_key(batch_id))
            if job_ids:
                pipe.rpush(self.jobs_key(batch_id), *job_ids)
            # Runs once (status guard); jobs may already be appending lines and counting: add.
            if err_lines:
                pipe.rpush(errors_key, *err_lines)
                pipe.hincrby(key, "failed", len(err_lines))
            if cur.status == "validating":
                cur.status = "in_progress"
                cur.in_progress_at = self._now()
            return True

        out = self._update(batch_id, start)
        if out is not None and out.status == "cancelling":
            return self.cancel(batch_id)
        return out

    def _enqueue(
        self, batch_id: str, requests: Sequence[JobRequest], tenant: str | None = None
    ) -> list[str]:
        ids: list[str] = []
        for i in range(0, len(requests), ENQUEUE_CHUNK):
            part = []
            for req in requests[i : i + ENQUEUE_CHUNK]:
                cid = (req.metadata or {})["custom_id"]
                digest = hashlib.sha256(cid.encode()).hexdigest()[:32]
                key = f"batch:{batch_id}:{digest}"
                part.append((uuid.uuid4().hex, req.model_copy(update={"idempotency_key": key})))
            ids += [got for got, _ in self.jobs.enqueue_many(part, tenant=tenant)]
        return ids

    def _fail_validation(self, batch_id: str, errors: Sequence[LineError]) -> Batch | None:
        data = [
            {"code": e.code, "message": str(e), "param": None, "line": e.line or None}
            for e in errors
        ]

        def fail(b: Batch, pipe: redis.client.Pipeline) -> bool:
            if b.status != "validating":
                return False
            b.status = "failed"
            b.failed_at = self._now()
            b.errors = BatchErrors(data=data)
            return True

        return self._update(batch_id, fail)

    def job_ids(self, batch_id: str) -> list[str]:
        return self.r.lrange(self.jobs_key(batch_id), 0, -1)

    def _cancel_jobs(
        self,
        batch_id: str,
        code: str = BATCH_CANCELLED,
        message: str = "the batch was cancelled before this request ran",
        count_running: bool = False,
    ) -> None:
        """Cancel every job; each queued one gets its ``code`` error line atomically (cancel.lua),
        and with ``count_running`` (expiry) each running one too (its worker adds no other)."""
        ids = self.job_ids(batch_id)
        js = self.jobs
        args = [js.keys.cancel_prefix, js.retention_s, js.events_maxlen, code, message]
        args.append("1" if count_running else "0")
        for i in range(0, len(ids), ENQUEUE_CHUNK):
            calls = [
                ("cancel", [js.keys.job(j), js.keys.events(j)], args)
                for j in ids[i : i + ENQUEUE_CHUNK]
            ]
            js._exec(calls)

    def reconcile(self, batch_id: str) -> int:
        """Add the line and count of every job of the batch that has ended (or whose record is
        gone) without being counted; returns how many. Idempotent and safe against concurrent
        worker writes: each job is counted at most once (the counted set, checked in Redis)."""
        bhash, out_key, err_key, counted_key = batch_keys(self.keys, batch_id)
        if not self.r.exists(bhash):
            return 0
        self.r.hset(bhash, "reconciled_at", self._now())
        counted = self.r.smembers(counted_key)
        todo = [j for j in self.job_ids(batch_id) if j not in counted]
        added = 0
        for i in range(0, len(todo), ENQUEUE_CHUNK):
            part = todo[i : i + ENQUEUE_CHUNK]
            pipe = self.r.pipeline(transaction=False)
            for j in part:
                pipe.hmget(self.keys.job(j), "status", "request", "result", "error")
            calls = []
            for j, (status, req, res, error) in zip(part, pipe.execute(), strict=True):
                got = self._final_line(j, status, req, res, error)
                if got is not None:
                    calls.append((j, *got))
            pipe = self.r.pipeline(transaction=False)
            for j, ok, line in calls:
                keys = [self.keys.job(j), bhash, out_key if ok else err_key, counted_key]
                field = "completed" if ok else "failed"
                self._reconcile_script(keys=keys, args=[j, line, field], client=pipe)
            added += sum(pipe.execute())
        return added

    @staticmethod
    def _final_line(
        job_id: str, status: str | None, req: str | None, res: str | None, error: str | None
    ) -> tuple[bool, str] | None:
        """(succeeded?, line) for a job that has ended (or is gone); None while it has not."""
        if status is None:
            return False, unrun_error_line(None, job_id, JOB_LOST, "the job's record is gone")
        if status not in ("succeeded", "failed", "cancelled"):
            return None
        try:
            request = JobRequest.model_validate_json(req or "")
        except ValueError:
            request = None
        if request is None or "custom_id" not in (request.metadata or {}):
            return False, unrun_error_line(request, job_id, JOB_LOST, "the job's request is gone")
        if status == "succeeded" and res:
            return True, output_line(request, job_id, JobResult.model_validate_json(res))
        return False, job_error_line(request, job_id, status, error)

    def _running(self, batch_id: str) -> int:
        sts = self.jobs.statuses(self.job_ids(batch_id))
        return sum(1 for s in sts if s in ("running", "cancelling"))

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
        self._cancel_jobs(batch_id)
        return self._settle_cancel(batch_id)

    def _settle_cancel(self, batch_id: str) -> Batch | None:
        """cancelling -> cancelled (with the partial output files) once no job is running."""
        if self._running(batch_id):
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
        _, out_key, err_key, _ = batch_keys(self.keys, batch_id)
        out = self.r.lrange(out_key, 0, -1)
        errs = self.r.lrange(err_key, 0, -1)
        tenant = self.r.hget(self.keys.batch(batch_id), "tenant")
        ids: list[str | None] = []
        for lines, kind in ((out, "output"), (errs, "error")):
            if not lines:
                ids.append(None)
                continue
            text = "".join(line + "\n" for line in lines)
            name = f"{batch_id}_{kind}.jsonl"
            f = self.files.create(text, name, purpose="batch_output", tenant=tenant)
            ids.append(f.id)
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
        """Finalize every complete batch and settle cancelling ones; returns the ids changed."""
        changed = []
        for bid in self.active():
            b = self.get(bid)
            if b is None:
                self.r.srem(self.active_key, bid)
                continue
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
                continue
            if after is not None and after.status != b.status:
                changed.append(bid)
        return changed

    def _reconcile_due(self, batch_id: str) -> bool:
        last = self.r.hget(self.keys.batch(batch_id), "reconciled_at")
        return last is None or self._now() - int(last) >= self.reconcile_every_s

    @staticmethod
    def _reset_finalizing(b: Batch) -> bool:
        if b.status != "finalizing":
            return False
        b.status = "in_progress"
        return True

    def expire(self, now: int | None = None) -> list[str]:
        """Expire batches past ``expires_at``: cancel their jobs, keep their partial output; every
        request without a line yet (queued or running) gets a ``batch_expired`` error line."""
        now = self._now() if now is None else now
        expired = []
        for bid in self.active():
            b = self.get(bid)
            if b is None or b.status not in ("validating", "in_progress") or b.expires_at > now:
                continue
            msg = "the batch expired before this request finished"
            self._cancel_jobs(bid, BATCH_EXPIRED, msg, count_running=True)
            self.reconcile(bid)
            files = self._write_files(bid)

            def mark(cur: Batch, pipe: redis.client.Pipeline, files: Any = files) -> bool:
                if cur.status not in ("validating", "in_progress"):
                    return False
                cur.status = "expired"
                cur.expired_at = now
                cur.output_file_id, cur.error_file_id = files
                return True

            after = self._update(bid, mark)
            if after is not None and after.status == "expired":
                expired.append(bid)
        return expired
