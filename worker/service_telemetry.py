"""The service loop's own counters (finished jobs, latency histograms, throughput window) and the
typed heartbeat it publishes (:class:`pagedserve.telemetry.WorkerHeartbeat`)."""

from __future__ import annotations

import collections
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from pagedserve.telemetry import (
    EngineTelemetry,
    Histogram,
    PrefixGroup,
    RunningJob,
    WorkerHeartbeat,
)
from worker.job_state import JobState

T = TypeVar("T")


@dataclass
class LoopClock:
    """Where the service loop's time goes: each iteration's wall time, split into the engine's
    steps, waits (for work, for a down Redis) and the rest, the loop's own service work.

    Why: at fast steps (a GPU, a small model) the service path's cost is that rest, and the
    ratio ``engine / offline wall`` tells a slower step (other threads and processes on the
    same cores) from loop overhead (``bench.service`` reads it from the heartbeat)."""

    total: float = 0.0  # finished iterations
    engine: float = 0.0
    #: The stepping thread's CPU time in those steps: ``engine - engine_cpu`` is time it spent
    #: off the CPU mid-step, waiting for the interpreter lock (the writer's and claimer's
    #: Python) or preempted (2.2% of the step time at ``bench.service --preset tiny``, against
    #: 0.15% offline). Not a phase: it is part of ``engine``. (On a GPU a step's wait for the
    #: device counts as CPU time where CUDA spins, as off the CPU where it blocks.)
    engine_cpu: float = 0.0
    idle: float = 0.0
    started: float | None = None  # perf_counter() at the start of the running iteration

    def step(self, engine_step: Callable[[], T]) -> T:
        """Run one engine step, counting its wall and thread CPU time."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return engine_step()
        finally:
            self.engine += time.perf_counter() - t0
            self.engine_cpu += time.thread_time() - c0

    def begin(self) -> None:
        self.started = time.perf_counter()

    def end(self) -> None:
        if self.started is not None:
            self.total += time.perf_counter() - self.started
            self.started = None

    def seconds(self) -> dict[str, float]:
        """Cumulative seconds by phase, the running iteration's so far included (a heartbeat
        is taken mid-iteration, after some of its engine or idle time was counted)."""
        total = self.total
        if self.started is not None:
            total += time.perf_counter() - self.started
        service = max(0.0, total - self.engine - self.idle)
        return {
            "engine": round(self.engine, 4),
            "service": round(service, 4),
            "idle": round(self.idle, 4),
        }


@dataclass
class ServiceTelemetry:
    throughput_window_s: float = 10.0
    started_at: float = field(default_factory=time.time)
    finished_counts: collections.Counter[str] = field(default_factory=collections.Counter)
    ttft: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)
    tokens_window: collections.deque[tuple[float, int]] = field(default_factory=collections.deque)

    def rate(self, tokens: int) -> float:
        """Output tokens per second over the last ``throughput_window_s``."""
        now = time.monotonic()
        self.tokens_window.append((now, tokens))
        while now - self.tokens_window[0][0] > self.throughput_window_s:
            self.tokens_window.popleft()
        t0, k0 = self.tokens_window[0]
        return (tokens - k0) / (now - t0) if now > t0 else 0.0

    def heartbeat(
        self,
        *,
        worker_id: str,
        model: str,
        state: str,
        engine: EngineTelemetry,
        jobs: Mapping[str, JobState],
        context: Mapping[str, int],
        prefixes: Sequence[PrefixGroup] = (),
        loop: LoopClock | None = None,
    ) -> WorkerHeartbeat:
        """The heartbeat: the engine's telemetry, this loop's counters and the model's context
        (``max_model_len`` / ``max_token_bytes``, :func:`worker.pretokenize.context_info`)."""
        return WorkerHeartbeat(
            worker_id=worker_id,
            model=model,
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=self.started_at,
            state=state,
            steps=engine.steps,
            running=engine.running,
            waiting=engine.waiting,
            tokens_generated=engine.tokens_generated,
            prompt_tokens=engine.prompt_tokens,
            throughput_tok_s=round(self.rate(engine.tokens_generated), 2),
            preemptions=engine.preemptions,
            jobs_finished=dict(self.finished_counts),
            prefix_cache=engine.prefix_cache,
            pool=engine.pool,
            jobs=[
                RunningJob(id=jid, tokens=st.tokens, max_tokens=st.max_tokens)
                for jid, st in jobs.items()
            ],
            prefixes=list(prefixes),
            time_to_first_token_seconds=self.ttft,
            e2e_request_latency_seconds=self.e2e,
            loop_seconds=loop.seconds() if loop is not None else {},
            engine_cpu_seconds=round(loop.engine_cpu, 4) if loop is not None else 0.0,
            **context,
        )
