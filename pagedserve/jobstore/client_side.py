"""The client side of the job store: enqueue (one or many, idempotent, tenant-tagged), read
records and statuses, cancel.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from pydantic import ValidationError

from pagedserve import openai_format
from pagedserve.jobstore.base import Call, StoreBase
from pagedserve.jobstore.records import (
    BatchRef,
    LineAdd,
    batch_line,
    check_client_request,
)
from pagedserve.prefix_sig import prefix_signature
from pagedserve.schemas import (
    UNPARSABLE_REQUEST,
    JobRecord,
    JobRequest,
    JobResult,
    JobStatus,
    short_validation_error,
)


class ClientSide(StoreBase):
    """Enqueue, read and cancel jobs (what clients and the API call)."""

    def enqueue_args(
        self, job_id: str, request: JobRequest, *, batch: BatchRef | None = None
    ) -> tuple[list[str], list[str]]:
        """KEYS and ARGV of the enqueue script (exposed for pipelined bulk submission).

        Without ``batch`` the request is a client's: reserved names raise ``ValueError``. With
        ``batch`` (the fan-out) the job is a member of that batch, idempotent per custom id
        under a key no client can name (``Keys.batch_idem``).

        On a cluster with several shards, a job with an idempotency key must live in that key's
        shard: ``job_id`` is then replaced by a fresh id that lands there (ARGV[1]; the script
        returns the id it stored, which callers use)."""
        if batch is None:
            check_client_request(request)
            idem = request.idempotency_key
            idem_key = self.keys.idem(idem or "")
            shard = self.keys.idem_shard(idem) if idem else self.keys.shard(job_id)
        else:
            digest = batch.idempotency_digest()
            idem = idem_key = self.keys.batch_idem(batch.batch_id, digest)
            shard = self.keys.batch_idem_shard(batch.batch_id, digest)
        job_id = self._id_in_shard(job_id, shard)
        if not idem:  # unused by the script, but declared: a key of the job's slot
            idem_key = self.keys.job(job_id)
        keys = [self.keys.job(job_id), self.keys.stream(request.priority, shard), idem_key]
        args = [
            job_id,
            request.model_dump_json(exclude_none=True),
            request.priority,
            "1" if idem else "0",
            sig.sig if (sig := prefix_signature(request)) is not None else "",
        ]
        if batch is not None:
            if not self.cluster:  # on a cluster the fan-out adds members apart (another slot)
                keys.append(self.keys.batch_members(batch.batch_id))
            args += [batch.batch_id, batch.custom_id, batch.url, batch.model]
        return keys, args

    def _id_in_shard(self, job_id: str, shard: int) -> str:
        """``job_id`` when it is in ``shard``, else fresh ids drawn until one is (about
        ``shards`` draws)."""
        while self.keys.shard(job_id) != shard:
            job_id = uuid.uuid4().hex
        return job_id

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
        pairs = zip(jobs, refs, strict=True)
        enqueues = [self.enqueue_args(jid, req, batch=ref) for (jid, req), ref in pairs]
        samples: dict[str, list[str]] = {}
        if tenant is not None:  # the open-set members each tag prunes (declared in its KEYS)
            samples = self.tenants.samples(tenant, [args[0] for _, args in enqueues])
        calls: list[Call] = []
        for keys, args in enqueues:
            calls.append(("enqueue", keys, args))
            if tenant is not None:
                jid = args[0]
                calls.append(("tag_tenant", *self.tenants.tag_call(jid, tenant, samples[jid])))
        replies = self._exec(calls, transaction=tenant is not None)
        step = 1 if tenant is None else 2
        out = [(got, bool(created)) for got, created in replies[::step]]
        if self.cluster and batches is not None:
            self._add_members(refs, [got for got, _ in out])
        return out

    def _add_members(self, refs: Sequence[BatchRef | None], job_ids: Sequence[str]) -> None:
        """Cluster: the second step of a batch job's enqueue, in the batch's slot. A fan-out
        that dies before it is run again to the end (``BatchStore._begin_fan_out``), enqueueing
        nothing twice (the idempotency keys) and adding the members then."""
        by_batch: dict[str, list[str]] = {}
        for ref, jid in zip(refs, job_ids, strict=True):
            if ref is not None:
                by_batch.setdefault(ref.batch_id, []).append(jid)
        for bid, ids in by_batch.items():
            self.r.sadd(self.keys.batch_members(bid), *ids)

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
        replies = self._cancel_calls(job_ids)
        adds: list[LineAdd] = []
        for jid, (status, ended, *fields) in zip(job_ids, replies, strict=True):
            ref = BatchRef.from_fields(fields)
            running = count_running and status in ("running", "cancelling")
            if ref is not None and (int(ended) or running):
                ok, line = batch_line(ref, jid, "cancelled", error=message, code=code)
                adds.append(LineAdd(jid, ref, ok, line, allow_running=running))
        self.add_batch_lines(adds)
        return [JobStatus(reply[0]) for reply in replies]

    def _cancel_calls(self, job_ids: Sequence[str], tries: int = 10) -> list[list[object]]:
        """Run ``cancel.lua`` on every job: read each owner and idempotency key, then cancel
        naming that owner's cancel set and that key (the script declares every key); a job whose
        owner changed in between (a reclaim) is read again and retried."""
        replies: list[list[object]] = [["moved", 0]] * len(job_ids)
        todo = list(range(len(job_ids)))
        for _ in range(tries):
            pipe = self.r.pipeline(transaction=False)
            for i in todo:
                pipe.hmget(self.keys.job(job_ids[i]), "worker", "idem_key")
            # A key of the wrong type reads as no owner: the script then answers its error.
            reads = [(None, None) if isinstance(x, Exception) else x
                     for x in pipe.execute(raise_on_error=False)]  # fmt: skip
            calls: list[Call] = []
            for i, (owner, idem) in zip(todo, reads, strict=True):
                j = job_ids[i]
                job = self.keys.job(j)
                cset = self.keys.cancel(owner or "", self.keys.shard(j))
                args = [owner or "", self.retention_s, self.events_maxlen]
                calls.append(("cancel", [job, self.keys.events(j), cset, idem or job], args))
            for i, reply in zip(todo, self._exec(calls), strict=True):
                replies[i] = reply
            todo = [i for i in todo if replies[i][0] == "moved"]
            if not todo:
                return replies
        raise RuntimeError(f"cancel: the owners of {len(todo)} jobs kept changing")

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
