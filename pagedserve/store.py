"""The Redis job store: enqueue, lease, renew, reclaim, fenced writes, cancel.

Every state change is one Lua script (atomic on the server). The worker-side calls take lists and
run as pipelines so that a worker loop needs one or two round trips per engine step however many
jobs it runs: :meth:`JobStore.commit_step` writes all progress and final results of a step and
drains the worker's cancel set in one round trip.

Fencing: each lease carries a token (``fence``) that :meth:`claim` / :meth:`reclaim` increment. A
write succeeds only while the job's current fence equals the writer's, so a worker that lost its
lease (presumed dead, its entry reclaimed by another) can never overwrite the new owner's work.

Batch jobs: the batch fan-out enqueues with a :class:`BatchRef`, written as server-owned fields of
the job record (``batch_id``, ``custom_id``, ``batch_url``, ``batch_model``) together with the
job's entry in the batch's members set. Leases carry that ref back; the store builds the job's
batch line (:func:`batch_line`, the one builder) and the scripts add it only for a member of the
batch. Nothing a client writes (``metadata``, idempotency keys) ever names a batch: the metadata
keys and idempotency-key prefix the service reserves are refused (:func:`check_client_request`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Literal

import redis
from pydantic import ValidationError
from redis.commands.core import Script

from pagedserve import openai_format
from pagedserve.keys import DEFAULT_PREFIX, GROUP, PRIORITIES, Keys, Priority
from pagedserve.redis_util import connect, stream_entries
from pagedserve.schemas import (
    TERMINAL_STATUSES,
    UNPARSABLE_REQUEST,
    JobRecord,
    JobRequest,
    JobResult,
    JobStatus,
    short_validation_error,
)
from pagedserve.tenants import TAG_JOB, TenantBook

log = logging.getLogger(__name__)

DEFAULT_RETENTION_S = 24 * 3600
#: How long a lease lasts unless renewed; the worker service runs with the same default.
DEFAULT_LEASE_MS = 15_000
DEFAULT_MAX_DELIVERIES = 3
DEFAULT_EVENTS_MAXLEN = 10_000

FinalStatus = Literal["succeeded", "failed", "cancelled"]

#: Metadata keys only the batch fan-out writes (its jobs show them); refused from clients.
RESERVED_METADATA_KEYS = frozenset({"batch_id", "custom_id"})
#: Idempotency keys with this prefix were the fan-out's own (before ``Keys.batch_idem``); refused
#: from clients so that no old or future internal key can be taken.
RESERVED_IDEMPOTENCY_PREFIX = "batch:"

#: Redis errors that say "not now" rather than "this call is wrong": retried like a lost connection.
TRANSIENT_REPLY_ERRORS: tuple[type[Exception], ...] = (
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.BusyLoadingError,
)


def check_client_request(request: JobRequest) -> None:
    """Raise ``ValueError`` for a client request that uses a name the service reserves."""
    idem = request.idempotency_key
    if idem is not None and idem.startswith(RESERVED_IDEMPOTENCY_PREFIX):
        raise ValueError(
            f"idempotency_key: the prefix {RESERVED_IDEMPOTENCY_PREFIX!r} is reserved for "
            "batch requests"
        )
    taken = sorted(RESERVED_METADATA_KEYS & set(request.metadata or {}))
    if taken:
        raise ValueError(f"metadata: the keys {taken} are reserved for batch requests")


@dataclass(frozen=True)
class BatchRef:
    """What makes a job a request of an OpenAI batch: written by the fan-out into the job record
    (server-owned hash fields), never taken from the request."""

    batch_id: str
    custom_id: str
    url: str
    model: str

    @classmethod
    def from_fields(cls, fields: Sequence[Any]) -> BatchRef | None:
        """From ``(batch_id, custom_id, batch_url, batch_model)`` as the scripts return them."""
        if len(fields) < 4 or not fields[0] or fields[1] is None:
            return None
        return cls(str(fields[0]), str(fields[1]), str(fields[2] or ""), str(fields[3] or ""))

    def idempotency_digest(self) -> str:
        return hashlib.sha256(self.custom_id.encode()).hexdigest()[:32]


def batch_line(
    ref: BatchRef,
    job_id: str,
    status: str,
    result: JobResult | None = None,
    error: str | None = None,
    *,
    code: str | None = None,
) -> tuple[bool, str]:
    """``(succeeded?, line)``: the one place a batch job's output or error line is built."""
    return openai_format.batch_line(
        ref.custom_id, ref.url, ref.model, job_id, status, result, error, code=code
    )


@dataclass(frozen=True)
class Lease:
    """A worker's right to run one job, valid while ``fence`` is the job's current fence."""

    job_id: str
    fence: int
    consumer: str
    priority: Priority
    entry_id: str
    request: JobRequest
    deliveries: int
    #: Set for a job of an OpenAI batch (from the job record's server-owned fields).
    batch: BatchRef | None = None


@dataclass(frozen=True)
class Progress:
    """New output of one running job since the last update (for completion ``index``)."""

    lease: Lease
    tokens_generated: int
    delta_text: str = ""
    delta_token_ids: Sequence[int] = ()
    index: int = 0


@dataclass(frozen=True)
class Finish:
    """A running job's final write: ``succeeded`` with a result, ``failed`` with a reason, or
    ``cancelled`` (after a cancel request, optionally with the partial result)."""

    lease: Lease
    status: FinalStatus
    result: JobResult | None = None
    error: str | None = None


def batch_keys(keys: Keys, batch_id: str) -> tuple[str, str, str, str]:
    """A batch's hash, output-line list, error-line list and set of counted job ids."""
    return (
        keys.batch(batch_id),
        keys.batch_output(batch_id),
        keys.batch_errors(batch_id),
        keys.batch_counted(batch_id),
    )


@dataclass(frozen=True)
class LineAdd:
    """One batch line to add outside a worker's final write (see ``batch_line.lua``)."""

    job_id: str
    ref: BatchRef
    ok: bool
    line: str
    allow_missing: bool = False
    allow_running: bool = False


@dataclass(frozen=True)
class WriteError:
    """A write of one job that Redis refused with an error (not a lost lease)."""

    job_id: str
    message: str
    #: The refused final write, or ``None`` for a progress update.
    finish: Finish | None = None


@dataclass
class StepResult:
    """What :meth:`JobStore.commit_step` reports back to the worker loop."""

    #: Job ids whose progress or final write was refused: the lease is lost, drop the sequence.
    lost: list[str] = field(default_factory=list)
    #: Job ids a client asked to cancel (drained from this worker's cancel set).
    cancels: set[str] = field(default_factory=set)
    #: Writes Redis answered with an error (e.g. a key of the wrong type): the job cannot be
    #: written as asked; the worker fails it (or retries without its batch line) and goes on.
    errors: list[WriteError] = field(default_factory=list)


@dataclass
class ClaimStats:
    """Counters of what claims saw besides leases (for metrics and tests)."""

    skipped: int = 0
    dead_lettered: int = 0


_SCRIPTS = (
    "enqueue",
    "lease",
    "renew",
    "finish",
    "progress",
    "release",
    "cancel",
    "pop_cancels",
    "batch_line",
)

#: One script call: (script name, KEYS, ARGV).
Call = tuple[str, Sequence[str], Sequence[Any]]


def _load_lua(name: str) -> str:
    base = resources.files("pagedserve") / "lua"
    common = (base / "_common.lua").read_text()
    return common + "\n" + (base / f"{name}.lua").read_text()


#: A delivered stream entry: (stream key, entry id, job id or None if the entry was deleted).
Entry = tuple[str, str, str | None]


def _job_of(fields: Any) -> str | None:
    return fields.get("job") if fields else None


def _flatten_entries(reply: Any) -> list[Entry]:
    """An XREADGROUP reply (RESP2 list or RESP3 dict) -> entries."""
    out: list[Entry] = []
    for stream, entries in stream_entries(reply):
        out += [(stream, entry_id, _job_of(fields)) for entry_id, fields in entries]
    return out


class JobStore:
    """All job state transitions against one Redis (see the module docstring)."""

    def __init__(
        self,
        redis_client: redis.Redis | str | None = None,
        *,
        prefix: str = DEFAULT_PREFIX,
        retention_s: int = DEFAULT_RETENTION_S,
        lease_ms: int = DEFAULT_LEASE_MS,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        events_maxlen: int = DEFAULT_EVENTS_MAXLEN,
    ) -> None:
        if redis_client is None or isinstance(redis_client, str):
            redis_client = connect(redis_client)
        self.r: redis.Redis = redis_client
        self.keys = Keys(prefix)
        self.retention_s = retention_s
        self.lease_ms = lease_ms
        self.max_deliveries = max_deliveries
        self.events_maxlen = events_maxlen
        self.stats = ClaimStats()
        # register_script only hashes locally; _exec sends EVALSHA and loads on NOSCRIPT.
        self._scripts: dict[str, Script] = {
            name: self.r.register_script(_load_lua(name)) for name in _SCRIPTS
        }
        self._scripts["tag_tenant"] = self.r.register_script(TAG_JOB)
        self.tenants = TenantBook(self.r, self.keys)
        self._groups_ready = False
        # Per consumer and stream: where re-reading the consumer's own pending entries has got
        # to ("0" at first, None once exhausted). Only the first claims after a start read them.
        self._pending_cursor: dict[tuple[str, str], str | None] = {}
        self.malformed: list[tuple[Lease, str]] = []
        # Entries delivered to a consumer beyond what it asked for (a blocking read can return one
        # per stream); they are leased first at the next claim.
        self._stash: dict[str, list[tuple[str, str]]] = {}
        self._autoclaim_cursor: dict[str, str] = {}

    # ----------------------------------------------------------------------------- setup
    def ensure_groups(self) -> None:
        """Create the priority streams and their consumer group (idempotent)."""
        if self._groups_ready:
            return
        for prio in PRIORITIES:
            try:
                self.r.xgroup_create(self.keys.stream(prio), GROUP, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise
        self._groups_ready = True

    def script(self, name: str) -> Script:
        return self._scripts[name]

    def load_scripts(self) -> None:
        """SCRIPT LOAD every script (after a server restart flushed the script cache)."""
        pipe = self.r.pipeline(transaction=False)
        for sc in self._scripts.values():
            pipe.script_load(sc.script)
        pipe.execute()

    def _exec(
        self, calls: Sequence[Call], *, raise_errors: bool = True, transaction: bool = False
    ) -> list[Any]:
        """Run script calls as EVALSHA in one pipeline (MULTI/EXEC with ``transaction``): one
        round trip.

        A NOSCRIPT error (empty script cache after a Redis restart) fails every call of the
        pipeline the same way, so loading the scripts and resending it once is safe. With
        ``raise_errors=False`` a call's error is returned in its place (the others still count),
        except transient ones (:data:`TRANSIENT_REPLY_ERRORS`), which are raised.
        """
        if not calls:
            return []
        for attempt in (0, 1):
            pipe = self.r.pipeline(transaction=transaction)
            for name, keys, args in calls:
                pipe.evalsha(self._scripts[name].sha, len(keys), *keys, *args)
            replies = pipe.execute(raise_on_error=False)
            if attempt == 0 and any(isinstance(x, redis.exceptions.NoScriptError) for x in replies):
                self.load_scripts()
                continue
            for x in replies:
                if isinstance(x, Exception) and (
                    raise_errors or isinstance(x, TRANSIENT_REPLY_ERRORS)
                ):
                    raise x
            return replies
        raise AssertionError("unreachable")

    # ----------------------------------------------------------------------------- client side
    def enqueue_args(
        self, job_id: str, request: JobRequest, *, batch: BatchRef | None = None
    ) -> tuple[list[str], list[str]]:
        """KEYS and ARGV of the enqueue script (exposed for pipelined bulk submission).

        Without ``batch`` the request is a client's: reserved names raise ``ValueError``. With
        ``batch`` (the fan-out) the job is a member of that batch, idempotent per custom id
        under a key no client can name (``Keys.batch_idem``)."""
        if batch is None:
            check_client_request(request)
            idem = request.idempotency_key
            idem_key = self.keys.idem(idem or "")
        else:
            idem = idem_key = self.keys.batch_idem(batch.batch_id, batch.idempotency_digest())
        keys = [self.keys.job(job_id), self.keys.stream(request.priority), idem_key]
        args = [
            job_id,
            request.model_dump_json(exclude_none=True),
            request.priority,
            "1" if idem else "0",
        ]
        if batch is not None:
            keys.append(self.keys.batch_members(batch.batch_id))
            args += [batch.batch_id, batch.custom_id, batch.url, batch.model]
        return keys, args

    def enqueue(
        self,
        job_id: str,
        request: JobRequest,
        *,
        batch: BatchRef | None = None,
        tenant: str | None = None,
    ) -> tuple[str, bool]:
        """Store and queue a job. Returns ``(job id, created)``; with an idempotency key already
        used, the existing job's id and ``False``. ``tenant`` is written as the record's own
        ``tenant`` field, atomically with the job (and counted, :mod:`pagedserve.tenants`)."""
        batches = [batch] if batch is not None else None
        return self.enqueue_many([(job_id, request)], batches=batches, tenant=tenant)[0]

    def enqueue_many(
        self,
        jobs: Sequence[tuple[str, JobRequest]],
        *,
        batches: Sequence[BatchRef] | None = None,
        tenant: str | None = None,
    ) -> list[tuple[str, bool]]:
        """:meth:`enqueue` for many jobs in one pipelined round trip (chunk large lists);
        ``batches`` gives each job's :class:`BatchRef` (the fan-out). With a ``tenant`` each
        enqueue is followed by its tenant tag, all in one MULTI/EXEC."""
        self.ensure_groups()
        refs: Sequence[BatchRef | None] = batches if batches is not None else [None] * len(jobs)
        calls: list[Call] = []
        for (jid, req), ref in zip(jobs, refs, strict=True):
            calls.append(("enqueue", *self.enqueue_args(jid, req, batch=ref)))
            if tenant is not None:
                tag_args = [jid, tenant, self.keys.job("")]
                calls.append(("tag_tenant", self.tenants.tag_keys(jid, tenant), tag_args))
        replies = self._exec(calls, transaction=tenant is not None)
        step = 1 if tenant is None else 2
        return [(got, bool(created)) for got, created in replies[::step]]

    def owner(self, job_id: str) -> tuple[bool, str | None]:
        """(whether the job exists, its tenant) in one round trip."""
        jid, tenant = self.r.hmget(self.keys.job(job_id), "id", "tenant")
        return jid is not None, tenant

    def get(self, job_id: str) -> JobRecord | None:
        """The job's record, or ``None`` for an unknown (or expired) id."""
        return self._record(self.r.hgetall(self.keys.job(job_id)))

    def get_many(self, job_ids: Sequence[str]) -> list[JobRecord | None]:
        pipe = self.r.pipeline(transaction=False)
        for jid in job_ids:
            pipe.hgetall(self.keys.job(jid))
        return [self._record(h) for h in pipe.execute()]

    def status(self, job_id: str) -> JobStatus:
        s = self.r.hget(self.keys.job(job_id), "status")
        return JobStatus(s) if s else JobStatus.NOT_FOUND

    def statuses(self, job_ids: Sequence[str]) -> list[JobStatus]:
        pipe = self.r.pipeline(transaction=False)
        for jid in job_ids:
            pipe.hget(self.keys.job(jid), "status")
        return [JobStatus(s) if s else JobStatus.NOT_FOUND for s in pipe.execute()]

    def cancel(self, job_id: str) -> JobStatus:
        """Cancel a job: queued -> cancelled at once; running -> cancelling (its worker aborts it
        at its next step and writes cancelled); a finished job keeps its status. A batch job
        cancelled here gets its ``batch_cancelled`` line."""
        return self.cancel_many([job_id])[0]

    def cancel_many(
        self,
        job_ids: Sequence[str],
        *,
        code: str = openai_format.BATCH_CANCELLED,
        message: str = "cancelled before it ran",
        count_running: bool = False,
    ) -> list[JobStatus]:
        """:meth:`cancel` for many jobs (two pipelined round trips). Each batch job that ends
        here gets its ``code`` error line; with ``count_running`` (a batch expiring) a running
        one too, so that the batch's files are complete at once (its worker's later cancelled
        write then finds it counted and adds nothing)."""
        args = [self.keys.cancel_prefix, self.retention_s, self.events_maxlen]
        calls: list[Call] = [
            ("cancel", [self.keys.job(j), self.keys.events(j)], args) for j in job_ids
        ]
        replies = self._exec(calls)
        adds: list[LineAdd] = []
        for jid, (status, ended, *fields) in zip(job_ids, replies, strict=True):
            ref = BatchRef.from_fields(fields)
            running = count_running and status in ("running", "cancelling")
            if ref is not None and (int(ended) or running):
                ok, line = batch_line(ref, jid, "cancelled", error=message, code=code)
                adds.append(LineAdd(jid, ref, ok, line, allow_running=running))
        self.add_batch_lines(adds)
        return [JobStatus(reply[0]) for reply in replies]

    def add_batch_lines(self, adds: Sequence[LineAdd]) -> int:
        """Add batch lines of jobs that ended without their worker's final write (one round
        trip); each is added only for a member of its batch, once. Returns how many were (an
        error of one batch is logged, not raised)."""
        calls: list[Call] = []
        for a in adds:
            bid = a.ref.batch_id
            keys = [
                self.keys.job(a.job_id),
                self.keys.batch(bid),
                self.keys.batch_members(bid),
                self.keys.batch_counted(bid),
                self.keys.batch_output(bid) if a.ok else self.keys.batch_errors(bid),
            ]
            flags = ["1" if a.allow_missing else "0", "1" if a.allow_running else "0"]
            field_ = "completed" if a.ok else "failed"
            calls.append(("batch_line", keys, [a.job_id, bid, a.line, field_, *flags]))
        added = 0
        for a, reply in zip(adds, self._exec(calls, raise_errors=False), strict=True):
            if isinstance(reply, Exception):
                # A broken batch (a key of the wrong type) must not fail the cancel, claim or
                # release that ended the job; the batch's own finalisation reports it.
                log.warning(
                    "batch %s: line of job %s not added: %s", a.ref.batch_id, a.job_id, reply
                )
            else:
                added += int(reply)
        return added

    @staticmethod
    def _record(h: dict[str, str]) -> JobRecord | None:
        if not h:
            return None

        def opt_float(name: str) -> float | None:
            v = h.get(name)
            return float(v) if v else None

        error = h.get("error") or None
        try:
            request = JobRequest.model_validate_json(h.get("request") or "")
        except ValidationError as e:
            # A stored record always reads back: a request that does not parse (written by an
            # older version or a Redis-side client) is shown as a placeholder with the reason.
            request = UNPARSABLE_REQUEST
            error = error or f"invalid stored request: {short_validation_error(e)}"
        return JobRecord(
            id=h["id"],
            status=JobStatus(h["status"]),
            request=request,
            priority=h.get("priority", "interactive"),  # type: ignore[arg-type]
            created_at=float(h["created_at"]),
            started_at=opt_float("started_at"),
            first_token_at=opt_float("first_token_at"),
            finished_at=opt_float("finished_at"),
            tokens_generated=int(h.get("tokens_generated", 0)),
            worker=h.get("worker") or None,
            deliveries=int(h.get("deliveries", 0)),
            result=JobResult.model_validate_json(h["result"]) if h.get("result") else None,
            error=error,
            tenant=h.get("tenant") or None,
        )

    # ----------------------------------------------------------------------------- worker: claim
    def claim(self, consumer: str, max_jobs: int, block_ms: int = 0) -> list[Lease]:
        """Lease up to ``max_jobs`` jobs (the caller's free capacity: the queue is the
        backpressure). Order: entries stashed from an earlier blocking read, this consumer's own
        pending entries (left by a previous process with the same name), then new entries,
        interactive before bulk. With ``block_ms`` and nothing found, waits that long for work."""
        if max_jobs <= 0:
            return []
        self.ensure_groups()
        entries = self._take_stash(consumer, max_jobs)
        entries += self._own_pending(consumer, max_jobs - len(entries))
        for prio in PRIORITIES:
            want = max_jobs - len(entries)
            if want <= 0:
                break
            reply = self.r.xreadgroup(GROUP, consumer, {self.keys.stream(prio): ">"}, count=want)
            entries += _flatten_entries(reply)
        if not entries and block_ms > 0:
            # COUNT applies per stream, so this may deliver one entry more than asked for: the
            # extra one stays in our pending list and is leased first next time.
            streams = {self.keys.stream(p): ">" for p in PRIORITIES}
            reply = self.r.xreadgroup(GROUP, consumer, streams, count=1, block=block_ms)
            got = _flatten_entries(reply)
            entries, extra = got[:max_jobs], got[max_jobs:]
            if extra:
                self._stash.setdefault(consumer, []).extend(extra)
        return self._lease_entries(consumer, entries)

    def reclaim(self, consumer: str, min_idle_ms: int, max_jobs: int) -> list[Lease]:
        """Take over up to ``max_jobs`` entries idle for ``min_idle_ms`` (their worker stopped
        renewing: presumed dead) with XAUTOCLAIM, interactive first, and lease them."""
        if max_jobs <= 0:
            return []
        self.ensure_groups()
        entries: list[Entry] = []
        for prio in PRIORITIES:
            stream = self.keys.stream(prio)
            start = self._autoclaim_cursor.get(stream, "0-0")
            while len(entries) < max_jobs:
                reply = self.r.xautoclaim(
                    stream,
                    GROUP,
                    consumer,
                    min_idle_ms,
                    start_id=start,
                    count=max_jobs - len(entries),
                )
                start = reply[0]
                entries += [(stream, eid, _job_of(fields)) for eid, fields in reply[1]]
                if start == "0-0":
                    break
            self._autoclaim_cursor[stream] = start
        return self._lease_entries(consumer, entries)

    def _take_stash(self, consumer: str, n: int) -> list[Entry]:
        stash = self._stash.get(consumer)
        if not stash or n <= 0:
            return []
        taken, self._stash[consumer] = stash[:n], stash[n:]
        return taken

    def _own_pending(self, consumer: str, n: int) -> list[Entry]:
        """This consumer's pending entries, read once after a (re)start of this store object:
        afterwards they are jobs this process itself runs."""
        out: list[Entry] = []
        for prio in PRIORITIES:
            stream = self.keys.stream(prio)
            cursor = self._pending_cursor.get((consumer, stream), "0")
            while cursor is not None and len(out) < n:
                reply = self.r.xreadgroup(GROUP, consumer, {stream: cursor}, count=n - len(out))
                got = _flatten_entries(reply)
                if not got:
                    cursor = None
                    break
                out += got
                cursor = got[-1][1]
            self._pending_cursor[(consumer, stream)] = cursor
        return out

    def _lease_entries(self, consumer: str, entries: Sequence[Entry]) -> list[Lease]:
        """Run the lease script on every entry in one pipelined round trip."""
        calls: list[Call] = []
        live: list[Entry] = []
        for stream, eid, job_id in entries:
            if job_id is None:  # the entry's content was deleted: nothing to run
                self.r.xack(stream, GROUP, eid)
                continue
            live.append((stream, eid, job_id))
            keys = [self.keys.job(job_id), stream, self.keys.dead, self.keys.events(job_id)]
            args = [
                consumer,
                GROUP,
                eid,
                self.lease_ms,
                self.max_deliveries,
                self.retention_s,
                self.events_maxlen,
            ]
            calls.append(("lease", keys, args))
        leases: list[Lease] = []
        adds: list[LineAdd] = []
        replies = self._exec(calls, raise_errors=False)
        for (stream, eid, job_id), reply in zip(live, replies, strict=True):
            assert job_id is not None
            if isinstance(reply, Exception):
                self._dead_letter_unreadable(stream, eid, job_id, reply)
                continue
            kind = reply[0]
            if kind in ("dead", "skip"):
                self._count_unrun(job_id, reply, adds)
                continue
            lease = self._lease_of(consumer, stream, eid, job_id, reply)
            if lease is not None:
                leases.append(lease)
        if adds:
            self.add_batch_lines(adds)
        return leases

    def _count_unrun(self, job_id: str, reply: Sequence[Any], adds: list[LineAdd]) -> None:
        """A job that ended at claim (dead-lettered, or cancelled while its owner was gone):
        count it, and queue its batch line."""
        kind, why, *fields = reply
        if kind == "dead":
            self.stats.dead_lettered += 1
            log.warning("job %s dead-lettered: %s", job_id, why)
        else:
            self.stats.skipped += 1
        ref = BatchRef.from_fields(fields)
        if ref is None or (kind == "skip" and why != "cancelled"):
            return
        if kind == "dead":
            ok, line = batch_line(
                ref, job_id, "failed", error=why, code=openai_format.DEAD_LETTERED
            )
        else:
            msg = "cancelled before it finished"
            ok, line = batch_line(
                ref, job_id, "cancelled", error=msg, code=openai_format.BATCH_CANCELLED
            )
        adds.append(LineAdd(job_id, ref, ok, line))

    def _lease_of(
        self, consumer: str, stream: str, eid: str, job_id: str, reply: Sequence[Any]
    ) -> Lease | None:
        """The lease of an 'ok' reply; ``None`` (handed over in :attr:`malformed`) when the
        stored request does not parse."""
        reason = None
        try:
            request = JobRequest.model_validate_json(reply[2] or "")
        except ValidationError as e:
            request, reason = UNPARSABLE_REQUEST, short_validation_error(e)
        lease = Lease(
            job_id=job_id,
            fence=int(reply[1]),
            consumer=consumer,
            priority=stream.rsplit(":", 1)[1],  # type: ignore[arg-type]
            entry_id=eid,
            request=request,
            deliveries=int(reply[3]),
            batch=BatchRef.from_fields(reply[4:]),
        )
        if reason is not None:
            # Leased (so owned and fenced) but handed over apart, to be failed at once.
            self.malformed.append((lease, f"invalid request: {reason}"))
            return None
        return lease

    def _dead_letter_unreadable(self, stream: str, eid: str, job_id: str, err: Exception) -> None:
        """An entry whose lease script failed (its job key is not a job record): nothing can
        run or fail it, so it goes to the dead-letter stream with the reason, and is acked."""
        reason = f"unreadable job record: {err}"
        log.warning("job %s dead-lettered: %s", job_id, reason)
        self.stats.dead_lettered += 1
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(self.keys.dead, {"job": job_id, "stream": stream, "entry": eid,
                                   "reason": reason})  # fmt: skip
        pipe.xack(stream, GROUP, eid)
        pipe.execute()

    def take_malformed(self) -> list[tuple[Lease, str]]:
        """Leases whose stored request does not parse, with the reason (cleared on read)."""
        out, self.malformed = self.malformed, []
        return out

    def own_pending_read(self, consumer: str) -> bool:
        """Whether claims have re-read every pending entry ``consumer`` left from an earlier run.

        Until then a worker must not reclaim: XAUTOCLAIM would hand it those same entries, and
        the pending re-read would then lease them a second time.
        """
        return all(
            self._pending_cursor.get((consumer, self.keys.stream(p)), "0") is None
            for p in PRIORITIES
        )

    # ----------------------------------------------------------------------------- worker: writes
    def renew(self, leases: Sequence[Lease]) -> list[str]:
        """Extend every lease in one round trip (and reset their entries' idle time so no other
        worker reclaims them). Returns the ids of jobs whose lease was lost: the worker must drop
        them without writing anything more."""
        if not leases:
            return []
        by_consumer: dict[str, list[Lease]] = {}
        for lease in leases:
            by_consumer.setdefault(lease.consumer, []).append(lease)
        calls: list[Call] = []
        groups = list(by_consumer.values())
        for group in groups:
            keys = [self.keys.job(x.job_id) for x in group]
            keys += [self.keys.stream(x.priority) for x in group]
            args: list[Any] = [group[0].consumer, GROUP, self.lease_ms]
            args += [x.fence for x in group] + [x.entry_id for x in group]
            calls.append(("renew", keys, args))
        lost: list[str] = []
        for group, flags in zip(groups, self._exec(calls), strict=True):
            lost += [x.job_id for x, ok in zip(group, flags, strict=True) if not ok]
        return lost

    def _finish_call(self, fin: Finish) -> Call:
        """The fenced final write; a batch job's line (built here) goes with it."""
        lease = fin.lease
        if fin.status == "succeeded" and fin.result is None:
            raise ValueError("a succeeded job needs a result")
        result = fin.result.model_dump_json(exclude_none=True) if fin.result is not None else ""
        tokens = str(fin.result.completion_tokens) if fin.result is not None else ""
        error = fin.error or ("failed" if fin.status == "failed" else "")
        keys = [
            self.keys.job(lease.job_id),
            self.keys.stream(lease.priority),
            self.keys.events(lease.job_id),
        ]
        args = [
            lease.fence,
            GROUP,
            fin.status,
            result,
            error,
            tokens,
            self.retention_s,
            self.events_maxlen,
        ]
        ref = lease.batch
        if ref is not None:
            ok, line = batch_line(ref, lease.job_id, fin.status, fin.result, fin.error)
            bid = ref.batch_id
            keys += [
                self.keys.batch(bid),
                self.keys.batch_members(bid),
                self.keys.batch_counted(bid),
                self.keys.batch_output(bid) if ok else self.keys.batch_errors(bid),
            ]
            args += [lease.job_id, bid, line, "completed" if ok else "failed"]
        return ("finish", keys, args)

    def _progress_call(self, p: Progress) -> Call:
        lease = p.lease
        keys = [self.keys.job(lease.job_id), self.keys.events(lease.job_id)]
        args = [
            lease.fence,
            p.tokens_generated,
            p.index,
            p.delta_text,
            json.dumps(list(p.delta_token_ids), separators=(",", ":")),
            self.events_maxlen,
        ]
        return ("progress", keys, args)

    def commit_step(
        self,
        consumer: str | None = None,
        progress: Iterable[Progress] = (),
        finished: Iterable[Finish] = (),
    ) -> StepResult:
        """One round trip per engine step: all progress updates, all final writes, and (with
        ``consumer``) the drain of that worker's cancel set. Refused writes (lease lost) are
        reported in :attr:`StepResult.lost`, each job once."""
        calls: list[Call] = []
        ids: list[tuple[str, Finish | None]] = []
        for p in progress:
            calls.append(self._progress_call(p))
            ids.append((p.lease.job_id, None))
        for f in finished:
            calls.append(self._finish_call(f))
            ids.append((f.lease.job_id, f))
        if consumer is not None:
            calls.append(("pop_cancels", [self.keys.cancel(consumer)], []))
        replies = self._exec(calls, raise_errors=False)
        out = StepResult()
        for (jid, fin), reply in zip(ids, replies, strict=False):
            if isinstance(reply, Exception):
                log.warning("write for job %s failed: %s", jid, reply)
                out.errors.append(WriteError(jid, str(reply), fin))
                continue
            ok = reply[0] if isinstance(reply, list) else reply
            if not ok and jid not in out.lost:
                out.lost.append(jid)
                log.warning("write for job %s refused: lease lost", jid)
        if consumer is not None:
            if isinstance(replies[-1], Exception):
                raise replies[-1]
            out.cancels = set(replies[-1][0] or ())
        return out

    def progress(
        self,
        lease: Lease,
        tokens_generated: int,
        delta_text: str = "",
        delta_token_ids: Sequence[int] = (),
        index: int = 0,
    ) -> bool:
        """Fenced progress of one job; ``False`` when the lease is lost."""
        p = Progress(lease, tokens_generated, delta_text, delta_token_ids, index)
        return not self.commit_step(progress=[p]).lost

    def complete(self, lease: Lease, result: JobResult) -> bool:
        """Fenced final write of a succeeded job; ``False`` (refused) if the lease is lost."""
        return not self.commit_step(finished=[Finish(lease, "succeeded", result=result)]).lost

    def fail(self, lease: Lease, reason: str) -> bool:
        """Fenced final write of a failed job; ``False`` if the lease is lost."""
        return not self.commit_step(finished=[Finish(lease, "failed", error=reason)]).lost

    def finish_cancelled(self, lease: Lease, result: JobResult | None = None) -> bool:
        """Fenced write of a cancelled job (after a cancel request), with any partial result."""
        return not self.commit_step(finished=[Finish(lease, "cancelled", result=result)]).lost

    def release(self, lease: Lease) -> JobStatus | None:
        """Hand a running job back to the queue (e.g. when draining on SIGTERM). Returns the new
        status (queued, or cancelled if a cancel was pending), or ``None`` if the lease is lost."""
        keys = [
            self.keys.job(lease.job_id),
            self.keys.stream(lease.priority),
            self.keys.events(lease.job_id),
        ]
        args = [lease.fence, GROUP, lease.job_id, self.retention_s, self.events_maxlen]
        out, *fields = self._exec([("release", keys, args)])[0]
        ref = BatchRef.from_fields(fields)
        if out == "cancelled" and ref is not None:
            msg = "cancelled before it finished"
            ok, line = batch_line(
                ref, lease.job_id, "cancelled", error=msg, code=openai_format.BATCH_CANCELLED
            )
            self.add_batch_lines([LineAdd(lease.job_id, ref, ok, line)])
        return JobStatus(out) if out in ("queued", "cancelled") else None

    def pop_cancels(self, consumer: str) -> set[str]:
        """Drain the job ids clients asked this worker to cancel."""
        return self.commit_step(consumer=consumer).cancels

    # ----------------------------------------------------------------------------- workers
    def heartbeat(self, worker_id: str, info: dict[str, Any], ttl_s: int = 30) -> None:
        """Publish a worker's liveness and stats (JSON values) with a TTL."""
        key = self.keys.worker(worker_id)
        fields = {k: json.dumps(v) for k, v in info.items()}
        t = self.r.time()
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(key)
        if fields:
            pipe.hset(key, mapping=fields)
        pipe.hset(key, "last_seen", json.dumps(t[0] + t[1] / 1e6))
        pipe.expire(key, ttl_s)
        pipe.zadd(self.keys.workers, {worker_id: t[0]})
        pipe.execute()

    def workers(self) -> dict[str, dict[str, Any]]:
        """Live workers (heartbeat key not expired) and their last published info."""
        ids = self.r.zrange(self.keys.workers, 0, -1)
        pipe = self.r.pipeline(transaction=False)
        for wid in ids:
            pipe.hgetall(self.keys.worker(wid))
        out: dict[str, dict[str, Any]] = {}
        stale: list[str] = []
        for wid, h in zip(ids, pipe.execute(), strict=True):
            if h:
                out[wid] = {k: json.loads(v) for k, v in h.items()}
            else:
                stale.append(wid)
        if stale:
            self.r.zrem(self.keys.workers, *stale)
        return out

    def queue_lengths(self) -> dict[str, int]:
        """Entries not yet delivered to any worker, per priority (the group's lag)."""
        self.ensure_groups()
        out: dict[str, int] = {}
        for prio in PRIORITIES:
            groups = self.r.xinfo_groups(self.keys.stream(prio))
            g = next((g for g in groups if g["name"] == GROUP), None)
            lag = g.get("lag") if g else None
            out[prio] = int(lag) if lag is not None else self.r.xlen(self.keys.stream(prio))
        return out

    def dead_letters(self, count: int = 100) -> list[dict[str, str]]:
        return [dict(fields, id=eid) for eid, fields in self.r.xrange(self.keys.dead, count=count)]


__all__ = [
    "TERMINAL_STATUSES",
    "BatchRef",
    "ClaimStats",
    "Finish",
    "JobStore",
    "Lease",
    "LineAdd",
    "Progress",
    "StepResult",
    "WriteError",
]
