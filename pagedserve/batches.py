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
import uuid
from collections.abc import Sequence

import redis

from pagedserve.batch_checks import limit_errors
from pagedserve.batchstore.files import FileStore
from pagedserve.batchstore.finalize import Finalizing
from pagedserve.batchstore.models import (
    DEFAULT_FILE_TTL_S,
    DEFAULT_FINALIZE_ATTEMPTS,
    DEFAULT_FINALIZE_BACKOFF_S,
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_RECONCILE_EVERY_S,
    ENQUEUE_CHUNK,
    FILE_CHUNK_LINES,
    FINAL_STATUSES,
    LIST_SCAN_WINDOW,
    MAX_TTL_S,
    MIN_TTL_S,
    MODELS_ENV,
    Batch,
    BatchErrors,
    BatchStatus,
    FileObject,
    RequestCounts,
    check_ttl,
    parse_window,
)
from pagedserve.batchstore.records import BatchRecords
from pagedserve.openai_format import LineError, line_error_line, parse_file
from pagedserve.schemas import JobRequest
from pagedserve.store import BatchRef

log = logging.getLogger("pagedserve.batches")


class BatchStore(Finalizing, BatchRecords):
    """Batches over a :class:`JobStore` (same Redis, same prefix). The fan-out and cancel live
    here; records, finalisation and files in :mod:`pagedserve.batchstore`."""

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


__all__ = [
    "DEFAULT_FILE_TTL_S",
    "DEFAULT_FINALIZE_ATTEMPTS",
    "DEFAULT_FINALIZE_BACKOFF_S",
    "DEFAULT_MAX_FILE_BYTES",
    "DEFAULT_RECONCILE_EVERY_S",
    "ENQUEUE_CHUNK",
    "FILE_CHUNK_LINES",
    "FINAL_STATUSES",
    "LIST_SCAN_WINDOW",
    "MAX_TTL_S",
    "MIN_TTL_S",
    "MODELS_ENV",
    "Batch",
    "BatchErrors",
    "BatchStatus",
    "BatchStore",
    "FileObject",
    "FileStore",
    "RequestCounts",
    "check_ttl",
    "parse_window",
]
