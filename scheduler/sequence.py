"""Per-sequence state: tokens, progress, block table and the stop conditions checked per step."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from scheduler.block_pool import BlockHash, hash_block


class Priority(enum.IntEnum):
    """Lower value runs first. Interactive work may preempt bulk work."""

    INTERACTIVE = 0
    BULK = 1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or (from the detokenizer) a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"


@dataclass(slots=True)
class StopConditions:
    max_tokens: int
    min_tokens: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False


@dataclass(slots=True, eq=False)
class Sequence:
    """One stream of tokens with its own block table (a request with n>1 owns n of them)."""

    seq_id: int
    request_id: str
    token_ids: list[int]
    prompt_len: int
    stop: StopConditions
    priority: int = Priority.INTERACTIVE
    arrival: int = 0
    cache_salt: str | None = None
    max_model_len: int = 1 << 30
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed: int = 0  # tokens whose keys/values are in the cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)  # full blocks of token_ids
    num_registered: int = 0  # leading full blocks already offered to the prefix cache
    synced_blocks: int = 0  # leading table entries the model runner already holds
    #: Blocks ``[start, end)`` reserved for this table to grow into (``BlockPool``'s windows).
    kv_window: tuple[int, int] = (0, 0)
    admitted_once: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int, int]:
        return (self.priority, self.arrival, self.seq_id)

    def full_block_hashes(self, num_blocks: int, block_size: int) -> list[BlockHash]:
        """Hashes of the first ``num_blocks`` full blocks, extending the memo as tokens grow."""
        hashes = self.block_hashes
        tokens = self.token_ids
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(
                hash_block(parent, tokens[i * block_size : (i + 1) * block_size], self.cache_salt)
            )
        return hashes

    def check_stop(self, token: int) -> FinishReason | None:
        """Stop conditions after ``token`` was appended (string stops belong to the detokenizer)."""
        stop = self.stop
        produced = len(self.token_ids) - self.prompt_len
        if produced >= stop.min_tokens and (
            (not stop.ignore_eos and token in stop.eos_token_ids) or token in stop.stop_token_ids
        ):
            return FinishReason.STOP
        if produced >= stop.max_tokens or len(self.token_ids) >= self.max_model_len:
            return FinishReason.LENGTH
        return None
