"""The Redis job store: enqueue, lease, renew, reclaim, fenced writes, cancel.

Every state change is one Lua script (atomic on the server). The worker-side calls take lists and
run as pipelines so that a worker loop needs one or two round trips per engine step however many
jobs it runs: :meth:`JobStore.commit_step` writes all progress and final results of a step and
drains the worker's cancel set in one round trip.

Fencing: each lease carries a token (``fence``) that :meth:`claim` / :meth:`reclaim` increment. A
write succeeds only while the job's current fence equals the writer's, so a worker that lost its
lease (presumed dead, its entry reclaimed by another) can never overwrite the new owner's work.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Literal

import redis
from pydantic import ValidationError
from redis.commands.core import Script

from pagedserve.keys import GROUP, PRIORITIES, Keys, Priority
from pagedserve.redis_util import connect
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
DEFAULT_LEASE_MS = 30_000
DEFAULT_MAX_DELIVERIES = 3
DEFAULT_EVENTS_MAXLEN = 10_000

FinalStatus = Literal["succeeded", "failed", "cancelled"]


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
    #: For a job of an OpenAI batch: the batch and the output (succeeded) or error-file line
    #: (failed, cancelled) appended atomically with the final write, only if it is accepted.
    batch_id: str | None = None
    batch_line: str | None = None


def batch_keys(keys: Keys, batch_id: str) -> tuple[str, str, str, str]:
    """A batch's hash, output-line list, error-line list and set of counted job ids."""
    base = keys.batch(batch_id)
    return base, f"{base}:output", f"{base}:errors", f"{base}:counted"


@dataclass
class StepResult:
    """What :meth:`JobStore.commit_step` reports back to the worker loop."""

    #: Job ids whose progress or final write was refused: the lease is lost, drop the sequence.
    lost: list[str] = field(default_factory=list)
    #: Job ids a client asked to cancel (drained from this worker's cancel set).
    cancels: set[str] = field(default_factory=set)


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
    items = reply.items() if isinstance(reply, dict) else (reply or [])
    for stream, entries in items:
        if isinstance(entries, list) and entries and isinstance(entries[0], list):
            entries = entries[0]  # RESP3 wraps the entries in a list
        for entry_id, fields in entries:
            out.append((stream, entry_id, _job_of(fields)))
    return out


class JobStore:
    """All job state transitions against one Redis (see the module docstring)."""

    def __init__(
        self,
        redis_client: redis.Redis | str | None = None,
        *,
        prefix: str = "ps",
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

    def _exec(self, calls: Sequence[Call], transaction: bool = False) -> list[Any]:
        """Run script calls as EVALSHA in one pipeline (MULTI/EXEC with ``transaction``): one
        round trip.

        A NOSCRIPT error (empty script cache after a Redis restart) fails every call of the
        pipeline the same way, so loading the scripts and resending it once is safe.
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
                if isinstance(x, Exception):
                    raise x
            return replies
        raise AssertionError("unreachable")

    # ----------------------------------------------------------------------------- client side
    def enqueue_args(self, job_id: str, request: JobRequest) -> tuple[list[str], list[str]]:
        """KEYS and ARGV of the enqueue script (exposed for pipelined bulk submission)."""
        idem = request.idempotency_key
        keys = [
            self.keys.job(job_id),
            self.keys.stream(request.priority),
            self.keys.idem(idem) if idem else self.keys.idem(""),
        ]
        args = [
            job_id,
            request.model_dump_json(exclude_none=True),
            request.priority,
            "1" if idem else "0",
        ]
        return keys, args

    def enqueue(
        self, job_id: str, request: JobRequest, *, tenant: str | None = None
    ) -> tuple[str, bool]:
        """Store and queue a job. Returns ``(job id, created)``; with an idempotency key already
        used, the existing job's id and ``False``. ``tenant`` is written as the record's own
        ``tenant`` field, atomically with the job (and counted, :mod:`pagedserve.tenants`)."""
        return self.enqueue_many([(job_id, request)], tenant=tenant)[0]

    def enqueue_many(
        self, jobs: Sequence[tuple[str, JobRequest]], *, tenant: str | None = None
    ) -> list[tuple[str, bool]]:
        """:meth:`enqueue` for many jobs in one pipelined round trip (chunk large lists)."""
        self.ensure_groups()
        calls: list[Call] = []
        for jid, req in jobs:
            calls.append(("enqueue", *self.enqueue_args(jid, req)))
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
        at its next step and writes cancelled); a finished job keeps its status."""
        call: Call = (
            "cancel",
            [self.keys.job(job_id), self.keys.events(job_id)],
            [self.keys.cancel_prefix, self.retention_s, self.events_maxlen],
        )
        return JobStatus(self._exec([call])[0])

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
        for (stream, eid, job_id), reply in zip(live, self._exec(calls), strict=True):
            assert job_id is not None
            kind = reply[0]
            if kind == "dead":
                self.stats.dead_lettered += 1
                log.warning("job %s dead-lettered: %s", job_id, reply[1])
                continue
            if kind != "ok":
                self.stats.skipped += 1
                continue
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
            )
            if reason is not None:
                # Leased (so owned and fenced) but handed over apart, to be failed at once.
                self.malformed.append((lease, f"invalid request: {reason}"))
                continue
            leases.append(lease)
        return leases

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
        if fin.batch_id and fin.batch_line is not None:
            ok = fin.status == "succeeded"
            bhash, out, errs, counted = batch_keys(self.keys, fin.batch_id)
            keys += [bhash, out if ok else errs, counted]
            args += [fin.batch_line, "completed" if ok else "failed", lease.job_id]
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
        ids: list[str] = []
        for p in progress:
            calls.append(self._progress_call(p))
            ids.append(p.lease.job_id)
        for f in finished:
            calls.append(self._finish_call(f))
            ids.append(f.lease.job_id)
        if consumer is not None:
            calls.append(("pop_cancels", [self.keys.cancel(consumer)], []))
        replies = self._exec(calls)
        out = StepResult()
        for jid, reply in zip(ids, replies, strict=False):
            ok = reply[0] if isinstance(reply, list) else reply
            if not ok and jid not in out.lost:
                out.lost.append(jid)
                log.warning("write for job %s refused: lease lost", jid)
        if consumer is not None:
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
        out = self._exec([("release", keys, args)])[0]
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
    "ClaimStats",
    "Finish",
    "JobStore",
    "Lease",
    "Progress",
    "StepResult",
]
