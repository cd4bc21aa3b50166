"""Reading one job's events stream: the one reader behind ``Client.stream`` and the API's SSE.

A job's events (``delta``, ``restart``, ``end``) are appended to ``{prefix}:events:{job}`` by the
store's scripts. :func:`follow_events` reads them in order after a given entry id, and between
reads tells its caller what it saw: nothing arrived within one blocking read (:class:`Idle`), or
no ``end`` event will ever come (:class:`Gone`: the job is unknown or expired, or it ended and its
events were trimmed away). Each caller decides what that means for it (the client raises or
returns, the SSE endpoint writes a keep-alive or a final ``end`` event).

A ``restart`` event is passed through like any other: it means the job started over (its worker
died and another leased it, or a draining worker handed it back), and the earlier run's deltas
are trimmed from the stream, so a reader from the start sees only the new run; a follower
discards what it has and goes on (see ``pagedserve.client.accumulate``).

While it follows a job, a reader keeps the job's watch key set (``{prefix}:watch:{job}``, renewed
well within :data:`WATCH_TTL_MS`): the worker writes a watched job's progress at the streaming
pace (``progress_interval_ms``, 50 ms) and a job nobody follows at ``bulk_progress_interval_ms``
(500 ms), so that the deltas of the many jobs no one streams (a pipeline waiting for results, a
non-streamed API call) cost Redis and the worker a tenth as many writes. A reader that starts
while the job runs gets what was written so far at once, then deltas at the slower pace until
the worker's next write of that job sees the key.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis

from pagedserve.redis_util import stream_entries
from pagedserve.schemas import DeltaEvent, JobStatus

if TYPE_CHECKING:
    from pagedserve.store import JobStore

#: The first id of every stream: read from here to get a job's events from its first one.
FIRST_ID = "0-0"
#: How long a reader's watch of a job lasts unless renewed (a reader renews it at a third).
WATCH_TTL_MS = 30_000


@dataclass(frozen=True)
class Idle:
    """No event arrived within one blocking read; the job was then in ``status``."""

    status: JobStatus
    last: str


@dataclass(frozen=True)
class Gone:
    """No ``end`` event will come: the job is unknown (``NOT_FOUND``), or terminal with its
    events stream already expired. ``last`` is the id of the last event read."""

    status: JobStatus
    last: str


def _read(r: redis.Redis, key: str, last: str, count: int, block_ms: int) -> list[DeltaEvent]:
    events: list[DeltaEvent] = []
    for _stream, entries in stream_entries(r.xread({key: last}, count=count, block=block_ms)):
        events += [DeltaEvent.from_stream(entry_id, fields) for entry_id, fields in entries]
    return events


def follow_events(
    store: JobStore,
    job_id: str,
    last: str = FIRST_ID,
    *,
    count: int,
    block_ms: Callable[[], int],
    keep_going: Callable[[], bool] = lambda: True,
    watch: bool = True,
) -> Iterator[DeltaEvent | Idle | Gone]:
    """The job's events after ``last`` in order, ending after the ``end`` event or a
    :class:`Gone`; an :class:`Idle` after each blocking read (``block_ms()`` ms, asked before
    each) that found nothing. ``keep_going()`` is asked before each read: once false, the
    iterator ends (the caller's time limit). ``watch``: keep the job's watch key set (a reader
    that shows the deltas as they come; one that only waits for the end passes False)."""
    r, key, watch_key = store.r, store.keys.events(job_id), store.keys.watch(job_id)
    renew_at = 0.0 if watch else float("inf")
    while keep_going():
        if (now := time.monotonic()) >= renew_at:
            r.set(watch_key, 1, px=WATCH_TTL_MS)
            renew_at = now + WATCH_TTL_MS / 3e3
        events = _read(r, key, last, count, block_ms())
        for ev in events:
            last = ev.id
            yield ev
            if ev.type == "end":
                return
        if events:
            continue
        status = store.status(job_id)
        if status == JobStatus.NOT_FOUND or (status.terminal and not r.exists(key)):
            yield Gone(status, last)
            return
        yield Idle(status, last)
