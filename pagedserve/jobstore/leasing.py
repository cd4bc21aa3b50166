"""The worker side of the job store, taking work: claim (stash, own pending entries, new
entries, interactive first), reclaim (``reclaim.lua``: dead workers' idle entries), lease, renew.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Sequence
from typing import Any

from pydantic import ValidationError

from pagedserve import openai_format
from pagedserve.jobstore.base import Call, StoreBase
from pagedserve.jobstore.records import (
    BatchRef,
    Entry,
    Lease,
    LineAdd,
    batch_line,
    flatten_entries,
    job_of,
)
from pagedserve.keys import GROUP, PRIORITIES, WINDOW_CONSUMER, Priority
from pagedserve.schemas import (
    UNPARSABLE_REQUEST,
    JobRequest,
    short_validation_error,
)

log = logging.getLogger("pagedserve.store")

#: With several shards, the longest a blocking claim waits on one shard's streams.
BLOCK_SLICE_MS = 100
#: Pending rows one reclaim call looks at (the admission window holds up to 2048 by default).
RECLAIM_SCAN = 1024


class Leasing(StoreBase):
    """Claim, reclaim and renew leases (what workers call to take and keep work)."""

    def claim(
        self,
        consumer: str,
        max_jobs: int,
        block_ms: int = 0,
        priorities: Sequence[Priority] = PRIORITIES,
    ) -> list[Lease]:
        """Lease up to ``max_jobs`` jobs (the caller's free capacity: the queue is the
        backpressure). Order: entries stashed from an earlier blocking read, this consumer's own
        pending entries (left by a previous process with the same name), then new entries of
        ``priorities``, interactive before bulk. With ``block_ms`` and nothing found, waits that
        long for work. (With prefix-aware admission the worker passes ``("interactive",)`` and
        takes bulk work through ``admit_bulk``.)"""
        if max_jobs <= 0:
            return []
        self.ensure_groups()
        entries = self._take_stash(consumer, max_jobs)
        entries += self._own_pending(consumer, max_jobs - len(entries))
        for stream in self._rotated(self.all_streams(priorities)):
            want = max_jobs - len(entries)
            if want <= 0:
                break
            reply = self.r.xreadgroup(GROUP, consumer, {stream: ">"}, count=want)
            entries += flatten_entries(reply)
        if not entries and block_ms > 0:
            entries = self._block_read(consumer, max_jobs, block_ms, priorities)
        return self._lease_entries(consumer, entries)

    def _rotated(self, streams: list[str]) -> list[str]:
        """``streams`` (priority-major) with each priority's shards in a turn that moves on at
        every claim, so that no shard's work waits behind another's."""
        n = self.keys.shards
        if n == 1:
            return streams
        self._block_turn = (self._block_turn + 1) % n
        t = self._block_turn
        return [
            s
            for i in range(0, len(streams), n)
            for s in streams[i + t : i + n] + streams[i : i + t]
        ]

    def _block_read(
        self, consumer: str, max_jobs: int, block_ms: int, priorities: Sequence[Priority]
    ) -> list[Entry]:
        """Wait up to ``block_ms`` for new work. A blocking read spans one slot: one shard's
        streams (each claim waits on the next shard, at most ``BLOCK_SLICE_MS`` while other
        shards exist, so work arriving on them waits no longer than that)."""
        shard = self._block_turn % self.keys.shards
        if self.keys.shards > 1:
            block_ms = min(block_ms, BLOCK_SLICE_MS)
        # COUNT applies per stream, so this may deliver one entry more than asked for: the
        # extra one stays in our pending list and is leased first next time.
        streams = {self.keys.stream(p, shard): ">" for p in priorities}
        reply = self.r.xreadgroup(GROUP, consumer, streams, count=1, block=block_ms)
        got = flatten_entries(reply)
        entries, extra = got[:max_jobs], got[max_jobs:]
        if extra:
            self._stash.setdefault(consumer, []).extend(extra)
        return entries

    def reclaim(
        self, consumer: str, min_idle_ms: int, max_jobs: int, held: Container[str] = ()
    ) -> list[Lease]:
        """Take over up to ``max_jobs`` entries idle for ``min_idle_ms`` (their worker stopped
        renewing: presumed dead), interactive first, and lease them (``reclaim.lua``: the
        pending entries of every consumer but the admission window's, which wait to be chosen,
        not for a lease to lapse).

        ``held``: ids of jobs the caller serves now. The caller's own idle entries are taken
        too (a final write lost in a failover leaves one behind), but leasing one of a job that
        runs fine would count one more delivery of it: those are left in the caller's pending
        list, idle reset."""
        if max_jobs <= 0:
            return []
        self.ensure_groups()
        entries: list[Entry] = []
        for stream in self.all_streams():
            start = self._reclaim_cursor.get(stream, "-")
            while len(entries) < max_jobs:
                args = [GROUP, consumer, min_idle_ms, start, max_jobs - len(entries),
                        WINDOW_CONSUMER, RECLAIM_SCAN]  # fmt: skip
                start, got = self._exec([("reclaim", [stream], args)])[0]
                for item in got:
                    if not item:  # deleted meanwhile
                        continue
                    eid, flat = item[0], item[1] or []
                    job = job_of(dict(zip(flat[::2], flat[1::2], strict=True)))
                    if job not in held:
                        entries.append((stream, eid, job))
                if start == "0-0":
                    start = "-"
                    break
            self._reclaim_cursor[stream] = start
        return self._lease_entries(consumer, entries, "reclaim")

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
        for stream in self.all_streams():
            cursor = self._pending_cursor.get((consumer, stream), "0")
            while cursor is not None and len(out) < n:
                reply = self.r.xreadgroup(GROUP, consumer, {stream: cursor}, count=n - len(out))
                got = flatten_entries(reply)
                if not got:
                    cursor = None
                    break
                out += got
                cursor = got[-1][1]
            self._pending_cursor[(consumer, stream)] = cursor
        return out

    def _lease_entries(
        self, consumer: str, entries: Sequence[Entry], path: str = "claim"
    ) -> list[Lease]:
        """Run the lease script on every entry in one pipelined round trip (one more for the
        rare job that ends at lease and has an idempotency key: see :meth:`_lease_replies`).
        ``path`` (claim, reclaim, admission) is named in the log line of a re-delivery."""
        live: list[tuple[str, str, str]] = []
        for stream, eid, job_id in entries:
            if job_id is None:  # the entry's content was deleted: nothing to run
                self.r.xack(stream, GROUP, eid)
                continue
            if self.keys.shard(job_id) != self._stream_shard(stream):
                # Not written by enqueue (its jobs live in their stream's shard): on a cluster
                # its record is in another slot than the entry, which no script may span.
                self._dead_letter_unreadable(stream, eid, job_id, ValueError("wrong shard"))
                continue
            live.append((stream, eid, job_id))
        leases: list[Lease] = []
        adds: list[LineAdd] = []
        replies = self._lease_replies(consumer, live)
        for (stream, eid, job_id), reply in zip(live, replies, strict=True):
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
                if lease.deliveries > 1:  # rare; says how a job came to be dead-lettered
                    log.info("job %s leased again by %s (%s, delivery %d, fence %d)", job_id,
                             consumer, path, lease.deliveries, lease.fence)  # fmt: skip
        if adds:
            self.add_batch_lines(adds)
        return leases

    def _lease_replies(
        self, consumer: str, live: Sequence[tuple[str, str, str]], tries: int = 3
    ) -> list[Any]:
        """``lease.lua`` replies for ``live`` entries. Each call first names the job key as the
        job's idempotency key (unknown yet); a job that would end at lease (cancelled,
        dead-lettered) with an idempotency key answers 'idem' with that key, changing nothing,
        and is called again naming it, so that the script declares the key it expires."""
        replies: list[Any] = [None] * len(live)
        idem = [self.keys.job(job_id) for _, _, job_id in live]
        todo = list(range(len(live)))
        for _ in range(tries):
            calls: list[Call] = []
            for i in todo:
                stream, eid, job_id = live[i]
                dead = self.keys.dead_in(self._stream_shard(stream))
                keys = [self.keys.job(job_id), stream, dead, self.keys.events(job_id), idem[i]]
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
            for i, reply in zip(todo, self._exec(calls, raise_errors=False), strict=True):
                replies[i] = reply
                if not isinstance(reply, Exception) and reply[0] == "idem":
                    named = reply[1] if len(reply) > 1 else None
                    idem[i] = named or self.keys.job(live[i][2])
            todo = [i for i in todo if not isinstance(replies[i], Exception)
                    and replies[i][0] == "idem"]  # fmt: skip
            if not todo:
                return replies
        for i in todo:  # the record kept changing (not seen in practice): read as unreadable
            replies[i] = RuntimeError(f"lease: idempotency key of {live[i][2]} kept changing")
        return replies

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
            batch=BatchRef.from_fields(reply[6:]),
            idem_key=reply[4] or None,
            created_at=_float_or_none(reply[5] if len(reply) > 5 else None),
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
        dead = self.keys.dead_in(self._stream_shard(stream))
        pipe.xadd(dead, {"job": job_id, "stream": stream, "entry": eid,
                                   "reason": reason})  # fmt: skip
        pipe.xack(stream, GROUP, eid)
        pipe.execute()

    def take_malformed(self) -> list[tuple[Lease, str]]:
        """Leases whose stored request does not parse, with the reason (cleared on read)."""
        out, self.malformed = self.malformed, []
        return out

    def own_pending_read(self, consumer: str) -> bool:
        """Whether claims have re-read every pending entry ``consumer`` left from an earlier run.

        Until then a worker must not reclaim: reclaim would hand it those same entries, and
        the pending re-read would then lease them a second time.
        """
        return all(
            self._pending_cursor.get((consumer, stream), "0") is None
            for stream in self.all_streams()
        )

    def _stream_shard(self, stream: str) -> int:
        """The shard of one of our stream keys (``ps:{sK}:jobs:<priority>``)."""
        n = self.keys.shards
        return next(
            (k for k in range(n) for p in PRIORITIES if self.keys.stream(p, k) == stream), 0
        )

    def renew(self, leases: Sequence[Lease]) -> list[str]:
        """Extend every lease in one round trip (and reset their entries' idle time so no other
        worker reclaims them). Returns the ids of jobs whose lease was lost: the worker must drop
        them without writing anything more."""
        if not leases:
            return []
        # One call per consumer and shard (a script touches one slot).
        by_consumer: dict[tuple[str, int], list[Lease]] = {}
        for lease in leases:
            by_consumer.setdefault((lease.consumer, self.keys.shard(lease.job_id)), []).append(
                lease
            )
        calls: list[Call] = []
        groups = list(by_consumer.values())
        for group in groups:
            keys = [self.keys.job(x.job_id) for x in group]
            keys += [self.keys.job_stream(x.job_id, x.priority) for x in group]
            args: list[Any] = [group[0].consumer, GROUP, self.lease_ms]
            args += [x.fence for x in group] + [x.entry_id for x in group]
            calls.append(("renew", keys, args))
        lost: list[str] = []
        for group, flags in zip(groups, self._exec(calls), strict=True):
            lost += [x.job_id for x, ok in zip(group, flags, strict=True) if not ok]
        return lost


def _float_or_none(v: Any) -> float | None:
    try:
        return float(v) if v not in (None, "") else None
    except (TypeError, ValueError):
        return None
