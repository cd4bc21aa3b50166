"""Ending batches: reconcile (lines of jobs that ended without one), settle a cancel, write the
output and error files, finalize (with retries and backoff), expire past the window.
"""

from __future__ import annotations

import logging

import redis

from pagedserve.batchstore.models import (
    ENQUEUE_CHUNK,
    FINAL_STATUSES,
    Batch,
    BatchErrors,
)
from pagedserve.batchstore.records import BatchRecords
from pagedserve.openai_format import (
    BATCH_EXPIRED,
    JOB_LOST,
)
from pagedserve.schemas import JobResult
from pagedserve.store import BatchRef, LineAdd, batch_line

log = logging.getLogger("pagedserve.batches")


class Finalizing(BatchRecords):
    """Reconcile, finalize, cancel settlement and expiry of batches."""

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
        if b is None or b.status in FINAL_STATUSES:  # gone, or ended and not yet unlisted
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
