"""The engine's counters and its typed telemetry (:class:`pagedserve.telemetry.EngineTelemetry`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedserve.telemetry import (
    BLOCK_CACHED,
    BLOCK_FREE,
    BLOCK_IN_USE,
    BLOCK_SHARED,
    EngineTelemetry,
    PoolSnapshot,
    PrefixCacheSnapshot,
)
from scheduler.block_pool import BlockState, PoolOccupancy
from scheduler.output import SchedulerOutput
from scheduler.scheduler import Scheduler

# The scheduler's block-state bytes -> the heartbeat's block-state characters. The two packages may
# not import each other, so this table, matched by name, is the one place the codes meet.
_WIRE_BLOCK_STATES = bytes.maketrans(
    bytes([BlockState.FREE, BlockState.IN_USE, BlockState.CACHED, BlockState.SHARED]),
    (BLOCK_FREE + BLOCK_IN_USE + BLOCK_CACHED + BLOCK_SHARED).encode("ascii"),
)

#: Seconds of recent steps the engine's own throughput is measured over.
RATE_WINDOW_S = 10.0


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    steps: int = 0
    preemptions: int = 0
    tokens_generated: int = 0
    prompt_tokens: int = 0
    requests_finished: int = 0
    prefix_cache: dict[str, float] = field(default_factory=dict)
    tokens_per_second: float = 0.0


@dataclass
class StatsKeeper:
    """Counts each step's tokens and reads the scheduler's gauges on demand."""

    stats: EngineStats = field(default_factory=EngineStats)
    recent: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) of steps

    def account(self, out: SchedulerOutput) -> None:
        st = self.stats
        st.steps += 1
        sampled = sum(1 for s in out.scheduled if s.sample)
        st.tokens_generated += sampled
        st.prompt_tokens += out.num_batched_tokens - sampled
        now = time.monotonic()
        self.recent.append((now, sampled))
        while self.recent and now - self.recent[0][0] > RATE_WINDOW_S:
            self.recent.pop(0)

    def read(self, s: Scheduler) -> EngineStats:
        st = self.stats
        st.running = s.num_running
        st.waiting = s.num_waiting
        st.preemptions = s.stats.num_preemptions
        st.prefix_cache = prefix_cache_snapshot(s).model_dump()
        if len(self.recent) >= 2:
            span = self.recent[-1][0] - self.recent[0][0]
            st.tokens_per_second = sum(t for _, t in self.recent[1:]) / span if span > 0 else 0.0
        return st

    def telemetry(
        self, s: Scheduler, kv_cache_dtype: str = "", bytes_per_block: int = 0
    ) -> EngineTelemetry:
        """Counters and the pool snapshot; the cache's dtype and bytes per block as given."""
        st = self.read(s)
        return EngineTelemetry(
            running=st.running,
            waiting=st.waiting,
            steps=st.steps,
            tokens_generated=st.tokens_generated,
            prompt_tokens=st.prompt_tokens,
            preemptions=st.preemptions,
            throughput_tok_s=st.tokens_per_second,
            prefix_cache=prefix_cache_snapshot(s),
            pool=pool_snapshot(s.occupancy(), kv_cache_dtype, bytes_per_block),
        )


def prefix_cache_snapshot(s: Scheduler) -> PrefixCacheSnapshot:
    ps = s.prefix_cache_stats()
    return PrefixCacheSnapshot(
        queried_tokens=ps.queried_tokens,
        hit_tokens=ps.hit_tokens,
        queried_blocks=ps.queried_blocks,
        hit_blocks=ps.hit_blocks,
        hit_rate=ps.hit_rate,
        moved_blocks=ps.moved_blocks,
    )


def pool_snapshot(
    occ: PoolOccupancy, kv_cache_dtype: str = "", bytes_per_block: int = 0
) -> PoolSnapshot:
    return PoolSnapshot(
        num_blocks=occ.num_blocks,
        block_size=occ.block_size,
        free=occ.free,
        in_use=occ.in_use,
        cached=occ.cached_evictable,
        shared=occ.shared,
        tokens_stored=occ.tokens_stored,
        fragmentation_slots=occ.fragmentation_slots,
        usage=occ.usage,
        block_states=occ.block_states.translate(_WIRE_BLOCK_STATES).decode("ascii"),
        kv_cache_dtype=kv_cache_dtype,
        bytes_per_block=bytes_per_block,
    )
