"""What the scheduler hands the model runner each step (its only input) and postprocess returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.sequence import FinishReason, Sequence


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of a step.

    The runner keeps every sequence's block table between steps; the scheduler sends only what
    changed: entries from index ``block_offset`` on are replaced by ``new_block_ids`` (a sequence
    new to the runner, or resumed after preemption, has ``block_offset == 0``; a copy-on-write
    replaces an entry in place by restarting at that index).
    """

    seq_id: int
    request_id: str
    token_ids: list[int]  # tokens whose keys/values are computed this step
    start_pos: int  # position of token_ids[0]
    block_offset: int
    new_block_ids: list[int]
    slot_mapping: list[int]  # one cache slot per token of token_ids
    sample: bool  # the step reaches the sequence's last token: its logits are needed

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    # (source block, destination block) copies to perform before the forward pass.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Sequences whose tables the runner must drop (finished, aborted or preempted since last step).
    released_seq_ids: list[int] = field(default_factory=list)
    preempted_seq_ids: list[int] = field(default_factory=list)
    num_batched_tokens: int = 0


@dataclass(slots=True)
class TokenUpdate:
    """What postprocess did with one sampled token."""

    seq: Sequence
    token_id: int
    finish_reason: FinishReason | None
