"""The scheduler's settings, its counters, and the error for a request that can never run."""

from __future__ import annotations

from dataclasses import dataclass


class SequenceRejected(ValueError):
    """A request that can never run (e.g. its prompt cannot fit in the whole pool)."""


@dataclass(slots=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    #: Place sequences in windows of blocks to grow into (``BlockPool``'s class docstring).
    kv_windows: bool = True
    # Blocks kept free when admitting new work, so running sequences can grow without
    # immediately preempting each other.
    watermark: float = 0.01

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: int = 0
    num_steps: int = 0
    num_batched_tokens_total: int = 0
