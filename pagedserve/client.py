"""The user-facing client: submit jobs, read their records, wait for them, stream them, cancel.

Works without torch; talks only to Redis (through :class:`~pagedserve.store.JobStore`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedserve.events import Gone, follow_events
from pagedserve.keys import DEFAULT_PREFIX, Priority
from pagedserve.params import SamplingParams
from pagedserve.schemas import ChatMessage, DeltaEvent, JobRecord, JobRequest, JobStatus
from pagedserve.store import JobStore, check_client_request
from pagedserve.tenants import check_tenant

PromptOrMessages = str | Sequence[int] | Sequence[ChatMessage | Mapping[str, Any]]

#: Jobs per pipelined round trip in :meth:`Client.submit_many`.
SUBMIT_CHUNK = 2000
#: ... but the first round trip carries at most this many, so that workers start on them
#: while the rest is being built and sent: 384 jobs took ~20 ms to reach Redis as one pipeline,
#: and idle workers waited for all of it (``bench.service``).
FIRST_CHUNK = 16
#: Longest single blocking read, so that waits notice deadlines and expired jobs.
_BLOCK_SLICE_S = 1.0
#: :meth:`Client.wait_many` reads the statuses of this many of the oldest open jobs (and the
#: records of those that ended) ...
HEAD_JOBS = 64
#: ... at most this often (seconds), besides its one-job poll.
HEAD_SWEEP_S = 0.1


def new_job_id() -> str:
    return uuid.uuid4().hex


def _chunks(n: int, chunk: int) -> Iterator[tuple[int, int]]:
    """[start, end) of each round trip's jobs: the first at most :data:`FIRST_CHUNK`."""
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, not {chunk}")
    start, size = 0, min(chunk, FIRST_CHUNK)
    while start < n:
        yield start, min(n, start + size)
        start, size = start + size, chunk


def _as_params(params: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    return SamplingParams.model_validate(dict(params))


def build_request(
    prompt_or_messages: PromptOrMessages,
    params: SamplingParams | Mapping[str, Any] | None = None,
    *,
    priority: Priority = "interactive",
    idempotency_key: str | None = None,
    metadata: dict[str, str] | None = None,
    model: str | None = None,
) -> JobRequest:
    """A validated request: a string or a list of ints is a prompt, a list of
    ``{role, content}`` mappings is a chat."""
    fields: dict[str, Any] = {
        "params": _as_params(params),
        "priority": priority,
        "idempotency_key": idempotency_key,
        "metadata": metadata,
        "model": model,
    }
    is_chat = (
        not isinstance(prompt_or_messages, str)
        and len(prompt_or_messages) > 0
        and not isinstance(prompt_or_messages[0], int)
    )
    if is_chat:
        fields["messages"] = list(prompt_or_messages)
    else:
        prompt = prompt_or_messages
        fields["prompt"] = prompt if isinstance(prompt, str) else list(prompt)  # strict: a list
    return JobRequest.model_validate(fields)


@dataclass
class Accumulated:
    """What a follower has of a job's completions (by index), as :func:`accumulate` builds it."""

    texts: dict[int, str] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    restarts: int = 0


def accumulate(events: Iterable[DeltaEvent]) -> Accumulated:
    """Fold :meth:`Client.stream` events into text and token ids per completion, starting over
    at each ``restart`` event (so a reclaimed job is never repeated)."""
    acc = Accumulated()
    for ev in events:
        if ev.type == "restart":
            acc = Accumulated(restarts=acc.restarts + 1)
        elif ev.type == "delta":
            acc.texts[ev.index] = acc.texts.get(ev.index, "") + ev.text
            acc.token_ids.setdefault(ev.index, []).extend(ev.token_ids)
    return acc


class Client:
    """Submit and follow jobs through Redis. ``redis_url`` defaults to ``PAGEDSERVE_REDIS_URL``.

    ``tenant``: written on every job this client submits (a Redis-side client is trusted: it
    writes the tenant it is given, and reads every job); ``None`` writes none (the API then
    treats the jobs as the default tenant's)."""

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        prefix: str = DEFAULT_PREFIX,
        tenant: str | None = None,
        **store_kw: Any,
    ):
        self.tenant = check_tenant(tenant) if tenant is not None else None
        self.store = JobStore(redis_url, prefix=prefix, **store_kw)
        self.r = self.store.r
        self.keys = self.store.keys

    # ----------------------------------------------------------------------------- submit
    def submit(
        self,
        prompt_or_messages: PromptOrMessages,
        params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        priority: Priority = "interactive",
        idempotency_key: str | None = None,
        metadata: dict[str, str] | None = None,
        model: str | None = None,
    ) -> str:
        """Queue one job; returns its id (an existing job's id for a reused idempotency key)."""
        req = build_request(
            prompt_or_messages,
            params,
            priority=priority,
            idempotency_key=idempotency_key,
            metadata=metadata,
            model=model,
        )
        return self.submit_request(req)

    def submit_request(self, request: JobRequest) -> str:
        return self.store.enqueue(new_job_id(), request, tenant=self.tenant)[0]

    def submit_many(
        self,
        prompts: Sequence[PromptOrMessages],
        params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        priority: Priority = "interactive",
        model: str | None = None,
        chunk: int = SUBMIT_CHUNK,
    ) -> list[str]:
        """Queue many jobs sharing ``params``, pipelined ``chunk`` at a time (one round trip
        each; the first carries at most :data:`FIRST_CHUNK`); returns ids in the order of
        ``prompts``. All requests are validated before any is
        queued."""
        p = _as_params(params)
        requests = [build_request(x, p, priority=priority, model=model) for x in prompts]
        return self.submit_requests(requests, chunk=chunk)

    def submit_requests(
        self, requests: Sequence[JobRequest], chunk: int = SUBMIT_CHUNK
    ) -> list[str]:
        """Queue validated requests, pipelined ``chunk`` at a time; ids in order. A request
        using a reserved name (see :func:`~pagedserve.store.check_client_request`) raises
        ``ValueError`` before any is queued."""
        for r in requests:
            check_client_request(r)
        ids: list[str] = []
        for start, end in _chunks(len(requests), chunk):
            part = [(new_job_id(), r) for r in requests[start:end]]
            ids += [got for got, _ in self.store.enqueue_many(part, tenant=self.tenant)]
        return ids

    # ----------------------------------------------------------------------------- read
    def get(self, job_id: str) -> JobRecord | None:
        return self.store.get(job_id)

    def status(self, job_id: str) -> JobStatus:
        return self.store.status(job_id)

    def cancel(self, job_id: str) -> JobStatus:
        """Request cancellation; returns the status right after (cancelled, cancelling, the final
        status of a finished job, or not_found)."""
        return self.store.cancel(job_id)

    def _snapshot(self, job_id: str) -> tuple[JobRecord | None, str]:
        """The record and the id of the last event, read atomically: any later event (the end
        one included) is then seen by a blocking read from that id."""
        pipe = self.r.pipeline(transaction=True)
        pipe.hgetall(self.keys.job(job_id))
        pipe.xrevrange(self.keys.events(job_id), count=1)
        h, last = pipe.execute()
        return self.store._record(h), (last[0][0] if last else "0-0")

    def wait(self, job_id: str, timeout: float | None = None) -> JobRecord:
        """Block until the job ends; returns its record. Raises ``TimeoutError`` after
        ``timeout`` seconds and ``KeyError`` for an unknown job."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            rec, last = self._snapshot(job_id)
            if rec is None:
                raise KeyError(f"job {job_id} not found")
            if rec.status.terminal:
                return rec
            block_s = _BLOCK_SLICE_S
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"job {job_id} still {rec.status.value} after {timeout} s")
                block_s = min(block_s, left)
            block_ms = max(1, int(block_s * 1e3))
            self.r.xread({self.keys.events(job_id): last}, count=1, block=block_ms)

    def wait_many(
        self, job_ids: Sequence[str], timeout: float | None = None, poll_s: float = 0.5
    ) -> list[JobRecord]:
        """Block until every job ended (polling, backing off up to ``poll_s``); records in the
        order of ``job_ids``. Raises ``KeyError`` for unknown jobs, ``TimeoutError``.

        Why one job at a time: the wait is over only when every job ended, so while one open
        job runs, nothing the others do can end it. Each poll waits on one open job (the latest
        submitted: under first-come-first-served the likeliest to end last) with a blocking
        read of its events, which its end event wakes; when it ended, one pipelined read of all
        the open ones drops every job that ended meanwhile.
        Polling every open job each time (as before) cost Redis and the client ~N reads per
        poll: on ``bench.service``'s 2 shared cores that client alone used 0.65 s of CPU per
        5.5 s round of 384 jobs.

        Records are read as their jobs end, not all at the end: at most every
        :data:`HEAD_SWEEP_S` a poll also reads the statuses of the :data:`HEAD_JOBS` oldest
        open jobs (the likeliest to have ended) and the records of those that did. Reading 384
        records after the last job ended took ~30 ms (``bench.service``: a round's wall time
        ended that much after its last job); now only the last few are left then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        got: dict[str, JobRecord] = {}
        open_ids = self._collect(list(dict.fromkeys(job_ids)), got)
        sleep, swept = 0.005, time.monotonic()
        while open_ids:
            if deadline is not None and time.monotonic() >= deadline:
                open_ids = self._collect(open_ids, got)
                if open_ids:
                    raise TimeoutError(f"{len(open_ids)} of {len(job_ids)} jobs still open")
                break
            left = sleep if deadline is None else min(sleep, deadline - time.monotonic())
            ended = self._ends_within(open_ids[-1], max(0.001, left))
            sleep = min(poll_s, sleep * 2)
            if ended:
                open_ids = self._collect(open_ids, got)
            elif len(open_ids) > 1 and time.monotonic() - swept >= HEAD_SWEEP_S:
                swept = time.monotonic()
                open_ids = self._collect(open_ids[:HEAD_JOBS], got) + open_ids[HEAD_JOBS:]
        return [got[j] for j in job_ids]

    def _ends_within(self, job_id: str, wait_s: float) -> bool:
        """Whether the job ended (or is unknown) within ``wait_s``: a blocking read of its
        events after the last one, which its end event wakes at once. Why not a sleep and a
        status read: the wait for the last job of a batch then ended up to a whole poll
        interval after the job (``bench.service``: 15-20 ms at ``poll_s=0.02``)."""
        pipe = self.r.pipeline(transaction=True)  # status and last event id, atomically
        pipe.hget(self.keys.job(job_id), "status")
        pipe.xrevrange(self.keys.events(job_id), count=1)
        status, last = pipe.execute()
        if not status or JobStatus(status).terminal:
            return True
        key = self.keys.events(job_id)
        since = last[0][0] if last else "0-0"
        got = self.r.xread({key: since}, count=8, block=max(1, int(wait_s * 1e3)))
        return any(f.get("type") == "end" for _, entries in got or [] for _, f in entries)

    def _collect(self, job_ids: list[str], got: dict[str, JobRecord]) -> list[str]:
        """The jobs of ``job_ids`` not ended yet, in order (one pipelined read); the records
        of the ended ones go into ``got``. ``KeyError`` for unknown (or expired) jobs."""
        statuses = self.store.statuses(job_ids) if job_ids else []
        missing = [j for j, s in zip(job_ids, statuses, strict=True) if s == "not_found"]
        if missing:
            raise KeyError(f"jobs not found: {missing[:5]}")
        ended = [j for j, s in zip(job_ids, statuses, strict=True) if s.terminal]
        for jid, rec in zip(ended, self.store.get_many(ended) if ended else [], strict=True):
            if rec is None:
                raise KeyError(f"job {jid} expired while waiting")
            got[jid] = rec
        return [j for j, s in zip(job_ids, statuses, strict=True) if not s.terminal]

    def stream(self, job_id: str, timeout: float | None = None) -> Iterator[DeltaEvent]:
        """Yield the job's events (``delta``, ``restart``) as they arrive, from its first one,
        ending after the ``end`` event (also yielded). Events are capped per job (oldest
        trimmed). Raises ``KeyError`` for an unknown job, ``TimeoutError`` after ``timeout``.

        A ``restart`` event means the job started over (its worker died and another leased it,
        or a draining worker handed it back): discard every delta received so far; the deltas
        after it are the new run's, from its first token. The earlier run's deltas are also
        trimmed from the stream, so a reader that starts later sees only the new run. Use
        :func:`accumulate` to fold events into each completion's text and token ids."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def block_ms() -> int:
            block_s = _BLOCK_SLICE_S
            if deadline is not None:
                block_s = min(block_s, max(0.001, deadline - time.monotonic()))
            return max(1, int(block_s * 1e3))

        for item in follow_events(self.store, job_id, count=512, block_ms=block_ms):
            if isinstance(item, DeltaEvent):
                yield item
            elif item.status == JobStatus.NOT_FOUND:
                raise KeyError(f"job {job_id} not found")
            elif isinstance(item, Gone):
                return  # ended, and its events already expired
            elif deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} still {item.status.value} after {timeout} s")

    def close(self) -> None:
        self.r.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
