"""The worker side of the job store, writing results: per-step fenced progress and final writes
in one round trip, release (hand back), and the drain of a worker's cancel set.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis

from pagedserve import openai_format
from pagedserve.jobstore.base import Call, StoreBase
from pagedserve.jobstore.records import (
    BatchRef,
    Finish,
    Lease,
    LineAdd,
    Progress,
    StepResult,
    WriteError,
    batch_line,
)
from pagedserve.keys import GROUP
from pagedserve.schemas import (
    JobResult,
    JobStatus,
)

log = logging.getLogger("pagedserve.store")


class Commits(StoreBase):
    """Fenced writes of leased jobs (what workers call each engine step)."""

    def _finish_call(self, fin: Finish) -> Call:
        """The fenced final write; a batch job's line (built here) goes with it."""
        lease = fin.lease
        result = fin.result.model_dump_json(exclude_none=True) if fin.result is not None else ""
        tokens = str(fin.result.completion_tokens) if fin.result is not None else ""
        error = fin.error or ("failed" if fin.status == "failed" else "")
        keys = [
            self.keys.job(lease.job_id),
            self.keys.job_stream(lease.job_id, lease.priority),
            self.keys.events(lease.job_id),
            self._idem_key(lease),
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
        if ref is not None and not self.cluster:  # on a cluster: a second step (commit_step)
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

    def _idem_key(self, lease: Lease) -> str:
        """The KEYS entry for the job's idempotency key: the lease's, or the job key itself
        for none (``idem_matches`` in ``_common.lua``)."""
        return lease.idem_key or self.keys.job(lease.job_id)

    def _progress_calls(
        self, progress: Iterable[Progress], out: StepResult
    ) -> list[tuple[Call, list[Lease]]]:
        """The step's deltas as ``progress.lua`` calls, each with the leases in its order: one
        call for all on a single Redis, one per job on a cluster (their keys' slots differ). A
        delta whose values cannot be built is that job's write error instead."""
        groups: list[tuple[list[str], list[Any], list[Lease]]] = []
        for p in progress:
            jid = p.lease.job_id
            try:
                ids = json.dumps(list(p.delta_token_ids), separators=(",", ":"))
            except Exception as e:
                log.warning("write for job %s not built: %r", jid, e)
                out.errors.append(WriteError(jid, f"{type(e).__name__}: {e}"))
                continue
            if not groups or self.cluster:
                groups.append(([], [self.events_maxlen], []))
            keys, args, leases = groups[-1]
            keys += (self.keys.job(jid), self.keys.events(jid), self.keys.watch(jid))
            args += (p.lease.fence, p.tokens_generated, p.index, p.delta_text, ids, p.end)
            leases.append(p.lease)
        return [(("progress", keys, args), leases) for keys, args, leases in groups]

    def commit_step(
        self,
        consumer: str | None = None,
        progress: Iterable[Progress] = (),
        finished: Iterable[Finish] = (),
    ) -> StepResult:
        """One round trip per engine step: all progress updates (one script call for all of
        them, but on a cluster), all final writes, and (with ``consumer``) the drain of that
        worker's cancel set. Refused writes (lease lost) are reported in
        :attr:`StepResult.lost`, each job once, and in :attr:`StepResult.refused` with the
        fence of each refused write. A write that cannot be built or that Redis answers with
        an error is reported in :attr:`StepResult.errors` (the other writes still count)."""
        progress, finished = list(progress), list(finished)
        if any(f.status == "succeeded" and f.result is None for f in finished):
            raise ValueError("a succeeded job needs a result")  # the caller's bug, not the job's
        calls: list[Call] = []
        sent: list[tuple[Lease, Finish | None]] = []
        out = StepResult()
        deltas = self._progress_calls(progress, out)
        calls += [call for call, _ in deltas]
        for f in finished:
            self._add_call(calls, sent, out, f.lease, f, lambda f=f: self._finish_call(f))
        drains = self.keys.shards if consumer is not None else 0
        for k in range(drains):
            calls.append(("pop_cancels", [self.keys.cancel(consumer or "", k)], []))
        replies = self._exec(calls, raise_errors=False)
        ended: list[Finish] = []
        for (_, leases), reply in zip(deltas, replies, strict=False):
            per_job = reply if isinstance(reply, list) else [reply] * len(leases)
            for lease, r in zip(leases, per_job, strict=True):
                if isinstance(r, bytes | str):  # that job's error, caught in the script
                    r = redis.ResponseError(r.decode() if isinstance(r, bytes) else r)
                self._take_reply(out, ended, lease, None, r)
                if r in (1, 2):
                    out.watched[lease.job_id] = r == 2
        replies = replies[len(deltas) :]
        for (lease, fin), reply in zip(sent, replies, strict=False):
            self._take_reply(out, ended, lease, fin, reply)
        for reply in replies[len(replies) - drains :] if drains else []:
            if isinstance(reply, Exception):
                # The writes above went through: a broken cancel set (a key of the wrong type)
                # must not make the caller send them again, nor stop its writes.
                log.warning("cancel set of %s not drained: %s", consumer, reply)
            else:
                out.cancels |= set(reply[0] or ())
        if ended:
            self.add_batch_lines([self._line_of(f) for f in ended])
        return out

    def _take_reply(
        self, out: StepResult, ended: list[Finish], lease: Lease, fin: Finish | None, reply: Any
    ) -> None:
        """Book one job's reply: an error, a refusal (lease lost) or a write done."""
        jid = lease.job_id
        if isinstance(reply, Exception):
            log.warning("write for job %s failed: %s", jid, reply)
            out.errors.append(WriteError(jid, str(reply), fin))
            return
        ok = reply[0] if isinstance(reply, list) else reply
        if not ok:
            out.refused.append((jid, lease.fence))
            if jid not in out.lost:
                out.lost.append(jid)
                log.warning("write for job %s refused: lease lost", jid)
        elif fin is not None:
            out.finished.append(fin.status)
            if lease.batch is not None and self.cluster:
                ended.append(fin)

    @staticmethod
    def _line_of(fin: Finish) -> LineAdd:
        """Cluster: a finished batch job's line, added right after its final write (another
        slot); should this process die in between, the batch's reconcile adds it."""
        ref = fin.lease.batch
        assert ref is not None
        ok, line = batch_line(ref, fin.lease.job_id, fin.status, fin.result, fin.error)
        return LineAdd(fin.lease.job_id, ref, ok, line)

    @staticmethod
    def _add_call(
        calls: list[Call],
        sent: list[tuple[Lease, Finish | None]],
        out: StepResult,
        lease: Lease,
        fin: Finish | None,
        build: Callable[[], Call],
    ) -> None:
        """Append one job's call; one that cannot be built (an unserialisable value, a
        succeeded job without a result) becomes that job's write error instead."""
        try:
            calls.append(build())
        except Exception as e:
            log.warning("write for job %s not built: %r", lease.job_id, e)
            out.errors.append(WriteError(lease.job_id, f"{type(e).__name__}: {e}", fin))
            return
        sent.append((lease, fin))

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
            self.keys.job_stream(lease.job_id, lease.priority),
            self.keys.events(lease.job_id),
            self._idem_key(lease),
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
