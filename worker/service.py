"""``pagedserve worker``: the long-lived Redis service loop around one :class:`Engine`.

One iteration of the loop:

1. Redis housekeeping, each at its own rate: claim as many jobs as ``engine.free_capacity()``
   allows (the queue is the backpressure; ``store.claim`` orders own pending entries first, then
   interactive before bulk), reclaim entries of dead workers (XAUTOCLAIM), renew the leases of
   running jobs, publish the heartbeat.
2. ``engine.step()`` when the engine has work.
3. One ``commit_step`` round trip: rate-limited progress deltas, final writes, and the drain of this
   worker's cancel set (cancelled and lost jobs are aborted in the engine at once).

Redis errors never stop the loop: the engine keeps stepping, progress accumulates, final writes are
buffered, and Redis is retried with backoff. Nothing one job carries stops it either: a write of
one job that Redis refuses with an error (a key of the wrong type, say) fails that job with the
reason, a lease that cannot be read dead-letters its entry, and the loop goes on.

SIGTERM / SIGINT drain: no more claims, running jobs get ``--grace-s`` seconds, the rest go back to
the queue (``store.release``), exit status 0.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import redis
from pydantic import ValidationError

from pagedserve.keys import DEFAULT_PREFIX, env_prefix
from pagedserve.redis_util import default_url
from pagedserve.schemas import Completion, JobResult
from pagedserve.schemas import TokenLogprob as WireLogprob
from pagedserve.store import DEFAULT_LEASE_MS, Finish, JobStore, Lease, Progress, WriteError
from pagedserve.telemetry import (
    Histogram,
    PoolSnapshot,
    PrefixCacheSnapshot,
    RunningJob,
    WorkerHeartbeat,
)
from worker.outputs import CompletionOutput, EngineConfig, RequestOutput, RequestRejected
from worker.pretokenize import Pretokenizer

if TYPE_CHECKING:
    from worker.engine import Engine

log = logging.getLogger("pagedserve.worker")

#: Errors that mean "Redis is unreachable right now": retried with backoff, never fatal.
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)
#: How the failure reason of a job whose state Redis refused to write begins.
WRITE_FAILED = "could not write the job's state: "
#: Most jobs leased by one claim call.
MAX_CLAIM = 64


@dataclass(slots=True)
class ServiceConfig:
    """Service-loop options (the engine's are in :class:`EngineConfig`)."""

    worker_id: str
    redis_url: str
    prefix: str = DEFAULT_PREFIX
    lease_ms: int = DEFAULT_LEASE_MS
    reclaim_ms: int = 15_000  # an entry idle this long belongs to a dead worker
    max_deliveries: int = 3
    grace_s: float = 30.0
    progress_interval_s: float = 0.05  # at most one progress write per job per interval
    heartbeat_s: float = 1.0
    idle_block_ms: int = 100  # blocking claim when the engine is idle
    # Least time between non-blocking claims while busy after one found nothing (a claim that
    # found jobs is repeated at once); new work waits at most this long for a busy worker.
    claim_interval_s: float = 0.05
    throughput_window_s: float = 10.0

    @property
    def renew_interval_s(self) -> float:
        return min(self.lease_ms, self.reclaim_ms) / 3 / 1e3

    @property
    def reclaim_interval_s(self) -> float:
        return max(0.2, self.reclaim_ms / 3 / 1e3)


@dataclass
class JobState:
    """What the loop keeps for one running job."""

    lease: Lease
    created_at: float  # Redis clock (seconds)
    max_tokens: int | None
    texts: dict[int, list[str]] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    # Not yet published increments per completion index.
    pending_text: dict[int, str] = field(default_factory=dict)
    pending_ids: dict[int, list[int]] = field(default_factory=dict)
    last_flush: float = 0.0
    flushed_once: bool = False
    first_token_seen: bool = False

    @property
    def tokens(self) -> int:
        return sum(len(v) for v in self.token_ids.values())

    def absorb(self, comp: CompletionOutput) -> None:
        i = comp.index
        if comp.new_token_ids:
            self.token_ids.setdefault(i, []).extend(comp.new_token_ids)
            self.pending_ids.setdefault(i, []).extend(comp.new_token_ids)
        if comp.text_delta:
            self.texts.setdefault(i, []).append(comp.text_delta)
            self.pending_text[i] = self.pending_text.get(i, "") + comp.text_delta

    def replay(self) -> None:
        """Make everything generated so far pending again (after a ``restart`` event told
        followers to discard what they had, while this run goes on)."""
        self.pending_text = {i: "".join(t) for i, t in self.texts.items()}
        self.pending_ids = {i: list(ids) for i, ids in self.token_ids.items()}
        self.flushed_once = False

    def take_progress(self) -> list[Progress]:
        idx = sorted(set(self.pending_text) | set(self.pending_ids))
        total = self.tokens
        out = [
            Progress(
                self.lease,
                tokens_generated=total,
                delta_text=self.pending_text.get(i, ""),
                delta_token_ids=tuple(self.pending_ids.get(i, ())),
                index=i,
            )
            for i in idx
        ]
        self.pending_text.clear()
        self.pending_ids.clear()
        return out

    def partial_result(self, prompt_tokens: int = 0) -> JobResult:
        comps = [
            Completion(
                index=i,
                text="".join(self.texts.get(i, [])),
                token_ids=list(ids),
                finish_reason="abort",
            )
            for i, ids in sorted(self.token_ids.items())
        ]
        return JobResult(
            completions=comps, prompt_tokens=prompt_tokens, completion_tokens=self.tokens
        )


def result_of(out: RequestOutput) -> JobResult:
    """The wire result of a finished engine request."""
    comps = []
    for c in out.outputs:
        logprobs = None
        if c.logprobs is not None:
            logprobs = [
                WireLogprob(token_id=lp.token_id, logprob=lp.logprob, top_logprobs=dict(lp.top))
                for lp in c.logprobs
            ]
        reason = c.finish_reason if c.finish_reason in ("stop", "length", "abort") else "stop"
        comps.append(
            Completion(
                index=c.index,
                text=c.text,
                token_ids=list(c.token_ids),
                finish_reason=reason,  # type: ignore[arg-type]
                logprobs=logprobs,
            )
        )
    return JobResult(
        completions=comps,
        prompt_tokens=len(out.prompt_token_ids),
        cached_prompt_tokens=out.num_cached_tokens,
        completion_tokens=sum(len(c.token_ids) for c in out.outputs),
    )


# ------------------------------------------------------------------------------- the loop
class Worker:
    """The service loop: Redis jobs in, engine steps, fenced results out."""

    def __init__(self, engine: Engine, store: JobStore, cfg: ServiceConfig) -> None:
        self.engine = engine
        self.store = store
        self.cfg = cfg
        self.jobs: dict[str, JobState] = {}
        self.unsent: list[Finish] = []  # final writes waiting for Redis
        self.unsent_progress: list[Progress] = []
        self.draining = False
        self.drain_deadline = float("inf")
        self.redis_ok = True
        self.retry_at = 0.0
        self.backoff = 0.05
        self.clock_offset = 0.0  # Redis clock - local clock
        self.last_claim = self.last_reclaim = self.last_renew = self.last_hb = 0.0
        self.started_at = time.time()
        self.finished_counts: collections.Counter[str] = collections.Counter()
        self.ttft = Histogram()
        self.e2e = Histogram()
        self.tokens_window: collections.deque[tuple[float, int]] = collections.deque()
        self.pretok = Pretokenizer.for_engine(engine)  # text and chat prompts: off the loop

    # ----------------------------------------------------------------- signals
    def request_stop(self, *_: object) -> None:
        if not self.draining:
            log.info("draining: %d running jobs, grace %.1f s", len(self.jobs), self.cfg.grace_s)
            self.draining = True
            self.drain_deadline = time.monotonic() + self.cfg.grace_s

    # ----------------------------------------------------------------- redis guard
    def _redis(self, fn: Any, *args: Any, **kw: Any) -> Any:
        """Run one Redis operation; on a connection error mark Redis down (retry later)."""
        if not self.redis_ok and time.monotonic() < self.retry_at:
            raise _RedisDown
        try:
            out = fn(*args, **kw)
        except redis.ResponseError as e:
            if "NOGROUP" in str(e):
                # The streams or the group vanished (FLUSHALL, a restart without AOF): recreate.
                log.warning("consumer group missing; recreating it")
                self.store._groups_ready = False
            else:
                # Not one job's (those come back in StepResult.errors): retried with backoff,
                # never fatal.
                log.warning("redis error (%s); retrying with backoff", e)
                self.retry_at = time.monotonic() + self.backoff
                self.backoff = min(2.0, self.backoff * 2)
                self.redis_ok = False
            raise _RedisDown from e
        except REDIS_DOWN as e:
            if self.redis_ok:
                log.warning("redis unreachable (%s); retrying with backoff", e)
            self.redis_ok = False
            self.retry_at = time.monotonic() + self.backoff
            self.backoff = min(2.0, self.backoff * 2)
            raise _RedisDown from e
        if not self.redis_ok:
            log.info("redis reachable again")
            self.store._groups_ready = False
            self._sync_clock()
        self.redis_ok = True
        self.backoff = 0.05
        return out

    def _sync_clock(self) -> None:
        try:
            sec, usec = self.store.r.time()
            self.clock_offset = sec + usec / 1e6 - time.time()
        except REDIS_DOWN:
            pass

    def _now_redis(self) -> float:
        return time.time() + self.clock_offset

    # ----------------------------------------------------------------- admission
    def _capacity(self) -> int:
        if self.draining:
            return 0
        return max(0, min(MAX_CLAIM, self.engine.free_capacity() - len(self.pretok)))

    def _admit(self, leases: list[Lease]) -> None:
        created = self._created_at([x.job_id for x in leases]) if leases else []
        for lease, created_at in zip(leases, created, strict=True):
            self._admit_one(lease, created_at)
        for lease, reason in self.store.take_malformed():
            self._fail(lease, reason)

    def _created_at(self, job_ids: list[str]) -> list[float]:
        pipe = self.store.r.pipeline(transaction=False)
        for jid in job_ids:
            pipe.hget(self.store.keys.job(jid), "created_at")
        try:
            values = self._redis(pipe.execute, raise_on_error=False)
            values = [None if isinstance(v, Exception) else v for v in values]
        except _RedisDown:
            values = [None] * len(job_ids)
        now = self._now_redis()
        return [float(v) if v else now for v in values]

    def _admit_one(self, lease: Lease, created_at: float) -> None:
        req = lease.request
        if lease.job_id in self.jobs:  # re-delivered to us while still running (own pending)
            st = self.jobs[lease.job_id]
            st.lease = lease
            if lease.deliveries > 1:
                st.replay()  # the lease started its events over: send what it has so far again
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
            )
        except RequestRejected as e:
            self._fail(lease, f"rejected: {e}")
            return
        except Exception as e:  # tokenizer / template errors: the job fails, the worker goes on
            log.warning("job %s could not be added: %r", lease.job_id, e)
            self._fail(lease, f"rejected: {type(e).__name__}: {e}")
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
                self.engine.add_request(lease.job_id, got, params, priority=prio)
            except Exception as e:  # as in _admit_one: the job fails, the worker goes on
                self.jobs.pop(lease.job_id, None)
                msg = str(e) if isinstance(e, RequestRejected) else f"{type(e).__name__}: {e}"
                self._fail(st.lease, f"rejected: {msg}")

    def _fail(self, lease: Lease, reason: str) -> None:
        self._final(Finish(lease, "failed", error=reason))

    def _final(self, fin: Finish) -> None:
        self.unsent.append(fin)
        self.finished_counts[fin.status] += 1

    # ----------------------------------------------------------------- housekeeping
    def housekeeping(self) -> None:
        now = time.monotonic()
        try:
            if self.jobs and now - self.last_renew >= self.cfg.renew_interval_s:
                lost = self._redis(self.store.renew, [s.lease for s in self.jobs.values()])
                self.last_renew = now
                self._drop_lost(lost)
            own_done = self.store.own_pending_read(self.cfg.worker_id)
            if own_done and now - self.last_reclaim >= self.cfg.reclaim_interval_s:
                self.last_reclaim = now
                cap = self._capacity()
                if cap:
                    got = self._redis(
                        self.store.reclaim, self.cfg.worker_id, self.cfg.reclaim_ms, cap
                    )
                    self._admit(got)
            self._claim()
            if now - self.last_hb >= self.cfg.heartbeat_s:
                self.last_hb = now
                self._heartbeat()
        except _RedisDown:
            pass

    def _claim(self) -> None:
        cap = self._capacity()
        if cap <= 0:
            return
        busy = self.engine.has_unfinished() or bool(self.unsent) or len(self.pretok) > 0
        now = time.monotonic()
        if busy and now - self.last_claim < self.cfg.claim_interval_s:
            return
        block = 0 if busy else self.cfg.idle_block_ms
        got = self._redis(self.store.claim, self.cfg.worker_id, cap, block)
        self.last_claim = 0.0 if got else now
        self._admit(got)

    def _drop_lost(self, lost: Sequence[str]) -> None:
        for jid in lost:
            if self.jobs.pop(jid, None) is not None:
                self.engine.abort(jid)
                log.warning("job %s: lease lost, dropped", jid)

    # ----------------------------------------------------------------- stepping
    def step(self) -> None:
        self._add_tokenized()
        outputs = self.engine.step() if self.engine.has_unfinished() else []
        now = time.monotonic()
        for out in outputs:
            st = self.jobs.get(out.request_id)
            if st is None:
                continue
            for comp in out.outputs:
                st.absorb(comp)
            if not st.first_token_seen and st.tokens > 0:
                st.first_token_seen = True
                self.ttft.observe(max(0.0, self._now_redis() - st.created_at))
            if out.finished:
                self._finish(st, out)
        for st in self.jobs.values():
            due = now - st.last_flush >= self.cfg.progress_interval_s
            if (st.pending_ids or st.pending_text) and (due or not st.flushed_once):
                self.unsent_progress += st.take_progress()
                st.last_flush = now
                st.flushed_once = True

    def _finish(self, st: JobState, out: RequestOutput) -> None:
        self.jobs.pop(st.lease.job_id, None)
        self.unsent_progress += st.take_progress()
        self.e2e.observe(max(0.0, self._now_redis() - st.created_at))
        lease = st.lease
        if out.error:
            self._fail(lease, out.error)
            return
        self._final(Finish(lease, "succeeded", result=result_of(out)))

    def commit(self) -> None:
        """One round trip: progress, final writes, cancel drain."""
        if not (self.jobs or self.unsent or self.unsent_progress):
            return
        progress, finals = self.unsent_progress, self.unsent
        try:
            res = self._redis(
                self.store.commit_step, self.cfg.worker_id, progress=progress, finished=finals
            )
        except _RedisDown:
            return  # kept: sent when Redis is back
        self.unsent_progress, self.unsent = [], []
        self._drop_lost(res.lost)
        for err in res.errors:
            self._write_failed(err)
        for jid in res.cancels:
            st = self.jobs.pop(jid, None)
            if st is None:
                continue
            self.engine.abort(jid)
            self._final(Finish(st.lease, "cancelled", result=st.partial_result()))
        if res.cancels & {f.lease.job_id for f in self.unsent}:
            self.commit()  # write the cancellations at once

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
    def drain_expired(self) -> None:
        """Past the grace period: hand running jobs back to the queue."""
        for jid, st in list(self.jobs.items()):
            self.engine.abort(jid)
            self.jobs.pop(jid)
            try:
                self._redis(self.store.release, st.lease)
            except _RedisDown:
                log.warning("job %s not released (redis down); it will be reclaimed", jid)

    # ----------------------------------------------------------------- heartbeat
    def heartbeat_model(self) -> WorkerHeartbeat:
        stats = self.engine.heartbeat_stats()
        now = time.monotonic()
        tokens = int(stats.get("tokens_generated", 0))
        self.tokens_window.append((now, tokens))
        while now - self.tokens_window[0][0] > self.cfg.throughput_window_s:
            self.tokens_window.popleft()
        t0, k0 = self.tokens_window[0]
        rate = (tokens - k0) / (now - t0) if now > t0 else 0.0
        state = "draining" if self.draining else "serving"
        return WorkerHeartbeat(
            worker_id=self.cfg.worker_id,
            model=getattr(self.engine, "model_name", ""),
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=self.started_at,
            state="reconnecting" if not self.redis_ok else state,
            steps=int(stats.get("steps", 0)),
            running=int(stats.get("running", 0)),
            waiting=int(stats.get("waiting", 0)),
            tokens_generated=tokens,
            prompt_tokens=int(stats.get("prompt_tokens", 0)),
            throughput_tok_s=round(rate, 2),
            preemptions=int(stats.get("preemptions", 0)),
            jobs_finished=dict(self.finished_counts),
            prefix_cache=_model_or(PrefixCacheSnapshot, stats.get("prefix_cache")),
            pool=_model_or(PoolSnapshot, stats.get("pool"), None),
            jobs=[
                RunningJob(id=jid, tokens=st.tokens, max_tokens=st.max_tokens)
                for jid, st in self.jobs.items()
            ],
            time_to_first_token_seconds=self.ttft,
            e2e_request_latency_seconds=self.e2e,
        )

    def _heartbeat(self) -> None:
        hb = self.heartbeat_model()
        ttl = max(5, int(self.cfg.heartbeat_s * 10))
        info = {**hb.model_dump(mode="json"), **self.pretok.context}  # + max_model_len (API)
        self._redis(self.store.heartbeat, self.cfg.worker_id, info, ttl)

    # ----------------------------------------------------------------- main loop
    def run(self) -> int:
        self._sync_clock()
        log.info("worker %s serving %s", self.cfg.worker_id, self.engine.model_name)
        while True:
            if self.draining:
                if not self.jobs and not self.unsent and not self.unsent_progress:
                    break
                if time.monotonic() >= self.drain_deadline:
                    self.drain_expired()
                    self.commit()
                    if self.unsent and not self.redis_ok:
                        log.warning("exiting with %d unsent results", len(self.unsent))
                    break
            self.housekeeping()
            self.step()
            self.commit()
            if not self.redis_ok and not self.engine.has_unfinished():
                time.sleep(min(self.backoff, max(0.0, self.retry_at - time.monotonic())))
        with contextlib.suppress(*REDIS_DOWN):
            self.store.r.delete(self.store.keys.worker(self.cfg.worker_id))
        log.info("worker %s stopped", self.cfg.worker_id)
        return 0


class _RedisDown(Exception):
    """Internal: the Redis operation was skipped or failed; retry later."""


def _model_or(cls: Any, value: Any, default: Any = ...) -> Any:
    if isinstance(value, dict):
        try:
            return cls.model_validate({k: v for k, v in value.items() if k in cls.model_fields})
        except ValidationError:
            pass
    return cls() if default is ... else default


# ------------------------------------------------------------------------------- CLI
def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pagedserve worker", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory or .gguf file")
    ap.add_argument("--worker-id", default=None, help="consumer name (default: host-pid)")
    ap.add_argument("--redis", default=None, help="Redis URL (default: $PAGEDSERVE_REDIS_URL)")
    ap.add_argument("--prefix", default=None, help="key prefix (default: $PAGEDSERVE_PREFIX/ps)")
    e = ap.add_argument_group("engine")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-kv-blocks", type=int, default=None)
    e.add_argument("--kv-cache-memory", type=_size, default=None, help="bytes, e.g. 512MB")
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=2048)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--dtype", default="float32")
    e.add_argument("--device", default="cpu")
    e.add_argument("--num-threads", type=int, default=None)
    e.add_argument("--no-prefix-caching", action="store_true")
    s = ap.add_argument_group("service")
    s.add_argument("--lease-ms", type=int, default=15_000)
    s.add_argument("--reclaim-ms", type=int, default=15_000)
    s.add_argument("--max-deliveries", type=int, default=3)
    s.add_argument("--grace-s", type=float, default=30.0)
    s.add_argument("--progress-interval-ms", type=float, default=50.0)
    s.add_argument("--log-level", default="INFO")
    return ap.parse_args(argv)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        device=args.device,
        enable_prefix_caching=not args.no_prefix_caching,
        num_threads=args.num_threads,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s worker: %(message)s",
        stream=sys.stderr,
    )
    cfg = ServiceConfig(
        worker_id=args.worker_id or f"{socket.gethostname()}-{os.getpid()}",
        redis_url=args.redis or default_url(),
        prefix=args.prefix or env_prefix(),
        lease_ms=args.lease_ms,
        reclaim_ms=args.reclaim_ms,
        max_deliveries=args.max_deliveries,
        grace_s=args.grace_s,
        progress_interval_s=args.progress_interval_ms / 1e3,
    )
    store = JobStore(
        cfg.redis_url,
        prefix=cfg.prefix,
        lease_ms=cfg.lease_ms,
        max_deliveries=cfg.max_deliveries,
    )
    from worker.engine import Engine

    engine = Engine(args.model, engine_config(args))
    worker = Worker(engine, store, cfg)
    signal.signal(signal.SIGTERM, worker.request_stop)
    signal.signal(signal.SIGINT, worker.request_stop)
    return worker.run()


if __name__ == "__main__":
    raise SystemExit(main())
