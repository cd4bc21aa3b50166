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
"""

from __future__ import annotations

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
) -> Iterator[DeltaEvent | Idle | Gone]:
    """The job's events after ``last`` in order, ending after the ``end`` event or a
    :class:`Gone`; an :class:`Idle` after each blocking read (``block_ms()`` ms, asked before
    each) that found nothing. ``keep_going()`` is asked before each read: once false, the
    iterator ends (the caller's time limit)."""
    r, key = store.r, store.keys.events(job_id)
    while keep_going():
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
