"""The service loop's writer: the writes of running jobs (progress deltas, final writes) and the
drain of the worker's cancel set go to Redis on a thread of their own, so that an engine step
never waits for a round trip.

At fast steps (a small model on a CPU, any model on a GPU) one pipelined round trip per step
costs a good part of the step. The loop hands its writes over with :meth:`Writer.put` (no I/O),
the thread sends whatever piled up meanwhile as one :meth:`JobStore.commit_step` pipeline while
the loop steps on, and the loop collects what Redis answered (refused writes, write errors,
cancel requests) with :meth:`Writer.take_reports` and acts on it on its own thread.

**How often.** Writes the loop marks urgent (an interactive job's: a streamed delta, a final
write someone waits on) wake the thread at once; all others wait for the next send, at most
``interval_s`` after the last one, and go together. Why: every wake of this thread takes the
interpreter lock from the loop, and getting it back costs the loop a thread switch; waking once
per step (bulk jobs' writes, each step's final writes) cost ``bench.service --preset tiny`` about
twice the loop's switches and ~5% of its throughput on a 2-core EPYC.

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

**The heartbeat** goes out on this thread too (:meth:`Writer.put_heartbeat`): the loop builds it
(it reads the engine's state), the thread writes it after the batch in hand. Only the newest
unsent one is kept; one Redis refused or could not take is not retried (the next one, a
``heartbeat_s`` later, replaces it). Why: its two round trips were the last Redis I/O the loop
did every second (``bench.service --preset tiny``: the loop's own time per round 0.288 -> 0.273
s, ~0.3% of the round; under py-spy, which inflates I/O, ~3% of the loop's samples).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pagedserve.store import Finish, JobStore, Progress, StepResult, WriteError
from worker.redis_guard import RedisDown, RedisGuard

log = logging.getLogger("pagedserve.worker")

#: How the failure reason of a job whose state Redis refused to write begins.
WRITE_FAILED = "could not write the job's state: "

#: What pending deltas are merged by: (job id, fence, completion index, attempt).
DeltaKey = tuple[str, int, int, int]


@dataclass
class Batch:
    """One round trip's worth of writes."""

    progress: dict[DeltaKey, Progress] = field(default_factory=dict)
    finals: list[Finish] = field(default_factory=list)
    cancels: bool = False  # drain the cancel set too
    #: Failed sends so far. Deltas sent once (Redis may have run them before the connection
    #: went) are sent again exactly as they were, and later ones never merge into them: the
    #: progress script skips a delta its lease already wrote, never half of one.
    attempt: int = 0

    def add(self, progress: Iterable[Progress], finals: Sequence[Finish]) -> None:
        for p in progress:
            key = (p.lease.job_id, p.lease.fence, p.index, self.attempt)
            old = self.progress.get(key)
            if old is not None:
                p = Progress(
                    p.lease,
                    max(old.tokens_generated, p.tokens_generated),
                    old.delta_text + p.delta_text,
                    (*old.delta_token_ids, *p.delta_token_ids),
                    p.index,
                    p.end,
                )
            self.progress[key] = p
        self.finals += finals

    def updates(self) -> list[Progress]:
        """The merged deltas, each with its job's newest token count (a completion that had no
        new delta lately must not write an older count after another's newer one)."""
        newest: dict[tuple[str, int], int] = {}
        for (jid, fence, _, _), p in self.progress.items():
            newest[jid, fence] = max(newest.get((jid, fence), 0), p.tokens_generated)
        return [
            p if p.tokens_generated == newest[jid, fence] else
            replace(p, tokens_generated=newest[jid, fence])
            for (jid, fence, _, _), p in self.progress.items()
        ]  # fmt: skip


class Writer:
    """A thread writing the service loop's job writes to Redis (see the module docstring).

    The loop's side takes no lock: :meth:`put` appends to a ``queue.SimpleQueue`` (which wakes
    the thread only when it waits on it), reports come back on another. The thread alone owns
    the batch being gathered, so a batch that Redis did not take simply stays in front of what
    comes after it. ``cancel_poll_s``: while the loop has running jobs (its last ``put(...,
    cancels=True)``), the cancel set is drained with every batch, and at least this often when
    there is nothing to write.
    """

    def __init__(
        self, store: JobStore, consumer: str, cancel_poll_s: float = 0.05, interval_s: float = 0.05
    ) -> None:
        self.store = store
        self.consumer = consumer
        self.cancel_poll_s = cancel_poll_s
        self.interval_s = interval_s
        self.guard = RedisGuard(store)
        self._queue: queue.SimpleQueue[tuple[Sequence[Progress], Sequence[Finish]]]
        self._queue = queue.SimpleQueue()
        self._wake = threading.Event()  # set by urgent puts, flush and close
        self._reports: queue.SimpleQueue[StepResult] = queue.SimpleQueue()
        self._done = threading.Condition()  # notified when writes are written (for flush)
        self._puts = self._written = 0  # writes put / written, counted by put() calls
        self._finals_put = self._finals_written = 0
        #: Jobs whose final write is put and not yet answered (read by the claimer's thread).
        self._finals_open: set[str] = set()
        #: Jobs whose delta Redis refused with an error (the reason), until their final write.
        self._broken: dict[str, str] = {}
        self._poll_cancels = False
        #: The newest heartbeat not written yet: (worker id, JSON-ready fields, TTL seconds).
        self._heartbeat: tuple[str, dict[str, Any], int] | None = None
        #: Heartbeats put / written or given up (for flush); these three under ``_done``'s lock.
        self._beats = self._beats_done = 0
        self._closed = False
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- the loop's side
    def put(
        self,
        progress: Sequence[Progress],
        finals: Sequence[Finish],
        cancels: bool,
        urgent: bool = True,
    ) -> None:
        """Queue writes; ``cancels``: whether the cancel set is to be drained from now on (the
        loop has running jobs); ``urgent``: send them now (else with the next send, at most
        ``interval_s`` after the last)."""
        if self._closed:
            raise RuntimeError("writer closed")
        self._poll_cancels = cancels
        if progress or finals or cancels:
            self._start()
        if not (progress or finals):
            return
        self._puts += 1
        self._finals_put += len(finals)
        self._finals_open.update(f.lease.job_id for f in finals)
        self._queue.put((progress, finals))
        if urgent:
            self._wake.set()

    def put_heartbeat(self, worker_id: str, info: dict[str, Any], ttl_s: int) -> None:
        """Have the thread publish this heartbeat (JSON-ready ``info``) soon, in place of one
        not written yet."""
        if self._closed:
            return
        with self._done:
            self._heartbeat = (worker_id, info, ttl_s)
            self._beats += 1
        self._start()
        self._wake.set()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pagedserve-writer", daemon=True)
            self._thread.start()

    def take_reports(self) -> list[StepResult]:
        """What Redis answered to the batches sent since the last call, in order."""
        out = []
        while not self._reports.empty():
            out.append(self._reports.get_nowait())
        return out

    def idle(self) -> bool:
        """Nothing waiting to be written or on its way, no report left to take."""
        return self._written == self._puts and self._reports.empty()

    def holds(self, job_id: str) -> bool:
        """Whether the job's final write is put and not answered yet: the worker still owns
        the job (its entry stays pending until that write acks it), so reclaim must leave it."""
        return job_id in self._finals_open

    def unsent_finals(self) -> int:
        return self._finals_put - self._finals_written

    def flush(self, timeout: float) -> bool:
        """Wait until every write put so far is written, and the newest heartbeat put so far
        written or given up (or ``timeout``); ``True`` if they were."""
        want, beats = self._puts, self._beats
        self._wake.set()
        with self._done:
            return self._done.wait_for(
                lambda: self._written >= want and self._beats_done >= beats, timeout
            )

    def close(self, timeout: float) -> bool:
        """Write what is pending (retrying a down Redis for up to ``timeout`` seconds) and stop
        the thread. ``True`` if everything was written."""
        with self._done:  # dropped: the worker deletes its heartbeat key as it exits
            self._heartbeat, self._beats_done = None, self._beats
        done = self.flush(timeout)
        self._closed = True
        if self._thread is not None:
            self._wake.set()  # the thread sees _closed: it ends
            self._thread.join(1.0)
        return done

    # ----------------------------------------------------------------- the thread
    def _run(self) -> None:
        batch, taken, finals = Batch(), 0, 0
        last_poll = last_send = 0.0
        while not self._closed:
            wait = self._wait_s(batch, last_poll, last_send)
            woken = self._wake.wait(wait) if wait > 0 else self._wake.is_set()
            self._wake.clear()  # before the queue is read: a later urgent put wakes it again
            while not self._queue.empty():  # everything put meanwhile joins the batch, in order
                item = self._queue.get_nowait()
                batch.add(*item)
                taken += 1
                finals += len(item[1])
            now = time.monotonic()
            if self._closed or now < self._retry_at():
                continue
            poll_due = self._poll_cancels and now >= last_poll + self.cancel_poll_s
            send_due = (batch.progress or batch.finals) and (
                woken or now >= last_send + self.interval_s
            )
            if not (send_due or poll_due):
                self._beat()
                continue
            batch.cancels = self._poll_cancels
            if batch.cancels:
                last_poll = now
            last_send = now
            if not self._send(batch):  # Redis down: kept, in front of what comes next
                continue
            with self._done:
                self._written, self._finals_written = taken, finals
                self._done.notify_all()
            self._beat()

    def _beat(self) -> None:
        """Write the pending heartbeat, if any (after the batch: job writes go first)."""
        with self._done:
            hb, self._heartbeat, seq = self._heartbeat, None, self._beats
        if hb is None or self._closed:
            return
        try:
            self.guard.call(self.store.heartbeat, *hb)
        except RedisDown:
            pass  # the guard marked Redis down: the heartbeat shows "reconnecting" meanwhile
        except Exception:  # an unexpected reply or a bug: the next heartbeat tries again
            log.exception("writer: heartbeat not written")
        with self._done:
            self._beats_done = max(self._beats_done, seq)
            self._done.notify_all()

    def _retry_at(self) -> float:
        return 0.0 if self.guard.ok else self.guard.retry_at

    def _wait_s(self, batch: Batch, last_poll: float, last_send: float) -> float:
        """How long to sleep unless woken (an urgent put, flush, close): with writes in hand
        until the next send is due (and Redis is back), else until the next cancel poll, or
        (nothing to do) a while."""
        now = time.monotonic()
        due = []
        if batch.progress or batch.finals:
            due.append(last_send + self.interval_s)
        if self._poll_cancels:
            due.append(last_poll + self.cancel_poll_s)
        if self._heartbeat is not None:
            due.append(now)
        if not due:  # a loop with no job yet: look again soon (polling may have been asked for)
            due.append(now + max(0.1, self.cancel_poll_s))
        return max(0.0, min(due) - now, self._retry_at() - now)

    def _send(self, batch: Batch) -> bool:
        """Write the batch: its deltas (with the cancel drain), then its final writes, each
        job's final write decided after its deltas were answered (a job whose delta Redis
        refused with an error is failed with the reason, as the loop would have). Reports go to
        the loop. ``False`` when Redis is down: what was not written stays in the batch."""
        if batch.progress or batch.cancels:
            consumer = self.consumer if batch.cancels else None
            first = self._call(consumer, batch.updates(), [])
            if first is None:
                batch.attempt += 1
                return False
            batch.progress.clear()
            batch.cancels = False
            for err in first.errors:
                self._broken[err.job_id] = err.message
            self._reports.put(first)
        if batch.finals:
            batch.finals = [self._final_of(f) for f in batch.finals]
            second = self._call(None, [], batch.finals)
            if second is None:
                return False
            for f in batch.finals:
                self._broken.pop(f.lease.job_id, None)
                self._finals_open.discard(f.lease.job_id)
            batch.finals = []
            self._reports.put(second)
        return True

    def _final_of(self, fin: Finish) -> Finish:
        """``fin``, or a failure with the reason for a job whose delta Redis refused."""
        why = self._broken.get(fin.lease.job_id)
        if why is None or fin.status == "failed":
            return fin
        return Finish(fin.lease, "failed", error=f"{WRITE_FAILED}{why}")

    def _call(
        self, consumer: str | None, updates: list[Progress], finals: list[Finish]
    ) -> StepResult | None:
        """One round trip; ``None`` when Redis is down."""
        try:
            return self.guard.call(
                self.store.commit_step, consumer, progress=updates, finished=finals
            )
        except RedisDown:
            return None
        except Exception as e:  # an unexpected reply or a bug: these jobs fail, not the worker
            log.exception("writer: %d writes failed", len(updates) + len(finals))
            msg = f"{type(e).__name__}: {e}"
            errors = [WriteError(p.lease.job_id, msg) for p in updates]
            errors += [WriteError(f.lease.job_id, msg, f) for f in finals]
            return StepResult(errors=errors)
