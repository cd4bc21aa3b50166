"""The service loop's writer: the writes of running jobs (progress deltas, final writes) and the
drain of the worker's cancel set go to Redis on a thread of their own, so that an engine step
never waits for a round trip.

At fast steps (a small model on a CPU, any model on a GPU) one pipelined round trip per step
costs a good part of the step. The loop hands its writes over with :meth:`Writer.put` (no I/O),
the thread sends whatever piled up meanwhile as one :meth:`JobStore.commit_step` pipeline while
the loop steps on, and the loop collects what Redis answered (refused writes, write errors,
cancel requests) with :meth:`Writer.take_reports` and acts on it on its own thread.

What stays as it was:

- **Order.** Batches are sent one at a time, in order; within one, progress comes before final
  writes. Pending deltas of one job, lease and completion are merged into one (text and token ids
  concatenated, the newest token count): per job they are written in the order they were put, and
  a job's final write goes after its last delta. A slow Redis means fewer, larger writes, never a
  growing queue: what waits is one entry per running job and completion, and the final writes.
- **Fencing, exactly once.** Every write is the fenced script it was (``progress.lua``,
  ``finish.lua``: the result is written and the entry acked in one script, so a result is in
  Redis before its entry leaves the pending list). A refused write comes back with its fence.
- **Redis down.** The batch goes back in front of what came meanwhile and is retried with
  backoff (:class:`RedisGuard`, the writer's own); nothing is dropped, the loop goes on.
- **One job's error.** A write Redis answers with an error, or one that cannot be built, comes
  back as that job's :class:`WriteError`: the loop fails the job (its rules), the worker goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from pagedserve.store import Finish, JobStore, Progress, StepResult, WriteError
from worker.redis_guard import RedisDown, RedisGuard

log = logging.getLogger("pagedserve.worker")

#: What pending deltas are merged by: (job id, fence, completion index).
DeltaKey = tuple[str, int, int]


@dataclass
class Batch:
    """One round trip's worth of writes."""

    progress: dict[DeltaKey, Progress] = field(default_factory=dict)
    finals: list[Finish] = field(default_factory=list)
    cancels: bool = False  # drain the cancel set too

    def add(self, progress: Iterable[Progress], finals: Sequence[Finish]) -> None:
        for p in progress:
            key = (p.lease.job_id, p.lease.fence, p.index)
            old = self.progress.get(key)
            if old is not None:
                p = Progress(
                    p.lease,
                    max(old.tokens_generated, p.tokens_generated),
                    old.delta_text + p.delta_text,
                    (*old.delta_token_ids, *p.delta_token_ids),
                    p.index,
                )
            self.progress[key] = p
        self.finals += finals

    def updates(self) -> list[Progress]:
        """The merged deltas, each with its job's newest token count (a completion that had no
        new delta lately must not write an older count after another's newer one)."""
        newest: dict[tuple[str, int], int] = {}
        for (jid, fence, _), p in self.progress.items():
            newest[jid, fence] = max(newest.get((jid, fence), 0), p.tokens_generated)
        return [
            p if p.tokens_generated == newest[jid, fence] else
            replace(p, tokens_generated=newest[jid, fence])
            for (jid, fence, _), p in self.progress.items()
        ]  # fmt: skip


class Writer:
    """A thread writing the service loop's job writes to Redis (see the module docstring).

    ``cancel_poll_s``: while the loop has running jobs (its last ``put(..., cancels=True)``),
    the cancel set is drained with every batch, and at least this often when there is nothing
    to write (the thread keeps that time itself: ``put`` wakes it only for writes).
    """

    def __init__(self, store: JobStore, consumer: str, cancel_poll_s: float = 0.025) -> None:
        self.store = store
        self.consumer = consumer
        self.cancel_poll_s = cancel_poll_s
        self.guard = RedisGuard(store)
        self._cv = threading.Condition()
        self._pending = Batch()
        self._reports: list[StepResult] = []
        self._inflight = 0  # final writes being sent (0 also when only progress is)
        self._sending = False
        self._waiting = False  # the thread waits for work (put() wakes it only then)
        self._poll_cancels = False
        self._closed = False
        self._last_cancel_poll = 0.0
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- the loop's side
    def put(self, progress: Sequence[Progress], finals: Sequence[Finish], cancels: bool) -> None:
        """Queue writes; ``cancels``: whether the cancel set is to be drained from now on (the
        loop has running jobs)."""
        if not (progress or finals) and cancels == self._poll_cancels:
            return  # nothing new: no lock, no wake-up
        with self._cv:
            if self._closed:
                raise RuntimeError("writer closed")
            wake = self._waiting and (progress or finals or cancels)
            self._pending.add(progress, finals)
            self._poll_cancels = cancels
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="pagedserve-writer", daemon=True
                )
                self._thread.start()
            if wake:  # a sending thread looks at what is pending when its round trip is done
                self._cv.notify()

    def take_reports(self) -> list[StepResult]:
        """What Redis answered to the batches sent since the last call, in order."""
        if not self._reports:  # read without the lock: a list's truth value is atomic
            return []
        with self._cv:
            out, self._reports = self._reports, []
        return out

    def idle(self) -> bool:
        """Nothing waiting to be written, nothing on its way, no report left to take."""
        with self._cv:
            p = self._pending
            return not (p.progress or p.finals or self._sending or self._reports)

    def unsent_finals(self) -> int:
        with self._cv:
            return len(self._pending.finals) + self._inflight

    def flush(self, timeout: float) -> bool:
        """Wait until every write put so far is written (or ``timeout``); ``True`` if it was."""
        with self._cv:
            return self._cv.wait_for(
                lambda: not (self._pending.progress or self._pending.finals or self._sending),
                timeout,
            )

    def close(self, timeout: float) -> bool:
        """Write what is pending (retrying a down Redis for up to ``timeout`` seconds) and stop
        the thread. ``True`` if everything was written."""
        done = self.flush(timeout)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(max(0.1, timeout) if done else 0.1)
        return done

    # ----------------------------------------------------------------- the thread
    def _run(self) -> None:
        while True:
            with self._cv:
                batch = self._next_batch()
                if batch is None:
                    return
                self._sending = True
                self._inflight = len(batch.finals)
            report = self._send(batch)
            with self._cv:
                self._sending = False
                self._inflight = 0
                if report is None:  # Redis down: in front of what came meanwhile, retried
                    batch.add(self._pending.progress.values(), self._pending.finals)
                    batch.cancels = False
                    self._pending = batch
                else:
                    self._reports.append(report)
                self._cv.notify_all()

    def _next_batch(self) -> Batch | None:
        """Under the lock: wait for something to send (``None``: closed)."""
        try:
            self._waiting = True
            return self._take()
        finally:
            self._waiting = False

    def _take(self) -> Batch | None:
        while True:
            if self._closed:  # close() gave the last writes their time
                return None
            p = self._pending
            now = time.monotonic()
            if not self.guard.ok and now < self.guard.retry_at:
                self._cv.wait(self.guard.retry_at - now)
                continue
            if p.progress or p.finals:
                break
            if self._poll_cancels:
                due = self._last_cancel_poll + self.cancel_poll_s - now
                if due <= 0:
                    break
                self._cv.wait(due)
            else:
                self._cv.wait()
        self._pending = Batch()
        p.cancels = self._poll_cancels
        if p.cancels:
            self._last_cancel_poll = time.monotonic()
        return p

    def _send(self, batch: Batch) -> StepResult | None:
        """One round trip; ``None`` when Redis is down (the batch is kept)."""
        consumer = self.consumer if batch.cancels else None
        updates = batch.updates()
        try:
            return self.guard.call(
                self.store.commit_step, consumer, progress=updates, finished=batch.finals
            )
        except RedisDown:
            return None
        except Exception as e:  # an unexpected reply or a bug: the batch's jobs fail, not us
            log.exception("writer: batch of %d writes failed", len(updates) + len(batch.finals))
            msg = f"{type(e).__name__}: {e}"
            errors = [WriteError(p.lease.job_id, msg) for p in updates]
            errors += [WriteError(f.lease.job_id, msg, f) for f in batch.finals]
            return StepResult(errors=errors)
