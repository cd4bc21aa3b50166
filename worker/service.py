"""``pagedserve worker``: the long-lived Redis service loop around one :class:`Engine`.

One iteration of the loop:

1. Redis housekeeping, each at its own rate: claim as many jobs as ``engine.free_capacity()``
   allows (the queue is the backpressure; ``store.claim`` orders own pending entries first, then
   interactive before bulk) and reclaim entries of dead workers (``reclaim.lua``), both as orders to
   ``worker.claimer``, whose thread runs the round trips while the loop steps on (an idle loop
   waits for its blocking read); renew the leases of running jobs, publish the heartbeat.
2. ``engine.step()`` when the engine has work.
3. The step's writes (each job's deltas once per ``progress_interval_s``, or
   ``bulk_progress_interval_s`` for bulk jobs; a first token at once; final writes) go to
   ``worker.writer``, whose thread sends them with the cancel-set drain while the loop steps
   on; Redis's answers come back (cancelled and lost jobs are aborted at once).

Redis errors never stop the loop: the engine keeps stepping, the writer merges progress per job,
keeps final writes and retries Redis with backoff. Nothing one job carries stops it either: a
write of one job that Redis refuses with an error (a key of the wrong type, say) fails that job
with the reason, a lease that cannot be read dead-letters its entry, and the loop goes on.

SIGTERM / SIGINT drain: no more claims, running jobs get ``--grace-s`` seconds, the rest go back to
the queue (``store.release``), the writer writes what it holds, exit status 0.

A job's tokens and text are the engine's: each step's ``RequestOutput`` is cumulative, and the
loop's per-job state (``worker.job_state``) is the lease, a flush timer and a cursor of what was
published. Around this module: ``worker.service_config`` (options and argparse),
``worker.redis_guard`` (backoff, Redis clock), ``worker.service_telemetry`` (the heartbeat),
``worker.writer`` (the writes' thread), ``worker.claimer`` (the claims' thread).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from pagedserve.jobstore.admission import admission_for_shards
from pagedserve.keys import PREFIX_ENV
from pagedserve.store import Finish, JobStore, Lease, Progress, StepResult, WriteError
from pagedserve.telemetry import WorkerHeartbeat
from worker.admission import PrefixAdmission, claim_round
from worker.claimer import Claimed, Claimer, ClaimOrder
from worker.job_state import JobState, partial_result, result_of
from worker.outputs import RequestOutput, RequestRejected, refusal
from worker.pretokenize import Pretokenizer
from worker.redis_guard import REDIS_DOWN, RedisDown, RedisGuard
from worker.service_config import (
    ServiceConfig,
    engine_config,
    parse_args,
    service_config,
)
from worker.service_telemetry import LoopClock, ServiceTelemetry
from worker.writer import WRITE_FAILED, Writer

if TYPE_CHECKING:
    from worker.engine import Engine
    from worker.engine_process import EngineProcess
    from worker.outputs import EngineConfig

__all__ = [
    "PREFIX_ENV",
    "REDIS_DOWN",
    "WRITE_FAILED",
    "JobState",
    "ServiceConfig",
    "Worker",
    "engine_config",
    "main",
    "parse_args",
    "result_of",
]

log = logging.getLogger("pagedserve.worker")

#: Most jobs leased by one claim call.
MAX_CLAIM = 64
#: The local queue (jobs leased beyond the free seats, waiting in the engine) holds about as
#: many jobs as finished here in this many seconds: the expected wait it adds to a job is this
#: long, and it vanishes when jobs stop finishing (long generations hold every seat).
LOOKAHEAD_S = 0.5
#: ... and at most this share of ``max_num_seqs``.
LOOKAHEAD_SHARE = 8


class HeldJobs:
    """The jobs this worker still owns, for reclaim (asked on the claimer's thread): running
    ones, and ended ones whose final write the writer has not had answered. Without the
    latter, a final write held up past ``--reclaim-ms`` (Redis failing over, a loaded machine)
    left its entry idle and unclaimed by any running job, and the worker's own reclaim leased
    the job again: one delivery more per hold-up (the sentinel failover test dead-lettered jobs
    "delivered 4 times"). Membership tests only: no iteration over a dict the loop changes."""

    def __init__(self, jobs: Mapping[str, object], writer: Writer) -> None:
        self.jobs = jobs
        self.writer = writer

    def __contains__(self, job_id: object) -> bool:
        return isinstance(job_id, str) and (job_id in self.jobs or self.writer.holds(job_id))


# ------------------------------------------------------------------------------- the loop
class Worker:
    """The service loop: Redis jobs in, engine steps, fenced results out."""

    def __init__(self, engine: Engine, store: JobStore, cfg: ServiceConfig) -> None:
        self.engine = engine
        self.store = store
        cfg = replace(cfg, admission=admission_for_shards(cfg.admission, store.keys.shards))
        self.cfg = cfg
        self.jobs: dict[str, JobState] = {}
        self.unsent: list[Finish] = []  # this iteration's final writes, for the writer
        self.unsent_progress: list[Progress] = []
        self.writer = Writer(store, cfg.worker_id, cfg.cancel_poll_s, cfg.write_interval_s)
        self.claimer = Claimer(store, cfg.worker_id, claim_round)
        self.held = HeldJobs(self.jobs, self.writer)
        self.urgent: list[JobState] = []  # to flush at the next step (first token, replay)
        self.next_flush = 0.0  # when the interactive jobs' progress is flushed next
        self.next_bulk_flush = 0.0  # ... and the bulk jobs' too
        self.draining = False
        self.drain_deadline = float("inf")
        self.unstarted_handed_back = False
        self.finish_times: deque[float] = deque()  # when jobs ended here, the last LOOKAHEAD_S
        self.guard = RedisGuard(store)
        self._redis = self.guard.call
        self.last_reclaim = self.last_renew = self.last_hb = 0.0
        #: Jobs were counted as finished since the last heartbeat (see :meth:`_settled`).
        self.hb_behind = False
        self.claim_found = False  # whether the last claim round took jobs
        self.telemetry = ServiceTelemetry(cfg.throughput_window_s)
        self.clock = LoopClock()
        self.pretok = Pretokenizer.for_engine(engine)  # text and chat prompts: off the loop
        self.admission = PrefixAdmission(cfg, engine, self.jobs)  # which jobs to claim

    # ----------------------------------------------------------------- signals
    def request_stop(self, *_: object) -> None:
        if not self.draining:
            log.info("draining: %d running jobs, grace %.1f s", len(self.jobs), self.cfg.grace_s)
            self.draining = True
            self.drain_deadline = time.monotonic() + self.cfg.grace_s

    # ----------------------------------------------------------------- admission
    def _capacity(self) -> int:
        """Jobs to claim now: the engine's free seats plus the local queue's lookahead. While
        that queue still feeds the next steps, claims wait until half of it is used up, so a
        round takes several jobs (each round is Redis round trips and the parsing of leases
        on this process's interpreter lock, which the engine's steps wait on)."""
        if self.draining:
            return 0
        ahead = self._lookahead()
        cap = min(MAX_CLAIM, self.engine.free_capacity(ahead) - len(self.pretok))
        if cap <= 0 or (cap < ahead // 2 and self.engine.num_waiting() > 0):
            return 0
        return cap

    def _lookahead(self) -> int:
        """How many leased jobs may wait here beyond the free seats (module constants): those
        get a seat the very step one frees, not a claim round later (the seats of a fast
        engine otherwise stay empty a step or two after every finish; ``bench.service``)."""
        times, horizon = self.finish_times, time.monotonic() - LOOKAHEAD_S
        while times and times[0] < horizon:
            times.popleft()
        return min(len(times), self.engine.config.max_num_seqs // LOOKAHEAD_SHARE)

    def _admit(self, leases: list[Lease], created_at: Mapping[str, float]) -> None:
        """Start the leased jobs; ``created_at``: their submission times (Redis clock), where
        known (else now)."""
        now = self.guard.now()
        for lease in leases:
            self._admit_one(lease, created_at.get(lease.job_id, now))

    def _admit_one(self, lease: Lease, created_at: float) -> None:
        req = lease.request
        if lease.job_id in self.jobs:  # re-delivered to us while still running (own pending)
            st = self.jobs[lease.job_id]
            st.lease = lease
            if lease.deliveries > 1:
                st.replay()  # the lease started its events over: send what it has so far again
                self.urgent.append(st)
            return
        if req.model is not None and req.model != self.engine.model_name:
            # One consumer group serves one model: a job for another model is an input error.
            self._fail(
                lease,
                f"rejected: model {req.model!r} is not served here (this worker serves "
                f"{self.engine.model_name!r})",
            )
            return
        if self.pretok.wanted(req):  # tokenized off the loop; _add_tokenized hands it over
            self.pretok.submit(lease)
            self.jobs[lease.job_id] = JobState(lease, created_at, req.params.max_tokens)
            return
        messages = [m.model_dump() for m in req.messages] if req.messages is not None else None
        try:
            self.engine.add_request(
                lease.job_id,
                req.prompt if messages is None else None,
                req.params,
                priority=lease.priority,
                messages=messages,
                stream=False,  # progress is read at intervals (step), not every step
            )
        except Exception as e:  # tokenizer / template errors too: the job fails, the worker goes on
            if not isinstance(e, RequestRejected):
                log.warning("job %s could not be added: %r", lease.job_id, e)
            self._fail(lease, refusal(e))
            return
        self.jobs[lease.job_id] = JobState(lease, created_at, req.params.max_tokens)

    def _add_tokenized(self) -> None:
        """Hand the jobs whose tokenization finished to the engine (as token ids). A job that
        ended meanwhile (cancelled, lease lost, drained) is no longer in ``self.jobs``: dropped."""
        idle = not self.engine.has_unfinished()  # nothing to step: wait a little, do not spin
        for lease, got in self.pretok.take_done(wait_s=0.005 if idle else 0.0):
            st = self.jobs.get(lease.job_id)
            if st is None:
                continue
            try:
                if isinstance(got, BaseException):
                    raise got
                params, prio = st.lease.request.params, st.lease.priority
                self.engine.add_request(lease.job_id, got, params, priority=prio, stream=False)
            except Exception as e:  # as in _admit_one: the job fails, the worker goes on
                self.jobs.pop(lease.job_id, None)
                self._fail(st.lease, refusal(e))

    def _fail(self, lease: Lease, reason: str) -> None:
        self._final(Finish(lease, "failed", error=reason))

    def _final(self, fin: Finish) -> None:
        self.unsent.append(fin)  # counted as finished once Redis took it (_on_report)

    # ----------------------------------------------------------------- housekeeping
    def housekeeping(self) -> None:
        now = time.monotonic()
        try:
            if self.jobs and now - self.last_renew >= self.cfg.renew_interval_s:
                lost = self._redis(self.store.renew, [s.lease for s in self.jobs.values()])
                self.last_renew = now
                self._drop_lost(lost)
            if self._settled():
                self._beat(now)
            self._claim()
            if now - self.last_hb >= self.cfg.heartbeat_s:
                self._beat(now)
        except RedisDown:
            pass

    def _settled(self) -> bool:
        """Whether a heartbeat is to go out now, before its period is up: jobs were counted as
        finished since the last one and the loop has nothing left in hand (no job, no write
        the writer has not answered). Why: the periodic heartbeat that first shows a pool idle
        can be one taken before the writer's last reports, so ``/v1/workers`` kept counts short
        of the store's by a few jobs until the next period (seen: 2299 of 2313 jobs with a
        1 s period); this one carries the counts a drained batch ends with."""
        return self.hb_behind and not self._busy() and self.writer.idle()

    def _beat(self, now: float) -> None:
        self.last_hb = now
        self._heartbeat()  # RedisDown: a drained batch's heartbeat is tried again next pass
        self.hb_behind = False

    def _claim(self) -> None:
        """Take the claimer's finished round, if any, and order the next one when due. The
        round trips run on the claimer's thread (:mod:`worker.claimer`); an idle loop waits
        here for its blocking read instead (a little longer than the read: the hand-over)."""
        idle_wait = self.cfg.idle_block_ms / 1e3 + 0.05
        got = self.claimer.take(0.0) if self._busy() else self._idle_take(idle_wait)
        if got is not None:
            self._claimed(got)
        if self._order_round() and not self._busy():  # idle: wait here for its blocking read
            got = self._idle_take(idle_wait)
            if got is None:
                return
            self._claimed(got)
            if got.leases:
                # The blocking read wakes at the first job a client queues, usually alone: the
                # next round (not blocking) goes out now, not after the first step's report.
                # bench.service --preset tiny: the first job stepped ~30 times alone (13 ms
                # before the next round even started), while the rest of a burst waited.
                self._order_round()

    def _order_round(self) -> bool:
        """Order the next claim round if one is due; whether one was ordered.

        A busy loop with free seats orders a round at once after one that took jobs (more may
        be queued), else one that waits up to ``claim_interval_s`` on Redis for new work: the
        first job queued wakes it. Why not a non-blocking round every ``claim_interval_s``, as
        before: work queued in between waited for the next poll, up to that interval, with the
        seats free (``bench.service``: a burst's jobs after its first 16 reached the engine ~50
        ms late). Redis sees one round per interval either way while nothing comes."""
        cap = self._capacity()
        if self.claimer.pending or cap <= 0:
            return False
        busy, now = self._busy(), time.monotonic()
        block_ms = self.cfg.idle_block_ms
        if busy:
            block_ms = 0 if self.claim_found else max(1, round(self.cfg.claim_interval_s * 1e3))
        reclaim = now - self.last_reclaim >= self.cfg.reclaim_interval_s
        if reclaim:
            self.last_reclaim = now
        self.claimer.ask(ClaimOrder(
            cap, block_ms, self.admission.order_request(),
            reclaim_ms=self.cfg.reclaim_ms if reclaim else 0, held=self.held,
        ))  # fmt: skip
        return True

    def _idle_take(self, timeout: float) -> Claimed | None:
        """The claimer's round, waiting up to ``timeout`` for it: idle time on the loop clock."""
        t0 = time.perf_counter()
        try:
            return self.claimer.take(timeout)
        finally:
            self.clock.idle += time.perf_counter() - t0

    def _busy(self) -> bool:
        """Work in hand: running jobs, unsent final writes, prompts being tokenized."""
        return self.engine.has_unfinished() or bool(self.unsent) or len(self.pretok) > 0

    def _claimed(self, got: Claimed) -> None:
        """Admit what a claim round took (handed back instead while draining); leases whose
        stored request does not parse fail at once."""
        self.admission.claimed(got.order.cap, got.leases, got.admitted)
        self.claim_found = bool(got.leases)
        leases = got.leases
        if self.draining:  # SIGTERM came during the round: what it took has not started here
            self._hand_back(leases)
            leases = []
        self._admit(leases, got.created_at)
        for lease, reason in got.malformed:
            self._fail(lease, reason)

    def _hand_back(self, leases: Sequence[Lease]) -> None:
        for lease in leases:
            try:
                self._redis(self.store.release, lease)
            except RedisDown:
                log.warning("job %s not released (redis down); it will be reclaimed", lease.job_id)

    def _drop_lost(self, lost: Sequence[str]) -> None:
        for jid in lost:
            if self.jobs.pop(jid, None) is not None:
                self.engine.abort(jid)
                log.warning("job %s: lease lost, dropped", jid)

    # ----------------------------------------------------------------- stepping
    def step(self) -> None:
        """One engine step, and the progress it makes due (all jobs together: one batch)."""
        self._add_tokenized()
        outputs: list[RequestOutput] = []
        if self.engine.has_unfinished():
            outputs = self.clock.step(self.engine.step)
        jobs = self.jobs
        for out in outputs:
            st = jobs.get(out.request_id)
            if st is None:
                continue
            st.latest = out
            if not st.first_token_seen and st.tokens > 0:
                st.first_token_seen = True
                self.telemetry.ttft.observe(max(0.0, self.guard.now() - st.created_at))
                self.urgent.append(st)
            if out.finished:
                self._finish(st, out)
        flush = [st for st in self.urgent if jobs.get(st.lease.job_id) is st]
        self.urgent = []
        now = time.monotonic()
        if now >= self.next_flush:
            self.next_flush = now + self.cfg.progress_interval_s
            every = now >= self.next_bulk_flush
            if every:
                self.next_bulk_flush = now + self.cfg.bulk_progress_interval_s
            flush += [st for st in jobs.values() if every or st.watched]
        fresh = {out.request_id for out in outputs} if flush else set()
        for st in flush:
            # a job that just reported (its first token, a streamed step) is current already;
            # others ask for a snapshot (started ones: finished jobs have left ``jobs``)
            if st.latest is not None and st.lease.job_id not in fresh:
                st.latest = self.engine.snapshot(st.lease.job_id) or st.latest
            self.unsent_progress += st.take_progress()

    def _finish(self, st: JobState, out: RequestOutput) -> None:
        self.jobs.pop(st.lease.job_id, None)
        self.finish_times.append(time.monotonic())
        self.admission.finished(st.lease.job_id, out)
        self.unsent_progress += st.take_progress()
        self.telemetry.e2e.observe(max(0.0, self.guard.now() - st.created_at))
        lease = st.lease
        if out.error:
            self._fail(lease, out.error)
            return
        self._final(Finish(lease, "succeeded", result=result_of(out)))

    def commit(self) -> None:
        """Hand this iteration's writes to the writer (no round trip here), and act on what
        Redis answered to earlier ones: lost leases, write errors, cancel requests."""
        self._put_writes()
        for res in self.writer.take_reports():
            self._on_report(res)
        if self.unsent:  # cancellations and refused final writes
            self._put_writes()

    def _put_writes(self) -> None:
        """Hand the writes over; an interactive job's make the writer send at once, bulk jobs'
        go with its next send (``write_interval_s``), unless the engine has nothing left to run:
        then no later step's writes can join them, and the last jobs of a batch would only
        wait for that send."""
        progress, finals = self.unsent_progress, self.unsent
        urgent = (
            not self.engine.has_unfinished()
            or any(p.lease.priority != "bulk" for p in progress)
            or any(f.lease.priority != "bulk" for f in finals)
        )
        self.writer.put(progress, finals, cancels=bool(self.jobs), urgent=urgent)
        self.unsent_progress, self.unsent = [], []

    def _on_report(self, res: StepResult) -> None:
        self.telemetry.finished_counts.update(res.finished)
        self.hb_behind = self.hb_behind or bool(res.finished)
        for jid, watched in res.watched.items():
            if (st := self.jobs.get(jid)) is not None:
                st.watched = watched
        for jid, fence in res.refused:
            st = self.jobs.get(jid)
            if st is not None and st.lease.fence == fence:  # not a newer lease of the job
                self._drop_lost([jid])
        for err in res.errors:
            self._write_failed(err)
        for jid in res.cancels:
            st = self.jobs.pop(jid, None)
            if st is None:
                continue
            partial = self.engine.abort(jid) or st.latest
            self._final(Finish(st.lease, "cancelled", result=partial_result(partial)))

    def _write_failed(self, err: WriteError) -> None:
        """A write of one job that Redis refused with an error. A running job is aborted and
        failed with the reason; a refused final write of a batch job is retried without its
        batch line (kept, for the batch's reconcile), any other one becomes a failure with the
        reason; if that is refused too the job is dropped (its entry is redelivered and, in the
        end, dead-lettered)."""
        reason = f"{WRITE_FAILED}{err.message}"
        fin = err.finish
        if fin is None:
            st = self.jobs.pop(err.job_id, None)
            if st is not None:
                self.engine.abort(err.job_id)
                self._fail(st.lease, reason)
            return
        if fin.lease.batch is not None:
            self._final(replace(fin, lease=replace(fin.lease, batch=None)))
        elif not (fin.status == "failed" and (fin.error or "").startswith(WRITE_FAILED)):
            self._fail(fin.lease, reason)
        else:
            log.error("job %s: final write refused again, dropped: %s", err.job_id, err.message)

    # ----------------------------------------------------------------- drain
    def hand_back_unstarted(self) -> None:
        """Draining: the jobs waiting in the engine's queue that never ran (the lookahead's,
        or leased while seats were full) go back to the queue at once, for other workers;
        the grace period is for the jobs that run."""
        self.unstarted_handed_back = True
        leases = []
        for jid in self.engine.unstarted():
            st = self.jobs.pop(jid, None)
            if st is not None:
                self.engine.abort(jid)
                self.admission.finished(jid, None)
                leases.append(st.lease)
        if leases:
            log.info("draining: %d jobs not started handed back", len(leases))
        self._hand_back(leases)

    def drain_expired(self) -> None:
        """Past the grace period: hand running jobs back to the queue (after their progress)."""
        self.commit()
        self.writer.flush(self.cfg.writer_drain_s)
        leases = [st.lease for st in self.jobs.values()]
        for jid in list(self.jobs):
            self.engine.abort(jid)
            self.jobs.pop(jid)  # (admission holds this dict: emptied, not replaced)
        self._hand_back(leases)

    # ----------------------------------------------------------------- heartbeat
    def heartbeat_model(self) -> WorkerHeartbeat:
        state = "draining" if self.draining else "serving"
        return self.telemetry.heartbeat(
            worker_id=self.cfg.worker_id,
            model=getattr(self.engine, "model_name", ""),
            state="reconnecting" if not self.redis_ok() else state,
            engine=self.engine.heartbeat_stats(),
            jobs=self.jobs,
            context=self.pretok.context,
            prefixes=self.admission.telemetry(),
            loop=self.clock,
        )

    def redis_ok(self) -> bool:
        """Whether the loop, the writer and the claimer all reach Redis."""
        return self.guard.ok and self.writer.guard.ok and self.claimer.guard.ok

    def _heartbeat(self) -> None:
        self._redis(self.admission.refresh, self.store, self.cfg.worker_id)
        hb = self.heartbeat_model()
        ttl = max(5, int(self.cfg.heartbeat_s * 10))
        self.writer.put_heartbeat(self.cfg.worker_id, hb.model_dump(mode="json"), ttl)

    def close(self, timeout: float) -> bool:
        """Stop the claimer (what a round still running took is handed back) and the writer
        thread after what it holds is written (retrying a down Redis for up to ``timeout`` s);
        ``True`` if everything was written. :meth:`run` ends with it."""
        got = self.claimer.close(timeout)
        if got is not None:
            self._hand_back(got.leases + [lease for lease, _ in got.malformed])
        return self.writer.close(timeout)

    # ----------------------------------------------------------------- main loop
    def _iterate(self) -> bool:
        """One pass of the loop; False once it is to stop (drained, or past the grace time)."""
        if self.draining:
            if not self.unstarted_handed_back:
                self.hand_back_unstarted()
            if (not self.jobs and not self.unsent and self.writer.idle()
                    and not self.claimer.pending):  # fmt: skip
                return False
            if time.monotonic() >= self.drain_deadline:
                self.drain_expired()
                self.commit()
                return False
        self.housekeeping()
        self.step()
        self.commit()
        if not self.engine.has_unfinished():
            t0 = time.perf_counter()
            if not self.guard.ok:
                time.sleep(self.guard.wait_s())
            elif self.draining:  # only the writer has work left: wait for it, do not spin
                self.writer.flush(0.05)
            self.clock.idle += time.perf_counter() - t0
        return True

    def run(self) -> int:
        self.guard.sync_clock()
        log.info("worker %s serving %s", self.cfg.worker_id, self.engine.model_name)
        while True:
            self.clock.begin()
            go_on = self._iterate()
            self.clock.end()
            if not go_on:
                break
        if not self.close(self.cfg.writer_drain_s):  # a down Redis: retried that long
            log.warning("exiting with %d unsent results", self.writer.unsent_finals())
        with contextlib.suppress(*REDIS_DOWN):
            self.store.r.delete(self.store.keys.worker(self.cfg.worker_id))
            self.admission.release_all(self.store, self.cfg.worker_id)
        log.info("worker %s stopped", self.cfg.worker_id)
        return 0


# ------------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv, description=(__doc__ or "").split("\n")[0])
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s worker: %(message)s",
        stream=sys.stderr,
    )
    cfg = service_config(args)
    store = JobStore(
        cfg.redis_url,
        prefix=cfg.prefix,
        lease_ms=cfg.lease_ms,
        max_deliveries=cfg.max_deliveries,
    )
    from worker.engine_process import EngineDied  # (no torch: the engine's process imports it)

    engine = _make_engine(args.model, engine_config(args), cfg.engine_process)
    worker = Worker(engine, store, cfg)  # type: ignore[arg-type]
    signal.signal(signal.SIGTERM, worker.request_stop)
    signal.signal(signal.SIGINT, worker.request_stop)
    try:
        return worker.run()
    except EngineDied as e:  # leases lapse: other workers reclaim the jobs
        log.error("%s; unsent results are written, running jobs go back by reclaim", e)
        worker.close(cfg.writer_drain_s)
        return 1
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()


def _make_engine(model: str, cfg: EngineConfig, in_child: bool) -> Engine | EngineProcess:
    """The engine, in this process or (``--engine-process``) in a child of its own."""
    if in_child:
        from worker.engine_process import EngineProcess

        return EngineProcess(model, cfg)
    from worker.engine import Engine

    return Engine(model, cfg)


if __name__ == "__main__":
    raise SystemExit(main())
