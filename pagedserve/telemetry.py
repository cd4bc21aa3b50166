"""What a worker publishes in its heartbeat, and how the API reads it back.

Workers keep cumulative counters and histogram buckets (like Prometheus client libraries do) and
publish them every second under their heartbeat key; the API sums nothing itself, it labels every
series with the worker id, so a restarted worker shows up as a counter reset, which Prometheus
handles.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any

from pydantic import BaseModel, Field, ValidationError

log = logging.getLogger("pagedserve.telemetry")

#: Latency buckets in seconds (time to first token and end-to-end), shared by workers and the API.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0,
)  # fmt: skip

#: The heartbeat's block-state characters (``PoolSnapshot.block_states``): the wire format. The
#: engine's own codes are ``scheduler.block_pool.BlockState``; the two packages may not import each
#: other, so ``worker.engine`` maps one onto the other, by name, in a single table.
BLOCK_FREE, BLOCK_IN_USE, BLOCK_CACHED, BLOCK_SHARED = "0", "1", "2", "3"


class Histogram(BaseModel):
    """Cumulative: ``counts[i]`` observations <= ``buckets[i]``; ``count`` includes +Inf."""

    buckets: list[float] = Field(default_factory=lambda: list(LATENCY_BUCKETS))
    counts: list[int] = Field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    sum: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        for j in range(i, len(self.counts)):
            self.counts[j] += 1
        self.sum += value
        self.count += 1


class PoolSnapshot(BaseModel):
    num_blocks: int
    block_size: int
    free: int
    in_use: int
    cached: int  # free blocks still holding a reusable prefix
    shared: int  # blocks referenced by more than one sequence
    tokens_stored: int
    fragmentation_slots: int
    usage: float  # in_use / num_blocks
    # One character per block, in block-id order: 0 free, 1 in use, 2 cached, 3 shared.
    block_states: str = ""
    # What a block holds in memory (--kv-cache-dtype): "" / 0 from a worker that does not say.
    kv_cache_dtype: str = ""
    bytes_per_block: int = 0


class PrefixCacheSnapshot(BaseModel):
    queried_tokens: int = 0
    hit_tokens: int = 0
    queried_blocks: int = 0
    hit_blocks: int = 0
    hit_rate: float = 0.0
    moved_blocks: int = 0  # prefixes moved so that a table could grow in place (block copies)


class PrefixGroup(BaseModel):
    """One prefix group a worker has served (``worker.admission``): what its cache holds of it."""

    signature: str  # pagedserve.prefix_sig signature
    owned: bool = False  # this worker holds the group's affinity
    warming: bool = False  # its first job's prefill is not done yet
    blocks: int = 0  # KV blocks of the group's shared prefix cached now
    jobs: int = 0  # jobs of the group finished here
    hits: int = 0  # of which found a cached prefix
    hit_tokens: int = 0  # prompt tokens served from the cache, over those jobs
    prompt_tokens: int = 0
    running: int = 0


class RunningJob(BaseModel):
    id: str
    tokens: int  # generated so far (all completions of the job together)
    max_tokens: int | None = None


class EngineTelemetry(BaseModel):
    """What the engine reports to the service loop each heartbeat (``Engine.heartbeat_stats``)."""

    steps: int = 0
    running: int = 0
    waiting: int = 0
    tokens_generated: int = 0  # cumulative output tokens
    prompt_tokens: int = 0  # cumulative prompt tokens computed
    preemptions: int = 0
    throughput_tok_s: float = 0.0  # the engine's own rate over its last ~10 s of steps
    prefix_cache: PrefixCacheSnapshot = Field(default_factory=PrefixCacheSnapshot)
    pool: PoolSnapshot | None = None


class WorkerHeartbeat(BaseModel):
    """Published by ``store.heartbeat(worker_id, hb.model_dump())`` about once a second."""

    worker_id: str
    model: str
    host: str = ""
    pid: int = 0
    started_at: float = 0.0
    state: str = "serving"  # serving | draining | reconnecting
    steps: int = 0
    running: int = 0
    waiting: int = 0
    tokens_generated: int = 0  # cumulative output tokens
    prompt_tokens: int = 0  # cumulative prompt tokens computed
    throughput_tok_s: float = 0.0  # output tokens per second over the last ~10 s
    preemptions: int = 0
    jobs_finished: dict[str, int] = Field(default_factory=dict)  # final status -> count
    prefix_cache: PrefixCacheSnapshot = Field(default_factory=PrefixCacheSnapshot)
    pool: PoolSnapshot | None = None
    jobs: list[RunningJob] = Field(default_factory=list)
    # Prefix-aware admission: the groups this worker serves or served lately, most recent first
    # (at most 64: worker.admission.MAX_GROUPS).
    prefixes: list[PrefixGroup] = Field(default_factory=list)
    time_to_first_token_seconds: Histogram = Field(default_factory=Histogram)
    e2e_request_latency_seconds: Histogram = Field(default_factory=Histogram)
    # The service loop's cumulative seconds by phase (``worker.service_telemetry.LoopClock``):
    # ``engine`` in engine steps, ``service`` in its own work (claims, admission, heartbeats,
    # progress and results handed to the writer), ``idle`` waiting for work or for Redis.
    loop_seconds: dict[str, float] = Field(default_factory=dict)
    # The stepping thread's CPU time in the engine's steps (part of ``loop_seconds["engine"]``;
    # the difference is time off the CPU mid-step: the interpreter lock, preemption).
    engine_cpu_seconds: float = Field(default=0.0, ge=0)
    # The served model's context, for the API's length check (``api.jobs.check_context``):
    # ``worker.pretokenize.context_info``. ``max_token_bytes``: most UTF-8 bytes one token of the
    # vocabulary stands for (None: no tokenizer, text cannot be bounded).
    max_model_len: int | None = Field(default=None, gt=0)
    max_token_bytes: int | None = Field(default=None, gt=0)

    @classmethod
    def parse_published(cls, fields: dict[str, Any]) -> WorkerHeartbeat | None:
        """Read back what ``JobStore.workers()`` returns for one worker; a malformed heartbeat is
        logged with the validation error and read as None (the worker counts as not live)."""
        try:
            return cls.model_validate({k: v for k, v in fields.items() if k in cls.model_fields})
        except ValidationError as exc:
            wid = fields.get("worker_id", "?")
            log.warning("malformed heartbeat of worker %r ignored: %s", wid, exc)
            return None
