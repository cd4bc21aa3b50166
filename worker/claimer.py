"""The service loop's claimer: the Redis round trips that take work (claim, prefix admission, the
reclaim of dead workers' entries) run on a thread of their own, so that a busy loop's engine
steps never wait for them.

Why: a busy worker with free seats keeps a claim round going (one that found nothing is
followed by a blocking read of up to ``claim_interval_s``, so new work does not wait), and each
round is two or three round trips plus the parsing of what they return. At fast
steps (a small model on a CPU, any model on a GPU) that was a good part of the loop's time:
``bench.service --preset tiny`` on a Zen 5 EPYC had the claim rounds at ~6% of the worker's
main-thread samples (py-spy), on top of the heartbeat's ~3%.

The split: the loop decides *whether* and *how much* to claim (its free seats, the prefix
admission request built from its cache: :class:`ClaimOrder`) and hands the order over with
:meth:`Claimer.ask`; the thread runs it (the same store calls as before, in the same order) and
the loop collects what came back with :meth:`Claimer.take`, admitting the leases on its own
thread. At most one order is in flight, so the seats it asked for cannot be asked for twice.
An idle loop asks with a blocking read and waits on :meth:`Claimer.take` (new work still starts
within a thread hand-over of its arrival).

Only this thread takes leases (claim, admission, reclaim), so the store's claim-side state (the
stash of a blocking read, the pending-list cursors, the malformed leases) has one user. A
connection error marks the claimer's own :class:`RedisGuard` down; the next order waits for its
retry time on the thread, never on the loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field

from pagedserve.store import AdmissionRequest, Admitted, JobStore, Lease
from worker.redis_guard import RedisDown, RedisGuard

log = logging.getLogger("pagedserve.worker")


@dataclass(frozen=True)
class ClaimOrder:
    """One round of taking work, as the loop decided it."""

    cap: int  # seats: the most jobs to lease
    block_ms: int  # with nothing found, wait this long for new work (0: do not wait)
    admission: AdmissionRequest | None = None  # bulk jobs by prefix; None: in arrival order
    reclaim_ms: int = 0  # > 0: first take over entries idle this long (dead workers')
    #: Jobs the worker serves (never reclaimed): a live view, asked at reclaim time, not a
    #: snapshot (a job that ends while the order waits keeps its entry until its final write).
    held: Container[str] = frozenset()


@dataclass
class Claimed:
    """What one order took."""

    order: ClaimOrder
    leases: list[Lease] = field(default_factory=list)  # reclaimed first, then claimed
    admitted: Admitted | None = None  # the prefix admission round's answer, for its bookkeeping
    malformed: list[tuple[Lease, str]] = field(default_factory=list)  # leased, to be failed
    #: When each leased job was submitted (its record's ``created_at``, Redis clock), if known.
    created_at: dict[str, float] = field(default_factory=dict)
    down: bool = False  # Redis was unreachable for (part of) the round


#: ``(store, consumer, cap, block_ms, admission request) -> (leases, admitted)``: one claim
#: round (:func:`worker.admission.claim_round`).
ClaimRound = Callable[
    [JobStore, str, int, int, AdmissionRequest | None], tuple[list[Lease], Admitted | None]
]


class Claimer:
    """A thread running the loop's claim orders (see the module docstring)."""

    def __init__(self, store: JobStore, consumer: str, claim_round: ClaimRound) -> None:
        self.store = store
        self.consumer = consumer
        self.claim_round = claim_round
        self.guard = RedisGuard(store)
        self._orders: queue.SimpleQueue[ClaimOrder | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[Claimed] = queue.SimpleQueue()
        self._in_flight = 0  # orders asked for whose result the loop has not taken
        self._thread: threading.Thread | None = None
        self._closed = False

    # ----------------------------------------------------------------- the loop's side
    @property
    def pending(self) -> bool:
        """An order is running or its result waits to be taken."""
        return self._in_flight > 0

    def ask(self, order: ClaimOrder) -> None:
        """Run ``order`` on the thread; one at a time (the loop asks again after :meth:`take`)."""
        if self._closed:
            raise RuntimeError("claimer closed")
        if self._in_flight:
            raise RuntimeError("a claim order is already in flight")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pagedserve-claimer",
                                            daemon=True)  # fmt: skip
            self._thread.start()
        self._in_flight = 1
        self._orders.put(order)

    def take(self, wait_s: float = 0.0) -> Claimed | None:
        """The finished order's result, waiting up to ``wait_s`` for it; None if not done."""
        if not self._in_flight:
            return None
        try:
            got = self._results.get(timeout=wait_s) if wait_s > 0 else self._results.get_nowait()
        except queue.Empty:
            return None
        self._in_flight = 0
        return got

    def close(self, timeout: float) -> Claimed | None:
        """Stop the thread; the result of an order still in flight (its leases are the
        caller's to hand back), if it ends within ``timeout``."""
        got = self.take(timeout) if self._in_flight else None
        self._closed = True
        if self._thread is not None:
            self._orders.put(None)
            self._thread.join(1.0)
        return got

    # ----------------------------------------------------------------- the thread
    def _run(self) -> None:
        while True:
            order = self._orders.get()
            if order is None:
                return
            if not self.guard.ok:  # Redis was down: wait for the retry here, not on the loop
                time.sleep(self.guard.wait_s())
            self._results.put(self._serve(order))

    def _serve(self, order: ClaimOrder) -> Claimed:
        out = Claimed(order)
        try:
            if order.reclaim_ms > 0 and self.store.own_pending_read(self.consumer):
                out.leases += self.guard.call(
                    self.store.reclaim, self.consumer, order.reclaim_ms, order.cap, order.held
                )
            cap = order.cap - len(out.leases)
            if cap > 0:
                block = order.block_ms if not out.leases else 0
                leases, out.admitted = self.guard.call(
                    self.claim_round, self.store, self.consumer, cap, block, order.admission
                )
                out.leases += leases
        except RedisDown:
            out.down = True
        except Exception:  # a bug or an unexpected reply: this round takes nothing more
            log.exception("claimer: claim round failed")
            out.down = True
        out.malformed = self.store.take_malformed()
        # The jobs' submission times (time-to-first-token and latency metrics), read by the
        # lease script; a job without one is left out (the loop uses its own now).
        out.created_at = {x.job_id: x.created_at for x in out.leases if x.created_at is not None}
        return out


__all__ = ["ClaimOrder", "ClaimRound", "Claimed", "Claimer"]
